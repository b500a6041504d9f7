/* Fuzz the V4.1 renderer with arbitrary JSON.  Byte 0 holds options (bit 0 thinking, bit 1 keep
 * thinking, bit 2 no BOS); the rest is JSON: an array is the messages, an object is a request
 * {"messages", "tools", "response_format", "context", "reasoning_effort"}, anything else is
 * passed as messages (and refused).  Errors are fine; crashes, leaks and UB are not.
 *
 * Oracles: a rendered prompt is well-formed UTF-8 of the length reported, with a JSON array of
 * image records; and the same bytes through Python's json.loads/json.dumps (engine/text/pyjson.h) are
 * a fixed point after one round: dumps(loads(dumps(loads(x)))) == dumps(loads(x)). */
#include "engine/text/chat.h"
#include "engine/text/pyjson.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_pyjson(const char *text, size_t len) {
    ds41_py *v = NULL;
    bool is_json = false;
    ds41_error err;
    if (ds41_py_loads(text, len, &v, &is_json, &err) != 0 || !is_json) return;
    ds41_buf once = {0};
    ds41_py_dumps(v, &once);
    ds41_py_free(v);
    if (once.oom) abort();
    ds41_py *again = NULL;
    if (ds41_py_loads(once.data, once.len, &again, &is_json, &err) != 0 || !is_json) {
        fprintf(stderr, "json.dumps output does not load again: %s\n", once.data);
        abort();
    }
    ds41_buf twice = {0};
    ds41_py_dumps(again, &twice);
    ds41_py_str(again, &twice); /* exercise str()/repr() too */
    ds41_py_free(again);
    if (twice.len < once.len || memcmp(once.data, twice.data, once.len) != 0) {
        fprintf(stderr, "json.dumps is not a fixed point: %s\n", once.data);
        abort();
    }
    ds41_buf_free(&once);
    ds41_buf_free(&twice);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    uint8_t flags = data[0];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    check_pyjson(text, len);

    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!root) return 0;
    ds41_chat_request req = ds41_chat_request_default();
    req.mode = (flags & 1) ? DS41_CHAT_MODE_THINKING : DS41_CHAT_MODE_CHAT;
    req.drop_thinking = !(flags & 2);
    req.add_bos = !(flags & 4);
    if (json_is_object(root)) {
        req.messages = json_object_get(root, "messages");
        req.tools = json_object_get(root, "tools");
        req.response_format = json_object_get(root, "response_format");
        req.context = json_object_get(root, "context");
        req.reasoning_effort = json_object_get(root, "reasoning_effort");
    } else {
        req.messages = root;
    }
    ds41_chat_prompt p;
    ds41_error err;
    if (ds41_chat_render(&req, &p, &err) == 0) {
        if (!p.text || p.text[p.len] != 0 || !ds41_utf8_valid(p.text, p.len, NULL) || !json_is_array(p.images)) {
            fprintf(stderr, "rendered prompt is malformed\n");
            abort();
        }
        ds41_chat_prompt_free(&p);
    } else if (!ds41_utf8_valid(err.msg, strlen(err.msg), NULL)) {
        fprintf(stderr, "error message is not UTF-8: %s\n", err.msg);
        abort();
    }
    json_decref(root);
    return 0;
}
