#!/bin/bash
# ds41d end to end with curl over its real Unix socket, on the embedded model generated on first
# start into a temporary state directory: configuration checks, health and models, chat and
# completions (stream and not), forced reasoning and tool calls (streamed as deltas), tool_choice, the prefix cache, errors,
# tokenize/detokenize, metrics, admin routes, SIGTERM.  TAP.
. "$(dirname "$0")/daemon_lib.sh"

# ---- configuration -------------------------------------------------------------------------------
cfg=$work/ds41d.yaml
write_config "$cfg"
"$ds41d" --config "$cfg" --check-config >"$work/eff.yaml" 2>"$work/check.err"; rc=$?
check "--check-config: exit 0 and the effective YAML (socket $sock)" \
    bash -c "test $rc -eq 0 && grep -q 'socket: $sock' '$work/eff.yaml' && grep -q 'test_forced_output: true' '$work/eff.yaml'"
printf 'engine:\n  threads: many\n' >"$work/bad.yaml"
"$ds41d" --config "$work/bad.yaml" --check-config >/dev/null 2>"$work/bad.err"; rc=$?
check "--check-config on a bad value: non-zero, FILE:LINE:COLUMN and the key" \
    bash -c "test $rc -ne 0 && grep -q 'bad.yaml:2:12: key .engine.threads.' '$work/bad.err'"
"$ds41d" --config "$cfg" --socket "$work/other.sock" --model /srv/none --check-config >"$work/ovr.yaml" 2>/dev/null
check "--socket and --model override the file (the model served as deepseek-v4.1-flash)" \
    bash -c "grep -q 'socket: $work/other.sock' '$work/ovr.yaml' && grep -q 'name: deepseek-v4.1-flash' '$work/ovr.yaml' && grep -q 'path: /srv/none' '$work/ovr.yaml'"
"$ds41d" --config "$work/missing.yaml" >/dev/null 2>"$work/missing.err"; rc=$?
check "a missing --config file: non-zero with a message naming it" \
    bash -c "test $rc -ne 0 && grep -q 'missing.yaml' '$work/missing.err'"

# ---- start: the embedded model is generated and served ----------------------------------------
if ! start_daemon "$cfg"; then
    notok "ds41d starts and /health answers 200"; finish; exit 0
fi
ok "ds41d starts, generates the embedded model and /health answers 200"
check "the embedded checkpoint is in the state directory" test -f "$state/embedded/tiny-seed1/inference/config.json"
check "the socket is mode 0660" test "$(stat -c %a "$sock")" = 660
code=$(api GET /health)
check "GET /health: status ok and the model's state" \
    test "$code $(pyj '(o["status"], o["models"])')" = "200 ('ok', [{'id': 'ds41-tiny', 'state': 'ready'}])"
code=$(api GET /v1/models)
check "GET /v1/models lists ds41-tiny only (never the real model's name)" \
    test "$code $(pyj '[m["id"] for m in o["data"]]')" = '200 ["ds41-tiny"]'

# ---- chat ------------------------------------------------------------------------------------------
chat='{"model":"ds41-tiny","messages":[{"role":"user","content":"Tell me a story."}],"max_tokens":12,"seed":42,"temperature":0.8}'
code=$(api POST /v1/chat/completions "$chat")
cp "$work/body" "$work/chat1.json"
check "chat: 200 chat.completion from ds41-tiny, 12 tokens, finish length" \
    test "$code $(pyj '(o["object"], o["model"], o["usage"]["completion_tokens"], o["choices"][0]["finish_reason"])')" = \
    "200 ('chat.completion', 'ds41-tiny', 12, 'length')"
code=$(api POST /v1/chat/completions "$chat")
check "chat: the same seed gives the same content" \
    test "$(pyj 'o["choices"][0]["message"]["content"]')" = "$(pyj 'o["choices"][0]["message"]["content"]' "$work/chat1.json")"
schat='{"model":"ds41-tiny","messages":[{"role":"user","content":"Tell me a story."}],"max_tokens":12,"seed":42,"temperature":0.8,"stream":true,"stream_options":{"include_usage":true}}'
curl -sN --unix-socket "$sock" -H 'Content-Type: application/json' -d "$schat" http://ds41/v1/chat/completions >"$work/s1.sse"
sse_collect "$work/s1.sse" >"$work/s1.json"
check "chat stream: SSE chunks, usage, [DONE]; the text equals the non-streamed answer" \
    test "$(pyj '(o["done"], o["finish_reason"], o["usage"]["completion_tokens"], o["content"])' "$work/s1.json")" = \
    "$(pyj '(True, "length", 12, o["choices"][0]["message"]["content"])' "$work/chat1.json")"
check "chat stream: text arrives in several chunks" test "$(pyj 'o["chunks"] > 5' "$work/s1.json")" = True

# prefix cache: the same prompt again re-uses all but the last prompt token
code=$(api POST /v1/chat/completions "$chat")
check "a prefix-cache hit: cached_tokens = prompt_tokens - 1, same content" \
    test "$(pyj '(o["usage"]["prompt_tokens_details"]["cached_tokens"] == o["usage"]["prompt_tokens"] - 1, o["choices"][0]["message"]["content"])')" = \
    "$(pyj '(True, o["choices"][0]["message"]["content"])' "$work/chat1.json")"

# thinking, forced reasoning and a DSML tool call
cat >"$work/tool.json" <<'EOF'
{"messages":[{"role":"user","content":"Weather in Paris?"}],
 "tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],
 "thinking":{"type":"enabled"},
 "ds41_forced_output":"The user wants the weather.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>"}
EOF
code=$(api POST /v1/chat/completions "@$work/tool.json")
check "forced output: reasoning_content, one get_weather call with {\"city\": \"Paris\"}, finish tool_calls" \
    test "$code $(pyj '(o["choices"][0]["message"]["reasoning_content"], [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in o["choices"][0]["message"]["tool_calls"]], o["choices"][0]["finish_reason"], o["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0)')" = \
    "200 ('The user wants the weather.', [('function', 'get_weather', {'city': 'Paris'})], 'tool_calls', True)"
"$py" -c 'import json,sys;o=json.load(open(sys.argv[1]));o["stream"]=True;print(json.dumps(o))' "$work/tool.json" >"$work/tool_s.json"
curl -sN --unix-socket "$sock" -H 'Content-Type: application/json' --data-binary "@$work/tool_s.json" \
    http://ds41/v1/chat/completions >"$work/tool.sse"
sse_collect "$work/tool.sse" >"$work/tool_s.out"
check "forced output streamed: the same reasoning and tool call (with an id), finish tool_calls" \
    test "$(pyj '(o["reasoning_content"], [(c["function"]["name"], json.loads(c["function"]["arguments"]), c["id"].startswith("call_")) for c in o["tool_calls"]], o["finish_reason"], o["content"])' "$work/tool_s.out")" = \
    "('The user wants the weather.', [('get_weather', {'city': 'Paris'}, True)], 'tool_calls', '')"
"$py" - "$work/tool.sse" >"$work/tool_raw.out" <<'EOF'
import json, sys
parts = []
for line in open(sys.argv[1], encoding="utf-8"):
    if line.startswith("data: {"):
        for ch in json.loads(line[6:]).get("choices", []):
            parts += ch.get("delta", {}).get("tool_calls") or []
first = parts[0] if parts else {}
print(len(parts) == 2, sorted(first), first.get("function"),
      all(sorted(p) == ["function", "index"] and sorted(p["function"]) == ["arguments"] for p in parts[1:]))
EOF
check "tool call streamed as deltas: first chunk index, id, type, name with arguments \"\", then the arguments whole (a call streams once its invoke is complete)" \
    test "$(cat "$work/tool_raw.out")" = "True ['function', 'id', 'index', 'type'] {'name': 'get_weather', 'arguments': ''} True"

# tool_choice naming a function makes the random model call it, streamed or not
cat >"$work/named.json" <<'EOF'
{"messages":[{"role":"user","content":"Weather in Paris?"}],
 "tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],
 "tool_choice":{"type":"function","function":{"name":"get_weather"}},
 "thinking":{"type":"disabled"}, "max_tokens":60, "seed":7, "temperature":1, "logprobs":true, "top_logprobs":3}
EOF
code=$(api POST /v1/chat/completions "@$work/named.json")
check "tool_choice named without forced output (with logprobs): one get_weather call with JSON arguments, finish tool_calls" \
    test "$code $(pyj '([(c["function"]["name"], type(json.loads(c["function"]["arguments"])).__name__) for c in o["choices"][0]["message"]["tool_calls"]], o["choices"][0]["finish_reason"])')" = \
    "200 ([('get_weather', 'dict')], 'tool_calls')"
named_args=$(pyj 'o["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]')
"$py" -c 'import json,sys;o=json.load(open(sys.argv[1]));o["stream"]=True;print(json.dumps(o))' "$work/named.json" >"$work/named_s.json"
curl -sN --unix-socket "$sock" -H 'Content-Type: application/json' --data-binary "@$work/named_s.json" \
    http://ds41/v1/chat/completions >"$work/named.sse"
sse_collect "$work/named.sse" >"$work/named_s.out"
check "tool_choice named, streamed: the same call from the pieces" \
    test "$(pyj '([(c["function"]["name"], c["function"]["arguments"]) for c in o["tool_calls"]], o["finish_reason"])' "$work/named_s.out")" = \
    "$("$py" -c 'import sys; print(([("get_weather", sys.argv[1])], "tool_calls"))' "$named_args")"
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"Hi"}],"reasoning_effort":"low","max_tokens":3,"ds41_forced_output":"ok</think>Hello!<｜end▁of▁sentence｜>"}')
check "reasoning_effort implies thinking: reasoning and content split at </think>" \
    test "$code $(pyj '(o["choices"][0]["message"].get("reasoning_content"), o["choices"][0]["finish_reason"])')" = "200 ('ok', 'length')"

# ---- completions ------------------------------------------------------------------------------------
code=$(api POST /v1/completions '{"prompt":"Once upon a time","max_tokens":7,"seed":5}')
check "completions: 200 text_completion, 7 tokens" \
    test "$code $(pyj '(o["object"], o["usage"]["completion_tokens"], len(o["choices"][0]["text"]) > 0)')" = "200 ('text_completion', 7, True)"
cp "$work/body" "$work/cmpl.json"
curl -sN --unix-socket "$sock" -d '{"prompt":"Once upon a time","max_tokens":7,"seed":5,"stream":true}' \
    http://ds41/v1/completions >"$work/cmpl.sse"
sse_collect "$work/cmpl.sse" >"$work/cmpl_s.json"
check "completions stream: the same text" \
    test "$(pyj 'o["content"]' "$work/cmpl_s.json")" = "$(pyj 'o["choices"][0]["text"]' "$work/cmpl.json")"
code=$(api POST /v1/completions '{"prompt":[0,40,41,42],"max_tokens":3,"temperature":0,"logprobs":2}')
check "completions from token ids with logprobs (2 alternatives each)" \
    test "$code $(pyj '(len(o["choices"][0]["logprobs"]["tokens"]), all(len(t) == 2 for t in o["choices"][0]["logprobs"]["top_logprobs"]))')" = "200 (3, True)"

# ---- tokenize / detokenize ---------------------------------------------------------------------------
code=$(api POST /tokenize '{"content":"hello world"}')
ids=$(pyj 'o["tokens"]')
code2=$(api POST /detokenize "{\"tokens\":$ids}")
check "tokenize then detokenize gives the text back" test "$code $code2 $(pyj 'o["content"]')" = "200 200 hello world"
code=$(api POST /tokenize '{"messages":[{"role":"user","content":"Hi"}]}')
check "tokenize messages: the chat prompt's ids (BOS first)" test "$code $(pyj 'o["tokens"][0]')" = "200 0"

# ---- errors -------------------------------------------------------------------------------------------
code=$(api POST /v1/chat/completions '{"messages":[')
check "invalid JSON: 400 invalid_json" test "$code $(pyj 'o["error"]["code"]')" = "400 invalid_json"
code=$(api POST /v1/chat/completions '{"model":"gpt-4","messages":[{"role":"user","content":"x"}]}')
check "unknown model: 404 model_not_found" test "$code $(pyj 'o["error"]["code"]')" = "404 model_not_found"
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"x"}],"logit_bias":{"5000":5}}')
check "logit_bias outside the vocabulary: 400 naming logit_bias" test "$code $(pyj 'o["error"]["param"]')" = "400 logit_bias"
long=$("$py" -c 'print(",".join(["7"] * 5000))')
code=$(api POST /v1/completions "{\"prompt\":[$long],\"max_tokens\":1}")
check "a prompt over the context: 400 context_length_exceeded" test "$code $(pyj 'o["error"]["code"]')" = "400 context_length_exceeded"
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"x"}],"frobnicate":1}')
check "an unknown field: 400 unknown_field" test "$code $(pyj 'o["error"]["code"]')" = "400 unknown_field"

# ---- metrics and admin --------------------------------------------------------------------------------
curl -s --unix-socket "$sock" http://ds41/metrics >"$work/metrics.txt"
check "metrics: requests by outcome, tokens, queue, KV bytes, decode histogram, prefix hit rate" \
    bash -c "grep -q '^ds41_requests_total{model=\"ds41-tiny\",outcome=\"tool_calls\"} 4' '$work/metrics.txt' &&
             grep -q '^ds41_generated_tokens_total' '$work/metrics.txt' && grep -q '^ds41_queue_depth' '$work/metrics.txt' &&
             grep -q '^ds41_kv_cache_bytes{model=\"ds41-tiny\",state=\"free\"}' '$work/metrics.txt' &&
             grep -q '^ds41_decode_batch_sequences_bucket{model=\"ds41-tiny\",le=\"+Inf\"}' '$work/metrics.txt' &&
             grep -q '^ds41_cache_hit_ratio{model=\"ds41-tiny\",tier=\"prefix\"}' '$work/metrics.txt' &&
             grep -q '^ds41_http_requests_total' '$work/metrics.txt' && ! grep -q 'tier=\"engram\"' '$work/metrics.txt'"
code=$(api GET /admin/sessions)
check "admin sessions (root): prefix-cache sessions with kv_bytes = kv_pages x page bytes" \
    test "$code $(pyj 'len(o["data"]) > 0 and all(s["kv_bytes"] == s["kv_pages"] * 4480 for s in o["data"])')" = "200 True"
first=$(pyj 'o["data"][0]["id"]')
code=$(api DELETE "/admin/sessions/$first")
code2=$(api DELETE "/admin/sessions/$first")
check "deleting a session: 200, then 404" test "$code $code2" = "200 404"
code=$(api GET /admin/cache)
check "admin cache: pages, bytes per token, kv, prefix, snapshot and experts tiers" \
    test "$code $(pyj '(o["page_bytes"], [t["name"] for t in o["tiers"]], o["pages_used"] + o["pages_free"] == o["pages_total"])')" = \
    "200 (4480, ['kv', 'prefix', 'snapshots', 'experts'], True)"
code=$(api POST /admin/models/load '{"path":"/etc"}')
check "admin load of a path outside the model directories: 403" test "$code" = 403
code=$(api POST /admin/models/load '{"name":"ds41-tiny"}')
check "admin load of the loaded model: 200 ready" test "$code $(pyj 'o["status"]')" = "200 ready"

# ---- stop ------------------------------------------------------------------------------------------------
stop_daemon TERM
check "SIGTERM: exit status 0" test "$daemon_status" = 0
check "the socket file is removed" test ! -e "$sock"
check "the log has levels and the drain" grep -q 'ds41d: info: SIGTERM: stopping' "$work/daemon.log"

# ---- test hook off, one slot, a queue of one, a small KV cache ---------------------------------------
write_config "$work/nohook.yaml" "limits:" "  max_queue: 1" "memory:" "  kv_cache_bytes: 384KiB" "  engram_cache_bytes: 4KiB"
sed -i 's/test_forced_output: true/test_forced_output: false/; s/max_sequences: 32/max_sequences: 1/' "$work/nohook.yaml"
if start_daemon "$work/nohook.yaml"; then
    code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"x"}],"ds41_forced_output":"hi"}')
    check "without engine.test_forced_output the hook is a 400 naming it (the model was not regenerated)" \
        bash -c "test '$code $(pyj 'o["error"]["param"]')' = '400 ds41_forced_output' && ! grep -q 'generated the embedded model' '$work/daemon.log'"
    # prompt + max_tokens beyond the whole KV pool: refused up front (400), not 503 kv_full forever
    code=$(curl -s -D "$work/h400" -o "$work/body" -w '%{http_code}' --unix-socket "$sock" \
        -d '{"prompt":[7,7,7,7,7,7,7,7,7,7],"max_tokens":100000}' http://ds41/v1/completions)
    msg=$(pyj 'o["error"]["message"]')
    note "HTTP $code: $msg"
    check "prompt + max_tokens beyond the whole KV pool (384 KiB): 400 request_too_large_for_kv_pool naming the sizes, no Retry-After" \
        bash -c "test '$code $(pyj 'o["error"]["code"] + "/" + o["error"]["param"]')' = '400 request_too_large_for_kv_pool/max_tokens' &&
                 [[ \"\$1\" == *'a prompt of 10 tokens + max_tokens 100000 (clipped to the context of 4096 tokens) needs the KV of 4095 tokens'*'the whole pool holds '*' pages ('*' tokens)'* ]] &&
                 ! grep -qi '^Retry-After' '$work/h400'" _ "$msg"
    # the tokens the pool holds, from the message: at that exact boundary a request is served to its end
    pool_tokens=$(sed -n 's/.*the whole pool holds [0-9]* pages (\([0-9]*\) tokens).*/\1/p' <<<"$msg")
    fit=$((pool_tokens - 10 + 1))
    code=$(api POST /v1/completions "{\"prompt\":[7,7,7,7,7,7,7,7,7,8],\"max_tokens\":$fit,\"ignore_eos\":true}")
    check "prompt 10 + max_tokens $fit needs exactly the $pool_tokens tokens the pool holds: served to its last token" \
        test "$code $(pyj '(o["choices"][0]["finish_reason"], o["usage"]["completion_tokens"])')" = "200 ('length', $fit)"
    code=$(api POST /v1/completions "{\"prompt\":[7,7,7,7,7,7,7,7,7,9],\"max_tokens\":$((fit + 1)),\"ignore_eos\":true}")
    check "one token more (max_tokens $((fit + 1))): 400 request_too_large_for_kv_pool" \
        test "$code $(pyj 'o["error"]["code"]')" = "400 request_too_large_for_kv_pool"
    long="{\"messages\":[{\"role\":\"user\",\"content\":\"a long story\"}],\"max_tokens\":$((pool_tokens / 2)),\"ignore_eos\":true,\"stream\":true}"
    curl -sN --unix-socket "$sock" -d "$long" http://ds41/v1/chat/completions >/dev/null &
    run_pid=$!
    for i in $(seq 1 100); do
        api GET /admin/sessions >/dev/null
        [ "$(pyj 'len([s for s in o["data"] if s["state"] == "decode"])')" = 1 ] && break
        sleep 0.05
    done
    curl -sN --unix-socket "$sock" -d "$long" http://ds41/v1/chat/completions >/dev/null &
    queued_pid=$!
    for i in $(seq 1 100); do
        api GET /admin/sessions >/dev/null
        [ "$(pyj 'len([s for s in o["data"] if s["state"] == "queued"])')" = 1 ] && break
        sleep 0.05
    done
    code=$(curl -s -D "$work/h429" -o "$work/body" -w '%{http_code}' --unix-socket "$sock" \
        -d '{"messages":[{"role":"user","content":"y"}],"max_tokens":2}' http://ds41/v1/chat/completions)
    check "one running, one queued (max_queue 1): the next request is 429 rate_limit_error with Retry-After" \
        bash -c "test '$code $(pyj 'o["error"]["type"]')' = '429 rate_limit_error' && grep -qi '^Retry-After: [0-9]' '$work/h429'"
    kill "$run_pid" "$queued_pid" 2>/dev/null
    wait "$run_pid" "$queued_pid" 2>/dev/null
    for i in $(seq 1 100); do
        api GET /admin/sessions >/dev/null
        [ "$(pyj 'len([s for s in o["data"] if s["state"] != "cached"])')" = 0 ] && break
        sleep 0.05
    done
    big=$("$py" -c 'print(",".join(["7"] * 4000))')
    code=$(curl -s -D "$work/h503" -o "$work/body" -w '%{http_code}' --unix-socket "$sock" \
        -d "{\"prompt\":[$big],\"max_tokens\":1}" http://ds41/v1/completions)
    check "a prompt the KV cache (384 KiB) can never hold: 400 naming its 4000 tokens, no Retry-After" \
        bash -c "test '$code $(pyj 'o["error"]["code"]')' = '400 request_too_large_for_kv_pool' &&
                 grep -q 'a prompt of 4000 tokens' '$work/body' && ! grep -qi '^Retry-After' '$work/h503'"
    curl -s --unix-socket "$sock" http://ds41/metrics >"$work/metrics2.txt"
    check "memory.engram_cache_bytes 4KiB: the Engram rows are streamed, /metrics shows the tier's reads" \
        "$py" -c '
import re, sys
t = open(sys.argv[1]).read()
def v(name):
    m = re.search("^" + name + r"\{model=\"ds41-tiny\",tier=\"engram\"\} (\d+)$", t, re.M)
    return int(m.group(1))
assert v("ds41_tier_budget_bytes") == 4096
assert v("ds41_tier_misses_total") > 0 and v("ds41_tier_read_bytes_total") > 0 and v("ds41_tier_read_errors_total") == 0
assert v("ds41_tier_misses_total") == v("ds41_tier_prefetched_early_total") + v("ds41_tier_waited_total")
assert re.search(r"^ds41_tier_read_latency_seconds\{model=\"ds41-tiny\",tier=\"engram\",quantile=\"0.99\"\} ", t, re.M)
' "$work/metrics2.txt"
    sed -i 's/^  max_queue: 1/  max_queue: 1\n  request_timeout_s: 1/' "$work/nohook.yaml"
    kill -HUP "$daemon_pid"
    for i in $(seq 1 100); do grep -q 'configuration reloaded' "$work/daemon.log" && break; sleep 0.05; done
    code=$(api POST /v1/chat/completions "{\"messages\":[{\"role\":\"user\",\"content\":\"z\"}],\"max_tokens\":$((pool_tokens - 100)),\"ignore_eos\":true}")
    check "after SIGHUP with limits.request_timeout_s 1, a longer request ends with finish_reason length" \
        test "$code $(pyj '(o["choices"][0]["finish_reason"], 0 < o["usage"]["completion_tokens"] < '$((pool_tokens - 100))')')" = "200 ('length', True)"
    stop_daemon TERM
    check "that daemon exits 0 too" test "$daemon_status" = 0
else
    notok "restart with the test hook off, one slot and a small KV cache"
fi
finish
