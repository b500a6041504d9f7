#!/bin/bash
# ds41d with the routed experts streamed under a small memory.expert_cache_bytes (issue 7):
# the same tokens as fully resident, statistics in `ds41ctl cache` and /metrics, the budget
# changed at run time (ds41ctl cache --set-expert-bytes), an injected read fault
# (engine.test_fault_expert_read) and a shard truncated under the running daemon each fail
# the affected request with a clear error while the daemon keeps serving.
#
# The model is a generated tiny checkpoint re-sharded so that every routed expert tensor
# lives in its own shard (model-00002-of-00002.safetensors): truncating that shard can then
# only affect streamed expert reads, never the mapped dense tensors (a mapped shard cut under
# the daemon: tests/test_daemon_truncate.sh).
. "$(dirname "$0")/daemon_lib.sh"
ctl=$bin/ds41ctl
mk=$bin/ds41-mkmodel

"$mk" "$work/gen" --preset tiny --seed 7 --quiet >/dev/null 2>&1
"$py" - "$work/gen" "$work/m" <<'EOF'
import json, os, shutil, struct, sys
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
for name in os.listdir(src):
    if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
        p = os.path.join(src, name)
        (shutil.copytree if os.path.isdir(p) else shutil.copy)(p, os.path.join(dst, name))
tensors, meta = {}, None
for name in sorted(os.listdir(src)):
    if not name.endswith(".safetensors"):
        continue
    with open(os.path.join(src, name), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
        base = 8 + n
        meta = h.pop("__metadata__", meta)
        for k, v in h.items():
            f.seek(base + v["data_offsets"][0])
            tensors[k] = (v["dtype"], v["shape"], f.read(v["data_offsets"][1] - v["data_offsets"][0]))
def routed(k):
    return k.startswith("layers.") and ".ffn.experts." in k
groups = [sorted(k for k in tensors if not routed(k)), sorted(k for k in tensors if routed(k))]
weight_map = {}
for i, keys in enumerate(groups):
    fname = "model-%05d-of-%05d.safetensors" % (i + 1, len(groups))
    hdr, off = {}, 0
    if meta:
        hdr["__metadata__"] = meta
    for k in keys:
        d, s, b = tensors[k]
        hdr[k] = {"dtype": d, "shape": s, "data_offsets": [off, off + len(b)]}
        off += len(b)
        weight_map[k] = fname
    hb = json.dumps(hdr, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(os.path.join(dst, fname), "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for k in keys:
            f.write(tensors[k][2])
with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": sum(len(t[2]) for t in tensors.values())}, "weight_map": weight_map}, f)
EOF
check "tiny checkpoint generated and re-sharded (routed experts alone in shard 2)" \
    test -s "$work/m/model-00002-of-00002.safetensors"
xshard=$work/m/model-00002-of-00002.safetensors
cp "$xshard" "$work/xshard.bak"

models="models:
  - name: m
    path: $work/m"
req='{"model":"m","prompt":[0,40,41,42,43,44,45,46,47,48,49,50,51,52],"max_tokens":10,"temperature":0}'

# ---- everything resident -------------------------------------------------------------------------
write_config "$work/res.yaml" "$models"
if ! start_daemon "$work/res.yaml"; then
    notok "the daemon starts with the model resident"
    finish
    exit 0
fi
code=$(api POST /v1/completions "$req")
check "resident: completion 200" test "$code" = 200
want=$(pyj 'o["choices"][0]["text"]')
"$ctl" --socket "$sock" --json cache >"$work/cache0.json"
check "resident: ds41ctl cache shows the expert tier all resident" \
    test "$(pyj '[(t["streamed"], t["total_bytes"] > 0) for t in o["cache"]["tiers"] if t["name"] == "experts"]' "$work/cache0.json")" = "[[false, true]]"
stop_daemon

# ---- streamed under a small budget ---------------------------------------------------------------
write_config "$work/x.yaml" "$models" "memory:
  expert_cache_bytes: 100KiB
  host_expert_cache_bytes: 1MiB"
if ! start_daemon "$work/x.yaml"; then
    notok "the daemon starts with a 100KiB expert budget"
    finish
    exit 0
fi
check "the daemon logs the streamed tier" grep -q "routed experts streamed" "$work/daemon.log"
code=$(api POST /v1/completions "$req")
check "streamed (100KiB, fewer slots than one layer's experts): the same text as resident" \
    test "$code $(pyj 'o["choices"][0]["text"]')" = "200 $want"
"$ctl" --socket "$sock" --json cache >"$work/cache1.json"
check "ds41ctl cache: expert tier streamed, budget 100KiB, misses, bytes read, latency, predictions" \
    test "$(pyj '[(t["streamed"], t["capacity_bytes"], t["misses"] > 0, t["bytes_read"] > 0, t["latency_p99_ns"] >= t["latency_p50_ns"] > 0, t["predicted"] >= t["predicted_used"]) for t in o["cache"]["tiers"] if t["name"] == "experts"]' "$work/cache1.json")" = "[[true, 102400, true, true, true, true]]"
"$ctl" --socket "$sock" cache >"$work/cache1.txt"
check "ds41ctl cache (text) has the experts line" grep -q "^experts: streamed from disk" "$work/cache1.txt"
"$ctl" --socket "$sock" metrics >"$work/metrics1.txt"
check "/metrics has ds41_tier_* series for tier=experts" \
    bash -c "grep -q '^ds41_tier_misses_total{model=\"m\",tier=\"experts\"} [1-9]' '$work/metrics1.txt' &&
             grep -q '^ds41_tier_read_bytes_total{model=\"m\",tier=\"experts\"} [1-9]' '$work/metrics1.txt' &&
             grep -q '^ds41_tier_read_latency_seconds{model=\"m\",tier=\"experts\",quantile=\"0.99\"}' '$work/metrics1.txt' &&
             grep -q '^ds41_tier_streamed{model=\"m\",tier=\"experts\"} 1' '$work/metrics1.txt'"
# memory.host_expert_cache_bytes is a GPU backend's host tier: the CPU backend computes on host
# memory and has none (no experts_host tier, nothing uploaded), yet counts its stall time.
check "CPU backend: memory.host_expert_cache_bytes makes no host tier; uploads 0, stall time counted" \
    bash -c "! grep -q 'experts_host' '$work/metrics1.txt' '$work/cache1.json' &&
             grep -q '^ds41_tier_uploaded_bytes_total{model=\"m\",tier=\"experts\"} 0$' '$work/metrics1.txt' &&
             grep -q '^ds41_tier_stall_nanoseconds_total{model=\"m\",tier=\"experts\"} [0-9]' '$work/metrics1.txt'"
"$ctl" --socket "$sock" cache --set-expert-bytes 1KiB >"$work/small.txt" 2>&1
rc=$?
check "ds41ctl cache --set-expert-bytes below one expert is refused naming the minimum" \
    bash -c "test $rc = 1 && grep -q 'minimum is' '$work/small.txt'"
check "ds41ctl cache --set-expert-bytes 300KiB" bash -c "'$ctl' --socket '$sock' cache --set-expert-bytes 300KiB | grep -q 'expert budget set to 307200 bytes'"
code=$(api POST /v1/completions "$req")
"$ctl" --socket "$sock" --json cache >"$work/cache2.json"
check "after the run-time change: same text, budget 300KiB" \
    test "$code $(pyj 'o["choices"][0]["text"]') $(pyj '[t["capacity_bytes"] for t in o["cache"]["tiers"] if t["name"] == "experts"]' "$work/cache2.json")" = "200 $want [307200]"

# ---- a shard truncated under the running daemon ----------------------------------------------------
# Drop the cached experts (budget change), then cut the expert shard in half.
"$ctl" --socket "$sock" cache --set-expert-bytes 60KiB >/dev/null
truncate -s $(($(stat -c %s "$xshard") / 2)) "$xshard"
code=$(api POST /v1/completions "$req")
msg=$(pyj 'o.get("error", {}).get("message", "")' 2>/dev/null)
note "truncated shard: HTTP $code: $msg"
check "truncated expert shard: the request fails with an error naming the shard and an expert tensor" \
    bash -c "test '$code' != 200 && [[ \"\$1\" == *model-00002-of-00002.safetensors* && \"\$1\" == *ffn.experts.* && \"\$1\" == *'end of file'* ]]" _ "$msg"
check "the daemon still answers /health" test "$(api GET /health)" = 200
cp "$work/xshard.bak" "$xshard"
code=$(api POST /v1/completions "$req")
check "shard restored: the next request is served, same text" test "$code $(pyj 'o["choices"][0]["text"]')" = "200 $want"
stop_daemon
check "the daemon exits cleanly" test "$daemon_status" = 0

# ---- an injected read fault ----------------------------------------------------------------------
# The hook goes into write_config's engine section.
write_config "$work/f.yaml" "$models" "memory:
  expert_cache_bytes: 100KiB"
sed -i 's/^  test_forced_output: true$/  test_forced_output: true\n  test_fault_expert_read: 5/' "$work/f.yaml"
if ! start_daemon "$work/f.yaml"; then
    notok "the daemon starts with engine.test_fault_expert_read"
    finish
    exit 0
fi
code=$(api POST /v1/completions "$req")
msg=$(pyj 'o.get("error", {}).get("message", "")' 2>/dev/null)
note "injected fault: HTTP $code: $msg"
check "injected EIO on the 5th expert read: the request fails naming the shard and an expert tensor" \
    bash -c "test '$code' != 200 && [[ \"\$1\" == *model-00002-of-00002.safetensors* && \"\$1\" == *ffn.experts.* && \"\$1\" == *'Input/output error'* ]]" _ "$msg"
code=$(api POST /v1/completions "$req")
check "the next request is served with the same text as resident" test "$code $(pyj 'o["choices"][0]["text"]')" = "200 $want"
"$ctl" --socket "$sock" metrics >"$work/metrics2.txt"
check "/metrics counts the read error" grep -q '^ds41_tier_read_errors_total{model="m",tier="experts"} 1' "$work/metrics2.txt"
stop_daemon
check "the daemon exits cleanly after the fault" test "$daemon_status" = 0

# ---- auto budgets (memory.*_cache_bytes auto) under a small "available memory" ------------------
# The test hook DS41_TEST_MEM_AVAILABLE (engine/serve/auto_budget.h) stands in for MemAvailable: 7 MiB
# holds tiny's ~3.3 MiB of dense weights, the auto KV cache (a quarter) and a row cache (5%), not
# the experts + Engram tables, so the Engram rows and then the experts are streamed; the text
# stays the resident one.
write_config "$work/auto.yaml" "$models"
export DS41_TEST_MEM_AVAILABLE=7MiB
start_daemon "$work/auto.yaml"
started=$?
unset DS41_TEST_MEM_AVAILABLE
if [ $started != 0 ]; then
    notok "the daemon starts with auto budgets and 7 MiB available"
    finish
    exit 0
fi
line=$(grep -o 'budgets: auto -> .*' "$work/daemon.log" | head -1)
note "$line"
check "auto budgets, 7 MiB available: the load logs experts and Engram streamed with their budgets and the inputs" \
    bash -c "[[ \"\$1\" == *'experts '*' streamed with '*' budget, Engram '*' streamed with '*' row cache (available 7.0 MiB'*'dense '*'KV 1.8 MiB)'* ]]" _ "$line"
code=$(api POST /v1/completions "$req")
check "auto budgets streamed: the same text as resident" test "$code $(pyj 'o["choices"][0]["text"]')" = "200 $want"
"$ctl" --socket "$sock" --json cache >"$work/cache3.json"
check "ds41ctl cache --json: experts and engram tiers streamed, the budgets line" \
    test "$(pyj '[sorted(t["name"] for t in o["cache"]["tiers"] if t.get("streamed")), o["cache"]["budgets"].startswith("budgets: auto -> experts")]' "$work/cache3.json")" = '[["engram", "experts"], true]'
"$ctl" --socket "$sock" cache >"$work/cache3.txt"
check "ds41ctl cache (text) prints the budgets line" grep -q "^budgets: auto -> experts .* streamed with" "$work/cache3.txt"
"$ctl" --socket "$sock" doctor >"$work/doctor.txt" 2>&1
check "ds41ctl doctor has a budgets row" grep -q "^budgets .*budgets: auto -> experts .* streamed" "$work/doctor.txt"
# Run time: an explicit budget, then "auto" again = the budget decided at load.
auto_cap=$(pyj '[t["capacity_bytes"] for t in o["cache"]["tiers"] if t["name"] == "experts"][0]' "$work/cache3.json")
"$ctl" --socket "$sock" cache --set-expert-bytes 300KiB >/dev/null 2>&1
code=$(api POST /v1/completions "$req")
"$ctl" --socket "$sock" cache --set-expert-bytes auto >"$work/setauto.txt" 2>&1
check "ds41ctl cache --set-expert-bytes auto prints the budget auto chose ($auto_cap bytes)" \
    grep -q "^expert budget set to auto: $auto_cap bytes" "$work/setauto.txt"
code2=$(api POST /v1/completions "$req")
"$ctl" --socket "$sock" --json cache >"$work/cache4.json"
check "ds41ctl cache --set-expert-bytes auto: back to the load-time auto budget ($auto_cap bytes), same text" \
    test "$code $code2 $(pyj 'o["choices"][0]["text"]') $(pyj '[t["capacity_bytes"] for t in o["cache"]["tiers"] if t["name"] == "experts"][0]' "$work/cache4.json")" = "200 200 $want $auto_cap"
stop_daemon
# 4 MiB cannot hold one layer's expert slots at max_sequences: the model fails to load, naming the sizes.
export DS41_TEST_MEM_AVAILABLE=4MiB
"$ds41d" --config "$work/auto.yaml" >"$work/daemon4.log" 2>&1 &
daemon_pid=$!
unset DS41_TEST_MEM_AVAILABLE
for i in $(seq 1 100); do grep -q "not enough memory" "$work/daemon4.log" && break; sleep 0.1; done
check "auto budgets, 4 MiB available: the load fails naming the sizes" \
    grep -q "not enough memory for the routed experts: available 4.0 MiB .* one layer needs" "$work/daemon4.log"
stop_daemon
finish
