#!/bin/bash
# Model load progress (issue 18): the admin model listing's "load" object (state, bytes and tensors
# of the tensor plan bound so far) while a load runs and after it, its totals equal to the
# checkpoint's tensor count and payload bytes; `ds41ctl models load NAME --wait` piped (not a
# terminal) prints the daemon's progress lines, then ready.  The DS41_TEST_LOAD_STEP_MS hook slows
# each progress step so the tiny model's load can be watched in flight; nothing here measures time.
# TAP.
. "$(dirname "$0")/daemon_lib.sh"
ctl=$bin/ds41ctl
mk=$bin/ds41-mkmodel

"$mk" "$work/m" --preset tiny --seed 7 --quiet >/dev/null 2>&1
"$mk" "$work/other" --preset tiny --seed 8 --quiet >/dev/null 2>&1
write_config "$work/d.yaml" "models:
  - name: m
    path: $work/m
    default: true
  - name: other
    path: $work/other"
if ! start_daemon "$work/d.yaml"; then
    notok "ds41d starts with two models"
    finish
    exit 0
fi
ok "ds41d starts with two models (m the default)"

# what the checkpoints hold: the index's tensors and payload bytes (metadata.total_size)
for d in m other; do
    read -r "n_$d" "b_$d" < <(pyj '"%d %d" % (len(o["weight_map"]), o["metadata"]["total_size"])' "$work/$d/model.safetensors.index.json")
done
note "m: $n_m tensors, $b_m bytes; other: $n_other tensors, $b_other bytes"

api GET /admin/models >/dev/null
check "after the load: m's load object is done with every tensor and byte of the checkpoint" \
    test "$(pyj '[(x["load"]["state"], x["load"]["tensors_done"], x["load"]["tensors_total"], x["load"]["bytes_done"], x["load"]["bytes_total"]) for x in o["data"] if x["id"] == "m"][0]')" = \
    "('done', $n_m, $n_m, $b_m, $b_m)"
check "a model never loaded has no load object" \
    test "$(pyj '[("load" in x, x["state"]) for x in o["data"] if x["id"] == "other"][0]')" = "(False, 'unloaded')"
"$ctl" --socket "$sock" --json models ls >"$work/ls.json"
check "ds41ctl --json models ls carries the same load object" \
    test "$(pyj '[x["load"]["tensors_done"] for x in o["data"] if x["id"] == "m"][0]' "$work/ls.json")" = "$n_m"

# a slowed load, watched from another thread of the daemon (the admin route) while it runs
stop_daemon TERM
DS41_TEST_LOAD_STEP_MS=150 start_daemon "$work/d.yaml" || { notok "ds41d restarts"; finish; exit 0; }
"$ctl" --socket "$sock" models load other --wait >"$work/wait.txt" 2>&1 &
wait_pid=$!
: >"$work/seen"
while kill -0 "$wait_pid" 2>/dev/null; do
    curl -s --unix-socket "$sock" http://ds41/admin/models >"$work/poll.json" &&
        pyj '[("%s %d %d %d %d" % (x["load"]["state"], x["load"]["tensors_done"], x["load"]["tensors_total"], x["load"]["bytes_done"], x["load"]["bytes_total"])) for x in o["data"] if x["id"] == "other" and "load" in x][0]' "$work/poll.json" >>"$work/seen" 2>/dev/null
    sleep 0.05
done
wait "$wait_pid"
rc=$?
sed 's/^/# ctl: /' "$work/wait.txt"
note "polled: $(sort -u "$work/seen" | tr '\n' ';')"
check "during the load: the admin route showed it binding, part of the tensors and bytes done" \
    bash -c "awk '\$1 == \"binding\" && \$2 > 0 && \$2 < \$3 && \$4 > 0 && \$4 < \$5 && \$3 == $n_other && \$5 == $b_other { f = 1 } END { exit !f }' '$work/seen'"
check "during the load: tensors and bytes done never went backwards" \
    bash -c "awk '\$2 < t || \$4 < b { bad = 1 } { t = \$2; b = \$4 } END { exit bad }' '$work/seen'"
check "models load other --wait, not a terminal: exit 0, progress lines, then ready" \
    bash -c "test $rc = 0 && grep -Eq '^other: loading \\(binding the weights: [0-9]+% \\([^)]* of [^)]*, [0-9]+ of $n_other tensors\\)\\)$' '$work/wait.txt' &&
             tail -1 '$work/wait.txt' | grep -q '^other: ready$' && ! grep -q \$'\\r' '$work/wait.txt'"
check "models load --wait: the percentages it printed rise" \
    bash -c "grep -o 'weights: [0-9]*%' '$work/wait.txt' | tr -dc '0-9\n' | awk 'NR > 1 && \$1 < p { bad = 1 } { p = \$1 } END { exit bad || NR < 2 }'"
api GET /admin/models >/dev/null
check "after the slowed load: other's totals equal its checkpoint's" \
    test "$(pyj '[(x["load"]["state"], x["load"]["tensors_done"], x["load"]["bytes_done"]) for x in o["data"] if x["id"] == "other"][0]')" = \
    "('done', $n_other, $b_other)"
check "the daemon's log has the progress lines it sent as STATUS=" \
    grep -q "model other: binding the weights: 100% (.* of .*, $n_other of $n_other tensors)" "$work/daemon.log"

stop_daemon TERM
check "ds41d exits 0 on SIGTERM" test "$daemon_status" = 0
finish
