/* ds41_service: what the daemon implements and the ipc layer calls.
 *
 * The ipc layer (ipc/http_server.h + ipc/api.h) speaks HTTP and JSON; it
 * parses and strictly validates requests, then hands them to a service
 * described by the struct of function pointers below.  The daemon adapts its
 * engine (scheduler, tokenizer, chat encoder, model manager) to this
 * interface; tests use a mock (tests/ipc_mock_service.c).  Nothing here
 * refers to engine types, so either side can change without the other.
 *
 * Threads.  Every function may be called concurrently from many ipc threads
 * (one per HTTP connection).  Generation events (ds41_gen_sink) may be
 * delivered from any thread of the service, including from inside submit()
 * or cancel() themselves; the ipc side is thread-safe for that.
 *
 * Strings.  Every `const char *` handed to the service is NUL-terminated,
 * valid UTF-8 without NUL bytes, and lives only for the duration of the call
 * (copy what you keep).  Strings handed back by the service (in events and
 * list callbacks) are copied by the ipc layer during the call; invalid UTF-8
 * in them is replaced by U+FFFD, never trusted.
 *
 * Errors.  Fallible calls return 0 on success and -1 on failure after
 * filling *err (ds41_svc_fail()); the ipc layer maps err->status to the HTTP
 * status and the OpenAI error shape (see ds41_svc_status).  A NULL function
 * pointer means "not supported": the route answers 501.
 *
 * Security.  The ipc layer never reads files or runs commands for a client.
 * The one request that names a filesystem path is the admin model load
 * (load_model); the service MUST resolve it (realpath) and refuse with
 * DS41_SVC_FORBIDDEN anything outside its configured model directories.
 * Only peers in the admin class reach that call. */
#ifndef DS41_IPC_SERVICE_H
#define DS41_IPC_SERVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------------------------ errors */

/* Outcome classes and the HTTP answer the ipc layer gives for each. */
typedef enum ds41_svc_status {
    DS41_SVC_OK = 0,
    DS41_SVC_BAD_REQUEST,    /* 400 invalid_request_error (bad value the api layer cannot know) */
    DS41_SVC_CONTEXT_LENGTH, /* 400 invalid_request_error, code context_length_exceeded */
    DS41_SVC_FORBIDDEN,      /* 403 permission_error (e.g. model path outside model dirs) */
    DS41_SVC_NOT_FOUND,      /* 404 not_found_error (unknown model: code model_not_found; session) */
    DS41_SVC_CONFLICT,       /* 409 invalid_request_error (model busy, already loading) */
    DS41_SVC_QUEUE_FULL,     /* 429 rate_limit_error + Retry-After: the request queue is full */
    DS41_SVC_KV_FULL,        /* 503 server_error + Retry-After: KV memory cannot hold the request */
    DS41_SVC_UNAVAILABLE,    /* 503 server_error + Retry-After: loading, stopping, no model */
    DS41_SVC_CANCELLED,      /* terminal status after cancel(); never shown to a client */
    DS41_SVC_INTERNAL,       /* 500 server_error */
} ds41_svc_status;

typedef struct ds41_svc_error {
    ds41_svc_status status;
    unsigned retry_after_s; /* 429/503: seconds for Retry-After; 0 = let the ipc layer pick 1 */
    char param[128];        /* the request field at fault ("" = none), e.g. "messages[2].content" */
    char code[48];          /* machine code ("" = derived from status), e.g. "context_length_exceeded" */
    char message[512];      /* one human-readable sentence */
} ds41_svc_error;

/* Fill err (if not NULL): status, param (NULL = none) and a printf-style
 * message; code and retry_after_s are cleared.  Always returns -1. */
int ds41_svc_fail(ds41_svc_error *err, ds41_svc_status status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Cut err's param and message to their longest valid UTF-8 prefix: a field
 * name or a value quoted with %.Ns, or cut by the buffer's size, may end
 * inside a character, and the error goes out as JSON.  ds41_svc_fail and the
 * API's field errors call it. */
void ds41_svc_error_clip_utf8(ds41_svc_error *err);

/* The default machine code for a status ("queue_full", "kv_full", ...). */
const char *ds41_svc_status_code(ds41_svc_status status);

/* ------------------------------------------------------------------ health */

/* GET /health also lists every model of list_models (id, state, detail) in "models". */
typedef enum ds41_health_state {
    DS41_HEALTH_OK = 0,  /* GET /health -> 200 {"status":"ok"}: at least one model serves */
    DS41_HEALTH_LOADING, /* 503 {"status":"loading","detail":...} + Retry-After */
    DS41_HEALTH_ERROR,   /* 503 {"status":"error","detail":...} */
} ds41_health_state;

typedef struct ds41_svc_health {
    ds41_health_state state;
    char detail[256]; /* e.g. "loading shard 17/48"; may be empty */
} ds41_svc_health;

/* ------------------------------------------------------------------ models */

typedef enum ds41_model_state {
    DS41_MODEL_UNLOADED = 0,
    DS41_MODEL_LOADING,
    DS41_MODEL_READY,
    DS41_MODEL_FAILED,
} ds41_model_state;

/* Bytes of one model held in one storage tier ("vram", "ram", "disk", ...). */
typedef struct ds41_svc_tier_bytes {
    const char *tier;
    uint64_t bytes;
} ds41_svc_tier_bytes;

/* How far the last load of a model got (the admin listing's "load" object): state "binding",
 * "placing", "done" or "failed"; tensors and bytes of the model's tensor plan bound so far. */
typedef struct ds41_svc_load {
    const char *state;
    uint64_t bytes_done, bytes_total, tensors_done, tensors_total;
} ds41_svc_load;

typedef struct ds41_svc_model {
    const char *id;   /* served name, e.g. "ds41-tiny" (required) */
    const char *path; /* checkpoint directory (admin listing only; may be NULL) */
    ds41_model_state state;
    int64_t created;         /* unix seconds */
    uint64_t context_length; /* tokens; 0 = unknown */
    const char *detail;      /* progress or failure text; may be NULL */
    const ds41_svc_tier_bytes *tiers;
    size_t n_tiers;
    uint32_t threads; /* CPU threads of its loaded engine (admin listing); 0 = not loaded */
    const ds41_svc_load *load; /* progress of its last load (admin listing); NULL = never loaded */
} ds41_svc_model;

/* List callbacks: the service calls emit(acc, item) once per item, during
 * the list call, from the calling thread.  The ipc layer copies the item. */
typedef void (*ds41_svc_model_emit)(void *acc, const ds41_svc_model *model);

/* ---------------------------------------------------------------- sessions */

/* A session is the engine's unit of KV memory: a running or queued request,
 * or a finished one whose pages are kept for prefix re-use. */
typedef struct ds41_svc_session {
    const char *id; /* stable id, [A-Za-z0-9._-]{1,128} (used by DELETE /admin/sessions/{id}) */
    const char *model;
    const char *state;   /* "queued", "prefill", "decode", "cached", ... */
    uint64_t request_id; /* ds41_gen_request.id of the live request; 0 = none */
    uint64_t prompt_tokens;
    uint64_t generated_tokens;
    uint64_t cached_tokens; /* prompt tokens served from the prefix cache */
    uint64_t kv_tokens;     /* tokens whose KV the session holds */
    uint64_t kv_pages;      /* pages allocated */
    uint64_t kv_bytes;      /* bytes of those pages */
    int64_t created;        /* unix seconds */
    int64_t last_used;      /* unix seconds */
    int64_t owner_uid;      /* uid of the peer whose request it is / made it; -1 = unknown */
} ds41_svc_session;

typedef void (*ds41_svc_session_emit)(void *acc, const ds41_svc_session *session);

/* ------------------------------------------------------------------- cache */

typedef struct ds41_svc_cache_tier {
    const char *name; /* "kv", "prefix", "experts-vram", "experts-ram", "engram", ... */
    uint64_t used_bytes;
    uint64_t capacity_bytes;
    uint64_t hits;
    uint64_t misses;
    /* Streamed tiers (experts, engram), all 0 when not applicable: */
    bool streamed;           /* reads from disk under a budget (false: all resident) */
    uint64_t bytes_read;     /* from the device into the tier */
    uint64_t latency_p50_ns; /* one load, submit to last byte */
    uint64_t latency_p99_ns;
    uint64_t predicted;      /* loads started early by a prediction */
    uint64_t predicted_used; /* of which were then used */
    uint64_t total_bytes;    /* everything the tier could hold (e.g. all routed experts) */
} ds41_svc_cache_tier;

typedef struct ds41_svc_cache {
    uint64_t page_tokens; /* tokens per KV page */
    uint64_t page_bytes;  /* bytes per KV page */
    uint64_t pages_total;
    uint64_t pages_used;
    uint64_t pages_free;
    double bytes_per_token; /* KV bytes per token of context */
    const ds41_svc_cache_tier *tiers;
    size_t n_tiers;
    /* The memory budgets decided at load (engine/serve/auto_budget.h: "budgets: auto -> experts ...
     * streamed with ... budget, ... (available ..., dense ..., KV ...)"), or NULL. */
    const char *budgets;
    /* Whether prefix-cache entries (memory and disk) are shared between peers of different
     * uids (the operator's choice; default not: each uid + cache_salt is its own partition). */
    bool prefix_shared_across_users;
} ds41_svc_cache;

/* --------------------------------------------------------------- snapshots */

/* A session snapshot on disk (the disk tier of the prefix cache). */
typedef struct ds41_svc_snapshot {
    const char *id;    /* "<model>:<name>", [A-Za-z0-9._:-]{1,200} (DELETE /admin/snapshots/{id}) */
    const char *model;
    uint64_t tokens;   /* token ids it holds (the prefix it restores) */
    uint64_t bytes;    /* file size */
    int64_t created;   /* unix seconds */
    int64_t last_used; /* unix seconds */
    bool has_sampler;  /* saved from a running request: the sampler state is included */
    int64_t owner_uid; /* uid of the peer whose request made it (its partition); -1 = unknown */
} ds41_svc_snapshot;

typedef void (*ds41_svc_snapshot_emit)(void *acc, const ds41_svc_snapshot *snapshot);

/* -------------------------------------------------------------- generation */

typedef enum ds41_gen_kind {
    DS41_GEN_CHAT = 1,       /* POST /v1/chat/completions: messages through the chat encoder */
    DS41_GEN_COMPLETION = 2, /* POST /v1/completions: raw prompt text or token ids */
} ds41_gen_kind;

/* Thinking mode as requested; the service decides DEFAULT. */
typedef enum ds41_thinking {
    DS41_THINKING_DEFAULT = 0,
    DS41_THINKING_DISABLED, /* chat mode: header </think>, no reasoning */
    DS41_THINKING_ENABLED,  /* thinking mode: header <think>, reasoning_content streamed */
} ds41_thinking;

typedef struct ds41_opt_double {
    bool set;
    double value;
} ds41_opt_double;

typedef struct ds41_svc_logit_bias {
    int32_t token; /* >= 0; the service rejects ids outside its vocabulary (DS41_SVC_BAD_REQUEST) */
    float bias;    /* in [-100, 100] */
} ds41_svc_logit_bias;

/* A validated generation request (ipc/api.h documents the JSON fields that
 * map here).  Optional numbers come as ds41_opt_double with set=false when
 * the client did not give them (or gave null). */
/* Hints of other servers' clients that a request may carry and ds41 does not act on. */
#define DS41_HINT_CACHE_PROMPT 1u /* llama-server "cache_prompt" (prefixes are always reused) */
#define DS41_HINT_KEEP_ALIVE 2u   /* Ollama "keep_alive" (models stay until unloaded) */

typedef struct ds41_gen_request {
    uint64_t id;             /* unique in this process, assigned by the ipc layer; used by cancel() */
    const char *response_id; /* "chatcmpl-..." / "cmpl-...", as the client will see it */
    ds41_gen_kind kind;
    const char *model; /* requested model name; NULL = the service's default model */

    /* DS41_GEN_CHAT: compact JSON texts, validated and normalized:
     *  messages_json: array of {"role": "system"|"developer"|"user"|"assistant"|"tool",
     *                 "content": string | [{"type":"text","text":string}...] | null,
     *                 optional "name", "tool_call_id" (tool), "reasoning_content" (assistant),
     *                 "prefix": bool (assistant, DeepSeek prefix completion),
     *                 "tool_calls": [{"id","type":"function","function":{"name","arguments"}}]}
     *                 (arguments: string or object, as the client sent it);
     *                 fields the OpenAI SDK echoes back (refusal, annotations, audio:null,
     *                 function_call:null, parsed, parsed_arguments) are dropped.
     *  tools_json: the "tools" array as given (order of keys preserved), or NULL.
     *  tool_choice_json: "none" | "auto" | "required" as a JSON string, or the
     *                 {"type":"function","function":{"name":...}} object; NULL = not given.
     *  response_format_json: {"type":"text"|"json_object"|"json_schema",...} or NULL. */
    const char *messages_json;
    const char *tools_json;
    const char *tool_choice_json;
    const char *response_format_json;
    bool parallel_tool_calls; /* default true */
    ds41_thinking thinking;
    int reasoning_effort; /* 0 = not given, else 1..100 (see ipc/api.h for the mapping) */

    /* DS41_GEN_COMPLETION: exactly one of prompt / prompt_tokens is set. */
    const char *prompt;
    size_t prompt_len;
    const int32_t *prompt_tokens;
    size_t n_prompt_tokens;

    /* sampling */
    ds41_opt_double temperature;        /* [0, 2] */
    ds41_opt_double top_p;              /* [0, 1] */
    int32_t top_k;                      /* 0 = off (-1 is mapped to 0) */
    ds41_opt_double min_p;              /* [0, 1] */
    ds41_opt_double repetition_penalty; /* (0, 100] */
    ds41_opt_double presence_penalty;   /* [-2, 2] */
    ds41_opt_double frequency_penalty;  /* [-2, 2] */
    bool has_seed;
    int64_t seed;
    const ds41_svc_logit_bias *logit_bias;
    size_t n_logit_bias;
    uint32_t max_tokens;     /* 0 = not given: the service's limit (context) applies */
    const char *const *stop; /* stop strings (each non-empty) */
    size_t n_stop;
    bool ignore_eos; /* keep generating past EOS (benchmarks) */
    uint32_t min_tokens;      /* EOS, stop ids and stop strings wait for this many tokens; 0 = none */
    unsigned ignored_hints;   /* DS41_HINT_*: hints the client sent that ds41 accepts and ignores */
    bool keep_special_tokens; /* skip_special_tokens: false (the default strips the special tokens'
                                 text from content and reasoning_content) */
    /* Test hook ("ds41_forced_output"): a text whose tokens (special tokens
     * matched) replace the sampled tokens until it runs out, so tests can make
     * a random-weight model emit reasoning and tool calls.  NULL = not given.
     * A service refuses it (DS41_SVC_BAD_REQUEST) unless configured for tests. */
    const char *forced_output;

    /* output options */
    bool logprobs;    /* deliver per-token logprobs in DELTA events */
    int top_logprobs; /* 0..20 alternatives per token */
    bool stream;      /* informational: the ipc layer handles the transport */
    const char *user; /* end-user id, opaque; may be NULL */

    /* Prefix-cache partition (issue 13): the service may reuse cached state only between
     * requests of the same peer uid (unless configured to share across users) and the same
     * cache_salt.  peer_uid is the SO_PEERCRED uid, filled by the ipc layer (-1: a peer without
     * credentials, e.g. TCP); cache_salt is the client's "cache_salt" (1..256 bytes) or NULL. */
    int64_t peer_uid;
    const char *cache_salt;
} ds41_gen_request;

typedef enum ds41_gen_event_type {
    DS41_GEN_DELTA = 1, /* generated text (content and/or reasoning) + optional logprobs */
    DS41_GEN_TOOL_CALL, /* a fragment of a tool call */
    DS41_GEN_FINISH,    /* terminal: finish reason + usage */
    DS41_GEN_ERROR,     /* terminal: error (status, message) */
} ds41_gen_event_type;

typedef enum ds41_finish_reason {
    DS41_FINISH_STOP = 1,   /* EOS or a stop string */
    DS41_FINISH_LENGTH,     /* max_tokens or context limit */
    DS41_FINISH_TOOL_CALLS, /* the model called tools */
    DS41_FINISH_CANCELLED,  /* after cancel(); never shown to a client */
} ds41_finish_reason;

typedef struct ds41_gen_usage {
    uint64_t prompt_tokens;
    uint64_t completion_tokens; /* including reasoning tokens */
    uint64_t cached_tokens;     /* prompt tokens served from the prefix cache */
    uint64_t reasoning_tokens;
    /* timings (ms, monotonic; never negative): admission to the prompt's logits, then the
     * generated tokens; has_timings false where the service does not measure them */
    bool has_timings;
    double prefill_ms, decode_ms;
} ds41_gen_usage;

typedef struct ds41_gen_top_logprob {
    const char *token; /* the token's bytes (may be a partial UTF-8 sequence) */
    size_t token_len;
    double logprob;
} ds41_gen_top_logprob;

typedef struct ds41_gen_logprob {
    const char *token; /* the sampled token's bytes */
    size_t token_len;
    double logprob;
    const ds41_gen_top_logprob *top;
    size_t n_top;
    bool reasoning; /* the token belongs to the reasoning, not the content */
} ds41_gen_logprob;

/* One event.  Only the fields of its type are read. */
typedef struct ds41_gen_event {
    ds41_gen_event_type type;

    /* DELTA: complete UTF-8 text (the detokenizer holds back partial
     * characters).  Either part may be empty.  logprobs describe the tokens
     * that produced this text, in order. */
    const char *content;
    size_t content_len;
    const char *reasoning;
    size_t reasoning_len;
    const ds41_gen_logprob *logprobs;
    size_t n_logprobs;

    /* TOOL_CALL: tool_index counts calls from 0 in this response.  The first
     * fragment of an index carries the function name (and optionally an id;
     * the ipc layer makes "call_..." ids when it is NULL); later fragments
     * carry only pieces of the arguments JSON text, in order. */
    int tool_index;
    const char *tool_id;
    const char *tool_name;
    const char *arguments;
    size_t arguments_len;

    /* FINISH */
    ds41_finish_reason finish_reason;
    ds41_gen_usage usage;
    bool stop_string;  /* DS41_FINISH_STOP by a stop string: stop[stop_index] of the request */
    size_t stop_index;

    /* ERROR: error.status is the reason (KV_FULL mid-generation, INTERNAL,
     * CANCELLED after cancel, ...). */
    ds41_svc_error error;
} ds41_gen_event;

/* Where a generation's events go.  Provided by the ipc layer per request. */
typedef struct ds41_gen_sink {
    void (*event)(void *sink_ctx, const ds41_gen_event *ev);
    void *sink_ctx;
} ds41_gen_sink;

/* What submit() reports back on acceptance. */
typedef struct ds41_gen_accept {
    char model[128]; /* the served model name that will answer (shown to the client) */
    uint64_t prompt_tokens; /* the prompt's length in tokens, when known (0 = unknown) */
} ds41_gen_accept;

/* ------------------------------------------------------------ tokenization */

typedef struct ds41_tokenize_request {
    const char *model; /* NULL = default model */
    const char *text;  /* raw text mode (messages_json == NULL) */
    size_t text_len;
    bool add_special;          /* add the tokenizer's special tokens (BOS) */
    const char *messages_json; /* chat mode: normalized messages as for generation, or NULL */
    const char *tools_json;    /* chat mode: tools or NULL */
    ds41_thinking thinking;    /* chat mode */
    int reasoning_effort;      /* chat mode, 0 = default */
} ds41_tokenize_request;

/* ----------------------------------------------------------------- service */

typedef struct ds41_service {
    void *ctx;

    /* Required. Fill *out; never fails. */
    void (*health)(void *ctx, ds41_svc_health *out);

    /* Calls emit once per known model (every state).  GET /v1/models shows the
     * READY ones; GET /admin/models shows all, with path and tier bytes. */
    int (*list_models)(void *ctx, ds41_svc_model_emit emit, void *acc, ds41_svc_error *err);

    /* Start a generation.  Admission is decided here, synchronously: a full
     * queue answers DS41_SVC_QUEUE_FULL, memory that cannot hold the request
     * DS41_SVC_KV_FULL, an unknown model DS41_SVC_NOT_FOUND, a too long prompt
     * DS41_SVC_CONTEXT_LENGTH, each with err filled and -1 returned; then no
     * event is ever delivered and the sink is forgotten.
     * On 0 (accepted), fill *accept (before the first event) and deliver,
     * in order and never two at once, any number of DELTA / TOOL_CALL events
     * followed by exactly ONE terminal event (FINISH or ERROR) -- also after cancel(), which may be
     * reported as FINISH with DS41_FINISH_CANCELLED or ERROR with
     * DS41_SVC_CANCELLED.  No call to the sink after the terminal event.
     * Events may be delivered before submit() returns.  req is valid only
     * during the call. */
    int (*submit)(void *ctx, const ds41_gen_request *req, const ds41_gen_sink *sink, ds41_gen_accept *accept,
                  ds41_svc_error *err);

    /* Ask for the generation with this id to stop soon (client gone, server
     * stopping).  Any thread, any time, also concurrently with its events;
     * an unknown or finished id is ignored.  Must not block for long. */
    void (*cancel)(void *ctx, uint64_t request_id);

    /* POST /tokenize: *tokens is malloc()ed by the service and free()d by the
     * ipc layer. */
    int (*tokenize)(void *ctx, const ds41_tokenize_request *req, int32_t **tokens, size_t *n_tokens,
                    ds41_svc_error *err);

    /* POST /detokenize: ids not in the vocabulary -> DS41_SVC_BAD_REQUEST.
     * *text is malloc()ed (UTF-8; invalid sequences are replaced by the ipc). */
    int (*detokenize)(void *ctx, const char *model, const int32_t *tokens, size_t n_tokens, char **text,
                      size_t *text_len, ds41_svc_error *err);

    /* GET /metrics: Prometheus text exposition (malloc()ed); the ipc layer
     * appends its own ds41_http_* series. */
    int (*metrics)(void *ctx, char **text, size_t *text_len, ds41_svc_error *err);

    /* Admin.  load_model: at least one of name / path is non-NULL; path is an
     * absolute path without ".." components (checked by the ipc layer) that the
     * SERVICE must still confine to its configured model directories.
     * Returns 0 when the model is ready, 1 when loading started in the
     * background (202), -1 on error. */
    int (*load_model)(void *ctx, const char *name, const char *path, ds41_svc_error *err);
    int (*unload_model)(void *ctx, const char *name, ds41_svc_error *err);
    int (*list_sessions)(void *ctx, ds41_svc_session_emit emit, void *acc, ds41_svc_error *err);
    int (*delete_session)(void *ctx, const char *id, ds41_svc_error *err);
    /* Calls emit exactly once with the cache statistics (its pointers need
     * to stay valid only during that call). */
    int (*cache_info)(void *ctx, void (*emit)(void *acc, const ds41_svc_cache *cache), void *acc,
                      ds41_svc_error *err);
    /* Session snapshots (NULL: a service without snapshots; the routes answer
     * 501).  list: every snapshot of every loaded model.  save: write the state of session `session_id` (a ds41_svc_session id) to disk and
     * emit the snapshot once (NOT_FOUND: no such session; CONFLICT: snapshots disabled or
     * nothing to save yet).  restore: load snapshot `snapshot_id` into its model's prefix
     * cache; *session_id receives the new cache session's id, *tokens its length (NOT_FOUND;
     * BAD_REQUEST with the reason when the file is refused: corrupted, truncated, other
     * version or model -- it is then deleted).  delete: remove it (NOT_FOUND). */
    int (*list_snapshots)(void *ctx, ds41_svc_snapshot_emit emit, void *acc, ds41_svc_error *err);
    int (*save_snapshot)(void *ctx, const char *session_id, ds41_svc_snapshot_emit emit, void *acc,
                         ds41_svc_error *err);
    int (*restore_snapshot)(void *ctx, const char *snapshot_id, char *session_id, size_t session_id_size,
                            uint64_t *tokens, ds41_svc_error *err);
    int (*delete_snapshot)(void *ctx, const char *snapshot_id, ds41_svc_error *err);
    /* POST /admin/cache/experts: change the routed-expert budget (0 = "auto":
     * the service's automatic choice; ds41d: the one made at load) of model `model` (NULL: every loaded
     * model) at run time; it applies from the next forward step.  Below one expert -> DS41_SVC_BAD_REQUEST
     * naming the minimum; unknown model -> NOT_FOUND. *chosen gets the budget in force from then on (what
     * "auto" chose; with no model named, the default model's; 0 = every routed expert resident). */
    int (*set_expert_budget)(void *ctx, const char *model, uint64_t bytes, uint64_t *chosen,
                             ds41_svc_error *err);
} ds41_service;

#endif
