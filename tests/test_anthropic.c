/* The Anthropic Messages API (ipc/api_anthropic.h): the request parser (the chat request it
 * builds, and every malformed body a 400 naming the field), the message builder / SSE encoder
 * (the exact event sequence, the non-streamed message, stop reasons, errors), and the two routes
 * over the mock service. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/api.h"
#include "ipc/api_anthropic.h"
#include "tests/ipc_mock_service.h"
#include "tests/tap.h"

static int parse(const char *body, bool count, ds41_api_request *r, ds41_svc_error *e) {
    memset(e, 0, sizeof *e);
    return ds41_anth_parse(body, strlen(body), count, r, e);
}

/* a equals b (a new reference, released). */
static bool eq_new(const json_t *a, json_t *b) {
    bool same = a && b && json_equal(a, b);
    json_decref(b);
    return same;
}

/* JSON text a equals JSON text b (as values). */
static bool json_same(const char *a, const char *b) {
    json_t *x = a ? json_loads(a, JSON_DECODE_ANY, NULL) : NULL, *y = json_loads(b, JSON_DECODE_ANY, NULL);
    bool same = x && y && json_equal(x, y);
    json_decref(x);
    json_decref(y);
    return same;
}

static void test_parse_ok(void) {
    ds41_api_request r;
    ds41_svc_error e;
    int rc = parse(
        "{\"model\":\"ds41-tiny\",\"max_tokens\":8000,\"system\":[{\"type\":\"text\",\"text\":\"Be brief.\","
        "\"cache_control\":{\"type\":\"ephemeral\"}},{\"type\":\"text\",\"text\":\"Be kind.\"}],"
        "\"messages\":[{\"role\":\"user\",\"content\":\"Weather?\"},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"thinking\",\"thinking\":\"Need a tool.\","
        "\"signature\":\"sig\"},{\"type\":\"redacted_thinking\",\"data\":\"xx\"},{\"type\":\"text\","
        "\"text\":\"Checking.\"},{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"get_weather\","
        "\"input\":{\"city\":\"Paris\"}}]},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Here:\"},{\"type\":\"tool_result\","
        "\"tool_use_id\":\"toolu_1\",\"content\":[{\"type\":\"text\",\"text\":\"18 C\"}]},"
        "{\"type\":\"tool_result\",\"tool_use_id\":\"toolu_1\",\"content\":\"boom\",\"is_error\":true},"
        "{\"type\":\"text\",\"text\":\"Thanks\"}]}],"
        "\"tools\":[{\"name\":\"get_weather\",\"description\":\"Weather\",\"input_schema\":{\"type\":"
        "\"object\",\"properties\":{\"city\":{\"type\":\"string\"}}}}],"
        "\"tool_choice\":{\"type\":\"tool\",\"name\":\"get_weather\",\"disable_parallel_tool_use\":true},"
        "\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":4096},\"stop_sequences\":[\"END\",\"##\"],"
        "\"temperature\":0.5,\"top_p\":0.9,\"top_k\":40,\"metadata\":{\"user_id\":\"u-7\"},\"stream\":true}",
        false, &r, &e);
    TAP_CHECK(rc == 0, "a full Messages request parses (%s: %s)", e.param, e.message);
    if (rc) return;
    const ds41_gen_request *g = &r.gen;
    TAP_CHECK(
        json_same(g->messages_json,
                  "[{\"role\":\"system\",\"content\":\"Be brief.\\n\\nBe kind.\"},"
                  "{\"role\":\"user\",\"content\":\"Weather?\"},"
                  "{\"role\":\"assistant\",\"content\":\"Checking.\",\"reasoning_content\":\"Need a tool.\","
                  "\"tool_calls\":[{\"id\":\"toolu_1\",\"type\":\"function\",\"function\":{\"name\":"
                  "\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}}]},"
                  "{\"role\":\"user\",\"content\":\"Here:\"},"
                  "{\"role\":\"tool\",\"content\":\"18 C\",\"tool_call_id\":\"toolu_1\"},"
                  "{\"role\":\"tool\",\"content\":\"Error: boom\",\"tool_call_id\":\"toolu_1\"},"
                  "{\"role\":\"user\",\"content\":\"Thanks\"}]"),
        "system, thinking, tool_use and tool_result (is_error) become the chat route's messages: %s",
        g->messages_json);
    TAP_CHECK(json_same(g->tools_json,
                        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":"
                        "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}}},"
                        "\"description\":\"Weather\"}}]"),
              "tools with input_schema become function tools: %s", g->tools_json);
    TAP_CHECK(
        json_same(g->tool_choice_json, "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}") &&
            !g->parallel_tool_calls,
        "tool_choice tool + disable_parallel_tool_use: a named choice, no parallel calls");
    TAP_CHECK(g->thinking == DS41_THINKING_ENABLED && g->reasoning_effort == 50,
              "thinking enabled with budget 4096: thinking mode, effort 50 (got %d)", g->reasoning_effort);
    TAP_CHECK(g->max_tokens == 8000 && g->n_stop == 2 && strcmp(g->stop[1], "##") == 0 &&
                  g->temperature.set && g->temperature.value == 0.5 && g->top_p.value == 0.9 &&
                  g->top_k == 40 && g->stream && g->user && strcmp(g->user, "u-7") == 0 &&
                  strcmp(g->model, "ds41-tiny") == 0 && g->kind == DS41_GEN_CHAT,
              "max_tokens, stop_sequences, temperature, top_p, top_k, metadata.user_id, stream, model");
    ds41_api_request_free(&r);

    static const struct {
        const char *choice, *want;
    } choices[] = {{"{\"type\":\"auto\"}", "\"auto\""},
                   {"{\"type\":\"any\"}", "\"required\""},
                   {"{\"type\":\"none\"}", "\"none\""}};
    bool all = true;
    for (size_t i = 0; i < sizeof choices / sizeof choices[0]; i++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                 "\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\"}}],\"tool_choice\":%s}",
                 choices[i].choice);
        all = all && parse(body, false, &r, &e) == 0 && json_same(r.gen.tool_choice_json, choices[i].want) &&
              r.gen.parallel_tool_calls;
        ds41_api_request_free(&r);
    }
    TAP_CHECK(all, "tool_choice auto / any / none map to auto / required / none");

    rc = parse("{\"model\":\"m\",\"max_tokens\":5,\"thinking\":{\"type\":\"disabled\"},\"messages\":[{"
               "\"role\":\"user\","
               "\"content\":[]},{\"role\":\"assistant\",\"content\":\"The answer is\"}]}",
               false, &r, &e);
    TAP_CHECK(rc == 0 && r.gen.thinking == DS41_THINKING_DISABLED &&
                  json_same(r.gen.messages_json,
                            "[{\"role\":\"user\",\"content\":\"\"},{\"role\":\"assistant\","
                            "\"content\":\"The answer is\",\"prefix\":true}]"),
              "thinking disabled; a last assistant message is a prefill (prefix): %s",
              rc ? e.message : r.gen.messages_json);
    ds41_api_request_free(&r);

    rc = parse("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"system\":\"S\","
               "\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":40000}}",
               true, &r, &e);
    TAP_CHECK(
        rc == 0 && r.gen.max_tokens == 0 && r.gen.reasoning_effort == 100 &&
            json_same(r.gen.messages_json,
                      "[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":\"x\"}]"),
        "count_tokens: no max_tokens needed, the same messages and effort");
    ds41_api_request_free(&r);

    TAP_CHECK(ds41_anth_budget_effort(1024) == 25 && ds41_anth_budget_effort(2047) == 25 &&
                  ds41_anth_budget_effort(2048) == 50 && ds41_anth_budget_effort(8191) == 50 &&
                  ds41_anth_budget_effort(8192) == 75 && ds41_anth_budget_effort(31999) == 75 &&
                  ds41_anth_budget_effort(32000) == 100,
              "the budget -> effort table (1024 25, 2048 50, 8192 75, 32000 100)");
}

static void test_parse_bad(void) {
#define M1 "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"
#define TOOLS "\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\"}}]"
    static const struct {
        const char *body;
        bool count;
        const char *param;
    } cases[] = {
        {"{\"model\":\"m\"," M1 "}", false, "max_tokens"},
        {"{\"model\":\"m\",\"max_tokens\":\"10\"," M1 "}", false, "max_tokens"},
        {"{\"model\":\"m\",\"max_tokens\":0," M1 "}", false, "max_tokens"},
        {"{\"max_tokens\":5," M1 "}", false, "model"},
        {"{\"model\":\"m\",\"max_tokens\":5," M1 ",\"frobnicate\":1}", false, "frobnicate"},
        {"{\"model\":\"m\",\"max_tokens\":5," M1 "}", true, "max_tokens"},
        {"{\"model\":\"m\",\"max_tokens\":5}", false, "messages"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[]}", false, "messages"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":{}}", false, "messages"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[3]}", false, "messages[0]"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"system\",\"content\":\"x\"}]}", false,
         "messages[0].role"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":7,\"content\":\"x\"}]}", false,
         "messages[0].role"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\"}]}", false,
         "messages[0].content"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":5}]}", false,
         "messages[0].content"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"name\":"
         "\"n\"}]}",
         false, "messages[0].name"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"x\"}]}]"
         "}",
         false, "messages[0].content[0].type"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[\"x\"]}]}", false,
         "messages[0].content[0]"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}"
         "]}]}",
         false, "messages[0].content[0].text"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":"
         "\"image\","
         "\"source\":{}}]}]}",
         false, "messages[0].content[0].type"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"tool_"
         "use\","
         "\"id\":\"a\",\"name\":\"f\",\"input\":{}}]}]}",
         false, "messages[0].content[0].type"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"tool_"
         "result\","
         "\"content\":\"r\"}]}]}",
         false, "messages[0].content[0].tool_use_id"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"tool_"
         "result\","
         "\"tool_use_id\":\"nope\",\"content\":\"r\"}]}]}",
         false, "messages[0].content[0].tool_use_id"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":"
         "\"tool_use\","
         "\"id\":\"a\",\"name\":\"f\",\"input\":{}}]},{\"role\":\"user\",\"content\":[{\"type\":\"tool_"
         "result\","
         "\"tool_use_id\":\"a\",\"content\":[{\"type\":\"image\"}]}]}]}",
         false, "messages[1].content[0].content[0].type"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":"
         "\"tool_use\","
         "\"id\":\"a\",\"name\":\"f\",\"input\":{}}]},{\"role\":\"user\",\"content\":[{\"type\":\"tool_"
         "result\","
         "\"tool_use_id\":\"a\",\"is_error\":\"yes\"}]}]}",
         false, "messages[1].content[0].is_error"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":"
         "\"tool_use\","
         "\"id\":\"a\",\"name\":\"f\",\"input\":[1]}]}]}",
         false, "messages[0].content[0].input"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":"
         "\"tool_use\","
         "\"id\":\"a\",\"name\":\"f\"}]}]}",
         false, "messages[0].content[0].input"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":"
         "\"thinking\"}]}]}",
         false, "messages[0].content[0].thinking"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"system\":5," M1 "}", false, "system"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"system\":[{\"type\":\"image\"}]," M1 "}", false,
         "system[0].type"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"tools\":{}," M1 "}", false, "tools"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"tools\":[{\"name\":\"f\"}]," M1 "}", false,
         "tools[0].input_schema"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"tools\":[{\"name\":\"f\",\"input_schema\":{},\"strict\":true}]"
         "," M1 "}",
         false, "tools[0].strict"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"tools\":[{\"name\":\"bad name\",\"input_schema\":{}}]," M1 "}",
         false, "tools[0].name"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"tools\":[{\"type\":\"web_search_20250305\",\"name\":\"w\"}]," M1
         "}",
         false, "tools[0].type"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\","
         "\"properties\":{\"a\":{\"type\":\"wat\"}}}}]," M1 "}",
         false, "tools[0].input_schema.properties.a.type"},
        {"{\"model\":\"m\",\"max_tokens\":5," TOOLS ",\"tool_choice\":\"auto\"," M1 "}", false,
         "tool_choice"},
        {"{\"model\":\"m\",\"max_tokens\":5," TOOLS ",\"tool_choice\":{\"type\":\"tool\"}," M1 "}", false,
         "tool_choice.name"},
        {"{\"model\":\"m\",\"max_tokens\":5," TOOLS ",\"tool_choice\":{\"type\":\"tool\",\"name\":\"g\"}," M1
         "}",
         false, "tool_choice.name"},
        {"{\"model\":\"m\",\"max_tokens\":5," TOOLS ",\"tool_choice\":{\"type\":\"maybe\"}," M1 "}", false,
         "tool_choice.type"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"tool_choice\":{\"type\":\"any\"}," M1 "}", false,
         "tool_choice.type"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"thinking\":{\"type\":\"adaptive\"}," M1 "}", false,
         "thinking.type"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"thinking\":{\"type\":\"enabled\"}," M1 "}", false,
         "thinking.budget_tokens"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":100}," M1
         "}",
         false, "thinking.budget_tokens"},
        {"{\"model\":\"m\",\"max_tokens\":2000,\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":2000}," M1
         "}",
         false, "thinking.budget_tokens"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"stop_sequences\":\"x\"," M1 "}", false, "stop_sequences"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"stop_sequences\":[\"\"]," M1 "}", false, "stop_sequences[0]"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"stop_sequences\":[\"a\",1]," M1 "}", false,
         "stop_sequences[1]"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"temperature\":1.5," M1 "}", false, "temperature"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"top_k\":-1," M1 "}", false, "top_k"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"metadata\":{\"user\":\"x\"}," M1 "}", false, "metadata.user"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"metadata\":{\"user_id\":3}," M1 "}", false, "metadata.user_id"},
        {"{\"model\":\"m\",\"max_tokens\":5,\"stream\":\"yes\"," M1 "}", false, "stream"},
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":true}", true,
         "stream"},
    };
    size_t n = sizeof cases / sizeof cases[0], failed = n;
    for (size_t i = 0; i < n; i++) {
        ds41_api_request r;
        ds41_svc_error e;
        int rc = parse(cases[i].body, cases[i].count, &r, &e);
        char *ej = rc ? ds41_anth_error_json(&e) : NULL;
        json_t *j = ej ? json_loads(ej, 0, NULL) : NULL;
        const char *type = json_string_value(json_object_get(json_object_get(j, "error"), "type"));
        const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
        bool good = rc == -1 && e.status == DS41_SVC_BAD_REQUEST && strcmp(e.param, cases[i].param) == 0 &&
                    json_is_object(j) &&
                    strcmp(json_string_value(json_object_get(j, "type")), "error") == 0 && type &&
                    strcmp(type, "invalid_request_error") == 0 && msg && strstr(msg, cases[i].param) &&
                    r.messages_json == NULL && r.model == NULL;
        if (rc == 0) ds41_api_request_free(&r);
        if (!good && failed == n) {
            failed = i;
            TAP_NOTE("case %zu: rc %d param '%s' (want '%s'), %s", i, rc, e.param, cases[i].param,
                     ej ? ej : "");
        }
        json_decref(j);
        free(ej);
    }
    TAP_CHECK(failed == n,
              "%zu malformed bodies: each a 400 invalid_request_error naming its field (first failure %zu)",
              n, failed);

    ds41_api_request r;
    ds41_svc_error e;
    int rc = parse("{\"model\":", false, &r, &e);
    TAP_CHECK(rc == -1 && strcmp(e.code, "invalid_json") == 0, "invalid JSON: 400 invalid_json");
    rc = parse("[1]", false, &r, &e);
    TAP_CHECK(rc == -1 && strcmp(e.code, "invalid_json") == 0, "a JSON array body: 400");
}

/* Every prefix and every single-byte change of a valid body: parsed or refused, never a crash
 * (ASan/UBSan watch), and a refusal always names a field or says the JSON is bad. */
static void test_parse_mutations(void) {
    static const char body[] =
        "{\"model\":\"m\",\"max_tokens\":2000,\"system\":\"s\",\"messages\":[{\"role\":\"user\",\"content\":"
        "\"q\"},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"f\",\"input\":{}"
        "}]},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":\"t\",\"content\":\"r\"}]}"
        "],"
        "\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\"}}],\"tool_choice\":{\"type\":"
        "\"any\"},"
        "\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":1024},\"stop_sequences\":[\"x\"]}";
    size_t len = sizeof body - 1, unnamed = 0, accepted = 0;
    static const char subst[] = "\"{}[],:0a-";
    char *buf = malloc(len + 1);
    for (size_t i = 0; buf && i <= len; i++) {
        for (size_t k = 0; k <= sizeof subst - 1; k++) {
            size_t n = len;
            memcpy(buf, body, len);
            if (k == sizeof subst - 1)
                n = i; /* a prefix */
            else if (i < len)
                buf[i] = subst[k];
            else
                continue;
            ds41_api_request r;
            ds41_svc_error e = {0};
            if (ds41_anth_parse(buf, n, k % 2 == 1, &r, &e) == 0) {
                accepted++;
                json_t *m = json_loads(r.gen.messages_json, 0, NULL);
                if (!json_is_array(m)) unnamed++;
                json_decref(m);
                ds41_api_request_free(&r);
            } else if (!e.param[0] && strcmp(e.code, "invalid_json") != 0) {
                unnamed++;
            }
        }
    }
    free(buf);
    TAP_CHECK(
        buf && unnamed == 0 && accepted > 0,
        "prefixes and byte changes of a valid body: accepted with valid messages or refused naming the field "
        "(%zu accepted, %zu bad)",
        accepted, unnamed);
    ds41_api_request r;
    ds41_svc_error e;
    TAP_CHECK(parse(body, false, &r, &e) == 0, "the unmutated body parses (%s)", e.message);
    ds41_api_request_free(&r);
}

/* ------------------------------------------------------------- the SSE encoder */

/* Split an SSE text into [{"event": name, "data": obj}]; NULL when a message lacks event: or data:. */
static json_t *sse_events(const char *s) {
    json_t *out = json_array();
    while (*s) {
        const char *end = strstr(s, "\n\n");
        if (!end || strncmp(s, "event: ", 7) != 0) goto bad;
        const char *nl = strchr(s, '\n');
        if (nl >= end || strncmp(nl + 1, "data: ", 6) != 0 || memchr(nl + 1, '\n', (size_t)(end - nl - 1)))
            goto bad;
        json_t *d = json_loadb(nl + 7, (size_t)(end - nl - 7), 0, NULL);
        if (!d) goto bad;
        json_array_append_new(out, json_pack("{s:s%,s:o}", "event", s + 7, (size_t)(nl - s - 7), "data", d));
        s = end + 2;
    }
    return out;
bad:
    json_decref(out);
    return NULL;
}

/* "name" or "name:delta-type" per event, comma separated. */
static void event_names(const json_t *evs, char *out, size_t n) {
    out[0] = 0;
    size_t i;
    json_t *e;
    json_array_foreach(evs, i, e) {
        const char *name = json_string_value(json_object_get(e, "event"));
        const json_t *d = json_object_get(e, "data");
        const char *dt = json_string_value(json_object_get(json_object_get(d, "delta"), "type"));
        const char *cb = json_string_value(json_object_get(json_object_get(d, "content_block"), "type"));
        size_t l = strlen(out);
        snprintf(out + l, n - l, "%s%s%s%s", i ? "," : "", name,
                 dt && strcmp(name, "content_block_delta") == 0 ? ":"
                 : cb                                           ? ":"
                                                                : "",
                 dt && strcmp(name, "content_block_delta") == 0 ? dt
                 : cb                                           ? cb
                                                                : "");
        if (strcmp(name, json_string_value(json_object_get(d, "type"))) != 0)
            snprintf(out, n, "MISMATCH %s", name);
    }
}

static ds41_gen_event delta_ev(const char *reasoning, const char *content) {
    return (ds41_gen_event){.type = DS41_GEN_DELTA,
                            .reasoning = reasoning,
                            .reasoning_len = reasoning ? strlen(reasoning) : 0,
                            .content = content,
                            .content_len = content ? strlen(content) : 0};
}

static ds41_gen_event tool_ev(int index, const char *name, const char *args) {
    return (ds41_gen_event){.type = DS41_GEN_TOOL_CALL,
                            .tool_index = index,
                            .tool_name = name,
                            .arguments = args,
                            .arguments_len = strlen(args)};
}

static ds41_gen_event finish_ev(ds41_finish_reason f) {
    return (ds41_gen_event){.type = DS41_GEN_FINISH,
                            .finish_reason = f,
                            .usage = {.prompt_tokens = 10, .completion_tokens = 7, .cached_tokens = 4}};
}

static void feed(ds41_anth_message *m, const ds41_gen_event *evs, size_t n, ds41_buf *out) {
    for (size_t i = 0; i < n; i++) ds41_anth_message_event(m, &evs[i], out);
}

static void test_encoder(void) {
    const ds41_gen_event evs[] = {delta_ev("ab", NULL),      delta_ev("c", NULL),
                                  delta_ev(NULL, "Hi"),      delta_ev(NULL, " there"),
                                  tool_ev(0, "f", "{\"x\""), tool_ev(0, NULL, ":1}"),
                                  tool_ev(1, "g", "{}"),     finish_ev(DS41_FINISH_TOOL_CALLS)};
    ds41_anth_message m;
    ds41_buf out = {0};
    TAP_CHECK(ds41_anth_message_init(&m, "msg_1", "ds41-tiny", 0xabc, true, NULL, 0) == 0, "message init");
    m.prompt_tokens = 10;
    feed(&m, evs, sizeof evs / sizeof evs[0], &out);
    json_t *ev = out.data ? sse_events(out.data) : NULL;
    char names[2048];
    event_names(ev, names, sizeof names);
    TAP_CHECK(
        ev && strcmp(names,
                     "message_start,ping,content_block_start:thinking,content_block_delta:thinking_delta,"
                     "content_block_delta:thinking_delta,content_block_delta:signature_delta,"
                     "content_block_stop,content_block_start:text,content_block_delta:text_delta,"
                     "content_block_delta:text_delta,content_block_stop,content_block_start:tool_use,"
                     "content_block_delta:input_json_delta,content_block_delta:input_json_delta,"
                     "content_block_stop,content_block_start:tool_use,"
                     "content_block_delta:input_json_delta,content_block_stop,message_delta,"
                     "message_stop") == 0,
        "stream: the exact event sequence, each with event: and data: lines of the same type: %s", names);
    json_t *start = json_object_get(json_array_get(ev, 0), "data");
    json_t *md = json_object_get(json_array_get(ev, json_array_size(ev) - 2), "data");
    json_t *tstart = json_object_get(json_object_get(json_array_get(ev, 11), "data"), "content_block");
    json_t *pj = json_object_get(json_object_get(json_array_get(ev, 12), "data"), "delta");
    TAP_CHECK(
        json_is_object(start) &&
            eq_new(json_object_get(start, "message"),
                   json_pack("{s:s,s:s,s:s,s:s,s:[],s:n,s:n,s:{s:i,s:i,s:i,s:i}}", "id", "msg_1", "type",
                             "message", "role", "assistant", "model", "ds41-tiny", "content", "stop_reason",
                             "stop_sequence", "usage", "input_tokens", 10, "cache_read_input_tokens", 0,
                             "cache_creation_input_tokens", 0, "output_tokens", 0)),
        "message_start: the message with empty content and the prompt's input_tokens");
    TAP_CHECK(json_is_object(md) &&
                  eq_new(md, json_pack("{s:s,s:{s:s,s:n},s:{s:i,s:i,s:i,s:i}}", "type", "message_delta",
                                       "delta", "stop_reason", "tool_use", "stop_sequence", "usage",
                                       "input_tokens", 6, "cache_read_input_tokens", 4,
                                       "cache_creation_input_tokens", 0, "output_tokens", 7)),
              "message_delta: stop_reason tool_use, usage with cache_read_input_tokens");
    TAP_CHECK(tstart && strcmp(json_string_value(json_object_get(tstart, "name")), "f") == 0 &&
                  strncmp(json_string_value(json_object_get(tstart, "id")), "toolu_", 6) == 0 &&
                  eq_new(json_object_get(tstart, "input"), json_object()) &&
                  strcmp(json_string_value(json_object_get(pj, "partial_json")), "{\"x\"") == 0,
              "tool_use block start: toolu_ id, name, empty input; then partial_json");
    json_decref(ev);
    ds41_buf_free(&out);
    ds41_anth_message_free(&m);

    /* the same events not streamed: the message object */
    ds41_anth_message_init(&m, "msg_2", "ds41-tiny", 0xabc, false, NULL, 0);
    feed(&m, evs, sizeof evs / sizeof evs[0], NULL);
    json_t *msg = ds41_anth_message_json(&m);
    json_t *content = json_object_get(msg, "content");
    json_t *want =
        json_pack("[{s:s,s:s,s:s},{s:s,s:s},{s:s,s:s,s:{s:i}},{s:s,s:s,s:{}}]", "type", "thinking",
                  "thinking", "abc", "signature", "", "type", "text", "text", "Hi there", "type", "tool_use",
                  "name", "f", "input", "x", 1, "type", "tool_use", "name", "g", "input");
    size_t i;
    json_t *b;
    json_array_foreach(content, i, b) json_object_del(b, "id");
    TAP_CHECK(json_equal(content, want) &&
                  strcmp(json_string_value(json_object_get(msg, "stop_reason")), "tool_use") == 0,
              "non-stream: thinking, text, tool_use blocks with parsed input, stop_reason tool_use");
    json_decref(want);
    json_decref(msg);
    ds41_anth_message_free(&m);

    /* stop reasons */
    const char *stops[] = {"END", "##"};
    struct {
        ds41_gen_event ev;
        const char *reason, *seq;
    } fin[] = {{finish_ev(DS41_FINISH_STOP), "end_turn", NULL},
               {finish_ev(DS41_FINISH_LENGTH), "max_tokens", NULL},
               {finish_ev(DS41_FINISH_STOP), "stop_sequence", "##"}};
    fin[2].ev.stop_string = true;
    fin[2].ev.stop_index = 1;
    bool all = true;
    for (size_t k = 0; k < 3; k++) {
        ds41_anth_message_init(&m, "msg_3", "x", 1, false, stops, 2);
        ds41_gen_event d = delta_ev(NULL, "a");
        ds41_anth_message_event(&m, &d, NULL);
        ds41_anth_message_event(&m, &fin[k].ev, NULL);
        msg = ds41_anth_message_json(&m);
        const json_t *sq = json_object_get(msg, "stop_sequence");
        all = all && strcmp(json_string_value(json_object_get(msg, "stop_reason")), fin[k].reason) == 0 &&
              (fin[k].seq ? json_is_string(sq) && strcmp(json_string_value(sq), fin[k].seq) == 0
                          : json_is_null(sq));
        json_decref(msg);
        ds41_anth_message_free(&m);
    }
    TAP_CHECK(all, "stop_reason end_turn / max_tokens / stop_sequence with the sequence that matched");

    /* an error after the stream began: an error event, nothing after it */
    ds41_anth_message_init(&m, "msg_4", "x", 1, true, NULL, 0);
    ds41_gen_event d = delta_ev(NULL, "a"), er = {.type = DS41_GEN_ERROR};
    ds41_svc_fail(&er.error, DS41_SVC_KV_FULL, NULL, "the KV cache is full");
    ds41_gen_event late = finish_ev(DS41_FINISH_STOP);
    ds41_anth_message_event(&m, &d, &out);
    ds41_anth_message_event(&m, &er, &out);
    ds41_anth_message_event(&m, &late, &out);
    ev = out.data ? sse_events(out.data) : NULL;
    event_names(ev, names, sizeof names);
    json_t *last = json_object_get(json_array_get(ev, json_array_size(ev) - 1), "data");
    TAP_CHECK(
        strcmp(names, "message_start,ping,content_block_start:text,content_block_delta:text_delta,error") ==
                0 &&
            strcmp(json_string_value(json_object_get(json_object_get(last, "error"), "type")),
                   "overloaded_error") == 0,
        "an error mid-stream: an error event (overloaded_error for a full KV cache), nothing after it: %s",
        names);
    json_decref(ev);
    ds41_buf_free(&out);
    ds41_anth_message_free(&m);

    static const struct {
        ds41_svc_status s;
        const char *type;
    } map[] = {{DS41_SVC_BAD_REQUEST, "invalid_request_error"}, {DS41_SVC_FORBIDDEN, "permission_error"},
               {DS41_SVC_NOT_FOUND, "not_found_error"},         {DS41_SVC_QUEUE_FULL, "rate_limit_error"},
               {DS41_SVC_UNAVAILABLE, "overloaded_error"},      {DS41_SVC_INTERNAL, "api_error"}};
    all = true;
    for (size_t k = 0; k < sizeof map / sizeof map[0]; k++) {
        ds41_svc_error e;
        ds41_svc_fail(&e, map[k].s, "model", "no such thing");
        char *t = ds41_anth_error_json(&e);
        json_t *j = t ? json_loads(t, 0, NULL) : NULL;
        all = all && eq_new(j, json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "type", map[k].type,
                                         "message", "model: no such thing"));
        json_decref(j);
        free(t);
    }
    TAP_CHECK(all,
              "error shapes: invalid_request / permission / not_found / rate_limit / overloaded / api_error");
}

/* ----------------------------------------------------------------- the routes */

static void post(const ds41_http_router *router, const char *path, const char *body,
                 ds41_http_memory_response *r) {
    ds41_error err;
    if (ds41_http_dispatch_memory(router, "POST", path, DS41_AUTH_INFERENCE, "application/json", body,
                                  strlen(body), 5000, r, &err) != 0)
        memset(r, 0, sizeof *r);
}

static void test_routes(void) {
    mock_service *mock = mock_service_new(false);
    ds41_api *api = NULL;
    ds41_error err;
    if (!mock || ds41_api_new(mock_service_iface(mock), NULL, NULL, &api, &err) != 0) {
        TAP_CHECK(false, "api over the mock service");
        return;
    }
    const ds41_http_router *router = ds41_api_router(api);
    ds41_http_memory_response r;
    static const char plain[] =
        "{\"model\":\"mock\",\"max_tokens\":50,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    post(router, "/v1/messages", plain, &r);
    json_t *j = r.body ? json_loads(r.body, 0, NULL) : NULL;
    json_t *c0 = json_array_get(json_object_get(j, "content"), 0);
    TAP_CHECK(
        r.status == 200 && strcmp(json_string_value(json_object_get(j, "type")), "message") == 0 &&
            strncmp(json_string_value(json_object_get(j, "id")), "msg_", 4) == 0 &&
            strcmp(json_string_value(json_object_get(c0, "text")), "Hello from the mock \xe2\x9c\x93") == 0 &&
            strcmp(json_string_value(json_object_get(j, "stop_reason")), "end_turn") == 0 &&
            json_integer_value(json_object_get(json_object_get(j, "usage"), "cache_read_input_tokens")) == 2,
        "POST /v1/messages: a message with the text, end_turn, cache_read_input_tokens from cached_tokens: "
        "%s",
        r.body ? r.body : "");
    json_decref(j);
    ds41_http_memory_response_free(&r);

    static const char streamed[] =
        "{\"model\":\"mock\",\"max_tokens\":50,\"stream\":true,\"messages\":[{\"role\":"
        "\"user\",\"content\":\"hi\"}]}";
    post(router, "/v1/messages", streamed, &r);
    json_t *ev = r.body ? sse_events(r.body) : NULL;
    char names[1024] = "";
    event_names(ev, names, sizeof names);
    TAP_CHECK(r.status == 200 && r.streamed && r.content_type &&
                  strncmp(r.content_type, "text/event-stream", 17) == 0 &&
                  strncmp(names, "message_start,ping,content_block_start:text,content_block_delta:text_delta",
                          74) == 0 &&
                  strstr(names, "content_block_stop,message_delta,message_stop") &&
                  strcmp(names + strlen(names) - 12, "message_stop") == 0,
              "POST /v1/messages stream: text/event-stream, message_start .. message_stop: %s", names);
    json_decref(ev);
    ds41_http_memory_response_free(&r);

    static const char bad[] = "{\"model\":\"mock\",\"max_tokens\":5,\"messages\":[],\"x\":1}";
    post(router, "/v1/messages", bad, &r);
    TAP_CHECK(r.status == 400 && r.body && strstr(r.body, "\"type\":\"error\"") &&
                  strstr(r.body, "invalid_request_error") && strstr(r.body, "'x'"),
              "a bad body: 400 in Anthropic's error shape naming the field: %s", r.body ? r.body : "");
    ds41_http_memory_response_free(&r);

    static const char missing[] =
        "{\"model\":\"missing\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":"
        "\"hi\"}]}";
    post(router, "/v1/messages", missing, &r);
    TAP_CHECK(r.status == 404 && r.body && strstr(r.body, "not_found_error"),
              "an unknown model: 404 not_found_error");
    ds41_http_memory_response_free(&r);

    static const char count[] = "{\"model\":\"mock\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    ds41_http_dispatch_memory(router, "POST", "/v1/messages/count_tokens", DS41_AUTH_INFERENCE,
                              "application/json", count, sizeof count - 1, 5000, &r, &err);
    j = r.body ? json_loads(r.body, 0, NULL) : NULL;
    /* the mock counts one token per byte of the normalized messages */
    TAP_CHECK(r.status == 200 && json_object_size(j) == 1 &&
                  json_integer_value(json_object_get(j, "input_tokens")) ==
                      (json_int_t)strlen("[{\"role\":\"user\",\"content\":\"hi\"}]"),
              "POST /v1/messages/count_tokens: {\"input_tokens\": n} of the rendered messages: %s",
              r.body ? r.body : "");
    json_decref(j);
    ds41_http_memory_response_free(&r);
    ds41_api_free(api);
    mock_service_free(mock);
}

int main(void) {
    test_parse_ok();
    test_parse_bad();
    test_parse_mutations();
    test_encoder();
    test_routes();
    return tap_done();
}
