#!/bin/bash
# ds41ctl against the real daemon (embedded model, temporary state directory): every command,
# human and --json output, the same answers as the HTTP API, clear errors when the daemon is
# down.  TAP.
. "$(dirname "$0")/daemon_lib.sh"
ctl() { "$bin/ds41ctl" --socket "$sock" "$@"; }

cfg=$work/ds41d.yaml
write_config "$cfg"

ctl status >"$work/down.out" 2>"$work/down.err"; rc=$?
check "daemon down: exit 1 and a message that says so" \
    bash -c "test $rc -eq 1 && grep -q 'cannot reach ds41d at $sock' '$work/down.err'"
"$bin/ds41ctl" --socket "$sock" frobnicate >/dev/null 2>&1; rc=$?
check "an unknown command: exit 2" test $rc -eq 2

if ! start_daemon "$cfg"; then
    notok "ds41d starts"; finish; exit 0
fi
ok "ds41d starts"

ctl status >"$work/status.txt"; rc=$?
check "status: ok, the model and its context, load and memory lines" \
    bash -c "test $rc -eq 0 && grep -q '^ds41d: *ok' '$work/status.txt' && grep -q '^model: *ds41-tiny (context 4096)' '$work/status.txt' &&
             grep -q '^load:' '$work/status.txt' && grep -q '^memory: *KV cache' '$work/status.txt'"
ctl --json status >"$work/status.json"
check "status --json: health ok, models, load" \
    test "$(pyj '(o["health"], o["models"][0]["id"], "running" in o["load"])' "$work/status.json")" = "('ok', 'ds41-tiny', True)"

ctl models ls >"$work/models.txt"
check "models ls: a table with the model, its state, bytes and path" \
    bash -c "head -1 '$work/models.txt' | grep -q '^NAME *STATE *CONTEXT *BYTES *PATH' && grep -q '^ds41-tiny *ready *4096 .*$state/embedded/tiny-seed1' '$work/models.txt'"
ctl --json models ls >"$work/models.json"
check "models ls --json: the admin listing with tiers" test "$(pyj '(o["data"][0]["state"], o["data"][0]["tiers"]["ram"] > 0)' "$work/models.json")" = "('ready', True)"

# chat and generate print what the API answers
ctl chat --seed 7 --max-tokens 10 --temperature 0.9 "Hello there" >"$work/chat.txt"; rc=$?
api POST /v1/chat/completions '{"messages":[{"role":"user","content":"Hello there"}],"seed":7,"max_tokens":10,"temperature":0.9}' >/dev/null
want=$(pyj 'o["choices"][0]["message"]["content"]')
check "chat PROMPT: streams the same answer the API gives" bash -c "test $rc -eq 0 && test \"\$(cat '$work/chat.txt')\" = \"\$1\"" _ "$want"
ctl chat "Hello there" --seed 7 --max-tokens 10 --temperature 0.9 >"$work/chat_after.txt"; rc=$?
check "chat: options after the prompt work too" bash -c "test $rc -eq 0 && cmp -s '$work/chat.txt' '$work/chat_after.txt'"
ctl --json chat --seed 7 --max-tokens 10 --temperature 0.9 "Hello there" >"$work/chat.json"
check "chat --json: the whole chat.completion" test "$(pyj 'o["choices"][0]["message"]["content"]' "$work/chat.json")" = "$want"
printf 'First question\nSecond question\n' | ctl --json chat --max-tokens 4 --seed 1 >"$work/inter.json"; rc=$?
turns=$("$py" - "$work/inter.json" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
dec, i, objs = json.JSONDecoder(), 0, []
while i < len(text):
    while i < len(text) and text[i].isspace(): i += 1
    if i >= len(text): break
    o, i = dec.raw_decode(text, i); objs.append(o)
u = [o["usage"] for o in objs]
print(len(objs), u[1]["prompt_tokens"] > u[0]["prompt_tokens"] + u[0]["completion_tokens"], u[1]["prompt_tokens_details"]["cached_tokens"] > 0)
EOF
)
check "interactive chat: one answer per line, the conversation kept (turn 2 re-uses turn 1 from the cache)" \
    test "$rc $turns" = "0 2 True True"
ctl chat --thinking --max-tokens 3 "Think" >"$work/think.txt"
check "chat --thinking marks the reasoning" grep -q '^\[reasoning\]' "$work/think.txt"
ctl generate --seed 3 --max-tokens 6 Once upon a time >"$work/gen.txt"; rc=$?
api POST /v1/completions '{"prompt":"Once upon a time","seed":3,"max_tokens":6}' >/dev/null
want=$(pyj 'o["choices"][0]["text"]')
check "generate PROMPT: the same text as /v1/completions" bash -c "test $rc -eq 0 && test \"\$(cat '$work/gen.txt')\" = \"\$1\"" _ "$want"

# sessions and caches
ctl ps >"$work/ps.txt"
check "ps: a session table (prefix-cache sessions)" \
    bash -c "head -1 '$work/ps.txt' | grep -q '^ID *MODEL *STATE *PROMPT *GENERATED *CACHED *KV_TOKENS *KV_PAGES *KV_BYTES' && grep -q 'ds41-tiny:c[0-9]* *ds41-tiny *cached' '$work/ps.txt'"
ctl cache >"$work/cache.txt"
check "cache: pages, bytes per token, tiers with hit rates, sessions" \
    bash -c "grep -q '^KV pages: .* 4480 bytes per page; 105.0 bytes per token' '$work/cache.txt' && grep -q '^prefix ' '$work/cache.txt' && grep -q '^kv ' '$work/cache.txt' && grep -q 'ds41-tiny:c' '$work/cache.txt'"
ctl --json cache >"$work/cache.json"
check "cache --json: every session's KV bytes equal its allocated pages x page bytes" \
    test "$(pyj 'len(o["sessions"]) > 0 and all(s["kv_bytes"] == s["kv_pages"] * o["cache"]["page_bytes"] and s["kv_pages"] > 0 for s in o["sessions"])' "$work/cache.json")" = True

# bench, doctor, metrics
ctl --json bench --requests 4 --concurrency 2 --prompt-tokens 24 --max-tokens 5 >"$work/bench.json"; rc=$?
check "bench: 4 of 4 requests, prefill and decode rates" \
    test "$rc $(pyj '(o["succeeded"], o["total_generated_tokens"], o["prefill_tokens_per_s"] > 0, o["generated_tokens_per_s"] > 0)' "$work/bench.json")" = "0 (4, 20, True, True)"
ctl bench --requests 2 --concurrency 2 --prompt-tokens 8 --max-tokens 2 >"$work/bench.txt"
check "bench: human summary" bash -c "grep -q '^requests: *2 of 2 succeeded' '$work/bench.txt' && grep -q '^decode:' '$work/bench.txt'"
ctl --json doctor >"$work/doctor.json"
# (a "cgroup" row appears only under a cgroup memory limit below MemAvailable: not counted)
check "doctor: daemon, budgets (decided at load), io_uring, O_DIRECT (on the daemon's model directory), memlock, cpu, backend, gpu, memory" \
    test "$(pyj '([c["check"] for c in o if c["check"] != "cgroup"], [c["status"] for c in o if c["check"] in ("daemon", "O_DIRECT", "budgets")])' "$work/doctor.json")" = \
    "(['daemon', 'budgets', 'io_uring', 'O_DIRECT', 'memlock', 'cpu', 'backend', 'gpu', 'memory'], ['ok', 'ok', 'ok'])"
ctl doctor --model "$work/nowhere" >"$work/doctor.txt"; rc=$?
check "doctor: a missing model directory fails the O_DIRECT check (exit 1)" \
    bash -c "test $rc -eq 1 && grep -q '^O_DIRECT *fail' '$work/doctor.txt'"
ctl metrics >"$work/metrics.txt"
check "metrics: the Prometheus text" grep -q '^ds41_requests_total{model="ds41-tiny",outcome="length"}' "$work/metrics.txt"
ctl --json metrics >"$work/metrics.json"
check "metrics --json: samples with labels" \
    test "$(pyj '[m["labels"]["outcome"] for m in o if m["name"] == "ds41_requests_total"][:2]' "$work/metrics.json")" = '["stop", "length"]'

# unload and load
ctl models unload ds41-tiny >"$work/unload.txt"; rc=$?
code=$(api GET /health)
check "models unload: the model goes, /health says 503" bash -c "test $rc -eq 0 && grep -q 'ds41-tiny: unloaded' '$work/unload.txt' && test $code = 503"
ctl chat "x" >/dev/null 2>"$work/chat503.err"; rc=$?
check "chat while unloaded: exit 1 with the daemon's 503 message" bash -c "test $rc -eq 1 && grep -q 'HTTP 503' '$work/chat503.err'"
ctl models load ds41-tiny >"$work/load.txt"; rc=$?
for i in $(seq 1 100); do [ "$(api GET /health)" = 200 ] && break; sleep 0.1; done
check "models load: loading in the background, then ready" bash -c "test $rc -eq 0 && grep -q 'ds41-tiny: loading' '$work/load.txt' && test $(api GET /health) = 200"
ctl models load nosuch >/dev/null 2>"$work/nosuch.err"; rc=$?
check "models load of an unknown model: exit 1, HTTP 404" bash -c "test $rc -eq 1 && grep -q 'HTTP 404' '$work/nosuch.err'"

stop_daemon TERM
check "the daemon exits 0" test "$daemon_status" = 0
finish
