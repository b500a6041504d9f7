#!/bin/bash
# ds41d as a systemd service, without systemd: systemd-socket-activate listens and starts the
# daemon on the first connection, passing the socket; a test-owned NOTIFY_SOCKET records the
# sd_notify messages (STATUS=, READY=1, RELOADING=1, STOPPING=1 in order); SIGHUP reloads a
# changed configuration (and keeps the running one when the new one is invalid); SIGTERM drains a
# running stream to its end and exits 0.  TAP.
. "$(dirname "$0")/daemon_lib.sh"
command -v systemd-socket-activate >/dev/null || { echo "1..0 # SKIP systemd-socket-activate is not installed"; exit 0; }

notify=$work/notify.sock
act=$work/activated.sock
# the notification socket: one line per datagram (newlines inside shown as '|')
"$py" - "$notify" "$work/notify.log" <<'EOF' &
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
with open(sys.argv[2], "a", buffering=1) as log:
    while True:
        data = s.recv(65536)
        log.write(data.decode("utf-8", "replace").replace("\n", "|") + "\n")
EOF
listener_pid=$!
for i in $(seq 1 50); do [ -S "$notify" ] && break; sleep 0.05; done

cfg=$work/ds41d.yaml
write_config "$cfg" "limits:" "  max_tokens_default: 5" "  drain_timeout_s: 20"
systemd-socket-activate -l "$act" --fdname=ds41d -E NOTIFY_SOCKET="$notify" -E WATCHDOG_USEC=300000 "$ds41d" --config "$cfg" \
    >"$work/daemon.log" 2>&1 &
daemon_pid=$!
for i in $(seq 1 100); do [ -S "$act" ] && break; sleep 0.05; done
check "systemd-socket-activate listens before the daemon runs (no own socket yet)" \
    bash -c "test -S '$act' && ! grep -q 'ds41d:' '$work/daemon.log'"

# the first connection starts the daemon
code=$(curl -s -o "$work/body" -w '%{http_code}' --unix-socket "$act" http://ds41/health)
for i in $(seq 1 300); do
    [ "$code" = 200 ] && break
    sleep 0.1
    code=$(curl -s -o "$work/body" -w '%{http_code}' --unix-socket "$act" http://ds41/health)
done
check "the first connection starts ds41d; /health becomes 200 on the passed socket" test "$code" = 200
check "the daemon serves the socket systemd passed and creates none of its own" \
    bash -c "grep -q 'listening on $act (socket activation)' '$work/daemon.log' && test ! -e '$sock'"
sock=$act
sleep 0.3
first_ready=$(grep -n '^READY=1' "$work/notify.log" | head -1 | cut -d: -f1)
first_status=$(grep -n '^STATUS=' "$work/notify.log" | head -1 | cut -d: -f1)
check "NOTIFY_SOCKET got STATUS= progress before READY=1 (READY with a STATUS line)" \
    bash -c "test -n '$first_ready' && test -n '$first_status' && test $first_status -lt $first_ready &&
             grep -q '^READY=1|STATUS=serving' '$work/notify.log' && grep -q '^STATUS=model ds41-tiny: loading' '$work/notify.log'"
last_bind=$(grep -n '^STATUS=model ds41-tiny: binding the weights: 100% (.* of .*, \([0-9][0-9]*\) of \1 tensors)$' "$work/notify.log" | tail -1 | cut -d: -f1)
check "STATUS= gives the share of the weights bound while loading, up to 100% of the tensors, before READY=1" \
    bash -c "test -n '$last_bind' && test $last_bind -lt $first_ready &&
             test \$(grep -c '^STATUS=model ds41-tiny: binding the weights: [0-9]*% ' '$work/notify.log') -ge 2"
check "READY=1 is sent once" test "$(grep -c '^READY=1' "$work/notify.log")" = 1
sleep 0.4
check "WATCHDOG_USEC=300000: WATCHDOG=1 pings at half the interval" test "$(grep -c '^WATCHDOG=1' "$work/notify.log")" -ge 2

code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"Hi"}],"ignore_eos":true}')
check "limits.max_tokens_default 5 applies" test "$code $(pyj 'o["usage"]["completion_tokens"]')" = "200 5"

# SIGHUP with a changed configuration
write_config "$cfg" "limits:" "  max_tokens_default: 3" "  drain_timeout_s: 20"
kill -HUP "$daemon_pid"
for i in $(seq 1 100); do [ "$(grep -c '^READY=1' "$work/notify.log")" -ge 2 ] && break; sleep 0.05; done
check "SIGHUP: RELOADING=1 (with MONOTONIC_USEC) then READY=1 again" \
    bash -c "grep -v '^WATCHDOG' '$work/notify.log' | grep -A1 '^RELOADING=1|MONOTONIC_USEC=' | tail -1 | grep -q '^READY=1|STATUS=serving (configuration reloaded)'"
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"Hi"}],"ignore_eos":true}')
check "the reloaded configuration applies (max_tokens_default 3)" test "$code $(pyj 'o["usage"]["completion_tokens"]')" = "200 3"
check "the model was not reloaded (unchanged)" test "$(grep -c 'model ds41-tiny ready' "$work/daemon.log")" = 1
printf 'limits:\n  max_tokens_default: lots\n' >"$cfg"
kill -HUP "$daemon_pid"
for i in $(seq 1 100); do [ "$(grep -c '^READY=1' "$work/notify.log")" -ge 3 ] && break; sleep 0.05; done
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"Hi"}],"ignore_eos":true}')
check "SIGHUP with an invalid file: the error is logged with its position, the running configuration kept" \
    bash -c "test '$code $(pyj 'o["usage"]["completion_tokens"]')' = '200 3' &&
             grep -q 'READY=1|STATUS=serving (reload failed, configuration kept: .*ds41d.yaml:2:' '$work/notify.log' &&
             grep -q 'reload: .*ds41d.yaml:2:.*limits.max_tokens_default.*keeping the running configuration' '$work/daemon.log'"

# SIGTERM while a stream runs: it is drained to its end, then exit 0
curl -sN --unix-socket "$sock" -d '{"messages":[{"role":"user","content":"Go"}],"max_tokens":150,"ignore_eos":true,"stream":true}' \
    http://ds41/v1/chat/completions >"$work/drain.sse" &
curl_pid=$!
for i in $(seq 1 100); do [ "$(grep -c '^data:' "$work/drain.sse" 2>/dev/null)" -ge 3 ] && break; sleep 0.02; done
kill -TERM "$daemon_pid"
wait "$curl_pid"
wait "$daemon_pid"
status=$?
daemon_pid=
sse_collect "$work/drain.sse" >"$work/drain.json"
check "SIGTERM drains: the running stream finishes (150 tokens, [DONE])" \
    test "$(pyj '(o["done"], o["finish_reason"])' "$work/drain.json")" = "(True, 'length')"
check "SIGTERM: exit status 0" test "$status" = 0
check "STOPPING=1 is the last notification but for watchdog pings" \
    bash -c "grep -v '^WATCHDOG' '$work/notify.log' | tail -1 | grep -q '^STOPPING=1'"
kill "$listener_pid" 2>/dev/null
wait "$listener_pid" 2>/dev/null
grep -v '^WATCHDOG' "$work/notify.log" | sed 's/^/# notify: /' | head -20
finish
