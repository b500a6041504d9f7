# Shared helpers for the ds41d integration tests (sourced by tests/test_daemon*.sh): TAP output,
# starting the real daemon on the embedded model in a temporary state directory, curl over its
# Unix socket, JSON checks with Python.
set -u
bin=${DS41_BUILD_DIR:?DS41_BUILD_DIR not set}/daemon
ds41d=$bin/ds41d
py=/usr/bin/python3
[ -x $py ] || py=python3
work=$(mktemp -d /tmp/ds41d-test-XXXXXX)
chmod 0755 "$work"
n=0
daemon_pid=
cleanup() {
    if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
        kill -KILL "$daemon_pid" 2>/dev/null
        wait "$daemon_pid" 2>/dev/null
    fi
    rm -rf "$work"
}
trap cleanup EXIT
# DS41_KEEP_WORK=1 keeps the work directory (daemon log, bodies) for debugging
[ -n "${DS41_KEEP_WORK:-}" ] && trap - EXIT
ok() { n=$((n + 1)); echo "ok $n - $*"; }
notok() { n=$((n + 1)); echo "not ok $n - $*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else notok "$what"; fi; }
skip() { n=$((n + 1)); echo "ok $n - skipped # SKIP $*"; }
note() { echo "# $*"; }
finish() { echo "1..$n"; }

sock=$work/ds41d.sock
state=$work/state

# write_config FILE [extra YAML appended]
write_config() {
    local f=$1; shift
    cat >"$f" <<EOF
listen:
  socket: $sock
  socket_group: null
auth:
  admin_group: null
state_directory: $state
engine:
  mode: fast
  threads: 2
  max_sequences: 32
  max_batch_tokens: 512
  prefill_chunk: 64
  test_forced_output: true
log:
  level: debug
EOF
    local extra
    for extra in "$@"; do printf '%s\n' "$extra" >>"$f"; done
}

# start_daemon CONFIG [more ds41d args]: starts ds41d in the background, waits for /health 200.
start_daemon() {
    local cfg=$1; shift
    "$ds41d" --config "$cfg" "$@" >"$work/daemon.log" 2>&1 &
    daemon_pid=$!
    local i
    for i in $(seq 1 300); do
        if [ -S "$sock" ] && [ "$(curl -s -o /dev/null -w '%{http_code}' --unix-socket "$sock" http://ds41/health)" = 200 ]; then
            return 0
        fi
        kill -0 "$daemon_pid" 2>/dev/null || break
        sleep 0.1
    done
    sed 's/^/# daemon: /' "$work/daemon.log" | tail -20
    return 1
}

# stop_daemon [SIGNAL]: signal it and wait; sets daemon_status.
stop_daemon() {
    local sig=${1:-TERM}
    daemon_status=
    [ -n "$daemon_pid" ] || return 1
    kill -"$sig" "$daemon_pid" 2>/dev/null
    local i
    for i in $(seq 1 200); do
        kill -0 "$daemon_pid" 2>/dev/null || break
        sleep 0.05
    done
    wait "$daemon_pid"
    daemon_status=$?
    daemon_pid=
}

# api METHOD PATH [BODY]: writes the body to $work/body and prints the HTTP status.
api() {
    local method=$1 path=$2 body=${3-}
    if [ -n "$body" ]; then
        curl -s -o "$work/body" -w '%{http_code}' --unix-socket "$sock" -X "$method" -H 'Content-Type: application/json' \
            --data-binary "$body" "http://ds41$path"
    else
        curl -s -o "$work/body" -w '%{http_code}' --unix-socket "$sock" -X "$method" "http://ds41$path"
    fi
}

# pyj EXPR [FILE]: evaluates EXPR with o = the JSON in FILE ($work/body by default); prints the result.
pyj() {
    "$py" - "$1" "${2:-$work/body}" <<'EOF'
import json, sys
o = json.load(open(sys.argv[2], encoding="utf-8"))
r = eval(sys.argv[1])
print(r if not isinstance(r, (dict, list)) else json.dumps(r, ensure_ascii=False))
EOF
}

# sse_collect FILE: reassembles a chat SSE stream into one JSON object
# {"content","reasoning_content","tool_calls","finish_reason","usage","done","chunks"}.
sse_collect() {
    "$py" - "$1" <<'EOF'
import json, sys
content, reasoning, calls, finish, usage, done, chunks, err = "", "", {}, None, None, False, 0, None
for line in open(sys.argv[1], encoding="utf-8"):
    line = line.rstrip("\n")
    if not line.startswith("data: "):
        continue
    data = line[6:]
    if data == "[DONE]":
        done = True
        continue
    ev = json.loads(data)
    chunks += 1
    if "error" in ev:
        err = ev["error"]
        continue
    if ev.get("usage"):
        usage = ev["usage"]
    for ch in ev.get("choices", []):
        d = ch.get("delta", {})
        content += d.get("content") or ""
        reasoning += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            c = calls.setdefault(tc["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            if tc.get("id"):
                c["id"] = tc["id"]
            f = tc.get("function", {})
            c["function"]["name"] += f.get("name") or ""
            c["function"]["arguments"] += f.get("arguments") or ""
        if "text" in ch:
            content += ch["text"] or ""
        if ch.get("finish_reason"):
            finish = ch["finish_reason"]
print(json.dumps({"content": content, "reasoning_content": reasoning,
                  "tool_calls": [calls[k] for k in sorted(calls)], "finish_reason": finish,
                  "usage": usage, "done": done, "chunks": chunks, "error": err}, ensure_ascii=False))
EOF
}
