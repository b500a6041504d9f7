/* Automatic memory budgets (see auto_budget.h for the policy and contract). */
#include "engine/serve/auto_budget.h"

#include "config/daemon_config.h"
#include "engine/model/tensor_plan.h"
#include "storage/expert_cache.h"
#include "storage/safetensors.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GIB (1ull << 30)

/* ---- 1. memory ------------------------------------------------------------------------ */

int ds41_mem_parse_meminfo(const char *text, uint64_t *bytes, ds41_error *err) {
    static const char key[] = "MemAvailable:";
    for (const char *line = text; line && *line;) {
        if (strncmp(line, key, sizeof key - 1) == 0) {
            const char *p = line + sizeof key - 1;
            while (*p == ' ' || *p == '\t') p++;
            if (*p < '0' || *p > '9') break;
            errno = 0;
            char *end;
            unsigned long long kib = strtoull(p, &end, 10);
            while (*end == ' ' || *end == '\t') end++;
            /* The kernel writes "kB" (KiB); refuse anything else rather than guess. */
            if (errno || strncmp(end, "kB", 2) != 0 || kib > UINT64_MAX / 1024)
                return ds41_fail(err, "/proc/meminfo: malformed MemAvailable line");
            *bytes = (uint64_t)kib * 1024;
            return 0;
        }
        line = strchr(line, '\n');
        if (line) line++;
    }
    return ds41_fail(err, "/proc/meminfo: no MemAvailable line");
}

int ds41_mem_parse_proc_cgroup(const char *text, char *path, size_t size, ds41_error *err) {
    for (const char *line = text; line && *line;) {
        const char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        /* cgroup v2: hierarchy id 0, no controllers: "0::/path". */
        if (len >= 3 && memcmp(line, "0::", 3) == 0) {
            const char *p = line + 3;
            size_t n = len - 3;
            if (n == 0 || p[0] != '/') return ds41_fail(err, "/proc/self/cgroup: the v2 path does not start with '/'");
            if (n >= size) return ds41_fail(err, "/proc/self/cgroup: the v2 path is too long");
            memcpy(path, p, n);
            path[n] = 0;
            return 1;
        }
        line = nl ? nl + 1 : NULL;
    }
    return 0;
}

/* Read a small text file (at most cap - 1 bytes) into buf.  -1 when it cannot be opened or read. */
static int slurp(const char *path, char *buf, size_t cap) {
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    size_t n = fread(buf, 1, cap - 1, f);
    int bad = ferror(f);
    fclose(f);
    if (bad) return -1;
    buf[n] = 0;
    return 0;
}

/* A memory.max / memory.current value: a decimal number, or "max" (UINT64_MAX). */
static int read_cgroup_value(const char *path, uint64_t *out) {
    char buf[64];
    if (slurp(path, buf, sizeof buf) != 0) return -1;
    if (strncmp(buf, "max", 3) == 0) {
        *out = UINT64_MAX;
        return 0;
    }
    if (buf[0] < '0' || buf[0] > '9') return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(buf, &end, 10);
    if (errno || (*end && *end != '\n')) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* The "file" line of a memory.stat text (page cache bytes charged to the cgroup). */
static int stat_file_bytes(const char *text, uint64_t *out) {
    for (const char *line = text; line && *line;) {
        if (strncmp(line, "file ", 5) == 0) {
            errno = 0;
            char *end;
            unsigned long long v = strtoull(line + 5, &end, 10);
            if (errno || end == line + 5) return -1;
            *out = (uint64_t)v;
            return 0;
        }
        line = strchr(line, '\n');
        if (line) line++;
    }
    return -1;
}

int ds41_mem_read(const char *root, ds41_mem_info *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    out->cgroup_free = UINT64_MAX;
    if (!root) {
        const char *hook = getenv(DS41_TEST_MEM_AVAILABLE_ENV);
        if (hook && *hook) {
            ds41_error serr = {{0}};
            if (ds41_size_parse(hook, &out->available, &serr) != 0)
                return ds41_fail(err, "%s: %s", DS41_TEST_MEM_AVAILABLE_ENV, serr.msg);
            out->mem_available = out->available;
            out->test_override = true;
            return 0;
        }
    }
    const char *r = root ? root : "";
    char path[PATH_MAX + 64];
    char *buf = malloc(1 << 16);
    if (!buf) return ds41_fail(err, "out of memory");
    snprintf(path, sizeof path, "%s/proc/meminfo", r);
    if (slurp(path, buf, 1 << 16) != 0) {
        free(buf);
        return ds41_fail(err, "%s: cannot read", path);
    }
    if (ds41_mem_parse_meminfo(buf, &out->mem_available, err) != 0) {
        free(buf);
        return -1;
    }
    out->available = out->mem_available;
    /* cgroup v2: the limits of the process's cgroup and of each ancestor apply. */
    char cg[PATH_MAX];
    snprintf(path, sizeof path, "%s/proc/self/cgroup", r);
    ds41_error cerr = {{0}};
    if (slurp(path, buf, 1 << 16) == 0 && ds41_mem_parse_proc_cgroup(buf, cg, sizeof cg, &cerr) == 1) {
        for (;;) {
            uint64_t max, cur = 0;
            snprintf(path, sizeof path, "%s/sys/fs/cgroup%s%smemory.max", r, cg, strcmp(cg, "/") == 0 ? "" : "/");
            if (read_cgroup_value(path, &max) == 0 && max != UINT64_MAX) {
                snprintf(path, sizeof path, "%s/sys/fs/cgroup%s%smemory.current", r, cg,
                         strcmp(cg, "/") == 0 ? "" : "/");
                if (read_cgroup_value(path, &cur) != 0 || cur == UINT64_MAX) cur = 0;
                /* memory.current counts the page cache charged to the cgroup (the checkpoint
                 * read by a previous run, say), which the kernel reclaims under the limit:
                 * only what is not file-backed is taken. */
                snprintf(path, sizeof path, "%s/sys/fs/cgroup%s%smemory.stat", r, cg, strcmp(cg, "/") == 0 ? "" : "/");
                uint64_t file_bytes = 0;
                if (slurp(path, buf, 1 << 16) == 0 && stat_file_bytes(buf, &file_bytes) == 0)
                    cur = cur > file_bytes ? cur - file_bytes : 0;
                uint64_t free_bytes = max > cur ? max - cur : 0;
                if (free_bytes < out->cgroup_free) {
                    out->cgroup_free = free_bytes;
                    snprintf(out->cgroup_dir, sizeof out->cgroup_dir, "%.255s", cg);
                }
            }
            if (strcmp(cg, "/") == 0) break;
            char *slash = strrchr(cg, '/');
            if (slash == cg)
                cg[1] = 0;
            else
                *slash = 0;
        }
    }
    free(buf);
    if (out->cgroup_free < out->available) out->available = out->cgroup_free;
    return 0;
}

/* ---- 2. footprint ----------------------------------------------------------------------- */

static void fill_common(const ds41_model_config *cfg, ds41_model_footprint *out) {
    out->n_routed_experts = (uint32_t)cfg->n_routed_experts;
    out->n_activated_experts = (uint32_t)cfg->n_activated_experts;
    ds41_cache_rate rate = ds41_model_config_cache_rate(cfg);
    out->kv_bytes_per_token = rate.per_tokens ? (double)rate.total_bytes / (double)rate.per_tokens : 0.0;
    ds41_session_bytes sb;
    ds41_model_config_session_bytes(cfg, &sb);
    out->session_bytes = sb.total_bytes;
}

int ds41_model_footprint_of(const ds41_model_config *cfg, ds41_model_footprint *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    ds41_tensor_plan plan = {0};
    if (ds41_tensor_plan_build(cfg, &plan, err) != 0) return -1;
    /* Per-expert sums for the slot estimate: experts of one layer are planned together. */
    uint64_t *per_expert = calloc((size_t)(cfg->n_routed_experts > 0 ? cfg->n_routed_experts : 1), sizeof *per_expert);
    if (!per_expert) {
        ds41_tensor_plan_free(&plan);
        return ds41_fail(err, "out of memory");
    }
    int cur_layer = -1;
    for (size_t i = 0; i < plan.n; i++) {
        const ds41_planned_tensor *t = &plan.t[i];
        out->total_bytes += t->nbytes;
        if (t->kind == DS41_KIND_ROUTED_EXPERTS && t->layer >= 0 && t->layer < cfg->n_layers && t->expert >= 0 &&
            t->expert < cfg->n_routed_experts) {
            if (t->layer != cur_layer) {
                memset(per_expert, 0, (size_t)cfg->n_routed_experts * sizeof *per_expert);
                cur_layer = t->layer;
            }
            out->expert_bytes += t->nbytes;
            /* Each of the six parts may start a run: allow one 4 KiB alignment unit on
             * each side (the tier's O_DIRECT unit), as the slot layout does at most. */
            per_expert[t->expert] += t->nbytes + 2 * 4096;
            if (per_expert[t->expert] > out->expert_slot_bytes) out->expert_slot_bytes = per_expert[t->expert];
        } else if (t->kind == DS41_KIND_ENGRAM_TABLES) {
            out->engram_bytes += t->nbytes;
        }
    }
    free(per_expert);
    ds41_tensor_plan_free(&plan);
    out->dense_bytes = out->total_bytes - out->expert_bytes - out->engram_bytes;
    fill_common(cfg, out);
    return 0;
}

int ds41_model_footprint_load(const char *dir, ds41_model_footprint *out, ds41_error *err) {
    ds41_model_config cfg;
    if (ds41_model_config_load(dir, &cfg, err) != 0) return -1;
    int rc = ds41_model_footprint_of(&cfg, out, err);
    /* A directory with the config and no weights yet (sizing a machine before the download,
     * `ds41ctl doctor --memory`): the plan's slot size stands. */
    char path[4096];
    snprintf(path, sizeof path, "%s/" DS41_ST_INDEX_NAME, dir);
    bool weights = access(path, F_OK) == 0;
    snprintf(path, sizeof path, "%s/" DS41_ST_SINGLE_NAME, dir);
    weights = weights || access(path, F_OK) == 0;
    if (rc == 0 && weights) {
        /* The exact slot size, as the tier will lay its slots out. */
        ds41_checkpoint *ck = ds41_checkpoint_open(dir, err);
        uint64_t slot = 0, total = 0;
        if (!ck || ds41_expert_cache_geometry(ck, &cfg, &slot, &total, err) != 0) {
            rc = -1;
        } else {
            /* expert_bytes stays the tensors' bytes (what resident experts occupy); the tier's
             * total (runs widened to its I/O unit) is larger, so a budget below expert_bytes
             * streams in the engine too. */
            out->expert_slot_bytes = slot;
        }
        ds41_checkpoint_close(ck);
    }
    ds41_model_config_free(&cfg);
    return rc;
}

uint64_t ds41_model_footprint_layer_min(const ds41_model_footprint *fp, uint32_t batch) {
    uint64_t want = (uint64_t)(batch ? batch : 1) * fp->n_activated_experts;
    if (want > fp->n_routed_experts) want = fp->n_routed_experts;
    if (want == 0) want = 1;
    return want * fp->expert_slot_bytes;
}

/* ---- 3. decision ------------------------------------------------------------------------ */

void ds41_budget_format_size(uint64_t bytes, char *buf, size_t size) {
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    if (bytes < 1024) {
        snprintf(buf, size, "%" PRIu64 " B", bytes);
        return;
    }
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 6) {
        v /= 1024.0;
        u++;
    }
    snprintf(buf, size, "%.1f %s", v, units[u]);
}

/* Memory an explicit budget takes: the budget, or the whole tier when it makes it resident. */
static uint64_t explicit_cost(uint64_t bytes, uint64_t total) { return bytes == 0 || bytes >= total ? total : bytes; }

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

int ds41_budget_decide(const ds41_budget_request *r, ds41_budget_plan *p, ds41_error *err) {
    memset(p, 0, sizeof *p);
    const uint64_t avail = r->available;
    uint64_t floor_headroom = avail / 8 < GIB ? avail / 8 : GIB;
    p->headroom = avail / 10 > floor_headroom ? avail / 10 : floor_headroom;
    p->usable = avail - p->headroom;

    /* Start from "everything resident" for the auto budgets. */
    uint64_t expert_cost = r->expert_auto ? r->expert_total : explicit_cost(r->expert_bytes, r->expert_total);
    uint64_t engram_cost = r->engram_auto ? r->engram_total : explicit_cost(r->engram_bytes, r->engram_total);
    p->expert_bytes = r->expert_auto ? 0 : r->expert_bytes;
    p->engram_bytes = r->engram_auto ? 0 : r->engram_bytes;
    const uint64_t fixed = sat_add(r->dense_bytes, r->kv_bytes);

    if (sat_add(fixed, sat_add(expert_cost, engram_cost)) > p->usable) {
        /* b. Engram first: a small row cache. */
        if (r->engram_auto && r->engram_total) {
            uint64_t rows = avail / 20 < GIB ? avail / 20 : GIB;
            if (rows < 4096) rows = 4096;
            if (rows < r->engram_total) {
                p->engram_bytes = rows;
                engram_cost = rows;
            }
        }
        /* c. Then the experts get what is left. */
        if (r->expert_auto && sat_add(fixed, sat_add(expert_cost, engram_cost)) > p->usable) {
            uint64_t taken = sat_add(fixed, engram_cost);
            uint64_t left = taken < p->usable ? p->usable - taken : 0;
            if (left < r->expert_layer_min || left == 0) {
                char a[32], h[32], d[32], k[32], g[32], x[32], m[32], l[32];
                ds41_budget_format_size(avail, a, sizeof a);
                ds41_budget_format_size(p->headroom, h, sizeof h);
                ds41_budget_format_size(r->dense_bytes, d, sizeof d);
                ds41_budget_format_size(r->kv_bytes, k, sizeof k);
                ds41_budget_format_size(engram_cost, g, sizeof g);
                ds41_budget_format_size(r->expert_total, x, sizeof x);
                ds41_budget_format_size(r->expert_layer_min, m, sizeof m);
                ds41_budget_format_size(left, l, sizeof l);
                memset(p, 0, sizeof *p);
                return ds41_fail(err,
                                 "budgets: auto: not enough memory for the routed experts: available %s less "
                                 "headroom %s, dense weights %s, KV cache %s and Engram %s leave %s, but one layer "
                                 "needs %s of expert slots at the configured batch (routed experts: %s); give more "
                                 "memory, a smaller KV cache or batch, or explicit budgets",
                                 a, h, d, k, g, l, m, x);
            }
            p->expert_bytes = left;
        }
    }
    p->experts_streamed = p->expert_bytes != 0 && p->expert_bytes < r->expert_total;
    p->engram_streamed = p->engram_bytes != 0 && p->engram_bytes < r->engram_total;
    return 0;
}

static void describe_tier(char *buf, size_t size, const char *name, bool is_auto, bool streamed, uint64_t total,
                          uint64_t budget, const char *what) {
    char t[32], b[32];
    ds41_budget_format_size(total, t, sizeof t);
    ds41_budget_format_size(budget, b, sizeof b);
    if (streamed)
        snprintf(buf, size, "%s %s streamed with %s %s%s", name, t, b, what, is_auto ? "" : " (explicit)");
    else
        snprintf(buf, size, "%s %s resident%s", name, t, is_auto ? "" : " (explicit)");
}

void ds41_budget_describe(const ds41_budget_request *r, const ds41_budget_plan *p, char *buf, size_t size) {
    if (!buf || size == 0) return;
    char x[160], g[160], a[32], h[32], d[32], k[32];
    describe_tier(x, sizeof x, "experts", r->expert_auto, p->experts_streamed, r->expert_total, p->expert_bytes,
                  "budget");
    if (r->engram_total)
        describe_tier(g, sizeof g, "Engram", r->engram_auto, p->engram_streamed, r->engram_total, p->engram_bytes,
                      "row cache");
    else
        snprintf(g, sizeof g, "no Engram tables");
    ds41_budget_format_size(r->available, a, sizeof a);
    ds41_budget_format_size(p->headroom, h, sizeof h);
    ds41_budget_format_size(r->dense_bytes, d, sizeof d);
    ds41_budget_format_size(r->kv_bytes, k, sizeof k);
    snprintf(buf, size, "budgets: %s -> %s, %s (available %s, headroom %s, dense %s, KV %s)",
             r->expert_auto || r->engram_auto ? "auto" : "explicit", x, g, a, h, d, k);
}

int ds41_auto_budget(const ds41_auto_budget_opts *o, ds41_budget_plan *plan, ds41_budget_request *req_out,
                     char *line, size_t line_size, ds41_error *err) {
    ds41_mem_info mem;
    if (o->mem)
        mem = *o->mem;
    else if (ds41_mem_read(NULL, &mem, err) != 0)
        return -1;
    ds41_model_footprint fp;
    if (ds41_model_footprint_load(o->dir, &fp, err) != 0) return -1;
    ds41_budget_request r = {.available = mem.available,
                             .dense_bytes = fp.dense_bytes,
                             .kv_bytes = o->kv_bytes ? o->kv_bytes : mem.available / 4,
                             .expert_total = fp.expert_bytes,
                             .engram_total = fp.engram_bytes,
                             .expert_layer_min = ds41_model_footprint_layer_min(&fp, o->batch),
                             .expert_auto = o->expert_auto,
                             .engram_auto = o->engram_auto,
                             .expert_bytes = o->expert_bytes,
                             .engram_bytes = o->engram_bytes};
    if (!o->kv_bytes && o->kv_tokens) {
        double per_seq = (double)fp.session_bytes + fp.kv_bytes_per_token * (double)o->kv_tokens + 1.0;
        double kv = per_seq * (double)(o->batch ? o->batch : 1);
        r.kv_bytes = kv >= 1.8e19 ? UINT64_MAX : (uint64_t)kv;
    }
    if (req_out) *req_out = r;
    if (ds41_budget_decide(&r, plan, err) != 0) return -1;
    if (line && line_size) ds41_budget_describe(&r, plan, line, line_size);
    return 0;
}
