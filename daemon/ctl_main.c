/* ds41ctl: control and query ds41d over its Unix socket (see ds41ctl(1)).  Human tables by
 * default, JSON with --json. */
#include "daemon/ctl_client.h"
#include "daemon/ctl_internal.h"
#include "ds41_version.h"
#include "engine/text/pyjson.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <pwd.h>

#define DEFAULT_SOCKET "/run/ds41d/ds41d.sock"

const char *g_socket = DEFAULT_SOCKET;
bool g_json = false;

static void usage(FILE *f) {
    fprintf(f,
            "usage: ds41ctl [--socket PATH] [--json] COMMAND [ARGS]\n"
            "       ds41ctl --version | --help\n"
            "\n"
            "Talks to ds41d over its Unix socket (default %s, or $DS41_SOCKET).\n"
            "--socket and --json may also follow the command (ds41ctl status --json).\n"
            "Commands (admin: root or a member of the daemon's auth.admin_group):\n"
            "  status                       daemon state, model, load and memory\n"
            "  models ls                    configured and loaded models, bytes per tier\n"
            "  models load NAME [--wait]    load a configured model (admin); --wait prints its state\n"
            "                               changes until it is ready (exit 1 if it fails), with the\n"
            "                               weights bound so far (a progress bar on a terminal)\n"
            "  models unload NAME           unload a model (admin)\n"
            "  ps [--all]                   live sessions with tokens and KV bytes; --all adds the\n"
            "                               prefix-cache entries (admin)\n"
            "  cancel SESSION               cancel a live session (an ID from ps), or drop a\n"
            "                               prefix-cache entry; kill is the same command (admin)\n"
            "  cache                        KV cache per session and per tier (admin)\n"
            "  cache ls                     session snapshots on disk (admin)\n"
            "  cache save SESSION           write a session (see ps) to a snapshot (admin)\n"
            "  cache restore SNAPSHOT       load a snapshot into the prefix cache (admin)\n"
            "  cache rm SNAPSHOT            delete a snapshot (admin)\n"
            "  cache --set-expert-bytes SIZE  change the routed-expert budget at run time\n"
            "       [--model M]             (e.g. 2GiB; auto or 0 = the budget decided at load;\n"
            "                               admin)\n"
            "  chat [PROMPT]                chat, streaming; interactive without PROMPT\n"
            "       [--model M] [--system TEXT] [--thinking] [--effort N] [--max-tokens N]\n"
            "       [--temperature T] [--seed S]\n"
            "  generate PROMPT              a plain completion, streamed\n"
            "       [--model M] [--max-tokens N] [--temperature T] [--seed S]\n"
            "  bench                        prefill and decode throughput through the daemon\n"
            "       [--requests N] [--concurrency C] [--prompt-tokens P]\n"
            "       [--max-tokens T] [--model M]\n"
            "  doctor [--model DIR]         check this machine: the daemon, io_uring, the\n"
            "                               checkpoint and O_DIRECT on its directory, memlock,\n"
            "                               CPU features, CPU kernel level and threads, GPU,\n"
            "                               free memory; with --model a download before it is\n"
            "                               served: shards, tensors, tokenizer, auto budgets\n"
            "       [--memory SIZE] [--kv-bytes SIZE] [--max-sequences N]\n"
            "                               size the tiers for SIZE of available memory\n"
            "  metrics                      the daemon's Prometheus metrics\n"
            "--json prints JSON for scripts.  On a terminal, chat and generate show the model's\n"
            "control characters escaped (\\x1b, \\u009b); piped, the text is written as it is.\n"
            "Exit status: 0 ok, 1 failure (including an unreachable daemon), 2 bad usage.\n",
            DEFAULT_SOCKET);
}

int fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("ds41ctl: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

/* ---- HTTP + JSON helpers --------------------------------------------------------------------- */

/* GET/POST returning parsed JSON; on a non-2xx answer prints the error and returns NULL. */
json_t *call_json(const char *method, const char *path, const char *body, int *status_out, bool quiet) {
    ds41_ctl_response r;
    ds41_error err = {{0}};
    if (ds41_ctl_request(g_socket, method, path, body, body ? strlen(body) : 0, 60000, &r, &err) != 0) {
        if (!quiet) fail("%s", err.msg);
        if (status_out) *status_out = 0;
        return NULL;
    }
    if (status_out) *status_out = r.status;
    json_error_t je;
    json_t *j = json_loadb(r.body, r.body_len, 0, &je);
    if (r.status / 100 != 2) {
        if (!quiet) {
            const char *msg = j ? json_string_value(json_object_get(json_object_get(j, "error"), "message")) : NULL;
            fail("%s %s: HTTP %d: %s", method, path, r.status, msg ? msg : r.body);
        }
        json_decref(j);
        ds41_ctl_response_free(&r);
        return NULL;
    }
    if (!j && !quiet) fail("%s %s: the answer is not JSON: %s", method, path, je.text);
    ds41_ctl_response_free(&r);
    return j;
}

static char *call_text(const char *path, int *status) {
    ds41_ctl_response r;
    ds41_error err = {{0}};
    if (ds41_ctl_request(g_socket, "GET", path, NULL, 0, 60000, &r, &err) != 0) {
        fail("%s", err.msg);
        return NULL;
    }
    *status = r.status;
    if (r.status / 100 != 2) {
        fail("GET %s: HTTP %d: %s", path, r.status, r.body);
        ds41_ctl_response_free(&r);
        return NULL;
    }
    return r.body;
}

void print_json(const json_t *j) {
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    if (s) puts(s);
    free(s);
}

const char *jstr(const json_t *o, const char *k) {
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "";
}
long long jint(const json_t *o, const char *k) { return (long long)json_integer_value(json_object_get(o, k)); }

void human_bytes(double b, char *out, size_t n) {
    static const char *const u[] = {"B", "kB", "MB", "GB", "TB", "PB"};
    int k = 0;
    while (b >= 1000 && k < 5) {
        b /= 1000;
        k++;
    }
    snprintf(out, n, k ? "%.1f %s" : "%.0f %s", b, u[k]);
}

/* ---- tables ------------------------------------------------------------------------------------ */

void table_row(table *t, ...) {
    if (t->rows == t->cap) {
        t->cap = t->cap ? t->cap * 2 : 8;
        t->cells = realloc(t->cells, t->cap * t->cols * sizeof *t->cells);
        if (!t->cells) exit(1);
    }
    va_list ap;
    va_start(ap, t);
    for (size_t c = 0; c < t->cols; c++) {
        const char *s = va_arg(ap, const char *);
        t->cells[t->rows * t->cols + c] = strdup(s ? s : "");
    }
    va_end(ap);
    t->rows++;
}

void table_free(table *t) {
    for (size_t i = 0; i < t->rows * t->cols; i++) free(t->cells[i]);
    free(t->cells);
    t->cells = NULL;
    t->rows = t->cap = 0;
}

void table_print(table *t) {
    size_t w[16] = {0};
    for (size_t r = 0; r < t->rows; r++)
        for (size_t c = 0; c < t->cols && c < 16; c++) {
            size_t l = strlen(t->cells[r * t->cols + c]);
            if (l > w[c]) w[c] = l;
        }
    for (size_t r = 0; r < t->rows; r++) {
        for (size_t c = 0; c < t->cols; c++) {
            const char *s = t->cells[r * t->cols + c];
            if (c + 1 == t->cols)
                printf("%s", s);
            else
                printf("%-*s  ", (int)w[c], s);
        }
        putchar('\n');
    }
    table_free(t);
}

char *fmt(const char *f, ...) {
    static char ring[64][256];
    static int k;
    char *b = ring[k++ % 64];
    va_list ap;
    va_start(ap, f);
    vsnprintf(b, sizeof ring[0], f, ap);
    va_end(ap);
    return b;
}

/* ---- metrics text ---------------------------------------------------------------------------- */

/* Sum of a series' samples (every label set) in a Prometheus text; label_filter (e.g.
 * "state=\"used\"") keeps only matching lines.  NAN when absent. */
static double metric_sum(const char *text, const char *name, const char *label_filter) {
    double sum = NAN;
    size_t nl = strlen(name);
    for (const char *line = text; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (strncmp(line, name, nl) != 0 || (line[nl] != '{' && line[nl] != ' ')) continue;
        const char *eol = strchr(line, '\n');
        size_t len = eol ? (size_t)(eol - line) : strlen(line);
        if (label_filter && !memmem(line, len, label_filter, strlen(label_filter))) continue;
        const char *sp = memrchr(line, ' ', len);
        if (!sp) continue;
        double v = strtod(sp + 1, NULL);
        sum = isnan(sum) ? v : sum + v;
    }
    return sum;
}

/* ---- commands ------------------------------------------------------------------------------------ */

static int cmd_status(void) {
    int st = 0;
    json_t *health = NULL;
    {
        ds41_ctl_response r;
        ds41_error err = {{0}};
        if (ds41_ctl_request(g_socket, "GET", "/health", NULL, 0, 10000, &r, &err) != 0) return fail("%s", err.msg);
        health = json_loadb(r.body, r.body_len, 0, NULL);
        st = r.status;
        ds41_ctl_response_free(&r);
    }
    json_t *models = call_json("GET", "/v1/models", NULL, NULL, true);
    int ms;
    char *metrics = call_text("/metrics", &ms);
    double running = metrics ? metric_sum(metrics, "ds41_running_sequences", NULL) : NAN;
    double queued = metrics ? metric_sum(metrics, "ds41_queue_depth", NULL) : NAN;
    double tps = metrics ? metric_sum(metrics, "ds41_generated_tokens_per_second", NULL) : NAN;
    double gen = metrics ? metric_sum(metrics, "ds41_generated_tokens_total", NULL) : NAN;
    double spec_steps = metrics ? metric_sum(metrics, "ds41_speculative_steps_total", NULL) : NAN;
    double spec_acc = metrics ? metric_sum(metrics, "ds41_speculative_accepted_total", NULL) : NAN;
    double kv_used = metrics ? metric_sum(metrics, "ds41_kv_cache_bytes", "state=\"used\"") : NAN;
    double kv_free = metrics ? metric_sum(metrics, "ds41_kv_cache_bytes", "state=\"free\"") : NAN;
    const char *hs = health ? jstr(health, "status") : "unknown";
    /* admins only (quiet otherwise): whether users share cached prefixes */
    json_t *cache = call_json("GET", "/admin/cache", NULL, NULL, true);
    json_t *shared = cache ? json_object_get(cache, "prefix_shared_across_users") : NULL;
    if (g_json) {
        json_t *o = json_pack("{s:s s:s s:O*}", "socket", g_socket, "health", hs, "models",
                              models ? json_object_get(models, "data") : NULL);
        json_t *load = json_object();
        if (!isnan(running)) json_object_set_new(load, "running", json_integer((json_int_t)running));
        if (!isnan(queued)) json_object_set_new(load, "queued", json_integer((json_int_t)queued));
        if (!isnan(tps)) json_object_set_new(load, "tokens_per_second", json_real(tps));
        if (!isnan(gen)) json_object_set_new(load, "generated_tokens", json_integer((json_int_t)gen));
        /* tokens a verification block gives: its accepted drafts + the backbone's own token */
        if (!isnan(spec_steps) && spec_steps > 0)
            json_object_set_new(load, "speculative_mean_accepted_length",
                                json_real(1.0 + spec_acc / spec_steps));
        if (!isnan(kv_used)) json_object_set_new(load, "kv_used_bytes", json_integer((json_int_t)kv_used));
        if (!isnan(kv_free)) json_object_set_new(load, "kv_free_bytes", json_integer((json_int_t)kv_free));
        json_object_set_new(o, "load", load);
        if (json_is_boolean(shared)) json_object_set(o, "prefix_shared_across_users", shared);
        if (health && json_object_get(health, "detail"))
            json_object_set(o, "detail", json_object_get(health, "detail"));
        print_json(o);
        json_decref(o);
    } else {
        printf("ds41d:   %s (%s)%s%s\n", hs, g_socket, health && json_object_get(health, "detail") ? ": " : "",
               health ? jstr(health, "detail") : "");
        size_t i;
        json_t *m;
        json_array_foreach(json_object_get(models, "data"), i, m)
            printf("model:   %s (context %lld)\n", jstr(m, "id"), jint(m, "max_model_len"));
        if (!isnan(running))
            printf("load:    %.0f running, %.0f queued, %.1f tokens/s, %.0f tokens generated\n", running,
                   isnan(queued) ? 0 : queued, isnan(tps) ? 0 : tps, isnan(gen) ? 0 : gen);
        if (!isnan(spec_steps) && spec_steps > 0)
            printf("spec:    mean accepted length %.2f tokens per verification (%.0f blocks, %.0f drafts "
                   "accepted)\n",
                   1.0 + (isnan(spec_acc) ? 0 : spec_acc) / spec_steps, spec_steps,
                   isnan(spec_acc) ? 0 : spec_acc);
        if (!isnan(kv_used)) {
            char u[32], f[32];
            human_bytes(kv_used, u, sizeof u);
            human_bytes(isnan(kv_free) ? 0 : kv_free, f, sizeof f);
            printf("memory:  KV cache %s used, %s free\n", u, isnan(kv_free) ? "unbounded" : f);
        }
        if (json_is_boolean(shared))
            printf("cache:   prefix cache %s\n",
                   json_is_true(shared) ? "shared across users" : "per user and cache_salt (not shared)");
    }
    json_decref(cache);
    json_decref(health);
    json_decref(models);
    free(metrics);
    return st == 200 ? 0 : 1;
}

/* POST /admin/models/ACTION {"name": NAME}: the answer, or NULL with the error printed. */
static json_t *post_model_action(const char *action, const char *name) {
    json_t *body = json_pack("{s:s}", "name", name);
    char *b = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    char path[64];
    snprintf(path, sizeof path, "/admin/models/%s", action);
    json_t *j = call_json("POST", path, b, NULL, false);
    free(b);
    return j;
}

/* One redraw of the load's progress bar (a terminal only): "NAME: [####    ] 45% 1.2 GiB of
 * 2.7 GiB, 4800 of 96085 tensors", the line cleared after it. */
static void load_bar(const char *name, const json_t *load) {
    const double done = (double)jint(load, "bytes_done"), total = (double)jint(load, "bytes_total");
    const double frac = total > 0 ? done / total : 0;
    char bar[31], d[32], t[32];
    for (int i = 0; i < 30; i++) bar[i] = i < (int)(frac * 30 + 0.5) ? '#' : ' ';
    bar[30] = 0;
    human_bytes(done, d, sizeof d);
    human_bytes(total, t, sizeof t);
    printf("\r%s: %s [%s] %3d%% %s of %s, %lld of %lld tensors\033[K", name, jstr(load, "state"), bar,
           (int)(frac * 100), d, t, jint(load, "tensors_done"), jint(load, "tensors_total"));
    fflush(stdout);
}

/* `models load NAME --wait`: ask for the load, then poll /admin/models and print each change of
 * the model's state and detail (what the daemon reports while loading, with the share of the
 * weights bound) until it is ready (0) or failed or gone (1).  On a terminal the progress is one
 * bar redrawn in place instead. */
static int models_load_wait(const char *name) {
    json_t *j = post_model_action("load", name);
    if (!j) return 1;
    const bool bar = !g_json && isatty(STDOUT_FILENO);
    bool bar_drawn = false;
    char last[600] = "";
    /* The load's answer says whether it started: printed at once, since a small model can be
     * ready before the first poll sees it loading. */
    if (!g_json && !bar && strcmp(jstr(j, "status"), "loading") == 0) {
        printf("%s: loading\n", name);
        fflush(stdout);
        snprintf(last, sizeof last, "%s: loading", name);
    }
    json_decref(j);
    for (;;) {
        json_t *list = call_json("GET", "/admin/models", NULL, NULL, false);
        if (!list) return 1;
        json_t *m = NULL, *x;
        size_t i;
        json_array_foreach(json_object_get(list, "data"), i, x) if (strcmp(jstr(x, "id"), name) == 0) m = x;
        if (!m) {
            json_decref(list);
            return fail("%s: no longer configured", name);
        }
        const char *state = jstr(m, "state"), *detail = jstr(m, "detail");
        const bool ready = strcmp(state, "ready") == 0, failed = strcmp(state, "failed") == 0,
                   gone = strcmp(state, "unloaded") == 0;
        char line[600];
        snprintf(line, sizeof line, "%s: %s%s%s%s", name, state, detail[0] && !ready ? " (" : "",
                 ready ? "" : detail, detail[0] && !ready ? ")" : "");
        const json_t *load = json_object_get(m, "load");
        if (bar && strcmp(state, "loading") == 0 && json_is_object(load) && jint(load, "bytes_total") > 0) {
            load_bar(name, load);
            bar_drawn = true;
        } else if (strcmp(line, last) != 0 && !(g_json && !ready)) {
            if (bar_drawn) putchar('\n');
            bar_drawn = false;
            if (g_json)
                print_json(m);
            else
                puts(line);
            fflush(stdout);
            snprintf(last, sizeof last, "%s", line);
        }
        json_decref(list);
        if (ready) return 0;
        if (failed || gone)
            return fail("%s: %s", name, failed ? "the load failed" : "unloaded while waiting");
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 200 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static int cmd_models(int argc, char **argv) {
    const char *sub = argc > 1 ? argv[1] : "ls";
    if (strcmp(sub, "ls") == 0) {
        int status;
        json_t *j = call_json("GET", "/admin/models", NULL, &status, true);
        bool admin = j != NULL;
        if (!j) {
            if (status == 0) return call_json("GET", "/admin/models", NULL, NULL, false), 1;
            j = call_json("GET", "/v1/models", NULL, NULL, false);
            if (!j) return 1;
            if (!g_json)
                fprintf(stderr, "ds41ctl: admin routes need root or the admin group; showing the served models\n");
        }
        if (g_json) {
            print_json(j);
        } else {
            table t = {.cols = admin ? 6 : 3};
            if (admin)
                table_row(&t, "NAME", "STATE", "CONTEXT", "BYTES", "PATH", "DETAIL");
            else
                table_row(&t, "NAME", "STATE", "CONTEXT");
            size_t i;
            json_t *m;
            json_array_foreach(json_object_get(j, "data"), i, m) {
                if (admin) {
                    char b[32];
                    human_bytes((double)jint(m, "bytes_total"), b, sizeof b);
                    table_row(&t, jstr(m, "id"), jstr(m, "state"), fmt("%lld", jint(m, "context_length")), b,
                              jstr(m, "path"), jstr(m, "detail"));
                } else {
                    table_row(&t, jstr(m, "id"), "ready", fmt("%lld", jint(m, "max_model_len")));
                }
            }
            table_print(&t);
        }
        json_decref(j);
        return 0;
    }
    if (strcmp(sub, "load") == 0 && argc == 4 &&
        (strcmp(argv[2], "--wait") == 0 || strcmp(argv[3], "--wait") == 0))
        return models_load_wait(strcmp(argv[2], "--wait") == 0 ? argv[3] : argv[2]);
    if ((strcmp(sub, "load") == 0 || strcmp(sub, "unload") == 0) && argc == 3) {
        json_t *j = post_model_action(sub, argv[2]);
        if (!j) return 1;
        if (g_json)
            print_json(j);
        else
            printf("%s: %s\n", argv[2], jstr(j, "status"));
        json_decref(j);
        return 0;
    }
    usage(stderr);
    return 2;
}

/* The prefix-cache partition owner of a session or snapshot: "UID (name)", "-" when unknown. */
static const char *owner_cell(const json_t *o) {
    json_t *u = json_object_get(o, "owner_uid");
    if (!json_is_integer(u)) return "-";
    struct passwd pw, *res = NULL;
    char buf[1024];
    if (getpwuid_r((uid_t)json_integer_value(u), &pw, buf, sizeof buf, &res) == 0 && res)
        return fmt("%lld (%.60s)", (long long)json_integer_value(u), res->pw_name);
    return fmt("%lld", (long long)json_integer_value(u));
}

static void sessions_table(const json_t *sessions) {
    table t = {.cols = 10};
    table_row(&t, "ID", "MODEL", "STATE", "PROMPT", "GENERATED", "CACHED", "KV_TOKENS", "KV_PAGES",
              "KV_BYTES", "OWNER");
    size_t i;
    json_t *s;
    json_array_foreach(json_object_get(sessions, "data"), i, s)
        table_row(&t, jstr(s, "id"), jstr(s, "model"), jstr(s, "state"),
                  fmt("%lld", jint(s, "prompt_tokens")), fmt("%lld", jint(s, "generated_tokens")),
                  fmt("%lld", jint(s, "cached_tokens")), fmt("%lld", jint(s, "kv_tokens")),
                  fmt("%lld", jint(s, "kv_pages")), fmt("%lld", jint(s, "kv_bytes")), owner_cell(s));
    table_print(&t);
}

/* ps [--all]: the prefix cache's entries (state "cached") only with --all. */
static int cmd_ps(int argc, char **argv) {
    bool all = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--all") == 0 || strcmp(argv[i], "-a") == 0) {
            all = true;
        } else {
            fprintf(stderr, "ds41ctl: ps: unknown argument '%s' (ps [--all])\n", argv[i]);
            return 2;
        }
    }
    json_t *j = call_json("GET", "/admin/sessions", NULL, NULL, false);
    if (!j) return 1;
    json_t *data = json_object_get(j, "data");
    for (size_t i = json_array_size(data); !all && i-- > 0;)
        if (strcmp(jstr(json_array_get(data, i), "state"), "cached") == 0) json_array_remove(data, i);
    if (g_json)
        print_json(j);
    else
        sessions_table(j);
    json_decref(j);
    return 0;
}

static int cmd_cache(void) {
    json_t *c = call_json("GET", "/admin/cache", NULL, NULL, false);
    if (!c) return 1;
    json_t *s = call_json("GET", "/admin/sessions", NULL, NULL, false);
    if (!s) {
        json_decref(c);
        return 1;
    }
    if (g_json) {
        json_t *o = json_pack("{s:O s:O}", "cache", c, "sessions", json_object_get(s, "data"));
        print_json(o);
        json_decref(o);
    } else {
        printf("KV pages: %lld used, %lld free, %lld in all; %lld tokens and %lld bytes per page; %.1f bytes per token\n",
               jint(c, "pages_used"), jint(c, "pages_free"), jint(c, "pages_total"), jint(c, "page_tokens"),
               jint(c, "page_bytes"), json_number_value(json_object_get(c, "bytes_per_token")));
        table t = {.cols = 6};
        table_row(&t, "TIER", "USED", "CAPACITY", "HITS", "MISSES", "HIT_RATE");
        size_t i;
        json_t *tier;
        json_array_foreach(json_object_get(c, "tiers"), i, tier) {
            char u[32], cap[32];
            human_bytes((double)jint(tier, "used_bytes"), u, sizeof u);
            long long capb = jint(tier, "capacity_bytes");
            const char *tn = jstr(tier, "name");
            if (capb)
                human_bytes((double)capb, cap, sizeof cap);
            else /* the CUDA backend's memory tiers have no budget of their own */
                snprintf(cap, sizeof cap, "%s",
                         strncmp(tn, "device-", 7) == 0 || strcmp(tn, "pinned-host") == 0 ? "-" : "auto");
            json_t *hr = json_object_get(tier, "hit_rate");
            table_row(&t, jstr(tier, "name"), u, cap, fmt("%lld", jint(tier, "hits")), fmt("%lld", jint(tier, "misses")),
                      json_is_number(hr) ? fmt("%.1f%%", 100 * json_number_value(hr)) : "-");
        }
        table_print(&t);
        if (jstr(c, "budgets")[0]) printf("%s\n", jstr(c, "budgets"));
        printf("prefix cache: %s\n", json_is_true(json_object_get(c, "prefix_shared_across_users"))
                                         ? "shared across users (prefix_cache.share_across_users)"
                                         : "one partition per user and cache_salt (not shared across users)");
        json_array_foreach(json_object_get(c, "tiers"), i, tier) {
            if (strcmp(jstr(tier, "name"), "experts") != 0) continue;
            char tot[32], rd[32];
            human_bytes((double)jint(tier, "total_bytes"), tot, sizeof tot);
            if (json_is_true(json_object_get(tier, "streamed"))) {
                human_bytes((double)jint(tier, "bytes_read"), rd, sizeof rd);
                json_t *acc = json_object_get(tier, "prediction_accuracy");
                printf("experts: streamed from disk (%s of routed experts); %s read, load latency p50 %.2f ms p99 "
                       "%.2f ms; prediction accuracy %s (%lld of %lld predicted used)\n",
                       tot, rd, (double)jint(tier, "latency_p50_ns") / 1e6, (double)jint(tier, "latency_p99_ns") / 1e6,
                       json_is_number(acc) ? fmt("%.1f%%", 100 * json_number_value(acc)) : "-",
                       jint(tier, "predicted_used"), jint(tier, "predicted"));
            } else {
                printf("experts: all resident (%s of routed experts, used in place from the checkpoint)\n", tot);
            }
        }
        putchar('\n');
        sessions_table(s);
    }
    json_decref(c);
    json_decref(s);
    return 0;
}

/* A session or snapshot id as a path segment: refused when it could leave it. */
static bool path_segment_ok(const char *id) {
    if (!*id) return false;
    for (const char *p = id; *p; p++)
        if (*p == '/' || *p == '?' || *p == '#' || *p == '%' || (unsigned char)*p <= ' ' || *p == 0x7f)
            return false;
    return true;
}

/* cancel SESSION (kill SESSION): DELETE /admin/sessions/ID -- a live request is cancelled (its
 * client gets the "cancelled" error), a prefix-cache entry is dropped. */
static int cmd_cancel(const char *id) {
    if (!path_segment_ok(id)) return fail("not a session id: %s", id), 2;
    char path[600];
    snprintf(path, sizeof path, "/admin/sessions/%.500s", id);
    json_t *j = call_json("DELETE", path, NULL, NULL, false);
    if (!j) return 1;
    if (g_json)
        print_json(j);
    else
        printf("%s: %s\n", id,
               strrchr(id, ':') && strrchr(id, ':')[1] == 'c' ? "dropped from the prefix cache"
                                                              : "cancelled");
    json_decref(j);
    return 0;
}

/* cache ls | save SESSION | restore SNAPSHOT | rm SNAPSHOT */
static int cmd_cache_snapshots(int argc, char **argv) {
    const char *sub = argv[1];
    if (strcmp(sub, "ls") == 0 && argc == 2) {
        json_t *j = call_json("GET", "/admin/snapshots", NULL, NULL, false);
        if (!j) return 1;
        if (g_json) {
            print_json(j);
        } else {
            table t = {.cols = 7};
            table_row(&t, "SNAPSHOT", "TOKENS", "SIZE", "CREATED", "LAST_USED", "SAMPLER", "OWNER");
            size_t i;
            json_t *e;
            json_array_foreach(json_object_get(j, "data"), i, e) {
                char size[32], created[32], used[32];
                human_bytes((double)jint(e, "bytes"), size, sizeof size);
                time_t c = (time_t)jint(e, "created"), u = (time_t)jint(e, "last_used");
                struct tm tc, tu;
                strftime(created, sizeof created, "%Y-%m-%d %H:%M:%S", localtime_r(&c, &tc));
                strftime(used, sizeof used, "%Y-%m-%d %H:%M:%S", localtime_r(&u, &tu));
                table_row(&t, jstr(e, "id"), fmt("%lld", jint(e, "tokens")), size, created, used,
                          json_is_true(json_object_get(e, "sampler_state")) ? "yes" : "no", owner_cell(e));
            }
            table_print(&t);
        }
        json_decref(j);
        return 0;
    }
    if ((strcmp(sub, "save") == 0 || strcmp(sub, "restore") == 0 || strcmp(sub, "rm") == 0) && argc == 3) {
        const char *arg = argv[2];
        json_t *j;
        if (strcmp(sub, "rm") == 0) {
            if (!path_segment_ok(arg)) return fail("not a snapshot id: %s", arg);
            char path[600];
            snprintf(path, sizeof path, "/admin/snapshots/%.500s", arg);
            j = call_json("DELETE", path, NULL, NULL, false);
        } else {
            bool save = strcmp(sub, "save") == 0;
            json_t *body = json_pack("{s:s}", save ? "session" : "id", arg);
            char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
            json_decref(body);
            if (!text) return fail("out of memory");
            j = call_json("POST", save ? "/admin/snapshots/save" : "/admin/snapshots/restore", text, NULL, false);
            free(text);
        }
        if (!j) return 1;
        if (g_json) {
            print_json(j);
        } else if (strcmp(sub, "save") == 0) {
            char size[32];
            human_bytes((double)jint(j, "bytes"), size, sizeof size);
            printf("saved %s as %s (%lld tokens, %s%s)\n", arg, jstr(j, "id"), jint(j, "tokens"), size,
                   json_is_true(json_object_get(j, "sampler_state")) ? ", with its sampler state" : "");
        } else if (strcmp(sub, "restore") == 0) {
            printf("restored %s into the prefix cache as %s (%lld tokens)\n", arg, jstr(j, "session"),
                   jint(j, "tokens"));
        } else {
            printf("deleted %s\n", arg);
        }
        json_decref(j);
        return 0;
    }
    fprintf(stderr, "ds41ctl: cache: expected ls, save SESSION, restore SNAPSHOT or rm SNAPSHOT\n");
    return 2;
}

/* cache --set-expert-bytes SIZE [--model M]: POST /admin/cache/experts. */
static int cmd_cache_set(int argc, char **argv) {
    const char *size = NULL, *model = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--set-expert-bytes") == 0 && i + 1 < argc)
            size = argv[++i];
        else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc)
            model = argv[++i];
        else {
            fprintf(stderr, "ds41ctl: cache: unknown argument '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!size) {
        fprintf(stderr, "ds41ctl: cache: --set-expert-bytes SIZE is required with --model\n");
        return 2;
    }
    json_t *body = json_object();
    json_object_set_new(body, "bytes", json_string(size));
    if (model) json_object_set_new(body, "model", json_string(model));
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    if (!text) return fail("out of memory");
    json_t *j = call_json("POST", "/admin/cache/experts", text, NULL, false);
    free(text);
    if (!j) return 1;
    long long chosen = jint(j, "expert_cache_bytes");
    char hb[32];
    human_bytes((double)chosen, hb, sizeof hb);
    if (g_json)
        print_json(j);
    else if (!chosen)
        printf("expert budget set to %sall routed experts resident (applies from the next forward step)\n",
               json_is_true(json_object_get(j, "auto")) ? "auto: " : "");
    else
        printf("expert budget set to %s%lld bytes (%s; applies from the next forward step)\n",
               json_is_true(json_object_get(j, "auto")) ? "auto: " : "", chosen, hb);
    json_decref(j);
    return 0;
}

static int cmd_metrics(void) {
    int st;
    char *text = call_text("/metrics", &st);
    if (!text) return 1;
    if (!g_json) {
        fputs(text, stdout);
        free(text);
        return 0;
    }
    json_t *arr = json_array();
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#' || !line[0]) continue;
        char *sp = strrchr(line, ' ');
        if (!sp) continue;
        *sp = 0;
        json_t *labels = json_object();
        char *brace = strchr(line, '{');
        if (brace) {
            *brace = 0;
            char *p = brace + 1;
            while (*p && *p != '}') {
                char *eq = strchr(p, '=');
                if (!eq || eq[1] != '"') break;
                *eq = 0;
                char *v = eq + 2, *q = v;
                ds41_buf val = {0};
                while (*q && *q != '"') {
                    if (*q == '\\' && q[1]) q++;
                    ds41_buf_putc(&val, *q++);
                }
                ds41_buf_putc(&val, 0);
                json_object_set_new(labels, p, json_string(val.data ? val.data : ""));
                ds41_buf_free(&val);
                p = *q ? q + 1 : q;
                if (*p == ',') p++;
            }
        }
        json_array_append_new(arr, json_pack("{s:s s:o s:f}", "name", line, "labels", labels, "value", strtod(sp + 1, NULL)));
    }
    print_json(arr);
    json_decref(arr);
    free(text);
    return 0;
}

/* ---- streaming chat / generate ---------------------------------------------------------------- */

typedef struct stream_state {
    bool tty;
    bool in_reasoning;
    ds41_buf content, reasoning; /* the whole answer (for the conversation history) */
    json_t *tool_calls;          /* index -> call */
    char finish[32];
    char error[512];
    json_t *usage;
    bool first_token_seen;
    double t_first;
} stream_state;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The model's text to stdout.  On a terminal, control characters other than newline and tab
 * (C0, DEL, C1) are written escaped (\x1b, \x7f, \u009b): a model's output must not move the
 * cursor, retitle the window or inject terminal sequences.  Piped, the text goes as it is, so
 * scripts get the exact answer (--json escapes everything anyway). */
static void put_model_text(const stream_state *s, const char *t) {
    if (!s->tty) {
        fputs(t, stdout);
        return;
    }
    const unsigned char *p = (const unsigned char *)t, *run = p;
    for (; *p; p++) {
        bool c0 = (*p < 0x20 && *p != '\n' && *p != '\t') || *p == 0x7f;
        bool c1 = *p == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f;
        if (!c0 && !c1) continue;
        fwrite(run, 1, (size_t)(p - run), stdout);
        if (c0) {
            printf("\\x%02x", *p);
        } else {
            printf("\\u%04x", p[1]);
            p++;
        }
        run = p + 1;
    }
    fwrite(run, 1, (size_t)(p - run), stdout);
}

static bool on_chat_event(void *ctx, const char *data, size_t len) {
    stream_state *s = ctx;
    if (len == 6 && memcmp(data, "[DONE]", 6) == 0) return true;
    json_t *ev = json_loadb(data, len, 0, NULL);
    if (!ev) return true;
    json_t *e = json_object_get(ev, "error");
    if (e) snprintf(s->error, sizeof s->error, "%s", jstr(e, "message"));
    json_t *u = json_object_get(ev, "usage");
    if (json_is_object(u)) {
        json_decref(s->usage);
        s->usage = json_incref(u);
    }
    size_t i;
    json_t *ch;
    json_array_foreach(json_object_get(ev, "choices"), i, ch) {
        json_t *d = json_object_get(ch, "delta");
        const char *r = json_string_value(json_object_get(d, "reasoning_content"));
        const char *c = json_string_value(json_object_get(d, "content"));
        if (!d) c = json_string_value(json_object_get(ch, "text"));
        if ((r && *r) || (c && *c)) {
            if (!s->first_token_seen) s->t_first = now_s();
            s->first_token_seen = true;
        }
        if (r && *r) {
            if (!s->in_reasoning) {
                fputs(s->tty ? "\033[2m" : "[reasoning] ", stdout);
                s->in_reasoning = true;
            }
            put_model_text(s, r);
            ds41_buf_puts(&s->reasoning, r);
        }
        if (c && *c) {
            if (s->in_reasoning) {
                fputs(s->tty ? "\033[0m\n" : "\n[answer] ", stdout);
                s->in_reasoning = false;
            }
            put_model_text(s, c);
            ds41_buf_puts(&s->content, c);
        }
        size_t k;
        json_t *tc;
        json_array_foreach(json_object_get(d, "tool_calls"), k, tc) {
            char idx[16];
            snprintf(idx, sizeof idx, "%lld", jint(tc, "index"));
            json_t *call = json_object_get(s->tool_calls, idx);
            if (!call) {
                call = json_pack("{s:s s:s s:{s:s s:s}}", "id", jstr(tc, "id"), "type", "function", "function", "name", "",
                                 "arguments", "");
                json_object_set_new(s->tool_calls, idx, call);
            }
            /* streamed as OpenAI does: the name in the first delta, arguments in pieces (any length) */
            json_t *f = json_object_get(tc, "function"), *cf = json_object_get(call, "function");
            static const char *const fields[] = {"name", "arguments"};
            for (int fi = 0; fi < 2; fi++) {
                ds41_buf joined = {0};
                ds41_buf_puts(&joined, jstr(cf, fields[fi]));
                ds41_buf_puts(&joined, jstr(f, fields[fi]));
                if (!joined.oom) json_object_set_new(cf, fields[fi], json_stringn(joined.data ? joined.data : "", joined.len));
                ds41_buf_free(&joined);
            }
        }
        const char *fr = json_string_value(json_object_get(ch, "finish_reason"));
        if (fr) snprintf(s->finish, sizeof s->finish, "%s", fr);
    }
    fflush(stdout);
    json_decref(ev);
    return true;
}

static void stream_end(stream_state *s) {
    if (s->in_reasoning && s->tty) fputs("\033[0m", stdout);
    s->in_reasoning = false;
    const char *k;
    json_t *call;
    json_object_foreach(s->tool_calls, k, call) {
        json_t *f = json_object_get(call, "function");
        fputs("\n[tool call] ", stdout);
        put_model_text(s, jstr(f, "name"));
        putchar(' ');
        put_model_text(s, jstr(f, "arguments"));
    }
    putchar('\n');
    fflush(stdout);
}

typedef struct gen_opts {
    const char *model, *system;
    bool thinking;
    long effort;
    long max_tokens;
    double temperature;
    bool has_temperature;
    long long seed;
    bool has_seed;
} gen_opts;

static int parse_gen_opts(int argc, char **argv, gen_opts *o, int *first_arg) {
    static const struct option lo[] = {
        {"model", required_argument, NULL, 'm'},      {"system", required_argument, NULL, 'S'},
        {"thinking", no_argument, NULL, 't'},         {"effort", required_argument, NULL, 'e'},
        {"max-tokens", required_argument, NULL, 'n'}, {"temperature", required_argument, NULL, 'T'},
        {"seed", required_argument, NULL, 's'},       {NULL, 0, NULL, 0},
    };
    memset(o, 0, sizeof *o);
    optind = 0; /* 0, not 1: glibc then re-initialises, dropping the "+" (stop at the first non-option) mode of the top-level parse */
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        char *end;
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'S': o->system = optarg; break;
        case 't': o->thinking = true; break;
        case 'e':
            o->effort = strtol(optarg, &end, 10);
            if (*end || o->effort < 1 || o->effort > 100) return fail("--effort: expected 1..100"), 2;
            o->thinking = true;
            break;
        case 'n':
            o->max_tokens = strtol(optarg, &end, 10);
            if (*end || o->max_tokens < 1) return fail("--max-tokens: expected an integer >= 1"), 2;
            break;
        case 'T':
            o->temperature = strtod(optarg, &end);
            if (*end || o->temperature < 0 || o->temperature > 2) return fail("--temperature: expected 0..2"), 2;
            o->has_temperature = true;
            break;
        case 's':
            o->seed = strtoll(optarg, &end, 10);
            if (*end) return fail("--seed: expected an integer"), 2;
            o->has_seed = true;
            break;
        default: return 2;
        }
    }
    *first_arg = optind;
    return 0;
}

static void add_gen_fields(json_t *req, const gen_opts *o) {
    if (o->model) json_object_set_new(req, "model", json_string(o->model));
    if (o->max_tokens) json_object_set_new(req, "max_tokens", json_integer(o->max_tokens));
    if (o->has_temperature) json_object_set_new(req, "temperature", json_real(o->temperature));
    if (o->has_seed) json_object_set_new(req, "seed", json_integer(o->seed));
}

/* One chat turn: streamed to stdout (or, with --json, the whole response printed). */
static int chat_turn(json_t *messages, const gen_opts *o, json_t **assistant) {
    json_t *req = json_pack("{s:O}", "messages", messages);
    add_gen_fields(req, o);
    if (o->thinking) {
        if (o->effort)
            json_object_set_new(req, "reasoning_effort", json_integer(o->effort));
        else
            json_object_set_new(req, "thinking", json_pack("{s:s}", "type", "enabled"));
    }
    if (g_json) {
        char *b = json_dumps(req, JSON_COMPACT);
        json_decref(req);
        json_t *r = call_json("POST", "/v1/chat/completions", b, NULL, false);
        free(b);
        if (!r) return 1;
        print_json(r);
        if (assistant) *assistant = json_incref(json_object_get(json_array_get(json_object_get(r, "choices"), 0), "message"));
        json_decref(r);
        return 0;
    }
    json_object_set_new(req, "stream", json_true());
    char *b = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    stream_state s = {.tty = isatty(STDOUT_FILENO), .tool_calls = json_object()};
    ds41_ctl_response r;
    ds41_error err = {{0}};
    int rc = ds41_ctl_stream(g_socket, "/v1/chat/completions", b, strlen(b), on_chat_event, &s, &r, &err);
    free(b);
    if (rc != 0) {
        rc = fail("%s", err.msg);
    } else if (r.status / 100 != 2) {
        json_t *j = json_loadb(r.body, r.body_len, 0, NULL);
        const char *msg = j ? json_string_value(json_object_get(json_object_get(j, "error"), "message")) : NULL;
        rc = fail("HTTP %d: %s", r.status, msg ? msg : r.body);
        json_decref(j);
    } else {
        stream_end(&s);
        if (s.error[0]) rc = fail("%s", s.error);
        if (assistant) {
            *assistant = json_pack("{s:s s:s%}", "role", "assistant", "content", s.content.data ? s.content.data : "",
                                   s.content.len);
            if (json_object_size(s.tool_calls)) {
                json_t *arr = json_array();
                const char *k;
                json_t *c;
                json_object_foreach(s.tool_calls, k, c) json_array_append(arr, c);
                json_object_set_new(*assistant, "tool_calls", arr);
            }
        }
    }
    ds41_ctl_response_free(&r);
    ds41_buf_free(&s.content);
    ds41_buf_free(&s.reasoning);
    json_decref(s.tool_calls);
    json_decref(s.usage);
    return rc;
}

static int cmd_chat(int argc, char **argv) {
    gen_opts o;
    int first;
    int prc = parse_gen_opts(argc, argv, &o, &first);
    if (prc) return prc;
    json_t *messages = json_array();
    if (o.system) json_array_append_new(messages, json_pack("{s:s s:s}", "role", "system", "content", o.system));
    if (first < argc) {
        ds41_buf prompt = {0};
        for (int i = first; i < argc; i++) {
            if (i > first) ds41_buf_putc(&prompt, ' ');
            ds41_buf_puts(&prompt, argv[i]);
        }
        json_array_append_new(messages, json_pack("{s:s s:s}", "role", "user", "content", prompt.data));
        ds41_buf_free(&prompt);
        int rc = chat_turn(messages, &o, NULL);
        json_decref(messages);
        return rc;
    }
    /* interactive: one line per user turn, the conversation kept */
    bool tty = isatty(STDIN_FILENO);
    char *line = NULL;
    size_t cap = 0;
    int rc = 0;
    for (;;) {
        if (tty) {
            fputs("> ", stdout);
            fflush(stdout);
        }
        ssize_t got = getline(&line, &cap, stdin);
        if (got < 0) break;
        while (got > 0 && (line[got - 1] == '\n' || line[got - 1] == '\r')) line[--got] = 0;
        if (!got) continue;
        json_array_append_new(messages, json_pack("{s:s s:s}", "role", "user", "content", line));
        json_t *assistant = NULL;
        rc = chat_turn(messages, &o, &assistant);
        if (rc != 0) break;
        if (assistant) json_array_append_new(messages, assistant);
    }
    if (tty) putchar('\n');
    free(line);
    json_decref(messages);
    return rc;
}

static int cmd_generate(int argc, char **argv) {
    gen_opts o;
    int first;
    int prc = parse_gen_opts(argc, argv, &o, &first);
    if (prc) return prc;
    if (first >= argc) return fail("generate: a PROMPT is needed"), 2;
    ds41_buf prompt = {0};
    for (int i = first; i < argc; i++) {
        if (i > first) ds41_buf_putc(&prompt, ' ');
        ds41_buf_puts(&prompt, argv[i]);
    }
    json_t *req = json_pack("{s:s}", "prompt", prompt.data);
    ds41_buf_free(&prompt);
    add_gen_fields(req, &o);
    if (!o.max_tokens) json_object_set_new(req, "max_tokens", json_integer(256));
    if (g_json) {
        char *b = json_dumps(req, JSON_COMPACT);
        json_decref(req);
        json_t *r = call_json("POST", "/v1/completions", b, NULL, false);
        free(b);
        if (!r) return 1;
        print_json(r);
        json_decref(r);
        return 0;
    }
    json_object_set_new(req, "stream", json_true());
    char *b = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    stream_state s = {.tty = isatty(STDOUT_FILENO), .tool_calls = json_object()};
    ds41_ctl_response r;
    ds41_error err = {{0}};
    int rc = ds41_ctl_stream(g_socket, "/v1/completions", b, strlen(b), on_chat_event, &s, &r, &err);
    free(b);
    if (rc != 0)
        rc = fail("%s", err.msg);
    else if (r.status / 100 != 2)
        rc = fail("HTTP %d: %s", r.status, r.body);
    else {
        stream_end(&s);
        if (s.error[0]) rc = fail("%s", s.error);
    }
    ds41_ctl_response_free(&r);
    ds41_buf_free(&s.content);
    ds41_buf_free(&s.reasoning);
    json_decref(s.tool_calls);
    json_decref(s.usage);
    return rc;
}

/* ---- bench ------------------------------------------------------------------------------------------ */

typedef struct bench_job {
    int index;
    long prompt_tokens, max_tokens;
    const char *model;
    double ttft, total;
    double decode_from, decode_to; /* when its decode ran (first token to end, now_s() time) */
    long completion, prompt_seen;
    bool ok;
    char error[256];
} bench_job;

typedef struct bench_shared {
    pthread_mutex_t mu;
    int next, n;
    bench_job *jobs;
} bench_shared;

static bool on_bench_event(void *ctx, const char *data, size_t len) {
    stream_state *s = ctx;
    if (len == 6 && memcmp(data, "[DONE]", 6) == 0) return true;
    json_t *ev = json_loadb(data, len, 0, NULL);
    if (!ev) return true;
    json_t *e = json_object_get(ev, "error");
    if (e) snprintf(s->error, sizeof s->error, "%s", jstr(e, "message"));
    json_t *u = json_object_get(ev, "usage");
    if (json_is_object(u)) {
        json_decref(s->usage);
        s->usage = json_incref(u);
    }
    if (!s->first_token_seen && json_array_size(json_object_get(ev, "choices"))) {
        s->first_token_seen = true;
        s->t_first = now_s();
    }
    json_decref(ev);
    return true;
}

static void *bench_worker(void *p) {
    bench_shared *sh = p;
    for (;;) {
        pthread_mutex_lock(&sh->mu);
        int i = sh->next < sh->n ? sh->next++ : -1;
        pthread_mutex_unlock(&sh->mu);
        if (i < 0) return NULL;
        bench_job *j = &sh->jobs[i];
        json_t *ids = json_array();
        uint64_t x = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1);
        for (long k = 0; k < j->prompt_tokens; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            json_array_append_new(ids, json_integer(3 + (json_int_t)((x >> 33) % 250)));
        }
        json_t *req = json_pack("{s:o s:I s:b s:b s:{s:b} s:I}", "prompt", ids, "max_tokens", (json_int_t)j->max_tokens,
                                "ignore_eos", 1, "stream", 1, "stream_options", "include_usage", 1, "seed", (json_int_t)i);
        if (j->model) json_object_set_new(req, "model", json_string(j->model));
        char *b = json_dumps(req, JSON_COMPACT);
        json_decref(req);
        stream_state s = {0};
        ds41_ctl_response r;
        ds41_error err = {{0}};
        double t0 = now_s();
        int rc = ds41_ctl_stream(g_socket, "/v1/completions", b, strlen(b), on_bench_event, &s, &r, &err);
        double t1 = now_s();
        free(b);
        if (rc != 0)
            snprintf(j->error, sizeof j->error, "%.250s", err.msg);
        else if (r.status / 100 != 2)
            snprintf(j->error, sizeof j->error, "HTTP %d", r.status);
        else if (s.error[0])
            snprintf(j->error, sizeof j->error, "%.250s", s.error);
        else {
            j->ok = true;
            j->ttft = (s.first_token_seen ? s.t_first : t1) - t0;
            j->total = t1 - t0;
            j->decode_from = s.first_token_seen ? s.t_first : t1;
            j->decode_to = t1;
            j->completion = (long)jint(s.usage, "completion_tokens");
            j->prompt_seen = (long)jint(s.usage, "prompt_tokens");
        }
        ds41_ctl_response_free(&r);
        json_decref(s.usage);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Seconds covered by at least one successful request's decode interval. */
static double bench_decode_union(const bench_job *jobs, long n) {
    double *iv = malloc((size_t)(n ? n : 1) * 2 * sizeof *iv);
    if (!iv) return 0;
    long k = 0;
    for (long i = 0; i < n; i++) {
        if (!jobs[i].ok || jobs[i].completion < 2 || jobs[i].decode_to <= jobs[i].decode_from) continue;
        iv[2 * k] = jobs[i].decode_from;
        iv[2 * k + 1] = jobs[i].decode_to;
        k++;
    }
    qsort(iv, (size_t)k, 2 * sizeof *iv, cmp_double); /* by start (pairs sort by their first member) */
    double sum = 0, from = 0, to = 0;
    for (long i = 0; i < k; i++) {
        if (i == 0 || iv[2 * i] > to) {
            sum += to - from;
            from = iv[2 * i];
            to = iv[2 * i + 1];
        } else if (iv[2 * i + 1] > to) {
            to = iv[2 * i + 1];
        }
    }
    if (k) sum += to - from;
    free(iv);
    return sum;
}

static int cmd_bench(int argc, char **argv) {
    static const struct option lo[] = {
        {"requests", required_argument, NULL, 'r'},      {"concurrency", required_argument, NULL, 'c'},
        {"prompt-tokens", required_argument, NULL, 'p'}, {"max-tokens", required_argument, NULL, 'n'},
        {"model", required_argument, NULL, 'm'},         {NULL, 0, NULL, 0},
    };
    long requests = 8, conc = 4, ptok = 128, mtok = 32;
    const char *model = NULL;
    optind = 0; /* 0, not 1: glibc then re-initialises, dropping the "+" (stop at the first non-option) mode of the top-level parse */
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        char *end;
        long v = optarg ? strtol(optarg, &end, 10) : 0;
        if (c != 'm' && (!optarg || *end || v < 1 || v > 1000000)) return fail("bench: bad value for an option"), 2;
        switch (c) {
        case 'r': requests = v; break;
        case 'c': conc = v; break;
        case 'p': ptok = v; break;
        case 'n': mtok = v; break;
        case 'm': model = optarg; break;
        default: return 2;
        }
    }
    if (optind != argc) return fail("bench: unexpected argument '%s'", argv[optind]), 2;
    if (conc > requests) conc = requests;
    if (conc > 256) conc = 256;
    bench_shared sh = {.n = (int)requests};
    pthread_mutex_init(&sh.mu, NULL);
    sh.jobs = calloc((size_t)requests, sizeof *sh.jobs);
    for (long i = 0; i < requests; i++)
        sh.jobs[i] = (bench_job){.index = (int)i, .prompt_tokens = ptok, .max_tokens = mtok, .model = model};
    pthread_t th[256];
    double t0 = now_s();
    for (long i = 0; i < conc; i++) pthread_create(&th[i], NULL, bench_worker, &sh);
    for (long i = 0; i < conc; i++) pthread_join(th[i], NULL);
    double wall = now_s() - t0;
    long ok = 0, gen = 0, prompt = 0, decode_tokens = 0;
    double ttft = 0, decode_s = 0;
    const char *first_err = NULL;
    for (long i = 0; i < requests; i++) {
        bench_job *j = &sh.jobs[i];
        if (!j->ok) {
            if (!first_err) first_err = j->error;
            continue;
        }
        ok++;
        gen += j->completion;
        prompt += j->prompt_seen;
        ttft += j->ttft;
        if (j->decode_to > j->decode_from && j->completion > 1) {
            decode_tokens += j->completion - 1;
            decode_s += j->decode_to - j->decode_from;
        }
    }
    double mean_ttft = ok ? ttft / (double)ok : 0;
    /* Decode rates: per request, the decode tokens over the seconds each request spent decoding
     * (summed); in all, the same tokens over the seconds during which any request was decoding
     * (the union of those intervals, so prefill-only stretches and the gaps between sequential
     * requests are not counted).  The union is never longer than the sum: in all >= per
     * request, equal when the requests ran one after another. */
    double decode_union = bench_decode_union(sh.jobs, requests);
    double rate_per_request = decode_s > 0 ? (double)decode_tokens / decode_s : 0.0;
    double rate_all = decode_union > 0 ? (double)decode_tokens / decode_union : 0.0;
    if (g_json) {
        json_t *o = json_pack(
            "{s:I s:I s:I s:I s:I s:f s:I s:I s:f s:f s:f s:f s:f}", "requests", (json_int_t)requests,
            "succeeded", (json_int_t)ok, "concurrency", (json_int_t)conc, "prompt_tokens", (json_int_t)ptok,
            "max_tokens", (json_int_t)mtok, "wall_seconds", wall, "total_prompt_tokens", (json_int_t)prompt,
            "total_generated_tokens", (json_int_t)gen, "mean_time_to_first_token_s", mean_ttft,
            "prefill_tokens_per_s", mean_ttft > 0 ? (double)ptok / mean_ttft : 0.0,
            "decode_tokens_per_s_per_request", rate_per_request, "decode_tokens_per_s", rate_all,
            "generated_tokens_per_s", wall > 0 ? (double)gen / wall : 0.0);
        if (first_err) json_object_set_new(o, "first_error", json_string(first_err));
        print_json(o);
        json_decref(o);
    } else {
        printf("requests:        %ld of %ld succeeded (%ld at a time), %ld prompt + %ld generated tokens each\n", ok,
               requests, conc, ptok, mtok);
        printf("wall time:       %.3f s\n", wall);
        printf("prefill:         %.3f s to the first token on average (%.1f prompt tokens/s per request)\n", mean_ttft,
               mean_ttft > 0 ? (double)ptok / mean_ttft : 0.0);
        printf("decode:          %.1f tokens/s per request, %.1f tokens/s in all\n", rate_per_request,
               rate_all);
        printf("overall:         %.1f generated tokens/s over the wall time (prefill included)\n",
               wall > 0 ? (double)gen / wall : 0.0);
        if (first_err) printf("first error:     %s\n", first_err);
    }
    free(sh.jobs);
    pthread_mutex_destroy(&sh.mu);
    return ok == requests ? 0 : 1;
}

/* ---- main ---------------------------------------------------------------------------------------------- */

/* The global options given after the command (ds41ctl status --json) are taken out of its
 * arguments, up to a "--" (after which everything is the command's); 1 = --help / --version done
 * (*rc set), 0 = go on. */
static int take_global_opts(int *argc, char **argv, int *rc) {
    int w = 1;
    bool rest = false;
    for (int i = 1; i < *argc; i++) {
        const char *a = argv[i];
        if (rest || strncmp(a, "--", 2) != 0) {
            argv[w++] = argv[i];
        } else if (strcmp(a, "--") == 0) {
            rest = true;
            argv[w++] = argv[i];
        } else if (strcmp(a, "--json") == 0) {
            g_json = true;
        } else if (strcmp(a, "--socket") == 0 && i + 1 < *argc) {
            g_socket = argv[++i];
        } else if (strncmp(a, "--socket=", 9) == 0) {
            g_socket = a + 9;
        } else if (strcmp(a, "--help") == 0) {
            usage(stdout);
            return *rc = 0, 1;
        } else if (strcmp(a, "--version") == 0) {
            puts("ds41ctl " DS41_VERSION);
            return *rc = 0, 1;
        } else {
            argv[w++] = argv[i];
        }
    }
    argv[w] = NULL;
    *argc = w;
    return 0;
}

int main(int argc, char **argv) {
    static const struct option lo[] = {{"socket", required_argument, NULL, 's'},
                                       {"json", no_argument, NULL, 'j'},
                                       {"help", no_argument, NULL, 'h'},
                                       {"version", no_argument, NULL, 'V'},
                                       {NULL, 0, NULL, 0}};
    const char *env = getenv("DS41_SOCKET");
    if (env && *env) g_socket = env;
    int c;
    while ((c = getopt_long(argc, argv, "+h", lo, NULL)) != -1) {
        switch (c) {
        case 's': g_socket = optarg; break;
        case 'j': g_json = true; break;
        case 'h': usage(stdout); return 0;
        case 'V':
            puts("ds41ctl " DS41_VERSION);
            return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[optind];
    int sub_argc = argc - optind;
    char **sub_argv = argv + optind;
    int rc;
    if (take_global_opts(&sub_argc, sub_argv, &rc)) return rc;
    if (strcmp(cmd, "status") == 0 && sub_argc == 1) return cmd_status();
    if (strcmp(cmd, "models") == 0) return cmd_models(sub_argc, sub_argv);
    if (strcmp(cmd, "ps") == 0) return cmd_ps(sub_argc, sub_argv);
    if ((strcmp(cmd, "cancel") == 0 || strcmp(cmd, "kill") == 0) && sub_argc == 2)
        return cmd_cancel(sub_argv[1]);
    if (strcmp(cmd, "cache") == 0 && sub_argc == 1) return cmd_cache();
    if (strcmp(cmd, "cache") == 0 && sub_argc > 1 && strncmp(sub_argv[1], "--", 2) == 0)
        return cmd_cache_set(sub_argc, sub_argv);
    if (strcmp(cmd, "cache") == 0) return cmd_cache_snapshots(sub_argc, sub_argv);
    if (strcmp(cmd, "chat") == 0) return cmd_chat(sub_argc, sub_argv);
    if (strcmp(cmd, "generate") == 0) return cmd_generate(sub_argc, sub_argv);
    if (strcmp(cmd, "bench") == 0) return cmd_bench(sub_argc, sub_argv);
    if (strcmp(cmd, "doctor") == 0) return cmd_doctor(sub_argc, sub_argv);
    if (strcmp(cmd, "metrics") == 0 && sub_argc == 1) return cmd_metrics();
    fprintf(stderr, "ds41ctl: unknown command or arguments: %s\n", cmd);
    usage(stderr);
    return 2;
}
