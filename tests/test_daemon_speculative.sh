#!/bin/bash
# Speculative decoding in the tools and ds41d (issue 16).  ds41-eval --speculative N with the test
# oracle writes the plain JSON byte for byte plus the speculative counters (every draft accepted),
# and ds41-generate --speculative N prints what plain decoding prints.  ds41d with
# engine.speculative on the random-weight embedded model (which has a DSpark head) loads and
# serves, concurrent seeded greedy clients get exactly the texts of a daemon
# without speculation, /metrics has the speculative counters and the accepted-length histogram,
# ds41ctl status answers; a model without DSpark refuses to load with it on, naming
# dspark_block_size.  (The head's drafts on random weights are rejected: what this shows is that
# drafting, verifying and rolling back change no text; the loop's acceptance paths are
# tests/test_speculative.c's.)
. "$(dirname "$0")/daemon_lib.sh"

prompts=16
run_clients() { # OUT: the texts of $prompts concurrent greedy chats, one line each
    local out=$1 i pids=()
    for i in $(seq 1 $prompts); do
        curl -s --unix-socket "$sock" -H 'Content-Type: application/json' --data-binary \
            "{\"messages\":[{\"role\":\"user\",\"content\":\"Client $i says hello $((i * 7)) times.\"}],\"max_tokens\":12,\"temperature\":0}" \
            -m 300 http://ds41/v1/chat/completions >"$work/r$i.json" &
        pids+=($!)
    done
    wait "${pids[@]}" # (not the daemon)
    for i in $(seq 1 $prompts); do pyj 'o["choices"][0]["message"]["content"] + "|" + o["choices"][0]["finish_reason"]' "$work/r$i.json"; done >"$out"
}

write_config "$work/plain.yaml"
check "daemon starts without speculation" start_daemon "$work/plain.yaml"
run_clients "$work/plain.txt"
stop_daemon
check "plain texts collected" test "$(grep -c '|' "$work/plain.txt")" = $prompts

sed 's/^engine:$/engine:\n  speculative: true\n  speculative_max_draft: 4\n  speculative_min_confidence_pct: 10/' \
    "$work/plain.yaml" >"$work/spec.yaml"
check "daemon starts with engine.speculative on" start_daemon "$work/spec.yaml"
run_clients "$work/spec.txt"
check "$prompts concurrent greedy clients get exactly their texts without speculation" cmp "$work/plain.txt" "$work/spec.txt"
curl -s --unix-socket "$sock" http://ds41/metrics >"$work/metrics"
check "/metrics has the speculative counters and the accepted-length histogram" bash -c \
    "grep -q '^ds41_speculative_steps_total{' '$work/metrics' && grep -q '^ds41_speculative_drafted_total{' '$work/metrics' &&
     grep -q '^ds41_speculative_accepted_total{' '$work/metrics' &&
     grep -q '^ds41_speculative_accepted_length_bucket{.*le=\"+Inf\"}' '$work/metrics'"
check "the DSpark head drafted (ds41_speculative_drafted_total > 0)" bash -c \
    "awk '/^ds41_speculative_drafted_total\\{/ { n += \$NF } END { exit !(n > 0) }' '$work/metrics'"
"$bin/ds41ctl" --socket "$sock" status >"$work/status.txt" 2>&1
check "ds41ctl status answers" test -s "$work/status.txt"
stop_daemon

# a model without DSpark
"$bin/ds41-mkmodel" "$work/nodspark" --quiet --set dspark_block_size=0 --set n_mtp_layers=0 \
    --set 'dspark_target_layer_ids=[]' --set dspark_n_routed_experts=0 --set dspark_n_activated_experts=0 \
    --set dspark_markov_rank=0 --set 'compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 1, 1]' >/dev/null 2>&1
write_config "$work/nod.yaml" "models:" "  - name: nod" "    path: $work/nodspark"
sed -i 's/^engine:$/engine:\n  speculative: true/' "$work/nod.yaml"
"$ds41d" --config "$work/nod.yaml" >"$work/nod.log" 2>&1 &
daemon_pid=$!
for i in $(seq 1 300); do
    grep -q 'dspark_block_size is 0' "$work/nod.log" && break
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.1
done
check "a model without DSpark refuses engine.speculative, naming dspark_block_size" \
    grep -q 'engine.speculative: speculative decoding needs the model.s DSpark head: dspark_block_size is 0' "$work/nod.log"
kill -KILL "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null; daemon_pid=

# ---- the tools ----
"$bin/ds41-mkmodel" "$work/tiny" --quiet >/dev/null 2>&1
ids=5,17,300,42,9,77,1000,3,64
"$bin/ds41-eval" --model "$work/tiny" --ids $ids --decode 14 --out "$work/e_plain.json"
"$bin/ds41-eval" --model "$work/tiny" --ids $ids --decode 14 --chunk 4 --speculative 4 --speculative-oracle --drafts \
    --out "$work/e_spec.json"
r=$("$py" - "$work/e_plain.json" "$work/e_spec.json" <<'PY'
import json, sys
plain = open(sys.argv[1], encoding="utf-8").read()
spec = open(sys.argv[2], encoding="utf-8").read()
cut = spec.find(',"speculative":')
o = json.loads(spec)
sp = o["speculative"]
ok = cut > 0 and spec[:cut] + "}\n" == plain and sp["drafted"] > 0 and sp["accepted"] == sp["drafted"] and \
    sum(len(d["ids"]) for d in o["drafts"]) == sp["drafted"] and all(d["position"] >= 9 for d in o["drafts"])
print("ok" if ok else "differ: %s" % sp)
PY
)
check "ds41-eval --speculative 4 with oracle drafts writes the plain JSON byte for byte plus the counters ($r)" test "$r" = ok
"$bin/ds41-eval" --model "$work/nodspark" --ids 5,6 --decode 2 --speculative 2 --out "$work/e_nod.json" 2>"$work/e_nod.err"
rc=$?
check "ds41-eval --speculative refuses a model without DSpark (exit $rc)" \
    bash -c "test $rc = 2 && grep -q 'dspark_block_size is 0' '$work/e_nod.err'"
"$bin/ds41-generate" --model "$work/tiny" --ids $ids --max-tokens 10 --seed 3 --json >"$work/g_plain.json" 2>/dev/null
"$bin/ds41-generate" --model "$work/tiny" --ids $ids --max-tokens 10 --seed 3 --json --speculative 3 \
    >"$work/g_spec.json" 2>"$work/g_spec.err"
check "ds41-generate --speculative 3 prints what plain decoding prints, and the counters on stderr" \
    bash -c "cmp -s '$work/g_plain.json' '$work/g_spec.json' && grep -q '^\[speculative: ' '$work/g_spec.err'"
finish
