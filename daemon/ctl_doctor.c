/* ds41ctl doctor: checks this machine for ds41d -- the daemon, io_uring, the checkpoint and
 * O_DIRECT on its directory, memlock, CPU features, the CPU kernel level and threads, GPU, free
 * memory (see ds41ctl(1)). */
#include "config/buf.h"
#include "config/daemon_config.h"
#include "config/model_config.h"
#include "cuda/backend_select.h"
#include "cuda/gpu.h"
#include "cuda/gpu_measure.h"
#include "daemon/ctl_client.h"
#include "daemon/ctl_internal.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/backend/cpu/threadpool.h"
#include "engine/model/tensor_plan.h"
#include "engine/serve/auto_budget.h"
#include "engine/text/vocab.h"
#include "storage/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct doctor {
    table t;
    json_t *arr;
    int fails;
} doctor;

static void dr(doctor *d, const char *check, const char *status, const char *detail) {
    table_row(&d->t, check, status, detail);
    json_array_append_new(d->arr, json_pack("{s:s s:s s:s}", "check", check, "status", status, "detail", detail));
    if (strcmp(status, "fail") == 0) d->fails++;
}

static void doctor_odirect(doctor *d, const char *dir) {
    DIR *dh = opendir(dir);
    if (!dh) {
        dr(d, "O_DIRECT", "fail", fmt("%s: %s", dir, strerror(errno)));
        return;
    }
    char file[4096] = "";
    struct dirent *e;
    while ((e = readdir(dh))) {
        size_t n = strlen(e->d_name);
        if (n > 12 && strcmp(e->d_name + n - 12, ".safetensors") == 0) {
            snprintf(file, sizeof file, "%s/%s", dir, e->d_name);
            break;
        }
    }
    closedir(dh);
    if (!file[0]) {
        dr(d, "O_DIRECT", "warn", fmt("no .safetensors file in %s", dir));
        return;
    }
    int fd = open(file, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
        dr(d, "O_DIRECT", "fail", fmt("open: %s", strerror(errno)));
        return;
    }
    void *buf = NULL;
    if (posix_memalign(&buf, 4096, 4096) != 0) {
        close(fd);
        dr(d, "O_DIRECT", "fail", "out of memory");
        return;
    }
    ssize_t got = pread(fd, buf, 4096, 0);
    int err = errno;
    close(fd);
    free(buf);
    if (got < 0)
        dr(d, "O_DIRECT", "fail", fmt("read: %s", strerror(err)));
    else
        dr(d, "O_DIRECT", "ok", fmt("aligned reads work on %.90s", dir));
}

/* Whether DIR is a directory; a failed "checkpoint" row when not. */
static bool doctor_is_dir(doctor *d, const char *dir) {
    struct stat st;
    if (stat(dir, &st) == 0 && S_ISDIR(st.st_mode)) return true;
    dr(d, "checkpoint", "fail",
       fmt("%.90s: %s", dir, stat(dir, &st) != 0 ? strerror(errno) : "not a directory"));
    return false;
}

/* Whether DIR is a checkpoint ds41d can load: inference/config.json valid, every safetensors
 * header readable (headers only: no payload page is touched), tokenizer.json present.  A Hugging
 * Face directory with only its root config.json fails here, naming what is missing. */
static void doctor_checkpoint(doctor *d, const char *dir) {
    if (!doctor_is_dir(d, dir)) return;
    ds41_model_config cfg;
    ds41_error err = {{0}};
    if (ds41_model_config_load(dir, &cfg, &err) != 0) {
        char root[4096];
        snprintf(root, sizeof root, "%s/config.json", dir);
        dr(d, "checkpoint", "fail",
           fmt("not a ds41 checkpoint: %.70s%s", err.msg,
               access(root, F_OK) == 0
                   ? " (a root config.json alone is not enough: inference/config.json is read)"
                   : ""));
        return;
    }
    ds41_model_config_free(&cfg);
    ds41_checkpoint *ck = ds41_checkpoint_open(dir, &err);
    if (!ck) {
        dr(d, "checkpoint", "fail", fmt("not a ds41 checkpoint: %.100s", err.msg));
        return;
    }
    char tokp[4096];
    snprintf(tokp, sizeof tokp, "%s/tokenizer.json", dir);
    char b[32];
    human_bytes((double)ds41_checkpoint_payload_bytes(ck), b, sizeof b);
    if (access(tokp, R_OK) != 0)
        dr(d, "checkpoint", "fail", fmt("%.60s: no readable tokenizer.json", dir));
    else
        dr(d, "checkpoint", "ok",
           fmt("%zu tensors, %s of weights; inference/config.json and tokenizer.json present",
               ds41_checkpoint_tensor_count(ck), b));
    ds41_checkpoint_close(ck);
}

/* The GPU rows: the first CUDA device (name, compute capability, driver and runtime versions,
 * memory) and its measured bandwidths, or "none (reason)"; then what engine.backend: auto picks
 * on this machine (cuda/backend_select.h: the same choice the daemon makes). */
static void doctor_gpu(doctor *d) {
    ds41_error err = {{0}};
    ds41_gpu *g = ds41_gpu_cuda_open(0, &err);
    ds41_gpu_info gi;
    if (g && g->info(g, &gi, &err) != 0) {
        g->destroy(g);
        g = NULL;
    }
    if (!g) {
        char drv[160] = "";
        FILE *fv = fopen("/proc/driver/nvidia/version", "r");
        if (fv) {
            char line[128] = "";
            if (fgets(line, sizeof line, fv)) {
                line[strcspn(line, "\n")] = 0;
                snprintf(drv, sizeof drv, "; /proc/driver/nvidia/version: %.100s", line);
            }
            fclose(fv);
        }
        dr(d, "gpu", "warn", fmt("GPU: none (%.200s)%s", err.msg, drv));
    } else {
        char fr[32], tot[32];
        human_bytes((double)gi.free_bytes, fr, sizeof fr);
        human_bytes((double)gi.total_bytes, tot, sizeof tot);
        dr(d, "gpu", "ok",
           fmt("GPU: %.100s, compute capability %d.%d, %d SMs, driver %d.%d, runtime %d.%d, %s free of %s%s",
               gi.name, gi.cc_major, gi.cc_minor, gi.multiprocessors, gi.driver_version / 1000,
               gi.driver_version % 1000 / 10, gi.runtime_version / 1000, gi.runtime_version % 1000 / 10, fr, tot,
               gi.unified ? " (unified memory)" : ""));
        /* A copy of up to 256 MiB each way: a fraction of a second on any of the targets. */
        uint64_t n = gi.free_bytes / 8 < (256u << 20) ? gi.free_bytes / 8 : 256u << 20;
        ds41_gpu_measure m;
        if (ds41_gpu_measure_run(g, n, n / 2, 3, NULL, NULL, &m, &err) == 0)
            dr(d, "gpu bandwidth", "ok",
               fmt("device memory %.1f GB/s (2 x %.0f MiB copied / time, best of %d), host-to-device %.1f GB/s "
                   "(pinned)",
                   m.device_gbs, (double)m.device_bytes / 1048576.0, m.passes, m.h2d_gbs));
        else
            dr(d, "gpu bandwidth", "fail", fmt("%.200s", err.msg));
        g->destroy(g);
    }
    char why[256] = "";
    ds41_cpu_opts one = {.threads = 1};
    ds41_backend *be = ds41_backend_open_why("auto", &one, 0, why, sizeof why, &err);
    if (be)
        dr(d, "backend auto", "ok",
           fmt("%.250s", strncmp(why, "backend auto: ", 14) == 0 ? why + 14 : why)); /* "cpu (why)" */
    else
        dr(d, "backend auto", "fail", fmt("%.250s", err.msg));
    ds41_backend_free(be);
}

/* ---- doctor --model DIR: a download checked before it is served ------------------------------
 * Every check works on the files alone (no daemon, no payload byte read), and every problem is one
 * row naming the file or tensor, so a user fixing a partial download sees all of it at once. */

#define HF_REPO "deepseek-ai/DeepSeek-V4.1-Flash"

/* The header of one shard and the size it implies (data start + the end of its last payload).
 * Returns 0 with *implied set, or -1 with a row already added. */
static int shard_implied_size(doctor *d, const char *path, const char *name, uint64_t size, uint64_t *implied,
                              uint64_t *payload, size_t *tensors) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        dr(d, "shard", "fail", fmt("%.150s: %s", path, strerror(errno)));
        return -1;
    }
    uint8_t len8[8];
    ssize_t got = size >= 8 ? pread(fd, len8, 8, 0) : 0;
    if (got != 8) {
        close(fd);
        dr(d, "shard", "fail",
           fmt("%.120s: %" PRIu64 " bytes, too short for a safetensors header: truncated (download it again)",
               path, size));
        return -1;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | len8[i];
    if (n > DS41_ST_MAX_HEADER_BYTES) {
        close(fd);
        dr(d, "shard", "fail", fmt("%.120s: header length %" PRIu64 " is not a safetensors header", path, n));
        return -1;
    }
    if (8 + n > size) {
        close(fd);
        dr(d, "shard", "fail",
           fmt("%.120s: %" PRIu64 " bytes, shorter than its %" PRIu64
               "-byte header: truncated (download it again)",
               path, size, 8 + n));
        return -1;
    }
    uint8_t *buf = malloc(8 + n);
    got = buf ? pread(fd, buf, 8 + n, 0) : -1;
    close(fd);
    if (got != (ssize_t)(8 + n)) {
        free(buf);
        dr(d, "shard", "fail", fmt("%.150s: cannot read its header", path));
        return -1;
    }
    /* Parsed as if the file were as long as any header could ask for: the payload extents are
     * compared with the real size below, so a truncated shard is reported with both figures. */
    ds41_st_header h = {0};
    ds41_error err = {{0}};
    int rc = ds41_checkpoint_parse_header(buf, 8 + n, UINT64_MAX / 2, name, &h, &err);
    free(buf);
    if (rc != 0) {
        dr(d, "shard", "fail", fmt("%.250s", err.msg));
        return -1;
    }
    uint64_t end = h.data_start;
    for (size_t i = 0; i < h.tensor_count; i++)
        if (h.tensors[i].nbytes && h.tensors[i].file_offset + h.tensors[i].nbytes > end)
            end = h.tensors[i].file_offset + h.tensors[i].nbytes;
    *implied = end;
    *payload = h.payload_bytes;
    *tensors = h.tensor_count;
    ds41_checkpoint_header_free(&h);
    return 0;
}

/* One shard: present, a regular file, at least as long as its header implies.  Returns 0 when
 * good. */
static int doctor_shard(doctor *d, const char *dir, const char *name, const char *first_tensor,
                        uint64_t *payload, size_t *tensors) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct stat st;
    if (stat(path, &st) != 0) {
        dr(d, "shard", "fail",
           fmt("%.120s: %s (the index maps %.60s and others to it; download it again)", path, strerror(errno),
               first_tensor ? first_tensor : "tensors"));
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        dr(d, "shard", "fail", fmt("%.150s: not a regular file", path));
        return -1;
    }
    uint64_t implied = 0;
    if (shard_implied_size(d, path, name, (uint64_t)st.st_size, &implied, payload, tensors) != 0) return -1;
    if ((uint64_t)st.st_size < implied) {
        dr(d, "shard", "fail",
           fmt("%.110s: %" PRIu64 " bytes, its header implies %" PRIu64 ": truncated (download it again)",
               path, (uint64_t)st.st_size, implied));
        return -1;
    }
    return 0;
}

/* The shards: those the index names (or model.safetensors), each checked; then the whole
 * checkpoint opened as ds41d opens it (the index and the headers against each other).  Returns
 * the open checkpoint or NULL. */
static ds41_checkpoint *doctor_shards(doctor *d, const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/" DS41_ST_INDEX_NAME, dir);
    int bad = 0;
    uint64_t payload = 0;
    size_t tensors = 0, shards = 0;
    FILE *f = fopen(path, "rb");
    if (f) {
        ds41_buf b = {0};
        char chunk[65536];
        size_t got;
        while ((got = fread(chunk, 1, sizeof chunk, f)) > 0 && b.len <= DS41_ST_MAX_HEADER_BYTES)
            ds41_buf_put(&b, chunk, got);
        fclose(f);
        ds41_st_index idx = {0};
        ds41_error err = {{0}};
        if (ds41_checkpoint_parse_index((const uint8_t *)(b.data ? b.data : ""), b.len, DS41_ST_INDEX_NAME,
                                        &idx, &err) != 0) {
            ds41_buf_free(&b);
            dr(d, "shards", "fail", fmt("%.250s", err.msg));
            return NULL;
        }
        ds41_buf_free(&b);
        shards = idx.shard_count;
        for (size_t i = 0; i < idx.shard_count; i++) {
            uint64_t p = 0;
            size_t t = 0;
            if (doctor_shard(d, dir, idx.shard_names[i], idx.shard_first_tensor[i], &p, &t) != 0) bad++;
            payload += p;
            tensors += t;
        }
        if (!bad && idx.has_total_size && idx.total_size != payload) {
            dr(d, "shards", "fail",
               fmt("%s: metadata.total_size %" PRIu64 " but the shards hold %" PRIu64 " payload bytes",
                   DS41_ST_INDEX_NAME, idx.total_size, payload));
            bad++;
        }
        ds41_checkpoint_index_free(&idx);
    } else {
        snprintf(path, sizeof path, "%s/" DS41_ST_SINGLE_NAME, dir);
        if (access(path, F_OK) != 0) {
            dr(d, "shards", "fail",
               fmt("%.100s: no " DS41_ST_INDEX_NAME " (nor " DS41_ST_SINGLE_NAME "): the weights are missing",
                   dir));
            return NULL;
        }
        shards = 1;
        if (doctor_shard(d, dir, DS41_ST_SINGLE_NAME, NULL, &payload, &tensors) != 0) bad++;
    }
    if (bad) {
        dr(d, "shards", "fail", fmt("%d of %zu shard files missing or damaged", bad, shards));
        return NULL;
    }
    ds41_error err = {{0}};
    ds41_checkpoint *ck = ds41_checkpoint_open(dir, &err);
    if (!ck) {
        dr(d, "shards", "fail", fmt("%.250s", err.msg));
        return NULL;
    }
    char hb[32];
    human_bytes((double)ds41_checkpoint_payload_bytes(ck), hb, sizeof hb);
    dr(d, "shards", "ok",
       fmt("%zu shard files, %zu tensors, %s of weights; every size matches its header", shards,
           ds41_checkpoint_tensor_count(ck), hb));
    return ck;
}

typedef struct plan_report {
    doctor *d;
    size_t shown, more;
} plan_report;

static void shape_text(char *buf, size_t size, const int64_t *shape, int ndim) {
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? "," : "", (long long)shape[i]);
    if (used < size) snprintf(buf + used, size - used, "]");
}

/* One row per tensor the plan and the checkpoint disagree on (the first 20; then a count). */
static void plan_problem(void *ctx, ds41_check_problem problem, const char *name,
                         const ds41_planned_tensor *p, const ds41_tensor *t) {
    plan_report *r = ctx;
    if (r->shown >= 20) {
        r->more++;
        return;
    }
    r->shown++;
    char a[96] = "", b[96] = "";
    if (p) shape_text(a, sizeof a, p->shape, p->ndim);
    if (t) shape_text(b, sizeof b, t->shape, t->ndim);
    switch (problem) {
    case DS41_CHECK_MISSING:
        dr(r->d, "tensor", "fail",
           fmt("%.120s: missing (inference/config.json needs it, %s %s)", name, ds41_dtype_name(p->dtype),
               a));
        break;
    case DS41_CHECK_UNEXPECTED:
        dr(r->d, "tensor", "fail",
           fmt("%.120s: not in the plan of inference/config.json (%s %s)", name, ds41_dtype_name(t->dtype),
               b));
        break;
    case DS41_CHECK_WRONG_DTYPE:
        dr(r->d, "tensor", "fail",
           fmt("%.120s: dtype %s, expected %s", name, ds41_dtype_name(t->dtype), ds41_dtype_name(p->dtype)));
        break;
    case DS41_CHECK_WRONG_SHAPE:
        dr(r->d, "tensor", "fail", fmt("%.120s: shape %s, expected %s", name, b, a));
        break;
    }
}

/* The tokenizer files ds41d reads, from the root of the same repository. */
static void doctor_tokenizer(doctor *d, const char *dir, const ds41_model_config *cfg) {
    static const char *const files[] = {"tokenizer.json", "tokenizer_config.json"};
    int missing = 0;
    for (size_t i = 0; i < 2; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        if (access(p, R_OK) != 0) {
            dr(d, "tokenizer", "fail",
               fmt("%.120s: %s (it comes with the weights: hf download " HF_REPO " %s --local-dir DIR)", p,
                   strerror(errno), files[i]));
            missing++;
        }
    }
    if (missing) return;
    ds41_error err = {{0}};
    ds41_vocab *v = ds41_vocab_load_dir(dir, &err);
    if (!v) {
        dr(d, "tokenizer", "fail", fmt("%.250s", err.msg));
        return;
    }
    uint32_t n = ds41_vocab_size(v);
    ds41_vocab_free(v);
    if (cfg && (int64_t)n > cfg->vocab_size)
        dr(d, "tokenizer", "fail",
           fmt("tokenizer.json has %u ids but inference/config.json says vocab_size %lld", n,
               (long long)cfg->vocab_size));
    else
        dr(d, "tokenizer", "ok", fmt("tokenizer.json (%u ids) and tokenizer_config.json", n));
}

/* The footprint of the config and the tiers "auto" would choose on `mem` with the daemon's
 * defaults (memory.* auto: KV a quarter of the memory, engine.max_sequences 64) or what
 * --kv-bytes / --max-sequences say. */
typedef struct sizing {
    uint64_t kv_bytes; /* --kv-bytes; 0 = auto (a quarter of the memory) */
    uint32_t batch;    /* --max-sequences; the daemon's default 64 */
} sizing;

static void doctor_budgets(doctor *d, const char *dir, const ds41_mem_info *mem, const sizing *sz) {
    ds41_model_footprint fp;
    ds41_error err = {{0}};
    if (ds41_model_footprint_load(dir, &fp, &err) != 0) {
        dr(d, "footprint", "fail", fmt("%.250s", err.msg));
        return;
    }
    char t[32], x[32], g[32], n[32], a[32];
    ds41_budget_format_size(fp.total_bytes, t, sizeof t);
    ds41_budget_format_size(fp.dense_bytes, n, sizeof n);
    ds41_budget_format_size(fp.expert_bytes, x, sizeof x);
    ds41_budget_format_size(fp.engram_bytes, g, sizeof g);
    ds41_budget_format_size(mem->available, a, sizeof a);
    dr(d, "footprint", "ok",
       fmt("%s of weights (dense %s, routed experts %s, Engram tables %s); %s available%s: %s", t, n, x, g, a,
           mem->test_override ? " (as given)" : "",
           fp.total_bytes < mem->available ? "it can all be resident" : "the tiers stream part of it"));
    ds41_auto_budget_opts ao = {.dir = dir,
                                .expert_auto = true,
                                .engram_auto = true,
                                .kv_bytes = sz->kv_bytes,
                                .batch = sz->batch,
                                .mem = mem};
    ds41_budget_plan plan;
    char line[512];
    if (ds41_auto_budget(&ao, &plan, NULL, line, sizeof line, &err) != 0)
        dr(d, "budgets", "fail", err.msg);
    else
        dr(d, "budgets", "ok", line);
}

/* The weight bytes one decode token of one sequence reads when everything is resident: every
 * tensor of the text layers and the head, one row of the embedding, top-k of the n routed experts
 * of each layer.  Not counted: the DSpark stages and the vision tower (unused when decoding
 * text), the Engram rows (a few KiB a token).  Memory bandwidth / this = the ceiling of
 * single-stream decode, the projection the guide (docs/GUIDE.md) makes for machines not
 * measured. */
static void doctor_decode_bytes(doctor *d, const ds41_model_config *cfg, const ds41_tensor_plan *plan) {
    uint64_t dense = 0, experts = 0;
    for (size_t i = 0; i < plan->n; i++) {
        const ds41_planned_tensor *t = &plan->t[i];
        switch (t->kind) {
        case DS41_KIND_ROUTED_EXPERTS:
            experts += t->nbytes;
            break;
        case DS41_KIND_DSPARK:
        case DS41_KIND_VISION:
        case DS41_KIND_ENGRAM_TABLES:
            break;
        default:
            dense += strcmp(t->name, "embed.weight") == 0 && t->shape[0] > 0
                         ? t->nbytes / (uint64_t)t->shape[0]
                         : t->nbytes;
        }
    }
    const uint64_t active =
        cfg->n_routed_experts > 0
            ? (uint64_t)((double)experts * (double)cfg->n_activated_experts / (double)cfg->n_routed_experts)
            : 0;
    const uint64_t per_token = dense + active;
    char a[32], b[32], c[32];
    ds41_budget_format_size(per_token, a, sizeof a);
    ds41_budget_format_size(dense, b, sizeof b);
    ds41_budget_format_size(active, c, sizeof c);
    dr(d, "decode", "ok",
       fmt("one token reads %s of weights (%s dense + %s of routed experts, %" PRIu64
           " bytes): at most %.1f tokens/s per 100 GB/s of memory bandwidth (a projection)",
           a, b, c, per_token, per_token ? 100e9 / (double)per_token : 0.0));
}

/* Every check of a download in DIR; the caller's --memory (or this machine's). */
static void doctor_model(doctor *d, const char *dir, const ds41_mem_info *mem, const sizing *sz) {
    if (!doctor_is_dir(d, dir)) return;
    ds41_model_config cfg;
    ds41_error err = {{0}};
    bool have_cfg = ds41_model_config_load(dir, &cfg, &err) == 0;
    if (!have_cfg) {
        char root[4096], inf[4096];
        snprintf(root, sizeof root, "%s/config.json", dir);
        snprintf(inf, sizeof inf, "%s/inference/config.json", dir);
        if (access(inf, F_OK) != 0 && access(root, F_OK) == 0)
            dr(d, "checkpoint", "fail",
               fmt("not a ds41 checkpoint: %.80s is missing; the root config.json is not enough: ds41 reads "
                   "inference/config.json, which " HF_REPO
                   " ships in its inference/ folder (hf download " HF_REPO
                   " inference/config.json --local-dir DIR)",
                   inf));
        else
            dr(d, "checkpoint", "fail", fmt("not a ds41 checkpoint: %.220s", err.msg));
    } else {
        dr(d, "checkpoint", "ok",
           fmt("inference/config.json: %lld layers, dim %lld, %lld routed experts top-%lld",
               (long long)cfg.n_layers, (long long)cfg.dim, (long long)cfg.n_routed_experts,
               (long long)cfg.n_activated_experts));
    }
    doctor_tokenizer(d, dir, have_cfg ? &cfg : NULL);
    ds41_checkpoint *ck = doctor_shards(d, dir);
    ds41_tensor_plan plan = {0};
    const bool have_plan = have_cfg && ds41_tensor_plan_build(&cfg, &plan, &err) == 0;
    if (have_cfg && !have_plan) dr(d, "tensors", "fail", fmt("%.250s", err.msg));
    if (have_plan && ck) {
        {
            plan_report r = {.d = d};
            ds41_check_counts c = ds41_tensor_plan_check(&plan, ck, plan_problem, &r);
            size_t bad = c.missing + c.unexpected + c.wrong_dtype + c.wrong_shape;
            if (r.more) dr(d, "tensor", "fail", fmt("... %zu more tensor problems", r.more));
            if (bad)
                dr(d, "tensors", "fail",
                   fmt("the checkpoint does not match inference/config.json: %zu missing, %zu unexpected, "
                       "%zu wrong "
                       "dtype, %zu wrong shape",
                       c.missing, c.unexpected, c.wrong_dtype, c.wrong_shape));
            else
                dr(d, "tensors", "ok",
                   fmt("all %zu tensors the config plans, with their dtypes and shapes", plan.n));
        }
    }
    ds41_checkpoint_close(ck);
    if (have_cfg) doctor_budgets(d, dir, mem, sz);
    if (have_plan) doctor_decode_bytes(d, &cfg, &plan);
    ds41_tensor_plan_free(&plan);
    if (have_cfg) ds41_model_config_free(&cfg);
}

int cmd_doctor(int argc, char **argv) {
    static const struct option lo[] = {{"model", required_argument, NULL, 'm'},
                                       {"memory", required_argument, NULL, 'M'},
                                       {"kv-bytes", required_argument, NULL, 'k'},
                                       {"max-sequences", required_argument, NULL, 'b'},
                                       {NULL, 0, NULL, 0}};
    const char *model_dir = NULL, *memory = NULL;
    sizing sz = {.batch = 64};
    optind = 0; /* 0, not 1: glibc then re-initialises, dropping the "+" (stop at the first non-option) mode of the top-level parse */
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (c == 'm')
            model_dir = optarg;
        else if (c == 'M')
            memory = optarg;
        else if (c == 'k') {
            ds41_error e = {{0}};
            if (ds41_size_parse(optarg, &sz.kv_bytes, &e) != 0)
                return fail("doctor: --kv-bytes '%s': expected a size such as 8GiB (%s)", optarg, e.msg);
        } else if (c == 'b') {
            char *end;
            unsigned long v = strtoul(optarg, &end, 10);
            if (*end || !*optarg || v < 1 || v > 4096)
                return fail("doctor: --max-sequences '%s': expected an integer 1..4096", optarg);
            sz.batch = (uint32_t)v;
        } else
            return 2;
    }
    if ((memory || sz.kv_bytes || sz.batch != 64) && !model_dir)
        return fail("doctor: --memory, --kv-bytes and --max-sequences size the tiers of --model DIR");
    /* --memory SIZE: size the tiers for a machine with that much available memory (the guide's
     * worked examples) instead of this one. */
    ds41_mem_info mem = {0};
    if (memory) {
        ds41_error e = {{0}};
        if (ds41_size_parse(memory, &mem.available, &e) != 0 || mem.available == 0)
            return fail("doctor: --memory '%s': expected a size such as 256GiB (%s)", memory, e.msg);
        mem.mem_available = mem.available;
        mem.cgroup_free = UINT64_MAX;
        mem.test_override = true;
    }
    doctor d = {.t = {.cols = 3}, .arr = json_array()};
    table_row(&d.t, "CHECK", "STATUS", "DETAIL");

    /* the daemon */
    ds41_ctl_response r;
    ds41_error err = {{0}};
    char *daemon_model = NULL;
    char daemon_threads[160] = "";
    if (ds41_ctl_request(g_socket, "GET", "/health", NULL, 0, 5000, &r, &err) == 0) {
        dr(&d, "daemon", r.status == 200 ? "ok" : "warn", fmt("%s answers %d %.60s", g_socket, r.status, r.body));
        ds41_ctl_response_free(&r);
        json_t *m = call_json("GET", "/admin/models", NULL, NULL, true);
        if (m) {
            json_t *first = json_array_get(json_object_get(m, "data"), 0);
            if (first && jstr(first, "path")[0]) daemon_model = strdup(jstr(first, "path"));
            /* the threads of the daemon's loaded engines, as it reports them */
            size_t i;
            json_t *e;
            json_array_foreach(json_object_get(m, "data"), i, e) {
                if (jint(e, "threads") <= 0) continue;
                size_t used = strlen(daemon_threads);
                snprintf(daemon_threads + used, sizeof daemon_threads - used, "%s%.40s %lld",
                         used ? ", " : "", jstr(e, "id"), jint(e, "threads"));
            }
            json_decref(m);
        }
        /* The memory budgets the daemon decided at load (admin only; quiet otherwise). */
        json_t *cj = call_json("GET", "/admin/cache", NULL, NULL, true);
        if (cj && jstr(cj, "budgets")[0]) dr(&d, "budgets", "ok", jstr(cj, "budgets"));
        json_decref(cj);
    } else {
        dr(&d, "daemon", "warn", err.msg);
    }

    /* io_uring */
#ifdef SYS_io_uring_setup
    {
        unsigned char params[120] = {0}; /* struct io_uring_params */
        long fd = syscall(SYS_io_uring_setup, 4, params);
        if (fd >= 0) {
            close((int)fd);
            dr(&d, "io_uring", "ok", "io_uring_setup works");
        } else {
            int e = errno;
            dr(&d, "io_uring", "fail",
               fmt("io_uring_setup: %s%s", strerror(e),
                   e == EPERM ? " (kernel.io_uring_disabled or a seccomp filter)" : e == ENOSYS ? " (kernel too old)" : ""));
        }
    }
#else
    dr(&d, "io_uring", "fail", "not available on this platform");
#endif

    /* O_DIRECT on the model directory */
    const char *dir = model_dir ? model_dir : daemon_model;
    if (model_dir) {
        ds41_error e = {{0}};
        if (!memory && ds41_mem_read(NULL, &mem, &e) != 0)
            dr(&d, "footprint", "fail", fmt("%.200s", e.msg));
        else
            doctor_model(&d, model_dir, &mem, &sz);
    } else if (dir) {
        doctor_checkpoint(&d, dir);
    }
    if (dir)
        doctor_odirect(&d, dir);
    else
        dr(&d, "O_DIRECT", "warn", "no model directory (give --model DIR, or run as an admin)");
    free(daemon_model);

    /* memlock */
    struct rlimit rl;
    if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
        if (rl.rlim_cur == RLIM_INFINITY)
            dr(&d, "memlock", "ok", "unlimited");
        else {
            char b[32];
            human_bytes((double)rl.rlim_cur, b, sizeof b);
            dr(&d, "memlock", rl.rlim_cur >= (64ull << 20) ? "ok" : "warn",
               fmt("%s locked memory allowed (the service sets LimitMEMLOCK=infinity)", b));
        }
    }

    /* CPU features, from the kernel's view (/proc/cpuinfo "flags" on x86, "Features" on Arm) */
    {
        static const char *const wanted[] = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile",
                                             "asimd", "asimddp", "asimdhp", "sve", "sve2", "i8mm", "bf16", NULL};
        ds41_buf f = {0};
        bool good = false;
        FILE *fc = fopen("/proc/cpuinfo", "r");
        char *line = NULL;
        size_t cap = 0;
        while (fc && getline(&line, &cap, fc) > 0) {
            if (strncmp(line, "flags", 5) != 0 && strncmp(line, "Features", 8) != 0) continue;
            for (size_t k = 0; wanted[k]; k++) {
                size_t wl = strlen(wanted[k]);
                for (const char *p = strchr(line, ':'); p && (p = strstr(p, wanted[k])); p += wl) {
                    if ((p[-1] == ' ' || p[-1] == ':') && (p[wl] == ' ' || p[wl] == '\n' || p[wl] == 0)) {
                        ds41_buf_printf(&f, "%s ", wanted[k]);
                        break;
                    }
                }
            }
            good = f.data && ((strstr(f.data, "avx2 ") && strstr(f.data, "fma ")) || strstr(f.data, "asimd "));
            break;
        }
        free(line);
        if (fc) fclose(fc);
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        ds41_buf_printf(&f, "(%ld CPUs)", ncpu);
        dr(&d, "cpu", good ? "ok" : "warn", f.data ? f.data : "");
        ds41_buf_free(&f);
    }

    /* the fast CPU path this machine gets (engine/backend/cpu/cpu_backend.h), and its default thread count */
    {
        ds41_cpu_level lv = ds41_cpu_level_detect();
        const char *cap = getenv("DS41_CPU_LEVEL");
        char threads[200];
        if (daemon_threads[0])
            snprintf(threads, sizeof threads, "the daemon's threads: %s", daemon_threads);
        else
            snprintf(threads, sizeof threads,
                     "%d threads by default here (one per usable CPU; the daemon's own count needs admin)",
                     ds41_cpu_count());
        dr(&d, "backend", lv >= DS41_CPU_AVX2 ? "ok" : "warn",
           fmt("fast CPU kernels at level %s%s%s%s; %.120s", ds41_cpu_level_name(lv),
               cap && *cap ? " (DS41_CPU_LEVEL=" : "", cap && *cap ? cap : "", cap && *cap ? ")" : "",
               threads));
    }

    /* GPU: the device the CUDA backend would run on, and what engine.backend: auto picks here */
    doctor_gpu(&d);

    /* memory */
    {
        FILE *fm = fopen("/proc/meminfo", "r");
        long long total = -1, avail = -1;
        char line[256];
        while (fm && fgets(line, sizeof line, fm)) {
            if (sscanf(line, "MemTotal: %lld kB", &total) == 1) continue;
            sscanf(line, "MemAvailable: %lld kB", &avail);
        }
        if (fm) fclose(fm);
        if (total > 0 && avail >= 0) {
            char a[32], t[32];
            human_bytes((double)avail * 1024, a, sizeof a);
            human_bytes((double)total * 1024, t, sizeof t);
            dr(&d, "memory", avail * 1024 >= (4ll << 30) ? "ok" : "warn", fmt("%s available of %s", a, t));
        } else {
            dr(&d, "memory", "warn", "cannot read /proc/meminfo");
        }
        /* A cgroup v2 limit below MemAvailable is what "auto" budgets size against. */
        ds41_mem_info mi;
        if (ds41_mem_read(NULL, &mi, NULL) == 0 && mi.cgroup_free < mi.mem_available) {
            char a[32];
            human_bytes((double)mi.cgroup_free, a, sizeof a);
            dr(&d, "cgroup", "ok", fmt("%s may be used under the memory.max of %s", a, mi.cgroup_dir));
        }
    }
    if (g_json) {
        print_json(d.arr);
        table_free(&d.t);
    } else {
        table_print(&d.t);
    }
    json_decref(d.arr);
    return d.fails ? 1 : 0;
}
