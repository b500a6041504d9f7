/* ds41_api: the OpenAI-compatible and admin HTTP API over a ds41_service.
 *
 * Routes (class: I = inference, every peer that can connect; A = admin, root
 * or the admin group, see ipc/http_server.h; others get 403):
 *
 *   method  path                      class  answer
 *   GET     /health                   I      200 {"status":"ok"}; 503 {"status":"loading"|"error",
 *                                            "detail":...} + Retry-After while loading
 *   GET     /v1/models                I      {"object":"list","data":[{"id","object":"model",
 *                                            "created","owned_by":"ds41","max_model_len"?}]} (READY models)
 *   GET     /v1/models/{id}           I      one model object, 404 model_not_found
 *   POST    /v1/chat/completions      I      chat.completion, or SSE chat.completion.chunk stream
 *   POST    /v1/completions           I      text_completion, or SSE stream
 *   POST    /v1/responses             I      response, or SSE response.* events (ipc/api_responses.h)
 *   GET     /v1/responses/{id}        I      a stored response of this peer; 404 otherwise
 *   DELETE  /v1/responses/{id}        I      {"id","object":"response","deleted":true}; 404 likewise
 *   POST    /v1/messages              I      Anthropic's Messages API (ipc/api_anthropic.h)
 *   POST    /v1/messages/count_tokens I      {"input_tokens": n} (ipc/api_anthropic.h)
 *   POST    /tokenize                 I      {"tokens":[...],"count":n}
 *   POST    /detokenize               I      {"content":"..."}
 *   GET     /metrics                  I      text/plain Prometheus exposition: the service's text
 *                                            followed by the ds41_http_* series
 *   GET     /admin/models             A      {"object":"list","data":[{"id","path","state","created",
 *                                            "context_length","detail","tiers":{tier:bytes},
 *                                            "bytes_total"}]} (every model, every state)
 *   POST    /admin/models/load        A      {"name"?: str, "path"?: absolute path} -> 200
 *                                            {"status":"ready"} or 202 {"status":"loading"}
 *   POST    /admin/models/unload      A      {"name": str} -> {"status":"unloaded"}
 *   GET     /admin/sessions           A      {"object":"list","data":[{"id","model","state",
 *                                            "request_id","prompt_tokens","generated_tokens",
 *                                            "cached_tokens","kv_tokens","kv_pages","kv_bytes",
 *                                            "created","last_used","owner_uid"}]} (owner_uid:
 *                                            the peer uid of the prefix-cache partition, null
 *                                            when unknown)
 *   DELETE  /admin/sessions/{id}      A      {"id":...,"deleted":true}; 404 when unknown
 *   GET     /admin/cache              A      {"page_tokens","page_bytes","pages_total","pages_used",
 *                                            "pages_free","bytes_per_token","tiers":[{"name",
 *                                            "used_bytes","capacity_bytes","hits","misses",
 *                                            "hit_rate"}],"budgets","prefix_shared_across_users"}
 *                                            (budgets: the load-time budget decision line, when
 *                                            the service has one; prefix_shared_across_users:
 *                                            whether users share cached prefixes)
 *   GET     /admin/snapshots          A      {"object":"list","data":[{"id","model","tokens","bytes",
 *                                            "created","last_used","sampler_state","owner_uid"}]} (session
 *                                            snapshots on disk; id = "<model>:<40 hex digits>")
 *   POST    /admin/snapshots/save     A      {"session": session id} -> the snapshot object; 404
 *                                            unknown session, 409 snapshots off / nothing fed yet
 *   POST    /admin/snapshots/restore  A      {"id": snapshot id} -> {"id","session","tokens"}: loaded
 *                                            into the prefix cache; 404 unknown, 400 refused (the
 *                                            message names the file and why; the file is deleted)
 *   DELETE  /admin/snapshots/{id}     A      {"id":...,"deleted":true}; 404 when unknown
 *
 * No route reads a file or runs a command for a client (snapshot ids are
 * checked by the service against the names it indexed); the only path a
 * client can name is "path" of /admin/models/load (admin class only), which
 * must be absolute and free of ".." segments here, and which the SERVICE
 * confines to its configured model directories (ipc/service.h).
 *
 * Request bodies are JSON objects, validated strictly: invalid JSON, a
 * duplicate key, an unknown field, a wrong type or a value out of range is a
 * 400 invalid_request_error whose "param" names the field (e.g.
 * "messages[1].content[0].text") and whose "code" is one of invalid_json,
 * unknown_field, invalid_type, invalid_value, missing_field,
 * unsupported_parameter.  A null value counts as "not given" for every
 * optional field.
 *
 * POST /v1/chat/completions accepts:
 *   messages (required, non-empty array; roles system, developer, user,
 *     assistant, tool; content a string, an array of {"type":"text","text"}
 *     parts, or null for an assistant; name; assistant tool_calls,
 *     reasoning_content, prefix; tool tool_call_id; the fields the OpenAI SDK
 *     puts in the assistant messages it hands back -- refusal, annotations,
 *     audio:null, function_call:null, parsed, and tool_calls[].index /
 *     function.parsed_arguments -- are accepted and dropped; image/audio/file
 *     parts -> 400 unsupported),
 *   model (string; absent = the service's default),
 *   temperature [0,2], top_p [0,1], max_tokens / max_completion_tokens
 *     (integer >= 1; both given and different -> 400), stop (string or array
 *     of up to 16 non-empty strings), seed (integer), logit_bias (object
 *     "token id" -> number in [-100,100], up to 1024 entries), logprobs (bool),
 *     top_logprobs (0..20, needs logprobs), tools (array of {"type":"function",
 *     "function":{"name","description","parameters","strict","namespace"}}),
 *     tool_choice ("none"|"auto"|"required"|{"type":"function","function":
 *     {"name"}} naming a given tool), response_format ({"type":"text"|
 *     "json_object"|"json_schema","json_schema":{"name","description",
 *     "schema","strict"}}), stream (bool), stream_options {"include_usage",
 *     "include_obfuscation"} (only with stream), n (only 1), presence_penalty
 *     and frequency_penalty [-2,2], user (string), parallel_tool_calls (bool),
 *     reasoning_effort, thinking ({"type":"enabled"|"disabled"}),
 *     chat_template_kwargs ({"thinking"|"enable_thinking": bool}),
 *   llama.cpp / vLLM extras: top_k (integer >= -1), min_p [0,1],
 *     repetition_penalty (0,100], ignore_eos (bool), skip_special_tokens
 *     (bool, default true: the special tokens' text is left out of content
 *     and reasoning_content; false keeps it),
 *   cache_salt (vLLM's: a string of 1..256 bytes; requests reuse each other's
 *     cached prefixes only with the same salt -- and, unless the daemon shares
 *     its cache across users, the same peer uid, which the ipc layer passes as
 *     gen.peer_uid),
 *   ds41 test hook: ds41_forced_output (string; the service refuses it unless
 *     its configuration enables test hooks, see ds41_gen_request),
 *   accepted and ignored: store, metadata, service_tier, modalities (only
 *     "text"), prompt_cache_key (the prefix cache is automatic),
 *     safety_identifier, verbosity,
 *   refused with 400 unsupported_parameter when not null: audio, prediction,
 *     web_search_options, functions, function_call (use tools).
 *
 * Thinking.  thinking.type (or chat_template_kwargs.thinking) chooses the
 * mode; reasoning_effort picks the effort of the thinking mode (the model's
 * "Reasoning Effort: N" prefix, N in 1..100) and implies thinking:
 *   "none" -> thinking disabled;   "minimal" -> 25;   "low" -> 50;
 *   "medium" -> 75 (= the model's default, which it calls "high");
 *   "high" -> 75;   "xhigh" / "max" -> 100;   an integer 1..100 -> itself.
 * A conflict (thinking disabled with an effort level, or enabled with
 * "none") is a 400.  Nothing given: the service's default mode.
 *
 * POST /v1/completions accepts: prompt (required: a string, an array of one
 * string, an array of token ids, or an array of one array of token ids),
 * model, suffix (null or "" only), max_tokens (integer >= 1, default 16 as
 * in OpenAI), temperature, top_p, n (1), best_of (1), stream, stream_options,
 * logprobs (integer 0..20: top alternatives per token), echo (string prompts
 * without logprobs), stop, presence_penalty, frequency_penalty, logit_bias,
 * seed, user, top_k, min_p, repetition_penalty, ignore_eos, skip_special_tokens,
 * cache_salt,
 * ds41_forced_output.
 *
 * POST /tokenize: {"model"?, exactly one of "content" | "prompt" (text) |
 * "messages" (chat, with optional "tools", "thinking", "reasoning_effort"),
 * "add_special" | "add_special_tokens" (bool)}.
 * POST /detokenize: {"model"?, "tokens": [ids]}.
 *
 * Streams (Content-Type: text/event-stream) are "data: <json>\n\n" events,
 * each written to the client as soon as the service produces it:
 *   chat: first {"choices":[{"index":0,"delta":{"role":"assistant","content":""},
 *     "logprobs":null,"finish_reason":null}]}, then deltas with "content",
 *     "reasoning_content" or "tool_calls" (OpenAI's shape: the first fragment
 *     of a call has index, id, type "function", function.name and
 *     function.arguments "", later ones index and function.arguments), then
 *     a chunk with "delta":{} and finish_reason (stop, length, tool_calls);
 *   completions: {"choices":[{"index":0,"text":...,"logprobs":...,
 *     "finish_reason":...}]};
 *   with stream_options.include_usage every chunk has "usage":null and a last
 *     chunk has "choices":[] and the usage;
 *   then "data: [DONE]\n\n".  An error after the stream began is sent as
 *   "data: {"error":{...}}\n\n" and the stream ends without [DONE].
 * Usage everywhere: {"prompt_tokens","completion_tokens","total_tokens",
 * "prompt_tokens_details":{"cached_tokens"},"completion_tokens_details":
 * {"reasoning_tokens"}}.  Logprobs: chat {"content":[{"token","logprob",
 * "bytes","top_logprobs":[...]}]} (reasoning tokens under
 * "reasoning_content" beside "content"); completions {"tokens",
 * "token_logprobs","top_logprobs","text_offset" (byte offsets)}.
 *
 * Service errors map to statuses per ds41_svc_status (429 and 503 carry
 * Retry-After).  A client that disconnects while its request runs (streamed
 * or not) makes the api call the service's cancel().
 *
 * Wiring (what the daemon does):
 *     metrics = ds41_http_metrics_new();
 *     ds41_api_new(&service, metrics, &opts, &api, &err);
 *     fd = <socket from systemd> or ds41_listen_unix(path, 0660, group, 128, &l, &err) (daemon/listen.h);
 *     ds41_http_listener l[] = {{.fd = fd}};        // + an optional loopback TCP one
 *     ds41_http_config cfg = {.listeners = l, .n_listeners = 1,
 *                             .has_admin_gid = true, .admin_gid = admin_group};
 *     ds41_http_server_start(&cfg, ds41_api_router(api), &server, &err);
 *     ...                                           // READY=1
 *     ds41_http_server_stop(server, drain_ms);      // SIGTERM: STOPPING=1, drain
 *     <the service delivers the terminal event of every accepted generation>
 *     ds41_api_free(api); ds41_http_metrics_free(metrics); close(fd);
 * A generation's state is freed by its terminal event, so the service must
 * deliver it (or cancel and then deliver it) even after the server stopped;
 * the api itself may be freed once the server is stopped. */
#ifndef DS41_IPC_API_H
#define DS41_IPC_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config/error.h"
#include "ipc/http_server.h"
#include "ipc/service.h"

typedef struct ds41_api_options {
    size_t max_body_bytes;          /* 0 = 32 MiB */
    unsigned completion_max_tokens; /* default max_tokens of /v1/completions; 0 = 16 */
    /* Stored responses of /v1/responses (ipc/response_store.h): their directory (NULL: kept in
     * memory only), total byte cap and age limit in seconds (0 = none). */
    const char *responses_dir;
    uint64_t responses_max_bytes;
    uint64_t responses_max_age_s;
} ds41_api_options;

typedef struct ds41_api ds41_api;

/* Bind the API to a service.  svc is copied (its ctx must outlive the api);
 * metrics may be NULL (then GET /metrics shows only the service's text);
 * opts may be NULL.  Errors: missing required service functions (health,
 * submit, cancel), out of memory. */
int ds41_api_new(const ds41_service *svc, ds41_http_metrics *metrics, const ds41_api_options *opts,
                 ds41_api **out, ds41_error *err);
void ds41_api_free(ds41_api *api);

/* The route table bound to api, for ds41_http_server_start() or
 * ds41_http_dispatch_memory().  Valid until ds41_api_free(). */
const ds41_http_router *ds41_api_router(const ds41_api *api);

/* ------------------------------------------------------ request parsing */

/* A parsed generation request: gen points into the owned storage below. */
typedef struct ds41_api_request {
    ds41_gen_request gen;
    bool include_usage; /* stream_options.include_usage */
    bool echo;          /* completions: prepend the prompt to the text */
    /* owned storage */
    char *model;
    char *messages_json;
    char *tools_json;
    char *tool_choice_json;
    char *response_format_json;
    char *prompt;
    int32_t *prompt_tokens;
    char **stop;
    ds41_svc_logit_bias *logit_bias;
    char *user;
    char *forced_output;
    char *cache_salt;
} ds41_api_request;

/* Parse and validate a /v1/chat/completions or /v1/completions body
 * (body[0..len), not necessarily NUL-terminated).  On success fill *out
 * (free with ds41_api_request_free) and return 0; gen.id and
 * gen.response_id are left for the caller.  On failure return -1 with err
 * filled (status DS41_SVC_BAD_REQUEST, param = the field, code as listed
 * above) and *out empty. */
int ds41_api_parse_chat(const char *body, size_t len, ds41_api_request *out, ds41_svc_error *err);
int ds41_api_parse_completion(const char *body, size_t len, unsigned default_max_tokens,
                              ds41_api_request *out, ds41_svc_error *err);
void ds41_api_request_free(ds41_api_request *r);

/* HTTP status for a service error status (400, 403, 404, 409, 429, 503, 500). */
int ds41_api_http_status(ds41_svc_status status);

#endif
