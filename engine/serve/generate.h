/* ds41_generation: one request's generation, from the request to the final message, as a state
 * machine that never runs the model itself.
 *
 * The caller (the offline generator ds41-generate, the daemon's scheduler) owns the forward
 * pass: it batches many generations per ds41_forward call.  A generation tells it which token ids
 * still have to go through the model and turns the logits of the last position into the next
 * token and the text events a client sees:
 *
 *     g = ds41_generation_new(tokenizer, &params, n_vocab)      render + tokenize the prompt
 *     loop:
 *         n = ds41_generation_pending(g, &ids)                    ids not yet fed (prompt, then
 *         feed a chunk ids[0..k) (k <= n) to the model;            one token per step)
 *         ds41_generation_mark_fed(g, k)
 *         if ds41_generation_wants_logits(g):                      everything fed, not finished
 *             ds41_generation_step(g, logits_of_last_position, scratch, &step)
 *             ... step.reasoning / step.content / step.tool_calls / step.finished ...
 *
 * A prefix cache that already holds the KV of the first k prompt ids calls
 * ds41_generation_mark_cached(g, k) instead of feeding them (usage reports them as
 * cached_tokens).
 *
 * Prompts.  CHAT renders OpenAI-style messages with the V4.1 chat encoding (engine/text/chat.h) in
 * chat or thinking mode and tokenizes the text (special tokens matched, BOS from the text);
 * "developer" messages are rendered as "system" (OpenAI's newer name for it); a last assistant
 * message with "prefix": true is continued (rendered without its EOS; DeepSeek's prefix
 * completion).  RAW tokenizes the text exactly as given (no BOS added: V4.1's tokenizer adds
 * none); IDS takes token ids as they are.
 *
 * Tokens.  Each step samples with engine/serve/sampler.h (or takes the next forced token, see below),
 * then checks engine/serve/stop.h's limits in this order: an EOS (the tokenizer_config.json eos_token
 * when the vocabulary has it, else the id of "<｜end▁of▁sentence｜>"; unless ignore_eos) or a stop token
 * id ends generation without emitting the token ("stop"); the max_tokens-th token, or a token
 * that fills the context (prompt + generated = max_context), is emitted and ends it ("length").
 * Every generated token counts in completion_tokens, a final EOS too.
 *
 * Text.  Emitted tokens go through the streaming detokenizer (never a partial UTF-8 sequence),
 * then the stop-string matcher (a completed stop string ends generation, its text and anything
 * after it never appear), giving the generated text T.  A CHAT generation with ignore_eos
 * leaves the EOS tokens it generates past out of T (their text would end the parsed message and
 * hide every later token).  RAW and IDS prompts stream T as content.  CHAT splits T the way the V4.1 parser
 * does (REFERENCE §11.7, the lenient parser of engine/text/chat.h), while it streams:
 *   - thinking mode: reasoning until the first of "</think>", a tool-call block
 *     ("\n\n<｜DSML｜ calls") or an EOS text; "</think>" itself is dropped;
 *   - then content until the first of an EOS text or a tool-call block;
 *   - a tool-call block never reaches reasoning or content while it is generated: it is
 *     streamed as tool-call fragments (tool_deltas, below) and decided on the complete text at
 *     the end (a malformed or cut-off block becomes content, as the lenient parser has it).
 * Text that might be the beginning of one of those markers is held back until it is decided.
 * When generation ends, T (plus the EOS text when it ended on EOS) is parsed with the strict
 * parser, falling back to the lenient one; the final step delivers whatever of that parse's
 * reasoning_content and content was not streamed yet, and its tool calls.  So the concatenation
 * of every step's reasoning (content) equals the final message's reasoning_content (content),
 * byte for byte, however the text was cut into tokens.
 *
 * Special tokens.  With skip_special, the text of every added token of the tokenizer (V4.1's
 * control tokens: <｜Assistant｜>, <think>, </think>, ｜DSML｜, <｜safety｜>, the EOS...; its
 * tokenizer.json marks only a few of them "special", all are control tokens) is dropped from the
 * streamed reasoning / content and from the final message's reasoning_content / content, wherever
 * it appears (the longest match at each position).  The splitting and the parse above still see
 * T whole: the markers they need are special tokens.  Text that may still become a special
 * token's text is held back like a marker prefix, so a special token is never streamed in part
 * and the concatenation rule above holds for the stripped text.  RAW / IDS prompts also drop the
 * tokens marked special before the stop strings see the text (as HF's decode(skip_special)).
 * Tool-call arguments are left as they are.
 *
 * Tool-call streaming.  While a block is generated it is scanned with the strict parser's rules
 * (REFERENCE §11.7) and streamed the way OpenAI and vLLM stream tool calls: a call's first
 * fragment carries its index and bare name with empty arguments, the next its arguments JSON text,
 * written the way the parser writes them ({"key": "string value", "key2": raw}).  A call goes out
 * only once its invoke is complete ("</｜DSML｜ invoke") and its arguments are valid JSON, and only
 * after every call before it went out, so a stream cut off later never holds a call the parsed
 * message lacks.  When the block deviates from the grammar the scanner stops there.  The final
 * step completes every streamed call and streams the calls not streamed yet, from the final
 * parse, so the concatenation of a call's fragments equals that call's arguments in the parsed
 * message, which is the same as without streaming.  Only when a stop string or an abort cuts a
 * block, or the block is malformed further on, can calls already sent be missing from the final
 * parse (whose finish_reason is then "stop" / "abort", and the block's text is content).
 *
 * Cut off (max_tokens, the context).  A tool-call block cut off never reaches content: when the
 * parser cannot take it whole, its calls are its complete invokes (the longest cut after an
 * invoke's end that parses), up to the first whose arguments are not valid JSON, and the rest of
 * the block is dropped; finish_reason is "length".  Without a block, content that ends in the
 * start of one ("\n\n<" and longer) loses that end.  Streamed and not streamed agree.
 *
 * Tool choice (CHAT).  TOOL_CHOICE_AUTO leaves the model free.  REQUIRED and NAMED constrain
 * the output to a DSML tool call: from the start of the content (in thinking mode: after the
 * model's "</think>"; the reasoning stays free, but EOS is masked there) only tokens whose bytes
 * continue the grammar are allowed (the others' logits are set to -inf before sampling, so
 * logprobs describe the masked distribution, as with other guided-decoding servers):
 *     "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"" NAME "\">\n"      NAME: a tool of `tools`
 *                                                                     (NAMED: that one)
 *     then any number of  "<｜DSML｜ parameter name=\"" P "\" string=\"true|false\">" VALUE
 *                         "</｜DSML｜ parameter>\n"    P: a property of the tool's parameters
 *                         schema not used yet (engine/text/json_schema.h, compiled here: a schema
 *                         outside the subset is an error); string="true" when its schema allows
 *                         strings (VALUE: the string's raw text, one of its enum strings if it
 *                         has an enum), string="false" when it allows another type (VALUE: JSON
 *                         of the schema: types, enums, items, nested required properties)
 *     then "</｜DSML｜ invoke>\n" once every required property is there, then
 *     (parallel_tool_calls) another invoke or "</｜DSML｜ calls>", then only EOS.
 * So the parsed arguments are JSON matching the schema.  A token may not run past the end of the
 * literal or value it is in; a VALUE never contains "｜DSML｜".  Tokens are checked by their bytes
 * against the grammar, every token each step (O(vocabulary x token length); the ones whose first
 * byte cannot follow are skipped at once).  Budget: the bytes of the shortest valid close from
 * the current point (the open value's shortest completion, the missing required parameters with
 * their shortest values, the invoke's and block's ends) bound its tokens; a token is allowed only
 * when its close and an EOS still fit after it, and when the budget holds no more than the close,
 * the close's canonical tokens (byte tokens where the text begins inside a UTF-8 sequence) and EOS
 * are forced, so a call is made even by a model that never ends its value (a random-weight one);
 * a max_tokens too small for the name line and the shortest close cuts the call off.  Forced
 * output (below) overrides the constraint; a forced token that leaves the grammar ends it.
 * tool_choice "none" is the caller's: it renders no tools and sets parse_tool_calls false.
 * parallel_tool_calls false keeps the first call only (the parsed message and the stream; under
 * REQUIRED / NAMED the grammar closes the block after one invoke).
 *
 * Structured output (CHAT).  params.response_format {"type": "json_object"} / "json_schema"
 * (engine/text/json_schema.h ds41_schema_compile_format: chat's and the Responses API's shapes;
 * a schema outside the subset is an error starting "response_format") holds the content to one
 * JSON document of the schema: from the start of the content (thinking mode: after "</think>";
 * EOS is masked in the reasoning) every token whose bytes cannot continue a valid document is
 * masked (-inf) before sampling, EOS is allowed once the document is complete and is the only
 * token once it cannot grow, and when the budget (max_tokens, the context) would no longer hold
 * the document's shortest close plus EOS, the close is forced one token per byte, then EOS.  The
 * matcher allows at most 2 whitespace bytes in a row and strings of at most 512 bytes, and the
 * content never holds the EOS text.  Not applied with a REQUIRED / NAMED tool choice (that
 * constraint holds the output), to a continued assistant message (prefix), or when a forced
 * token leaves the document; with ignore_eos it ends once the document is complete.  Cost per
 * step: a walk of the vocabulary in byte order (ds41_tokenizer_byte_order: a shared prefix is fed
 * once, the tokens below a dead prefix are skipped), and inside a string a plain token (whole
 * UTF-8 characters without '"', '\\', controls or '<') is taken without feeding its bytes.
 *
 * Forced output (tests only).  params.forced_ids makes the first n_forced generated tokens those
 * ids instead of samples (the logits are still required, checked and, with logprobs, described);
 * limits, stop strings, text splitting and the final parse treat them like sampled tokens.  This
 * is how tests make a random-weight model emit "</think>" and a DSML tool call.  The daemon
 * accepts it only when its configuration enables test hooks.
 *
 * Errors are ds41_error messages naming the field ("messages[2]: ...", "logit_bias: token 5000
 * outside the vocabulary (1024)", "prompt is empty", "prompt of 70000 tokens exceeds the context
 * (65536)").
 *
 * Threads: a generation belongs to one thread at a time; the tokenizer it borrows may be shared
 * (it is immutable). */
#ifndef DS41_ENGINE_GENERATE_H
#define DS41_ENGINE_GENERATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "config/error.h"
#include "engine/text/chat.h"
#include "engine/serve/sampler.h"
#include "engine/text/tokenizer.h"

typedef enum ds41_generation_prompt_kind {
    DS41_GENERATION_CHAT = 0, /* messages through the V4.1 chat encoding */
    DS41_GENERATION_RAW,      /* text tokenized as given */
    DS41_GENERATION_IDS,      /* token ids as given */
} ds41_generation_prompt_kind;

/* Why a generation ended. */
typedef enum ds41_generation_finish {
    DS41_GENERATION_RUNNING = 0,
    DS41_GENERATION_EOS,         /* the EOS token ("stop") */
    DS41_GENERATION_STOP_TOKEN,  /* a stop token id ("stop") */
    DS41_GENERATION_STOP_STRING, /* a stop string completed ("stop") */
    DS41_GENERATION_MAX_TOKENS,  /* max_tokens generated ("length") */
    DS41_GENERATION_CONTEXT,     /* prompt + generated reached max_context ("length") */
    DS41_GENERATION_ABORTED,     /* ds41_generation_abort (cancelled, server error) */
} ds41_generation_finish;

/* tool_choice (see "Tool choice" above). */
typedef enum ds41_generation_tool_choice {
    DS41_GENERATION_TOOL_CHOICE_AUTO = 0,
    DS41_GENERATION_TOOL_CHOICE_REQUIRED, /* some tool of params.tools */
    DS41_GENERATION_TOOL_CHOICE_NAMED,    /* params.tool_choice_name */
} ds41_generation_tool_choice;

/* What a request asks for.  Everything is borrowed for the duration of ds41_generation_new
 * (copied where kept).  Start from ds41_generation_params_default(). */
typedef struct ds41_generation_params {
    ds41_generation_prompt_kind kind;

    /* CHAT */
    const json_t *messages;        /* array of message objects (engine/text/chat.h) */
    const json_t *tools;           /* OpenAI tools array or NULL */
    const json_t *response_format; /* or NULL */
    bool thinking;                 /* thinking mode (reasoning in <think>...</think>) */
    int reasoning_effort;          /* thinking mode's effort 1..100; 0 = the model's default (75) */
    bool parse_tool_calls;         /* CHAT: split DSML tool-call blocks into tool calls (default true) */
    ds41_generation_tool_choice tool_choice; /* CHAT with tools: see "Tool choice" above */
    const char *tool_choice_name;  /* NAMED: the function's name (one of tools') */
    bool parallel_tool_calls;      /* default true; false: the first call only */

    /* RAW: text[0..text_len) (any bytes; invalid UTF-8 is encoded as U+FFFD) */
    const char *text;
    size_t text_len;

    /* IDS */
    const uint32_t *ids;
    size_t n_ids;

    /* sampling (logit_bias and the rest as in engine/serve/sampler.h) */
    ds41_sampler_params sampler;

    /* ending */
    const char *const *stop; /* n_stop stop strings (valid UTF-8, non-empty) */
    const size_t *stop_lens; /* their lengths; NULL = strlen */
    size_t n_stop;
    const uint32_t *stop_ids; /* stop token ids */
    uint32_t n_stop_ids;
    uint32_t max_tokens;  /* generated tokens; 0 = no limit but the context */
    uint32_t max_context; /* prompt + generated tokens; 0 = no limit */
    bool ignore_eos;      /* EOS is generated past like any token (benchmarks); in CHAT its text
                             stays out of T (see "Text") */
    bool skip_special;    /* drop the special tokens' text from what is returned (see "Special
                             tokens"); false keeps it (the daemon's skip_special_tokens: false) */
    uint32_t min_tokens;  /* EOS and stop ids are masked, and stop strings not looked for, until
                             this many tokens are generated (unless a constraint allows only the
                             end); 0 = none */

    /* tests only: the first generated tokens */
    const uint32_t *forced_ids;
    size_t n_forced;
} ds41_generation_params;

/* kind CHAT, chat mode, parse_tool_calls and parallel_tool_calls true, tool choice AUTO, ds41_sampler_params_default(), nothing else. */
ds41_generation_params ds41_generation_params_default(void);

typedef struct ds41_generation ds41_generation;

/* One tool-call fragment (see "Tool-call streaming" above).  name is set (bare name, as in
 * ds41_chat_tool_call; NUL-terminated) on a call's first fragment only, with arguments_len 0. */
typedef struct ds41_generation_tool_delta {
    size_t index; /* the call's index in the response, from 0 */
    const char *name;
    size_t name_len;
    const char *arguments; /* a piece of the arguments JSON text */
    size_t arguments_len;
} ds41_generation_tool_delta;

/* What one step produced.  Pointers are owned by the generation and valid until its next call. */
typedef struct ds41_generation_delta {
    uint32_t token;       /* the token generated at this step */
    bool forced;          /* it came from forced_ids */
    bool emitted;         /* its text is part of the output (false for a final EOS / stop id) */
    bool reasoning_token; /* it was generated while the reasoning was open (thinking mode) */
    ds41_sample_result sample; /* token, logprob and alternatives (when params asked for logprobs) */

    /* Text that became final at this step (valid UTF-8; either may be empty). */
    const char *reasoning;
    size_t reasoning_len;
    const char *content;
    size_t content_len;

    /* Final step only (CHAT): the parsed tool calls (whole; a server that does not stream
     * uses these). */
    const ds41_chat_tool_call *tool_calls;
    size_t n_tool_calls;

    /* Tool-call fragments that became final at this step, in order (CHAT). */
    const ds41_generation_tool_delta *tool_deltas;
    size_t n_tool_deltas;

    bool finished;
    ds41_generation_finish finish;
} ds41_generation_delta;

/* Render and tokenize the prompt and set up sampling, stopping and the tool-choice constraint.  tok is borrowed and must
 * outlive the generation; n_vocab is the model's vocabulary size (token ids, logit_bias and
 * forced ids must be below it).  Errors (nothing allocated, *out NULL): a bad message list or
 * effort (engine/text/chat.h's messages), images (not supported), an empty prompt, a prompt id >=
 * n_vocab, a prompt that leaves no room in max_context, bad sampler parameters, bad stop
 * strings, too many stop ids, a REQUIRED / NAMED tool choice without tools (or NAMED naming
 * none of them), out of memory. */
int ds41_generation_new(const ds41_tokenizer *tok, const ds41_generation_params *params, uint32_t n_vocab,
                        ds41_generation **out, ds41_error *err);
void ds41_generation_free(ds41_generation *g);

/* The prompt and generated tokens so far (prompt first); int32 as ds41_forward takes them. */
const int32_t *ds41_generation_tokens(const ds41_generation *g, size_t *n);
size_t ds41_generation_prompt_tokens(const ds41_generation *g);
size_t ds41_generation_completion_tokens(const ds41_generation *g); /* generated, a final EOS included */
size_t ds41_generation_reasoning_tokens(const ds41_generation *g);
size_t ds41_generation_cached_tokens(const ds41_generation *g);
/* The limits it was made with (0 = none): generated tokens, prompt + generated tokens. */
uint32_t ds41_generation_max_tokens(const ds41_generation *g);
uint32_t ds41_generation_max_context(const ds41_generation *g);

/* Timings: the scheduler marks when the request was admitted (before that, the creation counts);
 * prefill_ms runs from then to the first step (the prompt's logits), decode_ms from the first
 * step's start to the last step's end (every generated token).  Monotonic clock; 0 before. */
void ds41_generation_mark_started(ds41_generation *g);
void ds41_generation_timings(const ds41_generation *g, double *prefill_ms, double *decode_ms);

/* The rendered prompt text (CHAT and RAW; "" for IDS), NUL-terminated. */
const char *ds41_generation_prompt_text(const ds41_generation *g, size_t *len);

/* Tokens not yet fed to the model: *ids points at them (valid until the next step).  0 while
 * the generation waits for logits, and once it has finished. */
size_t ds41_generation_pending(const ds41_generation *g, const int32_t **ids);
/* n of the pending tokens went through the model (n <= pending). */
void ds41_generation_mark_fed(ds41_generation *g, size_t n);
/* The first n prompt tokens come from a prefix cache: like mark_fed, and counted as cached.
 * Only before anything was fed; n < the prompt length (the last prompt token must go through
 * the model to give logits).  Returns 0 / -1 (err says why; nothing changes). */
int ds41_generation_mark_cached(ds41_generation *g, size_t n, ds41_error *err);
/* Every token is fed and the generation has not finished: the next step needs the logits of
 * the last fed position. */
bool ds41_generation_wants_logits(const ds41_generation *g);

/* Sample (or force) the next token from logits[n_vocab] of the last fed position and advance the
 * text.  scratch is the caller's sampler scratch (one per thread, for at least n_vocab).  Fills
 * *out.  Errors (the generation unchanged, except that a sampler PRNG draw may have happened):
 * called when wants_logits is false, NaN / +inf logits, out of memory. */
int ds41_generation_step(ds41_generation *g, const float *logits, ds41_sampler_scratch *scratch,
                         ds41_generation_delta *out, ds41_error *err);

/* ds41_generation_step for a position whose next token a draft guessed (speculative decoding,
 * engine/serve/speculative.h): the same step, except that the sample is
 * ds41_sampler_sample_draft's (q as there: NULL = a deterministic draft) so the token keeps the
 * distribution of plain sampling; greedy gives exactly the plain step's token.  Forced tokens
 * (tests, constraints) are taken as usual.  *accepted: the step's token is the draft (then the
 * position after it, which the verification fed too, may be stepped next once the caller marks
 * it fed).  A rejected draft leaves no state here: nothing of it was recorded. */
int ds41_generation_step_draft(ds41_generation *g, const float *logits, ds41_sampler_scratch *scratch,
                               uint32_t draft, const float *q, ds41_generation_delta *out, bool *accepted,
                               ds41_error *err);
/* End now (client gone, server stopping, out of KV memory): like a finish by a stop string at
 * this point, so *out (if not NULL) delivers the held-back text and the parse of what was
 * generated.  No-op (out->finished with the earlier reason, no text) once finished. */
int ds41_generation_abort(ds41_generation *g, ds41_generation_delta *out, ds41_error *err);

bool ds41_generation_finished(const ds41_generation *g);
ds41_generation_finish ds41_generation_finish_reason(const ds41_generation *g);
/* "stop", "length" or "tool_calls" (a CHAT that ended on EOS/stop with tool calls); "abort". */
const char *ds41_generation_finish_name(const ds41_generation *g);
/* After a DS41_GENERATION_STOP_STRING finish: the index of the stop string that ended it; else -1. */
int ds41_generation_stop_index(const ds41_generation *g);

/* The whole generated text T (after stop strings; no final EOS), NUL-terminated. */
const char *ds41_generation_text(const ds41_generation *g, size_t *len);
/* After the finish: the parsed assistant turn (CHAT: reasoning_content, content, tool_calls;
 * RAW / IDS: content = T).  NULL before. */
const ds41_chat_completion *ds41_generation_result(const ds41_generation *g);
/* The generation's sampler (its state can be snapshotted: ds41_sampler_snapshot). */
const ds41_sampler *ds41_generation_sampler(const ds41_generation *g);
/* The seed the sampler uses (the given one, or the one drawn). */
uint64_t ds41_generation_seed(const ds41_generation *g);

#endif
