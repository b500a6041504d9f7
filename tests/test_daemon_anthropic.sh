#!/bin/bash
# The official Anthropic TypeScript SDK (npm @anthropic-ai/sdk, pinned below, with an undici@6 Agent
# on the socket path) against the real ds41d's /v1/messages: plain, streamed (the exact event
# sequence), tool use round trip, thinking, stop_sequences, count_tokens, cache_read_input_tokens,
# errors.  The packages are installed into the npm cache dir once; the test is skipped, saying why,
# only when npm cannot be reached.  TAP.
. "$(dirname "$0")/daemon_lib.sh"
here=$(cd "$(dirname "$0")" && pwd)
sdk_version=1.17.0
cache=${DS41_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-${TMPDIR:-/tmp}}/.cache}/ds41}
prefix=$cache/node-anthropic
mods=$prefix/node_modules

skip_all() { echo "1..0 # SKIP $*"; exit 0; }
have_sdk() {
    node -e "const v=require('$mods/@anthropic-ai/sdk/package.json').version; if (v !== '$sdk_version') process.exit(1);
             require('$mods/@anthropic-ai/sdk'); require('$mods/undici').Agent" >/dev/null 2>&1
}
command -v node >/dev/null || skip_all "npm unreachable: node is not installed (nodejs + npm are test dependencies)"
if ! have_sdk; then
    command -v npm >/dev/null || skip_all "npm unreachable: npm is not installed"
    mkdir -p "$prefix" || skip_all "npm unreachable: cannot create $prefix"
    exec 9>"$prefix/.lock"
    command -v flock >/dev/null && flock 9
    if ! have_sdk; then
        timeout 300 npm install --prefix "$prefix" --no-save --no-audit --no-fund --loglevel=error --prefer-offline \
            --fetch-retries=1 --fetch-timeout=30000 "@anthropic-ai/sdk@$sdk_version" undici@6 >"$prefix/install.log" 2>&1 ||
            skip_all "npm unreachable: 'npm install @anthropic-ai/sdk@$sdk_version undici@6' failed: $(tail -n 2 "$prefix/install.log" | tr '\n' ' ')"
        have_sdk || { echo "not ok 1 - @anthropic-ai/sdk@$sdk_version installed but does not load under node $(node --version)"; echo "1..1"; exit 0; }
    fi
fi
note "@anthropic-ai/sdk $sdk_version, undici $(node -p "require('$mods/undici/package.json').version")"

write_config "$work/ds41d.yaml"
start_daemon "$work/ds41d.yaml" || { notok "ds41d starts"; finish; exit 0; }
ok "ds41d starts"
node "$here/tools/anthropic_sdk_check.js" "$mods" "$sock" >"$work/sdk.out" 2>"$work/sdk.err"
cases=0
while IFS= read -r line; do
    cases=$((cases + 1))
    verdict=$("$py" -c 'import json,sys;o=json.loads(sys.argv[1]);print(("ok " if o["ok"] else "bad ") + o["what"] + ("" if o["ok"] else " -- " + o["detail"]))' "$line")
    case $verdict in "ok "*) ok "SDK: ${verdict#ok }" ;; *) notok "SDK: ${verdict#bad }" ;; esac
done <"$work/sdk.out"
check "the SDK script ran all 14 cases" test $cases -eq 14
[ -s "$work/sdk.err" ] && sed 's/^/# node: /' "$work/sdk.err" | head -20
stop_daemon TERM
check "the daemon exits 0" test "$daemon_status" = 0
finish
