#!/bin/bash
# ds41-bench end to end: the JSON report has every figure, consistent with
# itself, for the batch sizes asked; text mode; bad arguments refused.
# Behaviour only: no wall-time thresholds (the figures are reported, not
# judged here).  TAP output.  Usage: test_bench.sh [PRESET] (default: tiny;
# "bench" runs the full default measurement on the bench preset and prints
# the figures as TAP notes).
set -u
bin=${DS41_BUILD_DIR:?DS41_BUILD_DIR not set}/daemon
py=/usr/bin/python3
[ -x "$py" ] || py=python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
n=0
fail=0
ok() { n=$((n + 1)); echo "ok $n - $*"; }
notok() { n=$((n + 1)); fail=1; echo "not ok $n - $*"; }
preset=${1:-tiny}

if ! "$bin/ds41-mkmodel" "$work/m" --preset "$preset" --seed 5 --quiet >"$work/mk.log" 2>&1; then
    notok "mkmodel --preset $preset"; sed 's/^/# /' "$work/mk.log"; echo "1..$n"; exit 1
fi
ok "mkmodel --preset $preset"

if [ "$preset" = bench ]; then
    args=(--json)
else
    args=(--json --prompt 20 --steps 2 --batches 1,3 --bandwidth-gib 1 --threads 2)
fi
if "$bin/ds41-bench" --model "$work/m" "${args[@]}" >"$work/out.json" 2>"$work/err.log"; then
    ok "ds41-bench ${args[*]} runs"
else
    notok "ds41-bench ${args[*]} runs"; sed 's/^/# /' "$work/err.log"
fi

# Structure and consistency of the report.
"$py" - "$work/out.json" "$preset" >"$work/check.log" 2>&1 <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
preset = sys.argv[2]
m, p, d = doc['machine'], doc['prefill'], doc['decode']
want_batches = [1, 4, 16] if preset == 'bench' else [1, 3]
assert doc['backend'].startswith('cpu-'), doc['backend']
assert doc['threads'] >= 1
assert 'load_average_1m' in doc
assert m['read_bandwidth_gbs'] > 0 and m['fma_peak_gflops'] > 0 and m['read_passes'] == 6
assert m['read_bandwidth_gbs'] == max(m['read_bandwidth_samples_gbs'])
assert m['read_buffer_bytes'] >= (4 << 30 if preset == 'bench' else 1 << 29), m['read_buffer_bytes']
assert p['tokens'] == (256 if preset == 'bench' else 20) and p['seconds'] > 0 and p['flops'] > 0
assert abs(p['tokens_per_s'] - p['tokens'] / p['seconds']) <= 1e-3 * p['tokens_per_s']
assert abs(p['fraction_of_fma_peak'] - p['gflops'] / m['fma_peak_gflops']) <= 1e-3
assert [x['batch'] for x in d] == want_batches
prev = 0
for x in d:
    assert x['steps'] == (8 if preset == 'bench' else 2)
    assert x['weight_bytes_per_step'] > 0 and x['seconds_per_step'] > 0
    assert abs(x['tokens_per_s'] - x['batch'] / x['seconds_per_step']) <= 1e-3 * x['tokens_per_s']
    assert abs(x['weight_bytes_per_s'] - x['weight_bytes_per_step'] / x['seconds_per_step']) <= 1e-3 * x['weight_bytes_per_s']
    assert abs(x['fraction_of_bandwidth'] - x['weight_bytes_per_s'] / (m['read_bandwidth_gbs'] * 1e9)) <= 1e-3
    # more sequences route to more experts: a step never touches fewer bytes
    assert x['weight_bytes_per_step'] >= prev, (x['weight_bytes_per_step'], prev)
    prev = x['weight_bytes_per_step']
print(f"backend {doc['backend']} x{doc['threads']}: read {m['read_bandwidth_gbs']:.2f} GB/s, FMA {m['fma_peak_gflops']:.0f} GFLOP/s")
print(f"prefill {p['tokens']} tokens: {p['tokens_per_s']:.1f} tokens/s, {p['gflops']:.1f} GFLOP/s = {100 * p['fraction_of_fma_peak']:.1f}% of the FMA peak")
for x in d:
    print(f"decode B={x['batch']}: {x['tokens_per_s']:.2f} tokens/s, {x['weight_bytes_per_step'] / 1e6:.1f} MB/step, "
          f"{100 * x['fraction_of_bandwidth']:.1f}% of the read bandwidth")
EOF
if [ $? -eq 0 ]; then
    ok "the JSON report has every figure and they agree with each other"
    sed 's/^/# /' "$work/check.log"
else
    notok "the JSON report has every figure and they agree with each other"; sed 's/^/# /' "$work/check.log"
fi

if [ "$preset" != bench ]; then
    if "$bin/ds41-bench" --model "$work/m" --prompt 8 --steps 1 --batches 2 --bandwidth-gib 1 --cpu scalar \
        >"$work/out.txt" 2>/dev/null && grep -q '^backend    cpu-scalar, ' "$work/out.txt" &&
        grep -q '^decode B=2 ' "$work/out.txt" && grep -q 'of the FMA peak' "$work/out.txt"; then
        ok "text report, --cpu scalar honoured"
    else
        notok "text report, --cpu scalar honoured"; sed 's/^/# /' "$work/out.txt"
    fi
    # The Engram row tier streamed under 16 KiB: its figures per phase, consistent.
    if "$bin/ds41-bench" --model "$work/m" --json --prompt 20 --steps 3 --batches 1,2 --bandwidth-gib 1 --threads 2 \
        --engram-cache-bytes 16KiB >"$work/eng.json" 2>"$work/err.log" &&
        "$py" - "$work/eng.json" >"$work/engcheck.log" 2>&1 <<'EOF2'
import json, sys
doc = json.load(open(sys.argv[1]))
t = doc['engram_tier']
assert t['streamed'] is True and t['budget_bytes'] == 16384 and t['capacity_rows'] > 0, t
assert t['capacity_rows'] * (t['row_bytes'] + 48) <= 16384
phases = [(doc['prefill']['engram'], doc['prefill']['tokens'])] + [(x['engram'], x['batch'] * x['steps']) for x in doc['decode']]
for e, tokens in phases:
    assert e['uses'] == e['hits'] + e['misses'] and e['misses'] == e['prefetched_early'] + e['waited'], e
    assert e['uses'] > 0 and e['rows_read'] >= e['misses'] - e['bypass_reads'], e
    assert abs(e['hit_rate'] - e['hits'] / e['uses']) <= 1e-4, e
    assert e['bytes_read'] == e['rows_read'] * t['row_bytes'] and e['bytes_device'] >= e['bytes_read'], e
    assert abs(e['bytes_read_per_token'] - e['bytes_read'] / tokens) <= 0.1, (e, tokens)
    assert e['read_bandwidth_gbs'] >= 0 and e['latency_p99_us'] >= e['latency_p50_us'] > 0, e
print('engram: reader %s, direct %s; decode B=1 hit rate %.2f, %.0f bytes read/token' % (
    t['reader'], t['direct'], doc['decode'][0]['engram']['hit_rate'], doc['decode'][0]['engram']['bytes_read_per_token']))
EOF2
    then
        ok "--engram-cache-bytes 16KiB: the Engram tier's figures per phase, consistent"; sed 's/^/# /' "$work/engcheck.log"
    else
        notok "--engram-cache-bytes 16KiB: the Engram tier's figures per phase, consistent"
        sed 's/^/# /' "$work/err.log" "$work/engcheck.log"
    fi
    if "$bin/ds41-bench" --model "$work/m" --prompt 8 --steps 1 --batches 1 --bandwidth-gib 1 --engram-cache-bytes 16KiB \
        >"$work/eng.txt" 2>/dev/null && grep -q '^engram     rows streamed: budget 16384 bytes' "$work/eng.txt" &&
        grep -q '^  engram B=1 .*hit rate' "$work/eng.txt" &&
        "$bin/ds41-bench" --model "$work/m" --prompt 8 --steps 1 --batches 1 --bandwidth-gib 1 --ops >"$work/res.txt" 2>/dev/null &&
        grep -q '^engram     tables resident' "$work/res.txt"; then
        ok "text report: the Engram tier streamed or resident"
    else
        notok "text report: the Engram tier streamed or resident"; sed 's/^/# /' "$work/eng.txt"
    fi
    # (that last run had --ops: its text split)
    if grep -q '^ops prefill ' "$work/res.txt" && grep -q '^ops B=1 ' "$work/res.txt" &&
        grep -q '^  block 9 .*attn: .*; ffn: .*experts' "$work/res.txt" && grep -q '^  head ' "$work/res.txt"; then
        ok "--ops text report"
    else
        notok "--ops text report"; sed 's/^/# /' "$work/res.txt"
    fi
    # --ops: per-layer time split by op (tiny: 10 blocks, Engram before 1 and 5).
    if "$bin/ds41-bench" --model "$work/m" --json --ops --prompt 12 --steps 2 --batches 1,2 --bandwidth-gib 1 \
        --threads 2 >"$work/ops.json" 2>"$work/err.log" &&
        "$py" - "$work/ops.json" "$work/out.json" >"$work/opscheck.log" 2>&1 <<'EOF4'
import json, sys
doc = json.load(open(sys.argv[1]))
assert 'ops' not in json.load(open(sys.argv[2])), 'ops reported without --ops'
ops = doc['ops']
assert [o['phase'] for o in ops] == ['prefill', 'decode B=1', 'decode B=2'], [o['phase'] for o in ops]
steps = {'prefill': doc['prefill']['seconds']}
steps.update({f"decode B={x['batch']}": x['seconds_per_step'] for x in doc['decode']})
for o in ops:
    assert abs(o['seconds_per_step'] - steps[o['phase']]) <= 1e-6 * steps[o['phase']] + 2e-6, o['phase']
    assert len(o['blocks']) == 10 and [b['block'] for b in o['blocks']] == list(range(10))
    total = 0
    for b in o['blocks']:
        a, f = b['attn'], b['ffn']
        # every sub-layer ends with its hc_post; attention and experts where they belong
        assert a.get('hc_post', 0) > 0 and f.get('hc_post', 0) > 0, b
        assert a.get('attend', 0) + a.get('sparse_attn', 0) > 0 and a.get('linear_fp8', 0) > 0, b
        assert f.get('experts', 0) > 0 and f.get('router', 0) > 0 and 'experts' not in a, b
        assert ('engram_mix' in a) == (b['block'] in (1, 5)) and 'engram_mix' not in f, b
        assert all(v >= 0 for v in list(a.values()) + list(f.values()))
        total += sum(a.values()) + sum(f.values())
    h = o['head']
    assert h.get('embed', 0) > 0 and h.get('linear_bf16', 0) > 0 and 'experts' not in h, h
    total += sum(h.values())
    # the ops' time is part of the step's; the rest is between ops
    assert total <= o['seconds_per_step'] * 1.001 + 1e-6, (total, o['seconds_per_step'])
    assert abs(o['between_ops_seconds_per_step'] - (o['seconds_per_step'] - total)) <= 1e-6 * o['seconds_per_step'] + 1e-6
print('decode B=1: ops %.3f of %.3f ms/step' % (1e3 * (ops[1]['seconds_per_step'] - ops[1]['between_ops_seconds_per_step']),
                                              1e3 * ops[1]['seconds_per_step']))
EOF4
    then
        ok "--ops: per block, attention and FFN time split by op, the head, the rest between ops"
        sed 's/^/# /' "$work/opscheck.log"
    else
        notok "--ops: per block, attention and FFN time split by op, the head, the rest between ops"
        sed 's/^/# /' "$work/err.log" "$work/opscheck.log"
    fi
    bad=0
    for a in "--threads 0" "--prompt x" "--batches 1,,2" "--cpu sse" "--bandwidth-gib 0" "--steps -1" "--engram-cache-bytes 5XB"; do
        # shellcheck disable=SC2086
        "$bin/ds41-bench" --model "$work/m" $a >/dev/null 2>"$work/e.log"
        rc=$?
        if [ $rc -ne 2 ] || ! [ -s "$work/e.log" ]; then bad=1; echo "# $a: exit $rc"; fi
    done
    "$bin/ds41-bench" --model "$work/none" >/dev/null 2>"$work/e.log"
    rc=$?
    if [ $rc -ne 2 ] || ! grep -q config.json "$work/e.log"; then bad=1; echo "# missing model: exit $rc"; fi
    if [ $bad -eq 0 ]; then ok "bad arguments and a missing checkpoint: exit 2 with a message"; else notok "bad arguments and a missing checkpoint: exit 2 with a message"; fi
fi
if [ "$preset" != bench ]; then
    # --kernels: no checkpoint; every format x row count, consistent fractions.
    if "$bin/ds41-bench" --kernels --json --threads 2 --bandwidth-gib 1 >"$work/k.json" 2>"$work/k.err" &&
        "$py" - "$work/k.json" >"$work/k.log" 2>&1 <<'EOF3'
import json, sys
r = json.load(open(sys.argv[1]))
ks = r["kernels"]
assert r["read_gbs"] > 0 and r["threads"] == 2, r
got = sorted((k["format"], k["rows"]) for k in ks)
want = sorted((f, m) for f in ("fp4", "fp8", "bf16") for m in (1, 4, 16))
assert got == want, got
for k in ks:
    assert k["cache_gbs"] > 0 and k["memory_gbs"] > 0, k
    assert abs(k["memory_fraction"] - k["memory_gbs"] / r["read_gbs"]) < 1e-3, k
    assert k["n"] > 0 and k["k"] > 0 and k["linears"] >= 1, k
print("kernel ceilings:", ", ".join("%s/%d %.2f/%.2f" % (k["format"], k["rows"], k["cache_gbs"], k["memory_gbs"]) for k in ks))
EOF3
    then
        ok "--kernels: the linear kernel's ceilings for fp4/fp8/bf16 x 1/4/16 rows, consistent"; sed 's/^/# /' "$work/k.log"
    else
        notok "--kernels: the linear kernel's ceilings for fp4/fp8/bf16 x 1/4/16 rows, consistent"
        sed 's/^/# /' "$work/k.err" "$work/k.log"
    fi
    "$bin/ds41-bench" --kernels --model "$work/m" >/dev/null 2>"$work/e.log"
    rc=$?
    if [ $rc -eq 2 ] && grep -q -- '--kernels' "$work/e.log"; then
        ok "--kernels with --model: exit 2 with a message"
    else
        notok "--kernels with --model: exit 2 with a message (exit $rc)"
    fi
fi
echo "1..$n"
exit $fail
