#!/bin/bash
# ds41d operations (issue 13 items 3 and 4): one daemon per state directory (a second one exits
# naming the first one's pid, while the first keeps serving and finishes a snapshot save that was
# in flight, also after a SIGHUP); --check-config runs the start's checks (group, socket
# directory, state directory, model directories) and the start runs the same ones; ds41d run by
# hand without a config (--model/--name/--socket/--state-dir): a socket private to the invoking
# user, no group needed, the model served under --name.  TAP.
. "$(dirname "$0")/daemon_lib.sh"

cfg=$work/ds41d.yaml
lockmsg() { echo "state directory $state is in use by ds41d pid $1 (lock $state/ds41d.lock)"; }
# second_daemon LOG: a second ds41d on the first one's configuration, its own socket; prints its
# exit status (124: still running after 60 s, i.e. it started).
second_daemon() {
    timeout 60 "$ds41d" --config "$work/first.yaml" --socket "$work/second.sock" >"$1" 2>&1
    echo $?
}

# ---- one daemon per state directory ---------------------------------------------------------
# Admin routes (the snapshot save) for the test's own group, root or not.
write_config "$cfg" "snapshots:" "  test_save_delay_ms: 3000"
sed -i "s/^  admin_group: null\$/  admin_group: \"$(id -gn)\"/" "$cfg"
cp "$cfg" "$work/first.yaml"
if ! start_daemon "$cfg"; then notok "ds41d starts"; finish; exit 0; fi
first=$daemon_pid
check "the first daemon holds the lock: its pid is in $state/ds41d.lock" \
    test "$(cat "$state/ds41d.lock" 2>/dev/null)" = "$first"
chat='{"model":"ds41-tiny","messages":[{"role":"user","content":"Tell me about the sea."}],"max_tokens":8,"seed":1}'
st=$(api POST /v1/chat/completions "$chat")
api GET /admin/sessions >/dev/null
sess=$(pyj '[s["id"] for s in o["data"] if s["state"] == "cached"][-1]' 2>/dev/null)
note "chat $st, cached session ${sess:-none}"
snapdir=$state/snapshots/ds41-tiny
# a save in flight (the test hook holds it half-way for 3 s) while a second daemon starts
curl -s -o "$work/save.json" -w '%{http_code}' --unix-socket "$sock" -H 'Content-Type: application/json' \
    --data-binary "{\"session\":\"$sess\"}" http://ds41/admin/snapshots/save >"$work/save.code" &
curl_pid=$!
inflight=
for i in $(seq 1 100); do
    ls -a "$snapdir" 2>/dev/null | grep -q '^\.tmp-' && { inflight=y; break; }
    sleep 0.05
done
rc=$(second_daemon "$work/second.log")
check "a second daemon on the same state directory exits 1 naming the first one's pid (rc $rc)" \
    bash -c "test '$rc' = 1 && grep -qF '$(lockmsg "$first")' '$work/second.log'"
[ "$rc" = 1 ] || sed 's/^/# second: /' "$work/second.log" | tail -5
check "... before it touched the state directory (no socket of its own, the lock file keeps the first pid)" \
    bash -c "test ! -e '$work/second.sock' && test \"\$(cat '$state/ds41d.lock')\" = '$first'"
wait $curl_pid
save=$(cat "$work/save.code")
snap=$(pyj 'o.get("id", "")' "$work/save.json" 2>/dev/null)
check "the save that was in flight (${inflight:-not seen}) succeeds: 200, the snapshot file exists" \
    bash -c "test '$inflight:$save' = 'y:200' && test -f '$snapdir/${snap#ds41-tiny:}.snap'"
st=$(api GET /health)
st2=$(api POST /v1/chat/completions "$chat")
check "the first daemon still serves (/health $st, chat $st2)" test "$st:$st2" = "200:200"
# A reload keeps the lock, also when the file names another state directory.
sed -i "s|^state_directory: .*|state_directory: $work/state-other|" "$cfg"
kill -HUP "$first"
for i in $(seq 1 100); do grep -q 'configuration reloaded' "$work/daemon.log" && break; sleep 0.05; done
check "SIGHUP with another state_directory: reloaded, the change waits for the next start" \
    grep -q 'reload: state_directory changes take effect at the next start' "$work/daemon.log"
rc=$(second_daemon "$work/second2.log")
check "after SIGHUP a second daemon is still refused with the first one's pid (rc $rc)" \
    bash -c "test '$rc' = 1 && grep -qF '$(lockmsg "$first")' '$work/second2.log'"
st=$(api POST /v1/chat/completions "$chat")
check "and the first daemon still serves (chat $st)" test "$st" = 200
stop_daemon TERM
check "the first daemon exits 0" test "$daemon_status" = 0
if start_daemon "$work/first.yaml"; then
    ok "once it has exited the state directory is free: a new daemon starts on it"
    stop_daemon TERM
else
    notok "once it has exited the state directory is free: a new daemon starts on it"
fi

# ---- --check-config runs the checks of a start ------------------------------------------------
model=$state/embedded/tiny-seed1
write_config "$cfg"
# check_fails NAME PATTERN [ds41d args]: --check-config exits 1 with PATTERN (fixed string) on stderr
check_fails() {
    local what=$1 pattern=$2; shift 2
    "$ds41d" --config "$cfg" --check-config "$@" >/dev/null 2>"$work/check.err"
    local rc=$?
    if [ $rc = 1 ] && grep -qF -- "$pattern" "$work/check.err"; then
        ok "--check-config: $what (exit 1: $pattern)"
    else
        notok "--check-config: $what (exit $rc, wanted 1 and: $pattern)"
        sed 's/^/# /' "$work/check.err"
    fi
}
"$ds41d" --config "$cfg" --check-config --model "$model" >/dev/null 2>"$work/check.err"; rc=$?
check "--check-config: a good configuration with a model directory passes (exit $rc)" test $rc = 0
sed -i 's/^  socket_group: null$/  socket_group: ds41-no-such-group/' "$cfg"
check_fails "a missing socket group" "key 'listen.socket_group': group 'ds41-no-such-group' does not exist"
sed -i "s|^state_directory: .*|state_directory: $work/state-start|" "$cfg"
"$ds41d" --config "$cfg" >"$work/start.log" 2>&1; rc=$?
check "the start fails on the same check, before the socket or the state directory exist (exit $rc)" \
    bash -c "test $rc = 1 && grep -qF \"key 'listen.socket_group': group 'ds41-no-such-group' does not exist\" '$work/start.log' &&
             test ! -e '$sock' -a ! -e '$work/state-start'"
write_config "$cfg"
check_fails "an uncreatable socket directory" "key 'listen.socket': cannot create the socket directory $work/none/sub" \
    --socket "$work/none/sub/ds41d.sock"
touch "$work/file"
check_fails "a socket directory that is a file" "key 'listen.socket': $work/file: not a directory" \
    --socket "$work/file/ds41d.sock"
sed -i "s|^state_directory: .*|state_directory: $work/file/state|" "$cfg"
check_fails "an uncreatable state directory" "key 'state_directory': $work/file/state: cannot create it: $work/file is not a directory"
write_config "$cfg"
check_fails "a missing model directory" "key 'models[0].path' (model deepseek-v4.1-flash): $work/nomodel: No such file or directory" \
    --model "$work/nomodel"
mkdir -p "$work/notckpt"
echo '{"model_type": "deepseek_v4"}' >"$work/notckpt/config.json"
check_fails "a model directory that is not a checkpoint (only a root config.json)" \
    "key 'models[0].path' (model deepseek-v4.1-flash): $work/notckpt is not a ds41 checkpoint: $work/notckpt/inference/config.json" \
    --model "$work/notckpt"
mkdir -p "$work/noshards/inference"
cp "$model/inference/config.json" "$work/noshards/inference/"
check_fails "a model directory without its safetensors shards" "key 'models[0].path' (model deepseek-v4.1-flash): $work/noshards: cannot open the checkpoint" \
    --model "$work/noshards"
write_config "$cfg" "models:" "  - name: good" "    path: $model" "  - name: other" "    path: $work/notckpt"
check_fails "every models[] entry is checked, not only the default" "key 'models[1].path' (model other)"
"$ds41d" --name x --check-config >/dev/null 2>"$work/check.err"; rc=$?
check "--name without --model is a usage error (exit $rc)" bash -c "test $rc = 2 && grep -q -- '--model' '$work/check.err'"

# ---- run by hand: no config ----------------------------------------------------------------
hsock=$work/hand.sock
# hand_daemon LOG [args]: ds41d with options only, in the background; waits for /health on $hsock.
hand_daemon() {
    local log=$1; shift
    "$@" >"$log" 2>&1 &
    daemon_pid=$!
    for i in $(seq 1 300); do
        [ -S "$hsock" ] && [ "$(curl -s -o /dev/null -w '%{http_code}' --unix-socket "$hsock" http://ds41/health)" = 200 ] && return 0
        kill -0 "$daemon_pid" 2>/dev/null || break
        sleep 0.1
    done
    sed 's/^/# daemon: /' "$log" | tail -5
    return 1
}
hchat='{"model":"my-model","messages":[{"role":"user","content":"Hello there."}],"max_tokens":6,"seed":1}'
if [ -e /etc/ds41d/ds41d.yaml ]; then
    skip "/etc/ds41d/ds41d.yaml exists on this machine: a run without --config reads it"
else
    if hand_daemon "$work/hand.log" "$ds41d" --model "$model" --name my-model --socket "$hsock" --state-dir "$work/hstate"; then
        ok "ds41d --model --name --socket --state-dir starts without a config"
        check "the socket is private to the invoking user: mode 0600, owner $(id -u), group $(id -g) (not chowned)" \
            test "$(stat -c '%a %u %g' "$hsock")" = "600 $(id -u) $(id -g)"
        check "the log says the by-hand defaults are used" grep -q 'built-in defaults for a run by hand' "$work/hand.log"
        st=$(curl -s -o "$work/body" -w '%{http_code}' --unix-socket "$hsock" http://ds41/v1/models)
        check "/v1/models lists the --name id only" test "$st $(pyj '[m["id"] for m in o["data"]]')" = '200 ["my-model"]'
        st=$(curl -s -o "$work/body" -w '%{http_code}' --unix-socket "$hsock" -H 'Content-Type: application/json' \
            --data-binary "$hchat" http://ds41/v1/chat/completions)
        check "a chat with model my-model works" \
            test "$st $(pyj 'o["model"]') $(pyj 'o["usage"]["completion_tokens"] > 0')" = "200 my-model True"
        check "the state is in --state-dir (the lock with the daemon's pid)" \
            test "$(cat "$work/hstate/ds41d.lock" 2>/dev/null)" = "$daemon_pid"
        kill -TERM "$daemon_pid"; wait "$daemon_pid"; rc=$?; daemon_pid=
        check "it stops with status 0 and removes its socket" bash -c "test $rc = 0 && test ! -e '$hsock'"
    else
        notok "ds41d --model --name --socket --state-dir starts without a config"
    fi
    # As a user other than root: no group of its own needed, the state in $XDG_STATE_HOME/ds41d.
    if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
        home=$work/nobody
        hsock=$home/hand.sock
        mkdir -p "$home"
        cp -r "$model" "$home/m"
        chown -R 65534:65534 "$home"
        if hand_daemon "$work/nobody.log" env -i PATH="$PATH" XDG_STATE_HOME="$home/xdg" \
            setpriv --reuid=65534 --regid=65534 --clear-groups "$ds41d" --model "$home/m" --socket "$hsock"; then
            st=$(curl -s -o "$work/body" -w '%{http_code}' --unix-socket "$hsock" -H 'Content-Type: application/json' \
                --data-binary "${hchat/my-model/deepseek-v4.1-flash}" http://ds41/v1/chat/completions)
            check "as uid 65534 without groups: socket 0600 owned by 65534, state in \$XDG_STATE_HOME/ds41d, a chat works" \
                test "$(stat -c '%a %u %g' "$hsock") $(cat "$home/xdg/ds41d/ds41d.lock" 2>/dev/null) $st" = \
                     "600 65534 65534 $daemon_pid 200"
            kill -TERM "$daemon_pid"; wait "$daemon_pid"; daemon_pid=
        else
            notok "as uid 65534 without groups: ds41d --model --socket starts"
        fi
        env -i PATH="$PATH" HOME="$home" setpriv --reuid=65534 --regid=65534 --clear-groups "$ds41d" \
            --model "$home/m" --socket "$hsock" --check-config >"$work/home.yaml" 2>"$work/home.err"; rc=$?
        check "as uid 65534 with HOME and no XDG_STATE_HOME: the state in ~/.local/state/ds41d (exit $rc)" \
            bash -c "test $rc = 0 && grep -qx 'state_directory: $home/.local/state/ds41d' '$work/home.yaml'"
        env -i PATH="$PATH" HOME=/root XDG_STATE_HOME="$home/xdg" "$ds41d" --model "$model" --check-config \
            >"$work/root.yaml" 2>/dev/null
        check "as root by hand: the service's state directory and socket path, but mode 0600 and no group" \
            bash -c "grep -qx 'state_directory: /var/lib/ds41d' '$work/root.yaml' &&
                     grep -qx '  socket: /run/ds41d/ds41d.sock' '$work/root.yaml' &&
                     grep -qx '  socket_mode: \"0600\"' '$work/root.yaml' && grep -qx '  socket_group: null' '$work/root.yaml'"
    else
        skip "running as another user needs root and setpriv"
    fi
fi

finish
