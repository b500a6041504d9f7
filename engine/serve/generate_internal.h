/* What engine/serve/generate.c and generate_tool_choice.c share (the contract is generate.h):
 * the DSML markers, the splitter / streamer / constraint states and the generation object.
 * generate.c runs one request (prompt, splitter, tool-call streaming, stepping);
 * generate_tool_choice.c is the tool-choice constraint (generate.h "Tool choice"). */
#ifndef DS41_ENGINE_SERVE_GENERATE_INTERNAL_H
#define DS41_ENGINE_SERVE_GENERATE_INTERNAL_H

#include "config/buf.h"
#include "engine/serve/generate.h"
#include "engine/serve/stop.h"
#include "engine/text/json_schema.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* The markers the chat-output splitter watches (REFERENCE §11.7). */
#define TOOL_CALLS_START "\n\n<" DS41_CHAT_DSML " calls"

typedef enum split_state {
    SPLIT_REASONING = 0, /* thinking mode, before </think> */
    SPLIT_CONTENT,
    SPLIT_BLOCK, /* inside a tool-call block: held back until the end */
    SPLIT_DONE,  /* after an EOS text: the parser drops the rest */
} split_state;

/* The parser's DSML stop strings (REFERENCE §11.7; engine/text/chat_parse.c reads until them). */
#define DSML_INVOKE_START "<" DS41_CHAT_DSML " invoke"
#define DSML_INVOKE_END "</" DS41_CHAT_DSML " invoke"
#define DSML_PARAM_START "<" DS41_CHAT_DSML " parameter"
#define DSML_PARAM_END "/" DS41_CHAT_DSML " parameter"
#define DSML_CALLS_END "</" DS41_CHAT_DSML " calls>"

/* Where the tool-call streamer stands in a block (the parser's steps, see generate.h). */
typedef enum block_state {
    BS_CALLS = 0,   /* after "\n\n<｜DSML｜ calls" or an invoke's end: ">\n" + invoke or calls end */
    BS_HEAD,        /* after "<｜DSML｜ invoke": name="..." up to a parameter or the invoke end */
    BS_PARAM_HEAD,  /* after "<｜DSML｜ parameter": name="..." string="true|false"> */
    BS_VALUE,       /* inside a value, streamed up to block_pos */
    BS_AFTER_PARAM, /* after "/｜DSML｜ parameter": ">\n" + parameter or invoke end */
    BS_DONE,        /* after "</｜DSML｜ calls>" */
    BS_STALLED,     /* off the grammar (or a call parallel_tool_calls drops): the final parse decides */
} block_state;

/* A call streamed so far: its name and the arguments text sent. */
typedef struct stream_call {
    char *name;
    size_t name_len;
    ds41_buf args;
    bool released; /* its fragments go out (see generate.h "Tool-call streaming") */
} stream_call;

/* One fragment of this step; its text lives in step_frag_text (offsets: the buffer may move). */
typedef struct frag {
    size_t index;
    bool has_name;
    size_t name_off, name_len;
    size_t args_off, args_len;
} frag;

/* The tool-choice constraint (generate.h "Tool choice"), driven by the bytes of each token. */
typedef enum cstate {
    CS_OFF = 0,
    CS_WAIT_THINK, /* thinking mode: free reasoning (no EOS) until "</think>" */
    CS_LITERAL,    /* one of cands[] must follow */
    CS_VALUE,    /* a parameter value: JSON (or a raw string) of its schema, then "</｜DSML｜ parameter>" */
    CS_EOS_ONLY, /* after "</｜DSML｜ calls>" */
} cstate;

typedef enum lit_kind { LIT_START, LIT_NAME, LIT_AFTER_HEAD, LIT_AFTER_PARAM, LIT_AFTER_INVOKE } lit_kind;

typedef struct ctool {
    char *name;
    ds41_schema *schema; /* its parameters */
} ctool;

typedef struct cand {
    char *text;
    size_t len;
    int next;    /* CS_VALUE, CS_EOS_ONLY or 100 + lit_kind */
    int arg;     /* LIT_NAME -> AFTER_HEAD: the tool; -> VALUE: 2 x the parameter + 1 when raw */
    size_t cost; /* bytes that close the block once text is complete */
    bool fit;    /* this step's budget holds text and its close */
} cand;

typedef struct vstate {
    ds41_json_match m;
    bool content;
    uint8_t end, guard;
} vstate;

#define VALUE_END "</" DS41_CHAT_DSML " parameter>"

enum { M_THINK_END, M_TOOL_CALLS, M_EOS, N_MARKERS };
static const char *const MARKER_TEXT[N_MARKERS] = {DS41_CHAT_THINK_END, TOOL_CALLS_START, DS41_CHAT_EOS};

/* The decoded text of one added token (owned by the tokenizer). */
typedef struct special_text {
    const char *s;
    size_t len;
} special_text;

/* The structured-output constraint (generate.h "Structured output"). */
typedef enum jf_state {
    JF_OFF = 0,
    JF_WAIT_THINK, /* thinking mode: free reasoning (no EOS) until the content starts */
    JF_ON,         /* the content is held to the schema */
} jf_state;

typedef struct jstate {
    ds41_json_match m;
    uint8_t guard; /* bytes of jf_eos the text ends with */
} jstate;

struct ds41_generation {
    const ds41_tokenizer *tok;
    uint32_t n_vocab;
    ds41_generation_prompt_kind kind;
    ds41_chat_mode parse_mode; /* the mode the output is parsed in */
    bool parse_tool_calls;

    char *prompt_text;
    size_t prompt_text_len;

    int32_t *tokens; /* prompt + generated */
    size_t n_tokens, cap_tokens;
    size_t n_prompt;
    size_t n_fed;
    size_t n_cached;
    size_t n_reasoning;
    uint32_t max_context;

    uint32_t *forced;
    size_t n_forced;

    ds41_sampler *sampler;
    ds41_gen_limits limits;
    ds41_stop_matcher *stop;
    ds41_detok *detok;

    /* the generated text T and how far the splitter has decided it */
    ds41_buf text;
    size_t split_pos;
    split_state state;
    ds41_buf all_reasoning, all_content; /* everything split off so far (special tokens' text kept) */

    /* this step's text (special tokens' text dropped when skip_special) */
    ds41_buf step_reasoning, step_content;

    /* skip_special: the text of every added token, dropped from what is returned */
    special_text *specials;
    size_t n_specials;
    uint8_t special_first[32]; /* bit set: some special text starts with that byte */
    size_t strip_pos[2];       /* bytes of all_reasoning / all_content already stripped */

    /* tool-call streaming */
    bool parallel_tool_calls;
    block_state bstate;
    size_t block_pos;  /* absolute position in text the streamer has reached */
    size_t block_start; /* where the tool-call block begins in text (SPLIT_BLOCK) */
    bool value_string; /* the open value is a string="true" one */
    size_t n_params;   /* parameters of the open invoke */
    ds41_buf param_names; /* the open invoke's parameter names, each followed by a NUL */
    stream_call *calls;
    size_t n_calls, cap_calls;
    frag *frags; /* this step's fragments */
    size_t n_frags, cap_frags;
    ds41_buf frag_text;
    ds41_generation_tool_delta *deltas;
    size_t cap_deltas;
    bool frag_oom;

    /* tool-choice constraint */
    cstate cst;
    lit_kind lit;
    cand *cands;
    size_t n_cands;
    ds41_buf cur;  /* bytes of the current literal so far */
    ds41_buf tail; /* the last bytes (WAIT_THINK / VALUE end detection) */
    ctool *ctools;
    size_t n_ctools;
    int ctool_cur;     /* the tool of the open invoke */
    bool *prop_used;   /* per property of ctool_cur */
    size_t n_invokes;  /* invokes the constraint has opened */
    int32_t eos_id;    /* -1: none (or ignore_eos) */
    int32_t silent_eos_id; /* CHAT with ignore_eos: the EOS id, whose text stays out of T; else -1 */
    vstate vs;             /* CS_VALUE: the open value */
    size_t vrest;          /* CS_VALUE: bytes that close the block after the value's end */
    uint32_t byte_tok[256]; /* a token of each single byte (UINT32_MAX: none) */
    uint32_t *cforce;  /* tokens the constraint forces next */
    size_t n_cforce, cforce_pos;
    float *masked;     /* n_vocab logits with the constraint applied */
    uint32_t max_tokens;

    /* structured output (generate_json_format.c) */
    jf_state jf;
    ds41_schema *jf_schema;
    jstate js;        /* JF_ON: the content so far */
    jstate *jf_stack; /* the vocabulary walk's states, one per byte depth */
    size_t jf_depth_cap;
    size_t jf_growth;    /* ds41_schema_step_growth */
    uint8_t jf_fail[64]; /* KMP failure function of the EOS text (the guard) */
    const char *jf_eos;  /* the text the content may not contain (the parser would end there) */
    size_t jf_eos_len;
    uint32_t jf_byte_tok[256]; /* a token of each single byte (UINT32_MAX: none) */
    uint8_t *jf_plain;         /* per token: its bytes are whole UTF-8 characters a string may hold
                                  as they are (no '"', '\\', control character or '<') */

    /* min_tokens: EOS, stop ids and stop strings wait until this many tokens are generated */
    uint32_t min_tokens;

    /* timings (monotonic ns): admitted, the first step (the prompt's logits are there), the last */
    uint64_t t_start, t_first, t_last;
    bool started;

    ds41_generation_finish finish;
    int stop_index; /* DS41_GENERATION_STOP_STRING: which stop string */
    bool has_result;
    ds41_chat_completion result;
};

static inline int oom(ds41_error *err) { return ds41_fail(err, "out of memory"); }

/* The tokens left for this step and the ones after it (SIZE_MAX: no limit). */
static inline size_t ds41_gen_budget_left(const ds41_generation *g) {
    size_t gen = g->n_tokens - g->n_prompt; /* generated before this step */
    size_t left = SIZE_MAX;
    if (g->max_tokens) left = g->max_tokens > gen ? g->max_tokens - gen : 0;
    if (g->max_context) {
        size_t c = g->max_context > g->n_tokens ? g->max_context - g->n_tokens : 0;
        if (c < left) left = c;
    }
    return left;
}

/* The generation's n_vocab buffer for masked logits (allocated on first use; NULL: no memory). */
static inline float *ds41_gen_masked(ds41_generation *g) {
    if (!g->masked) g->masked = malloc((size_t)g->n_vocab * sizeof *g->masked);
    return g->masked;
}

/* logits with EOS masked (a constraint waiting for the reasoning to end), or logits itself when
 * nothing else is left or memory is short (generate.c). */
const float *ds41_gen_without_eos(ds41_generation *g, const float *logits);

/* ---- the structured-output constraint (generate_json_format.c) ---- */

/* Compiles params->response_format (json_object / json_schema) and arms the constraint; nothing
 * for text or none, or when the tool-choice constraint holds the output. */
int ds41_json_format_setup(ds41_generation *g, const ds41_generation_params *p, bool prefix, ds41_error *err);
void ds41_json_format_free(ds41_generation *g);
/* Before each step: force the document's shortest close when the budget would no longer hold it. */
void ds41_json_format_budget(ds41_generation *g);
/* The logits under the constraint (NULL: its close is forced from this step; see cforce). */
const float *ds41_json_format_logits(ds41_generation *g, const float *logits);
/* After each step (the splitter has run): the token's bytes through the matcher. */
void ds41_json_format_token(ds41_generation *g, uint32_t token, bool emitted);

/* ---- the tool-choice constraint (generate_tool_choice.c) ---- */

/* Frees the constraint's tools (their names and parameter schemas). */
void ds41_tool_choice_free(ds41_generation *g);
/* Drops the candidates of the current literal state. */
void ds41_tool_choice_clear(ds41_generation *g);
/* The tools the constraint may call, from the request's tools array and tool_choice. */
int ds41_tool_choice_setup(ds41_generation *g, const ds41_generation_params *p, ds41_error *err);
/* One generated byte through the constraint. */
void ds41_tool_choice_byte(ds41_generation *g, char c);
/* Before each step: close the block when the token budget would no longer hold it. */
void ds41_tool_choice_budget(ds41_generation *g);
/* The logits the sampler sees under the constraint (logits itself when it does not apply). */
const float *ds41_tool_choice_logits(ds41_generation *g, const float *logits);

#endif
