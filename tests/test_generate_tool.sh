#!/bin/bash
# ds41-generate end to end on a generated tiny checkpoint: greedy output equals ds41-eval's argmax
# chain on the same ids, raw prompts are tokenized like ds41-tokenize, seeded sampling repeats,
# forced output streams marked reasoning and a parsed tool call, bad arguments exit 2.  TAP.
set -u
bin=${DS41_BUILD_DIR:?DS41_BUILD_DIR not set}/daemon
gen=$bin/ds41-generate
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
n=0
ok() { n=$((n + 1)); echo "ok $n - $*"; }
notok() { n=$((n + 1)); echo "not ok $n - $*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else notok "$what"; fi; }
py=/usr/bin/python3
[ -x $py ] || py=python3

m=$work/tiny
if ! "$bin/ds41-mkmodel" "$m" --quiet >"$work/mk.log" 2>&1; then
    notok "ds41-mkmodel tiny"; sed 's/^/# /' "$work/mk.log"; echo "1..$n"; exit 0
fi

# greedy = ds41-eval's argmax chain on the same prompt ids
ids=0,40,41,42,300,301,302,7,8,9
"$gen" --model "$m" --ids $ids --max-tokens 16 --ignore-eos --json >"$work/g.json" 2>"$work/g.err"
"$bin/ds41-eval" --model "$m" --ids $ids --decode 16 --out "$work/e.json" 2>"$work/e.err"
same=$($py - "$work/g.json" "$work/e.json" <<'EOF'
import json, sys
g = json.load(open(sys.argv[1])); e = json.load(open(sys.argv[2]))
print("yes" if g["ids"] == [s["token"] for s in e["greedy"]] and len(g["ids"]) == 16 else "no: %s vs %s" % (g["ids"], [s["token"] for s in e["greedy"]]))
EOF
)
check "greedy ids = ds41-eval --decode 16 argmax chain ($same)" test "$same" = yes

# ds41-eval with the Engram rows streamed under 2 KiB (fewer rows than one step reads, each greedy
# token's rows prefetched) and with the tables resident: the same bytes, fast and reference
"$bin/ds41-eval" --model "$m" --ids $ids --decode 16 --chunk 4 --engram-cache-bytes 2KiB --out "$work/es.json" 2>"$work/es.err"
"$bin/ds41-eval" --model "$m" --ids $ids --decode 4 --reference --out "$work/er.json" 2>/dev/null
"$bin/ds41-eval" --model "$m" --ids $ids --decode 4 --reference --engram-cache-bytes 1000 --out "$work/ers.json" 2>/dev/null
check "ds41-eval --engram-cache-bytes 2KiB: logits byte-identical to resident (fast, and reference)" \
    eval 'cmp -s "$work/e.json" "$work/es.json" && cmp -s "$work/er.json" "$work/ers.json"'
"$bin/ds41-eval" --model "$m" --ids $ids --engram-cache-bytes 12XB --out "$work/x.json" >/dev/null 2>"$work/x.err"
rc=$?
check "ds41-eval --engram-cache-bytes 12XB: exit 2 naming the unit" eval '[ $rc -eq 2 ] && grep -q "unknown unit" "$work/x.err"'

# chunked prefill gives the same answer
"$gen" --model "$m" --ids $ids --max-tokens 16 --ignore-eos --json --chunk 3 >"$work/g3.json" 2>/dev/null
check "--chunk 3 gives the same tokens" cmp -s <($py -c 'import json,sys;print(json.load(open(sys.argv[1]))["ids"])' "$work/g.json") \
    <($py -c 'import json,sys;print(json.load(open(sys.argv[1]))["ids"])' "$work/g3.json")

# --raw: the prompt is the text's ids exactly
"$gen" --model "$m" --raw --prompt 'Once upon a time' --max-tokens 2 --json >"$work/r.json" 2>/dev/null
want=$(echo '"Once upon a time"' | "$bin/ds41-tokenize" "$m/tokenizer.json" | tr -d ' ')
have=$($py -c 'import json,sys;print(json.dumps(json.load(open(sys.argv[1]))["prompt_ids"]).replace(" ",""))' "$work/r.json")
check "--raw prompt ids = ds41-tokenize ids ($have)" test "$want" = "$have"

# --prompt is one user message in the chat encoding
"$gen" --model "$m" --prompt 'Hi' --thinking --effort 30 --max-tokens 1 --json >"$work/c.json" 2>/dev/null
text=$($py -c 'import json,sys;ids=json.load(open(sys.argv[1]))["prompt_ids"];print(json.dumps(ids))' "$work/c.json" |
    "$bin/ds41-tokenize" "$m/tokenizer.json" --decode)
check "--prompt --thinking --effort renders the V4.1 chat prompt" test "$text" = \
    '"<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 30 (range 1-100, the higher the value, the more thorough the reasoning)\n\n<｜User｜>Hi<｜Assistant｜><think>"'

# seeded sampling repeats; another seed differs
"$gen" --model "$m" --prompt 'Tell me' --temperature 1 --seed 11 --max-tokens 20 --ignore-eos >"$work/s1" 2>/dev/null
"$gen" --model "$m" --prompt 'Tell me' --temperature 1 --seed 11 --max-tokens 20 --ignore-eos >"$work/s2" 2>/dev/null
"$gen" --model "$m" --prompt 'Tell me' --temperature 1 --seed 12 --max-tokens 20 --ignore-eos >"$work/s3" 2>/dev/null
check "the same --seed prints the same text" cmp -s "$work/s1" "$work/s2"
check "another --seed prints another text" bash -c "! cmp -s '$work/s1' '$work/s3'"

# forced output: marked reasoning, a parsed tool call, finish tool_calls
forced='Let me look
it up.</think>

<｜DSML｜ calls>
<｜DSML｜ invoke name="get_weather">
<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
</｜DSML｜ invoke>
</｜DSML｜ calls><｜end▁of▁sentence｜>'
"$gen" --model "$m" --prompt 'Weather?' --thinking --forced "$forced" >"$work/f.out" 2>"$work/f.err"
expect=$(printf '> Let me look\n> it up.\n\n[tool call] get_weather {"city": "Paris"}')
check "streamed: reasoning lines prefixed '> ', then the tool call" test "$(cat "$work/f.out")" = "$expect"
check "summary on stderr says finish tool_calls" grep -q 'finish: tool_calls' "$work/f.err"
"$gen" --model "$m" --prompt 'Weather?' --thinking --forced "$forced" --json >"$work/f.json" 2>/dev/null
res=$($py - "$work/f.json" <<'EOF'
import json, sys
o = json.load(open(sys.argv[1]))
m = o["message"]
ok = (m["reasoning_content"] == "Let me look\nit up." and m["content"] == "" and
      m["tool_calls"] == [{"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}] and
      o["finish_reason"] == "tool_calls" and o["stream"] == {"reasoning": m["reasoning_content"], "content": ""})
print("yes" if ok else "no: %r" % o)
EOF
)
check "--json: the parsed message has the tool call and the reasoning ($res)" test "$res" = yes

# stop strings and max tokens
"$gen" --model "$m" --prompt 'x' --forced 'alpha beta gamma delta' --stop 'a gam' --json >"$work/st.json" 2>/dev/null
res=$($py -c 'import json,sys;o=json.load(open(sys.argv[1]));print(o["message"]["content"], o["finish_reason"])' "$work/st.json")
check "--stop cuts before the stop string ($res)" test "$res" = "alpha bet stop"

# bad arguments
"$gen" --model "$m" >/dev/null 2>&1; rc=$?
check "no prompt: exit 2" test $rc -eq 2
"$gen" --model "$m" --prompt x --temperature -1 >/dev/null 2>&1; rc=$?
check "negative temperature: exit 2" test $rc -eq 2
"$gen" --model "$work/nowhere" --prompt x >/dev/null 2>"$work/nm.err"; rc=$?
check "missing model directory: exit 2 with a message naming it" bash -c "test $rc -eq 2 && grep -q nowhere '$work/nm.err'"
echo '[{"role":"wizard","content":"x"}]' >"$work/bad.json"
"$gen" --model "$m" --messages "$work/bad.json" >/dev/null 2>"$work/bad.err"; rc=$?
check "an unknown role: exit 2 with the encoder's message" bash -c "test $rc -eq 2 && grep -q 'Unknown role: wizard' '$work/bad.err'"

echo "1..$n"
