# need_openai_sdk: the official OpenAI Node SDK (npm openai@6) and undici@6 for the tests that
# drive ds41d with it (sourced after daemon_lib.sh).  Installed into the npm cache dir once
# (under a lock); sets $mods to their node_modules.  Ends the test with a TAP skip, saying why,
# only when node or npm cannot be reached.
cache=${DS41_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-${TMPDIR:-/tmp}}/.cache}/ds41}
mods=$cache/node-openai/node_modules

skip_all() { echo "1..0 # SKIP $*"; exit 0; }
need_openai_sdk() {
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
}

# run_sdk_cases SCRIPT ARGS...: runs a node script printing {"ok","what","detail"} lines and turns
# each line into a TAP result; sets $cases to their number.
run_sdk_cases() {
    node "$@" >"$work/sdk.out" 2>"$work/sdk.err"
    cases=0
    local line what
    while IFS= read -r line; do
        cases=$((cases + 1))
        what=$("$py" -c 'import json,sys;o=json.loads(sys.argv[1]);print(o["what"] + ("" if o["ok"] else " -- " + o["detail"]))' "$line")
        if [ "$("$py" -c 'import json,sys;print(json.loads(sys.argv[1])["ok"])' "$line")" = True ]; then ok "SDK: $what"; else notok "SDK: $what"; fi
    done <"$work/sdk.out"
    [ -s "$work/sdk.err" ] && sed 's/^/# node: /' "$work/sdk.err" | head -20
    return 0
}
