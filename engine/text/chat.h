/* DeepSeek-V4.1 chat encoding: OpenAI-style messages -> prompt text, and generated text ->
 * assistant message (REFERENCE.md §4 "Prompt encoding" and §11).
 *
 * The authority is the official encoding/encoding.py of DeepSeek-V4.1-Flash at dba1be0a; this
 * module reproduces its encode_messages(..., return_multi_modal_data=True) and
 * parse_message_from_completion_text byte for byte, including its corners (a `null` tool result
 * renders "None", arguments strings are json.loads-ed up to twice, messages of unknown roles before
 * the last user turn vanish in thinking mode, ...).  JSON inside the prompt is Python's
 * json.dumps(ensure_ascii=False), see engine/text/pyjson.h.  The output is text; tokenizing it (special
 * tokens included, no BOS added by the tokenizer) is the tokenizer's job.
 *
 * Errors: where the official encoder raises with a message REFERENCE §11.7 / §11.8 gives, the
 * ds41_error holds exactly that message, unprefixed (e.g. "Unknown role: developer",
 * "Invalid reasoning effort for deepseek_v41: medium, should be int within [1,100] or ['low',
 * 'high', 'max']").  Where Python would fail with a TypeError / KeyError / AttributeError, ds41
 * fails too, with its own message naming the message ("messages[2]: tool_calls[0].function has no
 * 'arguments'").  Messages that quote model text are cut (at a character boundary, ending "...")
 * when the quote would not fit the error buffer.
 *
 * Thread safety: every function is reentrant and may run on several threads at once. */
#ifndef DS41_ENGINE_CHAT_H
#define DS41_ENGINE_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "config/error.h"

/* Special-token texts of the V4.1 prompt format. */
#define DS41_CHAT_BOS "<｜begin▁of▁sentence｜>"
#define DS41_CHAT_EOS "<｜end▁of▁sentence｜>"
#define DS41_CHAT_SYSTEM "<｜System｜>"
#define DS41_CHAT_USER "<｜User｜>"
#define DS41_CHAT_ASSISTANT "<｜Assistant｜>"
#define DS41_CHAT_LATEST_REMINDER "<｜latest_reminder｜>"
#define DS41_CHAT_THINK_START "<think>"
#define DS41_CHAT_THINK_END "</think>"
#define DS41_CHAT_DSML "｜DSML｜"
#define DS41_CHAT_IMAGE "<｜deepseek_image｜>"

typedef enum ds41_chat_mode {
    DS41_CHAT_MODE_CHAT = 0,     /* "chat": every assistant header is <｜Assistant｜></think> */
    DS41_CHAT_MODE_THINKING = 1, /* "thinking": reasoning in <think>...</think>, effort prefix */
} ds41_chat_mode;

/* "chat" / "thinking" -> *mode.  Anything else fails with "Invalid thinking_mode `NAME`". */
int ds41_chat_mode_parse(const char *name, ds41_chat_mode *mode, ds41_error *err);

/* The reasoning effort budget (1..100) of a `reasoning_effort` value: NULL or JSON null -> 75
 * ("high", the default); an integer 1..100 -> itself; "low" -> 50, "high" -> 75, "max" -> 100.
 * Anything else (0, 101, 1.5, true, "medium", ...) fails with "Invalid reasoning effort for
 * deepseek_v41: VALUE, should be int within [1,100] or ['low', 'high', 'max']" (VALUE as Python's
 * str() writes it: True, 1.5, medium). */
int ds41_chat_reasoning_effort(const json_t *effort, int *budget, ds41_error *err);

/* ---- rendering ---- */

/* What to render.  Start from ds41_chat_request_default() and set the fields you need.  All JSON
 * is borrowed (never modified, never kept after the call).
 *
 * messages: array of message objects.  Roles: "system", "user", "assistant", "tool",
 *   "latest_reminder" (any other role is "Unknown role: ROLE" when rendered).  Fields read:
 *   role, content (string, null, or a list of content blocks: {"type":"text","text":...},
 *   {"type":"image_url","image_url":{"url":...} or "..."}, {"type":"image", "url"/"source"/"data":
 *   ...}, others render "[Unsupported TYPE]" in user turns and are dropped elsewhere),
 *   reasoning_content, tool_calls (OpenAI form; "id" orders tool results; "namespace" at call
 *   level or in "function", or a qualified "ns::name"), tool_call_id (tool), tools and
 *   response_format (rendered on system messages), task ("action", "query", "authority",
 *   "domain", "title", "read_url"), wo_eos (assistant turn without its EOS), content_blocks
 *   (V4.1's internal form, honoured as the official encoder does).
 * tools: optional request-level OpenAI tools array.  When truthy it is put on the conversation's
 *   first message if that is a system message, else on a new empty system message put in front
 *   (as vLLM does; REFERENCE §11.1).  The first message is the context's when context is given.
 * response_format: optional request-level response_format, put on the same system message.  The
 *   OpenAI default {"type": "text"} means "no format" and is ignored; anything else truthy is
 *   written as given (§11.2).
 * context: optional array of earlier messages whose text is already in the model's cache: they
 *   are not rendered (and no BOS is added) but decide merging, tool-result order, the think
 *   headers and which reasoning is dropped, exactly as encode_messages(context=...) does.
 * reasoning_effort: see ds41_chat_reasoning_effort; validated whenever a message is rendered,
 *   in chat mode too; its prefix appears only in thinking mode, on message 0 (so never with a
 *   context).
 * drop_thinking: drop the reasoning of assistant turns before the last user turn (thinking mode).
 *   It is forced off when any message (context included) has truthy `tools`.
 * add_bos: begin with DS41_CHAT_BOS (only without a context). */
typedef struct ds41_chat_request {
    const json_t *messages;
    const json_t *tools;
    const json_t *response_format;
    const json_t *context;
    const json_t *reasoning_effort;
    ds41_chat_mode mode;
    bool drop_thinking;
    bool add_bos;
} ds41_chat_request;

/* mode chat, drop_thinking and add_bos true, every JSON field NULL. */
ds41_chat_request ds41_chat_request_default(void);

/* A rendered prompt.  images lists one record per DS41_CHAT_IMAGE placeholder of the rendered
 * messages (not of the context), in prompt order: {"type": "image", "url": ...} for image_url
 * blocks, {"type": "image", plus whichever of "source", "url", "data" the block had} for image
 * blocks.  A caller without vision support refuses a prompt whose images array is not empty. */
typedef struct ds41_chat_prompt {
    char *text; /* NUL-terminated UTF-8 (may contain NUL characters from the input) */
    size_t len; /* bytes, not counting the terminating NUL */
    json_t *images; /* a JSON array (own reference) */
} ds41_chat_prompt;

/* Renders req into *out (release with ds41_chat_prompt_free; *out is zeroed on failure).
 * Field values that are not strings are written as Python's str() writes them, like the official
 * encoder does: a null tool result or reminder "None", true "True", 1.5 "1.5", a JSON object
 * {'k': 'v'} (Python repr); `content or ""` fields (system, user, assistant) render "" when falsy.
 * Errors: the official encoder's messages (§11.8: image placeholder in text, invalid image
 * block, "Unknown role: ...", invalid effort or task, tool-namespace conflicts) and ds41's own
 * where Python would raise a TypeError / KeyError (messages not an array, a message not an object,
 * a tool call without function / name / arguments, tools that are not a list of
 * {"function": {...}} objects, a text block whose text is not a string, content_blocks that are
 * not a list), plus arguments that decode to a lone UTF-16 surrogate, which has no UTF-8 form
 * (Python would fail later, when tokenizing). */
int ds41_chat_render(const ds41_chat_request *req, ds41_chat_prompt *out, ds41_error *err);

void ds41_chat_prompt_free(ds41_chat_prompt *p);

/* ---- parsing generated text ---- */

typedef struct ds41_chat_tool_call {
    char *name; /* bare name: "search::lookup" comes back as name "lookup", namespace "search" */
    size_t name_len;
    char *tool_namespace; /* NULL when the invoked name had no "::" */
    size_t tool_namespace_len;
    char *arguments; /* JSON object text: {"key": value, ...} (values of string="false"
                        parameters are copied raw, so it may be invalid JSON) */
    size_t arguments_len;
} ds41_chat_tool_call;

/* A parsed assistant turn.  Every string is NUL-terminated UTF-8 with its length beside it. */
typedef struct ds41_chat_completion {
    char *reasoning_content; /* "" in chat mode */
    size_t reasoning_content_len;
    char *content;
    size_t content_len;
    ds41_chat_tool_call *tool_calls;
    size_t n_tool_calls;
    bool repaired; /* lenient parser only: the strict parser would have rejected the text */
} ds41_chat_completion;

/* parse_message_from_completion_text(text, mode) (§11.7): the text the model generated after
 * the prompt, including its final DS41_CHAT_EOS.  Strict: any deviation fails with the official
 * message:
 *   "Invalid thinking format: missing </think>", "Invalid format: missing EOS token",
 *   "Tool call format error: expected '>\n' but got '...'" (a literal backslash-n),
 *   "Missing special token in tool calls", "Tool name format error: '...'",
 *   "Parameter format error: '...'", "Parameter format error: expected '>\n' but got '...'",
 *   "Duplicate parameter name: '...'", "Unexpected content after tool calls",
 *   "Unexpected content at end", "Unexpected special token 'TOKEN' in content".
 * Like the official parser it accepts a tool-call block without a final EOS and a last invoke
 * cut off right after its name line.  Text that is not well-formed UTF-8 fails with
 * "completion text is not valid UTF-8 (byte N)" (decode with replacement first, or use the
 * lenient parser).  *out is zeroed on failure; release with ds41_chat_completion_free. */
int ds41_chat_parse_completion(const char *text, size_t len, ds41_chat_mode mode, ds41_chat_completion *out,
                               ds41_error *err);

/* For output that may be cut off (max_tokens, a stop string) or malformed.  Returns the strict
 * result whenever the strict parser accepts the text (repaired = false).  Otherwise it salvages,
 * sets repaired = true and leaves the strict parser's message in *note (if not NULL):
 *   - ill-formed UTF-8 is replaced by U+FFFD (one per maximal ill-formed subpart);
 *   - thinking mode without </think>: reasoning runs to the first tool-call block, EOS or end of
 *     text, and content starts there;
 *   - no EOS: content runs to the end of the text;
 *   - a tool-call block ("\n\n<｜DSML｜ calls" ...) that does not parse completely gives no tool
 *     calls: its raw text (up to an EOS) is appended to content, so nothing the model wrote is
 *     lost and no half-written call is ever returned;
 *   - text between a complete block and the EOS is appended to content;
 *   - text after the first EOS is dropped; special-token texts in content are kept as they are.
 * Fails (-1) only on out of memory or a NULL argument. */
int ds41_chat_parse_completion_lenient(const char *text, size_t len, ds41_chat_mode mode,
                                       ds41_chat_completion *out, ds41_error *note);

void ds41_chat_completion_free(ds41_chat_completion *c);

/* The parsed turn as the official parser returns it, an OpenAI assistant message:
 *   {"role": "assistant", "content": ..., "reasoning_content": ...,
 *    "tool_calls": [{"type": "function", "namespace": NS (only when there is one),
 *                    "function": {"name": ..., "arguments": ...}}, ...]}
 * tool_calls is always present (possibly empty) and has no "id": a server adds ids itself.  The
 * message can be given back as a later request's message or as a context entry: rendering it
 * after the prompt it answered reproduces the generated text when that text was in canonical form
 * (the official round trip).  Returns a new reference, or NULL with err filled (out of memory). */
json_t *ds41_chat_completion_to_message(const ds41_chat_completion *c, ds41_error *err);

#endif
