#!/bin/bash
# ds41d with a shard of a mapped checkpoint truncated under it (issue 7): the generated tiny
# checkpoint with its own sharding (dense layer tensors and routed experts mixed in the same
# shards, all mapped), a request decoding while a shard is cut in half.  The SIGBUS guard
# (storage/map_guard.h) keeps the daemon alive; the running request ends with an error naming
# the shard; /health, /v1/models and /admin/models keep answering and report the model failed;
# later requests get the same clear error (never tokens computed on zero pages) while another
# model keeps serving; once the file is restored, `ds41ctl models load` replaces the engine and
# the next request gets the same text as before the fault; a second cut, on the new mappings,
# fails the same way and SIGHUP reloads the default model.  Under the ASan build the daemon's exit status also covers leaks.
#
# ASan: its runtime installs a SIGBUS handler at start (handle_sigbus=1, the default); the
# guard installs its own when the first checkpoint is opened, which replaces ASan's and chains
# to it for faults outside the shards, so nothing needs setting here.
. "$(dirname "$0")/daemon_lib.sh"
ctl=$bin/ds41ctl
mk=$bin/ds41-mkmodel

"$mk" "$work/m" --preset tiny --seed 7 --shard-bytes 2000000 --quiet >/dev/null 2>&1
# A second model, untouched: the daemon keeps serving it while m is failed.
"$mk" "$work/other" --preset tiny --seed 8 --quiet >/dev/null 2>&1
# The shard to cut: one holding both dense layer tensors and routed experts, with a dense
# tensor entirely in its second half (the cut then removes weights every step reads).
pick=$("$py" - "$work/m" <<'EOF'
import json, os, struct, sys
d = sys.argv[1]
best, shards = None, 0
for name in sorted(os.listdir(d)):
    if not name.endswith(".safetensors"):
        continue
    shards += 1
    path = os.path.join(d, name)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    base = 8 + n
    experts = [k for k in h if ".ffn.experts." in k]
    dense_late = [k for k, v in h.items() if k.startswith("layers.") and ".ffn.experts." not in k
                  and base + v["data_offsets"][0] >= size // 2 and v["data_offsets"][1] > v["data_offsets"][0]]
    if experts and dense_late and best is None:
        best = (name, dense_late[0])
print("%s %s %d" % (best + (shards,) if best else ("none", "none", shards)))
EOF
)
read -r shard_name dense_tensor n_shards <<<"$pick"
note "$n_shards shards; shard to cut: $shard_name ($dense_tensor lies in its second half)"
check "tiny generated in several shards, one of them mixing dense layer tensors and routed experts" \
    test "$shard_name" != none -a "$n_shards" -ge 2
if [ "$shard_name" = none ]; then
    finish
    exit 0
fi
shard=$work/m/$shard_name
cp "$shard" "$work/shard.bak"

write_config "$work/d.yaml" "models:
  - name: m
    path: $work/m
    default: true
  - name: other
    path: $work/other"
if ! start_daemon "$work/d.yaml"; then
    notok "the daemon starts on the generated checkpoint"
    finish
    exit 0
fi
"$ctl" --socket "$sock" models load other >/dev/null 2>&1
for i in $(seq 1 300); do
    api GET /admin/models >/dev/null
    [ "$(pyj '[m["state"] for m in o["data"] if m["id"] == "other"]')" = '["ready"]' ] && break
    sleep 0.1
done
req='{"model":"m","prompt":[0,40,41,42,43,44,45,46,47,48,49,50,51,52],"max_tokens":10,"temperature":0}'
other_req=${req/\"m\"/\"other\"}
code=$(api POST /v1/completions "$req")
want=$(pyj 'o["choices"][0]["text"]')
code2=$(api POST /v1/completions "$other_req")
want_other=$(pyj 'o["choices"][0]["text"]')
check "before the fault: completions 200 from both models" test "$code $code2" = "200 200"

# ---- a request decoding while the shard is cut in half ------------------------------------------
long='{"model":"m","prompt":[0,40,41,42],"max_tokens":100000,"ignore_eos":true,"temperature":0,"stream":true}'
curl -sN --unix-socket "$sock" -d "$long" http://ds41/v1/completions >"$work/long.sse" &
long_pid=$!
decoding=no
for i in $(seq 1 200); do
    api GET /admin/sessions >/dev/null
    if [ "$(pyj 'len([s for s in o["data"] if s["state"] == "decode"])' 2>/dev/null)" = 1 ]; then
        decoding=yes
        break
    fi
    sleep 0.05
done
check "a long streamed request is decoding" test $decoding = yes
truncate -s $(($(stat -c %s "$shard") / 2)) "$shard"
for i in $(seq 1 200); do
    kill -0 "$long_pid" 2>/dev/null || break
    sleep 0.05
done
kill "$long_pid" 2>/dev/null
wait "$long_pid" 2>/dev/null
sse_collect "$work/long.sse" >"$work/long.json"
msg=$(pyj '(o["error"] or {}).get("message", "")' "$work/long.json")
note "running request: $(pyj 'len(o["content"])' "$work/long.json") characters, then: $msg"
check "the running request ends with an error event naming the shard (truncated while mapped)" \
    bash -c "[[ \"\$1\" == *$shard_name*'was truncated or became unreadable while mapped (SIGBUS at offset '*'): the model must be reloaded'* ]]" _ "$msg"
check "ds41d is still running" kill -0 "$daemon_pid"
code=$(api GET /health)
health=$(pyj '[(x["id"], x["state"]) for x in o["models"]]')
check "/health answers 200 (other serves) and reports m failed, naming the shard" \
    bash -c "test '$code $(pyj 'o["status"]')' = '200 ok' && test \"\$2\" = '[[\"m\", \"failed\"], [\"other\", \"ready\"]]' && [[ \"\$1\" == *$shard_name* ]]" \
    _ "$(pyj '[x["error"] for x in o["models"] if x["id"] == "m"][0]')" "$health"
code=$(api GET /v1/models)
check "/v1/models answers 200 and lists only the model still working" \
    test "$code $(pyj '[m["id"] for m in o["data"]]')" = '200 ["other"]'
code=$(api GET /admin/models)
check "/admin/models: m is failed, its detail names the shard; other is ready" \
    bash -c "test '$code $(pyj '[(m["id"], m["state"]) for m in o["data"]]')' = '200 [[\"m\", \"failed\"], [\"other\", \"ready\"]]' && [[ \"\$1\" == *$shard_name*'must be reloaded'* ]]" _ "$(pyj '[m["detail"] for m in o["data"] if m["id"] == "m"][0]')"
"$ctl" --socket "$sock" metrics >"$work/metrics.txt"
check "/metrics: ds41_model_state failed for m, ready for other" \
    bash -c "grep -q '^ds41_model_state{model=\"m\",state=\"failed\"} 1' '$work/metrics.txt' &&
             grep -q '^ds41_model_state{model=\"other\",state=\"ready\"} 1' '$work/metrics.txt'"
code=$(api POST /v1/completions "$req")
msg=$(pyj 'o.get("error", {}).get("message", "")' 2>/dev/null)
note "next request: HTTP $code: $msg"
check "the next request gets 503 with the same clear error, no tokens" \
    bash -c "test '$code' = 503 && [[ \"\$1\" == *$shard_name*'truncated or became unreadable'* ]] && ! grep -q '\"choices\"' '$work/body'" _ "$msg"
code=$(api POST /v1/completions "$other_req")
check "the other model keeps serving: same text as before" test "$code $(pyj 'o["choices"][0]["text"]')" = "200 $want_other"
check "the daemon logged the failed step" grep -q "was truncated or became unreadable while mapped" "$work/daemon.log"

# wait_ready: "yes" once /health says m is ready (within 30 s), else "no" (other serves all along,
# so /health itself is 200 throughout).
wait_ready() {
    local i
    for i in $(seq 1 300); do
        if [ "$(api GET /health)" = 200 ] && [ "$(pyj '[x["state"] for x in o["models"] if x["id"] == "m"]')" = '["ready"]' ]; then
            echo yes
            return
        fi
        sleep 0.1
    done
    echo no
}

# ---- restored and reloaded ------------------------------------------------------------------------
cp "$work/shard.bak" "$shard"
"$ctl" --socket "$sock" models load m >"$work/load.txt" 2>&1
rc=$?
note "ds41ctl models load m: $(cat "$work/load.txt")"
ready=$(wait_ready)
check "the shard restored, ds41ctl models load m: the model is ready again" test "$rc $ready" = "0 yes"
check "the daemon logged the reload" grep -q "model m: reloading" "$work/daemon.log"
code=$(api POST /v1/completions "$req")
check "the next request is served with the same text as before the fault" \
    test "$code $(pyj 'o["choices"][0]["text"]')" = "200 $want"

# ---- a second time, on the fresh mappings; SIGHUP reloads the (default) model -------------------
truncate -s 0 "$shard"
code=$(api POST /v1/completions "$req")
msg=$(pyj 'o.get("error", {}).get("message", "")' 2>/dev/null)
check "cut again (to 0 bytes) after the reload: the request fails naming the shard, ds41d runs on" \
    bash -c "test '$code' != 200 && [[ \"\$1\" == *$shard_name*'truncated or became unreadable'* ]] && kill -0 $daemon_pid" _ "$msg"
cp "$work/shard.bak" "$shard"
kill -HUP "$daemon_pid"
ready=$(wait_ready)
code=$(api POST /v1/completions "$req")
check "restored + SIGHUP: ready again, the same text" test "$ready $code $(pyj 'o["choices"][0]["text"]')" = "yes 200 $want"
stop_daemon
check "the daemon exits cleanly (status 0: under ASan, no leaks)" test "$daemon_status" = 0
check "no sanitizer report in the daemon log" bash -c "! grep -q 'Sanitizer' '$work/daemon.log'"
finish
