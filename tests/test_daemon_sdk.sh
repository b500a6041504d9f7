#!/bin/bash
# The official OpenAI Node SDK (npm openai@6, with an undici@6 Agent on the socket path) against
# the real ds41d: streaming and non-streaming chat, the prefix cache, forced reasoning and tool
# calls received exactly, completions, errors.  openai@6 and undici@6 are installed into the npm
# cache dir once; the test is skipped, saying why, only when npm cannot be reached.  TAP.
. "$(dirname "$0")/daemon_lib.sh"
here=$(cd "$(dirname "$0")" && pwd)
cache=${DS41_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-${TMPDIR:-/tmp}}/.cache}/ds41}
mods=$cache/node-openai/node_modules

skip_all() { echo "1..0 # SKIP $*"; exit 0; }
command -v node >/dev/null || skip_all "npm unreachable: node is not installed (nodejs + npm are test dependencies)"
loads() { node -e "require('$mods/openai'); require('$mods/undici').Agent" >/dev/null 2>&1; }
if ! loads; then
    command -v npm >/dev/null || skip_all "npm unreachable: npm is not installed"
    mkdir -p "$cache/node-openai" || skip_all "npm unreachable: cannot create $cache/node-openai"
    exec 9>"$cache/node-openai/.lock"
    command -v flock >/dev/null && flock 9
    if ! loads; then
        if ! timeout 300 npm install --prefix "$cache/node-openai" --no-save --no-audit --no-fund --loglevel=error \
                --prefer-offline --fetch-retries=1 --fetch-timeout=30000 openai@6 undici@6 \
                >"$cache/node-openai/install.log" 2>&1; then
            skip_all "npm unreachable: 'npm install openai@6 undici@6' failed: $(tail -n 2 "$cache/node-openai/install.log" | tr '\n' ' ')"
        fi
        loads || { echo "not ok 1 - openai@6 installed but does not load under node $(node --version)"; echo "1..1"; exit 0; }
    fi
fi
note "openai $(node -p "require('$mods/openai/package.json').version"), undici $(node -p "require('$mods/undici/package.json').version")"

write_config "$work/ds41d.yaml"
if ! start_daemon "$work/ds41d.yaml"; then
    notok "ds41d starts"; finish; exit 0
fi
ok "ds41d starts"
node "$here/tools/openai_sdk_check.js" "$mods" "$sock" >"$work/sdk.out" 2>"$work/sdk.err"
cases=0
while IFS= read -r line; do
    cases=$((cases + 1))
    what=$("$py" -c 'import json,sys;o=json.loads(sys.argv[1]);print(o["what"] + ("" if o["ok"] else " -- " + o["detail"]))' "$line")
    if [ "$("$py" -c 'import json,sys;print(json.loads(sys.argv[1])["ok"])' "$line")" = True ]; then ok "SDK: $what"; else notok "SDK: $what"; fi
done <"$work/sdk.out"
check "the SDK script ran all 18 cases" test $cases -eq 18
[ -s "$work/sdk.err" ] && sed 's/^/# node: /' "$work/sdk.err" | head -20
stop_daemon TERM
check "the daemon exits 0" test "$daemon_status" = 0
finish
