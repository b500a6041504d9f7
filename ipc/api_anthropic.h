/* The Anthropic Messages API over a ds41_service: POST /v1/messages and
 * POST /v1/messages/count_tokens (class I, as /v1/chat/completions: same
 * auth, limits and prefix-cache partition by peer uid).
 *
 * A request is validated strictly (an unknown field is a 400 naming it) and
 * translated into the same ds41_gen_request the chat route builds (kind
 * DS41_GEN_CHAT, OpenAI-shaped normalized messages), so generation, the chat
 * template, tool calls and the prefix cache are the chat route's.
 *
 * Request fields:
 *   model (string, required), max_tokens (integer >= 1, required; not for
 *   count_tokens), messages (required, non-empty; role "user" or
 *   "assistant"; content a string or an array of blocks:
 *     text {text, cache_control?, citations: null};
 *     user: tool_result {tool_use_id (a tool_use id of an earlier assistant
 *       turn), content (string or text blocks), is_error (bool: the content
 *       is sent as "Error: <content>"), cache_control?};
 *     assistant: tool_use {id, name, input (object), cache_control?},
 *       thinking {thinking, signature} (-> reasoning_content),
 *       redacted_thinking {data} (dropped: its text is not readable);
 *     image / document / search_result / server tool blocks -> 400;
 *     a last assistant message is a prefill: the answer continues it),
 *   system (string or an array of text blocks), tools (array of {name,
 *   description?, input_schema (object, the subset engine/text/json_schema.h
 *   supports), cache_control?, type: "custom"}), tool_choice ({type: "auto" |
 *   "any" | "tool" (+ name) | "none", disable_parallel_tool_use?}),
 *   thinking ({type: "enabled", budget_tokens >= 1024 and < max_tokens} |
 *   {type: "disabled"}), stop_sequences (up to 16 non-empty strings),
 *   temperature [0, 1], top_p [0, 1], top_k (integer >= 0), metadata
 *   ({user_id: string | null}), stream (bool), service_tier ("auto" |
 *   "standard_only", accepted and ignored), and ds41's test hook
 *   ds41_forced_output (see ds41_gen_request).  cache_control is accepted
 *   and ignored everywhere: the prefix cache is automatic.
 *
 * Thinking budget -> V4.1 reasoning effort (the model's "Reasoning Effort: N"
 * prefix; the budget is not a hard cap on thinking tokens, max_tokens is):
 *   1024..2047 -> 25,  2048..8191 -> 50,  8192..31999 -> 75 (the model's
 *   default),  >= 32000 -> 100.  thinking absent: the service's default mode (ds41d's:
 * no thinking, as in Anthropic's API).
 *
 * Answers: a "message" object (content blocks thinking {thinking,
 * signature:""}, text, tool_use {id "toolu_...", name, input}; stop_reason
 * end_turn | max_tokens | stop_sequence | tool_use; stop_sequence; usage
 * {input_tokens (prompt tokens not read from the cache),
 * cache_read_input_tokens (from the prefix cache), cache_creation_input_tokens
 * (0), output_tokens}), or with stream the SSE sequence message_start, ping,
 * then per block content_block_start / content_block_delta (thinking_delta +
 * signature_delta, text_delta, input_json_delta) / content_block_stop, then
 * message_delta {stop_reason, stop_sequence, usage} and message_stop; each
 * event has "event:" and "data:" lines.  count_tokens: {"input_tokens": n},
 * the rendered prompt's length.
 *
 * Errors: {"type":"error","error":{"type":...,"message":...}} with type
 * invalid_request_error (400, 409), permission_error (403), not_found_error
 * (404), rate_limit_error (429), overloaded_error (503 + Retry-After),
 * api_error (500); the message starts with the field at fault. */
#ifndef DS41_IPC_API_ANTHROPIC_H
#define DS41_IPC_API_ANTHROPIC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "config/buf.h"
#include "ipc/api.h"
#include "ipc/http_server.h"
#include "ipc/service.h"

/* Parse and validate a /v1/messages body (count_tokens: a count_tokens
 * body, where max_tokens, stream and the sampling fields are not allowed).
 * On success fill *out (free with ds41_api_request_free; gen.kind is
 * DS41_GEN_CHAT, gen.id / response_id / peer_uid are left for the caller) and
 * return 0.  On failure return -1 with err a 400 whose param names the field
 * (e.g. "messages[1].content[0].tool_use_id") and *out empty. */
int ds41_anth_parse(const char *body, size_t len, bool count_tokens, ds41_api_request *out,
                    ds41_svc_error *err);

/* The effort level (1..100) a thinking budget maps to (see above). */
int ds41_anth_budget_effort(long long budget_tokens);

/* ------------------------------------------------ the answer, as events arrive */

#define DS41_ANTH_MAX_BLOCKS 256

typedef enum ds41_anth_block_type {
    DS41_ANTH_THINKING = 1,
    DS41_ANTH_TEXT,
    DS41_ANTH_TOOL_USE,
} ds41_anth_block_type;

typedef struct ds41_anth_block {
    ds41_anth_block_type type;
    int tool_index; /* TOOL_USE: the service's tool_index */
    char id[48];    /* TOOL_USE: "toolu_..." */
    char *name;     /* TOOL_USE */
    ds41_buf text;  /* thinking, text, or the tool input's JSON text */
} ds41_anth_block;

/* The message being produced: its blocks (built from the service's events),
 * and in stream mode the SSE text for each event.  Not thread-safe (the
 * route serializes events). */
typedef struct ds41_anth_message {
    char id[48]; /* "msg_..." */
    char model[128];
    uint64_t id_bits; /* makes the tool_use ids */
    bool stream;
    bool started; /* message_start written */
    bool open;    /* the last block is still open (stream) */
    ds41_anth_block blocks[DS41_ANTH_MAX_BLOCKS];
    size_t n_blocks;
    uint64_t prompt_tokens; /* known at start (0 = unknown) */
    char **stop;            /* the request's stop sequences (owned copies) */
    size_t n_stop;
    /* terminal */
    bool finished;
    ds41_finish_reason finish;
    bool stop_string;
    size_t stop_index;
    ds41_gen_usage usage;
} ds41_anth_message;

/* stop: the request's stop sequences (copied).  Returns 0, -1 out of memory. */
int ds41_anth_message_init(ds41_anth_message *m, const char *id, const char *model, uint64_t id_bits,
                           bool stream, const char *const *stop, size_t n_stop);
void ds41_anth_message_free(ds41_anth_message *m);

/* Stream mode: append message_start and a ping to out unless already written. */
void ds41_anth_message_start(ds41_anth_message *m, ds41_buf *out);
/* Take one service event (DELTA, TOOL_CALL, FINISH; ERROR writes an error
 * event).  Stream mode appends the SSE events it causes to out (which may
 * be NULL in non-stream mode). */
void ds41_anth_message_event(ds41_anth_message *m, const ds41_gen_event *ev, ds41_buf *out);
/* After FINISH: the whole message object (non-stream answer); NULL on OOM. */
json_t *ds41_anth_message_json(const ds41_anth_message *m);

/* {"type":"error","error":{"type":..,"message":..}} for a service error
 * (message prefixed by the field when err->param is set); malloc()ed. */
char *ds41_anth_error_json(const ds41_svc_error *err);

/* The routes (ctx is the ds41_api). */
void ds41_api_route_anthropic_messages(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_anthropic_count_tokens(ds41_http_exchange *ex, void *ctx);

#endif
