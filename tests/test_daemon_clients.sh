#!/bin/bash
# ds41d with many clients: 16 concurrent seeded requests get exactly what each gets alone and
# /metrics shows decode steps that carried more than 8 sequences; a client that disconnects
# mid-stream frees its session; peers are told apart with SO_PEERCRED (a second uid in the
# socket's group gets the inference routes and 403 on admin routes, the admin group gets both,
# others cannot connect); 10,000 requests from a fuzzing client are each refused with a 4xx (or a
# closed connection for broken framing) and the daemon keeps serving.  TAP.
. "$(dirname "$0")/daemon_lib.sh"

cfg=$work/ds41d.yaml
peer_tests=false
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && getent group nogroup >/dev/null && getent group adm >/dev/null; then
    peer_tests=true
    # the socket's group: nogroup (65534); the admin group: adm (4)
    write_config "$cfg" "limits:" "  max_tokens_default: 8" "  max_body_bytes: 64KiB" "  idle_timeout_s: 2"
    sed -i 's/^  socket_group: null/  socket_group: nogroup/; s/^  admin_group: null/  admin_group: adm/' "$cfg"
else
    write_config "$cfg" "limits:" "  max_tokens_default: 8" "  max_body_bytes: 64KiB" "  idle_timeout_s: 2"
fi
if ! start_daemon "$cfg"; then
    notok "ds41d starts"; finish; exit 0
fi
ok "ds41d starts"

# ---- 16 concurrent clients ---------------------------------------------------------------------
body() { echo "{\"messages\":[{\"role\":\"user\",\"content\":\"Client $1: tell me something about the number $1.\"}],\"max_tokens\":32,\"ignore_eos\":true,\"seed\":$((100 + $1)),\"temperature\":0.8}"; }
# each alone first (cold), then all at once after the prefix cache is emptied (cold again)
for i in $(seq 0 15); do
    curl -s --unix-socket "$sock" -H 'Content-Type: application/json' -d "$(body $i)" -o "$work/alone$i.json" \
        http://ds41/v1/chat/completions
done
drop_cache() {
    api GET /admin/sessions >/dev/null
    local id
    for id in $(pyj '" ".join(s["id"] for s in o["data"] if s["state"] == "cached")'); do api DELETE "/admin/sessions/$id" >/dev/null; done
}
drop_cache
pids=()
for i in $(seq 0 15); do
    curl -s --unix-socket "$sock" -H 'Content-Type: application/json' -d "$(body $i)" \
        -o "$work/conc$i.json" http://ds41/v1/chat/completions &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
curl -s --unix-socket "$sock" http://ds41/metrics >"$work/metrics1.txt"
same=0 cold=0
for i in $(seq 0 15); do
    a=$(pyj '(o["choices"][0]["message"]["content"], o["usage"]["completion_tokens"])' "$work/conc$i.json" 2>/dev/null)
    b=$(pyj '(o["choices"][0]["message"]["content"], o["usage"]["completion_tokens"])' "$work/alone$i.json" 2>/dev/null)
    [ -n "$a" ] && [ "$a" = "$b" ] && same=$((same + 1))
    [ "$(pyj 'o["usage"]["prompt_tokens_details"]["cached_tokens"]' "$work/conc$i.json" 2>/dev/null)" = 0 ] && cold=$((cold + 1))
done
check "16 concurrent clients with fixed seeds get exactly what each gets alone ($same of 16, $cold cold)" test "$same $cold" = "16 16"
big=$("$py" - "$work/metrics1.txt" <<'EOF'
import re, sys
b = {}
for line in open(sys.argv[1]):
    m = re.match(r'ds41_decode_batch_sequences_bucket\{model="ds41-tiny",le="([^"]+)"\} (\d+)', line)
    if m: b[m.group(1)] = int(m.group(2))
print(b["16"] - b["8"])
EOF
)
check "/metrics: decode steps that carried 9 to 16 sequences ($big)" test "$big" -gt 0

# ---- a client that disconnects mid-stream -------------------------------------------------------
events=$("$py" - "$sock" <<'EOF'
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
body = b'{"messages":[{"role":"user","content":"A long story"}],"max_tokens":100000,"ignore_eos":true,"stream":true}'
s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: ds41\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
s.settimeout(30)
got = b""
try:
    while got.count(b"data:") < 5:
        d = s.recv(4096)
        if not d:
            break  # the daemon ended the stream early: reported below, not a hang
        got += d
except OSError:
    pass
s.close()
print(got.count(b"data:"))
EOF
)
for i in $(seq 1 100); do
    api GET /admin/sessions >/dev/null
    live=$(pyj 'len([s for s in o["data"] if s["state"] != "cached"])')
    [ "$live" = 0 ] && break
    sleep 0.05
done
curl -s --unix-socket "$sock" http://ds41/metrics >"$work/metrics2.txt"
outcomes=$(grep '^ds41_requests_total{model="ds41-tiny"' "$work/metrics2.txt" | sed 's/.*outcome=//' | tr '\n' ' ')
check "a client that disconnects mid-stream (after $events events): its session is gone ($live live sessions) and counted as cancelled ($outcomes)" \
    bash -c "test '$events' -ge 5 && test '$live' = 0 && grep -q '^ds41_requests_total{model=\"ds41-tiny\",outcome=\"cancelled\"} 1' '$work/metrics2.txt'"
code=$(api GET /admin/cache)
pages=$(pyj 'o["pages_used"]')
api GET /admin/sessions >/dev/null
check "the KV pages in use are only those of prefix-cache sessions" \
    test "$pages" -le "$(pyj 'sum(s["kv_pages"] for s in o["data"])')"

# ---- peers ------------------------------------------------------------------------------------------
if $peer_tests; then
    as() { local uid=$1 gid=$2 groups=$3; shift 3; setpriv --reuid="$uid" --regid="$gid" $groups -- "$@"; }
    peer() { as "$@" curl -s -o /dev/null -w '%{http_code}' --unix-socket "$sock" "http://ds41$path"; }
    check "the socket: mode 0660, group nogroup" test "$(stat -c '%a %G' "$sock")" = "660 nogroup"
    path=/v1/models; a=$(peer 65534 65534 --clear-groups)
    path=/admin/sessions; b=$(peer 65534 65534 --clear-groups)
    check "a second uid in the socket's group: 200 on inference routes, 403 on admin routes ($a $b)" test "$a $b" = "200 403"
    code=$(as 65534 65534 --clear-groups curl -s -o "$work/nobody.json" -w '%{http_code}' --unix-socket "$sock" \
        -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}' http://ds41/v1/chat/completions)
    check "... and its chat completion works" test "$code" = 200
    path=/admin/sessions; c=$(peer 65534 65534 --groups=4)
    check "a member of the admin group (supplementary): 200 on admin routes ($c)" test "$c" = 200
    as 65534 65533 --clear-groups curl -s -o /dev/null --unix-socket "$sock" http://ds41/v1/models; rc=$?
    check "a uid outside the socket's group cannot connect (curl exit $rc)" test "$rc" = 7
    as 65534 65534 --clear-groups "$bin/ds41ctl" --socket "$sock" ps >/dev/null 2>"$work/ctl403.err"; rc=$?
    check "ds41ctl ps as that uid: exit 1 with the daemon's 403" bash -c "test $rc = 1 && grep -q 'HTTP 403' '$work/ctl403.err'"
else
    skip "peer classes need root, setpriv and the groups nogroup and adm"
fi

# ---- a slow-drip client: cut off with 408 ---------------------------------------------------------
drip=$("$py" - "$sock" <<'EOF'
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.settimeout(10)
t0 = time.time()
req = b"POST /tokenize HTTP/1.1\r\nHost: ds41\r\nContent-Length: 40\r\n\r\n" + b'{"content":"' + b"a" * 26 + b'"}'
got = b""
try:
    for byte in req:
        s.sendall(bytes([byte]))
        time.sleep(0.1)
except OSError:
    pass
try:
    while True:
        d = s.recv(4096)
        if not d:
            break
        got += d
except OSError:
    pass
print(got.split(b"\r\n", 1)[0].decode("latin-1", "replace"), round(time.time() - t0))
EOF
)
check "a client that drips its request is cut off with 408 after limits.idle_timeout_s ($drip)" \
    bash -c "case '$drip' in 'HTTP/1.1 408 '*' 2'|'HTTP/1.1 408 '*' 3') exit 0;; *) exit 1;; esac"

# ---- a fuzzing client ----------------------------------------------------------------------------
"$py" "$(dirname "$0")/tools/fuzz_client.py" "$sock" 10000 7 >"$work/fuzz.json" 2>"$work/fuzz.err"
note "fuzz: $(cat "$work/fuzz.json")"
check "10,000 fuzzed requests: every answer a 2xx or 4xx, broken framing closed, nothing else" \
    test "$(pyj '(o["answered"] + o["closed"], o["bad"], all(int(k) < 500 for k in o["by_status"]), o["by_status"].get("400", 0) > 5000, "413" in o["by_status"])' "$work/fuzz.json")" = \
    "(10000, [], True, True, True)"
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"still there?"}],"max_tokens":3}')
check "the daemon keeps serving after the fuzzing (health and a chat completion)" \
    test "$(curl -s -o /dev/null -w '%{http_code}' --unix-socket "$sock" http://ds41/health) $code" = "200 200"

stop_daemon TERM
check "the daemon exits 0" test "$daemon_status" = 0
finish
