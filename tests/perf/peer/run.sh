#!/usr/bin/env bash
# Peer benchmark: ds41 against llama.cpp on matched models, same host, runs
# alternating.  Not part of the test suite (it needs the npm registry once and
# takes minutes).  See the README section "Peer benchmark".
#
#   tests/perf/peer/run.sh [--pairs N] [--threads N] [--steps N]
#                          [--batches 1,4,16] [--prompts 64,512] [--build DIR]
#
# From a clean checkout it: builds ds41 (meson, in DIR, default build/);
# installs the pinned node-llama-cpp 3.22.1 and @node-llama-cpp/linux-x64
# 3.22.1 (its prebuilt llama.cpp) into DIR/peer/npm; writes the bench preset
# (ds41-mkmodel --preset bench, DIR/peer/bench-model, ~3 GB) and the matched
# random-weight gpt-oss GGUF (mkgguf.py, DIR/peer/peer-gpt-oss.gguf, ~2 GB);
# then runs N pairs (default 6) of ds41-bench and llama_bench.mjs, the order
# within a pair alternating, and prints every run and the medians with the
# ratios ds41/llama.cpp (summary.py).  Runs are kept in DIR/peer/runs.jsonl.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
pairs=6 threads=2 steps=8 batches=1,4,16 prompts=64,512 build="$root/build"
while [ $# -gt 0 ]; do
    case "$1" in
    --pairs) pairs=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --batches) batches=$2; shift 2 ;;
    --prompts) prompts=$2; shift 2 ;;
    --build) build=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (--help)" >&2; exit 2 ;;
    esac
done
case "$pairs" in '' | *[!0-9]* | 0) echo "run.sh: --pairs: expected a positive integer" >&2; exit 2 ;; esac

say() { echo "peer: $*" >&2; }
load1() { cut -d' ' -f1-3 /proc/loadavg | tr ' ' ','; }

# 1. ds41
[ -f "$build/build.ninja" ] || (cd "$root" && meson setup "$build" >&2)
say "building ds41-bench and ds41-mkmodel in $build"
meson compile -C "$build" ds41-bench ds41-mkmodel >&2
bench="$build/daemon/ds41-bench" mkmodel="$build/daemon/ds41-mkmodel"
cache="$build/peer"
mkdir -p "$cache"

# 2. llama.cpp through node-llama-cpp, pinned
command -v node >/dev/null || { echo "run.sh: node (>= 18) is needed" >&2; exit 1; }
npmdir="$cache/npm"
want=3.22.1
have=$(node -e "try{console.log(require('$npmdir/node_modules/node-llama-cpp/package.json').version)}catch{}" 2>/dev/null || true)
have_bin=$(node -e "try{console.log(require('$npmdir/node_modules/@node-llama-cpp/linux-x64/package.json').version)}catch{}" 2>/dev/null || true)
if [ "$have" != "$want" ] || [ "$have_bin" != "$want" ]; then
    say "installing node-llama-cpp $want and @node-llama-cpp/linux-x64 $want into $npmdir"
    mkdir -p "$npmdir"
    cat >"$npmdir/package.json" <<EOF
{"private": true, "dependencies": {"node-llama-cpp": "$want", "@node-llama-cpp/linux-x64": "$want"}}
EOF
    # --ignore-scripts: no postinstall build; llama_bench.mjs loads the prebuilt binaries only.
    (cd "$npmdir" && npm install --no-audit --no-fund --ignore-scripts --save-exact >&2)
fi
cp "$here/llama_bench.mjs" "$npmdir/llama_bench.mjs"

# 3. the matched models
model="$cache/bench-model"
if [ ! -f "$model/model.safetensors.index.json" ]; then
    rm -rf "$model"
    say "writing the bench preset to $model (~3 GB, a minute or two)"
    "$mkmodel" "$model" --preset bench --quiet >&2
fi
gguf="$cache/peer-gpt-oss.gguf" shapes="$cache/peer-gpt-oss.json"
if [ ! -s "$gguf" ] || [ ! -s "$shapes" ] || [ "$here/mkgguf.py" -nt "$gguf" ] || [ "$here/gguf.py" -nt "$gguf" ]; then
    say "writing the matched gpt-oss GGUF to $gguf (~2 GB)"
    python3 "$here/mkgguf.py" "$model" "$gguf.tmp" >"$shapes.tmp"
    mv "$gguf.tmp" "$gguf"
    mv "$shapes.tmp" "$shapes"
fi
vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab'])" "$shapes")

# 4. alternating runs
runs="$cache/runs.jsonl"
: >"$runs"
record() { # who pair order load file [prefill-only files...]
    python3 - "$@" >>"$runs" <<'EOF'
import json, sys
who, pair, order, load, path = sys.argv[1:6]
rec = {"who": who, "pair": int(pair), "order": int(order), "load": [float(x) for x in load.split(",")],
       "bench": json.load(open(path))}
rec["prefill_runs"] = [json.load(open(p)) for p in sys.argv[6:]]
print(json.dumps(rec))
EOF
}
IFS=, read -r -a prompt_list <<<"$prompts"
run_ds41() { # pair order
    local l out="$cache/ds41.json" extra=() i
    l=$(load1)
    "$bench" --model "$model" --threads "$threads" --json --prompt "${prompt_list[0]}" --steps "$steps" \
        --batches "$batches" --bandwidth-gib 1 >"$out" 2>"$cache/ds41.err" || {
        cat "$cache/ds41.err" >&2; return 1; }
    # ds41-bench prefills one prompt length per run: the others in runs of
    # their own (their one B=1 decode step is not reported).
    for ((i = 1; i < ${#prompt_list[@]}; i++)); do
        extra+=("$cache/ds41-prefill$i.json")
        "$bench" --model "$model" --threads "$threads" --json --prompt "${prompt_list[$i]}" --steps 1 \
            --batches 1 --bandwidth-gib 1 >"${extra[-1]}" 2>"$cache/ds41.err" || {
            cat "$cache/ds41.err" >&2; return 1; }
    done
    record ds41 "$1" "$2" "$l" "$out" "${extra[@]}"
}
run_llama() { # pair order
    local l out="$cache/llama.json"
    l=$(load1)
    (cd "$npmdir" && node llama_bench.mjs --model "$gguf" --vocab "$vocab" --threads "$threads" \
        --batches "$batches" --prompts "$prompts" --steps "$steps") >"$out" 2>"$cache/llama.err" || {
        cat "$cache/llama.err" >&2; return 1; }
    record llama "$1" "$2" "$l" "$out"
}
say "$pairs pairs, $threads threads, decode batches $batches ($steps steps), prefill $prompts tokens"
for p in $(seq 1 "$pairs"); do
    if [ $((p % 2)) -eq 1 ]; then
        run_ds41 "$p" 1; run_llama "$p" 2
    else
        run_llama "$p" 1; run_ds41 "$p" 2
    fi
    python3 "$here/summary.py" "$runs" "$shapes" --pair="$p" >&2
done
echo "peer benchmark, $(date -u '+%Y-%m-%d %H:%M UTC'), host $(hostname), $(nproc) CPUs:" \
    "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
python3 "$here/summary.py" "$runs" "$shapes"
