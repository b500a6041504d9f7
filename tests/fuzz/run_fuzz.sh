#!/bin/bash
# Short libFuzzer run for the test suite: run_fuzz.sh FUZZER SEED_DIR RUNS
# New corpus entries go to a scratch directory, never into the source tree.
# Prints one TAP case.
set -u
fuzzer=$1 seeds=$2 runs=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if "$fuzzer" -runs="$runs" -max_len=65536 -rss_limit_mb=2048 -timeout=20 \
        -artifact_prefix="$work/" "$work" "$seeds" >"$work/log" 2>&1; then
    echo "ok 1 - $(basename "$fuzzer"): $runs inputs, no crash"
else
    echo "not ok 1 - $(basename "$fuzzer") found a crash"
    tail -n 60 "$work/log" | sed 's/^/# /'
    for f in "$work"/crash-* "$work"/leak-* "$work"/timeout-*; do
        [ -e "$f" ] || continue
        echo "# artifact $(basename "$f"):"
        head -c 300 "$f" | od -An -c | head -5 | sed 's/^/#   /'
    done
fi
echo "1..1"
