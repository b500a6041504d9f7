#!/bin/bash
# Issue 13, item 2: the prefix cache must not tell one local user what another sent.  Two real
# uids (setpriv, both in the socket's group) talk to the real daemon over its Unix socket: user A
# sends "My bank PIN is 4711 and my password is hunter2"; user B sending the same text (a guess
# confirmed) or another PIN gets cached_tokens 0, while A's repeat is a hit -- in the memory tier,
# in the disk tier (a snapshot saved for A, the memory entries dropped), and across a restart
# (the entries written to disk at shutdown record their partition).  cache_salt separates
# requests of one uid (and is validated: 400 naming the field); prefix_cache.share_across_users
# turns sharing on; admins see the setting and each entry's owner uid, other peers get 403.
# A version-1 snapshot file (before partitions) is deleted at start with a log line.  TAP.
. "$(dirname "$0")/daemon_lib.sh"
ctl() { "$bin/ds41ctl" --socket "$sock" "$@"; }

if ! { [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && getent group nogroup >/dev/null &&
    getent group adm >/dev/null; }; then
    skip "two peer uids need root, setpriv and the groups nogroup and adm"
    finish
    exit 0
fi
UA=65533 # user A (no passwd entry needed: SO_PEERCRED reports the uid)
UB=65534 # user B (nobody)

cfg=$work/ds41d.yaml
config() {
    write_config "$cfg" "$@"
    # both users connect through the socket's group; root and the adm group are the admins
    sed -i 's/^  socket_group: null/  socket_group: nogroup/; s/^  admin_group: null/  admin_group: adm/' "$cfg"
}

# as UID METHOD PATH [BODY]: the request as uid UID (gid nogroup, no other groups); the reply
# body goes to $work/body (written by this shell: the users cannot write here); prints the status.
as() {
    local uid=$1 method=$2 path=$3 body=${4-}
    setpriv --reuid="$uid" --regid=65534 --clear-groups -- curl -s -w '\n%{http_code}' --unix-socket "$sock" \
        -X "$method" -H 'Content-Type: application/json' ${body:+--data-binary "$body"} "http://ds41$path" \
        >"$work/raw"
    head -n -1 "$work/raw" >"$work/body"
    tail -n 1 "$work/raw"
}
secret() { printf '{"messages":[{"role":"user","content":"My bank PIN is %s and my password is %s"}],"temperature":0,"max_tokens":2%s}' "$1" "$2" "${3:+,\"cache_salt\":\"$3\"}"; }
# chat UID PIN PASSWORD [SALT]: prints "STATUS CACHED PROMPT"
chat() {
    local st
    st=$(as "$1" POST /v1/chat/completions "$(secret "$2" "$3" "${4-}")")
    if [ "$st" = 200 ]; then
        echo "$st $(pyj 'o["usage"]["prompt_tokens_details"]["cached_tokens"]') $(pyj 'o["usage"]["prompt_tokens"]')"
    else
        echo "$st - -"
    fi
}
hit() { test "$1" = 200 && test "$2" = "$(($3 - 1))"; } # STATUS CACHED PROMPT: the prompt less its last token
miss() { test "$1" = 200 && test "$2" = 0; }
same() { test "$1" = "$2"; }
# probe WHAT hit|miss UID PIN PASSWORD [SALT]: one chat as UID, checked; WHAT gets the result appended
probe() {
    local what=$1 kind=$2 r
    shift 2
    r=$(chat "$@")
    check "$what ($r)" $kind $r
}
# expect hit|miss|same "ARGS" [...]: every pair holds (ARGS split into words)
expect() { while [ $# -ge 2 ]; do "$1" $2 || return 1; shift 2; done; }

config
start_daemon "$cfg" || { notok "ds41d starts"; finish; exit 0; }
check "the socket admits both users: mode 0660, group nogroup" test "$(stat -c '%a %G' "$sock")" = "660 nogroup"

# ---- the memory tier: the issue's example ------------------------------------------------------
a1=$(chat $UA 4711 hunter2)
probe "user A sent the PIN 4711 ($a1); user B guessing 4711 gets cached_tokens 0" miss $UB 4711 hunter2
probe "user B guessing 1234 gets cached_tokens 0 as well: no guess is confirmed" miss $UB 1234 hunter2
probe "user A's own repeat is served from the prefix cache: the prompt less its last token" hit $UA 4711 hunter2
probe "user B's repeat hits B's own entry" hit $UB 4711 hunter2

# ---- cache_salt -----------------------------------------------------------------------------------
s1=$(chat $UA 4711 hunter2 tenant-1)
s2=$(chat $UA 4711 hunter2 tenant-1)
s3=$(chat $UA 4711 hunter2 tenant-2)
check "the same uid with a cache_salt: a miss ($s1), then a hit within that salt ($s2), another salt misses ($s3)" \
    expect miss "$s1" hit "$s2" miss "$s3"
bad=""
for v in '5' '""' "\"$(printf 'x%.0s' $(seq 257))\"" '["a"]'; do
    st=$(as $UA POST /v1/chat/completions "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1,\"cache_salt\":$v}")
    bad="$bad $st:$(pyj 'o["error"]["param"]')"
done
st=$(as $UA POST /v1/completions '{"prompt":"hi","max_tokens":1,"cache_salt":7}')
bad="$bad $st:$(pyj 'o["error"]["param"]')"
check "bad cache_salt values (a number, empty, 257 bytes, an array; /v1/completions): 400 naming the field ($bad)" \
    test "$bad" = " 400:cache_salt 400:cache_salt 400:cache_salt 400:cache_salt 400:cache_salt"
st=$(as $UA POST /v1/completions '{"prompt":"My bank PIN is 4711","max_tokens":1,"cache_salt":"c"}')
st2=$(as $UA POST /v1/completions '{"prompt":"My bank PIN is 4711","max_tokens":1,"cache_salt":"c"}')
check "/v1/completions accepts cache_salt and hits within it ($st $st2 cached $(pyj 'o["usage"]["prompt_tokens_details"]["cached_tokens"]'))" \
    test "$st $st2 $(pyj 'o["usage"]["prompt_tokens_details"]["cached_tokens"] > 0')" = "200 200 True"

# ---- what admins see, what the users see ------------------------------------------------------------
st=$(api GET /admin/sessions)
owners=$(pyj 'sorted({s["owner_uid"] for s in o["data"] if s["state"] == "cached"})')
check "admin: /admin/sessions shows each cached entry's owner uid ($owners)" test "$owners" = "[$UA, $UB]"
st=$(api GET /admin/cache)
check "admin: /admin/cache says sharing is off" test "$st $(pyj 'o["prefix_shared_across_users"]')" = "200 False"
ctl cache >"$work/ctl.out" 2>&1
check "ds41ctl cache: the sharing setting and an OWNER column with both uids" \
    bash -c "grep -q 'not shared across users' '$work/ctl.out' && grep -q OWNER '$work/ctl.out' && grep -q ' $UA' '$work/ctl.out' && grep -q ' $UB' '$work/ctl.out'"
ctl status >"$work/ctl.out" 2>&1
check "ds41ctl status (admin): the prefix cache is per user" grep -q 'prefix cache per user' "$work/ctl.out"
codes="$(as $UB GET /admin/sessions) $(as $UB GET /admin/snapshots) $(as $UB GET /admin/cache)"
check "user B: 403 on the session, snapshot and cache listings (no other user's ids) ($codes)" test "$codes" = "403 403 403"
setpriv --reuid=$UB --regid=65534 --clear-groups -- "$bin/ds41ctl" --socket "$sock" status >"$work/ctl.out" 2>&1
check "ds41ctl status as user B: no cache line, no admin data" bash -c "! grep -q '^cache:' '$work/ctl.out'"

# ---- the disk tier (no restart): every entry saved (A's new one among them), the memory dropped ------
d1=$(chat $UA 2468 swordfish)
api GET /admin/sessions >/dev/null
pyj '" ".join(s["id"] for s in o["data"] if s["state"] == "cached")' >"$work/all_ids"
saved=0
for id in $(cat "$work/all_ids"); do [ "$(api POST /admin/snapshots/save "{\"session\":\"$id\"}")" = 200 ] && saved=$((saved + 1)); done
for id in $(cat "$work/all_ids"); do api DELETE "/admin/sessions/$id" >/dev/null; done
api GET /admin/sessions >/dev/null
left=$(pyj 'sum(1 for s in o["data"] if s["state"] == "cached")')
api GET /admin/snapshots >/dev/null
snap_owners=$(pyj 'sorted({s.get("owner_uid") for s in o["data"]})')
check "the cached entries saved as snapshots ($saved, owners $snap_owners), every memory entry dropped ($left left)" \
    test "$([ $saved -ge 2 ] && echo y) $snap_owners $left" = "y [$UA, $UB] 0"
db=$(chat $UB 2468 swordfish)
check "disk tier: user B's guess of A's prompt is not restored from A's snapshot ($db)" miss $db
da=$(chat $UA 2468 swordfish)
api GET /admin/cache >/dev/null
sn_hits=$(pyj '[t["hits"] for t in o["tiers"] if t["name"] == "snapshots"][0]')
check "disk tier: user A's repeat is restored from the snapshot ($da; snapshot hits $sn_hits)" \
    expect hit "$da" same "$sn_hits 1"

# ---- across a restart ------------------------------------------------------------------------------
r1=$(chat $UA 1357 letmein)
stop_daemon TERM
snapdir=$state/snapshots/ds41-tiny
formats=$("$py" - "$snapdir" $UA <<'EOF'
import glob, struct, sys
owners = set()
for f in glob.glob(sys.argv[1] + "/*.snap"):
    b = open(f, "rb").read(136)
    version, uid = struct.unpack("<I", b[8:12])[0], struct.unpack("<q", b[120:128])[0]
    owners.add((version, uid))
print(" ".join("v%d:%d" % p for p in sorted(owners)))
EOF
)
check "shutdown wrote the entries to disk, each file recording its owner ($formats)" \
    bash -c "echo '$formats' | grep -q 'v2:$UA' && echo '$formats' | grep -q 'v2:$UB' && ! echo '$formats' | grep -q 'v1'"
# a snapshot of the format before partitions: its owner is unknown, so it must not be served
"$py" - "$snapdir/0123456789abcdef0123456789abcdef01234567.snap" <<'EOF'
import struct, sys
head = b"DS41SNAP" + struct.pack("<II", 1, 0) + bytes(32) + struct.pack("<QQQQq", 1, 20, 0, 20, 0) + bytes(8)
open(sys.argv[1], "wb").write(head + struct.pack("<I", 5) + bytes(20) + bytes(8))
EOF
start_daemon "$cfg" || { notok "ds41d restarts"; finish; exit 0; }
check "a version-1 snapshot is deleted at start with a log line saying why" \
    bash -c "grep -q 'format version 1 has no cache partition' '$work/daemon.log' && ! test -e '$snapdir/0123456789abcdef0123456789abcdef01234567.snap'"
probe "after the restart user B still gets cached_tokens 0 for A's prompt" miss $UB 1357 letmein
probe "after the restart user A gets the hit from A's snapshot ($r1 before)" hit $UA 1357 letmein
rs=$(chat $UA 4711 hunter2 tenant-1)
rs3=$(chat $UA 4711 hunter2 tenant-3)
check "the cache_salt partition survives the restart too ($rs; another salt: $rs3)" expect hit "$rs" miss "$rs3"
ctl cache ls >"$work/ctl.out" 2>&1
check "ds41ctl cache ls: an OWNER column with the owners' uids" \
    bash -c "grep -q OWNER '$work/ctl.out' && grep -q ' $UA' '$work/ctl.out' && grep -q ' $UB' '$work/ctl.out'"
stop_daemon TERM

# ---- the operator shares the cache across users -------------------------------------------------------
config "prefix_cache:" "  share_across_users: true"
start_daemon "$cfg" || { notok "ds41d starts with sharing on"; finish; exit 0; }
h1=$(chat $UA 8080 opensesame)
h2=$(chat $UB 8080 opensesame)
h3=$(chat $UB 8080 opensesame other)
check "share_across_users: true: user B hits user A's entry ($h1; $h2), a cache_salt still separates ($h3)" \
    expect miss "$h1" hit "$h2" miss "$h3"
st=$(api GET /admin/cache)
check "admin: /admin/cache says sharing is on" test "$st $(pyj 'o["prefix_shared_across_users"]')" = "200 True"
ctl status >"$work/ctl.out" 2>&1
check "ds41ctl status (admin): shared across users" grep -q 'prefix cache shared across users' "$work/ctl.out"
stop_daemon TERM
check "no daemon error on the way (exit 0)" test "$daemon_status" = 0
finish
