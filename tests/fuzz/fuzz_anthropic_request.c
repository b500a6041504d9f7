/* Fuzz target 'anthropic_request': arbitrary bytes as /v1/messages and /v1/messages/count_tokens
 * bodies, to ds41_anth_parse() and to the routes over the deterministic mock service (sync mode,
 * through ds41_http_dispatch_memory() -- no sockets).  data[0] bit 0 picks count_tokens, bit 1 the
 * stream flag forced on (the body is wrapped when it is a JSON object); the rest is the body.
 * Oracles beyond "no crash, no leak, no UB":
 *   - a refusal is a 400 that names a field (or says the JSON is bad), and its Anthropic error
 *     JSON has the shape {"type":"error","error":{"type","message"}};
 *   - an accepted request hands the service JSON texts that parse (messages an array);
 *   - the route agrees with the parser (refused -> 400, accepted -> not 400), every answer is
 *     JSON in Anthropic's shape, a streamed one is well-formed SSE (event: + data: lines of the
 *     same type) ending in message_stop or an error event, and no generation is left running. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/api.h"
#include "ipc/api_anthropic.h"
#include "ipc/http_server.h"
#include "tests/ipc_mock_service.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static mock_service *mock;
static ds41_api *api;

static void fail(const char *what, const char *detail) {
    fprintf(stderr, "anthropic_request oracle: %s (%.300s)\n", what, detail ? detail : "");
    abort();
}

static bool anthropic_error(const json_t *j) {
    const json_t *e = json_object_get(j, "error");
    return json_is_object(j) && json_object_size(j) == 2 && json_is_string(json_object_get(j, "type")) &&
           strcmp(json_string_value(json_object_get(j, "type")), "error") == 0 && json_is_object(e) &&
           json_is_string(json_object_get(e, "type")) && json_is_string(json_object_get(e, "message")) &&
           json_string_length(json_object_get(e, "message")) > 0;
}

/* The SSE body: every message "event: T\ndata: {...type T...}\n\n"; the last message_stop or error. */
static void check_sse(const char *s, size_t len) {
    const char *end = s + len, *last = NULL;
    while (s < end) {
        const char *stop = strstr(s, "\n\n");
        const char *nl = memchr(s, '\n', (size_t)(end - s));
        if (!stop || strncmp(s, "event: ", 7) != 0 || !nl || nl >= stop || strncmp(nl + 1, "data: ", 6) != 0)
            fail("malformed SSE message", s);
        json_t *d = json_loadb(nl + 7, (size_t)(stop - nl - 7), 0, NULL);
        const char *type = json_string_value(json_object_get(d, "type"));
        if (!type || strlen(type) != (size_t)(nl - s - 7) || strncmp(type, s + 7, strlen(type)) != 0)
            fail("SSE event name and data type differ", s);
        if (strcmp(type, "error") == 0 && !anthropic_error(d)) fail("SSE error event without the shape", s);
        json_decref(d);
        last = s + 7;
        s = stop + 2;
    }
    if (!last || (strncmp(last, "message_stop", 12) != 0 && strncmp(last, "error", 5) != 0))
        fail("stream does not end in message_stop or error", last);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!api) {
        mock = mock_service_new(false);
        ds41_error err;
        ds41_api_options opts = {.max_body_bytes = 1 << 20};
        if (!mock || ds41_api_new(mock_service_iface(mock), NULL, &opts, &api, &err) != 0) abort();
    }
    if (size < 1) return 0;
    bool count = data[0] & 1;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    char *owned = NULL;
    if ((data[0] & 2) && !count) { /* force stream: true into an object body */
        json_t *j = json_loadb(body, len, JSON_REJECT_DUPLICATES, NULL);
        if (json_is_object(j)) {
            json_object_set_new(j, "stream", json_true());
            owned = json_dumps(j, JSON_COMPACT);
            if (owned) {
                body = owned;
                len = strlen(owned);
            }
        }
        json_decref(j);
    }
    ds41_api_request req;
    ds41_svc_error e = {0};
    int rc = ds41_anth_parse(body, len, count, &req, &e);
    if (rc == 0) {
        const char *texts[] = {req.gen.messages_json, req.gen.tools_json, req.gen.tool_choice_json};
        for (size_t i = 0; i < 3; i++) {
            json_t *j = texts[i] ? json_loads(texts[i], JSON_DECODE_ANY, NULL) : NULL;
            if (texts[i] && !j) fail("a JSON text for the service does not parse", texts[i]);
            if (i == 0 && !json_is_array(j)) fail("messages is not an array", texts[0]);
            json_decref(j);
        }
        ds41_api_request_free(&req);
    } else {
        if (e.status != DS41_SVC_BAD_REQUEST && e.status != DS41_SVC_INTERNAL)
            fail("refusal not a 400", e.message);
        if (e.status == DS41_SVC_BAD_REQUEST && !e.param[0] && strcmp(e.code, "invalid_json") != 0)
            fail("a refusal that names no field", e.message);
        char *ej = ds41_anth_error_json(&e);
        json_t *j = ej ? json_loads(ej, 0, NULL) : NULL;
        if (!anthropic_error(j)) fail("error JSON without the shape", ej);
        json_decref(j);
        free(ej);
    }
    ds41_http_memory_response r;
    ds41_error err;
    if (ds41_http_dispatch_memory(ds41_api_router(api), "POST",
                                  count ? "/v1/messages/count_tokens" : "/v1/messages", DS41_AUTH_INFERENCE,
                                  "application/json", body, len, 10000, &r, &err) != 0)
        abort();
    if ((rc != 0) != (r.status == 400) && r.status != 413) fail("the route and the parser disagree", r.body);
    if (r.streamed) {
        check_sse(r.body ? r.body : "", r.body_len);
    } else {
        json_t *j = r.body ? json_loadb(r.body, r.body_len, 0, NULL) : NULL;
        if (!j) fail("the answer is not JSON", r.body);
        if (r.status >= 400 && r.status != 413 && !anthropic_error(j))
            fail("an error without Anthropic's shape", r.body);
        if (r.status == 200 && !count &&
            strcmp(json_string_value(json_object_get(j, "type")), "message") != 0)
            fail("a 200 that is not a message", r.body);
        json_decref(j);
    }
    ds41_http_memory_response_free(&r);
    free(owned);
    if (mock_service_live(mock) != 0) fail("a generation was left running", NULL);
    return 0;
}
