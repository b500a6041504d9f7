/* What the two halves of the V4.1 chat module share (the contract is chat.h): the DSML markers,
 * the error-quote limits and two small helpers.  chat_render.c encodes messages into a prompt,
 * chat_parse.c parses a completion back into a message. */
#ifndef DS41_ENGINE_CHAT_INTERNAL_H
#define DS41_ENGINE_CHAT_INTERNAL_H

#include <stddef.h>

#include "config/error.h"

#define TOOL_CALLS_START "\n\n<｜DSML｜ calls"
#define CALLS_END "</｜DSML｜ calls>"
#define INVOKE_START "<｜DSML｜ invoke"
#define INVOKE_END "</｜DSML｜ invoke"
#define PARAM_START "<｜DSML｜ parameter"
#define PARAM_END "/｜DSML｜ parameter"

/* Longest quote of model text in a parser error message, and of a name in an encoder one (the
 * messages must fit DS41_ERROR_MAX). */
#define MAX_QUOTE 720
#define MAX_NAME 400

/* The longest prefix of s[len] of at most max bytes that ends on a character boundary. */
static inline size_t utf8_cut(const char *s, size_t len, size_t max) {
    if (len <= max) return len;
    size_t n = max;
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80) n--;
    return n;
}

static inline int oom(ds41_error *err) {
    return ds41_fail(err, "out of memory");
}

#endif
