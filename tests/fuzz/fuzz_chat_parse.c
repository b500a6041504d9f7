/* Fuzz the V4.1 completion parsers (strict and lenient) with arbitrary bytes.  Byte 0 picks the
 * mode (bit 0: thinking); the rest is the generated text.
 *
 * Oracles beyond "no crash, no leak, no UB":
 *   - the lenient parser never fails, and repairs exactly when the strict one fails;
 *   - when the strict parser accepts, the lenient result is identical;
 *   - every result converts to a message (all strings are well-formed UTF-8);
 *   - a strictly parsed turn, rendered after a user turn, parses back (strictly) to the same
 *     reasoning, content and number of calls whenever it renders at all. */
#include "engine/text/chat.h"
#include "engine/text/pyjson.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bool same_span(const char *a, size_t an, const char *b, size_t bn) {
    return an == bn && (an == 0 || memcmp(a, b, an) == 0);
}

static bool same_completion(const ds41_chat_completion *a, const ds41_chat_completion *b) {
    if (!same_span(a->content, a->content_len, b->content, b->content_len) ||
        !same_span(a->reasoning_content, a->reasoning_content_len, b->reasoning_content, b->reasoning_content_len) ||
        a->n_tool_calls != b->n_tool_calls)
        return false;
    for (size_t i = 0; i < a->n_tool_calls; i++) {
        const ds41_chat_tool_call *x = &a->tool_calls[i], *y = &b->tool_calls[i];
        if (!same_span(x->name, x->name_len, y->name, y->name_len) ||
            !same_span(x->arguments, x->arguments_len, y->arguments, y->arguments_len) ||
            (x->tool_namespace == NULL) != (y->tool_namespace == NULL) ||
            (x->tool_namespace &&
             !same_span(x->tool_namespace, x->tool_namespace_len, y->tool_namespace, y->tool_namespace_len)))
            return false;
    }
    return true;
}

static void check_message(const ds41_chat_completion *c) {
    ds41_error err;
    json_t *m = ds41_chat_completion_to_message(c, &err);
    if (!m) {
        fprintf(stderr, "parsed turn does not convert: %s\n", err.msg);
        abort();
    }
    json_decref(m);
}

static void check_round_trip(const ds41_chat_completion *c, ds41_chat_mode mode) {
    ds41_error err;
    json_t *msg = ds41_chat_completion_to_message(c, &err);
    json_t *messages = msg ? json_pack("[o]", msg) : NULL;
    json_t *context = json_pack("[{s:s, s:s}]", "role", "user", "content", "q");
    if (!messages || !context) abort();
    ds41_chat_request req = ds41_chat_request_default();
    req.messages = messages;
    req.context = context;
    req.mode = mode;
    ds41_chat_prompt p;
    if (ds41_chat_render(&req, &p, &err) == 0) {
        ds41_chat_completion back;
        if (ds41_chat_parse_completion(p.text, p.len, mode, &back, &err) != 0) {
            fprintf(stderr, "re-rendered turn does not parse: %s\n", err.msg);
            abort();
        }
        if (!same_span(back.content, back.content_len, c->content, c->content_len) ||
            !same_span(back.reasoning_content, back.reasoning_content_len, c->reasoning_content,
                       c->reasoning_content_len) ||
            back.n_tool_calls != c->n_tool_calls) {
            fprintf(stderr, "re-rendered turn parses differently\n");
            abort();
        }
        ds41_chat_completion_free(&back);
        ds41_chat_prompt_free(&p);
    }
    json_decref(messages);
    json_decref(context);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    ds41_chat_mode mode = (data[0] & 1) ? DS41_CHAT_MODE_THINKING : DS41_CHAT_MODE_CHAT;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;

    ds41_chat_completion strict, lenient;
    ds41_error err, note;
    int strict_rc = ds41_chat_parse_completion(text, len, mode, &strict, &err);
    if (ds41_chat_parse_completion_lenient(text, len, mode, &lenient, &note) != 0) {
        fprintf(stderr, "lenient parser failed: %s\n", note.msg);
        abort();
    }
    if (strict_rc == 0) {
        if (lenient.repaired || !same_completion(&strict, &lenient)) {
            fprintf(stderr, "lenient differs from an accepting strict parse\n");
            abort();
        }
        for (size_t i = 0; i < strict.n_tool_calls; i++) {
            const ds41_chat_tool_call *tc = &strict.tool_calls[i];
            if (tc->arguments_len < 2 || tc->arguments[0] != '{' || tc->arguments[tc->arguments_len - 1] != '}')
                abort();
        }
        check_message(&strict);
        check_round_trip(&strict, mode);
        ds41_chat_completion_free(&strict);
    } else if (!lenient.repaired) {
        fprintf(stderr, "strict failed (%s) but lenient did not repair\n", err.msg);
        abort();
    }
    if (!ds41_utf8_valid(err.msg, strict_rc ? strlen(err.msg) : 0, NULL)) {
        fprintf(stderr, "error message is not UTF-8\n");
        abort();
    }
    check_message(&lenient);
    ds41_chat_completion_free(&lenient);
    return 0;
}
