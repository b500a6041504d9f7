/* The OpenAI Responses API over a ds41_service (issue 18):
 *
 *   POST   /v1/responses        I  a response object, or an SSE stream of response.* events
 *   GET    /v1/responses/{id}   I  a stored response (404 unknown, expired or another peer's)
 *   DELETE /v1/responses/{id}   I  {"id","object":"response","deleted":true} (404 likewise)
 *
 * A request becomes a DS41_GEN_CHAT generation (the chat route's machinery, no second
 * generation path):
 *   input        a string (one user message) or items: {"type":"message"?, "role": user |
 *                assistant | system | developer, "content": string | [{"type":"input_text" |
 *                "output_text", "text"}]}, {"type":"function_call","call_id","name",
 *                "arguments"}, {"type":"function_call_output","call_id","output"}, and
 *                {"type":"reasoning","content":[{"type":"reasoning_text","text"}]} (the next
 *                assistant turn's reasoning); ids, status, annotations and logprobs the SDK
 *                echoes back are accepted and dropped;
 *   instructions a system message put first (not carried over by previous_response_id);
 *   tools        [{"type":"function","name","description","parameters","strict"}];
 *   tool_choice  "auto" | "none" | "required" | {"type":"function","name"};
 *   reasoning    {"effort": none | minimal | low | medium | high | xhigh, "summary"} (effort
 *                maps as reasoning_effort does on the chat route);
 *   text         {"format": {"type": "text" | "json_object" | "json_schema", "name",
 *                "schema", "description", "strict"}, "verbosity"}: handed to the service as
 *                the chat route's response_format;
 *   max_output_tokens, temperature, top_p, stream, store (default true),
 *   previous_response_id, metadata (up to 16 string values), parallel_tool_calls, user,
 *   accepted and ignored: include, truncation, service_tier, prompt_cache_key,
 *   safety_identifier, background (false only), stream_options;
 *   ds41 extras as on the chat route: seed, cache_salt, ds41_forced_output.
 * Any other field is a 400 naming it (the chat route's error shape and codes).
 *
 * previous_response_id: the stored response's conversation (its input and output) comes
 * before the new input, so the prompt of a continuation starts with the tokens of the earlier
 * one and the prefix cache (memory, or the snapshot tier after a restart) serves them.  Stored
 * responses are partitioned by the peer uid (ipc/response_store.h). */
#ifndef DS41_IPC_API_RESPONSES_H
#define DS41_IPC_API_RESPONSES_H

#include <jansson.h>
#include <stdbool.h>

#include "ipc/api.h"
#include "ipc/service.h"

typedef struct ds41_responses_request {
    ds41_api_request chat; /* the generation (messages_json set by ds41_responses_messages) */
    json_t *input;         /* the input as chat messages (not yet normalized) */
    char *instructions;
    char *previous_response_id;
    bool store;
    json_t *echo; /* the request fields a response object repeats */
} ds41_responses_request;

/* Parse and validate a POST /v1/responses body.  0 and *out filled (free with
 * ds41_responses_request_free), or -1 with err a 400 naming the field. */
int ds41_responses_parse(const char *body, size_t len, ds41_responses_request *out, ds41_svc_error *err);

/* Set r->chat.messages_json to instructions + previous (chat messages of an earlier
 * response, or NULL) + the input.  *conversation (if not NULL) gets previous + input: what a
 * stored response keeps before its own output. */
int ds41_responses_messages(ds41_responses_request *r, const json_t *previous, json_t **conversation,
                            ds41_svc_error *err);

void ds41_responses_request_free(ds41_responses_request *r);

#endif
