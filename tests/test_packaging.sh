#!/bin/bash
# Packaging test (TAP): the generated systemd units, `systemd-analyze verify`
# on them, a staged `meson install --destdir` (units, sysusers/tmpfiles, man
# pages, and the YAML at DESTDIR/etc/ds41d/ds41d.yaml whatever the prefix),
# systemd-sysusers/-tmpfiles on the staged files, and a lint of the man pages.
#
# systemd-analyze verify works without a booted systemd (it loads the unit
# files offline); --man=yes makes it run man(1) on every Documentation= page,
# pointed at the staged man pages with MANPATH.  Verify needs ExecStart= to
# name an existing executable: the copies verified point at the built ds41d
# when it exists, else at another built program or /bin/true (noted below).
set -u
build=${DS41_BUILD_DIR:?DS41_BUILD_DIR must name the build tree}
src=${DS41_SOURCE_DIR:-$(pwd)}
n=0
failed=0
ok() { n=$((n + 1)); echo "ok $n - $*"; }
not_ok() { n=$((n + 1)); failed=1; echo "not ok $n - $*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else not_ok "$what"; fi; }
skip() { n=$((n + 1)); echo "ok $n - skipped # SKIP $*"; }
note() { echo "# $*"; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
py=/usr/bin/python3
[ -x "$py" ] || py=python3

service=$build/packaging/ds41d.service
socket=$build/packaging/ds41d.socket

# ---- the generated units -----------------------------------------------------
check "the units are generated into the build tree" test -f "$service" -a -f "$socket"
check "no @placeholder@ is left in the units" bash -c "! grep -n '@[a-z_]*@' '$service' '$socket'"

# install_dir BUILDDIR OPTION: a directory option of a meson build directory ("bindir",
# "datadir", "prefix"), joined to its prefix.
install_dir() {
    "$py" - "$1" "$2" <<'EOF'
import json, os, sys
opts = {o["name"]: o["value"] for o in json.load(open(os.path.join(sys.argv[1], "meson-info", "intro-buildoptions.json")))}
print(os.path.join(opts["prefix"], opts[sys.argv[2]]))
EOF
}
bindir=$(install_dir "$build" bindir)
check "ExecStart runs $bindir/ds41d with the default config" \
    grep -qx "ExecStart=$bindir/ds41d --config /etc/ds41d/ds41d.yaml" "$service"

missing=""
for line in Type=notify NotifyAccess=main WatchdogSec=30s User=ds41 Group=ds41 NoNewPrivileges=yes \
            ProtectSystem=strict ProtectHome=yes PrivateTmp=yes StateDirectory=ds41d RuntimeDirectory=ds41d \
            RuntimeDirectoryPreserve=yes LimitMEMLOCK=infinity 'ExecReload=/bin/kill -HUP $MAINPID' \
            Restart=on-failure TimeoutStopSec=60s; do
    grep -qxF "$line" "$service" || missing="$missing [$line]"
done
check "the service has the issue's settings (missing:${missing:- none})" test -z "$missing"
missing=""
for line in ListenStream=/run/ds41d/ds41d.sock SocketMode=0660 SocketGroup=ds41 WantedBy=sockets.target; do
    grep -qxF "$line" "$socket" || missing="$missing [$line]"
done
check "the socket unit listens on /run/ds41d/ds41d.sock, 0660, group ds41 (missing:${missing:- none})" test -z "$missing"

# ---- staged install ----------------------------------------------------------
dest=$work/dest
if meson install -C "$build" --destdir "$dest" --no-rebuild >"$work/install.log" 2>&1; then
    ok "meson install --destdir succeeds"
else
    not_ok "meson install --destdir succeeds"
    sed 's/^/# /' "$work/install.log" | tail -20
fi
check "the default YAML is installed at DESTDIR/etc/ds41d/ds41d.yaml, unchanged" \
    cmp -s "$dest/etc/ds41d/ds41d.yaml" "$src/packaging/ds41d.yaml"

datadir=$(install_dir "$build" datadir)
check "the packaged default is also kept at DESTDIR$datadir/ds41d/ds41d.yaml" \
    cmp -s "$dest$datadir/ds41d/ds41d.yaml" "$src/packaging/ds41d.yaml"
# The configuration is a conffile: a second install over an edited file keeps the edit.
sed -i 's/^  max_queue: 256$/  max_queue: 77  # edited by the operator/' "$dest/etc/ds41d/ds41d.yaml"
cp "$dest/etc/ds41d/ds41d.yaml" "$work/edited.yaml"
if meson install -C "$build" --destdir "$dest" --no-rebuild >"$work/install2.log" 2>&1; then
    check "a second meson install keeps the edited DESTDIR/etc/ds41d/ds41d.yaml" \
        bash -c "grep -q 'max_queue: 77  # edited' '$dest/etc/ds41d/ds41d.yaml' && cmp -s '$work/edited.yaml' '$dest/etc/ds41d/ds41d.yaml'"
else
    not_ok "a second meson install succeeds"
    sed 's/^/# /' "$work/install2.log" | tail -20
fi
# A relative DESTDIR: the config goes where meson puts its own files (the man page's DESTDIR).
if (cd "$work" && meson install -C "$build" --destdir reldest --no-rebuild >"$work/install3.log" 2>&1); then
    man8=$(find "$work/reldest" "$build/reldest" -name ds41d.8 -path '*/man8/*' 2>/dev/null | head -1)
    reldest=${man8%/share/man/man8/ds41d.8}
    reldest=${reldest%"$(dirname "$datadir")"}
    check "meson install with a relative --destdir installs the config in the same DESTDIR (${reldest:-?})" \
        cmp -s "$reldest/etc/ds41d/ds41d.yaml" "$src/packaging/ds41d.yaml"
    rm -rf "$build/reldest"
else
    not_ok "meson install with a relative --destdir succeeds"
    sed 's/^/# /' "$work/install3.log" | tail -20
fi

# Where meson says each packaging file goes; every one must be in DESTDIR.
meson introspect "$build" --installed >"$work/installed.json" 2>/dev/null
"$py" - "$work/installed.json" >"$work/dests" <<'EOF'
import json, os, sys
installed = json.load(open(sys.argv[1]))
for src, dst in sorted(installed.items()):
    print(os.path.basename(src), dst)
EOF
dest_of() { awk -v f="$1" '$1 == f { print $2; exit }' "$work/dests"; }
unitdir=$(pkg-config --variable=systemdsystemunitdir systemd 2>/dev/null)
unitdir=${unitdir:-/usr/lib/systemd/system}
missing=""
for f in ds41d.service ds41d.socket; do
    d=$(dest_of "$f")
    [ "$d" = "$unitdir/$f" ] && cmp -s "$dest$d" "$build/packaging/$f" || missing="$missing $f->${d:-?}"
done
check "the units are installed into systemd's unit directory $unitdir (wrong:${missing:- none})" test -z "$missing"
sysusersdir=$(pkg-config --variable=sysusersdir systemd 2>/dev/null)
tmpfilesdir=$(pkg-config --variable=tmpfilesdir systemd 2>/dev/null)
sysusers=$dest${sysusersdir:-/usr/lib/sysusers.d}/ds41d.conf
tmpfiles=$dest${tmpfilesdir:-/usr/lib/tmpfiles.d}/ds41d.conf
check "sysusers.d and tmpfiles.d files are installed" test -f "$sysusers" -a -f "$tmpfiles"
mandir=""
missing=""
for page in ds41d.8 ds41ctl.1 ds41d.yaml.5; do
    d=$(dest_of "$page")
    if [ -n "$d" ] && [ -f "$dest$d" ]; then mandir=$(dirname "$(dirname "$dest$d")"); else missing="$missing $page"; fi
done
check "the man pages ds41d(8), ds41ctl(1), ds41d.yaml(5) are installed (missing:${missing:- none})" test -z "$missing"

# ---- systemd-analyze verify ---------------------------------------------------
if command -v systemd-analyze >/dev/null; then
    exe=""
    for cand in "$build/daemon/ds41d" "$build"/daemon/ds41-*; do
        if [ -f "$cand" ] && [ -x "$cand" ]; then exe=$cand; break; fi
    done
    if [ -z "$exe" ]; then
        exe=/bin/true
        note "ds41d is not built yet: ExecStart points at $exe for verify"
    else
        note "ExecStart points at $exe for verify"
    fi
    units=$work/units
    mkdir -p "$units"
    sed "s|^ExecStart=[^ ]*|ExecStart=$exe|" "$service" >"$units/ds41d.service"
    cp "$socket" "$units/ds41d.socket"
    (cd "$units" && MANPATH=$mandir SYSTEMD_LOG_LEVEL=notice \
        systemd-analyze verify --man=yes ./ds41d.service ./ds41d.socket) >"$work/verify.log" 2>&1
    rc=$?
    # Any message about our units (unknown keys are only warnings) fails too.
    if [ $rc -eq 0 ] && ! grep -q 'ds41d' "$work/verify.log"; then
        ok "systemd-analyze verify accepts ds41d.service and ds41d.socket (with their man pages)"
    else
        not_ok "systemd-analyze verify accepts ds41d.service and ds41d.socket (rc $rc)"
        sed 's/^/# /' "$work/verify.log"
    fi
    # The check can fail: a unit with a missing binary and an unknown key.
    sed -e "s|^ExecStart=[^ ]*|ExecStart=/nonexistent/ds41d|" -e 's/^Type=notify$/Type=notify\nBogusSetting=1/' \
        "$service" >"$units/broken.service"
    (cd "$units" && systemd-analyze verify --man=no ./broken.service) >"$work/broken.log" 2>&1
    rc=$?
    check "verify rejects a broken copy (missing ExecStart binary, unknown key)" \
        test $rc -ne 0 -a -n "$(grep -l 'BogusSetting' "$work/broken.log")"
    if systemd-analyze security --help 2>/dev/null | grep -q -- '--offline'; then
        level=$(cd "$units" && systemd-analyze security --offline=true ./ds41d.service 2>/dev/null |
                sed -n 's/.*Overall exposure level for ds41d.service: \([0-9.]*\).*/\1/p')
        check "systemd-analyze security rates the service's exposure below 5 (got ${level:-?})" \
            "$py" -c "import sys; sys.exit(0 if '$level' and float('$level') < 5.0 else 1)"
    else
        skip "systemd-analyze security --offline is not available"
    fi
else
    skip "systemd-analyze is not installed (Debian: systemd)"
    skip "systemd-analyze is not installed"
    skip "systemd-analyze is not installed"
fi

# ---- sysusers / tmpfiles on the staged files -----------------------------------
root=$work/root
mkdir -p "$root/etc"
if command -v systemd-sysusers >/dev/null; then
    systemd-sysusers --root="$root" "$sysusers" >"$work/sysusers.log" 2>&1
    check "systemd-sysusers creates user ds41 and groups ds41, ds41-admin" \
        bash -c "grep -q '^ds41:x:[0-9]*:[0-9]*:.*:/var/lib/ds41d:' '$root/etc/passwd' &&
                 grep -q '^ds41:x:' '$root/etc/group' && grep -q '^ds41-admin:x:' '$root/etc/group'"
    if [ "$(id -u)" = 0 ] && command -v systemd-tmpfiles >/dev/null; then
        systemd-tmpfiles --create --root="$root" "$tmpfiles" >"$work/tmpfiles.log" 2>&1
        uid=$(awk -F: '$1 == "ds41" { print $3 }' "$root/etc/passwd")
        check "systemd-tmpfiles creates /run/ds41d (0755) and /var/lib/ds41d (0750) owned by ds41" \
            bash -c "[ \"\$(stat -c '%a %u' '$root/run/ds41d')\" = '755 $uid' ] &&
                     [ \"\$(stat -c '%a %u' '$root/var/lib/ds41d')\" = '750 $uid' ]"
    else
        skip "systemd-tmpfiles --root needs root (to chown) and systemd-tmpfiles"
    fi
else
    skip "systemd-sysusers is not installed"
    skip "systemd-sysusers is not installed"
fi

# ---- packaging/README.md's install commands work after the quick start --------------
# The quick start (.ci/demo, README's "Building") has set up `build` with the default prefix.
# Run the README's `meson setup`/`meson configure` commands after that (build directories
# moved under $work) and check that the directory its `meson install -C DIR` installs from
# has prefix /usr, as the units and the text say.
"$py" - "$src/packaging/README.md" "$work/rd" >"$work/readme.cmds" <<'EOF'
import re, shlex, sys
text = open(sys.argv[1], encoding="utf-8").read()
block = re.search(r"## Install and start\s+```sh\n(.*?)```", text, re.S).group(1)
for line in block.splitlines():
    for cmd in line.split("#")[0].split("&&"):
        words = shlex.split(cmd)
        words = [w for w in words if w != "sudo"]
        if words[:2] in (["meson", "setup"], ["meson", "configure"], ["meson", "install"]):
            words = [sys.argv[2] + "/" + w if re.fullmatch(r"build[-\w]*", w) else w for w in words]
            print(shlex.join(words))
EOF
readme_build=$(sed -n 's/^meson install -C \([^ ]*\).*/\1/p' "$work/readme.cmds" | head -1)
mkdir -p "$work/rd"
rdok=y
(cd "$src" && meson setup "$work/rd/build" >"$work/rd.log" 2>&1) || rdok=n
while read -r line; do
    case $line in "meson install"*) continue ;; esac
    (cd "$src" && eval "$line") >>"$work/rd.log" 2>&1 || rdok=n
done <"$work/readme.cmds"
rdprefix=$(install_dir "$readme_build" prefix 2>/dev/null)
check "packaging/README.md's commands after the quick start install from a /usr build (got ${rdprefix:-?})" \
    test "$rdok:$rdprefix" = "y:/usr"
[ "$rdok:$rdprefix" = "y:/usr" ] || sed 's/^/# /' "$work/readme.cmds" "$work/rd.log" | tail -20

# ---- man pages ---------------------------------------------------------------
if command -v groff >/dev/null; then
    bad=""
    for page in "$src"/packaging/ds41d.8 "$src"/packaging/ds41ctl.1 "$src"/packaging/ds41d.yaml.5; do
        out=$(LC_ALL=C.UTF-8 groff -man -ww -z -Tutf8 "$page" 2>&1)
        [ -z "$out" ] || { bad="$bad $(basename "$page")"; echo "$out" | sed 's/^/# /'; }
    done
    check "the man pages format without groff warnings (bad:${bad:- none})" test -z "$bad"
else
    skip "groff is not installed"
fi

echo "1..$n"
exit $failed
