/* ipc/api without sockets: strict request parsing, every route through
 * ds41_http_dispatch_memory() with the deterministic mock service, response
 * shapes, SSE framing, error statuses. */
#include <jansson.h>
#include <string.h>

#include "ipc/api.h"
#include "ipc/http_server.h"
#include "tests/ipc_mock_service.h"
#include "tests/ipc_test_util.h"
#include "tests/tap.h"

static mock_service *mock;
static ds41_api *api;
static ds41_http_metrics *metrics;

typedef struct resp {
    ds41_http_memory_response r;
    json_t *json;
} resp;

static resp call(const char *method, const char *path, ds41_auth_class auth, const char *ctype,
                 const char *body) {
    resp x = {0};
    ds41_error err;
    if (ds41_http_dispatch_memory(ds41_api_router(api), method, path, auth, ctype, body,
                                  body ? strlen(body) : 0, 5000, &x.r, &err) != 0)
        printf("# dispatch failed: %s\n", err.msg);
    if (x.r.body && !x.r.streamed) x.json = json_loadb(x.r.body, x.r.body_len, 0, NULL);
    return x;
}

static resp post(const char *path, const char *body) {
    return call("POST", path, DS41_AUTH_INFERENCE, "application/json", body);
}

static void resp_free(resp *x) {
    json_decref(x->json);
    ds41_http_memory_response_free(&x->r);
}

static bool has_header(const resp *x, const char *line) {
    return x->r.headers && strstr(x->r.headers, line) != NULL;
}

/* ------------------------------------------------------------- parsing */

typedef struct bad_case {
    const char *body;
    const char *param; /* "" = none */
    const char *code;
} bad_case;

/* A field name cut inside a character (metadata keys are quoted up to 64
 * bytes) still makes a well-formed JSON error naming a valid UTF-8 prefix. */
static void test_error_field_utf8(void) {
    char body[512], key[80];
    memset(key, 'k', 63);
    memcpy(key + 63, "\xe2\x82\xac", 3); /* U+20AC across the 64-byte cut */
    key[66] = 0;
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"metadata\":{\"%s\":1}}", key);
    resp x = post("/v1/chat/completions", body);
    const char *param = x.json ? json_string_value(json_object_get(json_object_get(x.json, "error"), "param")) : NULL;
    char want[96];
    snprintf(want, sizeof want, "metadata.%.63s", key);
    TAP_CHECK(x.r.status == 400 && param && strcmp(param, want) == 0,
              "a field name cut inside a UTF-8 character is named by its valid prefix (%s)", param ? param : "no JSON");
    resp_free(&x);
}

static void test_chat_parse_errors(void) {
    static const bad_case cases[] = {
        {"{", "", "invalid_json"},
        {"[1]", "", "invalid_json"},
        {"{\"messages\":[],\"messages\":[]}", "", "invalid_json"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"foo\":1}", "foo", "unknown_field"},
        {"{}", "messages", "missing_field"},
        {"{\"messages\":[]}", "messages", "invalid_value"},
        {"{\"messages\":\"hi\"}", "messages", "invalid_type"},
        {"{\"messages\":[{\"role\":\"robot\",\"content\":\"hi\"}]}", "messages[0].role", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\",\"foo\":1}]}", "messages[0].foo",
         "unknown_field"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages[0].content", "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":null}]}", "messages[0].content", "missing_field"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]}",
         "messages[0].content[0].type", "unsupported_parameter"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\",\"x\":1}]}]}",
         "messages[0].content[0].x", "unknown_field"},
        {"{\"messages\":[{\"role\":\"tool\",\"content\":\"r\"}]}", "messages[0].tool_call_id",
         "missing_field"},
        {"{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\","
         "\"function\":{\"name\":\"f\",\"arguments\":5}}]}]}",
         "messages[0].tool_calls[0].function.arguments", "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"temperature\":\"hot\"}", "temperature",
         "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"temperature\":3}", "temperature",
         "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"top_p\":true}", "top_p", "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":0}", "max_tokens",
         "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1.5}", "max_tokens",
         "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":5,\"max_completion_tokens\":"
         "6}",
         "max_tokens", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"n\":2}", "n", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stop\":5}", "stop", "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stop\":[\"\"]}", "stop[0]",
         "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"logit_bias\":{\"abc\":1}}",
         "logit_bias.abc", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"logit_bias\":{\"5\":200}}", "logit_bias.5",
         "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"logit_bias\":{\"5\":\"x\"}}",
         "logit_bias.5", "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"top_logprobs\":2}", "top_logprobs",
         "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"logprobs\":true,\"top_logprobs\":21}",
         "top_logprobs", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"bad name\"}}]}",
         "tools[0].function.name", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"retrieval\"}]}",
         "tools[0].type", "invalid_value"},
    /* tool schemas (issue 13): the supported subset, names distinct and non-empty */
#define TOOLS_BODY(t) "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":" t "}"
#define FN(name, params) "{\"type\":\"function\",\"function\":{\"name\":\"" name "\"" params "}}"
        {TOOLS_BODY("[" FN("f", "") "," FN("g", "") "," FN("f", "") "]"), "tools[2].function.name",
         "invalid_value"},
        {TOOLS_BODY("[" FN("", "") "]"), "tools[0].function.name", "invalid_value"},
        {TOOLS_BODY("[" FN("f", ",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":"
                                "\"strin\"}}}") "]"),
         "tools[0].function.parameters.properties.city.type", "invalid_value"},
        {TOOLS_BODY("[" FN("g", "") "," FN("f", ",\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":"
                                                "{}},\"required\":[\"a\",\"b\"]}") "]"),
         "tools[1].function.parameters.required[1]", "invalid_value"},
        {TOOLS_BODY("[" FN("f", ",\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":"
                                "\"array\",\"items\":{\"oneOf\":[]}}}}") "]"),
         "tools[0].function.parameters.properties.a.items.oneOf", "invalid_value"},
        {TOOLS_BODY("[" FN("f", ",\"parameters\":{\"type\":\"array\"}") "]"),
         "tools[0].function.parameters.type", "invalid_value"},
        {TOOLS_BODY("[" FN("f", ",\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":"
                                "\"integer\",\"enum\":[1,\"x\"]}}}") "]"),
         "tools[0].function.parameters.properties.a.enum[1]", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"f\"}}],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":"
         "\"g\"}}}",
         "tool_choice.function.name", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tool_choice\":\"required\"}",
         "tool_choice", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":{\"type\":\"xml\"}}",
         "response_format.type", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream_options\":{\"include_usage\":true}"
         "}",
         "stream_options", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream\":true,\"stream_options\":{\"foo\":"
         "1}}",
         "stream_options.foo", "unknown_field"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream\":\"yes\"}", "stream",
         "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"thinking\":{\"type\":\"maybe\"}}",
         "thinking.type", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"reasoning_effort\":\"extreme\"}",
         "reasoning_effort", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"reasoning_effort\":0}", "reasoning_effort",
         "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"reasoning_effort\":1.5}",
         "reasoning_effort", "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"thinking\":{\"type\":\"disabled\"},"
         "\"reasoning_effort\":\"high\"}",
         "reasoning_effort", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"audio\":{}}", "audio",
         "unsupported_parameter"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"functions\":[]}", "functions",
         "unsupported_parameter"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"modalities\":[\"audio\"]}",
         "modalities[0]", "unsupported_parameter"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"seed\":\"1\"}", "seed", "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"model\":7}", "model", "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"\\u0000\"}]}", "", "invalid_json"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"cache_salt\":5}", "cache_salt",
         "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"cache_salt\":\"\"}", "cache_salt",
         "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"cache_salt\":\"a\\u0000b\"}", "",
         "invalid_json"},
    };
    size_t n = sizeof cases / sizeof cases[0];
    size_t failed_at = n;
    char got[1024] = "";
    for (size_t i = 0; i < n; i++) {
        ds41_api_request r;
        ds41_svc_error err = {0};
        int rc = ds41_api_parse_chat(cases[i].body, strlen(cases[i].body), &r, &err);
        if (rc != -1 || err.status != DS41_SVC_BAD_REQUEST || strcmp(err.param, cases[i].param) != 0 ||
            strcmp(err.code, cases[i].code) != 0 || !err.message[0]) {
            snprintf(got, sizeof got, "rc=%d param='%s' code='%s' msg='%s'", rc, err.param, err.code,
                     err.message);
            if (rc == 0) ds41_api_request_free(&r);
            failed_at = i;
            break;
        }
    }
    TAP_CHECK(failed_at == n,
              "chat: %zu invalid bodies each refused naming the field (first failure: %s -> %s)", n,
              failed_at < n ? cases[failed_at].body : "-", got);
}

static void test_chat_parse_full(void) {
    const char *body =
        "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"s\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"}],\"name\":\"bob\"},"
        "{\"role\":\"assistant\",\"content\":null,\"refusal\":null,\"annotations\":[],\"audio\":null,"
        "\"function_call\":null,\"parsed\":null,\"reasoning_content\":\"r\",\"tool_calls\":[{\"id\":\"c1\","
        "\"type\":\"function\","
        "\"index\":0,\"function\":{\"name\":\"f\",\"arguments\":\"{}\",\"parsed_arguments\":{}}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"ok\"}],"
        "\"temperature\":0.7,\"top_p\":0.9,\"max_tokens\":10,\"max_completion_tokens\":10,\"stop\":[\"a\","
        "\"b\"],"
        "\"seed\":-42,\"logit_bias\":{\"5\":-100,\"7\":2.5},\"logprobs\":true,\"top_logprobs\":3,"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":\"d\",\"parameters\":"
        "{\"type\":\"object\"},\"strict\":true}}],\"tool_choice\":\"auto\",\"response_format\":{\"type\":"
        "\"json_object\"},\"stream\":true,\"stream_options\":{\"include_usage\":true},\"n\":1,"
        "\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,\"user\":\"u\",\"parallel_tool_calls\":false,"
        "\"reasoning_effort\":\"low\",\"chat_template_kwargs\":{\"thinking\":true},\"top_k\":40,\"min_p\":0."
        "05,"
        "\"repetition_penalty\":1.1,\"store\":false,\"metadata\":{\"a\":\"b\"},\"service_tier\":\"auto\","
        "\"modalities\":[\"text\"],\"prompt_cache_key\":\"k\",\"safety_identifier\":\"s\",\"verbosity\":"
        "\"low\","
        "\"ignore_eos\":true,\"audio\":null,\"prediction\":null}";
    ds41_api_request r;
    ds41_svc_error err = {0};
    int rc = ds41_api_parse_chat(body, strlen(body), &r, &err);
    TAP_CHECK(rc == 0, "chat: the full field set parses (%s)", rc ? err.message : "ok");
    if (rc) return;
    const ds41_gen_request *g = &r.gen;
    bool sampling = g->temperature.set && g->temperature.value == 0.7 && g->top_p.value == 0.9 &&
                    g->max_tokens == 10 && g->has_seed && g->seed == -42 && g->top_k == 40 && g->min_p.set &&
                    g->repetition_penalty.value == 1.1 && g->presence_penalty.value == 0.5 &&
                    g->frequency_penalty.value == -0.5 && g->n_stop == 2 && strcmp(g->stop[1], "b") == 0 &&
                    g->n_logit_bias == 2 && g->logit_bias[0].token == 5 && g->logit_bias[0].bias == -100.0f &&
                    g->logit_bias[1].bias == 2.5f && g->ignore_eos;
    TAP_CHECK(sampling, "chat: sampling fields map to the request struct");
    TAP_CHECK(g->logprobs && g->top_logprobs == 3 && g->stream && r.include_usage &&
                  !g->parallel_tool_calls && strcmp(g->user, "u") == 0 && strcmp(g->model, "m") == 0,
              "chat: output fields map (logprobs, stream, include_usage, user, model)");
    TAP_CHECK(g->thinking == DS41_THINKING_ENABLED && g->reasoning_effort == 50,
              "chat: reasoning_effort low + kwargs thinking -> enabled, effort 50");
    const char *want_messages =
        "[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\","
        "\"text\":\"a\"}],"
        "\"name\":\"bob\"},{\"role\":\"assistant\",\"content\":null,\"reasoning_content\":\"r\",\"tool_"
        "calls\":"
        "[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},"
        "{\"role\":\"tool\",\"content\":\"ok\",\"tool_call_id\":\"c1\"}]";
    TAP_CHECK(strcmp(g->messages_json, want_messages) == 0,
              "chat: messages normalized (SDK echo fields dropped): %s", g->messages_json);
    TAP_CHECK(g->tools_json && strstr(g->tools_json, "\"name\":\"f\"") &&
                  strcmp(g->tool_choice_json, "\"auto\"") == 0 &&
                  strcmp(g->response_format_json, "{\"type\":\"json_object\"}") == 0,
              "chat: tools, tool_choice, response_format passed as JSON");
    ds41_api_request_free(&r);

    const char *nulls = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"temperature\":null,"
                        "\"tools\":null,\"stop\":null,\"seed\":null,\"model\":null}";
    rc = ds41_api_parse_chat(nulls, strlen(nulls), &r, &err);
    TAP_CHECK(rc == 0 && !r.gen.temperature.set && !r.gen.tools_json && r.gen.n_stop == 0 &&
                  !r.gen.has_seed && !r.gen.model && r.gen.thinking == DS41_THINKING_DEFAULT &&
                  r.gen.max_tokens == 0,
              "chat: null means not given");
    if (rc == 0) ds41_api_request_free(&r);

    /* cache_salt (issue 13): 1..256 bytes, kept; the peer uid is the caller's to fill (-1 until then) */
    char salty[600];
    snprintf(salty, sizeof salty,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"cache_salt\":\"%0256d\"}", 7);
    rc = ds41_api_parse_chat(salty, strlen(salty), &r, &err);
    TAP_CHECK(rc == 0 && r.gen.cache_salt && strlen(r.gen.cache_salt) == 256 && r.gen.peer_uid == -1,
              "chat: a 256-byte cache_salt is kept, peer_uid starts unknown (%s)", rc ? err.message : "ok");
    if (rc == 0) ds41_api_request_free(&r);
    snprintf(salty, sizeof salty,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"cache_salt\":\"%0257d\"}", 7);
    rc = ds41_api_parse_chat(salty, strlen(salty), &r, &err);
    TAP_CHECK(rc == -1 && strcmp(err.param, "cache_salt") == 0 && strcmp(err.code, "invalid_value") == 0,
              "chat: a 257-byte cache_salt is refused naming the field (%s)", err.message);
    if (rc == 0) ds41_api_request_free(&r);
}

/* skip_special_tokens (vLLM's field): a boolean, default true; false keeps the special tokens. */
static void test_skip_special_tokens(void) {
    static const struct {
        const char *value; /* NULL: absent */
        int rc;
        bool keep;
    } cases[] = {{NULL, 0, false},   {"true", 0, false},       {"false", 0, true},
                 {"null", 0, false}, {"\"false\"", -1, false}, {"0", -1, false}};
    size_t n = sizeof cases / sizeof cases[0], bad = n;
    char got[512] = "";
    for (size_t i = 0; i < n && bad == n; i++) {
        for (int kind = 0; kind < 2 && bad == n; kind++) {
            char body[256];
            const char *start =
                kind ? "{\"prompt\":\"x\"" : "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]";
            if (cases[i].value)
                snprintf(body, sizeof body, "%s,\"skip_special_tokens\":%s}", start, cases[i].value);
            else
                snprintf(body, sizeof body, "%s}", start);
            ds41_api_request r;
            ds41_svc_error err = {0};
            int rc = kind ? ds41_api_parse_completion(body, strlen(body), 16, &r, &err)
                          : ds41_api_parse_chat(body, strlen(body), &r, &err);
            bool ok = rc == cases[i].rc && (rc == 0 ? r.gen.keep_special_tokens == cases[i].keep
                                                    : err.status == DS41_SVC_BAD_REQUEST &&
                                                          strcmp(err.param, "skip_special_tokens") == 0 &&
                                                          strcmp(err.code, "invalid_type") == 0);
            if (!ok) {
                bad = i;
                snprintf(got, sizeof got, "%.200s: rc=%d param='%.40s' code='%.40s' msg='%.200s'", body, rc,
                         err.param, err.code, err.message);
            }
            if (rc == 0) ds41_api_request_free(&r);
        }
    }
    TAP_CHECK(bad == n,
              "skip_special_tokens: absent/true/null strip, false keeps, a non-boolean is a 400 naming the "
              "field, in chat and completions (%s)",
              got);
}

static void test_thinking_mapping(void) {
    static const struct {
        const char *extra;
        ds41_thinking mode;
        int effort;
    } cases[] = {
        {"\"thinking\":{\"type\":\"enabled\"}", DS41_THINKING_ENABLED, 0},
        {"\"thinking\":{\"type\":\"disabled\"}", DS41_THINKING_DISABLED, 0},
        {"\"reasoning_effort\":\"none\"", DS41_THINKING_DISABLED, 0},
        {"\"reasoning_effort\":\"minimal\"", DS41_THINKING_ENABLED, 25},
        {"\"reasoning_effort\":\"medium\"", DS41_THINKING_ENABLED, 75},
        {"\"reasoning_effort\":\"high\"", DS41_THINKING_ENABLED, 75},
        {"\"reasoning_effort\":\"max\"", DS41_THINKING_ENABLED, 100},
        {"\"reasoning_effort\":37", DS41_THINKING_ENABLED, 37},
        {"\"chat_template_kwargs\":{\"enable_thinking\":false}", DS41_THINKING_DISABLED, 0},
        {"\"thinking\":{\"type\":\"enabled\"},\"reasoning_effort\":\"xhigh\"", DS41_THINKING_ENABLED, 100},
    };
    size_t n = sizeof cases / sizeof cases[0], bad_i = n;
    for (size_t i = 0; i < n; i++) {
        char body[256];
        snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s}",
                 cases[i].extra);
        ds41_api_request r;
        ds41_svc_error err = {0};
        if (ds41_api_parse_chat(body, strlen(body), &r, &err) != 0) {
            bad_i = i;
            break;
        }
        bool ok = r.gen.thinking == cases[i].mode && r.gen.reasoning_effort == cases[i].effort;
        ds41_api_request_free(&r);
        if (!ok) {
            bad_i = i;
            break;
        }
    }
    TAP_CHECK(bad_i == n, "thinking: %zu mappings of thinking / reasoning_effort (first failure: %s)", n,
              bad_i < n ? cases[bad_i].extra : "-");
}

static void test_completion_parse(void) {
    static const bad_case bad[] = {
        {"{}", "prompt", "missing_field"},
        {"{\"prompt\":[\"a\",\"b\"]}", "prompt", "invalid_value"},
        {"{\"prompt\":[]}", "prompt", "invalid_value"},
        {"{\"prompt\":[-1]}", "prompt[0]", "invalid_value"},
        {"{\"prompt\":[[1,\"x\"]]}", "prompt[0][1]", "invalid_type"},
        {"{\"prompt\":{\"x\":1}}", "prompt", "invalid_type"},
        {"{\"prompt\":[1,2],\"echo\":true}", "echo", "unsupported_parameter"},
        {"{\"prompt\":\"a\",\"suffix\":\"z\"}", "suffix", "unsupported_parameter"},
        {"{\"prompt\":\"a\",\"best_of\":2}", "best_of", "invalid_value"},
        {"{\"prompt\":\"a\",\"messages\":[]}", "messages", "unknown_field"},
        {"{\"prompt\":\"a\",\"logprobs\":true}", "logprobs", "invalid_type"},
        {"{\"prompt\":\"a\",\"logprobs\":2,\"echo\":true}", "echo", "unsupported_parameter"},
        {"{\"prompt\":\"a\",\"cache_salt\":[\"x\"]}", "cache_salt", "invalid_type"},
    };
    size_t n = sizeof bad / sizeof bad[0], fail = n;
    char got[1024] = "";
    for (size_t i = 0; i < n; i++) {
        ds41_api_request r;
        ds41_svc_error err = {0};
        int rc = ds41_api_parse_completion(bad[i].body, strlen(bad[i].body), 16, &r, &err);
        if (rc != -1 || strcmp(err.param, bad[i].param) != 0 || strcmp(err.code, bad[i].code) != 0) {
            snprintf(got, sizeof got, "rc=%d param='%s' code='%s'", rc, err.param, err.code);
            if (rc == 0) ds41_api_request_free(&r);
            fail = i;
            break;
        }
    }
    TAP_CHECK(fail == n, "completions: %zu invalid bodies refused naming the field (first failure: %s -> %s)",
              n, fail < n ? bad[fail].body : "-", got);

    ds41_api_request r;
    ds41_svc_error err = {0};
    const char *b1 = "{\"prompt\":\"hello\",\"logprobs\":3,\"echo\":false}";
    int rc = ds41_api_parse_completion(b1, strlen(b1), 16, &r, &err);
    TAP_CHECK(rc == 0 && r.gen.kind == DS41_GEN_COMPLETION && r.gen.prompt_len == 5 &&
                  strcmp(r.gen.prompt, "hello") == 0 && r.gen.max_tokens == 16 && r.gen.logprobs &&
                  r.gen.top_logprobs == 3,
              "completions: text prompt, default max_tokens 16, logprobs 3");
    if (rc == 0) ds41_api_request_free(&r);
    const char *b2 = "{\"prompt\":[[1,2,129279]],\"max_tokens\":4}";
    rc = ds41_api_parse_completion(b2, strlen(b2), 16, &r, &err);
    TAP_CHECK(rc == 0 && r.gen.n_prompt_tokens == 3 && r.gen.prompt_tokens[2] == 129279 && !r.gen.prompt &&
                  r.gen.max_tokens == 4,
              "completions: token-id prompt in a nested array");
    if (rc == 0) ds41_api_request_free(&r);
}

/* ------------------------------------------------------------- routes */

static const char *chat_body(const char *extra) {
    static char body[2048];
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]%s%s}",
             extra ? "," : "", extra ? extra : "");
    return body;
}

static void test_health_models(void) {
    resp x = call("GET", "/health", DS41_AUTH_INFERENCE, NULL, NULL);
    TAP_CHECK(x.r.status == 200 && x.json && strcmp(jstr(x.json, "status"), "ok") == 0 &&
                  strcmp(x.r.content_type, "application/json") == 0,
              "GET /health -> 200 {\"status\":\"ok\"}");
    TAP_CHECK(x.json && json_array_size(jpath(x.json, "models")) == 2 &&
                  strcmp(jstr(x.json, "models[0].id"), "mock-model") == 0 &&
                  strcmp(jstr(x.json, "models[0].state"), "ready") == 0 &&
                  !jpath(x.json, "models[0].detail") && strcmp(jstr(x.json, "models[1].id"), "other") == 0 &&
                  strcmp(jstr(x.json, "models[1].state"), "unloaded") == 0 &&
                  strcmp(jstr(x.json, "models[1].detail"), "not loaded") == 0 && !jpath(x.json, "detail"),
              "GET /health lists every configured model with its state (and why, unless ready)");
    resp_free(&x);
    mock_service_set_health(mock, DS41_HEALTH_LOADING, "loading shard 17/48");
    x = call("GET", "/health", DS41_AUTH_INFERENCE, NULL, NULL);
    TAP_CHECK(x.r.status == 503 && x.json && strcmp(jstr(x.json, "status"), "loading") == 0 &&
                  strcmp(jstr(x.json, "detail"), "loading shard 17/48") == 0 &&
                  has_header(&x, "Retry-After: 5") && json_array_size(jpath(x.json, "models")) == 2,
              "GET /health while loading -> 503 with detail, Retry-After and the models");
    resp_free(&x);
    mock_service_set_health(mock, DS41_HEALTH_OK, NULL);

    x = call("GET", "/v1/models", DS41_AUTH_INFERENCE, NULL, NULL);
    TAP_CHECK(x.r.status == 200 && x.json && strcmp(jstr(x.json, "object"), "list") == 0 &&
                  json_array_size(jpath(x.json, "data")) == 1 &&
                  strcmp(jstr(x.json, "data[0].id"), "mock-model") == 0 &&
                  strcmp(jstr(x.json, "data[0].object"), "model") == 0 &&
                  jint(x.json, "data[0].created") == 1700000000 &&
                  strcmp(jstr(x.json, "data[0].owned_by"), "ds41") == 0,
              "GET /v1/models lists the ready model in OpenAI shape");
    resp_free(&x);
    x = call("GET", "/v1/models/mock-model", DS41_AUTH_INFERENCE, NULL, NULL);
    TAP_CHECK(x.r.status == 200 && x.json && strcmp(jstr(x.json, "id"), "mock-model") == 0,
              "GET /v1/models/{id} returns one model");
    resp_free(&x);
    x = call("GET", "/v1/models/other", DS41_AUTH_INFERENCE, NULL, NULL);
    TAP_CHECK(x.r.status == 404 && is_error_shape(x.json, "not_found_error", "model_not_found", "model"),
              "GET /v1/models/{id} of an unloaded model -> 404 model_not_found");
    resp_free(&x);
}

static void test_chat_nonstream(void) {
    resp x = post("/v1/chat/completions", chat_body("\"model\":\"mock-model\""));
    TAP_CHECK(x.r.status == 200 && x.json && strncmp(jstr(x.json, "id"), "chatcmpl-", 9) == 0 &&
                  strcmp(jstr(x.json, "object"), "chat.completion") == 0 &&
                  strcmp(jstr(x.json, "model"), "mock-model") == 0 && jint(x.json, "created") > 1600000000 &&
                  strcmp(jstr(x.json, "choices[0].message.role"), "assistant") == 0 &&
                  strcmp(jstr(x.json, "choices[0].message.content"), "Hello from the mock \xe2\x9c\x93") ==
                      0 &&
                  strcmp(jstr(x.json, "choices[0].finish_reason"), "stop") == 0 &&
                  json_is_null(jpath(x.json, "choices[0].logprobs")) && jint(x.json, "choices[0].index") == 0,
              "chat non-stream: chat.completion with the mock's text, finish stop");
    TAP_CHECK(x.json && jint(x.json, "usage.completion_tokens") == 5 &&
                  jint(x.json, "usage.total_tokens") ==
                      jint(x.json, "usage.prompt_tokens") + jint(x.json, "usage.completion_tokens") &&
                  jint(x.json, "usage.prompt_tokens_details.cached_tokens") == 2 &&
                  jint(x.json, "usage.completion_tokens_details.reasoning_tokens") == 0,
              "chat non-stream: usage with cached_tokens and reasoning_tokens");
    /* issue 13: response ids must not count the requests other users made in between */
    char id1[64] = "";
    snprintf(id1, sizeof id1, "%s", x.json ? jstr(x.json, "id") : "");
    resp_free(&x);
    x = post("/v1/chat/completions", chat_body("\"model\":\"mock-model\""));
    const char *id2 = x.json ? jstr(x.json, "id") : "";
    bool ids_ok = strlen(id1) == 33 && strlen(id2) == 33 && strncmp(id1, id2, 17) == 0 &&
                  strcmp(id1, id2) != 0 && strtoull(id2 + 17, NULL, 16) - strtoull(id1 + 17, NULL, 16) > 1000;
    TAP_CHECK(ids_ok, "chat: response ids of consecutive requests are unique and not a counter (%s, %s)", id1,
              id2);
    resp_free(&x);

    x = post("/v1/chat/completions", chat_body("\"thinking\":{\"type\":\"enabled\"}"));
    TAP_CHECK(x.r.status == 200 && x.json &&
                  strcmp(jstr(x.json, "choices[0].message.reasoning_content"), "think0 think1 ") == 0 &&
                  jint(x.json, "usage.completion_tokens_details.reasoning_tokens") == 2,
              "chat non-stream: reasoning_content in thinking mode");
    resp_free(&x);

    x = post("/v1/chat/completions",
             chat_body("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                       "\"parameters\":{\"type\":\"object\"}}}]"));
    const char *id = x.json ? jstr(x.json, "choices[0].message.tool_calls[0].id") : NULL;
    TAP_CHECK(
        x.r.status == 200 && x.json && json_is_null(jpath(x.json, "choices[0].message.content")) && id &&
            strncmp(id, "call_", 5) == 0 &&
            strcmp(jstr(x.json, "choices[0].message.tool_calls[0].type"), "function") == 0 &&
            strcmp(jstr(x.json, "choices[0].message.tool_calls[0].function.name"), "get_weather") == 0 &&
            strcmp(jstr(x.json, "choices[0].message.tool_calls[0].function.arguments"), "{\"x\": 1}") == 0 &&
            strcmp(jstr(x.json, "choices[0].finish_reason"), "tool_calls") == 0,
        "chat non-stream: tool_calls assembled from fragments, content null, finish tool_calls");
    resp_free(&x);

    x = post("/v1/chat/completions", chat_body("\"logprobs\":true,\"top_logprobs\":2"));
    json_t *lp = x.json ? jpath(x.json, "choices[0].logprobs.content") : NULL;
    TAP_CHECK(x.r.status == 200 && json_array_size(lp) == 5 && strcmp(jstr(lp, "[0].token"), "Hello") == 0 &&
                  json_real_value(jpath(lp, "[1].logprob")) == -0.5 &&
                  json_array_size(jpath(lp, "[0].bytes")) == 5 && jint(lp, "[0].bytes[0]") == 'H' &&
                  json_array_size(jpath(lp, "[4].top_logprobs")) == 2 &&
                  strcmp(jstr(lp, "[4].top_logprobs[1].token"), "alt1") == 0,
              "chat non-stream: logprobs in OpenAI shape (token, logprob, bytes, top_logprobs)");
    resp_free(&x);

    x = post("/v1/chat/completions", chat_body("\"max_tokens\":2"));
    TAP_CHECK(x.r.status == 200 && x.json &&
                  strcmp(jstr(x.json, "choices[0].message.content"), "Hello from") == 0 &&
                  strcmp(jstr(x.json, "choices[0].finish_reason"), "length") == 0,
              "chat non-stream: max_tokens cuts with finish length");
    resp_free(&x);
}

static json_t *stream_events(resp *x, char *why, size_t n) {
    if (!x->r.body) {
        snprintf(why, n, "no body");
        return NULL;
    }
    return sse_split(x->r.body, x->r.body_len, NULL, why, n);
}

static void test_chat_stream(void) {
    char why[128] = "";
    resp x = post("/v1/chat/completions", chat_body("\"stream\":true"));
    json_t *ev = stream_events(&x, why, sizeof why);
    size_t n = json_array_size(ev);
    TAP_CHECK(x.r.status == 200 && x.r.streamed && strcmp(x.r.content_type, "text/event-stream") == 0 && ev,
              "chat stream: 200 text/event-stream, every event 'data: ...\\n\\n' (%s)", why);
    bool shape = n == 8;
    char text[128] = "";
    for (size_t i = 0; shape && i + 1 < n; i++) {
        json_t *c = json_array_get(ev, i);
        shape = strcmp(jstr(c, "object"), "chat.completion.chunk") == 0 &&
                strncmp(jstr(c, "id"), "chatcmpl-", 9) == 0 &&
                strcmp(jstr(c, "id"), jstr(json_array_get(ev, 0), "id")) == 0 &&
                !json_object_get(c, "usage") && json_is_null(jpath(c, "choices[0].logprobs"));
        const char *piece = jstr(c, "choices[0].delta.content");
        if (piece && i > 0) strncat(text, piece, sizeof text - strlen(text) - 1);
    }
    json_t *first = json_array_get(ev, 0), *fin = json_array_get(ev, n - 2);
    TAP_CHECK(shape && strcmp(jstr(first, "choices[0].delta.role"), "assistant") == 0 &&
                  strcmp(jstr(first, "choices[0].delta.content"), "") == 0 &&
                  json_is_null(jpath(first, "choices[0].finish_reason")),
              "chat stream: first chunk carries role assistant and empty content");
    TAP_CHECK(shape && strcmp(text, "Hello from the mock \xe2\x9c\x93") == 0,
              "chat stream: content deltas in order (%s)", text);
    TAP_CHECK(fin && json_object_size(jpath(fin, "choices[0].delta")) == 0 &&
                  strcmp(jstr(fin, "choices[0].finish_reason"), "stop") == 0,
              "chat stream: finish chunk with empty delta and finish_reason");
    TAP_CHECK(n > 0 &&
                  strcmp(json_string_value(json_array_get(ev, n - 1))
                             ? json_string_value(json_array_get(ev, n - 1))
                             : "",
                         "[DONE]") == 0 &&
                  x.r.body_len > 14 && strcmp(x.r.body + x.r.body_len - 14, "data: [DONE]\n\n") == 0,
              "chat stream: ends with exactly 'data: [DONE]\\n\\n'");
    json_decref(ev);
    resp_free(&x);

    x = post("/v1/chat/completions",
             chat_body("\"stream\":true,\"stream_options\":{\"include_usage\":true}"));
    ev = stream_events(&x, why, sizeof why);
    n = json_array_size(ev);
    bool nulls = n >= 3;
    for (size_t i = 0; nulls && i + 2 < n; i++) nulls = json_is_null(jpath(json_array_get(ev, i), "usage"));
    json_t *u = json_array_get(ev, n - 2);
    TAP_CHECK(nulls && u && json_array_size(jpath(u, "choices")) == 0 &&
                  jint(u, "usage.completion_tokens") == 5 &&
                  jint(u, "usage.prompt_tokens_details.cached_tokens") == 2 &&
                  strcmp(json_string_value(json_array_get(ev, n - 1)), "[DONE]") == 0,
              "chat stream include_usage: usage null on every chunk, then a usage chunk with no choices, "
              "then [DONE]");
    json_decref(ev);
    resp_free(&x);

    x = post("/v1/chat/completions",
             chat_body("\"stream\":true,\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]"));
    ev = stream_events(&x, why, sizeof why);
    json_t *t1 = jpath(json_array_get(ev, 1), "choices[0].delta.tool_calls[0]");
    json_t *t2 = jpath(json_array_get(ev, 2), "choices[0].delta.tool_calls[0]");
    TAP_CHECK(t1 && t2 && jint(t1, "index") == 0 && strncmp(jstr(t1, "id"), "call_", 5) == 0 &&
                  strcmp(jstr(t1, "type"), "function") == 0 && strcmp(jstr(t1, "function.name"), "f") == 0 &&
                  strcmp(jstr(t1, "function.arguments"), "{\"x\": ") == 0 && jint(t2, "index") == 0 &&
                  !json_object_get(t2, "id") && !jpath(t2, "function.name") &&
                  strcmp(jstr(t2, "function.arguments"), "1}") == 0 &&
                  strcmp(jstr(json_array_get(ev, 3), "choices[0].finish_reason"), "tool_calls") == 0,
              "chat stream: tool call fragments in OpenAI shape (id/type/name first, then arguments)");
    json_decref(ev);
    resp_free(&x);

    x = post("/v1/chat/completions",
             chat_body("\"stream\":true,\"reasoning_effort\":\"high\",\"logprobs\":true"));
    ev = stream_events(&x, why, sizeof why);
    TAP_CHECK(
        ev && strcmp(jstr(json_array_get(ev, 1), "choices[0].delta.reasoning_content"), "think0 ") == 0 &&
            !jpath(json_array_get(ev, 1), "choices[0].delta.content") &&
            json_array_size(jpath(json_array_get(ev, 1), "choices[0].logprobs.reasoning_content")) == 1 &&
            strcmp(jstr(json_array_get(ev, 3), "choices[0].delta.content"), "Hello") == 0 &&
            json_array_size(jpath(json_array_get(ev, 3), "choices[0].logprobs.content")) == 1,
        "chat stream: reasoning_content deltas before content, logprobs per chunk");
    json_decref(ev);
    resp_free(&x);
}

static void test_completions(void) {
    resp x = post("/v1/completions", "{\"prompt\":\"Say\",\"max_tokens\":3,\"echo\":true}");
    TAP_CHECK(x.r.status == 200 && x.json && strncmp(jstr(x.json, "id"), "cmpl-", 5) == 0 &&
                  strcmp(jstr(x.json, "object"), "text_completion") == 0 &&
                  strcmp(jstr(x.json, "choices[0].text"), "SayHello from the") == 0 &&
                  strcmp(jstr(x.json, "choices[0].finish_reason"), "length") == 0,
              "completions non-stream: text_completion, echo prepends the prompt");
    resp_free(&x);
    x = post("/v1/completions", "{\"prompt\":[1,2,3],\"logprobs\":1}");
    json_t *lp = x.json ? jpath(x.json, "choices[0].logprobs") : NULL;
    TAP_CHECK(x.r.status == 200 && json_array_size(jpath(lp, "tokens")) == 5 &&
                  json_array_size(jpath(lp, "token_logprobs")) == 5 && jint(lp, "text_offset[1]") == 5 &&
                  json_is_real(jpath(lp, "top_logprobs[0].alt0")) &&
                  json_object_size(jpath(lp, "top_logprobs[0]")) == 1,
              "completions non-stream: logprobs as tokens/token_logprobs/top_logprobs/text_offset");
    resp_free(&x);
    char why[128] = "";
    x = post("/v1/completions",
             "{\"prompt\":\"Say\",\"stream\":true,\"stream_options\":{\"include_usage\":true}}");
    json_t *ev = stream_events(&x, why, sizeof why);
    size_t n = json_array_size(ev);
    TAP_CHECK(ev && n == 8 && strcmp(jstr(json_array_get(ev, 0), "object"), "text_completion") == 0 &&
                  strcmp(jstr(json_array_get(ev, 0), "choices[0].text"), "Hello") == 0 &&
                  strcmp(jstr(json_array_get(ev, 5), "choices[0].finish_reason"), "stop") == 0 &&
                  json_array_size(jpath(json_array_get(ev, 6), "choices")) == 0 &&
                  jint(json_array_get(ev, 6), "usage.completion_tokens") == 5 &&
                  strcmp(json_string_value(json_array_get(ev, 7)), "[DONE]") == 0,
              "completions stream: text chunks, finish, usage chunk, [DONE] (%s, %zu events)", why, n);
    json_decref(ev);
    resp_free(&x);
}

static void test_service_errors(void) {
    resp x = post("/v1/chat/completions", chat_body("\"model\":\"queue-full\""));
    TAP_CHECK(x.r.status == 429 && is_error_shape(x.json, "rate_limit_error", "queue_full", NULL) &&
                  has_header(&x, "Retry-After: 3"),
              "queue full -> 429 rate_limit_error with Retry-After");
    resp_free(&x);
    x = post("/v1/chat/completions", chat_body("\"model\":\"kv-full\",\"stream\":true"));
    TAP_CHECK(x.r.status == 503 && !x.r.streamed && is_error_shape(x.json, "server_error", "kv_full", NULL) &&
                  has_header(&x, "Retry-After: 7"),
              "KV memory full -> 503 with Retry-After, also for a stream request");
    resp_free(&x);
    x = post("/v1/completions", "{\"prompt\":\"a\",\"model\":\"missing\"}");
    TAP_CHECK(x.r.status == 404 && is_error_shape(x.json, "not_found_error", "model_not_found", "model"),
              "unknown model -> 404 model_not_found naming 'model'");
    resp_free(&x);
    x = post("/v1/chat/completions", chat_body("\"model\":\"late-error\""));
    TAP_CHECK(x.r.status == 503 && is_error_shape(x.json, "server_error", "kv_full", NULL),
              "non-stream error after acceptance -> mapped status");
    resp_free(&x);
    char why[128] = "";
    x = post("/v1/chat/completions", chat_body("\"model\":\"late-error\",\"stream\":true"));
    json_t *ev = stream_events(&x, why, sizeof why);
    size_t n = json_array_size(ev);
    json_t *last = json_array_get(ev, n - 1);
    TAP_CHECK(x.r.status == 200 && n == 3 && is_error_shape(last, "server_error", "kv_full", NULL),
              "stream error after acceptance -> an error event and no [DONE]");
    json_decref(ev);
    resp_free(&x);
    x = post("/v1/chat/completions", chat_body("\"model\":\"cancel-self\""));
    TAP_CHECK(x.r.status == 503 && is_error_shape(x.json, "server_error", "cancelled", NULL),
              "a generation the server cancels -> 503 cancelled");
    resp_free(&x);
}

static void test_tokenize(void) {
    resp x = post("/tokenize", "{\"content\":\"ab\",\"add_special\":true}");
    TAP_CHECK(x.r.status == 200 && x.json && jint(x.json, "count") == 3 && jint(x.json, "tokens[0]") == 0 &&
                  jint(x.json, "tokens[1]") == 'a' && jint(x.json, "tokens[2]") == 'b',
              "POST /tokenize text -> tokens and count");
    resp_free(&x);
    x = post("/tokenize",
             "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"thinking\":{\"type\":\"enabled\"}}");
    TAP_CHECK(x.r.status == 200 && x.json &&
                  jint(x.json, "count") == (long long)strlen("[{\"role\":\"user\",\"content\":\"hi\"}]"),
              "POST /tokenize messages -> the service sees normalized messages");
    resp_free(&x);
    x = post("/tokenize", "{\"content\":\"a\",\"prompt\":\"b\"}");
    TAP_CHECK(x.r.status == 400 &&
                  is_error_shape(x.json, "invalid_request_error", "missing_field", "content"),
              "POST /tokenize with two inputs -> 400");
    resp_free(&x);
    x = post("/detokenize", "{\"tokens\":[104,105]}");
    TAP_CHECK(x.r.status == 200 && x.json && strcmp(jstr(x.json, "content"), "hi") == 0,
              "POST /detokenize -> content");
    resp_free(&x);
    x = post("/detokenize", "{\"tokens\":[104,999]}");
    TAP_CHECK(x.r.status == 400 && is_error_shape(x.json, "invalid_request_error", NULL, "tokens[1]"),
              "POST /detokenize out-of-vocabulary id -> 400 naming tokens[1]");
    resp_free(&x);
    x = post("/detokenize", "{\"tokens\":[255,254]}");
    TAP_CHECK(x.r.status == 200 && x.json && strcmp(jstr(x.json, "content"), "\xef\xbf\xbd\xef\xbf\xbd") == 0,
              "POST /detokenize invalid UTF-8 from the service is replaced by U+FFFD");
    resp_free(&x);
    x = post("/detokenize", "{\"tokens\":\"1,2\"}");
    TAP_CHECK(x.r.status == 400 && is_error_shape(x.json, "invalid_request_error", "invalid_type", "tokens"),
              "POST /detokenize tokens of the wrong type -> 400");
    resp_free(&x);
}

static void test_metrics(void) {
    resp x = call("GET", "/metrics", DS41_AUTH_INFERENCE, NULL, NULL);
    TAP_CHECK(x.r.status == 200 && strncmp(x.r.content_type, "text/plain", 10) == 0 && x.r.body &&
                  strstr(x.r.body, "mock_requests_total ") &&
                  strstr(x.r.body, "ds41_http_requests_total{route=\"chat_completions\",code=\"200\"}") &&
                  strstr(x.r.body, "ds41_http_requests_total{route=\"chat_completions\",code=\"429\"} 1"),
              "GET /metrics: the service's text plus ds41_http_requests_total by route and code");
    resp_free(&x);
}

static void test_admin(void) {
    static const struct {
        const char *method, *path, *body;
    } admin_routes[] = {
        {"GET", "/admin/models", NULL},
        {"POST", "/admin/models/load", "{\"name\":\"mock-model\"}"},
        {"POST", "/admin/models/unload", "{\"name\":\"mock-model\"}"},
        {"GET", "/admin/sessions", NULL},
        {"DELETE", "/admin/sessions/sess-cached", NULL},
        {"GET", "/admin/cache", NULL},
    };
    size_t n = sizeof admin_routes / sizeof admin_routes[0], fail = n;
    for (size_t i = 0; i < n; i++) {
        resp x = call(admin_routes[i].method, admin_routes[i].path, DS41_AUTH_INFERENCE, "application/json",
                      admin_routes[i].body);
        bool ok = x.r.status == 403 && is_error_shape(x.json, "permission_error", NULL, NULL);
        resp_free(&x);
        if (!ok && fail == n) fail = i;
    }
    TAP_CHECK(fail == n, "every admin route answers 403 permission_error to the inference class (%s)",
              fail < n ? admin_routes[fail].path : "all");

    resp x = call("GET", "/admin/models", DS41_AUTH_ADMIN, NULL, NULL);
    TAP_CHECK(x.r.status == 200 && x.json && json_array_size(jpath(x.json, "data")) == 2 &&
                  jint(x.json, "data[0].tiers.vram") == 1000 && jint(x.json, "data[0].tiers.ram") == 2000 &&
                  jint(x.json, "data[0].bytes_total") == 3000 &&
                  strcmp(jstr(x.json, "data[0].path"), "/models/mock") == 0 &&
                  strcmp(jstr(x.json, "data[1].state"), "unloaded") == 0,
              "GET /admin/models: every model with state, path and bytes per tier");
    resp_free(&x);
    x = call("POST", "/admin/models/load", DS41_AUTH_ADMIN, "application/json", "{\"name\":\"mock-model\"}");
    TAP_CHECK(x.r.status == 200 && x.json && strcmp(jstr(x.json, "status"), "ready") == 0,
              "load by name -> 200 ready");
    resp_free(&x);
    x = call("POST", "/admin/models/load", DS41_AUTH_ADMIN, "application/json", "{\"path\":\"/models/new\"}");
    TAP_CHECK(x.r.status == 202 && x.json && strcmp(jstr(x.json, "status"), "loading") == 0,
              "load by path in the model directories -> 202 loading");
    resp_free(&x);
    x = call("POST", "/admin/models/load", DS41_AUTH_ADMIN, "application/json", "{\"path\":\"/etc/passwd\"}");
    TAP_CHECK(x.r.status == 403 && is_error_shape(x.json, "permission_error", "forbidden", "path"),
              "load by a path outside the model directories -> 403 (the service's check)");
    resp_free(&x);
    static const char *const bad_paths[] = {"{\"path\":\"models/x\"}",
                                            "{\"path\":\"/models/../etc\"}",
                                            "{\"path\":\"/models/..\"}",
                                            "{}",
                                            "{\"path\":5}",
                                            "{\"name\":\"x\",\"cmd\":\"rm\"}"};
    size_t bp = sizeof bad_paths / sizeof bad_paths[0], bfail = bp;
    for (size_t i = 0; i < bp; i++) {
        resp y = call("POST", "/admin/models/load", DS41_AUTH_ADMIN, "application/json", bad_paths[i]);
        if (!(y.r.status == 400 && is_error_shape(y.json, "invalid_request_error", NULL, NULL)) &&
            bfail == bp)
            bfail = i;
        resp_free(&y);
    }
    TAP_CHECK(bfail == bp, "load: relative paths, '..' segments, missing or unknown fields -> 400 (%s)",
              bfail < bp ? bad_paths[bfail] : "all");
    x = call("POST", "/admin/models/load", DS41_AUTH_ADMIN, "application/json", "{\"name\":\"busy\"}");
    TAP_CHECK(x.r.status == 409 && is_error_shape(x.json, "invalid_request_error", "conflict", "name"),
              "load while busy -> 409");
    resp_free(&x);
    x = call("POST", "/admin/models/unload", DS41_AUTH_ADMIN, "application/json", "{\"name\":\"nope\"}");
    TAP_CHECK(x.r.status == 404 && is_error_shape(x.json, "not_found_error", "not_found", "name"),
              "unload an unknown model -> 404");
    resp_free(&x);
    x = call("GET", "/admin/sessions", DS41_AUTH_ADMIN, NULL, NULL);
    TAP_CHECK(x.r.status == 200 && x.json && strcmp(jstr(x.json, "data[0].id"), "sess-cached") == 0 &&
                  jint(x.json, "data[0].kv_bytes") == 13350 && jint(x.json, "data[0].kv_pages") == 1,
              "GET /admin/sessions lists sessions with KV bytes and pages");
    resp_free(&x);
    x = call("DELETE", "/admin/sessions/sess-cached", DS41_AUTH_ADMIN, NULL, NULL);
    TAP_CHECK(x.r.status == 200 && x.json && json_is_true(jpath(x.json, "deleted")),
              "DELETE /admin/sessions/{id}");
    resp_free(&x);
    x = call("DELETE", "/admin/sessions/nope", DS41_AUTH_ADMIN, NULL, NULL);
    TAP_CHECK(x.r.status == 404 && is_error_shape(x.json, "not_found_error", NULL, "id"),
              "DELETE of an unknown session -> 404");
    resp_free(&x);
    x = call("GET", "/admin/cache", DS41_AUTH_ADMIN, NULL, NULL);
    TAP_CHECK(x.r.status == 200 && x.json && jint(x.json, "pages_free") == 18 &&
                  json_real_value(jpath(x.json, "bytes_per_token")) == 890.0 &&
                  strcmp(jstr(x.json, "tiers[1].name"), "prefix") == 0 &&
                  json_real_value(jpath(x.json, "tiers[1].hit_rate")) == 0.75 &&
                  json_is_null(jpath(x.json, "tiers[0].hit_rate")),
              "GET /admin/cache: pages, bytes per token, tiers with hit rates");
    resp_free(&x);
}

static void test_http_errors(void) {
    resp x = call("GET", "/v2/nothing", DS41_AUTH_INFERENCE, NULL, NULL);
    TAP_CHECK(x.r.status == 404 && is_error_shape(x.json, "not_found_error", "not_found", NULL),
              "unknown path -> 404");
    resp_free(&x);
    x = call("GET", "/v1/chat/completions", DS41_AUTH_INFERENCE, NULL, NULL);
    TAP_CHECK(x.r.status == 405 &&
                  is_error_shape(x.json, "invalid_request_error", "method_not_allowed", NULL) &&
                  has_header(&x, "Allow: POST"),
              "wrong method -> 405 with Allow");
    resp_free(&x);
    x = call("POST", "/health", DS41_AUTH_INFERENCE, "application/json", "{}");
    TAP_CHECK(x.r.status == 405 && has_header(&x, "Allow: GET, HEAD"),
              "POST /health -> 405 Allow: GET, HEAD");
    resp_free(&x);
    x = call("HEAD", "/health", DS41_AUTH_INFERENCE, NULL, NULL);
    TAP_CHECK(x.r.status == 200, "HEAD is served by GET routes");
    resp_free(&x);
    x = call("GET", "/v1/models/bad$name", DS41_AUTH_INFERENCE, NULL, NULL);
    TAP_CHECK(x.r.status == 404, "a path parameter with odd characters matches no route");
    resp_free(&x);
    x = call("POST", "/v1/chat/completions", DS41_AUTH_INFERENCE, "multipart/form-data; boundary=x",
             chat_body(NULL));
    TAP_CHECK(x.r.status == 415 &&
                  is_error_shape(x.json, "invalid_request_error", "unsupported_media_type", NULL),
              "multipart body -> 415");
    resp_free(&x);
    x = call("POST", "/v1/chat/completions", DS41_AUTH_INFERENCE, "application/x-www-form-urlencoded",
             chat_body(NULL));
    TAP_CHECK(x.r.status == 200, "curl -d's default Content-Type is accepted");
    resp_free(&x);
    x = post("/v1/chat/completions", "{\"messages\":");
    TAP_CHECK(x.r.status == 400 && is_error_shape(x.json, "invalid_request_error", "invalid_json", NULL),
              "invalid JSON -> 400 invalid_json in the OpenAI error shape");
    resp_free(&x);
    x = post("/v1/chat/completions", chat_body("\"max_tokens\":\"ten\""));
    TAP_CHECK(x.r.status == 400 &&
                  is_error_shape(x.json, "invalid_request_error", "invalid_type", "max_tokens"),
              "wrong type over the route -> 400 naming the field");
    resp_free(&x);
    char *big = malloc(40000);
    memset(big, ' ', 39999);
    big[0] = '{';
    big[39998] = '}';
    big[39999] = 0;
    x = post("/v1/chat/completions", big);
    TAP_CHECK(x.r.status == 413 && is_error_shape(x.json, "invalid_request_error", "request_too_large", NULL),
              "body over max_body_bytes -> 413");
    resp_free(&x);
    free(big);
}

int main(void) {
    mock = mock_service_new(false);
    metrics = ds41_http_metrics_new();
    ds41_error err;
    ds41_api_options opts = {.max_body_bytes = 32768};
    if (!mock || !metrics || ds41_api_new(mock_service_iface(mock), metrics, &opts, &api, &err) != 0) {
        TAP_CHECK(0, "setup");
        return tap_done();
    }
    ds41_service broken = {0};
    ds41_api *bad_api;
    TAP_CHECK(ds41_api_new(&broken, NULL, NULL, &bad_api, &err) == -1 && strstr(err.msg, "submit"),
              "an incomplete service is refused: %s", err.msg);

    test_chat_parse_errors();
    test_error_field_utf8();
    test_chat_parse_full();
    test_thinking_mapping();
    test_skip_special_tokens();
    test_completion_parse();
    test_health_models();
    test_chat_nonstream();
    test_chat_stream();
    test_completions();
    test_service_errors();
    test_tokenize();
    test_metrics();
    test_admin();
    test_http_errors();
    TAP_CHECK(mock_service_live(mock) == 0, "no generation left running");

    ds41_service partial = *mock_service_iface(mock);
    partial.tokenize = NULL;
    partial.cache_info = NULL;
    ds41_api *partial_api;
    if (ds41_api_new(&partial, NULL, NULL, &partial_api, &err) == 0) {
        ds41_http_memory_response r;
        ds41_http_dispatch_memory(ds41_api_router(partial_api), "POST", "/tokenize", DS41_AUTH_INFERENCE,
                                  NULL, "{\"content\":\"a\"}", 15, 1000, &r, &err);
        json_t *j = r.body ? json_loads(r.body, 0, NULL) : NULL;
        TAP_CHECK(r.status == 501 && is_error_shape(j, "server_error", "not_implemented", NULL),
                  "a route whose service function is missing answers 501");
        json_decref(j);
        ds41_http_memory_response_free(&r);
        ds41_http_dispatch_memory(ds41_api_router(partial_api), "GET", "/metrics", DS41_AUTH_INFERENCE, NULL,
                                  NULL, 0, 1000, &r, &err);
        TAP_CHECK(r.status == 200 && r.body && strstr(r.body, "mock_requests_total") &&
                      !strstr(r.body, "ds41_http_requests_total"),
                  "GET /metrics without http metrics shows the service's text only");
        ds41_http_memory_response_free(&r);
        ds41_api_free(partial_api);
    }

    ds41_api_free(api);
    mock_service_free(mock);
    ds41_http_metrics_free(metrics);
    return tap_done();
}
