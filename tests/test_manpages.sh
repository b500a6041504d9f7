#!/bin/bash
# Each tool's --help against its man page, so that an option added, renamed or
# dropped on one side fails here (TAP).  For every tool with a page in
# packaging/: the options its --help text names (plus --help, which printed
# it) must be exactly the options its page documents -- the tags of the page's
# .TP entries (--x, --x ARG) -- naming every difference in both directions;
# and every option the page's SYNOPSIS shows must be one of the tool's.
# ds41ctl's page is checked with its commands by test_help.sh.
# TAP helpers, $bin, $py and a $work directory from daemon_lib.sh (no daemon is started).
. "$(dirname "$0")/daemon_lib.sh"
src=$(cd "$(dirname "$0")/.." && pwd)

compare() { # HELPFILE PAGE -> "help_count page_count|problems"
    "$py" - "$1" "$2" <<'PY'
import re, sys
help_text = open(sys.argv[1], encoding="utf-8").read()
roff = open(sys.argv[2], encoding="utf-8").read()
OPT = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")

def deroff(s):
    s = re.sub(r"\\f[BIRP]", "", s)
    return s.replace("\\-", "-").replace("\\(dq", '"').replace("\\e", "\\")

help_opts = set(OPT.findall(help_text)) | {"--help"}
lines = roff.splitlines()
page_opts, synopsis_opts = set(), set()
section = None
for i, line in enumerate(lines):
    if line.startswith(".SH"):
        section = line[3:].strip().strip('"')
        continue
    if section == "SYNOPSIS":
        synopsis_opts.update(OPT.findall(deroff(line)))
    if line.strip() == ".TP" and i + 1 < len(lines):
        tag = deroff(lines[i + 1])
        tag = re.sub(r"^\.[A-Z]{1,2}\s+", "", tag).replace('"', " ").split()
        if tag and OPT.fullmatch(tag[0]):
            page_opts.add(tag[0])
problems = []
problems += ["option %s of --help is not documented by the page" % o for o in sorted(help_opts - page_opts)]
problems += ["option %s of the page is not in --help" % o for o in sorted(page_opts - help_opts)]
problems += ["option %s of the page's SYNOPSIS is not in --help" % o for o in sorted(synopsis_opts - help_opts)]
print("%d %d|%s" % (len(help_opts), len(page_opts), "; ".join(problems)))
PY
}

# The check itself can fail: a page missing an option and documenting one the tool lacks.
printf 'usage: t [--alpha N] [--beta]\n  --alpha N  a\n  --beta     b\n' >"$work/t.help"
printf '.TH T 1\n.SH SYNOPSIS\n.B t\n.RB [ \\-\\-gamma ]\n.SH OPTIONS\n.TP\n.BI \\-\\-alpha " N"\na\n.TP\n.B \\-\\-gamma\ng\n.TP\n.B \\-\\-help\nh\n' >"$work/t.1"
r=$(compare "$work/t.help" "$work/t.1")
want="3 3|option --beta of --help is not documented by the page; option --gamma of the page is not in --help; option --gamma of the page's SYNOPSIS is not in --help"
if [ "$r" = "$want" ]; then ok "the comparison names a difference in each direction"; else notok "the comparison names a difference in each direction (got '$r')"; fi

for t in ds41-eval ds41-bench ds41-generate ds41-mkmodel ds41-inspect ds41-tokenize ds41d; do
    page=$(ls "$src"/packaging/"$t".[18] 2>/dev/null | head -1)
    if [ -z "$page" ]; then notok "$t has a man page in packaging/ ($t.1 or $t.8)"; continue; fi
    if ! "$bin/$t" --help >"$work/$t.help" 2>&1; then notok "$t --help exits 0"; continue; fi
    if ! grep -q "'$(basename "$page")'" "$src/packaging/meson.build"; then
        notok "$(basename "$page") is installed by packaging/meson.build (install_man)"
    fi
    r=$(compare "$work/$t.help" "$page")
    counts=${r%%|*}
    problems=${r#*|}
    if [ -z "$problems" ] && [[ $counts =~ ^[1-9][0-9]*\ [1-9] ]]; then
        ok "$t --help and $(basename "$page") name the same options ($counts: help/page)"
    else
        notok "$t --help and $(basename "$page") name the same options ($counts: help/page): $problems"
    fi
done
if command -v groff >/dev/null; then
    bad=""
    for t in ds41-eval ds41-bench ds41-generate ds41-mkmodel ds41-inspect ds41-tokenize; do
        out=$(LC_ALL=C.UTF-8 groff -man -ww -z -Tutf8 "$src/packaging/$t.1" 2>&1)
        [ -z "$out" ] || { bad="$bad $t.1"; echo "$out" | sed 's/^/# /'; }
    done
    if [ -z "$bad" ]; then ok "the tools' man pages format without groff warnings"; else notok "the tools' man pages format without groff warnings (bad:$bad)"; fi
else
    skip "groff is not installed"
fi
finish
