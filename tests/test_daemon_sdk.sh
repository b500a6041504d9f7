#!/bin/bash
# The official OpenAI Node SDK (npm openai@6, with an undici@6 Agent on the socket path) against
# the real ds41d: streaming and non-streaming chat, the prefix cache, forced reasoning and tool
# calls received exactly, completions, errors.  openai@6 and undici@6 are installed into the npm
# cache dir once; the test is skipped, saying why, only when npm cannot be reached.  TAP.
. "$(dirname "$0")/daemon_lib.sh"
here=$(cd "$(dirname "$0")" && pwd)
. "$here/openai_sdk_lib.sh"
need_openai_sdk

write_config "$work/ds41d.yaml"
if ! start_daemon "$work/ds41d.yaml"; then
    notok "ds41d starts"; finish; exit 0
fi
ok "ds41d starts"
run_sdk_cases "$here/tools/openai_sdk_check.js" "$mods" "$sock"
check "the SDK script ran all 18 cases" test $cases -eq 18
stop_daemon TERM
check "the daemon exits 0" test "$daemon_status" = 0
finish
