#!/bin/bash
# ds41ctl against the real daemon (embedded model, temporary state directory): every command,
# human and --json output, the same answers as the HTTP API, clear errors when the daemon is
# down.  TAP.
. "$(dirname "$0")/daemon_lib.sh"
ctl() { "$bin/ds41ctl" --socket "$sock" "$@"; }

cfg=$work/ds41d.yaml
write_config "$cfg"
# one engine thread: a count doctor must report from the daemon, not from this machine's CPUs
sed -i 's/^  threads: 2$/  threads: 1/' "$cfg"
# as root: the socket's group is nogroup, so uid 65534 can connect as a non-admin peer
peer_tests=false
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && getent group nogroup >/dev/null; then
    peer_tests=true
    sed -i 's/^  socket_group: null$/  socket_group: nogroup/' "$cfg"
fi

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
ctl status --json >"$work/status_after.json"; rc=$?
check "status --json (the flag after the command): the same JSON" \
    test "$rc $(pyj '(o["health"], o["models"][0]["id"], "running" in o["load"])' "$work/status_after.json")" = "0 ('ok', 'ds41-tiny', True)"
"$bin/ds41ctl" status --socket "$sock" --json >"$work/status_after2.json"; rc=$?
check "status --socket PATH --json: the socket after the command too" \
    test "$rc $(pyj 'o["health"]' "$work/status_after2.json")" = "0 ok"
version=$(sed -n "s/^ *version *: *'\([^']*\)'.*/\1/p" "$(dirname "$0")/../meson.build" | head -1)
check "ds41ctl --version and status --version print the project version ($version)" \
    bash -c "test -n '$version' && test \"\$('$bin/ds41ctl' --version)\" = 'ds41ctl $version' && test \"\$('$bin/ds41ctl' status --version)\" = 'ds41ctl $version' && test \"\$('$ds41d' --version)\" = 'ds41d $version'"

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
ctl ps --all >"$work/ps.txt"
check "ps --all: a session table with the prefix-cache entries" \
    bash -c "head -1 '$work/ps.txt' | grep -q '^ID *MODEL *STATE *PROMPT *GENERATED *CACHED *KV_TOKENS *KV_PAGES *KV_BYTES' && grep -q 'ds41-tiny:c[0-9]* *ds41-tiny *cached' '$work/ps.txt'"
ctl ps >"$work/ps_live.txt"; rc=$?
check "ps: live sessions only, no prefix-cache rows" \
    bash -c "test $rc -eq 0 && head -1 '$work/ps_live.txt' | grep -q '^ID *MODEL *STATE' && ! grep -q 'cached' '$work/ps_live.txt'"
ctl ps --json >"$work/ps_live.json"
ctl ps --all --json >"$work/ps_all.json"
check "ps --json: no cached session; ps --all --json: the cached ones" \
    test "$(pyj '[s["state"] for s in o["data"] if s["state"] == "cached"]' "$work/ps_live.json") $(pyj 'any(s["state"] == "cached" for s in o["data"])' "$work/ps_all.json")" = "[] True"

# cancel / kill: a long generation is cancelled, its client gets the error, the session goes
curl -sN --unix-socket "$sock" -H 'Content-Type: application/json' http://ds41/v1/completions \
    -d '{"prompt":"x","max_tokens":4000,"ignore_eos":true,"stream":true}' >"$work/cancel_stream.txt" &
curl_pid=$!
live=
for i in $(seq 1 400); do
    live=$(ctl ps --json 2>/dev/null | "$py" -c 'import json,sys; print(" ".join(s["id"] for s in json.load(sys.stdin)["data"] if s["state"] != "cached"))')
    [ -n "$live" ] && break
    sleep 0.02
done
if $peer_tests; then
    setpriv --reuid=65534 --regid=65534 --clear-groups -- "$bin/ds41ctl" --socket "$sock" cancel "$live" >/dev/null 2>"$work/cancel403.err"; rc=$?
    still=$(ctl ps --json | "$py" -c 'import json,sys; print(" ".join(s["id"] for s in json.load(sys.stdin)["data"]))')
    check "cancel as a non-admin peer: exit 1 with the daemon's 403, the session runs on" \
        bash -c "test $rc -eq 1 && grep -q 'HTTP 403' '$work/cancel403.err' && [[ ' $still ' == *' $live '* ]]"
else
    skip "cancel as a non-admin peer (needs root, setpriv and the nogroup group)"
fi
ctl cancel "$live" >"$work/cancel.txt"; rc=$?
wait "$curl_pid"
check "cancel SESSION: the live request ($live) is cancelled, its stream ends with the cancelled error" \
    bash -c "test -n '$live' && test $rc -eq 0 && grep -q '^$live: cancelled' '$work/cancel.txt' && grep -q '\"code\":\"cancelled\"' '$work/cancel_stream.txt'"
check "cancel: the session is gone from ps --all" bash -c "! '$bin/ds41ctl' --socket '$sock' ps --all | grep -q '^$live '"
cached=$(ctl ps --all --json | "$py" -c 'import json,sys; print([s["id"] for s in json.load(sys.stdin)["data"] if s["state"] == "cached"][0])')
ctl kill "$cached" >"$work/kill.txt"; rc=$?
check "kill SESSION: a prefix-cache entry ($cached) is dropped" \
    bash -c "test $rc -eq 0 && grep -q 'dropped from the prefix cache' '$work/kill.txt' && ! '$bin/ds41ctl' --socket '$sock' ps --all | grep -q '^$cached '"
ctl cancel ds41-tiny:r999999 >/dev/null 2>"$work/cancel404.err"; rc=$?
check "cancel of an unknown session: exit 1, HTTP 404" bash -c "test $rc -eq 1 && grep -q 'HTTP 404' '$work/cancel404.err'"
ctl cancel 'a/../b' >/dev/null 2>&1; rc=$?
check "cancel of a malformed id: exit 2, nothing sent" test $rc -eq 2
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
# The decode rate "in all" counts the seconds during which some request was decoding: never below
# the per-request rate (equal, up to rounding, when the requests run one at a time).
ctl bench --requests 3 --concurrency 1 --prompt-tokens 64 --max-tokens 8 >"$work/bench_seq.txt"
ctl --json bench --requests 4 --concurrency 4 --prompt-tokens 24 --max-tokens 12 >"$work/bench_par.json"
rates=$("$py" - "$work/bench_seq.txt" "$work/bench_par.json" <<'EOF'
import json, re, sys
m = re.search(r"^decode: *([0-9.]+) tokens/s per request, ([0-9.]+) tokens/s in all", open(sys.argv[1]).read(), re.M)
o = json.load(open(sys.argv[2]))
seq = bool(m) and float(m.group(2)) >= float(m.group(1)) * 0.999 > 0
par = o.get("decode_tokens_per_s", 0) >= o["decode_tokens_per_s_per_request"] > 0
print(seq, par, m.groups() if m else None, o.get("decode_tokens_per_s"), o["decode_tokens_per_s_per_request"])
EOF
)
check "bench: decode 'in all' >= 'per request', one at a time and four at a time ($rates)" \
    bash -c "[[ \"\$1\" == 'True True '* ]]" _ "$rates"
ctl --json doctor >"$work/doctor.json"
# (a "cgroup" row appears only under a cgroup memory limit below MemAvailable, "gpu bandwidth" only
# where a GPU opens: not counted)
check "doctor: daemon, budgets (decided at load), io_uring, checkpoint and O_DIRECT (on the daemon's model directory), memlock, cpu, backend, gpu, backend auto, memory" \
    test "$(pyj '([c["check"] for c in o if c["check"] not in ("cgroup", "gpu bandwidth")], [c["status"] for c in o if c["check"] in ("daemon", "O_DIRECT", "budgets")])' "$work/doctor.json")" = \
    "(['daemon', 'budgets', 'io_uring', 'checkpoint', 'O_DIRECT', 'memlock', 'cpu', 'backend', 'gpu', 'backend auto', 'memory'], ['ok', 'ok', 'ok'])"
check "doctor: the backend row gives the daemon's own thread count (engine.threads 1)" \
    bash -c "[[ \"\$1\" == *\"the daemon's threads: ds41-tiny 1\"* ]]" _ "$(pyj '[c["detail"] for c in o if c["check"] == "backend"][0]' "$work/doctor.json")"
check "doctor: the daemon's model directory is a checkpoint" \
    test "$(pyj '[c["status"] for c in o if c["check"] == "checkpoint"]' "$work/doctor.json")" = '["ok"]'
mkdir -p "$work/hfdir"
echo '{"architectures":["DeepseekV4ForCausalLM"]}' >"$work/hfdir/config.json"
ctl doctor --model "$work/hfdir" >"$work/doctor_hf.txt"; rc=$?
check "doctor --model DIR with only a root config.json: the checkpoint check fails naming inference/config.json (exit 1)" \
    bash -c "test $rc -eq 1 && grep -q '^checkpoint *fail *not a ds41 checkpoint: .*inference/config.json' '$work/doctor_hf.txt'"
ctl doctor --model "$work/nowhere" >"$work/doctor.txt"; rc=$?
check "doctor: a missing model directory fails the O_DIRECT check (exit 1)" \
    bash -c "test $rc -eq 1 && grep -q '^O_DIRECT *fail' '$work/doctor.txt'"
# --set-expert-bytes auto prints the budget it chose (the tiny model: everything resident)
ctl cache --set-expert-bytes auto >"$work/setauto.txt"; rc=$?
ctl cache --set-expert-bytes auto --json >"$work/setauto.json"
check "cache --set-expert-bytes auto: says what auto chose, not '0 bytes'" \
    bash -c "test $rc -eq 0 && grep -q '^expert budget set to auto: all routed experts resident' '$work/setauto.txt' && ! grep -q ' 0 bytes' '$work/setauto.txt'"
check "cache --set-expert-bytes auto --json: auto, the chosen budget (0: resident)" \
    test "$(pyj '(o["auto"], o["expert_cache_bytes"])' "$work/setauto.json")" = "(True, 0)"

# special tokens: left out of content by default, streamed or not; skip_special_tokens false keeps them
forced='Hi<｜Assistant｜> there<think>, friend<｜User｜>.'
body='{"messages":[{"role":"user","content":"x"}],"ds41_forced_output":"'"$forced"'","max_tokens":12'
api POST /v1/chat/completions "$body}" >/dev/null
plain=$(pyj 'o["choices"][0]["message"]["content"]')
api POST /v1/chat/completions "$body,\"skip_special_tokens\":false}" >/dev/null
kept=$(pyj 'o["choices"][0]["message"]["content"]')
curl -sN --unix-socket "$sock" -H 'Content-Type: application/json' http://ds41/v1/chat/completions -d "$body,\"stream\":true}" >"$work/special.sse"
streamed=$(sse_collect "$work/special.sse" | "$py" -c 'import json,sys; print(json.load(sys.stdin)["content"])')
check "chat: special tokens left out of content, streamed and not ('$plain', '$streamed'); skip_special_tokens false keeps them ('$kept')" \
    test "$plain|$streamed|$kept" = "Hi there, friend.|Hi there, friend.|$forced"

# chat on a terminal: the model's control characters are escaped; piped they are written as sent
seed=
for s in $(seq 1 60); do
    api POST /v1/chat/completions '{"messages":[{"role":"user","content":"hi"}],"seed":'$s',"temperature":1.5,"max_tokens":24}' >/dev/null
    if [ "$(pyj '(lambda c: any(ord(x) < 32 and x not in "\n\t" for x in c) and "\x00" not in c)(o["choices"][0]["message"]["content"])')" = True ]; then
        seed=$s; cp "$work/body" "$work/ctrl.json"; break
    fi
done
tty_ok=$("$py" - "$bin/ds41ctl" "$sock" "$seed" "$work/ctrl.json" <<'EOF'
import json, os, pty, sys
ctl, sock, seed, ref = sys.argv[1:5]
content = json.load(open(ref, encoding="utf-8"))["choices"][0]["message"]["content"]
def esc(t):
    out = []
    for ch in t:
        o = ord(ch)
        if (o < 32 and ch not in "\n\t") or o == 0x7f: out.append("\\x%02x" % o)
        elif 0x80 <= o <= 0x9f: out.append("\\u%04x" % o)
        else: out.append(ch)
    return "".join(out)
pid, fd = pty.fork()
if pid == 0:
    os.execv(ctl, [ctl, "--socket", sock, "chat", "--seed", seed, "--temperature", "1.5", "--max-tokens", "24", "hi"])
data = b""
while True:
    try:
        b = os.read(fd, 65536)
    except OSError:
        break
    if not b: break
    data += b
_, status = os.waitpid(pid, 0)
text = data.replace(b"\r\n", b"\n").decode("utf-8", "replace")
raw_ctrl = any(ord(c) < 32 and c not in "\n\t" for c in text)
print(os.waitstatus_to_exitcode(status) == 0 and not raw_ctrl and text == esc(content) + "\n")
EOF
)
ctl chat --seed "$seed" --temperature 1.5 --max-tokens 24 hi >"$work/ctrl_piped.txt"
piped_ok=$("$py" -c 'import json,sys; c=json.load(open(sys.argv[1], encoding="utf-8"))["choices"][0]["message"]["content"]; print(open(sys.argv[2], encoding="utf-8", newline="").read() == c + "\n")' "$work/ctrl.json" "$work/ctrl_piped.txt")
check "chat on a terminal escapes the model's control characters (seed $seed); piped, the exact text" \
    test "${seed:+x} $tty_ok $piped_ok" = "x True True"

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
