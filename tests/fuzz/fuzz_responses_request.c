/* Fuzz target 'responses_request': arbitrary bytes as POST /v1/responses bodies (issue 18), to
 * the parser and to the route through the deterministic mock service (no sockets), and as ids
 * of GET / DELETE /v1/responses/{id}.
 *
 * data[0] & 3 picks: 0 the parser and the route (non-streamed), 1 the route streamed (the body
 * gets "stream": true when it parses as an object), 2 GET and 3 DELETE with the bytes as the id.
 * Oracles beyond "no crash, no leak, no UB":
 *   - the parser and the route agree: a body the parser refuses is a 400 naming the same field
 *     (and never anything but a 400 for a bad body), one it accepts is not a 400;
 *   - what the parser hands the service (messages, tools, tool_choice, response_format) is JSON;
 *   - every answer has a status the route can give and a JSON body, in the OpenAI error shape
 *     for >= 400; a stream is "event: T\ndata: {type T, ...}" events with sequence numbers
 *     0, 1, ... starting with response.created and ending with response.completed /
 *     response.incomplete or an error event. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/api.h"
#include "ipc/api_responses.h"
#include "ipc/http_server.h"
#include "tests/ipc_mock_service.h"
#include "tests/ipc_test_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static mock_service *mock;
static ds41_api *api;

static void fail(const char *what, const ds41_http_memory_response *r) {
    fprintf(stderr, "responses_request oracle: %s (status %d, body %.300s)\n", what, r ? r->status : -1,
            r && r->body ? r->body : "");
    abort();
}

static void setup(void) {
    if (api) return;
    mock = mock_service_new(false);
    /* a small store so that eviction runs too */
    ds41_api_options opts = {.max_body_bytes = 1 << 20, .responses_max_bytes = 64 << 10};
    ds41_error err;
    if (!mock || ds41_api_new(mock_service_iface(mock), NULL, &opts, &api, &err) != 0) abort();
}

static void check_stream(const ds41_http_memory_response *r) {
    char why[160];
    json_t *ev = sse_split_named(r->body, r->body_len, why, sizeof why);
    if (!ev) fail(why, r);
    size_t n = json_array_size(ev);
    for (size_t i = 0; i < n; i++)
        if (json_integer_value(json_object_get(json_array_get(ev, i), "sequence_number")) != (json_int_t)i)
            fail("sequence numbers are not 0, 1, ...", r);
    const char *first = n ? json_string_value(json_object_get(json_array_get(ev, 0), "type")) : NULL;
    const char *last = n ? json_string_value(json_object_get(json_array_get(ev, n - 1), "type")) : NULL;
    if (!first || strcmp(first, "response.created") != 0)
        fail("the stream does not start with response.created", r);
    if (strcmp(last, "response.completed") != 0 && strcmp(last, "response.incomplete") != 0 &&
        strcmp(last, "error") != 0)
        fail("the stream does not end with completed, incomplete or error", r);
    json_decref(ev);
}

static void check_answer(const ds41_http_memory_response *r) {
    static const int ok[] = {200, 400, 404, 429, 503};
    bool known = false;
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) known = known || r->status == ok[i];
    if (!known) fail("unexpected status", r);
    if (!r->body) fail("no body", r);
    if (r->streamed) {
        check_stream(r);
        return;
    }
    json_t *j = json_loadb(r->body, r->body_len, 0, NULL);
    if (!j) fail("the body is not JSON", r);
    if (r->status >= 400 && !is_error_shape(j, NULL, NULL, NULL))
        fail("an error without the OpenAI shape", r);
    if (r->status == 200 && !json_object_get(j, "id")) fail("a 200 without an id", r);
    json_decref(j);
}

static void check_parser_agrees(const char *body, size_t len, const ds41_http_memory_response *r) {
    ds41_responses_request req;
    ds41_svc_error err = {0};
    int rc = ds41_responses_parse(body, len, &req, &err);
    const bool parsed = rc == 0; /* req holds memory until freed */
    if (rc == 0 && !req.previous_response_id) rc = ds41_responses_messages(&req, NULL, NULL, &err);
    if (rc != 0) {
        if (parsed) ds41_responses_request_free(&req);
        if (err.status != DS41_SVC_BAD_REQUEST) return; /* out of memory */
        if (r->status != 400) fail("the parser refuses what the route accepted", r);
        json_t *j = json_loadb(r->body, r->body_len, 0, NULL);
        const char *param = jstr(j, "error.param");
        if (strcmp(param ? param : "", err.param) != 0) fail("route and parser name different fields", r);
        json_decref(j);
        return;
    }
    if (r->status == 400) fail("the route refuses what the parser accepted", r);
    const ds41_gen_request *g = &req.chat.gen;
    const char *texts[] = {g->messages_json, g->tools_json, g->tool_choice_json, g->response_format_json};
    for (size_t i = 0; i < 4; i++) {
        if (!texts[i]) continue;
        json_t *j = json_loads(texts[i], JSON_DECODE_ANY, NULL);
        if (!j) fail("a JSON text handed to the service does not parse", r);
        json_decref(j);
    }
    ds41_responses_request_free(&req);
}

static ds41_http_memory_response dispatch(const char *method, const char *path, const char *body,
                                          size_t len) {
    ds41_http_memory_response r;
    ds41_error err;
    if (ds41_http_dispatch_memory(ds41_api_router(api), method, path, DS41_AUTH_INFERENCE, "application/json",
                                  body, len, 10000, &r, &err) != 0)
        abort();
    return r;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    setup();
    if (size < 1) return 0;
    int mode = data[0] & 3;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    if (mode >= 2) {
        char path[160];
        snprintf(path, sizeof path, "/v1/responses/%.*s", (int)(len < 100 ? len : 100), body);
        ds41_http_memory_response r = dispatch(mode == 2 ? "GET" : "DELETE", path, NULL, 0);
        if (r.status != 404 && r.status != 200) fail("GET/DELETE of a fuzzed id", &r);
        ds41_http_memory_response_free(&r);
        return 0;
    }
    char *streamed = NULL;
    if (mode == 1) {
        json_t *j = json_loadb(body, len, JSON_REJECT_DUPLICATES, NULL);
        if (json_is_object(j)) {
            json_object_set_new(j, "stream", json_true());
            streamed = json_dumps(j, JSON_COMPACT);
        }
        json_decref(j);
        if (streamed) {
            body = streamed;
            len = strlen(streamed);
        }
    }
    ds41_http_memory_response r = dispatch("POST", "/v1/responses", body, len);
    check_answer(&r);
    check_parser_agrees(body, len, &r);
    ds41_http_memory_response_free(&r);
    free(streamed);
    if (mock_service_live(mock) != 0) {
        fprintf(stderr, "responses_request oracle: a generation was left running\n");
        abort();
    }
    return 0;
}
