#!/bin/bash
# Help texts and man pages against the binaries, so that drift fails a test:
#  - every tool prints the project version (meson.build) for --version;
#  - every command and option ds41ctl --help names is in ds41ctl(1), and every command and option
#    ds41ctl(1) names is in ds41ctl --help;
#  - every file a tool's --help cites exists: in the source tree, in the install tree
#    (/etc/ds41d/NAME installed from packaging/NAME, runtime paths under a directory
#    packaging/tmpfiles.d creates, the kernel's /proc), or in a checkpoint as ds41-mkmodel writes
#    it (inference/config.json, tokenizer.json, ...).
# TAP.
set -u
bin=${DS41_BUILD_DIR:?DS41_BUILD_DIR not set}/daemon
src=$(cd "$(dirname "$0")/.." && pwd)
py=/usr/bin/python3
[ -x $py ] || py=python3
work=$(mktemp -d /tmp/ds41-help-XXXXXX)
trap 'rm -rf "$work"' EXIT
n=0
ok() { n=$((n + 1)); echo "ok $n - $*"; }
notok() { n=$((n + 1)); echo "not ok $n - $*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else notok "$what"; fi; }

tools="ds41d ds41ctl ds41-mkmodel ds41-inspect ds41-eval ds41-generate ds41-tokenize ds41-bench"
version=$(sed -n "s/^ *version *: *'\([^']*\)'.*/\1/p" "$src/meson.build" | head -1)
for t in $tools; do
    out=$("$bin/$t" --version 2>&1); rc=$?
    check "$t --version: '$t $version', exit 0 (got '$out', $rc)" test "$rc $out" = "0 $t $version"
done

for t in $tools; do
    "$bin/$t" --help >"$work/$t.help" 2>&1
done
"$bin/ds41-mkmodel" "$work/ckpt" --preset tiny --quiet >/dev/null 2>&1

# ds41ctl --help <-> ds41ctl(1)
result=$("$py" - "$work/ds41ctl.help" "$src/packaging/ds41ctl.1" <<'EOF'
import re, sys
help_text = open(sys.argv[1], encoding="utf-8").read()
roff = open(sys.argv[2], encoding="utf-8").read()

def deroff(s):
    s = re.sub(r"\\f[BIRP]", "", s)
    s = s.replace("\\-", "-").replace("\\(dq", '"').replace("\\e", "\\")
    return s

OPT = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
WORD = re.compile(r"[a-z][a-z-]*$")

def command_of(words):
    """'cache ls' / 'cache --set-expert-bytes' / 'status' from the words of an entry's head."""
    if not words or not WORD.match(words[0]):
        return None
    cmd = [words[0]]
    if len(words) > 1 and (WORD.match(words[1]) or (words[1].startswith("--") and words[0] == "cache")):
        cmd.append(words[1])
    return " ".join(cmd)

# help: the command entries are the lines indented by two spaces under "Commands"
help_cmds = set()
in_cmds = False
for line in help_text.splitlines():
    if line.startswith("Commands"):
        in_cmds = True
        continue
    if in_cmds:
        if not line.startswith("  "):
            in_cmds = False
            continue
        if line.startswith("   "):
            continue  # continuation of an entry
        c = command_of(re.split(r"\s{2,}", line.strip())[0].split())
        if c:
            help_cmds.add(c)
help_opts = set(OPT.findall(help_text))

# man: the .TP entries under .SH COMMANDS; options anywhere
lines = roff.splitlines()
man_cmds = set()
section = None
for i, line in enumerate(lines):
    if line.startswith(".SH"):
        section = line[3:].strip()
    if section == "COMMANDS" and line.strip() == ".TP" and i + 1 < len(lines):
        head = deroff(lines[i + 1])
        head = re.sub(r'^\.(B|BI|BR|I|IR|RB)\s+', "", head).replace('"', " ")
        c = command_of(head.split())
        if c:
            man_cmds.add(c)
man_opts = set(OPT.findall(deroff(roff)))

problems = []
for c in sorted(help_cmds - man_cmds):
    problems.append("command '%s' of --help missing from ds41ctl(1)" % c)
for c in sorted(man_cmds - help_cmds):
    problems.append("command '%s' of ds41ctl(1) missing from --help" % c)
for o in sorted(help_opts - man_opts):
    problems.append("option %s of --help missing from ds41ctl(1)" % o)
for o in sorted(man_opts - help_opts):
    problems.append("option %s of ds41ctl(1) missing from --help" % o)
print("%d %d %d %d|%s" % (len(help_cmds), len(man_cmds), len(help_opts), len(man_opts), "; ".join(problems)))
EOF
)
counts=${result%%|*}
problems=${result#*|}
check "ds41ctl --help and ds41ctl(1) name the same commands and options ($counts: commands help/man, options help/man)${problems:+: $problems}" \
    bash -c "test -z \"\$1\" && [[ \"\$2\" =~ ^[1-9][0-9]*\ [1-9] ]]" _ "$problems" "$counts"

# every file cited by a --help text exists
result=$("$py" - "$src" "$work/ckpt" "$work"/*.help <<'EOF'
import os, re, sys
src, ckpt, helps = sys.argv[1], sys.argv[2], sys.argv[3:]
EXT = r"(json|yaml|yml|md|py|h|c|sh|safetensors|conf|service|socket|txt)"
BARE_EXT = r"(json|yaml|yml|md|py|h|c|sh|safetensors)"  # not .socket: listen.socket is a YAML key
# a path with a slash ending in a file name, an absolute path (not ~/...: per user), a bare file name: lower-case with a
# data extension (FILE.json, STREAMS.safetensors are placeholders) or any document or source file
PATH = re.compile(r"(?<![\w./~-])(/[\w.-]+(?:/[\w.-]+)*|[\w.-]+(?:/[\w.-]+)+\." + EXT + r"|[a-z0-9_][\w.-]*\." +
                  BARE_EXT + r"|[A-Za-z0-9_][\w.-]*\.(?:md|py|h|c|sh))(?![\w/])")
packaging_meson = open(os.path.join(src, "packaging/meson.build")).read()
tmpfiles = open(os.path.join(src, "packaging/tmpfiles.d/ds41d.conf")).read()
tmp_dirs = [l.split()[1] for l in tmpfiles.splitlines() if l and not l.startswith("#") and len(l.split()) > 1]
repo_names = set()
for root, dirs, files in os.walk(src):
    dirs[:] = [d for d in dirs if not d.startswith(".") and not d.startswith("build")]
    repo_names.update(files)

def exists(p):
    if p.startswith("/"):
        if p.startswith(("/proc/", "/sys/", "/dev/")):
            return os.path.exists(p)
        if p.startswith("/etc/ds41d/"):
            name = p[len("/etc/ds41d/"):]
            return os.path.isfile(os.path.join(src, "packaging", name)) and name in packaging_meson
        return any(p == d or p.startswith(d + "/") for d in tmp_dirs)
    if "/" in p:
        return os.path.exists(os.path.join(src, p)) or os.path.exists(os.path.join(ckpt, p))
    return p in repo_names or os.path.exists(os.path.join(ckpt, p))

cited, missing = 0, []
for h in helps:
    tool = os.path.basename(h)[:-5]
    for m in PATH.finditer(open(h, encoding="utf-8").read()):
        p = m.group(1)
        cited += 1
        if not exists(p):
            missing.append("%s cites %s" % (tool, p))
print("%d|%s" % (cited, "; ".join(sorted(set(missing)))))
EOF
)
cited=${result%%|*}
missing=${result#*|}
check "every file the tools' --help texts cite exists in the tree, the install tree or a checkpoint ($cited cited)${missing:+: $missing}" \
    bash -c "test -z \"\$1\" && test \"\$2\" -gt 5" _ "$missing" "$cited"
echo "1..$n"
