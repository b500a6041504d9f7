#!/bin/bash
# Routed experts streamed vs resident through the tools (issue 7): ds41-eval's logits JSON is
# byte for byte the same with every expert resident, with --expert-cache-bytes below one
# layer's union of experts (waves), with a larger budget, without prediction, and with the
# budget taken from a ds41d YAML (--config); fast mode on PRESET, the reference mode too on the
# small presets.  ds41-bench runs streamed and reports the tier.  TAP output.
# Usage: test_expert_eval.sh [PRESET] (tiny by default; "bench" is the long test).
# DS41_EXPERT_EVAL_MODEL=DIR uses an existing checkpoint instead of generating one.
set -u
bin=${DS41_BUILD_DIR:?DS41_BUILD_DIR not set}/daemon
py=/usr/bin/python3
[ -x "$py" ] || py=python3
preset=${1:-tiny}
# A disk file system (O_DIRECT), not /tmp's possible tmpfs.
work=$(mktemp -d "${DS41_BUILD_DIR}/expert-eval-XXXXXX")
trap 'rm -rf "$work"' EXIT
n=0
ok() { n=$((n + 1)); echo "ok $n - $*"; }
notok() { n=$((n + 1)); echo "not ok $n - $*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else notok "$what"; fi; }

model=${DS41_EXPERT_EVAL_MODEL:-$work/m}
if [ -z "${DS41_EXPERT_EVAL_MODEL:-}" ]; then
    if ! "$bin/ds41-mkmodel" "$model" --preset "$preset" --seed 9 --quiet >"$work/mk.log" 2>&1; then
        notok "mkmodel --preset $preset"; sed 's/^/# /' "$work/mk.log"; echo "1..$n"; exit 0
    fi
fi
ok "checkpoint ($preset) at hand"

# The slot size: ds41-eval refuses a 1-byte budget naming the minimum.
"$bin/ds41-eval" --model "$model" --ids 1 --out "$work/x.json" --expert-cache-bytes 1 >"$work/min.log" 2>&1
slot=$(sed -n 's/.*the minimum is \([0-9]*\) bytes.*/\1/p' "$work/min.log" | head -1)
check "a budget below one expert slot is refused naming the minimum (${slot:-?} bytes)" test -n "$slot"
slot=${slot:-4096}

if [ "$preset" = bench ]; then
    ids=5,17,200,4096,77,129000,3,3,64,1000,20000,9
    decode=2
    modes=(fast)
else
    ids=5,17,200,400,77,1000,3,3,64,11,20,9,5,17,200,31,32,33,34,35
    decode=4
    modes=(fast reference)
fi
for mode in "${modes[@]}"; do
    extra=(--threads 2)
    [ "$mode" = reference ] && extra=(--reference)
    if ! "$bin/ds41-eval" --model "$model" --ids "$ids" --decode $decode "${extra[@]}" --out "$work/res.json" \
        >"$work/res.log" 2>&1; then
        notok "$mode: resident run"; sed 's/^/# /' "$work/res.log"; continue
    fi
    ok "$mode: resident run"
    # 3 slots: far below one layer's union over the prompt (waves); 40 slots; then no prediction.
    for spec in "$((3 * slot)):" "$((40 * slot)):" "$((40 * slot)):--no-predict"; do
        budget=${spec%%:*}
        flag=${spec#*:}
        if "$bin/ds41-eval" --model "$model" --ids "$ids" --decode $decode "${extra[@]}" --out "$work/x.json" \
            --expert-cache-bytes "$budget" $flag >"$work/x.log" 2>&1 && cmp -s "$work/res.json" "$work/x.json"; then
            ok "$mode: --expert-cache-bytes $budget $flag: logits JSON byte for byte the resident one"
        else
            notok "$mode: --expert-cache-bytes $budget $flag: logits JSON byte for byte the resident one"
            sed 's/^/# /' "$work/x.log" | tail -3
        fi
    done
done

# --config FILE: memory.expert_cache_bytes from a ds41d YAML.
printf 'memory:\n  expert_cache_bytes: %s\n' "$((5 * slot))" >"$work/d.yaml"
if "$bin/ds41-eval" --model "$model" --ids "$ids" --decode $decode --threads 2 --out "$work/c.json" \
    --config "$work/d.yaml" >"$work/c.log" 2>&1 && "$bin/ds41-eval" --model "$model" --ids "$ids" --decode $decode \
    --threads 2 --out "$work/r2.json" >/dev/null 2>&1 && cmp -s "$work/r2.json" "$work/c.json"; then
    ok "--config (memory.expert_cache_bytes 5 slots): same logits"
else
    notok "--config (memory.expert_cache_bytes 5 slots): same logits"; sed 's/^/# /' "$work/c.log" | tail -3
fi
printf 'memory:\n  expert_cache_bytes: lots\n' >"$work/bad.yaml"
"$bin/ds41-eval" --model "$model" --ids 1 --out "$work/b.json" --config "$work/bad.yaml" >"$work/b.log" 2>&1
rc=$?
check "--config with a bad size: exit 2 naming the key" \
    bash -c "test $rc = 2 && grep -q 'memory.expert_cache_bytes' '$work/b.log'"

# Auto budgets (engine/serve/auto_budget.h) through the test hook DS41_TEST_MEM_AVAILABLE: on tiny,
# 5 MiB of "available memory" does not hold dense + experts + Engram, so the Engram rows and then
# the experts are streamed, and the logits stay byte for byte the resident ones; 4 MiB cannot
# hold one layer's expert slots: exit 2 naming the sizes.  "--expert-cache-bytes auto" is a flag
# value; an explicit size wins over auto.
if [ "$preset" = tiny ]; then
    if DS41_TEST_MEM_AVAILABLE=5MiB "$bin/ds41-eval" --model "$model" --ids "$ids" --decode $decode --threads 2 \
        --out "$work/a.json" >"$work/a.log" 2>&1 && cmp -s "$work/r2.json" "$work/a.json" &&
        grep -q 'budgets: auto -> experts .* streamed with .* budget, Engram .* streamed with .* row cache (available 5.0 MiB' "$work/a.log"; then
        ok "auto budgets with 5 MiB available: Engram and experts streamed (logged), logits byte for byte the resident ones"
    else
        notok "auto budgets with 5 MiB available: Engram and experts streamed (logged), logits byte for byte the resident ones"
        sed 's/^/# /' "$work/a.log" | tail -3
    fi
    DS41_TEST_MEM_AVAILABLE=5MiB "$bin/ds41-eval" --model "$model" --ids "$ids" --decode $decode --threads 2 \
        --expert-cache-bytes auto --engram-cache-bytes 0 --out "$work/a2.json" >"$work/a2.log" 2>&1
    rc=$?
    check "--expert-cache-bytes auto --engram-cache-bytes 0 (explicit: resident) with 5 MiB: experts streamed, Engram resident, same logits" \
        bash -c "test $rc = 0 && cmp -s '$work/r2.json' '$work/a2.json' && grep -q 'experts .* streamed with .*, Engram .* resident (explicit)' '$work/a2.log'"
    DS41_TEST_MEM_AVAILABLE=4MiB "$bin/ds41-eval" --model "$model" --ids "$ids" --out "$work/a3.json" >"$work/a3.log" 2>&1
    rc=$?
    check "auto budgets with 4 MiB available: exit 2, the message names the sizes" \
        bash -c "test $rc = 2 && grep -q 'not enough memory for the routed experts: available 4.0 MiB' '$work/a3.log' && grep -q 'one layer needs' '$work/a3.log'"
    DS41_TEST_MEM_AVAILABLE=4MiB "$bin/ds41-eval" --model "$model" --ids "$ids" --expert-cache-bytes "$((5 * slot))" \
        --engram-cache-bytes 0 --out "$work/a4.json" >"$work/a4.log" 2>&1
    rc=$?
    check "explicit budgets win over auto (4 MiB available, 5 slots + Engram resident: runs)" test $rc = 0
    DS41_TEST_MEM_AVAILABLE=5MiB "$bin/ds41-bench" --model "$model" --json --prompt 16 --steps 2 --batches 1 \
        --bandwidth-gib 1 --threads 2 >"$work/ab.json" 2>"$work/ab.log"
    rc=$?
    check "ds41-bench without budget flags, 5 MiB available: auto streams the experts (its report says so)" \
        bash -c "test $rc = 0 && grep -q 'budgets: auto -> experts' '$work/ab.log' && \"$py\" -c 'import json,sys; x=json.load(open(sys.argv[1])); assert x[\"experts\"][\"streamed\"] is True' '$work/ab.json'"
fi

# ds41-bench streamed: the tier's report.
if [ "$preset" = bench ]; then
    bargs=(--expert-cache-bytes 1GiB --json --prompt 32 --steps 4 --batches 1 --bandwidth-gib 1 --threads 2)
else
    bargs=(--expert-cache-bytes $((10 * slot)) --json --prompt 16 --steps 2 --batches 1,2 --bandwidth-gib 1 --threads 2)
fi
if "$bin/ds41-bench" --model "$model" "${bargs[@]}" >"$work/b.json" 2>"$work/berr.log"; then
    ok "ds41-bench ${bargs[*]} runs"
else
    notok "ds41-bench ${bargs[*]} runs"; sed 's/^/# /' "$work/berr.log" | tail -5
fi
"$py" - "$work/b.json" >"$work/bcheck.log" 2>&1 <<'EOF'
import json, sys
x = json.load(open(sys.argv[1]))["experts"]
assert x["streamed"] is True, x
assert x["slots"] >= 1 and x["total_bytes"] > x["budget_bytes"] >= x["slot_bytes"], x
assert x["device_read_bandwidth_bps"] > 0, x
assert x["prediction"] is True and x["prediction_mode"] == "early", x
io = x["io_without_compute"]
assert io["read_bps"] > 0 and io["read_bps_next_layer_early"] > 0, io
for p in x["phases"]:
    assert p["uses"] == p["hits"] + p["prefetch_hits"] + p["misses"], p
    assert 0 <= p["prefetch_inflight"] <= p["prefetch_hits"], p
    assert p["bytes_read"] > 0 and p["achieved_read_bps"] > 0, p
    # bytes of loads a layer used: never more than what was read
    assert 0 < p["bytes_used"] <= p["bytes_read"] and 0 < p["used_fraction_of_device"] <= p["fraction_of_device"], p
    assert 0 <= p["hit_rate"] <= 1 and 0 <= p["prediction_accuracy"] <= 1, p
    assert p["latency_p99_ns"] >= p["latency_p50_ns"] > 0, p
    # what the tier read came from the device: /proc/self/io counts at least the tier's bytes
    assert p["proc_io_read_bytes"] >= p["bytes_read"] * 0.9, p
    print("# %s B=%d: %.1f%% hits, %.1f MB/token, %.2f GB/s = %.1f%% of the device, accuracy %.1f%%" % (
        p["phase"], p["batch"], 100 * p["hit_rate"], p["bytes_read_per_token"] / 1e6,
        p["achieved_read_bps"] / 1e9, 100 * p["fraction_of_device"], 100 * p["prediction_accuracy"]))
print("# without compute: %.1f%% of the device, %.1f%% with the next layer early" % (
    100 * io["fraction_of_device"], 100 * io["fraction_of_device_next_layer_early"]))
EOF
rc=$?
cat "$work/bcheck.log" | grep '^#'
check "ds41-bench's expert report: uses = hits + predicted + misses, bytes (used <= read), latency, accuracy, /proc/self/io >= tier bytes" \
    test $rc = 0
[ $rc = 0 ] || sed 's/^/# /' "$work/bcheck.log" | tail -5
echo "1..$n"
