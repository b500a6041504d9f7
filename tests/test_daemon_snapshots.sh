#!/bin/bash
# Session snapshots through the real daemon (embedded model, temporary state directories): a
# conversation survives a restart (the next turn gives the same answer as an uninterrupted
# daemon, and its prompt is served from the disk snapshot: cached_tokens), the admin routes and
# `ds41ctl cache ls|save|restore|rm`, corrupted and truncated snapshots refused with a clear
# error while the daemon keeps serving (prefill instead), and a SIGKILL in the middle of a save
# (the test-only snapshots.test_save_delay_ms) never leaves a snapshot that restores wrongly.
# TAP.
. "$(dirname "$0")/daemon_lib.sh"
ctl() { "$bin/ds41ctl" --socket "$sock" "$@"; }

turn1='{"messages":[{"role":"user","content":"Tell me about the sea and the ships on it."}],"seed":3,"temperature":0.8,"max_tokens":12}'
# turn2 BODYFILE ANSWER1: the next turn (turn 1, its answer, a new question)
turn2_body() {
    "$py" - "$1" <<'PY'
import json, sys
a = sys.argv[1]
print(json.dumps({"messages": [{"role": "user", "content": "Tell me about the sea and the ships on it."},
                               {"role": "assistant", "content": a},
                               {"role": "user", "content": "And the harbours?"}],
                  "seed": 5, "temperature": 0.8, "max_tokens": 12}))
PY
}
answer() { pyj 'o["choices"][0]["message"]["content"]'; }
cached() { pyj 'o["usage"]["prompt_tokens_details"]["cached_tokens"]'; }
snapdir() { echo "$state/snapshots/ds41-tiny"; }
nsnaps() { ls "$(snapdir)" 2>/dev/null | grep -c '\.snap$'; }

# ---- the uninterrupted daemon --------------------------------------------------------------
state=$work/state-a
cfg=$work/a.yaml
write_config "$cfg"
if ! start_daemon "$cfg"; then notok "ds41d starts"; finish; exit 0; fi
st=$(api POST /v1/chat/completions "$turn1"); a1=$(answer)
body2=$(turn2_body "$a1")
st2=$(api POST /v1/chat/completions "$body2"); a2=$(answer); c2=$(cached); p2=$(pyj 'o["usage"]["prompt_tokens"]')
check "uninterrupted: two turns, the second served from the prefix cache (cached_tokens $c2)" \
    test "$st $st2 $([ "$c2" -gt 0 ] && echo y)" = "200 200 y"
stop_daemon TERM

# ---- the same conversation with a restart in between ---------------------------------------
state=$work/state-b
cfg=$work/b.yaml
write_config "$cfg"
start_daemon "$cfg" || { notok "ds41d starts"; finish; exit 0; }
api POST /v1/chat/completions "$turn1" >/dev/null; b1=$(answer)
check "turn 1 gives the same answer on both daemons" test "$b1" = "$a1"
stop_daemon TERM
check "SIGTERM: the daemon exits 0 and writes the cached conversations as snapshots ($(nsnaps) files)" \
    bash -c "test '$daemon_status' = 0 && test $(nsnaps) -ge 1 && ! ls -a '$(snapdir)' | grep -q '^\.tmp-'"
start_daemon "$cfg" || { notok "ds41d restarts"; finish; exit 0; }
check "after the restart the snapshots are indexed" grep -q "model ds41-tiny: [1-9][0-9]* session snapshot(s) in $(snapdir)" "$work/daemon.log"
st=$(api POST /v1/chat/completions "$body2"); b2=$(answer); cb2=$(cached)
check "after a restart the next turn gives the same answer as the uninterrupted daemon" test "$st:$b2" = "200:$a2"
check "and its prompt came from the disk snapshot: cached_tokens $cb2 = $c2" test "$cb2" = "$c2"
api GET /admin/cache >/dev/null
check "/admin/cache: a snapshots tier with one hit" test "$(pyj '",".join("%d:%s" % (t["hits"], t["used_bytes"] > 0) for t in o["tiers"] if t["name"] == "snapshots")')" = "1:True"

curl -s --unix-socket "$sock" http://ds41/metrics >"$work/metrics.txt"
check "/metrics: the snapshot series (one hit, the restored tokens)" \
    bash -c "grep -q '^ds41_snapshot_hits_total{model=\"ds41-tiny\"} 1\$' '$work/metrics.txt' &&
             grep -q '^ds41_snapshot_restored_tokens_total{model=\"ds41-tiny\"} $c2\$' '$work/metrics.txt' &&
             grep -q '^ds41_snapshot_files{model=\"ds41-tiny\"} [1-9]' '$work/metrics.txt'"

# ---- admin routes and ds41ctl --------------------------------------------------------------
ctl cache ls >"$work/ls.txt"; rc=$?
check "cache ls: a table of the snapshots" \
    bash -c "test $rc -eq 0 && head -1 '$work/ls.txt' | grep -q '^SNAPSHOT *TOKENS *SIZE *CREATED *LAST_USED *SAMPLER' && grep -q '^ds41-tiny:[0-9a-f]\{40\} ' '$work/ls.txt'"
ctl --json cache ls >"$work/ls.json"
n_before=$(pyj 'len(o["data"])' "$work/ls.json")
api GET /admin/snapshots >/dev/null
check "cache ls --json is GET /admin/snapshots" test "$(pyj 'len(o["data"])')" = "$n_before"
api GET /admin/sessions >/dev/null
sess=$(pyj 'max((s for s in o["data"] if s["state"] == "cached"), key=lambda s: s["prompt_tokens"])["id"]')
ctl --json cache save "$sess" >"$work/save.json"; rc=$?
snap=$(pyj 'o["id"]' "$work/save.json")
check "cache save SESSION: a snapshot of a cached session ($sess -> $snap)" \
    bash -c "test $rc -eq 0 && [[ '$snap' == ds41-tiny:* ]] && test -f '$(snapdir)/${snap#ds41-tiny:}.snap'"
ctl cache save ds41-tiny:c999999 >/dev/null 2>"$work/save.err"; rc=$?
check "cache save of an unknown session: exit 1 and a message" bash -c "test $rc -eq 1 && grep -q 'no session' '$work/save.err'"
# a running request, saved with its sampler state
curl -s --unix-socket "$sock" -H 'Content-Type: application/json' -o "$work/long.json" \
    --data-binary '{"messages":[{"role":"user","content":"Count."}],"max_tokens":3000,"ignore_eos":true,"seed":1}' \
    http://ds41/v1/chat/completions &
curl_pid=$!
live=
for i in $(seq 1 100); do
    api GET /admin/sessions >/dev/null
    live=$(pyj '([s["id"] for s in o["data"] if s["state"] == "decode"] + [""])[0]')
    [ -n "$live" ] && break
    sleep 0.1
done
st=$(api POST /admin/snapshots/save "{\"session\":\"$live\"}")
check "save of a running request includes its sampler state ($live)" test "$st:$(pyj 'o["sampler_state"]')" = "200:True"
api DELETE "/admin/sessions/$live" >/dev/null
wait $curl_pid
ctl cache restore "$snap" >"$work/restore.txt"; rc=$?
check "cache restore SNAPSHOT: loaded into the prefix cache as a session" \
    bash -c "test $rc -eq 0 && grep -q 'restored $snap into the prefix cache as ds41-tiny:c[0-9]* ' '$work/restore.txt'"
ctl cache rm "$snap" >/dev/null; rc=$?
ctl --json cache ls >"$work/ls2.json"
check "cache rm SNAPSHOT: deleted" bash -c "test $rc -eq 0 && test ! -f '$(snapdir)/${snap#ds41-tiny:}.snap' && ! grep -q '${snap#ds41-tiny:}' '$work/ls2.json'"
st=$(api DELETE "/admin/snapshots/$snap")
check "deleting it again: 404" test "$st" = 404
st=$(api POST /admin/snapshots/restore '{"id":"ds41-tiny:../../etc/passwd"}')
check "restore of a malformed id: 404" test "$st" = 404
st=$(api POST /admin/snapshots/save '{"session":"x","extra":1}')
check "an unknown field: 400" test "$st" = 400
stop_daemon TERM

# ---- corrupted and truncated snapshots ------------------------------------------------------
# corrupt the longest snapshot the next turn matches (its prompt less the last token); the one of
# turn 1's prompt stays intact
n_files=$(nsnaps)
victim=$("$py" - "$(snapdir)" "$((p2 - 1))" <<'PY'
import os, struct, sys
d, want = sys.argv[1], int(sys.argv[2])
for f in sorted(os.listdir(d)):
    if not f.endswith(".snap"):
        continue
    p = os.path.join(d, f)
    b = bytearray(open(p, "rb").read())
    if struct.unpack_from("<Q", b, 48)[0] == want:
        b[len(b) - 12] ^= 0xFF  # in the payload: the head still indexes, the load refuses it
        open(p, "wb").write(bytes(b))
        print(p)
PY
)
start_daemon "$cfg" || { notok "ds41d restarts"; finish; exit 0; }
st=$(api POST /v1/chat/completions "$body2"); b3=$(answer); c3=$(cached)
check "a corrupted snapshot is refused, the next longest restored: same answer (cached_tokens $c3 = $c2)" \
    test "$st:$b3:$c3" = "200:$a2:$c2"
check "the refusal says why, naming the file" \
    bash -c "test -n '$victim' && grep -q 'snapshot refused and deleted: $victim: checksum mismatch (file corrupted)' '$work/daemon.log'"
check "the corrupted file is deleted ($n_files -> $(nsnaps) files)" test ! -f "$victim" -a "$(nsnaps)" = "$((n_files - 1))"
st=$(api GET /health)
check "the daemon keeps serving" test "$st" = 200
stop_daemon TERM
for f in "$(snapdir)"/*.snap; do truncate -s $(($(stat -c %s "$f") - 40)) "$f"; done
big=$(ls "$(snapdir)"/*.snap | head -1)
start_daemon "$cfg" || { notok "ds41d restarts"; finish; exit 0; }
check "a truncated snapshot is refused at start with a message naming the file, and deleted" \
    bash -c "grep -q 'unreadable snapshot deleted: $big: truncated' '$work/daemon.log' && test ! -f '$big'"
st=$(api POST /v1/chat/completions "$body2"); b4=$(answer)
check "and the daemon answers by prefilling" test "$st:$b4" = "200:$a2"
stop_daemon TERM
# a snapshot truncated behind a valid head is refused when it is restored through the admin route
start_daemon "$cfg" || { notok "ds41d restarts"; finish; exit 0; }
api GET /admin/snapshots >/dev/null
victim=$(pyj 'o["data"][0]["id"]')
vfile="$(snapdir)/${victim#ds41-tiny:}.snap"
"$py" - "$vfile" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
b[-3] ^= 0x01
open(p, "wb").write(bytes(b))
PY
st=$(api POST /admin/snapshots/restore "{\"id\":\"$victim\"}")
msg=$(pyj 'o["error"]["message"]')
check "restore of a damaged snapshot: 400 naming the file and the reason" \
    bash -c "test '$st' = 400 && [[ \"\$1\" == *'$vfile: checksum mismatch'* ]]" _ "$msg"
stop_daemon TERM

# ---- SIGKILL in the middle of a save ------------------------------------------------------
write_config "$cfg" "snapshots:" "  test_save_delay_ms: 5000"
start_daemon "$cfg" || { notok "ds41d restarts"; finish; exit 0; }
api POST /v1/chat/completions "$turn1" >/dev/null
api GET /admin/sessions >/dev/null
sess=$(pyj '[s["id"] for s in o["data"] if s["state"] == "cached"][-1]')
before=$(ls "$(snapdir)" | sort)
curl -s -o /dev/null --unix-socket "$sock" -H 'Content-Type: application/json' \
    --data-binary "{\"session\":\"$sess\"}" http://ds41/admin/snapshots/save &
curl_pid=$!
seen=
for i in $(seq 1 100); do
    ls -a "$(snapdir)" | grep -q '^\.tmp-' && { seen=y; break; }
    sleep 0.05
done
stop_daemon KILL
wait $curl_pid 2>/dev/null
after=$(ls "$(snapdir)" | sort)
check "SIGKILL during a save: the save was in flight (temporary file), no new snapshot appeared" \
    test "$seen:$after" = "y:$before"
write_config "$cfg"
start_daemon "$cfg" || { notok "ds41d restarts"; finish; exit 0; }
check "at the next start the temporary file is cleaned" \
    bash -c "grep -q 'removed 1 temporary file' '$work/daemon.log' && ! ls -a '$(snapdir)' | grep -q '^\.tmp-'"
st=$(api POST /v1/chat/completions "$body2"); b5=$(answer)
check "and the conversation still gives the uninterrupted answer" test "$st:$b5" = "200:$a2"
stop_daemon TERM
check "no daemon error on the way (no crash: exit 0)" test "$daemon_status" = 0

# ---- the snapshot routes are admin routes --------------------------------------------------
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && getent group nogroup >/dev/null && getent group adm >/dev/null; then
    write_config "$cfg"
    sed -i 's/^  socket_group: null/  socket_group: nogroup/; s/^  admin_group: null/  admin_group: adm/' "$cfg"
    start_daemon "$cfg" || { notok "ds41d restarts"; finish; exit 0; }
    as() { local groups=$1; shift; setpriv --reuid=65534 --regid=65534 $groups -- "$@"; }
    req() { as "$1" curl -s -o /dev/null -w '%{http_code}' --unix-socket "$sock" -X "$2" -H 'Content-Type: application/json' ${4:+--data-binary "$4"} "http://ds41$3"; }
    codes="$(req --clear-groups GET /admin/snapshots) $(req --clear-groups POST /admin/snapshots/save '{"session":"ds41-tiny:c1"}')"
    codes="$codes $(req --clear-groups POST /admin/snapshots/restore '{"id":"ds41-tiny:x"}') $(req --clear-groups DELETE /admin/snapshots/ds41-tiny:x)"
    check "a peer outside the admin group: 403 on every snapshot route ($codes)" test "$codes" = "403 403 403 403"
    code=$(req --groups=4 GET /admin/snapshots)
    check "a member of the admin group: 200 ($code)" test "$code" = 200
    stop_daemon TERM
else
    skip "peer classes need root, setpriv and the groups nogroup and adm"
fi
finish
