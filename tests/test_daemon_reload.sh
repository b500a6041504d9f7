#!/bin/bash
# ds41d with several models (issue 13 items 3 and 4): SIGHUP is transactional -- a configuration
# whose default model path has a typo is refused before anything running is touched (both models
# keep serving, a stream in flight completes, the log names the key, the daemon keeps running),
# and a valid change applies only what changed (a changed path loads beside the running model and
# takes over once ready while the old one finishes its stream; an added and a removed model are
# logged as such).  /health is 200 while any model is ready and lists every configured model with
# its state; a request for a configured model that is not loaded says how to load it; `ds41ctl
# models load NAME --wait` prints the state transitions and waits for ready (exit 1 on failure).
# Under the ASan build the daemon's exit status also covers leaks.
. "$(dirname "$0")/daemon_lib.sh"
ctl=$bin/ds41ctl
mk=$bin/ds41-mkmodel

"$mk" "$work/m" --preset tiny --seed 7 --quiet >/dev/null 2>&1
"$mk" "$work/other" --preset tiny --seed 8 --quiet >/dev/null 2>&1
"$mk" "$work/m2" --preset tiny --seed 9 --quiet >/dev/null 2>&1

# config FILE M_PATH [extra models YAML]
config() {
    write_config "$1" "models:
  - name: m
    path: $2
    default: true
  - name: other
    path: $work/other${3:+
$3}" "limits:
  drain_timeout_s: 600"
}
config "$work/d.yaml" "$work/m"
if ! start_daemon "$work/d.yaml"; then
    notok "ds41d starts with two models"
    finish
    exit 0
fi
ok "ds41d starts with two models (m the default)"

# ---- item 4: /health, a configured model that is not loaded, models load --wait ------------------
code=$(api GET /health)
check "/health with m ready and other not loaded: 200, every configured model with its state" \
    test "$code $(pyj '(o["status"], [(x["id"], x["state"]) for x in o["models"]])')" = \
    "200 ('ok', [('m', 'ready'), ('other', 'unloaded')])"
req='{"model":"m","prompt":[0,40,41,42,43,44,45,46,47,48,49,50,51,52],"max_tokens":10,"temperature":0}'
other_req=${req/\"m\"/\"other\"}
code=$(api POST /v1/completions "$other_req")
msg=$(pyj 'o["error"]["message"]')
note "a request for other while unloaded: HTTP $code: $msg"
check "a request for a configured model that is not loaded: 503 model_not_loaded saying how to load it" \
    bash -c "test '$code $(pyj 'o["error"]["code"]')' = '503 model_not_loaded' &&
             [[ \"\$1\" == *\"model 'other' is configured but not loaded; load it with \\\`ds41ctl models load other\\\` or POST /admin/models/load\"* ]]" _ "$msg"
"$ctl" --socket "$sock" models load other --wait >"$work/wait.txt" 2>&1
rc=$?
sed 's/^/# ctl: /' "$work/wait.txt"
check "models load other --wait: exit 0 after printing loading then ready, other ready" \
    bash -c "test $rc = 0 && grep -q '^other: loading' '$work/wait.txt' && tail -1 '$work/wait.txt' | grep -q '^other: ready' &&
             test \"\$(curl -s --unix-socket '$sock' http://ds41/admin/models | $py -c 'import json,sys; print([m[\"state\"] for m in json.load(sys.stdin)[\"data\"] if m[\"id\"] == \"other\"][0])')\" = ready"
"$ctl" --socket "$sock" models unload m >/dev/null 2>&1
code=$(api GET /health)
check "the default model unloaded while other serves: /health stays 200 and says m is unloaded" \
    test "$code $(pyj '(o["status"], [(x["id"], x["state"]) for x in o["models"]])')" = \
    "200 ('ok', [('m', 'unloaded'), ('other', 'ready')])"
code=$(api POST /v1/completions "$req")
check "a request for the unloaded default model names the load command" \
    bash -c "test '$code' = 503 && grep -q 'ds41ctl models load m' '$work/body'"
"$ctl" --socket "$sock" models load m --wait >"$work/wait2.txt" 2>&1
rc=$?
check "models load m --wait: ready again (exit 0)" bash -c "test $rc = 0 && tail -1 '$work/wait2.txt' | grep -q '^m: ready'"
stop_daemon
check "the daemon exits cleanly" test "$daemon_status" = 0

# ---- item 3: reloads, on a fresh daemon with both models loaded ----------------------------------
mv "$work/daemon.log" "$work/daemon1.log"
if ! start_daemon "$work/d.yaml"; then
    notok "ds41d starts again"
    finish
    exit 0
fi
api POST /admin/models/load '{"name":"other"}' >/dev/null
for i in $(seq 1 300); do
    api GET /admin/models >/dev/null
    [ "$(pyj '[x["state"] for x in o["data"]]')" = '["ready", "ready"]' ] && break
    sleep 0.1
done

code=$(api POST /v1/completions "$req")
want=$(pyj 'o["choices"][0]["text"]')
code2=$(api POST /v1/completions "$other_req")
want_other=$(pyj 'o["choices"][0]["text"]')
check "both models serve" test "$code $code2" = "200 200"

# decoding: the number of sessions decoding now (nothing when the daemon does not answer)
decoding() {
    rm -f "$work/body"
    [ "$(api GET /admin/sessions)" = 200 ] && pyj 'len([s for s in o["data"] if s["state"] == "decode"])'
}
# long_stream FILE: a streamed completion on m of $long tokens in the background (pid in $stream_pid),
# returns once it is decoding.
long=2000
long_stream() {
    curl -sN --unix-socket "$sock" -H 'Content-Type: application/json' \
        -d "{\"model\":\"m\",\"prompt\":[0,60,61,62,63],\"max_tokens\":$long,\"ignore_eos\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true}}" \
        http://ds41/v1/completions >"$1" &
    stream_pid=$!
    local i
    for i in $(seq 1 200); do
        [ "$(decoding)" = 1 ] && return 0
        sleep 0.05
    done
    return 1
}
# stream_ok FILE: the stream ended normally with all $long tokens
stream_ok() {
    sse_collect "$1" >"$1.json"
    test "$(pyj '(o["error"], o["finish_reason"], (o["usage"] or {}).get("completion_tokens"), o["done"])' "$1.json")" = \
        "(None, 'length', $long, True)"
}

# ---- a reload with a typo in the default model's path -------------------------------------------
long_stream "$work/s1.sse"
check "a long stream on m is decoding" test $? = 0
config "$work/d.yaml" "$work/m-typo"
since=$(wc -l <"$work/daemon.log")
kill -HUP "$daemon_pid"
for i in $(seq 1 200); do grep -q 'reload: models.m.path' "$work/daemon.log" && break; sleep 0.05; done
busy=$(decoding)
grep 'reload' "$work/daemon.log" | sed 's/^/# daemon: /'
check "the stream was still decoding when the reload was refused" test "$busy" = 1
check "the daemon is still running" kill -0 "$daemon_pid"
check "the log names the key and both paths and keeps the running configuration" \
    grep -q "reload: models.m.path changed from $work/m to $work/m-typo: $work/m-typo: No such file or directory (keeping the running configuration" "$work/daemon.log"
check "nothing was unloaded or called removed" \
    bash -c "! tail -n +$((since + 1)) '$work/daemon.log' | grep -q 'removed from the configuration\|unloaded\|cancel'"
code=$(api GET /health)
check "/health: 200, both models ready" \
    test "$code $(pyj '[(x["id"], x["state"]) for x in o["models"]]')" = '200 [["m", "ready"], ["other", "ready"]]'
code=$(api POST /v1/completions "$req")
code2=$(api POST /v1/completions "$other_req")
t2=$(pyj 'o["choices"][0]["text"]')
api POST /v1/completions "$req" >/dev/null
check "both models still serve, the same text as before" \
    test "$code $code2 $(pyj 'o["choices"][0]["text"]') $t2" = "200 200 $want $want_other"
wait "$stream_pid"
check "the in-flight stream completes (all $long tokens, finish_reason length, no error)" stream_ok "$work/s1.sse"

# ---- a valid change: m moves to another directory, a model is added --------------------------------
long_stream "$work/s2.sse"
check "a second long stream on m is decoding" test $? = 0
config "$work/d.yaml" "$work/m2" "  - name: third
    path: $work/m"
kill -HUP "$daemon_pid"
for i in $(seq 1 600); do grep -q 'model m now serves' "$work/daemon.log" && break; sleep 0.05; done
# (the old model is out of the list now, so /admin/sessions no longer shows its stream: the client does)
busy=$(kill -0 "$stream_pid" 2>/dev/null && ! grep -q '\[DONE\]' "$work/s2.sse" && echo 1)
grep 'reload\|now serves' "$work/daemon.log" | tail -n +2 | sed 's/^/# daemon: /'
check "the log says which key changed and what was added" \
    bash -c "grep -q 'reload: models.m.path changed from $work/m to $work/m2: reloading m' '$work/daemon.log' &&
             grep -q 'reload: model third added ($work/m)' '$work/daemon.log' && ! grep -q 'model m removed' '$work/daemon.log'"
check "m now serves the new directory while the old one still decodes its stream" \
    bash -c "grep -q 'model m now serves $work/m2 (was $work/m)' '$work/daemon.log' && test '$busy' = 1"
code=$(api GET /admin/models)
check "/admin/models: m ready at the new path, other ready, third unloaded" \
    test "$code $(pyj '[(x["id"], x["state"], x["path"]) for x in o["data"]]')" = \
    "200 [[\"m\", \"ready\", \"$work/m2\"], [\"other\", \"ready\", \"$work/other\"], [\"third\", \"unloaded\", \"$work/m\"]]"
code=$(api POST /v1/completions "$req")
t_new=$(pyj 'o["choices"][0]["text"]')
code2=$(api POST /v1/completions "$other_req")
check "requests for m get the new checkpoint's text, other unchanged" \
    test "$code $code2 $([ "$t_new" != "$want" ] && echo differs) $(pyj 'o["choices"][0]["text"]')" = "200 200 differs $want_other"
wait "$stream_pid"
check "the stream on the old directory completes (all $long tokens)" stream_ok "$work/s2.sse"
for i in $(seq 1 200); do grep -q "model m: $work/m unloaded" "$work/daemon.log" && break; sleep 0.05; done
check "then the old directory is unloaded" grep -q "model m: $work/m unloaded" "$work/daemon.log"

# ---- a directory with a config and no shards is refused up front ------------------------------------
mkdir -p "$work/noshards/inference"
cp "$work/m2/inference/config.json" "$work/noshards/inference/"
config "$work/d.yaml" "$work/noshards" "  - name: third
    path: $work/m"
since=$(wc -l <"$work/daemon.log")
kill -HUP "$daemon_pid"
for i in $(seq 1 200); do grep -q 'reload: models.m.path changed from .* to .*/noshards' "$work/daemon.log" && break; sleep 0.05; done
check "a new path with a config but no checkpoint: refused before anything changes, naming the key" \
    bash -c "grep -q 'reload: models.m.path changed from $work/m2 to $work/noshards: $work/noshards: no checkpoint here: .*(keeping the running configuration' '$work/daemon.log' &&
             ! tail -n +$((since + 1)) '$work/daemon.log' | grep -q 'reloading m\|unloaded'"

# ---- a new path that passes the checks but fails to load: the old directory keeps serving ----------
cp -r "$work/m2" "$work/broken"
echo '{"not": "a tokenizer"}' >"$work/broken/tokenizer.json"
config "$work/d.yaml" "$work/broken" "  - name: third
    path: $work/m"
kill -HUP "$daemon_pid"
for i in $(seq 1 200); do grep -q "the new path $work/broken failed to load" "$work/daemon.log" && break; sleep 0.05; done
grep "broken" "$work/daemon.log" | sed 's/^/# daemon: /'
check "a new path whose checkpoint fails to load: logged, the old directory keeps serving" \
    bash -c "grep -q 'model m: the new path $work/broken failed to load: .*; $work/m2 keeps serving' '$work/daemon.log' &&
             test \"\$(curl -s --unix-socket '$sock' -H 'Content-Type: application/json' -d '$req' http://ds41/v1/completions |
                      $py -c 'import json,sys; print(json.load(sys.stdin)[\"choices\"][0][\"text\"])')\" = \"\$1\"" _ "$t_new"
api GET /admin/models >/dev/null
check "/admin/models still shows m ready at $work/m2" \
    test "$(pyj '[(x["state"], x["path"]) for x in o["data"] if x["id"] == "m"]')" = "[[\"ready\", \"$work/m2\"]]"

# ---- a removed model ------------------------------------------------------------------------------
config "$work/d.yaml" "$work/m2"
kill -HUP "$daemon_pid"
for i in $(seq 1 200); do grep -q 'model third removed' "$work/daemon.log" && break; sleep 0.05; done
check "a removed model is logged as removed from the configuration" \
    grep -q 'reload: model third removed from the configuration: unloading' "$work/daemon.log"
code=$(api GET /health)
check "/health lists the two configured models" test "$code $(pyj '[x["id"] for x in o["models"]]')" = '200 ["m", "other"]'

stop_daemon
check "the daemon exits cleanly (status 0: under ASan, no leaks)" test "$daemon_status" = 0
check "no sanitizer report in the daemon log" bash -c "! grep -q 'Sanitizer' '$work/daemon.log'"
finish
