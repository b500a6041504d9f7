#!/bin/bash
# The Debian package end to end (TAP; meson -Ddeb_tests=true, see
# packaging/README.md): packaging/build-deb.sh builds ds41_*.deb from a clean
# copy of the tree, lintian finds no error in it, it installs on this machine
# (apt-get install ./ds41_*.deb), every file is in place and owned by the
# package, /etc/ds41d/ds41d.yaml is a conffile, the postinst created the ds41
# user and groups and the directories, the units are enabled and pass
# `systemd-analyze verify` where they are installed, the installed programs
# run; then `apt-get purge` removes the files, the conffile, the state
# directory and the unit links.
#
# It changes the machine (it installs a package), so it needs root and a
# machine where ds41 is not installed already: otherwise it skips, saying why.
# A ds41 user the test's install created is removed at the end (Debian's purge
# keeps system users on purpose).
set -u
src=${DS41_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
n=0
failed=0
ok() { n=$((n + 1)); echo "ok $n - $*"; }
not_ok() { n=$((n + 1)); failed=1; echo "not ok $n - $*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else not_ok "$what"; fi; }
note() { echo "# $*"; }
skip_all() { echo "1..0 # SKIP $*"; exit 0; }

[ "$(id -u)" = 0 ] || skip_all "needs root (installs and purges the ds41 package on this machine)"
command -v dpkg >/dev/null && command -v apt-get >/dev/null || skip_all "not a Debian system (no dpkg/apt-get)"
if dpkg-query -W -f='${Status}' ds41 2>/dev/null | grep -qv 'not-installed'; then
    skip_all "the ds41 package is installed on this machine already; the test would purge it"
fi
for f in /usr/bin/ds41d /etc/ds41d/ds41d.yaml /var/lib/ds41d /run/ds41d; do
    [ ! -e "$f" ] || skip_all "$f exists (an install outside dpkg?); the package would take it over and its purge remove it"
done

# One run at a time on a machine: two would install and purge the same package.
exec 9>/run/lock/ds41-packaging-deb.lock && flock 9

export DEBIAN_FRONTEND=noninteractive
missing=()
for p in debhelper dpkg-dev lintian fakeroot; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    note "installing ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >/dev/null 2>&1
fi
for t in dpkg-buildpackage dh lintian; do
    command -v "$t" >/dev/null || skip_all "$t is missing and could not be installed (apt-get install debhelper dpkg-dev lintian)"
done

work=$(mktemp -d /tmp/ds41-debtest-XXXXXX)
user_before=$(getent passwd ds41 || true)
groups_before=$(getent group ds41-admin ds41 || true)
cleanup() {
    if dpkg-query -W -f='${Status}' ds41 2>/dev/null | grep -qv 'not-installed'; then
        apt-get purge -y -qq ds41 >/dev/null 2>&1 || dpkg --purge ds41 >/dev/null 2>&1
    fi
    if [ -z "$user_before" ] && getent passwd ds41 >/dev/null; then userdel ds41 2>/dev/null; fi
    # The state and runtime directories were absent when the test began (a failed purge leaves them).
    rm -rf /var/lib/ds41d /run/ds41d
    if [ -z "$groups_before" ]; then
        getent group ds41-admin >/dev/null && groupdel ds41-admin 2>/dev/null
        getent group ds41 >/dev/null && groupdel ds41 2>/dev/null
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# ---- build -------------------------------------------------------------------
if bash "$src/packaging/build-deb.sh" "$work/out" >"$work/build.log" 2>&1; then
    ok "packaging/build-deb.sh builds the package (dpkg-buildpackage -b -us -uc)"
else
    not_ok "packaging/build-deb.sh builds the package"
    tail -40 "$work/build.log" | sed 's/^/# /'
    echo "1..$n"
    exit 1
fi
deb=$(ls "$work"/out/ds41_*.deb 2>/dev/null | head -1)
version=$(sed -n "s/^ *version *: *'\([^']*\)'.*/\1/p" "$src/meson.build" | head -1)
check "the .deb is left in the output directory, at the project's version $version ($(basename "${deb:-none}"))" \
    bash -c "[[ \$(basename '$deb') == ds41_${version}_*.deb ]]"
check "the quick test subset ran during the build (dh_auto_test)" \
    grep -q 'Ok: *[1-9]' "$work/build.log"

# ---- lintian -----------------------------------------------------------------
# lintian exits non-zero on an error (its default --fail-on) or when it cannot check the package.
lintian --tag-display-limit 0 "$deb" "$work"/out/ds41_*.changes >"$work/lintian.log" 2>&1
rc=$?
errors=$(grep -c '^E: ' "$work/lintian.log")
check "lintian reports no errors on the package (exit $rc, $errors errors, $(grep -c '^W: ' "$work/lintian.log") warnings)" \
    test "$rc:$errors" = 0:0
grep -v "root privileges" "$work/lintian.log" | sed "s/^/# lintian: /" | head -40

# ---- install -----------------------------------------------------------------
if apt-get install -y -qq --no-install-recommends "$deb" >"$work/install.log" 2>&1; then
    ok "apt-get install ./$(basename "$deb") succeeds"
else
    not_ok "apt-get install ./$(basename "$deb") succeeds"
    tail -30 "$work/install.log" | sed 's/^/# /'
fi
dpkg -L ds41 >"$work/owned" 2>/dev/null
unitdir=$(dirname "$(grep -m1 '/systemd/system/ds41d.service$' "$work/owned")")
files=(/usr/bin/ds41d /usr/bin/ds41ctl /usr/bin/ds41-eval /usr/bin/ds41-bench /usr/bin/ds41-generate
       /usr/bin/ds41-mkmodel /usr/bin/ds41-inspect /usr/bin/ds41-tokenize
       "$unitdir/ds41d.service" "$unitdir/ds41d.socket"
       /usr/lib/sysusers.d/ds41d.conf /usr/lib/tmpfiles.d/ds41d.conf
       /etc/ds41d/ds41d.yaml /usr/share/ds41d/ds41d.yaml /usr/share/doc/ds41/copyright
       /usr/share/man/man8/ds41d.8.gz /usr/share/man/man5/ds41d.yaml.5.gz /usr/share/man/man1/ds41ctl.1.gz)
for t in eval bench generate mkmodel inspect tokenize; do files+=("/usr/share/man/man1/ds41-$t.1.gz"); done
bad=""
for f in "${files[@]}"; do
    [ -f "$f" ] && grep -qxF "$f" "$work/owned" || bad="$bad $f"
done
check "the ${#files[@]} programs, units, sysusers/tmpfiles files, configuration and man pages are installed and owned by ds41 (missing:${bad:- none})" \
    test -z "$bad"
check "the programs are executable" bash -c 'for f in /usr/bin/ds41d /usr/bin/ds41ctl /usr/bin/ds41-*; do [ -x "$f" ] || exit 1; done'
check "/etc/ds41d/ds41d.yaml is a conffile, the packaged default" \
    bash -c "dpkg-query -W -f='\${Conffiles}' ds41 | grep -q '^ */etc/ds41d/ds41d.yaml ' &&
             cmp -s /etc/ds41d/ds41d.yaml '$src/packaging/ds41d.yaml'"
out=$(/usr/bin/ds41d --version 2>&1)
check "the installed ds41d --version runs: '$out'" test "$out" = "ds41d $version"
out=$(/usr/bin/ds41-mkmodel --version 2>&1)
check "the installed tools run: '$out'" test "$out" = "ds41-mkmodel $version"

# ---- user, groups, directories, units ------------------------------------------
if [ -n "$user_before" ]; then note "user ds41 existed before the install: the check shows it is still there"; fi
check "the postinst created user ds41 (home /var/lib/ds41d) and groups ds41, ds41-admin" \
    bash -c "getent passwd ds41 | grep -q '^ds41:x:[0-9]*:[0-9]*:.*:/var/lib/ds41d:' &&
             getent group ds41 >/dev/null && getent group ds41-admin >/dev/null"
check "the postinst created /var/lib/ds41d (0750) and /run/ds41d (0755) owned by ds41" \
    bash -c "[ \"\$(stat -c '%a %U %G' /var/lib/ds41d)\" = '750 ds41 ds41' ] &&
             [ \"\$(stat -c '%a %U %G' /run/ds41d)\" = '755 ds41 ds41' ]"
check "ds41d.service and ds41d.socket are enabled (multi-user.target, sockets.target)" \
    test -L /etc/systemd/system/multi-user.target.wants/ds41d.service -a \
         -L /etc/systemd/system/sockets.target.wants/ds41d.socket
if command -v systemd-analyze >/dev/null; then
    SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=yes "$unitdir/ds41d.service" "$unitdir/ds41d.socket" \
        >"$work/verify.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && ! grep -q ds41d "$work/verify.log"; then
        ok "systemd-analyze verify accepts the installed $unitdir/ds41d.service and ds41d.socket (ExecStart, man pages)"
    else
        not_ok "systemd-analyze verify accepts the installed units (rc $rc)"
        sed 's/^/# /' "$work/verify.log"
    fi
else
    not_ok "systemd-analyze is installed (Debian: systemd)"
fi
/usr/bin/ds41d --config /etc/ds41d/ds41d.yaml --check-config >"$work/check.log" 2>&1
rc=$?
check "ds41d --check-config accepts the installed /etc/ds41d/ds41d.yaml (rc $rc)" test $rc = 0
[ $rc = 0 ] || sed 's/^/# /' "$work/check.log" | tail -10

# ---- purge -------------------------------------------------------------------
# What a running daemon leaves in its state directory (a snapshot) goes with the purge too.
mkdir -p /var/lib/ds41d/snapshots && echo x >/var/lib/ds41d/snapshots/left-by-ds41d
if apt-get purge -y -qq ds41 >"$work/purge.log" 2>&1; then
    ok "apt-get purge ds41 succeeds"
else
    not_ok "apt-get purge ds41 succeeds"
    tail -20 "$work/purge.log" | sed 's/^/# /'
fi
check "dpkg knows ds41 no more" bash -c "! dpkg-query -W -f='\${Status}' ds41 2>/dev/null | grep -qv 'not-installed'"
left=""
for f in "${files[@]}" /etc/ds41d /var/lib/ds41d /run/ds41d \
         /etc/systemd/system/multi-user.target.wants/ds41d.service /etc/systemd/system/sockets.target.wants/ds41d.socket; do
    [ -e "$f" ] || [ -L "$f" ] && left="$left $f"
done
check "the purge removed every file, the conffile, /etc/ds41d, the state and runtime directories and the unit links (left:${left:- none})" \
    test -z "$left"
echo "1..$n"
exit $failed
