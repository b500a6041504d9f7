/* The Responses API below the socket (issue 18): the request parser (what a body becomes, and
 * every malformed field refused with a 400 naming it), the response store (byte cap, age limit,
 * partitions by peer, reopening a directory, hostile ids) and the routes through the mock
 * service (create, stream, retrieve, delete, previous_response_id). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ipc/api.h"
#include "ipc/api_responses.h"
#include "ipc/response_store.h"
#include "tests/ipc_mock_service.h"
#include "tests/ipc_test_util.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

/* ------------------------------------------------------------------ parser */

static bool json_equal_text(const char *text, const char *want) {
    json_t *a = json_loads(text ? text : "null", JSON_DECODE_ANY, NULL);
    json_t *b = json_loads(want, JSON_DECODE_ANY, NULL);
    bool eq = a && b && json_equal(a, b);
    if (!eq) fprintf(stderr, "# got  %s\n# want %s\n", text ? text : "(null)", want);
    json_decref(a);
    json_decref(b);
    return eq;
}

static void test_parse_full(void) {
    const char *body =
        "{\"model\":\"m\",\"instructions\":\"Be brief.\",\"input\":["
        "{\"role\":\"user\",\"content\":\"Weather?\"},"
        "{\"type\":\"reasoning\",\"id\":\"rs_1\",\"summary\":[],\"content\":[{\"type\":\"reasoning_text\","
        "\"text\":\"hm\"}]},"
        "{\"type\":\"function_call\",\"id\":\"fc_1\",\"call_id\":\"call_1\",\"name\":\"w\",\"arguments\":\"{}"
        "\","
        "\"status\":\"completed\"},"
        "{\"type\":\"function_call_output\",\"call_id\":\"call_1\",\"output\":\"sunny\"},"
        "{\"type\":\"message\",\"role\":\"assistant\",\"id\":\"msg_1\",\"status\":\"completed\",\"content\":["
        "{\"type\":\"output_text\",\"text\":\"It is sunny.\",\"annotations\":[]}]},"
        "{\"role\":\"developer\",\"content\":[{\"type\":\"input_text\",\"text\":\"More.\"}]}],"
        "\"tools\":[{\"type\":\"function\",\"name\":\"w\",\"description\":\"d\",\"parameters\":{\"type\":"
        "\"object\"},"
        "\"strict\":true}],"
        "\"tool_choice\":{\"type\":\"function\",\"name\":\"w\"},\"reasoning\":{\"effort\":\"low\","
        "\"summary\":\"auto\"},"
        "\"max_output_tokens\":33,\"temperature\":0.5,\"top_p\":0.9,\"stream\":true,\"store\":false,"
        "\"text\":{\"format\":{\"type\":\"json_schema\",\"name\":\"s\",\"schema\":{\"type\":\"object\"},"
        "\"strict\":true}},"
        "\"previous_response_id\":\"resp_x\",\"metadata\":{\"k\":\"v\"},\"parallel_tool_calls\":false,"
        "\"user\":\"u\","
        "\"include\":[],\"truncation\":\"disabled\",\"seed\":5}";
    ds41_responses_request r;
    ds41_svc_error err = {0};
    int rc = ds41_responses_parse(body, strlen(body), &r, &err);
    TAP_CHECK(rc == 0, "a body with every supported field parses (%s: %s)", err.param, err.message);
    if (rc) return;
    const ds41_gen_request *g = &r.chat.gen;
    TAP_CHECK(g->kind == DS41_GEN_CHAT && strcmp(g->model, "m") == 0 && g->max_tokens == 33 &&
                  g->temperature.set && g->temperature.value == 0.5 && g->top_p.set && g->stream &&
                  !r.store && !g->parallel_tool_calls && g->has_seed && g->seed == 5 &&
                  strcmp(r.previous_response_id, "resp_x") == 0,
              "scalars map onto the chat generation (max_output_tokens -> max_tokens, store false, ...)");
    TAP_CHECK(g->thinking == DS41_THINKING_ENABLED && g->reasoning_effort == 50,
              "reasoning.effort low -> thinking with effort 50, as reasoning_effort on the chat route");
    TAP_CHECK(json_equal_text(g->tools_json,
                              "[{\"type\":\"function\",\"function\":{\"name\":\"w\",\"description\":\"d\","
                              "\"parameters\":{\"type\":\"object\"},\"strict\":true}}]"),
              "tools become the chat route's function tools");
    TAP_CHECK(json_equal_text(g->tool_choice_json, "{\"type\":\"function\",\"function\":{\"name\":\"w\"}}"),
              "tool_choice {type function, name} becomes the chat route's shape");
    TAP_CHECK(
        json_equal_text(
            g->response_format_json,
            "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"s\",\"schema\":{\"type\":\"object\"},"
            "\"strict\":true}}"),
        "text.format json_schema becomes response_format (what the JSON-mode enforcement reads)");
    json_t *prev = json_loads(
        "[{\"role\":\"user\",\"content\":\"Earlier\"},{\"role\":\"assistant\",\"content\":\"Yes\"}]", 0,
        NULL);
    json_t *conv = NULL;
    rc = ds41_responses_messages(&r, prev, &conv, &err);
    TAP_CHECK(
        rc == 0 &&
            json_equal_text(
                g->messages_json,
                "[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                "{\"role\":\"user\",\"content\":\"Earlier\"},{\"role\":\"assistant\",\"content\":\"Yes\"},"
                "{\"role\":\"user\",\"content\":\"Weather?\"},"
                "{\"role\":\"assistant\",\"content\":null,\"reasoning_content\":\"hm\",\"tool_calls\":"
                "[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"w\",\"arguments\":\"{}\"}"
                "}]},"
                "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"sunny\"},"
                "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"It is sunny.\"}]},"
                "{\"role\":\"developer\",\"content\":[{\"type\":\"text\",\"text\":\"More.\"}]}]"),
        "messages: instructions first, then the previous conversation, then the items (reasoning joins "
        "the function call's assistant turn, the output is a tool message)");
    TAP_CHECK(conv && json_array_size(conv) == 2 + 5,
              "the conversation kept for the store leaves the instructions out");
    json_t *echo = r.echo;
    const char *tool0 =
        json_string_value(json_object_get(json_array_get(json_object_get(echo, "tools"), 0), "name"));
    TAP_CHECK(json_is_string(json_object_get(echo, "instructions")) &&
                  json_is_false(json_object_get(echo, "store")) &&
                  json_integer_value(json_object_get(echo, "max_output_tokens")) == 33 && tool0 &&
                  strcmp(tool0, "w") == 0,
              "the response object repeats the request's fields in the Responses shape");
    json_decref(conv);
    json_decref(prev);
    ds41_responses_request_free(&r);

    const char *plain = "{\"input\":\"hi\"}";
    rc = ds41_responses_parse(plain, strlen(plain), &r, &err);
    TAP_CHECK(rc == 0 && r.store && r.chat.gen.parallel_tool_calls && r.chat.gen.max_tokens == 0 &&
                  r.chat.gen.thinking == DS41_THINKING_DEFAULT && !r.chat.gen.tools_json,
              "defaults: store true, parallel tool calls, no limit, the service's thinking default");
    rc = rc ? rc : ds41_responses_messages(&r, NULL, NULL, &err);
    TAP_CHECK(rc == 0 &&
                  json_equal_text(r.chat.gen.messages_json, "[{\"role\":\"user\",\"content\":\"hi\"}]"),
              "a string input is one user message");
    ds41_responses_request_free(&r);
}

static void test_parse_refusals(void) {
    static const struct {
        const char *body, *param, *code;
    } cases[] = {
        {"{\"input\":\"x\",\"bogus\":1}", "bogus", "unknown_field"},
        {"{\"model\":\"m\"}", "input", "missing_field"},
        {"{\"input\":7}", "input", "invalid_type"},
        {"{\"input\":[]}", "input", "invalid_value"},
        {"{\"input\":[{\"role\":\"tool\",\"content\":\"x\"}]}", "input[0].role", "invalid_value"},
        {"{\"input\":[{\"role\":\"user\"}]}", "input[0].content", "missing_field"},
        {"{\"input\":[{\"role\":\"user\",\"content\":\"x\",\"x\":1}]}", "input[0].x", "unknown_field"},
        {"{\"input\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_image\",\"image_url\":\"u\"}]}]}",
         "input[0].content[0].type", "unsupported_parameter"},
        {"{\"input\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_text\"}]}]}",
         "input[0].content[0].text", "missing_field"},
        {"{\"input\":[{\"type\":\"function_call\",\"name\":\"f\",\"arguments\":\"{}\"}]}", "input[0].call_id",
         "missing_field"},
        {"{\"input\":[{\"type\":\"function_call_output\",\"call_id\":\"c\"}]}", "input[0].output",
         "missing_field"},
        {"{\"input\":[{\"type\":\"reasoning\",\"summary\":[],\"encrypted_content\":\"zz\"}]}",
         "input[0].encrypted_content", "unsupported_parameter"},
        {"{\"input\":[{\"type\":\"reasoning\",\"content\":[{\"type\":\"text\",\"text\":\"t\"}]}]}",
         "input[0].content[0].type", "invalid_value"},
        {"{\"input\":[{\"type\":\"item_reference\",\"id\":\"x\"}]}", "input[0].type", "invalid_value"},
        {"{\"input\":\"x\",\"tools\":[{\"type\":\"web_search\"}]}", "tools[0].type", "unsupported_parameter"},
        {"{\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"name\":\"a b\"}]}", "tools[0].name",
         "invalid_value"},
        {"{\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"name\":\"a\",\"function\":{}}]}",
         "tools[0].function", "unknown_field"},
        {"{\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"name\":\"a\",\"parameters\":3}]}",
         "tools[0].parameters", "invalid_type"},
        {"{\"input\":\"x\",\"tool_choice\":\"required\"}", "tool_choice", "invalid_value"},
        {"{\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"name\":\"a\"}],\"tool_choice\":{\"type\":"
         "\"function\","
         "\"name\":\"b\"}}",
         "tool_choice.name", "invalid_value"},
        {"{\"input\":\"x\",\"tool_choice\":{\"type\":\"file_search\"}}", "tool_choice.type",
         "unsupported_parameter"},
        {"{\"input\":\"x\",\"text\":{\"format\":{\"type\":\"yaml\"}}}", "text.format.type", "invalid_value"},
        {"{\"input\":\"x\",\"text\":{\"format\":{\"type\":\"json_schema\",\"name\":\"n\"}}}",
         "text.format.schema", "missing_field"},
        {"{\"input\":\"x\",\"text\":{\"format\":{\"type\":\"json_schema\",\"schema\":{}}}}",
         "text.format.name", "missing_field"},
        {"{\"input\":\"x\",\"text\":{\"fmt\":{}}}", "text.fmt", "unknown_field"},
        {"{\"input\":\"x\",\"text\":{\"format\":{\"type\":\"json_schema\",\"name\":\"n\",\"schema\":{\"type\":"
         "\"string\",\"pattern\":\"a\"}}}}",
         "text.format.schema.pattern", "invalid_value"},
        {"{\"input\":\"x\",\"reasoning\":{\"effort\":\"huge\"}}", "reasoning.effort", "invalid_value"},
        {"{\"input\":\"x\",\"reasoning\":{\"budget\":3}}", "reasoning.budget", "unknown_field"},
        {"{\"input\":\"x\",\"temperature\":3}", "temperature", "invalid_value"},
        {"{\"input\":\"x\",\"top_p\":\"a\"}", "top_p", "invalid_type"},
        {"{\"input\":\"x\",\"max_output_tokens\":0}", "max_output_tokens", "invalid_value"},
        {"{\"input\":\"x\",\"store\":1}", "store", "invalid_type"},
        {"{\"input\":\"x\",\"stream\":\"yes\"}", "stream", "invalid_type"},
        {"{\"input\":\"x\",\"metadata\":{\"k\":1}}", "metadata.k", "invalid_type"},
        {"{\"input\":\"x\",\"background\":true}", "background", "unsupported_parameter"},
        {"{\"input\":\"x\",\"previous_response_id\":5}", "previous_response_id", "invalid_type"},
        {"{\"input\":\"x\",\"include\":[1]}", "include[0]", "invalid_type"},
        {"{\"input\":\"x\",\"truncation\":\"sometimes\"}", "truncation", "invalid_value"},
        {"{\"input\":\"x\",\"conversation\":\"c\"}", "conversation", "unknown_field"},
        {"[1]", "", "invalid_json"},
        {"{\"input\":", "", "invalid_json"},
    };
    size_t bad = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ds41_responses_request r;
        ds41_svc_error err = {0};
        int rc = ds41_responses_parse(cases[i].body, strlen(cases[i].body), &r, &err);
        if (rc == 0) rc = ds41_responses_messages(&r, NULL, NULL, &err);
        bool ok = rc != 0 && err.status == DS41_SVC_BAD_REQUEST && strcmp(err.param, cases[i].param) == 0 &&
                  strcmp(err.code, cases[i].code) == 0;
        if (!ok) {
            fprintf(stderr, "# %s -> rc %d param '%s' code '%s' (%s); want '%s' '%s'\n", cases[i].body, rc,
                    err.param, err.code, err.message, cases[i].param, cases[i].code);
            bad++;
        }
        ds41_responses_request_free(&r);
    }
    TAP_CHECK(bad == 0, "%zu malformed bodies are 400s naming the field and why (%zu wrong)",
              sizeof cases / sizeof cases[0], bad);
}

/* ------------------------------------------------------------------- store */

static int get(ds41_response_store *s, int64_t owner, const char *id, int64_t now, char *out, size_t n) {
    char *d = NULL;
    size_t len = 0;
    int rc = ds41_response_store_get(s, owner, id, now, &d, &len, NULL);
    if (out) snprintf(out, n, "%s", d ? d : "");
    free(d);
    return rc;
}

static void test_store(const char *dir) {
    ds41_response_store *s;
    ds41_error err;
    /* a cap of 100 bytes: three entries of 40 cannot all stay */
    TAP_CHECK(ds41_response_store_open(dir, 100, 1000, 0, &s, &err) == 0,
              "a store opens (creating its directory)");
    char forty[41];
    memset(forty, 'a', 40);
    forty[40] = 0;
    TAP_CHECK(ds41_response_store_put(s, 1000, "resp_a", forty, 40, 10, &err) == 0 &&
                  ds41_response_store_put(s, 1000, "resp_b", forty, 40, 20, &err) == 0 &&
                  ds41_response_store_put(s, 2000, "resp_c", forty, 40, 30, &err) == 0,
              "three entries are stored");
    char buf[64];
    size_t n;
    uint64_t bytes;
    ds41_response_store_stats(s, &n, &bytes);
    TAP_CHECK(n == 2 && bytes == 80 && get(s, 1000, "resp_a", 30, NULL, 0) == 0 &&
                  get(s, 1000, "resp_b", 30, buf, sizeof buf) == 1 && strcmp(buf, forty) == 0,
              "the byte cap evicts the oldest entry (2 entries, 80 bytes left)");
    TAP_CHECK(ds41_response_store_put(s, 1000, "resp_big", "x", 101, 31, &err) == -1 &&
                  strstr(err.msg, "cap"),
              "an entry larger than the cap is refused, saying so");
    TAP_CHECK(get(s, 2000, "resp_b", 30, NULL, 0) == 0 && get(s, -1, "resp_b", 30, NULL, 0) == 0 &&
                  get(s, 1000, "resp_c", 30, NULL, 0) == 0,
              "partitions: another uid (or a peer without credentials) does not find it");
    TAP_CHECK(ds41_response_store_remove(s, 1000, "resp_c") == 0 && get(s, 2000, "resp_c", 30, NULL, 0) == 1,
              "partitions: another uid cannot delete it");
    static const char *const bad_ids[] = {"", "../x", "a/b", "resp_.json", "x y", NULL};
    bool refused = true;
    for (size_t i = 0; bad_ids[i]; i++)
        refused = refused && ds41_response_store_put(s, 1000, bad_ids[i], "x", 1, 30, NULL) == -1 &&
                  get(s, 1000, bad_ids[i], 30, NULL, 0) == 0;
    TAP_CHECK(refused, "ids that are not [A-Za-z0-9_-]{1,64} are refused (they become file names)");
    ds41_response_store_close(s);

    if (dir) {
        char stray[512];
        snprintf(stray, sizeof stray, "%s/1000-resp_half.json.tmp", dir);
        FILE *f = fopen(stray, "w");
        if (f) fclose(f);
        TAP_CHECK(ds41_response_store_open(dir, 100, 1000, 40, &s, &err) == 0, "the directory reopens");
        ds41_response_store_stats(s, &n, &bytes);
        TAP_CHECK(n == 2 && get(s, 1000, "resp_b", 40, buf, sizeof buf) == 1 &&
                      get(s, 2000, "resp_c", 40, NULL, 0) == 1 && get(s, 1000, "resp_c", 40, NULL, 0) == 0 &&
                      access(stray, F_OK) != 0,
                  "reopened: the entries with their owners, a half-written file removed");
        /* the age counts from the creation time, kept in the file's mtime across the reopen */
        TAP_CHECK(get(s, 1000, "resp_b", 1020, NULL, 0) == 1 && get(s, 1000, "resp_b", 1021, NULL, 0) == 0,
                  "the age limit: kept at 1000 s, gone after (from the creation time recorded on disk)");
        char path[512];
        snprintf(path, sizeof path, "%s/1000-resp_b.json", dir);
        TAP_CHECK(access(path, F_OK) != 0, "an expired entry's file is deleted");
        ds41_response_store_close(s);
        TAP_CHECK(ds41_response_store_open(dir, 100, 10, 2000, &s, &err) == 0,
                  "reopened with a shorter age limit");
        ds41_response_store_stats(s, &n, &bytes);
        TAP_CHECK(n == 0 && bytes == 0, "entries over the age limit are dropped when the store opens");
        TAP_CHECK(ds41_response_store_put(s, -1, "resp_anon", "{}", 2, 2000, &err) == 0 &&
                      get(s, -1, "resp_anon", 2000, buf, sizeof buf) == 1 && strcmp(buf, "{}") == 0 &&
                      get(s, 0, "resp_anon", 2000, NULL, 0) == 0,
                  "a peer without credentials has its own partition (not root's)");
        ds41_response_store_close(s);
    }
}

/* ------------------------------------------------------------------ routes */

static ds41_http_memory_response call(ds41_api *api, const char *method, const char *path, const char *body) {
    ds41_http_memory_response r;
    ds41_error err;
    if (ds41_http_dispatch_memory(ds41_api_router(api), method, path, DS41_AUTH_INFERENCE, "application/json",
                                  body, body ? strlen(body) : 0, 10000, &r, &err) != 0) {
        fprintf(stderr, "dispatch: %s\n", err.msg);
        abort();
    }
    return r;
}

static void test_routes(void) {
    mock_service *mock = mock_service_new(false);
    ds41_api *api;
    ds41_error err;
    ds41_api_options opts = {0};
    if (!mock || ds41_api_new(mock_service_iface(mock), NULL, &opts, &api, &err) != 0) abort();
    ds41_http_memory_response r =
        call(api, "POST", "/v1/responses", "{\"input\":\"Hello there\",\"instructions\":\"I\"}");
    json_t *o = json_loadb(r.body, r.body_len, 0, NULL);
    const char *id = jstr(o, "id");
    TAP_CHECK(r.status == 200 && id && strncmp(id, "resp_", 5) == 0 && strlen(id) == 37 &&
                  strcmp(jstr(o, "object"), "response") == 0 && strcmp(jstr(o, "status"), "completed") == 0,
              "POST /v1/responses: a completed response object with a resp_ id of 128 random bits");
    json_t *out0 = json_array_get(json_object_get(o, "output"), 0);
    TAP_CHECK(
        out0 && strcmp(jstr(out0, "type"), "message") == 0 &&
            strcmp(jstr(json_array_get(json_object_get(out0, "content"), 0), "text"),
                   "Hello from the mock \xe2\x9c\x93") == 0 &&
            json_integer_value(json_object_get(
                json_object_get(json_object_get(o, "usage"), "input_tokens_details"), "cached_tokens")) == 2,
        "the output is one message item with the generated text; usage has "
        "input_tokens_details.cached_tokens");
    char last[512];
    mock_service_last_request(mock, last, sizeof last);
    TAP_CHECK(strstr(last, "model=") != NULL, "the service got a chat generation (%s)", last);
    char path[128];
    snprintf(path, sizeof path, "/v1/responses/%s", id);
    char saved_id[64];
    snprintf(saved_id, sizeof saved_id, "%s", id);
    ds41_http_memory_response g = call(api, "GET", path, NULL);
    json_t *go = json_loadb(g.body, g.body_len, 0, NULL);
    TAP_CHECK(g.status == 200 && json_equal(go, o), "GET /v1/responses/{id}: the same object");
    json_decref(go);
    ds41_http_memory_response_free(&g);
    json_decref(o);
    ds41_http_memory_response_free(&r);

    char body[256];
    snprintf(body, sizeof body, "{\"input\":\"More\",\"previous_response_id\":\"%s\",\"stream\":true}",
             saved_id);
    r = call(api, "POST", "/v1/responses", body);
    char why[128];
    json_t *ev = r.streamed ? sse_split_named(r.body, r.body_len, why, sizeof why) : NULL;
    if (!ev) fprintf(stderr, "# %s\n", r.streamed ? why : "not streamed");
    size_t nev = json_array_size(ev);
    bool seq = nev > 4;
    for (size_t i = 0; seq && i < nev; i++)
        seq = json_integer_value(json_object_get(json_array_get(ev, i), "sequence_number")) == (json_int_t)i;
    json_t *lastev = json_array_get(ev, nev - 1);
    TAP_CHECK(
        r.status == 200 && seq && strcmp(jstr(json_array_get(ev, 0), "type"), "response.created") == 0 &&
            strcmp(jstr(lastev, "type"), "response.completed") == 0,
        "streamed continuation: response.created first, response.completed last, sequence numbers 0..n-1");
    TAP_CHECK(strstr(r.body, "event: response.output_text.delta\ndata: ") != NULL,
              "each SSE event has an event: line and a data: line");
    json_t *resp = json_object_get(lastev, "response");
    TAP_CHECK(resp && strcmp(jstr(resp, "previous_response_id"), saved_id) == 0,
              "the continuation names its previous response");
    char spath[128];
    snprintf(spath, sizeof spath, "/v1/responses/%s", resp && jstr(resp, "id") ? jstr(resp, "id") : "x");
    ds41_http_memory_response sg = call(api, "GET", spath, NULL);
    TAP_CHECK(sg.status == 200,
              "a streamed response is stored by the time its stream ends (GET at once: 200)");
    ds41_http_memory_response_free(&sg);
    mock_service_last_request(mock, last, sizeof last);
    TAP_CHECK(
        strstr(last,
               "{\"role\":\"user\",\"content\":\"Hello there\"},{\"role\":\"assistant\",\"content\":"
               "\"Hello from the mock \xe2\x9c\x93\"},{\"role\":\"user\",\"content\":\"More\"}") != NULL &&
            strstr(last, "\"content\":\"I\"") == NULL,
        "previous_response_id: the stored conversation and its output come before the new input (the old "
        "instructions do not)");
    json_decref(ev);
    ds41_http_memory_response_free(&r);

    snprintf(body, sizeof body, "{\"input\":\"More\",\"previous_response_id\":\"resp_nope\"}");
    r = call(api, "POST", "/v1/responses", body);
    o = json_loadb(r.body, r.body_len, 0, NULL);
    TAP_CHECK(r.status == 404 && is_error_shape(o, NULL, "previous_response_not_found", NULL) &&
                  strcmp(jstr(o, "error.param"), "previous_response_id") == 0,
              "an unknown previous_response_id: 404 naming it");
    json_decref(o);
    ds41_http_memory_response_free(&r);

    r = call(api, "DELETE", path, NULL);
    o = json_loadb(r.body, r.body_len, 0, NULL);
    TAP_CHECK(r.status == 200 && json_is_true(json_object_get(o, "deleted")) &&
                  strcmp(jstr(o, "id"), saved_id) == 0,
              "DELETE /v1/responses/{id}: deleted true");
    json_decref(o);
    ds41_http_memory_response_free(&r);
    r = call(api, "GET", path, NULL);
    TAP_CHECK(r.status == 404, "GET after DELETE: 404");
    ds41_http_memory_response_free(&r);
    r = call(api, "DELETE", path, NULL);
    TAP_CHECK(r.status == 404, "DELETE twice: 404");
    ds41_http_memory_response_free(&r);

    r = call(api, "POST", "/v1/responses", "{\"input\":\"x\",\"store\":false}");
    o = json_loadb(r.body, r.body_len, 0, NULL);
    snprintf(path, sizeof path, "/v1/responses/%s", jstr(o, "id") ? jstr(o, "id") : "x");
    json_decref(o);
    ds41_http_memory_response_free(&r);
    r = call(api, "GET", path, NULL);
    TAP_CHECK(r.status == 404, "store false: nothing to GET");
    ds41_http_memory_response_free(&r);

    r = call(api, "POST", "/v1/responses",
             "{\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"name\":\"f\"}]}");
    o = json_loadb(r.body, r.body_len, 0, NULL);
    json_t *fc = json_array_get(json_object_get(o, "output"), 0);
    TAP_CHECK(r.status == 200 && fc && strcmp(jstr(fc, "type"), "function_call") == 0 &&
                  strcmp(jstr(fc, "name"), "f") == 0 && strcmp(jstr(fc, "arguments"), "{\"x\": 1}") == 0 &&
                  strncmp(jstr(fc, "call_id"), "call_", 5) == 0,
              "a tool call is a function_call item with the joined arguments and a call_ id");
    json_decref(o);
    ds41_http_memory_response_free(&r);

    r = call(api, "POST", "/v1/responses", "{\"input\":\"x\",\"max_output_tokens\":2}");
    o = json_loadb(r.body, r.body_len, 0, NULL);
    TAP_CHECK(r.status == 200 && strcmp(jstr(o, "status"), "incomplete") == 0 &&
                  strcmp(jstr(o, "incomplete_details.reason"), "max_output_tokens") == 0,
              "cut by max_output_tokens: status incomplete, incomplete_details.reason max_output_tokens");
    json_decref(o);
    ds41_http_memory_response_free(&r);

    r = call(api, "POST", "/v1/responses", "{\"input\":\"x\",\"model\":\"missing\"}");
    TAP_CHECK(r.status == 404, "a service refusal keeps its status (unknown model: 404)");
    ds41_http_memory_response_free(&r);
    ds41_api_free(api);
    TAP_CHECK(mock_service_live(mock) == 0, "no generation left running");
    mock_service_free(mock);
}

int main(void) {
    test_parse_full();
    test_parse_refusals();
    test_store(NULL);
    char dir[256];
    if (!tmpdir_make(dir, sizeof dir, "TMPDIR", "ds41-responses-XXXXXX")) {
        TAP_CHECK(0, "a temporary directory");
        return tap_done();
    }
    char sub[300];
    snprintf(sub, sizeof sub, "%s/responses", dir);
    test_store(sub);
    tmpdir_remove(dir);
    test_routes();
    return tap_done();
}
