/* ds41-generate: the offline generator.  Loads a checkpoint, renders a prompt (a user message, an
 * OpenAI-style messages file, raw text or token ids), runs prefill and decode on the engine and
 * streams the answer to stdout -- the tool a developer uses to debug the engine end to end,
 * without the daemon.  The generation logic is engine/serve/generate.h, the same the daemon runs. */
#include "daemon/backend_flag.h"
#include "ds41_version.h"
#include "engine/forward/forward.h"
#include "engine/serve/generate.h"
#include "engine/serve/speculative.h"
#include "engine/text/pyjson.h"
#include "engine/text/tokenizer.h"

#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: ds41-generate --model DIR (--prompt TEXT | --messages FILE.json | --ids 1,2,3)\n"
            "                     [--raw] [--thinking] [--effort N] [--temperature T] [--top-p P]\n"
            "                     [--top-k K] [--seed S] [--max-tokens N] [--stop S]... [--ignore-eos]\n"
            "                     [--chunk N] [--speculative N] [--backend KIND] [--reference] [--forced TEXT]\n"
            "                     [--json]\n"
            "       ds41-generate --version\n"
            "\n"
            "Runs the model on a prompt and streams the answer to stdout.\n"
            "  --prompt TEXT      one user message (rendered with the V4.1 chat encoding), or with\n"
            "                     --raw the exact prompt text (no chat encoding, no BOS added)\n"
            "  --messages FILE    an OpenAI messages array, or a request object with \"messages\" and\n"
            "                     optional \"tools\" and \"response_format\" (\"-\" = stdin)\n"
            "  --ids LIST         prompt token ids, comma separated (no chat encoding)\n"
            "  --thinking         thinking mode: the reasoning is streamed first, marked (dim on a\n"
            "                     terminal, else each line prefixed with \"> \")\n"
            "  --effort N         reasoning effort 1..100 (thinking mode; default 75)\n"
            "  --temperature T    0 = greedy (the default), else sampled; --top-p, --top-k as usual\n"
            "  --seed S           sampling seed (default: drawn, and reported on stderr)\n"
            "  --max-tokens N     generated tokens at most (default 256)\n"
            "  --stop S           a stop string (repeatable)\n"
            "  --ignore-eos       keep generating past EOS\n"
            "  --chunk N          prefill the prompt in chunks of N tokens (default: all at once)\n"
            "  --speculative N    speculative decoding with the model's DSpark draft head, up to N\n"
            "                     drafts per step (1..8, at most its dspark_block_size); the output is\n"
            "                     plain decoding's.  Refused for a model without DSpark.  The summary\n"
            "                     adds the drafted and accepted counts\n"
            DS41_BACKEND_HELP
            "  --reference        the canonical reference arithmetic (engine/backend/refmath.h)\n"
            "  --forced TEXT      test hook: the output is the tokens of TEXT (special tokens matched)\n"
            "                     instead of samples, then sampling goes on\n"
            "  --json             no streaming: print one JSON object with the prompt and generated ids,\n"
            "                     the text, the parsed message, the streamed parts, finish reason, usage\n"
            "Tool calls are printed as \"[tool call] NAME ARGUMENTS\".  A summary (finish reason, token\n"
            "counts, speed, seed) goes to stderr.\n"
            "Exit status: 0 ok, 2 bad arguments, model or prompt, 1 other failures.\n");
}

static int parse_u64(const char *s, uint64_t *out) {
    if (!s || !*s || *s == '-' || *s == '+') return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end) return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, float *out) {
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

static int parse_ids(const char *s, uint32_t **out, size_t *n) {
    size_t cap = 16, k = 0;
    uint32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) return -1;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        if (*p < '0' || *p > '9') goto bad;
        unsigned long v = strtoul(p, &end, 10);
        if (errno || v > UINT32_MAX || end == p) goto bad;
        if (k == cap) {
            cap *= 2;
            uint32_t *ni = realloc(ids, cap * sizeof *ni);
            if (!ni) goto bad;
            ids = ni;
        }
        ids[k++] = (uint32_t)v;
        p = end;
        if (*p == ',') {
            p++;
            if (!*p) goto bad;
        } else if (*p) {
            goto bad;
        }
    }
    *out = ids;
    *n = k;
    return 0;
bad:
    free(ids);
    return -1;
}

/* ---- streaming output ------------------------------------------------------------------------ */

typedef struct printer {
    bool tty;
    bool in_reasoning;
    bool at_line_start;
    bool wrote_any;
} printer;

static void print_reasoning(printer *p, const char *s, size_t n) {
    if (!n) return;
    if (!p->in_reasoning) {
        if (p->tty) fputs("\033[2m", stdout);
        p->in_reasoning = true;
        p->at_line_start = true;
    }
    for (size_t i = 0; i < n; i++) {
        if (!p->tty && p->at_line_start) fputs("> ", stdout);
        fputc(s[i], stdout);
        p->at_line_start = s[i] == '\n';
    }
    p->wrote_any = true;
}

static void end_reasoning(printer *p) {
    if (!p->in_reasoning) return;
    if (p->tty) fputs("\033[0m", stdout);
    if (!p->at_line_start) fputc('\n', stdout);
    fputc('\n', stdout);
    p->in_reasoning = false;
    p->at_line_start = true;
}

static void print_content(printer *p, const char *s, size_t n) {
    if (!n) return;
    end_reasoning(p);
    fwrite(s, 1, n, stdout);
    p->wrote_any = true;
    p->at_line_start = s[n - 1] == '\n';
}

/* What every step's delta goes to (the streaming printer and the JSON summary's parts). */
typedef struct step_out {
    printer *pr;
    ds41_buf *stream_r, *stream_c;
    bool json_out;
    double t_first; /* when the first step came (the prompt's logits) */
} step_out;

static double now_s(void);
static void print_tool_call(printer *p, const ds41_chat_tool_call *c);

static void on_step(void *ctx, const ds41_generation *g, const ds41_generation_delta *st, const float *logits) {
    (void)g;
    (void)logits;
    step_out *o = ctx;
    if (o->t_first == 0) o->t_first = now_s();
    ds41_buf_put(o->stream_r, st->reasoning, st->reasoning_len);
    ds41_buf_put(o->stream_c, st->content, st->content_len);
    if (!o->json_out) {
        print_reasoning(o->pr, st->reasoning, st->reasoning_len);
        print_content(o->pr, st->content, st->content_len);
        for (size_t i = 0; i < st->n_tool_calls; i++) print_tool_call(o->pr, &st->tool_calls[i]);
        fflush(stdout);
    }
}

static void print_tool_call(printer *p, const ds41_chat_tool_call *c) {
    end_reasoning(p);
    if (p->wrote_any && !p->at_line_start) fputc('\n', stdout);
    fputs("[tool call] ", stdout);
    if (c->tool_namespace) printf("%s::", c->tool_namespace);
    fwrite(c->name, 1, c->name_len, stdout);
    fputc(' ', stdout);
    fwrite(c->arguments, 1, c->arguments_len, stdout);
    fputc('\n', stdout);
    p->wrote_any = true;
    p->at_line_start = true;
}

/* ---- JSON summary ------------------------------------------------------------------------------ */

static json_t *ids_json(const int32_t *ids, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

static json_t *summary_json(const ds41_generation *g, const ds41_buf *stream_r, const ds41_buf *stream_c,
                            ds41_error *err) {
    size_t n_tokens, text_len;
    const int32_t *toks = ds41_generation_tokens(g, &n_tokens);
    size_t n_prompt = ds41_generation_prompt_tokens(g);
    const char *text = ds41_generation_text(g, &text_len);
    const ds41_chat_completion *r = ds41_generation_result(g);
    json_t *msg = ds41_chat_completion_to_message(r, err);
    if (!msg) return NULL;
    char seed[32];
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)ds41_generation_seed(g));
    json_t *o = json_pack("{s:o s:o s:s% s:o s:s s:s s:{s:s% s:s%} s:{s:I s:I s:I s:I}}", "prompt_ids",
                          ids_json(toks, n_prompt), "ids", ids_json(toks + n_prompt, n_tokens - n_prompt), "text",
                          text, text_len, "message", msg, "finish_reason", ds41_generation_finish_name(g), "seed", seed,
                          "stream", "reasoning", stream_r->data ? stream_r->data : "", stream_r->len, "content",
                          stream_c->data ? stream_c->data : "", stream_c->len, "usage", "prompt_tokens",
                          (json_int_t)n_prompt, "completion_tokens", (json_int_t)ds41_generation_completion_tokens(g),
                          "reasoning_tokens", (json_int_t)ds41_generation_reasoning_tokens(g), "cached_tokens",
                          (json_int_t)ds41_generation_cached_tokens(g));
    if (!o) ds41_fail(err, "out of memory");
    return o;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- main -------------------------------------------------------------------------------------- */

enum {
    OPT_MODEL = 1000,
    OPT_PROMPT,
    OPT_MESSAGES,
    OPT_IDS,
    OPT_RAW,
    OPT_THINKING,
    OPT_EFFORT,
    OPT_TEMPERATURE,
    OPT_TOP_P,
    OPT_TOP_K,
    OPT_SEED,
    OPT_MAX_TOKENS,
    OPT_STOP,
    OPT_IGNORE_EOS,
    OPT_CHUNK,
    OPT_SPECULATIVE,
    OPT_REFERENCE,
    OPT_FORCED,
    OPT_JSON,
};

int main(int argc, char **argv) {
    static const struct option longopts[] = {
        {"model", required_argument, NULL, OPT_MODEL},
        {"prompt", required_argument, NULL, OPT_PROMPT},
        {"messages", required_argument, NULL, OPT_MESSAGES},
        {"ids", required_argument, NULL, OPT_IDS},
        {"raw", no_argument, NULL, OPT_RAW},
        {"thinking", no_argument, NULL, OPT_THINKING},
        {"effort", required_argument, NULL, OPT_EFFORT},
        {"temperature", required_argument, NULL, OPT_TEMPERATURE},
        {"top-p", required_argument, NULL, OPT_TOP_P},
        {"top-k", required_argument, NULL, OPT_TOP_K},
        {"seed", required_argument, NULL, OPT_SEED},
        {"max-tokens", required_argument, NULL, OPT_MAX_TOKENS},
        {"stop", required_argument, NULL, OPT_STOP},
        {"ignore-eos", no_argument, NULL, OPT_IGNORE_EOS},
        {"chunk", required_argument, NULL, OPT_CHUNK},
        {"speculative", required_argument, NULL, OPT_SPECULATIVE},
        {"reference", no_argument, NULL, OPT_REFERENCE},
        DS41_BACKEND_LONGOPT,
        {"forced", required_argument, NULL, OPT_FORCED},
        {"json", no_argument, NULL, OPT_JSON},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    const char *model = NULL, *prompt = NULL, *messages_path = NULL, *ids_arg = NULL, *forced_text = NULL;
    const char *backend = NULL; /* --backend (NULL: auto) */
    bool raw = false, thinking = false, reference = false, json_out = false, ignore_eos = false;
    uint64_t effort = 0, max_tokens = 256, chunk = 0, seed = 0, top_k = 0, speculative = 0;
    bool has_seed = false;
    float temperature = 0.0f, top_p = 1.0f;
    const char **stops = NULL;
    size_t n_stops = 0;
    int c;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case OPT_MODEL: model = optarg; break;
        case OPT_PROMPT: prompt = optarg; break;
        case OPT_MESSAGES: messages_path = optarg; break;
        case OPT_IDS: ids_arg = optarg; break;
        case OPT_RAW: raw = true; break;
        case OPT_THINKING: thinking = true; break;
        case OPT_EFFORT:
            if (parse_u64(optarg, &effort) != 0 || effort < 1 || effort > 100) {
                fprintf(stderr, "ds41-generate: --effort: expected 1..100, got '%s'\n", optarg);
                return 2;
            }
            break;
        case OPT_TEMPERATURE:
            if (parse_float(optarg, &temperature) != 0 || temperature < 0) {
                fprintf(stderr, "ds41-generate: --temperature: expected a number >= 0, got '%s'\n", optarg);
                return 2;
            }
            break;
        case OPT_TOP_P:
            if (parse_float(optarg, &top_p) != 0 || top_p < 0 || top_p > 1) {
                fprintf(stderr, "ds41-generate: --top-p: expected 0..1, got '%s'\n", optarg);
                return 2;
            }
            break;
        case OPT_TOP_K:
            if (parse_u64(optarg, &top_k) != 0 || top_k > UINT32_MAX) {
                fprintf(stderr, "ds41-generate: --top-k: expected an integer >= 0, got '%s'\n", optarg);
                return 2;
            }
            break;
        case OPT_SEED:
            if (parse_u64(optarg, &seed) != 0) {
                fprintf(stderr, "ds41-generate: --seed: expected an integer 0..2^64-1, got '%s'\n", optarg);
                return 2;
            }
            has_seed = true;
            break;
        case OPT_MAX_TOKENS:
            if (parse_u64(optarg, &max_tokens) != 0 || max_tokens < 1 || max_tokens > UINT32_MAX) {
                fprintf(stderr, "ds41-generate: --max-tokens: expected an integer >= 1, got '%s'\n", optarg);
                return 2;
            }
            break;
        case OPT_STOP: {
            const char **ns = realloc(stops, (n_stops + 1) * sizeof *ns);
            if (!ns) return 1;
            stops = ns;
            stops[n_stops++] = optarg;
            break;
        }
        case OPT_IGNORE_EOS: ignore_eos = true; break;
        case OPT_CHUNK:
            if (parse_u64(optarg, &chunk) != 0 || chunk < 1 || chunk > (1u << 24)) {
                fprintf(stderr, "ds41-generate: --chunk: expected an integer >= 1, got '%s'\n", optarg);
                return 2;
            }
            break;
        case OPT_SPECULATIVE:
            if (parse_u64(optarg, &speculative) != 0 || speculative < 1 || speculative > DS41_SPEC_MAX_K) {
                fprintf(stderr, "ds41-generate: --speculative: expected 1..%u, got '%s'\n", DS41_SPEC_MAX_K, optarg);
                return 2;
            }
            break;
        case OPT_REFERENCE: reference = true; break;
        case DS41_BACKEND_OPT:
            if (ds41_backend_flag_parse("ds41-generate", optarg) != 0) return 2;
            backend = optarg;
            break;
        case OPT_FORCED: forced_text = optarg; break;
        case OPT_JSON: json_out = true; break;
        case 'h': usage(stdout); return 0;
        case 'V':
            puts("ds41-generate " DS41_VERSION);
            return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc || !model || (!!prompt + !!messages_path + !!ids_arg) != 1 || (raw && !prompt)) {
        usage(stderr);
        free(stops);
        return 2;
    }

    int status = 2;
    ds41_error err = {{0}};
    ds41_vocab *vocab = NULL;
    json_t *messages_doc = NULL, *user_msgs = NULL;
    uint32_t *ids = NULL, *forced = NULL;
    size_t n_ids = 0;
    ds41_token_ids forced_ids = {0};
    ds41_tokenizer *tok = NULL;
    ds41_engine *engine = NULL;
    ds41_kv_pool *pool = NULL;
    ds41_kv_seq *seq = NULL;
    ds41_generation *g = NULL;
    ds41_sampler_scratch *scratch = NULL;
    float *logits = NULL;
    ds41_buf stream_r = {0}, stream_c = {0};

    vocab = ds41_vocab_load_dir(model, &err);
    tok = vocab ? ds41_tokenizer_new(vocab, &err) : NULL;
    if (!tok) {
        fprintf(stderr, "ds41-generate: %s\n", err.msg);
        goto out;
    }
    ds41_engine_opts eo = {.reference = reference};
    if (ds41_backend_flag_apply("ds41-generate", backend, &eo) != 0) goto out;
    engine = ds41_engine_load(model, &eo, &err);
    if (!engine) {
        fprintf(stderr, "ds41-generate: %s\n", err.msg);
        goto out;
    }
    const ds41_model_config *cfg = ds41_engine_config(engine);
    const uint32_t n_vocab = (uint32_t)cfg->vocab_size;

    ds41_generation_params gp = ds41_generation_params_default();
    if (ids_arg) {
        if (parse_ids(ids_arg, &ids, &n_ids) != 0) {
            fprintf(stderr, "ds41-generate: --ids: expected comma-separated token ids, got '%s'\n", ids_arg);
            goto out;
        }
        gp.kind = DS41_GENERATION_IDS;
        gp.ids = ids;
        gp.n_ids = n_ids;
    } else if (raw) {
        gp.kind = DS41_GENERATION_RAW;
        gp.text = prompt;
        gp.text_len = strlen(prompt);
    } else if (prompt) {
        user_msgs = json_pack("[{s:s s:s}]", "role", "user", "content", prompt);
        if (!user_msgs) {
            fprintf(stderr, "ds41-generate: --prompt: not valid UTF-8 text\n");
            goto out;
        }
        gp.messages = user_msgs;
    } else {
        json_error_t je;
        messages_doc = strcmp(messages_path, "-") == 0 ? json_loadf(stdin, 0, &je) : json_load_file(messages_path, 0, &je);
        if (!messages_doc) {
            fprintf(stderr, "ds41-generate: %s:%d:%d: %s\n", messages_path, je.line, je.column, je.text);
            goto out;
        }
        if (json_is_object(messages_doc)) {
            gp.messages = json_object_get(messages_doc, "messages");
            gp.tools = json_object_get(messages_doc, "tools");
            gp.response_format = json_object_get(messages_doc, "response_format");
        } else {
            gp.messages = messages_doc;
        }
        if (!json_is_array(gp.messages)) {
            fprintf(stderr, "ds41-generate: %s: expected a messages array or an object with \"messages\"\n",
                    messages_path);
            goto out;
        }
    }
    gp.thinking = thinking;
    gp.reasoning_effort = (int)effort;
    gp.sampler.temperature = temperature;
    gp.sampler.top_p = top_p;
    gp.sampler.top_k = (uint32_t)top_k;
    gp.sampler.has_seed = has_seed;
    gp.sampler.seed = seed;
    gp.stop = stops;
    gp.n_stop = n_stops;
    gp.max_tokens = (uint32_t)max_tokens;
    gp.max_context = cfg->max_seq_len > 0 && cfg->max_seq_len < UINT32_MAX ? (uint32_t)cfg->max_seq_len : 0;
    gp.ignore_eos = ignore_eos;
    if (forced_text) {
        if (ds41_tokenizer_encode(tok, forced_text, strlen(forced_text), &forced_ids, &err) != 0) {
            fprintf(stderr, "ds41-generate: --forced: %s\n", err.msg);
            goto out;
        }
        gp.forced_ids = forced_ids.ids;
        gp.n_forced = forced_ids.n;
    }
    if (ds41_generation_new(tok, &gp, n_vocab, &g, &err) != 0) {
        fprintf(stderr, "ds41-generate: %s\n", err.msg);
        goto out;
    }

    ds41_draft_provider head;
    ds41_spec_config spec = {.max_k = (uint32_t)speculative, .max_backoff = DS41_SPEC_MAX_BACKOFF};
    if (speculative) {
        if (ds41_spec_head_provider(engine, &head, &err) != 0) {
            fprintf(stderr, "ds41-generate: --speculative: %s\n", err.msg);
            goto out;
        }
        if ((int64_t)speculative > cfg->dspark_block_size) {
            fprintf(stderr, "ds41-generate: --speculative: %llu is above the model's dspark_block_size %lld\n",
                    (unsigned long long)speculative, (long long)cfg->dspark_block_size);
            goto out;
        }
    }

    status = 1;
    pool = ds41_engine_new_pool(engine, 0, 0, &err);
    seq = pool ? ds41_kv_seq_new(pool, &err) : NULL;
    logits = malloc((size_t)(1 + DS41_SPEC_MAX_K) * n_vocab * sizeof *logits);
    if (!seq || !logits || ds41_sampler_scratch_new(&scratch, n_vocab, &err) != 0) {
        fprintf(stderr, "ds41-generate: %s\n", logits ? err.msg : "out of memory");
        goto out;
    }

    printer pr = {.tty = !json_out && isatty(STDOUT_FILENO), .at_line_start = true};
    step_out so = {.pr = &pr, .stream_r = &stream_r, .stream_c = &stream_c, .json_out = json_out};
    const double t0 = now_s();
    ds41_spec_stats sst = {0};
    /* plain decoding is the same loop without a provider (engine/serve/speculative.h) */
    if (ds41_spec_generate(engine, seq, g, (size_t)chunk, speculative ? &spec : NULL, speculative ? &head : NULL,
                           scratch, logits, on_step, &so, &sst, &err) != 0) {
        fprintf(stderr, "ds41-generate: %s\n", err.msg);
        goto out;
    }
    const double t_prefill = so.t_first ? so.t_first : now_s();
    const double t1 = now_s();
    if (json_out) {
        json_t *o = summary_json(g, &stream_r, &stream_c, &err);
        if (!o) {
            fprintf(stderr, "ds41-generate: %s\n", err.msg);
            goto out;
        }
        char *s = json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII);
        json_decref(o);
        if (!s) goto out;
        puts(s);
        free(s);
    } else {
        end_reasoning(&pr);
        if (pr.wrote_any && !pr.at_line_start) fputc('\n', stdout);
    }
    const size_t n_gen = ds41_generation_completion_tokens(g);
    fprintf(stderr, "[finish: %s; prompt %zu tokens (%.1f tok/s), completion %zu tokens (%.1f tok/s); seed %llu]\n",
            ds41_generation_finish_name(g), ds41_generation_prompt_tokens(g),
            (double)ds41_generation_prompt_tokens(g) / (t_prefill - t0 > 1e-9 ? t_prefill - t0 : 1e-9), n_gen,
            (double)n_gen / (t1 - t_prefill > 1e-9 ? t1 - t_prefill : 1e-9),
            (unsigned long long)ds41_generation_seed(g));
    if (speculative)
        fprintf(stderr, "[speculative: %llu verification steps, %llu drafted, %llu accepted]\n",
                (unsigned long long)sst.steps, (unsigned long long)sst.drafted, (unsigned long long)sst.accepted);
    status = fflush(stdout) == 0 && !ferror(stdout) ? 0 : 1;
out:
    ds41_buf_free(&stream_r);
    ds41_buf_free(&stream_c);
    free(logits);
    ds41_sampler_scratch_free(scratch);
    ds41_generation_free(g);
    ds41_kv_seq_free(seq);
    ds41_kv_pool_free(pool);
    ds41_engine_free(engine);
    ds41_tokenizer_free(tok);
    ds41_vocab_free(vocab);
    ds41_token_ids_free(&forced_ids);
    json_decref(messages_doc);
    json_decref(user_msgs);
    free(ids);
    free(forced);
    free(stops);
    return status;
}
