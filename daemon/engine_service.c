/* ds41d's ds41_service on the engine (see engine_service.h). */
#include "daemon/engine_service.h"
#include "daemon/engine_service_internal.h"

#include "daemon/log.h"
#include "engine/serve/auto_budget.h"
#include "engine/forward/forward.h"
#include "engine/serve/generate.h"
#include "cuda/backend_select.h"
#include "engine/model/model_gen.h"
#include "engine/text/pyjson.h"
#include "engine/serve/scheduler.h"
#include "engine/text/tokenizer.h"
#include "storage/snapshot_store.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- settings: the part of the configuration the service uses (owned copies) --------------- */

static void settings_free(settings *st) {
    for (size_t i = 0; i < st->n_models; i++) {
        free(st->models[i].name);
        free(st->models[i].path);
    }
    free(st->models);
    free(st->embedded_name);
    free(st->embedded_preset);
    free(st->embedded_dir);
    free(st->snapshots_dir);
    memset(st, 0, sizeof *st);
}

static char *sdup(const char *s) { return s ? strdup(s) : NULL; }

static int settings_from(const ds41_daemon_config *cfg, settings *st, ds41_error *err) {
    memset(st, 0, sizeof *st);
    if (cfg->n_models) {
        st->models = calloc(cfg->n_models, sizeof *st->models);
        if (!st->models) return ds41_fail(err, "out of memory");
        st->n_models = cfg->n_models;
        const ds41_daemon_model *def = ds41_daemon_config_default_model(cfg);
        for (size_t i = 0; i < cfg->n_models; i++) {
            st->models[i].name = sdup(cfg->models[i].name);
            st->models[i].path = sdup(cfg->models[i].path);
            st->models[i].is_default = &cfg->models[i] == def;
            if (!st->models[i].name || !st->models[i].path) goto oom;
        }
    } else if (cfg->embedded_model.enabled) {
        char dir[PATH_MAX];
        if (ds41_daemon_config_embedded_dir(cfg, dir, sizeof dir, err) != 0) {
            settings_free(st);
            return -1;
        }
        st->embedded = true;
        st->models = calloc(1, sizeof *st->models);
        if (!st->models) goto oom;
        st->n_models = 1;
        st->models[0].name = sdup(cfg->embedded_model.name);
        st->models[0].path = sdup(dir);
        st->models[0].is_default = true;
        st->embedded_name = sdup(cfg->embedded_model.name);
        st->embedded_preset = sdup(cfg->embedded_model.preset);
        st->embedded_dir = sdup(dir);
        st->embedded_seed = cfg->embedded_model.seed;
        if (!st->models[0].name || !st->models[0].path || !st->embedded_name || !st->embedded_preset ||
            !st->embedded_dir)
            goto oom;
    } else {
        return ds41_fail(err, "nothing to serve: no models and embedded_model.enabled is false");
    }
    st->mode = cfg->engine.mode;
    st->threads = cfg->engine.threads;
    st->backend = cfg->engine.backend;
    st->cuda_device = cfg->engine.cuda_device;
    st->max_sequences = cfg->engine.max_sequences;
    st->max_batch_tokens = cfg->engine.max_batch_tokens;
    st->prefill_chunk = cfg->engine.prefill_chunk;
    st->test_forced_output = cfg->engine.test_forced_output;
    st->speculative = cfg->engine.speculative;
    st->spec_max_draft = cfg->engine.speculative_max_draft;
    st->spec_min_confidence_pct = cfg->engine.speculative_min_confidence_pct;
    st->kv_cache_bytes = cfg->memory.kv_cache_bytes;
    st->expert_cache_bytes = cfg->memory.expert_cache_bytes;
    st->host_expert_cache_bytes = cfg->memory.host_expert_cache_bytes;
    st->test_fault_expert_read = cfg->engine.test_fault_expert_read;
    st->engram_cache_bytes = cfg->memory.engram_cache_bytes;
    st->max_queue = cfg->limits.max_queue;
    st->max_tokens_default = cfg->limits.max_tokens_default;
    st->max_context = cfg->limits.max_context;
    st->request_timeout_s = cfg->limits.request_timeout_s;
    st->drain_ms = cfg->limits.drain_timeout_s * 1000u;
    st->prefix_cache = cfg->prefix_cache.enabled;
    st->prefix_cache_max_bytes = cfg->prefix_cache.max_bytes;
    st->prefix_share = cfg->prefix_cache.share_across_users;
    st->snapshots = cfg->snapshots.enabled && cfg->prefix_cache.enabled;
    st->snapshots_max_bytes = cfg->snapshots.max_bytes;
    st->snapshot_delay_ms = cfg->snapshots.test_save_delay_ms;
    char sdir[PATH_MAX];
    if (snprintf(sdir, sizeof sdir, "%s/snapshots", cfg->state_directory ? cfg->state_directory : ".") >=
        (int)sizeof sdir) {
        settings_free(st);
        return ds41_fail(err, "state_directory: path too long");
    }
    if (!(st->snapshots_dir = sdup(sdir))) goto oom;
    return 0;
oom:
    settings_free(st);
    return ds41_fail(err, "out of memory");
}

/* ---- models ----------------------------------------------------------------------------------- */

static void progress(ds41_engine_service *s, const model *m, ds41_model_state state, const char *detail) {
    if (s->progress) s->progress(s->progress_ctx, m->name, state, detail);
}

/* model.load_state values, named as the admin listing's "load" object gives them. */
enum { LOAD_NONE = 0, LOAD_BINDING, LOAD_PLACING, LOAD_DONE, LOAD_FAILED };
static const char *load_state_name(int st) {
    static const char *const names[] = {NULL, "binding", "placing", "done", "failed"};
    return st > LOAD_NONE && st <= LOAD_FAILED ? names[st] : NULL;
}

static void load_progress_start(model *m) {
    atomic_store_explicit(&m->load_tensors_done, 0, memory_order_relaxed);
    atomic_store_explicit(&m->load_tensors_total, 0, memory_order_relaxed);
    atomic_store_explicit(&m->load_bytes_done, 0, memory_order_relaxed);
    atomic_store_explicit(&m->load_bytes_total, 0, memory_order_relaxed);
    atomic_store_explicit(&m->load_state, LOAD_BINDING, memory_order_release);
    m->load_reported = -1;
    /* Test hook: DS41_TEST_LOAD_STEP_MS=N sleeps N ms after each progress report, so a test sees a
     * tiny model's load in flight.  Never set it in production. */
    const char *step = getenv("DS41_TEST_LOAD_STEP_MS");
    m->load_step_ms = step ? (unsigned)strtoul(step, NULL, 10) : 0;
    if (m->load_step_ms > 10000) m->load_step_ms = 10000;
}

/* ds41_engine_opts.progress: the figures into atomics (the admin listing reads them from its own
 * thread), and at each stage and each tenth of the bytes a detail line for STATUS= (sd_notify via
 * the service's progress callback) and `ds41ctl models load --wait`: a dozen lines per load. */
static void on_load_progress(void *ctx, const ds41_load_progress *p) {
    model *m = ctx;
    atomic_store_explicit(&m->load_tensors_total, p->tensors_total, memory_order_relaxed);
    atomic_store_explicit(&m->load_bytes_total, p->bytes_total, memory_order_relaxed);
    atomic_store_explicit(&m->load_tensors_done, p->tensors_done, memory_order_relaxed);
    atomic_store_explicit(&m->load_bytes_done, p->bytes_done, memory_order_relaxed);
    atomic_store_explicit(&m->load_state,
                          p->stage == DS41_LOAD_BINDING   ? LOAD_BINDING
                          : p->stage == DS41_LOAD_PLACING ? LOAD_PLACING
                                                          : LOAD_DONE,
                          memory_order_release);
    if (p->stage == DS41_LOAD_DONE) return; /* "ready" follows */
    const int pct = p->bytes_total ? (int)(p->bytes_done * 100 / p->bytes_total) : 100;
    const int key = (int)p->stage * 16 + pct / 10;
    if (key != m->load_reported) {
        m->load_reported = key;
        char done[32], total[32], detail[256];
        ds41_budget_format_size(p->bytes_done, done, sizeof done);
        ds41_budget_format_size(p->bytes_total, total, sizeof total);
        snprintf(detail, sizeof detail, "%s the weights: %d%% (%s of %s, %llu of %llu tensors)",
                 p->stage == DS41_LOAD_PLACING ? "placing" : "binding", pct, done, total,
                 (unsigned long long)p->tensors_done, (unsigned long long)p->tensors_total);
        pthread_rwlock_wrlock(&m->lock);
        snprintf(m->detail, sizeof m->detail, "%s", detail);
        pthread_rwlock_unlock(&m->lock);
        progress(m->svc, m, DS41_MODEL_LOADING, detail);
    }
    if (m->load_step_ms)
        nanosleep(&(struct timespec){m->load_step_ms / 1000, (long)(m->load_step_ms % 1000) * 1000000L},
                  NULL);
}

/* The state clients see (callers hold m->lock): a READY model whose engine lost a mapped shard
 * (truncated under it: storage/map_guard.h) is FAILED -- every step fails from then on -- with the
 * engine's message in *lost.  The next load replaces the engine (model_start_load). */
ds41_model_state es_effective_state(const model *m, ds41_error *lost) {
    ds41_error e;
    if (m->state == DS41_MODEL_READY && m->engine &&
        ds41_engine_check_mappings(m->engine, lost ? lost : &e) != 0)
        return DS41_MODEL_FAILED;
    return m->state;
}

static model *model_new(ds41_engine_service *s, const model_setting *ms, bool embedded) {
    model *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->svc = s;
    m->name = sdup(ms->name);
    m->path = sdup(ms->path);
    m->is_default = ms->is_default;
    m->embedded = embedded;
    m->state = DS41_MODEL_UNLOADED;
    m->created = (int64_t)time(NULL);
    if (!m->name || !m->path) {
        free(m->name);
        free(m->path);
        free(m);
        return NULL;
    }
    pthread_rwlock_init(&m->lock, NULL);
    pthread_mutex_init(&m->loader_mu, NULL);
    return m;
}

/* Unload (write lock taken here): the scheduler gets drain_ms, then cancels what is left. */
static void model_unload(model *m, unsigned drain_ms) {
    pthread_rwlock_wrlock(&m->lock);
    ds41_scheduler *sched = m->sched;
    m->sched = NULL;
    m->state = DS41_MODEL_UNLOADED;
    snprintf(m->detail, sizeof m->detail, "unloaded");
    ds41_scheduler_free(sched, drain_ms); /* hands cached conversations to the store */
    ds41_snapshot_store_free(m->store);  /* after the scheduler: writes what it was handed */
    ds41_kv_pool_free(m->layout_pool);
    m->store = NULL;
    m->layout_pool = NULL;
    ds41_tokenizer_free(m->tok);
    ds41_vocab_free(m->vocab);
    ds41_engine_free(m->engine);
    m->tok = NULL;
    m->vocab = NULL;
    m->engine = NULL;
    pthread_rwlock_unlock(&m->lock);
}

static void model_join_loader(model *m) {
    pthread_mutex_lock(&m->loader_mu);
    bool started = m->loader_started;
    pthread_t t = m->loader;
    m->loader_started = false;
    pthread_mutex_unlock(&m->loader_mu);
    if (started) pthread_join(t, NULL);
}

static void model_free(model *m, unsigned drain_ms) {
    if (!m) return;
    model_join_loader(m);
    model_unload(m, drain_ms);
    pthread_rwlock_destroy(&m->lock);
    pthread_mutex_destroy(&m->loader_mu);
    free(m->name);
    free(m->path);
    free(m);
}

static bool has_checkpoint(const char *dir) {
    char p[PATH_MAX];
    struct stat st;
    snprintf(p, sizeof p, "%s/inference/config.json", dir);
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static int mkdir_p(const char *path, mode_t mode) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, mode) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    return mkdir(buf, mode) != 0 && errno != EEXIST ? -1 : 0;
}

static int rm_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : -1;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        if (!d) return -1;
        struct dirent *e;
        while ((e = readdir(d))) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
            char sub[PATH_MAX];
            if (snprintf(sub, sizeof sub, "%s/%s", path, e->d_name) >= (int)sizeof sub) continue;
            rm_tree(sub);
        }
        closedir(d);
        return rmdir(path);
    }
    return unlink(path);
}

static void gen_progress(void *ctx, const char *line) {
    model *m = ctx;
    ds41_log(DS41_LOG_DEBUG, "embedded model: %s", line);
    (void)m;
}

/* Generate the embedded checkpoint into a temporary directory beside its place, then rename. */
static int generate_embedded(model *m, const settings *st, ds41_error *err) {
    char parent[PATH_MAX], tmp[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", m->path);
    char *slash = strrchr(parent, '/');
    if (!slash || slash == parent) return ds41_fail(err, "%s: no parent directory", m->path);
    *slash = 0;
    if (mkdir_p(parent, 0750) != 0) return ds41_fail(err, "%s: cannot create: %s", parent, strerror(errno));
    if (snprintf(tmp, sizeof tmp, "%s.tmp-%ld", m->path, (long)getpid()) >= (int)sizeof tmp)
        return ds41_fail(err, "%s: path too long", m->path);
    rm_tree(tmp);
    ds41_model_gen_opts o = {.preset = st->embedded_preset, .seed = st->embedded_seed, .progress = gen_progress,
                             .progress_ctx = m};
    if (ds41_model_generate(tmp, &o, NULL, err) != 0) {
        rm_tree(tmp);
        return ds41_error_prefix(err, "generating the embedded model");
    }
    if (rename(tmp, m->path) != 0) {
        int e = errno;
        rm_tree(tmp);
        if (has_checkpoint(m->path)) return 0; /* another instance won the race */
        return ds41_fail(err, "%s: cannot move the generated model into place: %s", m->path, strerror(e));
    }
    return 0;
}

static uint64_t checkpoint_bytes(const char *dir) {
    uint64_t total = 0;
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 12 || strcmp(e->d_name + n - 12, ".safetensors") != 0) continue;
        char p[PATH_MAX];
        struct stat st;
        if (snprintf(p, sizeof p, "%s/%s", dir, e->d_name) < (int)sizeof p && stat(p, &st) == 0)
            total += (uint64_t)st.st_size;
    }
    closedir(d);
    return total;
}

/* "auto" KV budget: a quarter of the memory the process may use (engine/serve/auto_budget.h: MemAvailable
 * capped by the cgroup's limits, or the DS41_TEST_MEM_AVAILABLE test hook). */
static uint64_t auto_kv_budget(const ds41_mem_info *mem) {
    if (mem && mem->available) return mem->available / 4;
    long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || psz <= 0) return 1ull << 30;
    uint64_t avail = (uint64_t)pages * (uint64_t)psz;
    return avail / 4;
}

/* memory.expert_cache_bytes / engram_cache_bytes "auto" (0): decide from the memory the process may
 * use (engine/serve/auto_budget.h), log the decision and keep its line for `ds41ctl cache` / doctor.
 * Explicit values are used as given.  Fails (naming the sizes) when the memory cannot hold one
 * layer's expert slots at max_sequences. */
static int decide_budgets(model *m, const settings *st, const ds41_mem_info *mem, uint64_t kv_bytes,
                          ds41_engine_opts *eo, ds41_error *err) {
    ds41_auto_budget_opts ao = {.dir = m->path,
                                .expert_auto = st->expert_cache_bytes == 0,
                                .engram_auto = st->engram_cache_bytes == 0,
                                .expert_bytes = st->expert_cache_bytes,
                                .engram_bytes = st->engram_cache_bytes,
                                .kv_bytes = kv_bytes,
                                .batch = st->max_sequences,
                                .mem = mem};
    ds41_budget_plan plan;
    char line[sizeof m->budgets];
    if (ds41_auto_budget(&ao, &plan, NULL, line, sizeof line, err) != 0) return -1;
    eo->expert_cache_bytes = plan.expert_bytes;
    eo->engram_cache_bytes = plan.engram_bytes;
    ds41_log(DS41_LOG_INFO, "model %s: %s%s", m->name, line,
             mem->test_override ? " [test hook " DS41_TEST_MEM_AVAILABLE_ENV "]" : "");
    /* An explicit expert budget: still size what "auto" would give, for a run-time change. */
    uint64_t auto_expert = plan.expert_bytes;
    ds41_error aerr = {{0}};
    if (!ao.expert_auto) {
        ds41_auto_budget_opts a2 = ao;
        a2.expert_auto = true;
        a2.engram_auto = false;
        a2.engram_bytes = plan.engram_bytes;
        ds41_budget_plan p2;
        auto_expert = ds41_auto_budget(&a2, &p2, NULL, NULL, 0, &aerr) == 0 ? p2.expert_bytes : 0;
    }
    pthread_rwlock_wrlock(&m->lock);
    snprintf(m->budgets, sizeof m->budgets, "%s", line);
    m->auto_expert_bytes = auto_expert;
    snprintf(m->auto_expert_error, sizeof m->auto_expert_error, "%.255s", aerr.msg);
    pthread_rwlock_unlock(&m->lock);
    return 0;
}

static void sched_log(void *ctx, const char *line) {
    model *m = ctx;
    ds41_log(DS41_LOG_WARNING, "model %s: %s", m->name, line);
}

/* ---- the disk tier of the prefix cache (storage/snapshot_store.h) ---------------------------- */

static void store_log(void *ctx, const char *line) {
    model *m = ctx;
    ds41_log(DS41_LOG_WARNING, "model %s: %s", m->name, line);
}

/* The largest state a snapshot of n_ids tokens of this model can hold: the KV state of n_ids
 * tokens plus room for a sampler state. */
static uint64_t snapshot_max_raw(void *ctx, size_t n_ids) {
    model *m = ctx;
    return ds41_kv_serialized_size_for(ds41_kv_pool_layout(m->layout_pool), n_ids) + (64ull << 20);
}

/* The scheduler's partitions and the snapshot files' owners are the same thing. */
ds41_snapshot_owner es_owner_of(const ds41_sched_partition *part) {
    ds41_snapshot_owner o = {.uid = part->owner_uid};
    _Static_assert(sizeof o.key == sizeof part->key, "partition keys differ in size");
    memcpy(o.key, part->key, sizeof o.key);
    return o;
}

ds41_sched_partition es_partition_of(const ds41_snapshot_owner *o) {
    ds41_sched_partition part = {.owner_uid = o->uid};
    memcpy(part.key, o->key, sizeof part.key);
    return part;
}

/* Scheduler callback (engine thread): a prompt missed the in-memory cache. */
static ds41_kv_seq *disk_restore_once(model *m, ds41_kv_pool *pool, const ds41_sched_partition *part,
                                      const int32_t *ids, size_t n, size_t *n_cached, bool *retry) {
    *n_cached = 0;
    *retry = false;
    char name[DS41_SNAPSHOT_NAME_LEN + 1];
    const ds41_snapshot_owner owner = es_owner_of(part);
    if (ds41_snapshot_store_match(m->store, &owner, ids, n, name) == 0) return NULL;
    ds41_snapshot snap;
    ds41_error err = {{0}};
    if (ds41_snapshot_store_load(m->store, name, &snap, &err) != 0) { /* logged by the store, deleted */
        *retry = strncmp(err.msg, "no snapshot", 11) != 0;
        return NULL;
    }
    ds41_kv_seq *seq = NULL;
    if (snap.n_ids >= n || memcmp(snap.ids, ids, snap.n_ids * sizeof *ids) != 0 ||
        memcmp(snap.owner.key, owner.key, sizeof owner.key) != 0) {
        ds41_log(DS41_LOG_WARNING,
                 "model %s: snapshot %s does not hold a prefix of the prompt in its partition", m->name,
                 name);
    } else if (ds41_kv_seq_deserialize(pool, snap.kv, snap.kv_len, &seq, &err) != 0) {
        bool full = strstr(err.msg, "KV cache full") != NULL;
        ds41_log(DS41_LOG_WARNING, "model %s: snapshot %s/%s.snap refused: %s%s", m->name,
                 ds41_snapshot_store_dir(m->store), name, err.msg, full ? "" : " (deleted)");
        if (!full) ds41_snapshot_store_remove(m->store, name, NULL);
        *retry = !full;
    } else if (ds41_kv_seq_tokens(seq) != snap.n_ids) {
        ds41_log(DS41_LOG_WARNING, "model %s: snapshot %s holds %llu tokens for %zu ids (deleted)", m->name, name,
                 (unsigned long long)ds41_kv_seq_tokens(seq), snap.n_ids);
        ds41_kv_seq_free(seq);
        seq = NULL;
        ds41_snapshot_store_remove(m->store, name, NULL);
        *retry = true;
    } else {
        *n_cached = snap.n_ids;
        ds41_log(DS41_LOG_DEBUG, "model %s: restored %zu tokens from snapshot %s", m->name, snap.n_ids, name);
    }
    ds41_snapshot_free(&snap);
    return seq;
}

/* A refused snapshot leaves the index: the next longest one is tried (a few at most). */
static ds41_kv_seq *disk_restore(void *ctx, ds41_kv_pool *pool, const ds41_sched_partition *part,
                                 const int32_t *ids, size_t n, size_t *n_cached) {
    model *m = ctx;
    bool retry = true;
    ds41_kv_seq *seq = NULL;
    for (int attempt = 0; attempt < 4 && retry && !seq; attempt++)
        seq = disk_restore_once(m, pool, part, ids, n, n_cached, &retry);
    return seq;
}

/* Scheduler callback (engine thread, or the thread freeing the scheduler): a cached prefix (a
 * prompt less its last token, or a finished conversation) leaves the in-memory cache.  Serialized
 * here (a copy of its pages), written by the store's writer thread. */
static void disk_evicted(void *ctx, const ds41_kv_seq *seq, const ds41_sched_partition *part,
                         const int32_t *ids, size_t n) {
    model *m = ctx;
    if ((uint64_t)n != ds41_kv_seq_tokens(seq) || n == 0) return;
    const ds41_snapshot_owner owner = es_owner_of(part);
    if (ds41_snapshot_store_contains(m->store, &owner, ids, n))
        return; /* already on disk (queued saves aside) */
    size_t len = ds41_kv_seq_serialized_size(seq), written = 0;
    uint8_t *kv = malloc(len);
    int32_t *copy = malloc(n * sizeof *copy);
    ds41_error err = {{0}};
    if (!kv || !copy || ds41_kv_seq_serialize(seq, kv, len, &written, &err) != 0) {
        ds41_log(DS41_LOG_WARNING, "model %s: cannot snapshot a conversation: %s", m->name,
                 err.msg[0] ? err.msg : "out of memory");
        free(kv);
        free(copy);
        return;
    }
    memcpy(copy, ids, n * sizeof *copy);
    if (ds41_snapshot_store_save_async(m->store, &owner, copy, n, kv, len, &err) != 0)
        ds41_log(DS41_LOG_WARNING, "model %s: cannot snapshot a conversation: %s", m->name, err.msg);
}

/* Open the model's snapshot store (loader thread).  Failing to is not fatal: the model serves
 * without a disk tier. */
static void open_store(model *m, const settings *st, ds41_engine *engine) {
    ds41_error err = {{0}};
    char dir[PATH_MAX];
    if (snprintf(dir, sizeof dir, "%s/%s", st->snapshots_dir, m->name) >= (int)sizeof dir) {
        ds41_log(DS41_LOG_WARNING, "model %s: snapshots off: path too long", m->name);
        return;
    }
    ds41_snapshot_store_opts o = {.dir = dir,
                                  .max_bytes = st->snapshots_max_bytes,
                                  .max_raw = snapshot_max_raw,
                                  .max_raw_ctx = m,
                                  .write = {.test_delay_ms = st->snapshot_delay_ms},
                                  .log = store_log,
                                  .log_ctx = m};
    m->layout_pool = ds41_engine_new_pool(engine, 0, 0, &err);
    if (!m->layout_pool || ds41_snapshot_model_id(m->path, o.model_id, &err) != 0 ||
        ds41_snapshot_store_open(&o, &m->store, &err) != 0) {
        ds41_log(DS41_LOG_WARNING, "model %s: snapshots off: %s", m->name, err.msg);
        ds41_kv_pool_free(m->layout_pool);
        m->layout_pool = NULL;
        m->store = NULL;
        return;
    }
    ds41_snapshot_store_stats ss;
    ds41_snapshot_store_get_stats(m->store, &ss);
    ds41_log(DS41_LOG_INFO, "model %s: %llu session snapshot(s) in %s", m->name, (unsigned long long)ss.entries, dir);
}

/* Remove m from the pending swaps (cfg_lock held for writing). */
static void pending_remove(ds41_engine_service *s, const model *m) {
    for (size_t i = 0; i < s->n_pending; i++)
        if (s->pending[i] == m) {
            s->pending[i] = s->pending[--s->n_pending];
            return;
        }
}

/* A replaced model no request can find any more: the calls that found it before the swap end
 * first (its write lock), its running requests get drain_ms to finish -- cancellable meanwhile:
 * m->sched stays set while the scheduler drains -- then it unloads. */
static void model_retire(model *m, unsigned drain_ms) {
    model_join_loader(m);
    pthread_rwlock_wrlock(&m->lock);
    ds41_scheduler *sched = m->sched;
    pthread_rwlock_unlock(&m->lock);
    ds41_scheduler_free(sched, drain_ms);
    pthread_rwlock_wrlock(&m->lock);
    m->sched = NULL;
    pthread_rwlock_unlock(&m->lock);
    model_free(m, 0);
}

/* Loader thread of a model loaded for a path change, now READY: it takes the place of the model
 * it replaces (new requests reach it from now on); the old one serves its running requests to
 * their end (limits.drain_timeout_s at most) and unloads. */
static void swap_in(model *m) {
    ds41_engine_service *s = m->svc;
    pthread_rwlock_wrlock(&s->cfg_lock);
    model *old = m->replaces;
    bool found = false;
    for (size_t i = 0; i < s->n_models && !found; i++) {
        if (s->models[i] != old) continue;
        s->models[i] = m;
        m->is_default = old->is_default;
        found = true;
    }
    if (found) { /* else it stays pending: ds41_engine_service_free frees it */
        pending_remove(s, m);
        m->replaces = NULL;
    }
    const unsigned drain_ms = s->st.drain_ms;
    pthread_rwlock_unlock(&s->cfg_lock);
    if (!found) return;
    char old_path[PATH_MAX];
    snprintf(old_path, sizeof old_path, "%s", old->path);
    ds41_log(DS41_LOG_INFO,
             "model %s now serves %s (was %s); the old directory unloads once its requests end", m->name,
             m->path, old_path);
    model_retire(old, drain_ms);
    ds41_log(DS41_LOG_INFO, "model %s: %s unloaded", m->name, old_path);
}

typedef struct load_arg {
    model *m;
    settings st; /* a copy of what loading needs */
} load_arg;

static void *loader_main(void *p) {
    load_arg *a = p;
    model *m = a->m;
    ds41_engine_service *s = m->svc;
    ds41_error err = {{0}};
    ds41_engine *engine = NULL;
    ds41_vocab *vocab = NULL;
    ds41_tokenizer *tok = NULL;
    ds41_scheduler *sched = NULL;

    if (m->embedded && !has_checkpoint(m->path)) {
        progress(s, m, DS41_MODEL_LOADING, "generating the embedded model");
        pthread_rwlock_wrlock(&m->lock);
        snprintf(m->detail, sizeof m->detail, "generating the embedded model");
        pthread_rwlock_unlock(&m->lock);
        if (generate_embedded(m, &a->st, &err) != 0) goto fail;
        ds41_log(DS41_LOG_INFO, "generated the embedded model (%s, seed %llu) in %s", a->st.embedded_preset,
                 (unsigned long long)a->st.embedded_seed, m->path);
    }
    load_progress_start(m);
    progress(s, m, DS41_MODEL_LOADING, "loading the checkpoint");
    pthread_rwlock_wrlock(&m->lock);
    snprintf(m->detail, sizeof m->detail, "loading %s", m->path);
    pthread_rwlock_unlock(&m->lock);
    ds41_engine_opts eo = {.reference = a->st.mode == DS41_ENGINE_MODE_REFERENCE,
                           .cpu = {.threads = (int)a->st.threads},
                           .expert_cache_bytes = a->st.expert_cache_bytes,
                           .host_expert_cache_bytes = a->st.host_expert_cache_bytes,
                           .engram_cache_bytes = a->st.engram_cache_bytes,
                           .progress = on_load_progress,
                           .progress_ctx = m};
    ds41_mem_info mem;
    ds41_error merr = {{0}};
    const bool have_mem = ds41_mem_read(NULL, &mem, &merr) == 0;
    if (!have_mem) ds41_log(DS41_LOG_WARNING, "model %s: %s", m->name, merr.msg);
    const uint64_t kv_bytes = a->st.kv_cache_bytes ? a->st.kv_cache_bytes : auto_kv_budget(have_mem ? &mem : NULL);
    if (have_mem && decide_budgets(m, &a->st, &mem, kv_bytes, &eo, &err) != 0) goto fail;
    /* Under the read-fault test hook prediction is off: a failed predicted
     * read is read again when a layer needs the expert, so only with
     * prediction off is the Nth read surely one a request waits for. */
    eo.expert_no_predict = a->st.test_fault_expert_read != 0;
    if (!eo.reference) {
        /* engine.backend: the engine owns the backend from the load on. */
        char why[256];
        eo.backend = ds41_backend_open_why(ds41_cfg_backend_name(a->st.backend), &eo.cpu, (int)a->st.cuda_device,
                                           why, sizeof why, &err);
        if (!eo.backend) {
            ds41_error_prefix(&err, "engine.backend");
            goto fail;
        }
        ds41_log(DS41_LOG_INFO, "model %s: %s", m->name, why);
    }
    engine = ds41_engine_load(m->path, &eo, &err);
    if (!engine) goto fail;
    if (ds41_engine_experts_streamed(engine)) {
        ds41_expert_cache_stats xs;
        ds41_engine_expert_stats(engine, &xs, false);
        ds41_reader *rd = ds41_engine_expert_reader(engine);
        ds41_log(DS41_LOG_INFO,
                 "model %s: routed experts streamed: %llu slots of %llu bytes for %llu bytes of experts (reader %s, "
                 "O_DIRECT %s)",
                 m->name, (unsigned long long)xs.slots, (unsigned long long)xs.slot_bytes,
                 (unsigned long long)xs.total_bytes, xs.backend, xs.direct ? "yes" : "no");
        if (rd && ds41_reader_warning(rd)) ds41_log(DS41_LOG_WARNING, "model %s: %s", m->name, ds41_reader_warning(rd));
        /* Test hook (engine.test_fault_expert_read): the Nth expert read fails once. */
        if (rd && a->st.test_fault_expert_read)
            ds41_reader_set_fault(rd, DS41_READER_ANY_FILE, DS41_FAULT_EIO, a->st.test_fault_expert_read, 0);
    }
    vocab = ds41_vocab_load_dir(m->path, &err);
    tok = vocab ? ds41_tokenizer_new(vocab, &err) : NULL;
    if (!tok) goto fail;
    const ds41_model_config *mc = ds41_engine_config(engine);
    if (ds41_vocab_size(vocab) > (uint32_t)mc->vocab_size)
        ds41_log(DS41_LOG_WARNING, "model %s: the tokenizer has %u ids, the model %lld", m->name, ds41_vocab_size(vocab),
                 (long long)mc->vocab_size);
    ds41_sched_config sc = {.max_sequences = a->st.max_sequences,
                            .max_batch_tokens = a->st.max_batch_tokens,
                            .prefill_chunk = a->st.prefill_chunk,
                            .max_queue = a->st.max_queue,
                            .kv_budget_bytes = kv_bytes,
                            .prefix_cache = a->st.prefix_cache,
                            .prefix_cache_max_bytes = a->st.prefix_cache_max_bytes,
                            .log = sched_log,
                            .log_ctx = m};
    if (a->st.speculative) {
        /* the model's DSpark head drafts (engine/serve/speculative.h) */
        if (ds41_spec_head_provider(engine, &sc.draft, &err) != 0) {
            ds41_error_prefix(&err, "engine.speculative");
            goto fail;
        }
        if ((int64_t)a->st.spec_max_draft > mc->dspark_block_size) {
            ds41_fail(&err, "engine.speculative_max_draft: %u is above the model's dspark_block_size %lld",
                      a->st.spec_max_draft, (long long)mc->dspark_block_size);
            goto fail;
        }
        sc.spec = (ds41_spec_config){.max_k = a->st.spec_max_draft,
                                     .min_confidence = (float)a->st.spec_min_confidence_pct / 100.0f,
                                     .max_backoff = DS41_SPEC_MAX_BACKOFF};
    }
    if (a->st.snapshots && !m->store) open_store(m, &a->st, engine);
    if (m->store) sc.disk = (ds41_sched_disk){.restore = disk_restore, .evicted = disk_evicted, .ctx = m};
    if (ds41_scheduler_new(engine, &sc, &sched, &err) != 0) goto fail;

    pthread_rwlock_wrlock(&m->lock);
    m->engine = engine;
    m->vocab = vocab;
    m->tok = tok;
    m->sched = sched;
    m->n_vocab = (uint32_t)mc->vocab_size;
    uint64_t ctx = a->st.max_context ? a->st.max_context : (uint64_t)(mc->max_seq_len > 0 ? mc->max_seq_len : 0);
    m->context = ctx;
    m->bytes = checkpoint_bytes(m->path);
    m->state = DS41_MODEL_READY;
    m->created = (int64_t)time(NULL);
    snprintf(m->detail, sizeof m->detail, "ready");
    pthread_rwlock_unlock(&m->lock);
    ds41_log(DS41_LOG_INFO, "model %s ready (%s, %.1f MB, context %llu)", m->name, m->path, (double)m->bytes / 1e6,
             (unsigned long long)ctx);
    progress(s, m, DS41_MODEL_READY, "ready");
    settings_free(&a->st);
    free(a);
    if (m->replaces) swap_in(m);
    return NULL;
fail:
    ds41_scheduler_free(sched, 0);
    ds41_snapshot_store_free(m->store);
    m->store = NULL;
    ds41_kv_pool_free(m->layout_pool);
    m->layout_pool = NULL;
    ds41_tokenizer_free(tok);
    ds41_vocab_free(vocab);
    ds41_engine_free(engine);
    if (atomic_load_explicit(&m->load_state, memory_order_relaxed) != LOAD_NONE)
        atomic_store_explicit(&m->load_state, LOAD_FAILED, memory_order_release);
    pthread_rwlock_wrlock(&m->lock);
    m->state = DS41_MODEL_FAILED;
    snprintf(m->detail, sizeof m->detail, "%.250s", err.msg);
    pthread_rwlock_unlock(&m->lock);
    if (m->replaces) /* reaped by ds41_engine_service_tick */
        ds41_log(DS41_LOG_ERROR, "model %s: the new path %s failed to load: %s; %s keeps serving", m->name,
                 m->path, err.msg, m->replaces->path);
    else
        ds41_log(DS41_LOG_ERROR, "model %s: %s", m->name, err.msg);
    progress(s, m, DS41_MODEL_FAILED, err.msg);
    settings_free(&a->st);
    free(a);
    return NULL;
}

static int settings_copy(const settings *src, settings *dst) {
    *dst = *src;
    dst->models = NULL;
    dst->n_models = 0;
    dst->embedded_name = sdup(src->embedded_name);
    dst->embedded_preset = sdup(src->embedded_preset);
    dst->embedded_dir = sdup(src->embedded_dir);
    dst->snapshots_dir = sdup(src->snapshots_dir);
    return (src->embedded_name && !dst->embedded_name) || (src->embedded_preset && !dst->embedded_preset) ||
                   (src->embedded_dir && !dst->embedded_dir) || (src->snapshots_dir && !dst->snapshots_dir)
               ? -1
               : 0;
}

/* Start loading m (callers hold cfg_lock).  0 when started or nothing to do. */
static int model_start_load(ds41_engine_service *s, model *m, ds41_error *err) {
    /* A model that lost a shard mapping is dropped first (its scheduler fails what is left; the
     * old mappings go), then loaded afresh.  loader_mu: two loads at once drop it only once. */
    pthread_mutex_lock(&m->loader_mu);
    pthread_rwlock_rdlock(&m->lock);
    ds41_error lost;
    bool is_lost = es_effective_state(m, &lost) != m->state;
    pthread_rwlock_unlock(&m->lock);
    if (is_lost) {
        ds41_log(DS41_LOG_WARNING, "model %s: reloading (%s)", m->name, lost.msg);
        model_unload(m, 0);
    }
    pthread_mutex_unlock(&m->loader_mu);
    pthread_rwlock_wrlock(&m->lock);
    if (m->state == DS41_MODEL_READY || m->state == DS41_MODEL_LOADING) {
        pthread_rwlock_unlock(&m->lock);
        return 0;
    }
    m->state = DS41_MODEL_LOADING;
    snprintf(m->detail, sizeof m->detail, "loading");
    pthread_rwlock_unlock(&m->lock);
    model_join_loader(m); /* a finished earlier attempt */
    load_arg *a = calloc(1, sizeof *a);
    if (!a || settings_copy(&s->st, &a->st) != 0) {
        if (a) settings_free(&a->st);
        free(a);
        pthread_rwlock_wrlock(&m->lock);
        m->state = DS41_MODEL_FAILED;
        pthread_rwlock_unlock(&m->lock);
        return ds41_fail(err, "out of memory");
    }
    a->m = m;
    pthread_mutex_lock(&m->loader_mu);
    int e = pthread_create(&m->loader, NULL, loader_main, a);
    m->loader_started = e == 0;
    pthread_mutex_unlock(&m->loader_mu);
    if (e != 0) {
        settings_free(&a->st);
        free(a);
        pthread_rwlock_wrlock(&m->lock);
        m->state = DS41_MODEL_FAILED;
        pthread_rwlock_unlock(&m->lock);
        return ds41_fail(err, "cannot start a loader thread: %s", strerror(e));
    }
    return 0;
}

/* The model a request names (NULL: the default); callers hold cfg_lock. */
model *es_find_model(ds41_engine_service *s, const char *name) {
    for (size_t i = 0; i < s->n_models; i++)
        if (name ? strcmp(s->models[i]->name, name) == 0 : s->models[i]->is_default) return s->models[i];
    return NULL;
}

/* Find a READY model and take its read lock.  On error fills err (404 / 503). */
model *es_acquire_model(ds41_engine_service *s, const char *name, ds41_svc_error *err) {
    model *m = es_find_model(s, name);
    if (!m) {
        ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "model", "The model '%s' does not exist", name ? name : "(default)");
        snprintf(err->code, sizeof err->code, "model_not_found");
        return NULL;
    }
    pthread_rwlock_rdlock(&m->lock);
    ds41_error lost;
    const ds41_model_state state = es_effective_state(m, &lost);
    if (state != DS41_MODEL_READY) {
        const bool is_lost = state != m->state;
        if (m->state == DS41_MODEL_UNLOADED) {
            ds41_svc_fail(
                err, DS41_SVC_UNAVAILABLE, "model",
                "The model '%s' is configured but not loaded; load it with `ds41ctl models load %s` or "
                "POST /admin/models/load {\"name\": \"%s\"}",
                m->name, m->name, m->name);
            snprintf(err->code, sizeof err->code, "model_not_loaded");
        } else {
            const char *what = is_lost                          ? "failed"
                               : m->state == DS41_MODEL_LOADING ? "is loading"
                                                                : "failed to load";
            ds41_svc_fail(err, DS41_SVC_UNAVAILABLE, NULL, "The model '%s' %s (%s)%s%s%s", m->name, what,
                          is_lost ? lost.msg : m->detail,
                          m->state == DS41_MODEL_LOADING ? "" : "; load it again with `ds41ctl models load ",
                          m->state == DS41_MODEL_LOADING ? "" : m->name,
                          m->state == DS41_MODEL_LOADING ? "" : "`");
        }
        err->retry_after_s = m->state == DS41_MODEL_LOADING ? 5 : 30;
        pthread_rwlock_unlock(&m->lock);
        return NULL;
    }
    return m;
}

/* ---- other service functions ------------------------------------------------------------------ */

/* Ready while at least one model serves (the body lists each model's state: ipc/api.c); else
 * loading while one loads, else error, with the default model's state as the detail. */
static void svc_health(void *ctx, ds41_svc_health *out) {
    ds41_engine_service *s = ctx;
    memset(out, 0, sizeof *out);
    bool ready = false, loading = false;
    pthread_rwlock_rdlock(&s->cfg_lock);
    for (size_t i = 0; i < s->n_models && !ready; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        ds41_error lost;
        const ds41_model_state state = es_effective_state(m, &lost);
        ready = state == DS41_MODEL_READY;
        loading |= state == DS41_MODEL_LOADING;
        if (m->is_default || !out->detail[0])
            snprintf(out->detail, sizeof out->detail, "%.64s: %.180s", m->name,
                     state != m->state ? lost.msg : m->detail);
        pthread_rwlock_unlock(&m->lock);
    }
    if (!s->n_models) snprintf(out->detail, sizeof out->detail, "no model is configured");
    pthread_rwlock_unlock(&s->cfg_lock);
    out->state = ready ? DS41_HEALTH_OK : loading ? DS41_HEALTH_LOADING : DS41_HEALTH_ERROR;
    if (ready) out->detail[0] = 0;
}

static int svc_list_models(void *ctx, ds41_svc_model_emit emit, void *acc, ds41_svc_error *err) {
    (void)err;
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    for (size_t i = 0; i < s->n_models; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        ds41_svc_tier_bytes tier = {.tier = "ram", .bytes = m->bytes};
        ds41_error lost;
        const ds41_model_state state = es_effective_state(m, &lost);
        const int ls = atomic_load_explicit(&m->load_state, memory_order_acquire);
        const ds41_svc_load load = {
            .state = load_state_name(ls),
            .bytes_done = atomic_load_explicit(&m->load_bytes_done, memory_order_relaxed),
            .bytes_total = atomic_load_explicit(&m->load_bytes_total, memory_order_relaxed),
            .tensors_done = atomic_load_explicit(&m->load_tensors_done, memory_order_relaxed),
            .tensors_total = atomic_load_explicit(&m->load_tensors_total, memory_order_relaxed)};
        ds41_svc_model sm = {.load = ls != LOAD_NONE ? &load : NULL,
                             .id = m->name,
                             .path = m->path,
                             .state = state,
                             .created = m->created,
                             .context_length = state == DS41_MODEL_READY ? m->context : 0,
                             .detail = state != m->state ? lost.msg : m->detail,
                             .tiers = state == DS41_MODEL_READY ? &tier : NULL,
                             .n_tiers = state == DS41_MODEL_READY ? 1 : 0,
                             .threads = state == DS41_MODEL_READY && m->engine
                                            ? (uint32_t)ds41_backend_threads(ds41_engine_backend(m->engine))
                                            : 0};
        emit(acc, &sm);
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return 0;
}

/* ---- admin -------------------------------------------------------------------------------------- */

static int svc_load_model(void *ctx, const char *name, const char *path, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = NULL;
    if (path) {
        char want[PATH_MAX];
        if (!realpath(path, want)) {
            pthread_rwlock_unlock(&s->cfg_lock);
            return ds41_svc_fail(err, DS41_SVC_FORBIDDEN, "path", "the path is not a configured model directory");
        }
        for (size_t i = 0; i < s->n_models && !m; i++) {
            char have[PATH_MAX];
            if (realpath(s->models[i]->path, have) && strcmp(have, want) == 0) m = s->models[i];
        }
        if (!m) {
            pthread_rwlock_unlock(&s->cfg_lock);
            return ds41_svc_fail(err, DS41_SVC_FORBIDDEN, "path", "the path is not a configured model directory");
        }
        if (name && strcmp(name, m->name) != 0) {
            pthread_rwlock_unlock(&s->cfg_lock);
            return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "name", "the path belongs to the model '%s'", m->name);
        }
    } else {
        m = es_find_model(s, name);
        if (!m) {
            pthread_rwlock_unlock(&s->cfg_lock);
            ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "name", "The model '%s' is not configured", name ? name : "");
            snprintf(err->code, sizeof err->code, "model_not_found");
            return -1;
        }
    }
    pthread_rwlock_rdlock(&m->lock);
    bool ready = es_effective_state(m, NULL) == DS41_MODEL_READY; /* a lost model loads again */
    pthread_rwlock_unlock(&m->lock);
    int rc = 0;
    if (!ready) {
        ds41_error e;
        if (model_start_load(s, m, &e) != 0)
            rc = ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "%s", e.msg);
        else
            rc = 1;
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

static int svc_unload_model(void *ctx, const char *name, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = es_find_model(s, name);
    if (!m) {
        pthread_rwlock_unlock(&s->cfg_lock);
        ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "name", "The model '%s' is not configured", name ? name : "");
        snprintf(err->code, sizeof err->code, "model_not_found");
        return -1;
    }
    pthread_rwlock_rdlock(&m->lock);
    bool loading = m->state == DS41_MODEL_LOADING;
    pthread_rwlock_unlock(&m->lock);
    if (loading) {
        pthread_rwlock_unlock(&s->cfg_lock);
        return ds41_svc_fail(err, DS41_SVC_CONFLICT, "name", "The model '%s' is loading", m->name);
    }
    model_unload(m, 0);
    ds41_log(DS41_LOG_INFO, "model %s unloaded", m->name);
    pthread_rwlock_unlock(&s->cfg_lock);
    return 0;
}

/* ---- lifecycle ------------------------------------------------------------------------------------ */

static int build_models(ds41_engine_service *s, ds41_error *err) {
    s->models = calloc(s->st.n_models, sizeof *s->models);
    if (!s->models) return ds41_fail(err, "out of memory");
    for (size_t i = 0; i < s->st.n_models; i++) {
        s->models[i] = model_new(s, &s->st.models[i], s->st.embedded);
        if (!s->models[i]) return ds41_fail(err, "out of memory");
        s->n_models++;
    }
    return 0;
}

int ds41_engine_service_new(const ds41_daemon_config *cfg, ds41_engine_service_progress prog, void *prog_ctx,
                            ds41_engine_service **out, ds41_error *err) {
    *out = NULL;
    ds41_engine_service *s = calloc(1, sizeof *s);
    if (!s) return ds41_fail(err, "out of memory");
    if (settings_from(cfg, &s->st, err) != 0) {
        free(s);
        return -1;
    }
    s->progress = prog;
    s->progress_ctx = prog_ctx;
    pthread_rwlock_init(&s->cfg_lock, NULL);
    pthread_mutex_init(&s->jobs_mu, NULL);
    if (build_models(s, err) != 0) {
        ds41_engine_service_free(s, 0);
        return -1;
    }
    s->iface = (ds41_service){.ctx = s,
                              .health = svc_health,
                              .list_models = svc_list_models,
                              .load_model = svc_load_model,
                              .unload_model = svc_unload_model};
    es_generation_routes(&s->iface);
    es_metrics_routes(&s->iface);
    es_cache_routes(&s->iface);
    *out = s;
    return 0;
}

const ds41_service *ds41_engine_service_iface(ds41_engine_service *s) { return &s->iface; }

int ds41_engine_service_load(ds41_engine_service *s, const char *name, ds41_error *err) {
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = es_find_model(s, name);
    int rc = m ? model_start_load(s, m, err) : ds41_fail(err, "no model '%s'", name ? name : "(default)");
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

ds41_model_state ds41_engine_service_default_state(ds41_engine_service *s, char *detail, size_t detail_size) {
    ds41_model_state st = DS41_MODEL_FAILED;
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = es_find_model(s, NULL);
    if (m) {
        pthread_rwlock_rdlock(&m->lock);
        ds41_error lost;
        st = es_effective_state(m, &lost);
        if (detail && detail_size) snprintf(detail, detail_size, "%s", st != m->state ? lost.msg : m->detail);
        pthread_rwlock_unlock(&m->lock);
    } else if (detail && detail_size) {
        snprintf(detail, detail_size, "no default model");
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return st;
}

/* Free the pending swaps whose new directory failed to load (their loader thread cannot). */
static void reap_failed_swaps(ds41_engine_service *s) {
    model *failed[8];
    size_t n = 0;
    pthread_rwlock_wrlock(&s->cfg_lock);
    for (size_t i = 0; i < s->n_pending && n < 8;) {
        model *m = s->pending[i];
        pthread_rwlock_rdlock(&m->lock);
        const bool dead = m->state == DS41_MODEL_FAILED;
        pthread_rwlock_unlock(&m->lock);
        if (dead) {
            failed[n++] = m;
            pending_remove(s, m);
        } else {
            i++;
        }
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    for (size_t i = 0; i < n; i++) model_free(failed[i], 0);
}

/* A directory a reload may point a model at, checked before anything running is touched: a
 * valid inference/config.json, a checkpoint whose index and shard headers open (no payload byte
 * is read: storage/safetensors.h) and a tokenizer.json file. */
static int check_model_dir(const char *path, ds41_error *err) {
    struct stat sb;
    if (stat(path, &sb) != 0) return ds41_fail(err, "%s: %s", path, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return ds41_fail(err, "%s: not a directory", path);
    ds41_model_config mc;
    if (ds41_model_config_load(path, &mc, err) != 0) return -1;
    ds41_model_config_free(&mc);
    ds41_checkpoint *ck = ds41_checkpoint_open(path, err);
    if (!ck) return -1;
    ds41_checkpoint_close(ck);
    char tok[PATH_MAX];
    if (snprintf(tok, sizeof tok, "%s/tokenizer.json", path) >= (int)sizeof tok)
        return ds41_fail(err, "%s: path too long", path);
    if (stat(tok, &sb) != 0) return ds41_fail(err, "%s: %s", tok, strerror(errno));
    if (!S_ISREG(sb.st_mode)) return ds41_fail(err, "%s: not a file", tok);
    return 0;
}

int ds41_engine_service_reconfigure(ds41_engine_service *s, const ds41_daemon_config *cfg, ds41_error *err) {
    settings st;
    if (settings_from(cfg, &st, err) != 0) return -1;
    const size_t n = st.n_models;
    /* per new entry: the running model of that name and kind (NULL: added), and a new model
     * object when the entry is added or its path changed */
    model **prev = calloc(n ? n : 1, sizeof *prev), **fresh = calloc(n ? n : 1, sizeof *fresh);
    model **list = calloc(n ? n : 1, sizeof *list), **pend = calloc(n ? n : 1, sizeof *pend);
    model **gone = NULL;
    size_t n_gone = 0;
    bool applied = false;
    if (!prev || !fresh || !list || !pend) {
        ds41_fail(err, "out of memory");
        goto out;
    }
    /* Only this thread (SIGHUP) changes the model list, and not while a swap is pending, so the
     * plan made here still holds when it is applied below. */
    reap_failed_swaps(s);
    pthread_rwlock_rdlock(&s->cfg_lock);
    char swapping[160] = "";
    if (s->n_pending) snprintf(swapping, sizeof swapping, "%s", s->pending[0]->name);
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < s->n_models && !prev[i]; k++)
            if (strcmp(s->models[k]->name, st.models[i].name) == 0 && s->models[k]->embedded == st.embedded)
                prev[i] = s->models[k];
    const size_t n_old = s->n_models;
    pthread_rwlock_unlock(&s->cfg_lock);
    if (swapping[0]) {
        ds41_fail(
            err,
            "model %s is still loading its new path (an earlier reload); send SIGHUP again once it serves",
            swapping);
        goto out;
    }
    /* Check every new or changed directory before anything running is touched. */
    for (size_t i = 0; i < n; i++) {
        const model_setting *ms = &st.models[i];
        if (prev[i] && strcmp(prev[i]->path, ms->path) == 0) continue;
        if (!st.embedded && check_model_dir(ms->path, err) != 0) {
            if (prev[i])
                ds41_error_prefix(err, "models.%s.path changed from %s to %s", ms->name, prev[i]->path,
                                  ms->path);
            else
                ds41_error_prefix(err, "models.%s.path (a new model)", ms->name);
            goto out;
        }
        if (!(fresh[i] = model_new(s, ms, st.embedded))) {
            ds41_fail(err, "out of memory");
            goto out;
        }
    }
    if (!(gone = calloc(n_old + n + 1, sizeof *gone))) {
        ds41_fail(err, "out of memory");
        goto out;
    }

    pthread_rwlock_wrlock(&s->cfg_lock);
    size_t n_pend = 0;
    for (size_t i = 0; i < n; i++) {
        const model_setting *ms = &st.models[i];
        if (!fresh[i]) {
            list[i] = prev[i];
        } else if (!prev[i]) {
            list[i] = fresh[i];
            ds41_log(DS41_LOG_INFO, "reload: model %s added (%s)", ms->name, ms->path);
        } else {
            pthread_rwlock_rdlock(&prev[i]->lock);
            const bool serving = prev[i]->state == DS41_MODEL_READY || prev[i]->state == DS41_MODEL_LOADING;
            pthread_rwlock_unlock(&prev[i]->lock);
            if (serving) { /* the old directory serves until the new one is ready (swap_in) */
                list[i] = prev[i];
                fresh[i]->replaces = prev[i];
                pend[n_pend++] = fresh[i];
                ds41_log(
                    DS41_LOG_INFO,
                    "reload: models.%s.path changed from %s to %s: reloading %s (the old directory serves "
                    "until the new one is ready)",
                    ms->name, prev[i]->path, ms->path, ms->name);
            } else {
                list[i] = fresh[i];
                gone[n_gone++] = prev[i];
                ds41_log(DS41_LOG_INFO, "reload: models.%s.path changed from %s to %s (%s was not loaded)",
                         ms->name, prev[i]->path, ms->path, ms->name);
            }
        }
        list[i]->is_default = ms->is_default;
        if (fresh[i]) fresh[i]->is_default = ms->is_default;
    }
    for (size_t k = 0; k < s->n_models; k++) {
        bool kept = false;
        for (size_t i = 0; i < n && !kept; i++) kept = prev[i] == s->models[k];
        if (!kept) {
            gone[n_gone++] = s->models[k];
            ds41_log(DS41_LOG_INFO, "reload: model %s removed from the configuration: unloading",
                     s->models[k]->name);
        }
    }
    model *old_def = es_find_model(s, NULL);
    char old_def_name[160];
    snprintf(old_def_name, sizeof old_def_name, "%s", old_def ? old_def->name : "");
    settings_free(&s->st);
    s->st = st;
    memset(&st, 0, sizeof st);
    free(s->models);
    s->models = list;
    s->n_models = n;
    list = NULL;
    free(s->pending);
    s->pending = pend;
    s->n_pending = n_pend;
    pend = NULL;
    model *def = es_find_model(s, NULL);
    if (def && strcmp(def->name, old_def_name) != 0)
        ds41_log(DS41_LOG_INFO, "reload: the default model is now %s (was %s)", def->name,
                 old_def_name[0] ? old_def_name : "none");
    ds41_error lerr = {{0}};
    if (def && model_start_load(s, def, &lerr) != 0)
        ds41_log(DS41_LOG_ERROR, "model %s: %s", def->name, lerr.msg);
    for (size_t i = 0; i < s->n_pending; i++)
        if (model_start_load(s, s->pending[i], &lerr) != 0)
            ds41_log(DS41_LOG_ERROR, "model %s: %s", s->pending[i]->name, lerr.msg);
    pthread_rwlock_unlock(&s->cfg_lock);
    applied = true;
    /* unload the models that are gone (no new request can reach them now) */
    for (size_t k = 0; k < n_gone; k++) model_free(gone[k], 0);
out:
    if (!applied)
        for (size_t i = 0; i < n; i++) model_free(fresh ? fresh[i] : NULL, 0);
    settings_free(&st);
    free(prev);
    free(fresh);
    free(list);
    free(pend);
    free(gone);
    return applied ? 0 : -1;
}

void ds41_engine_service_tick(ds41_engine_service *s) {
    pthread_rwlock_rdlock(&s->cfg_lock);
    uint32_t limit = s->st.request_timeout_s;
    const bool swaps = s->n_pending > 0;
    pthread_rwlock_unlock(&s->cfg_lock);
    if (swaps) reap_failed_swaps(s);
    if (!limit) return;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    pthread_mutex_lock(&s->jobs_mu);
    for (job *j = s->jobs; j; j = j->next) {
        if (j->timed_out || !j->sched_id || now.tv_sec - j->started.tv_sec < (time_t)limit) continue;
        j->timed_out = true;
        ds41_log(DS41_LOG_WARNING, "request %llu ran past limits.request_timeout_s (%u s): ended",
                 (unsigned long long)j->ipc_id, limit);
        ds41_scheduler_cancel(j->m->sched, j->sched_id);
    }
    pthread_mutex_unlock(&s->jobs_mu);
}

void ds41_engine_service_free(ds41_engine_service *s, unsigned drain_ms) {
    if (!s) return;
    /* pending swaps first: a load that finishes swaps in (its loader retires the old model) */
    pthread_rwlock_rdlock(&s->cfg_lock);
    size_t n_pend = s->n_pending;
    model **pend = n_pend ? malloc(n_pend * sizeof *pend) : NULL;
    if (pend) memcpy(pend, s->pending, n_pend * sizeof *pend);
    pthread_rwlock_unlock(&s->cfg_lock);
    for (size_t i = 0; pend && i < n_pend; i++) model_join_loader(pend[i]);
    free(pend);
    for (size_t i = 0; i < s->n_pending; i++) model_free(s->pending[i], 0); /* failed to load */
    free(s->pending);
    for (size_t i = 0; i < s->n_models; i++) model_free(s->models[i], drain_ms);
    free(s->models);
    settings_free(&s->st);
    pthread_rwlock_destroy(&s->cfg_lock);
    pthread_mutex_destroy(&s->jobs_mu);
    free(s);
}
