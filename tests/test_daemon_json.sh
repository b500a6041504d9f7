#!/bin/bash
# ds41d structured output, extra request fields and timings (issue 18), on the random-weight
# embedded model over the Unix socket:
#  - response_format json_object / json_schema is enforced while generating: 6 schemas x 20 seeds
#    x (streamed, not streamed) = 240 requests, plus 10 in thinking mode, every content parses
#    and validates against its schema with Python's jsonschema (a real JSON Schema validator),
#    finish_reason "stop"; a max_tokens too small for the shortest document ends with "length";
#    unsupported keywords are refused with 400 naming the keyword's path;
#  - min_tokens holds EOS and stop strings back; cache_prompt / keep_alive are accepted with a
#    log line; other unknown fields still get 400 naming them; top_k 1 and min_p 1 are greedy,
#    repetition_penalty changes a greedy output;
#  - "timings" next to usage (non-streamed) and on the last SSE chunk, consistent with usage.
. "$(dirname "$0")/daemon_lib.sh"

if ! "$py" -c 'import jsonschema' 2>/dev/null; then
    skip "Python jsonschema is not installed (apt-get install python3-jsonschema)"
    finish
    exit 0
fi

write_config "$work/c.yaml"
check "daemon starts" start_daemon "$work/c.yaml"

# ---- structured output: many seeds x schemas, streamed and not, validated by jsonschema ----
"$py" - "$sock" >"$work/jf.out" 2>&1 <<'EOF'
import http.client, json, socket, sys
import jsonschema

sock = sys.argv[1]

class UC(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sock)

def post(body):
    c = UC("ds41", timeout=300)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read().decode("utf-8")
    c.close()
    return r.status, data

def sse(data):
    content, finish, last = "", None, None
    for line in data.split("\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        last = ev
        for ch in ev.get("choices", []):
            content += ch.get("delta", {}).get("content") or ""
            finish = ch.get("finish_reason") or finish
    return content, finish, last

SCHEMAS = [
    None,  # json_object
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "ok": {"type": "boolean"}, "note": {"type": ["string", "null"]}},
            "required": ["id", "ok", "note"], "additionalProperties": False}},
        "kind": {"const": "shape"}, "nothing": {"type": "null"}},
     "required": ["point", "items", "kind", "nothing"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "number"}},
     "additionalProperties": True},
    {"enum": ["red", "green", 3, None, {"k": [1, 2]}]},
]

n = bad = 0
for si, schema in enumerate(SCHEMAS):
    rf = {"type": "json_object"} if schema is None else \
         {"type": "json_schema", "json_schema": {"name": "s%d" % si, "schema": schema, "strict": si % 2 == 0}}
    check = {"type": "object"} if schema is None else schema
    for seed in range(20):
        for stream in (False, True):
            body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "seed": 100 * si + seed,
                    "temperature": 1, "max_tokens": 120, "response_format": rf, "stream": stream}
            st, data = post(body)
            n += 1
            try:
                assert st == 200, "status %d: %s" % (st, data[:300])
                if stream:
                    content, finish, _ = sse(data)
                else:
                    o = json.loads(data)
                    content, finish = o["choices"][0]["message"]["content"], o["choices"][0]["finish_reason"]
                assert finish == "stop", "finish_reason %r" % finish
                jsonschema.validate(json.loads(content), check)
            except Exception as e:
                bad += 1
                print("FAIL schema %d seed %d stream %s: %s" % (si, seed, stream, str(e)[:300]))
print("structured %d requests, %d failed" % (n, bad))

# thinking mode: the reasoning is free, the content after </think> is held to the schema
tn = tbad = 0
for seed in range(10):
    body = {"messages": [{"role": "user", "content": "JSON please"}], "seed": seed, "temperature": 1,
            "max_tokens": 120, "thinking": {"type": "enabled"}, "stream": seed % 2 == 1,
            "ds41_forced_output": "Let me think.</think>",
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMAS[1]}}}
    st, data = post(body)
    tn += 1
    try:
        assert st == 200, data[:300]
        if body["stream"]:
            content, finish, _ = sse(data)
        else:
            o = json.loads(data)
            content, finish = o["choices"][0]["message"]["content"], o["choices"][0]["finish_reason"]
            assert o["choices"][0]["message"].get("reasoning_content") == "Let me think.", o
        assert finish == "stop", finish
        jsonschema.validate(json.loads(content), SCHEMAS[1])
    except Exception as e:
        tbad += 1
        print("FAIL thinking seed %d: %s" % (seed, str(e)[:300]))
print("thinking %d requests, %d failed" % (tn, tbad))
EOF
sed 's/^/# /' "$work/jf.out" | tail -15
check "240 structured-output requests (6 schemas x 20 seeds x streamed/not) parse, validate, finish 'stop'" \
    grep -q '^structured 240 requests, 0 failed$' "$work/jf.out"
check "10 thinking-mode requests: reasoning free, content validates" \
    grep -q '^thinking 10 requests, 0 failed$' "$work/jf.out"

schema_b='{"type":"object","properties":{"name":{"type":"string"},"n":{"type":"integer"}},"required":["name","n"],"additionalProperties":false}'
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"x"}],"seed":1,"max_tokens":3,
 "response_format":{"type":"json_schema","json_schema":{"name":"b","schema":'"$schema_b"'}}}')
check "max_tokens below the shortest document: finish_reason 'length' (the output is cut)" \
    test "$code $(pyj 'o["choices"][0]["finish_reason"]')" = "200 length"

refuse() { # refuse SCHEMA PARAM
    code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"x"}],
 "response_format":{"type":"json_schema","json_schema":{"name":"r","schema":'"$1"'}}}')
    [ "$code" = 400 ] && [ "$(pyj 'o["error"]["param"]')" = "$2" ] &&
        pyj 'o["error"]["message"]' | grep -q "'${2##*.}' is not supported"
}
check "pattern is refused with 400 naming its path" \
    refuse '{"type":"object","properties":{"s":{"type":"string","pattern":"^a"}}}' \
    response_format.json_schema.schema.properties.s.pattern
check "anyOf is refused with 400 naming its path" \
    refuse '{"anyOf":[{"type":"string"},{"type":"integer"}]}' response_format.json_schema.schema.anyOf
check "\$ref is refused with 400 naming its path" \
    refuse '{"type":"object","properties":{"a":{"$ref":"#/x"}}}' 'response_format.json_schema.schema.properties.a.$ref'
check "minItems is refused with 400 naming its path" \
    refuse '{"type":"array","minItems":1}' response_format.json_schema.schema.minItems

# ---- request fields ----
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"x"}],"seed":3,"max_tokens":12,
 "min_tokens":12,"logit_bias":{"1":100}}')
check "min_tokens holds EOS back (EOS biased to +100 still yields 12 tokens)" \
    test "$code $(pyj 'o["usage"]["completion_tokens"], o["choices"][0]["finish_reason"]')" = "200 (12, 'length')"
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"x"}],"seed":3,"max_tokens":12,
 "logit_bias":{"1":100}}')
check "without min_tokens the biased EOS ends at once" \
    test "$code $(pyj 'o["usage"]["completion_tokens"], o["choices"][0]["finish_reason"]')" = "200 (1, 'stop')"
# a stop string made of the first generated text: found without min_tokens, not before min_tokens
code=$(api POST /v1/completions '{"prompt":"Hello","seed":4,"max_tokens":8,"temperature":0}')
first=$(pyj 'o["choices"][0]["text"][:1]')
code=$(api POST /v1/completions '{"prompt":"Hello","seed":4,"max_tokens":8,"temperature":0,"stop":['"$(pyj 'json.dumps(o["choices"][0]["text"][:1])')"']}')
check "a stop string in the first tokens stops a plain request" \
    test "$code $(pyj 'o["choices"][0]["finish_reason"], o["usage"]["completion_tokens"] < 8')" = "200 ('stop', True)"
code=$(api POST /v1/completions '{"prompt":"Hello","seed":4,"max_tokens":8,"temperature":0,"min_tokens":8,"stop":['"$("$py" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$first")"']}')
check "min_tokens: stop strings are not looked for before it" \
    test "$code $(pyj 'o["choices"][0]["finish_reason"], o["usage"]["completion_tokens"]')" = "200 ('length', 8)"
code=$(api POST /v1/completions '{"prompt":"x","max_tokens":4,"min_tokens":5}')
check "min_tokens above max_tokens is refused naming min_tokens" \
    test "$code $(pyj 'o["error"]["param"]')" = "400 min_tokens"
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"cache_prompt":true,"keep_alive":"5m"}')
check "cache_prompt and keep_alive are accepted, with one log line" \
    bash -c "test $code = 200 && grep -q 'ignoring cache_prompt keep_alive' '$work/daemon.log'"
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"x"}],"n_probs":3}')
check "another unknown field is still 400 naming it" test "$code $(pyj 'o["error"]["param"]')" = "400 n_probs"
code=$(api POST /v1/completions '{"prompt":"x","max_tokens":2,"keep_alive":[1]}')
check "keep_alive of the wrong type is refused naming it" test "$code $(pyj 'o["error"]["param"]')" = "400 keep_alive"
greedy() { api POST /v1/completions '{"prompt":"The cat","max_tokens":48,"seed":9,'"$1"'}' >/dev/null; pyj 'o["choices"][0]["text"]'; }
g0=$(greedy '"temperature":0')
check "top_k 1 at temperature 1 is the greedy output" test "$(greedy '"temperature":1,"top_k":1')" = "$g0"
check "min_p 1 at temperature 1 is the greedy output" test "$(greedy '"temperature":1,"min_p":1')" = "$g0"
check "repetition_penalty changes the greedy output" test "$(greedy '"temperature":0,"repetition_penalty":100')" != "$g0"

# ---- timings ----
timings_ok='(lambda t, u: t["cache_n"] == u["prompt_tokens_details"]["cached_tokens"] and t["prompt_n"] == u["prompt_tokens"] - t["cache_n"] and t["predicted_n"] == u["completion_tokens"] and all(t[k] >= 0 for k in ("prompt_ms", "predicted_ms", "prompt_per_second", "predicted_per_second", "prompt_per_token_ms", "predicted_per_token_ms")))(o["timings"], o["usage"])'
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"time me"}],"max_tokens":6,"seed":2}')
check "chat: timings next to usage, counts match usage, ms >= 0" test "$code $(pyj "$timings_ok")" = "200 True"
code=$(api POST /v1/chat/completions '{"messages":[{"role":"user","content":"time me"}],"max_tokens":6,"seed":2}')
check "chat again: the cached prefix shows in cache_n" \
    test "$code $(pyj "$timings_ok and o['timings']['cache_n'] > 0")" = "200 True"
code=$(api POST /v1/completions '{"prompt":"time me","max_tokens":5}')
check "completions: timings next to usage" test "$code $(pyj "$timings_ok")" = "200 True"
curl -s -N --unix-socket "$sock" -H 'Content-Type: application/json' -o "$work/s1" \
    --data-binary '{"messages":[{"role":"user","content":"x"}],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}' \
    http://ds41/v1/chat/completions
grep '^data: {' "$work/s1" | tail -1 | cut -c7- >"$work/last"
check "stream with include_usage: timings on the last chunk (the usage one), consistent with it" \
    test "$(pyj "$timings_ok and o['choices'] == []" "$work/last") $(grep -c '"timings"' "$work/s1")" = "True 1"
curl -s -N --unix-socket "$sock" -H 'Content-Type: application/json' -o "$work/s2" \
    --data-binary '{"messages":[{"role":"user","content":"x"}],"max_tokens":5,"stream":true}' \
    http://ds41/v1/chat/completions
grep '^data: {' "$work/s2" | tail -1 | cut -c7- >"$work/last"
check "stream without usage: timings on the last chunk (the finish_reason one)" \
    test "$(pyj 'o["choices"][0]["finish_reason"] is not None and o["timings"]["predicted_n"] == 5' "$work/last") $(grep -c '"timings"' "$work/s2")" = "True 1"

stop_daemon TERM
check "daemon exits cleanly" test "$daemon_status" = 0
finish
