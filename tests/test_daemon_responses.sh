#!/bin/bash
# Issue 18: the OpenAI Responses API of the real ds41d through the official OpenAI Node SDK
# (openai@6 responses.create / retrieve / delete, streaming; tests/tools/openai_responses_check.js):
# plain, streamed, reasoning, a function tool round trip, previous_response_id served from the
# prefix cache -- also after a restart (the snapshot tier) -- and the store's partition by peer:
# another uid cannot GET, DELETE or continue a response (404, as for an unknown id).  TAP.
. "$(dirname "$0")/daemon_lib.sh"
here=$(cd "$(dirname "$0")" && pwd)
. "$here/openai_sdk_lib.sh"
need_openai_sdk

cfg=$work/ds41d.yaml
write_config "$cfg"
two_uids=false
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && getent group nogroup >/dev/null; then
    two_uids=true # another uid connects through the socket's group
    sed -i 's/^  socket_group: null/  socket_group: nogroup/' "$cfg"
fi
if ! start_daemon "$cfg"; then
    notok "ds41d starts"; finish; exit 0
fi
ok "ds41d starts"
run_sdk_cases "$here/tools/openai_responses_check.js" "$mods" "$sock" first "$work/state.json"
check "the SDK script ran all 15 cases" test $cases -eq 15
id=$("$py" -c 'import json,sys;print(json.load(open(sys.argv[1]))["id"])' "$work/state.json" 2>/dev/null)
check "a stored response is a file under <state_directory>/responses" test -f "$state/responses/$(id -u)-$id.json"

# as UID METHOD PATH [BODY]: the request as another uid (gid nogroup); prints the status
as() {
    local uid=$1 method=$2 path=$3 body=${4-}
    setpriv --reuid="$uid" --regid=65534 --clear-groups -- curl -s -o /dev/null -w '%{http_code}' --unix-socket "$sock" \
        -X "$method" -H 'Content-Type: application/json' ${body:+--data-binary "$body"} "http://ds41$path"
}
if $two_uids; then
    check "another uid cannot GET the response (404)" test "$(as 65534 GET "/v1/responses/$id")" = 404
    check "another uid cannot DELETE it (404)" test "$(as 65534 DELETE "/v1/responses/$id")" = 404
    check "another uid cannot continue it (404)" \
        test "$(as 65534 POST /v1/responses "{\"input\":\"hi\",\"max_output_tokens\":2,\"previous_response_id\":\"$id\"}")" = 404
    check "its own responses work for the other uid (200)" \
        test "$(as 65534 POST /v1/responses '{"input":"hi","max_output_tokens":2}')" = 200
    check "the owner still GETs it (200)" test "$(api GET "/v1/responses/$id")" = 200
else
    skip "a second peer uid needs root, setpriv and the group nogroup (the store's partitions are checked in C too)"
fi
check "GET of an id that was never made: 404 in the OpenAI error shape" \
    test "$(api GET /v1/responses/resp_00000000000000000000000000000000):$(pyj 'o["error"]["code"]')" = "404:not_found"

stop_daemon TERM
check "the daemon exits 0" test "$daemon_status" = 0
if ! start_daemon "$cfg"; then
    notok "ds41d restarts"; finish; exit 0
fi
ok "ds41d restarts on the same state directory"
run_sdk_cases "$here/tools/openai_responses_check.js" "$mods" "$sock" restarted "$work/state.json"
check "the SDK script ran both cases after the restart" test $cases -eq 2
stop_daemon TERM
check "the daemon exits 0 again" test "$daemon_status" = 0
finish
