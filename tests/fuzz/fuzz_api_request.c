/* Fuzz target 'api_request': arbitrary bytes as request bodies (and paths)
 * to the API's parsers and route handlers, through the deterministic mock
 * service and ds41_http_dispatch_memory() -- no sockets.
 *
 * data[0] picks the route (and the admin class with bit 0x80); the rest is
 * the body.  Oracles beyond "no crash, no leak, no UB":
 *   - every answer has a status the API can legitimately give (never 500,
 *     never none) and a JSON body, in the OpenAI error shape for >= 400;
 *   - a streamed answer is well-formed SSE ending in [DONE] or an error event;
 *   - for chat and completions, the direct parser and the route agree: a body
 *     the parser refuses is a 400 naming the same field, one it accepts is
 *     not a 400; accepted requests carry re-parseable JSON for messages and
 *     tools. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/api.h"
#include "ipc/http_server.h"
#include "tests/ipc_mock_service.h"
#include "tests/ipc_test_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static mock_service *mock;
static ds41_api *api;
static ds41_http_metrics *metrics;

static void fail(const char *what, const ds41_http_memory_response *r) {
    fprintf(stderr, "api_request oracle: %s (status %d, body %.300s)\n", what, r ? r->status : -1,
            r && r->body ? r->body : "");
    abort();
}

static void setup(void) {
    if (api) return;
    mock = mock_service_new(false);
    metrics = ds41_http_metrics_new();
    ds41_api_options opts = {.max_body_bytes = 1 << 20};
    ds41_error err;
    if (!mock || !metrics || ds41_api_new(mock_service_iface(mock), metrics, &opts, &api, &err) != 0) abort();
}

static bool allowed_status(int s) {
    static const int ok[] = {200, 202, 400, 403, 404, 405, 409, 413, 415, 429, 503};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (s == ok[i]) return true;
    return false;
}

static void check_response(const ds41_http_memory_response *r) {
    if (!allowed_status(r->status)) fail("unexpected status", r);
    if (!r->body) fail("no body", r);
    if (r->streamed) {
        char why[128];
        json_t *ev = sse_split(r->body, r->body_len, NULL, why, sizeof why);
        if (!ev) fail(why, r);
        json_t *last = json_array_get(ev, json_array_size(ev) - 1);
        bool done = json_is_string(last) && strcmp(json_string_value(last), "[DONE]") == 0;
        if (!done && !is_error_shape(last, NULL, NULL, NULL))
            fail("stream ends without [DONE] or an error", r);
        json_decref(ev);
        return;
    }
    if (r->content_type && strncmp(r->content_type, "text/plain", 10) == 0) return;
    json_t *j = json_loadb(r->body, r->body_len, JSON_ALLOW_NUL, NULL);
    if (!j) fail("body is not JSON", r);
    if (r->status >= 400 && !is_error_shape(j, NULL, NULL, NULL)) fail("error without the OpenAI shape", r);
    json_decref(j);
}

static void check_parser_agrees(bool chat, const char *body, size_t len, const ds41_http_memory_response *r) {
    ds41_api_request req;
    ds41_svc_error err = {0};
    int rc = chat ? ds41_api_parse_chat(body, len, &req, &err)
                  : ds41_api_parse_completion(body, len, 16, &req, &err);
    if (rc != 0) {
        if (r->status != 400 && r->status != 413) fail("the parser refuses what the route accepted", r);
        if (r->status == 400) {
            json_t *j = json_loadb(r->body, r->body_len, 0, NULL);
            const char *param = jstr(j, "error.param");
            if (strcmp(param ? param : "", err.param) != 0) fail("route and parser name different fields", r);
            json_decref(j);
        }
        return;
    }
    if (r->status == 400) fail("the route refuses what the parser accepted", r);
    const char *texts[] = {req.gen.messages_json, req.gen.tools_json, req.gen.tool_choice_json,
                           req.gen.response_format_json};
    for (size_t i = 0; i < 4; i++) {
        if (!texts[i]) continue;
        json_t *j = json_loads(texts[i], JSON_DECODE_ANY, NULL);
        if (!j) fail("a JSON text handed to the service does not parse", r);
        json_decref(j);
    }
    ds41_api_request_free(&req);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    setup();
    if (size < 1) return 0;
    ds41_auth_class auth = (data[0] & 0x80) ? DS41_AUTH_ADMIN : DS41_AUTH_INFERENCE;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    const char *method = "POST", *path;
    char dyn[160];
    switch ((data[0] & 0x7f) % 9) {
    case 0:
        path = "/v1/chat/completions";
        break;
    case 1:
        path = "/v1/completions";
        break;
    case 2:
        path = "/tokenize";
        break;
    case 3:
        path = "/detokenize";
        break;
    case 4:
        path = "/admin/models/load";
        break;
    case 5:
        path = "/admin/models/unload";
        break;
    case 6:
    case 7: { /* the bytes as a path segment */
        size_t n = len < 100 ? len : 100;
        snprintf(dyn, sizeof dyn, "%s%.*s", (data[0] & 0x7f) % 9 == 6 ? "/admin/sessions/" : "/v1/models/",
                 (int)n, body);
        method = (data[0] & 0x7f) % 9 == 6 ? "DELETE" : "GET";
        path = dyn;
        len = 0;
        break;
    }
    default: { /* "METHOD PATH\n" then the body */
        const char *nl = memchr(body, '\n', len < 150 ? len : 150);
        if (!nl) return 0;
        char line[152];
        memcpy(line, body, (size_t)(nl - body));
        line[nl - body] = 0;
        char m[16], p[140];
        if (sscanf(line, "%15s %139s", m, p) != 2) return 0;
        if (strncmp(p, "/v1/messages", 12) == 0) return 0; /* Anthropic's error shape: fuzz_anthropic_request */
        snprintf(dyn, sizeof dyn, "%s", p);
        method = m;
        path = dyn;
        len -= (size_t)(nl - body) + 1;
        body = nl + 1;
        ds41_http_memory_response r;
        ds41_error err;
        if (ds41_http_dispatch_memory(ds41_api_router(api), method, path, auth, "application/json", body, len,
                                      10000, &r, &err) != 0)
            abort();
        if (r.status != 0) check_response(&r);
        ds41_http_memory_response_free(&r);
        return 0;
    }
    }
    ds41_http_memory_response r;
    ds41_error err;
    if (ds41_http_dispatch_memory(ds41_api_router(api), method, path, auth, "application/json", body, len,
                                  10000, &r, &err) != 0)
        abort();
    check_response(&r);
    int route = (data[0] & 0x7f) % 9;
    if (route <= 1) check_parser_agrees(route == 0, body, len, &r);
    ds41_http_memory_response_free(&r);
    if (mock_service_live(mock) != 0) {
        fprintf(stderr, "api_request oracle: a generation was left running\n");
        abort();
    }
    return 0;
}
