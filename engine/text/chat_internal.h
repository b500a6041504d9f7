/* What the two halves of the V4.1 chat module share (the contract is chat.h): the DSML markers,
 * the error-quote limits and the out-of-memory error.  chat_render.c encodes messages into a prompt,
 * chat_parse.c parses a completion back into a message. */
#ifndef DS41_ENGINE_CHAT_INTERNAL_H
#define DS41_ENGINE_CHAT_INTERNAL_H

#include <stddef.h>

#include "config/error.h"
#include "config/utf8.h"

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

static inline int oom(ds41_error *err) {
    return ds41_fail(err, "out of memory");
}

#endif
