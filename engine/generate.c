/* One request's generation as a state machine (see generate.h). */
#include "engine/generate.h"

#include "engine/pyjson.h"
#include "engine/stop.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The markers the chat-output splitter watches (REFERENCE §11.7). */
#define TOOL_CALLS_START "\n\n<" DS41_CHAT_DSML " calls"

typedef enum split_state {
    SPLIT_REASONING = 0, /* thinking mode, before </think> */
    SPLIT_CONTENT,
    SPLIT_BLOCK, /* inside a tool-call block: held back until the end */
    SPLIT_DONE,  /* after an EOS text: the parser drops the rest */
} split_state;

enum { M_THINK_END, M_TOOL_CALLS, M_EOS, N_MARKERS };
static const char *const MARKER_TEXT[N_MARKERS] = {DS41_CHAT_THINK_END, TOOL_CALLS_START, DS41_CHAT_EOS};

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
    ds41_buf all_reasoning, all_content; /* everything streamed so far */

    /* this step's text */
    ds41_buf step_reasoning, step_content;

    ds41_generation_finish finish;
    bool has_result;
    ds41_chat_completion result;
};

ds41_generation_params ds41_generation_params_default(void) {
    ds41_generation_params p;
    memset(&p, 0, sizeof p);
    p.kind = DS41_GENERATION_CHAT;
    p.parse_tool_calls = true;
    p.sampler = ds41_sampler_params_default();
    return p;
}

static int oom(ds41_error *err) { return ds41_fail(err, "out of memory"); }

static int push_token(ds41_generation *g, int32_t id) {
    if (g->n_tokens == g->cap_tokens) {
        size_t nc = g->cap_tokens ? g->cap_tokens * 2 : 256;
        int32_t *nt = realloc(g->tokens, nc * sizeof *nt);
        if (!nt) return -1;
        g->tokens = nt;
        g->cap_tokens = nc;
    }
    g->tokens[g->n_tokens++] = id;
    return 0;
}

/* ---- prompt ------------------------------------------------------------------------------ */

/* The request's messages as the encoder takes them: "developer" is "system", and a last
 * assistant message with "prefix": true is rendered without its EOS (continued).  Returns a new
 * array; *prefix tells whether the last message is continued. */
static json_t *prepare_messages(const json_t *messages, bool *prefix, ds41_error *err) {
    *prefix = false;
    if (!json_is_array(messages)) {
        ds41_fail(err, "messages: expected an array");
        return NULL;
    }
    json_t *list = json_deep_copy(messages);
    if (!list) {
        oom(err);
        return NULL;
    }
    size_t n = json_array_size(list);
    for (size_t i = 0; i < n; i++) {
        json_t *msg = json_array_get(list, i);
        if (!json_is_object(msg)) continue; /* the encoder names it */
        const char *role = json_string_value(json_object_get(msg, "role"));
        if (role && strcmp(role, "developer") == 0 && json_object_set_new(msg, "role", json_string("system")) != 0)
            goto fail;
        json_t *pf = json_object_get(msg, "prefix");
        if (pf) {
            bool continued = json_is_true(pf) && i + 1 == n && role && strcmp(role, "assistant") == 0;
            if (json_object_del(msg, "prefix") != 0) goto fail;
            if (continued) {
                if (json_object_set_new(msg, "wo_eos", json_true()) != 0) goto fail;
                *prefix = true;
            }
        }
    }
    return list;
fail:
    json_decref(list);
    oom(err);
    return NULL;
}

static int render_chat(ds41_generation *g, const ds41_generation_params *p, bool *prefix, ds41_error *err) {
    json_t *messages = prepare_messages(p->messages, prefix, err);
    if (!messages) return -1;
    ds41_chat_request req = ds41_chat_request_default();
    req.messages = messages;
    req.tools = p->tools;
    req.response_format = p->response_format;
    req.mode = p->thinking ? DS41_CHAT_MODE_THINKING : DS41_CHAT_MODE_CHAT;
    json_t *effort = NULL;
    if (p->reasoning_effort != 0) {
        effort = json_integer(p->reasoning_effort);
        if (!effort) {
            json_decref(messages);
            return oom(err);
        }
        req.reasoning_effort = effort;
    }
    ds41_chat_prompt prompt;
    int rc = ds41_chat_render(&req, &prompt, err);
    json_decref(messages);
    json_decref(effort);
    if (rc != 0) return -1;
    if (json_array_size(prompt.images) > 0) {
        ds41_chat_prompt_free(&prompt);
        return ds41_fail(err, "messages: image content is not supported by this model");
    }
    g->prompt_text = prompt.text;
    g->prompt_text_len = prompt.len;
    prompt.text = NULL;
    ds41_chat_prompt_free(&prompt);
    return 0;
}

static int tokenize_prompt(ds41_generation *g, const char *text, size_t len, ds41_error *err) {
    ds41_token_ids ids = {0};
    if (ds41_tokenizer_encode(g->tok, text, len, &ids, err) != 0) {
        ds41_token_ids_free(&ids);
        return ds41_error_prefix(err, "prompt");
    }
    for (size_t i = 0; i < ids.n; i++) {
        if (ids.ids[i] >= g->n_vocab) {
            uint32_t bad = ids.ids[i];
            ds41_token_ids_free(&ids);
            return ds41_fail(err, "prompt: token %u is outside the model's vocabulary (%u)", bad, g->n_vocab);
        }
        if (push_token(g, (int32_t)ids.ids[i]) != 0) {
            ds41_token_ids_free(&ids);
            return oom(err);
        }
    }
    ds41_token_ids_free(&ids);
    return 0;
}

/* ---- setup --------------------------------------------------------------------------------- */

int ds41_generation_new(const ds41_tokenizer *tok, const ds41_generation_params *p, uint32_t n_vocab,
                        ds41_generation **out, ds41_error *err) {
    if (!out) return ds41_fail(err, "generation: no output");
    *out = NULL;
    if (!tok || !p) return ds41_fail(err, "generation: no tokenizer or parameters");
    if (n_vocab == 0 || n_vocab > DS41_SAMPLER_MAX_VOCAB) return ds41_fail(err, "generation: bad vocabulary size %u", n_vocab);
    ds41_generation *g = calloc(1, sizeof *g);
    if (!g) return oom(err);
    g->tok = tok;
    g->n_vocab = n_vocab;
    g->kind = p->kind;
    g->max_context = p->max_context;
    g->parse_tool_calls = p->kind == DS41_GENERATION_CHAT && p->parse_tool_calls;

    bool prefix = false;
    switch (p->kind) {
    case DS41_GENERATION_CHAT:
        if (render_chat(g, p, &prefix, err) != 0) goto fail;
        if (tokenize_prompt(g, g->prompt_text, g->prompt_text_len, err) != 0) goto fail;
        break;
    case DS41_GENERATION_RAW:
        if (!p->text && p->text_len) {
            ds41_fail(err, "prompt: no text");
            goto fail;
        }
        g->prompt_text = malloc(p->text_len + 1);
        if (!g->prompt_text) {
            oom(err);
            goto fail;
        }
        if (p->text_len) memcpy(g->prompt_text, p->text, p->text_len);
        g->prompt_text[p->text_len] = 0;
        g->prompt_text_len = p->text_len;
        if (tokenize_prompt(g, p->text, p->text_len, err) != 0) goto fail;
        break;
    case DS41_GENERATION_IDS:
        if (!p->ids && p->n_ids) {
            ds41_fail(err, "prompt: no ids");
            goto fail;
        }
        for (size_t i = 0; i < p->n_ids; i++) {
            if (p->ids[i] >= n_vocab) {
                ds41_fail(err, "prompt[%zu]: token %u is outside the model's vocabulary (%u)", i, p->ids[i], n_vocab);
                goto fail;
            }
            if (push_token(g, (int32_t)p->ids[i]) != 0) {
                oom(err);
                goto fail;
            }
        }
        g->prompt_text = calloc(1, 1);
        if (!g->prompt_text) {
            oom(err);
            goto fail;
        }
        break;
    default: ds41_fail(err, "generation: unknown prompt kind %d", (int)p->kind); goto fail;
    }
    g->n_prompt = g->n_tokens;
    if (g->n_prompt == 0) {
        ds41_fail(err, "prompt is empty");
        goto fail;
    }
    if (g->max_context && g->n_prompt >= g->max_context) {
        ds41_fail(err, "prompt of %zu tokens leaves no room in the context (%u tokens)", g->n_prompt, g->max_context);
        goto fail;
    }

    /* Chat output in thinking mode starts in the reasoning, unless a continued assistant
     * message already closed it (its reasoning, if any, is part of the prompt). */
    g->parse_mode = p->kind == DS41_GENERATION_CHAT && p->thinking && !prefix ? DS41_CHAT_MODE_THINKING
                                                                               : DS41_CHAT_MODE_CHAT;
    g->state = g->parse_mode == DS41_CHAT_MODE_THINKING ? SPLIT_REASONING : SPLIT_CONTENT;

    if (ds41_sampler_new(&g->sampler, &p->sampler, n_vocab, err) != 0) {
        ds41_error_prefix(err, "sampling");
        goto fail;
    }
    {
        uint32_t *prompt_ids = malloc(g->n_prompt * sizeof *prompt_ids);
        if (!prompt_ids) {
            oom(err);
            goto fail;
        }
        for (size_t i = 0; i < g->n_prompt; i++) prompt_ids[i] = (uint32_t)g->tokens[i];
        int rc = ds41_sampler_accept_prompt(g->sampler, prompt_ids, g->n_prompt, err);
        free(prompt_ids);
        if (rc != 0) goto fail;
    }

    for (uint32_t i = 0; i < p->n_stop_ids; i++) {
        if (!p->stop_ids || p->stop_ids[i] >= n_vocab) {
            ds41_fail(err, "stop_token_ids[%u]: not a token of the vocabulary (%u)", i, n_vocab);
            goto fail;
        }
    }
    {
        /* The EOS of tokenizer_config.json, else the V4.1 EOS text's id. */
        const ds41_vocab *v = ds41_tokenizer_vocab(tok);
        int32_t eos = ds41_vocab_eos_id(v);
        if (eos < 0) eos = ds41_vocab_find(v, DS41_CHAT_EOS, strlen(DS41_CHAT_EOS));
        uint32_t eos_ids[1];
        uint32_t n_eos = 0;
        if (!p->ignore_eos && eos >= 0 && (uint32_t)eos < n_vocab) eos_ids[n_eos++] = (uint32_t)eos;
        if (ds41_gen_limits_init(&g->limits, p->max_tokens, eos_ids, n_eos, p->stop_ids, p->n_stop_ids, err) != 0)
            goto fail;
    }

    if (p->n_stop) {
        if (!p->stop) {
            ds41_fail(err, "stop: no strings");
            goto fail;
        }
        size_t *lens = malloc(p->n_stop * sizeof *lens);
        if (!lens) {
            oom(err);
            goto fail;
        }
        for (size_t i = 0; i < p->n_stop; i++) lens[i] = p->stop_lens ? p->stop_lens[i] : (p->stop[i] ? strlen(p->stop[i]) : 0);
        int rc = ds41_stop_matcher_new(&g->stop, p->stop, lens, p->n_stop, err);
        free(lens);
        if (rc != 0) {
            ds41_error_prefix(err, "stop");
            goto fail;
        }
    } else if (ds41_stop_matcher_new(&g->stop, NULL, NULL, 0, err) != 0) {
        goto fail;
    }

    g->detok = ds41_detok_new(tok, p->kind == DS41_GENERATION_CHAT ? false : p->skip_special);
    if (!g->detok) {
        oom(err);
        goto fail;
    }

    if (p->n_forced) {
        if (!p->forced_ids) {
            ds41_fail(err, "forced output: no ids");
            goto fail;
        }
        g->forced = malloc(p->n_forced * sizeof *g->forced);
        if (!g->forced) {
            oom(err);
            goto fail;
        }
        for (size_t i = 0; i < p->n_forced; i++) {
            if (p->forced_ids[i] >= n_vocab) {
                ds41_fail(err, "forced output[%zu]: token %u is outside the vocabulary (%u)", i, p->forced_ids[i], n_vocab);
                goto fail;
            }
            g->forced[i] = p->forced_ids[i];
        }
        g->n_forced = p->n_forced;
    }
    *out = g;
    return 0;
fail:
    ds41_generation_free(g);
    return -1;
}

void ds41_generation_free(ds41_generation *g) {
    if (!g) return;
    free(g->prompt_text);
    free(g->tokens);
    free(g->forced);
    ds41_sampler_free(g->sampler);
    ds41_stop_matcher_free(g->stop);
    ds41_detok_free(g->detok);
    ds41_buf_free(&g->text);
    ds41_buf_free(&g->step_reasoning);
    ds41_buf_free(&g->step_content);
    ds41_buf_free(&g->all_reasoning);
    ds41_buf_free(&g->all_content);
    if (g->has_result) ds41_chat_completion_free(&g->result);
    free(g);
}

/* ---- accessors ------------------------------------------------------------------------------ */

const int32_t *ds41_generation_tokens(const ds41_generation *g, size_t *n) {
    if (n) *n = g->n_tokens;
    return g->tokens;
}
size_t ds41_generation_prompt_tokens(const ds41_generation *g) { return g->n_prompt; }
size_t ds41_generation_completion_tokens(const ds41_generation *g) { return g->n_tokens - g->n_prompt; }
size_t ds41_generation_reasoning_tokens(const ds41_generation *g) { return g->n_reasoning; }
size_t ds41_generation_cached_tokens(const ds41_generation *g) { return g->n_cached; }

const char *ds41_generation_prompt_text(const ds41_generation *g, size_t *len) {
    if (len) *len = g->prompt_text_len;
    return g->prompt_text;
}

size_t ds41_generation_pending(const ds41_generation *g, const int32_t **ids) {
    size_t n = g->finish == DS41_GENERATION_RUNNING ? g->n_tokens - g->n_fed : 0;
    if (ids) *ids = n ? g->tokens + g->n_fed : NULL;
    return n;
}

void ds41_generation_mark_fed(ds41_generation *g, size_t n) {
    size_t pending = ds41_generation_pending(g, NULL);
    g->n_fed += n < pending ? n : pending;
}

int ds41_generation_mark_cached(ds41_generation *g, size_t n, ds41_error *err) {
    if (g->n_fed != 0) return ds41_fail(err, "prefix cache: the generation has already fed tokens");
    if (n >= g->n_prompt) return ds41_fail(err, "prefix cache: %zu cached tokens for a prompt of %zu", n, g->n_prompt);
    g->n_fed = n;
    g->n_cached = n;
    return 0;
}

bool ds41_generation_wants_logits(const ds41_generation *g) {
    return g->finish == DS41_GENERATION_RUNNING && g->n_fed == g->n_tokens;
}

bool ds41_generation_finished(const ds41_generation *g) { return g->finish != DS41_GENERATION_RUNNING; }
ds41_generation_finish ds41_generation_finish_reason(const ds41_generation *g) { return g->finish; }

const char *ds41_generation_finish_name(const ds41_generation *g) {
    switch (g->finish) {
    case DS41_GENERATION_RUNNING: return "running";
    case DS41_GENERATION_EOS:
    case DS41_GENERATION_STOP_TOKEN:
    case DS41_GENERATION_STOP_STRING:
        return g->has_result && g->result.n_tool_calls > 0 ? "tool_calls" : "stop";
    case DS41_GENERATION_MAX_TOKENS:
    case DS41_GENERATION_CONTEXT: return "length";
    case DS41_GENERATION_ABORTED: return "abort";
    }
    return "stop";
}

const char *ds41_generation_text(const ds41_generation *g, size_t *len) {
    if (len) *len = g->text.len;
    return g->text.data ? g->text.data : "";
}

const ds41_chat_completion *ds41_generation_result(const ds41_generation *g) {
    return g->has_result ? &g->result : NULL;
}

uint64_t ds41_generation_seed(const ds41_generation *g) { return ds41_sampler_seed(g->sampler); }

const ds41_sampler *ds41_generation_sampler(const ds41_generation *g) { return g->sampler; }

/* ---- the output splitter -------------------------------------------------------------------- */

static bool marker_watched(const ds41_generation *g, int m) {
    switch (g->state) {
    case SPLIT_REASONING: return m != M_TOOL_CALLS || g->parse_tool_calls;
    case SPLIT_CONTENT: return m == M_EOS || (m == M_TOOL_CALLS && g->parse_tool_calls);
    default: return false;
    }
}

static void emit_part(ds41_generation *g, split_state part, const char *s, size_t n) {
    if (!n) return;
    if (part == SPLIT_REASONING) {
        ds41_buf_put(&g->step_reasoning, s, n);
        ds41_buf_put(&g->all_reasoning, s, n);
    } else {
        ds41_buf_put(&g->step_content, s, n);
        ds41_buf_put(&g->all_content, s, n);
    }
}

/* Decide as much of T as can be decided: stream reasoning / content up to the next marker or up
 * to a suffix that may still become one (unless final: then nothing is held back). */
static void split_advance(ds41_generation *g, bool final) {
    const char *t = g->text.data ? g->text.data : "";
    const size_t len = g->text.len;
    if (g->kind != DS41_GENERATION_CHAT) {
        emit_part(g, SPLIT_CONTENT, t + g->split_pos, len - g->split_pos);
        g->split_pos = len;
        return;
    }
    while (g->state == SPLIT_REASONING || g->state == SPLIT_CONTENT) {
        size_t best = SIZE_MAX;
        int which = -1;
        for (int m = 0; m < N_MARKERS; m++) {
            if (!marker_watched(g, m)) continue;
            const char *hit = memmem(t + g->split_pos, len - g->split_pos, MARKER_TEXT[m], strlen(MARKER_TEXT[m]));
            if (hit && (size_t)(hit - t) < best) {
                best = (size_t)(hit - t);
                which = m;
            }
        }
        if (which < 0) {
            size_t hold = 0;
            if (!final) {
                /* the longest suffix that is a proper prefix of a watched marker */
                for (int m = 0; m < N_MARKERS; m++) {
                    if (!marker_watched(g, m)) continue;
                    size_t ml = strlen(MARKER_TEXT[m]);
                    size_t avail = len - g->split_pos;
                    for (size_t k = (ml - 1 < avail ? ml - 1 : avail); k > hold; k--) {
                        if (memcmp(t + len - k, MARKER_TEXT[m], k) == 0) {
                            hold = k;
                            break;
                        }
                    }
                }
            }
            emit_part(g, g->state, t + g->split_pos, len - g->split_pos - hold);
            g->split_pos = len - hold;
            return;
        }
        emit_part(g, g->state, t + g->split_pos, best - g->split_pos);
        g->split_pos = best;
        if (which == M_THINK_END) {
            g->split_pos += strlen(MARKER_TEXT[M_THINK_END]);
            g->state = SPLIT_CONTENT;
        } else if (which == M_TOOL_CALLS) {
            g->state = SPLIT_BLOCK;
        } else {
            g->state = SPLIT_DONE;
        }
    }
}

/* Everything of `full` past what was streamed, when the streamed text is its prefix.  It is by
 * construction (the splitter follows the parser's rules); were it not, nothing more is sent
 * rather than text that contradicts the stream. */
static void emit_rest(ds41_generation *g, split_state part, const char *full, size_t full_len) {
    const ds41_buf *done = part == SPLIT_REASONING ? &g->all_reasoning : &g->all_content;
    if (done->len > full_len || (done->len && memcmp(full, done->data, done->len) != 0)) return;
    emit_part(g, part, full + done->len, full_len - done->len);
}

static char *dup_buf(const ds41_buf *b, size_t *len) {
    char *s = malloc(b->len + 1);
    if (!s) return NULL;
    if (b->len) memcpy(s, b->data, b->len);
    s[b->len] = 0;
    *len = b->len;
    return s;
}

/* The end of the text: parse it and deliver what was not streamed. */
static int finalize(ds41_generation *g, ds41_error *err) {
    /* Text held for a possible stop string can no longer become one. */
    const char *piece;
    size_t piece_len;
    ds41_stop_output so;
    if (g->finish != DS41_GENERATION_STOP_STRING) {
        ds41_detok_finish(g->detok, &piece, &piece_len);
        if (piece_len) {
            if (ds41_stop_matcher_feed(g->stop, piece, piece_len, &so, err) != 0) return -1;
            ds41_buf_put(&g->text, so.text, so.len);
        }
        ds41_stop_matcher_finish(g->stop, &so);
        ds41_buf_put(&g->text, so.text, so.len);
    }
    if (g->text.oom) return oom(err);

    if (g->kind != DS41_GENERATION_CHAT || !g->parse_tool_calls) {
        /* No DSML to decide: the splitter's own split is the result. */
        split_advance(g, true);
        if (g->all_reasoning.oom || g->all_content.oom) return oom(err);
        ds41_chat_completion *r = &g->result;
        memset(r, 0, sizeof *r);
        r->reasoning_content = dup_buf(&g->all_reasoning, &r->reasoning_content_len);
        r->content = dup_buf(&g->all_content, &r->content_len);
        g->has_result = true;
        if (!r->reasoning_content || !r->content) return oom(err);
        return 0;
    }

    /* The parser's input: T, plus the EOS the model ended with (it is not part of T). */
    ds41_buf parse_in = {0};
    ds41_buf_put(&parse_in, g->text.data ? g->text.data : "", g->text.len);
    if (g->finish == DS41_GENERATION_EOS) ds41_buf_puts(&parse_in, DS41_CHAT_EOS);
    if (parse_in.oom) {
        ds41_buf_free(&parse_in);
        return oom(err);
    }
    ds41_error note;
    int rc = ds41_chat_parse_completion_lenient(parse_in.data ? parse_in.data : "", parse_in.len, g->parse_mode,
                                                &g->result, &note);
    ds41_buf_free(&parse_in);
    if (rc != 0) return oom(err);
    g->has_result = true;
    emit_rest(g, SPLIT_REASONING, g->result.reasoning_content, g->result.reasoning_content_len);
    emit_rest(g, SPLIT_CONTENT, g->result.content, g->result.content_len);
    g->state = SPLIT_DONE;
    return 0;
}

/* ---- stepping ---------------------------------------------------------------------------------- */

static void step_reset(ds41_generation *g, ds41_generation_delta *out) {
    g->step_reasoning.len = 0;
    g->step_content.len = 0;
    if (g->step_reasoning.data) g->step_reasoning.data[0] = 0;
    if (g->step_content.data) g->step_content.data[0] = 0;
    memset(out, 0, sizeof *out);
}

static void step_fill(ds41_generation *g, ds41_generation_delta *out) {
    out->reasoning = g->step_reasoning.data ? g->step_reasoning.data : "";
    out->reasoning_len = g->step_reasoning.len;
    out->content = g->step_content.data ? g->step_content.data : "";
    out->content_len = g->step_content.len;
    out->finished = g->finish != DS41_GENERATION_RUNNING;
    out->finish = g->finish;
    if (out->finished && g->has_result) {
        out->tool_calls = g->result.tool_calls;
        out->n_tool_calls = g->result.n_tool_calls;
    }
}

/* log_softmax(logits)[token] in double precision (forced tokens' logprob). */
static float raw_logprob(const float *logits, uint32_t n, uint32_t token) {
    float mx = -INFINITY;
    for (uint32_t i = 0; i < n; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0;
    for (uint32_t i = 0; i < n; i++) sum += exp((double)logits[i] - (double)mx);
    return (float)((double)logits[token] - (double)mx - log(sum));
}

int ds41_generation_step(ds41_generation *g, const float *logits, ds41_sampler_scratch *scratch,
                         ds41_generation_delta *out, ds41_error *err) {
    ds41_generation_delta dummy;
    if (!out) out = &dummy;
    step_reset(g, out);
    if (!ds41_generation_wants_logits(g))
        return ds41_fail(err, g->finish != DS41_GENERATION_RUNNING ? "generation: already finished"
                                                                   : "generation: tokens still to feed");
    if (!logits) return ds41_fail(err, "generation: no logits");
    if (push_token(g, 0) != 0) return oom(err); /* room first, so nothing fails after sampling */
    g->n_tokens--;

    ds41_sample_result res;
    if (ds41_sampler_sample(g->sampler, scratch, logits, g->n_vocab, &res, err) != 0) return -1;
    size_t gen_index = g->n_tokens - g->n_prompt;
    if (gen_index < g->n_forced) {
        uint32_t forced = g->forced[gen_index];
        if (res.token != forced) {
            res.token = forced;
            if (!isnan(res.logprob)) res.logprob = raw_logprob(logits, g->n_vocab, forced);
        }
        out->forced = true;
    }
    const uint32_t token = res.token;
    out->token = token;
    out->sample = res;
    out->reasoning_token = g->state == SPLIT_REASONING;
    if (out->reasoning_token) g->n_reasoning++;

    ds41_gen_verdict v = ds41_gen_limits_step(&g->limits, token);
    g->tokens[g->n_tokens++] = (int32_t)token;
    if (ds41_gen_verdict_emits(v)) {
        if (ds41_sampler_accept(g->sampler, token, err) != 0) return -1;
        out->emitted = true;
        const char *piece;
        size_t piece_len;
        if (ds41_detok_push(g->detok, token, &piece, &piece_len) != 0) return oom(err);
        ds41_stop_output so;
        if (ds41_stop_matcher_feed(g->stop, piece, piece_len, &so, err) != 0) return -1;
        ds41_buf_put(&g->text, so.text, so.len);
        if (g->text.oom) return oom(err);
        if (so.stopped) g->finish = DS41_GENERATION_STOP_STRING;
    }
    if (g->finish == DS41_GENERATION_RUNNING) {
        if (v == DS41_GEN_EOS)
            g->finish = DS41_GENERATION_EOS;
        else if (v == DS41_GEN_STOP_TOKEN)
            g->finish = DS41_GENERATION_STOP_TOKEN;
        else if (v == DS41_GEN_LENGTH)
            g->finish = DS41_GENERATION_MAX_TOKENS;
        else if (g->max_context && g->n_tokens >= g->max_context)
            g->finish = DS41_GENERATION_CONTEXT;
    }
    split_advance(g, false);
    if (g->finish != DS41_GENERATION_RUNNING && finalize(g, err) != 0) return -1;
    if (g->step_reasoning.oom || g->step_content.oom || g->all_reasoning.oom || g->all_content.oom) return oom(err);
    step_fill(g, out);
    return 0;
}

int ds41_generation_abort(ds41_generation *g, ds41_generation_delta *out, ds41_error *err) {
    ds41_generation_delta dummy;
    if (!out) out = &dummy;
    step_reset(g, out);
    if (g->finish == DS41_GENERATION_RUNNING) {
        g->finish = DS41_GENERATION_ABORTED;
        split_advance(g, false);
        if (finalize(g, err) != 0) return -1;
        if (g->step_reasoning.oom || g->step_content.oom) return oom(err);
        step_fill(g, out);
        return 0;
    }
    out->finished = true;
    out->finish = g->finish;
    out->reasoning = out->content = "";
    return 0;
}
