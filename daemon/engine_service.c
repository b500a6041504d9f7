/* ds41d's ds41_service on the engine (see engine_service.h). */
#include "daemon/engine_service.h"

#include "daemon/log.h"
#include "engine/serve/auto_budget.h"
#include "engine/forward/forward.h"
#include "engine/serve/generate.h"
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

typedef struct model_setting {
    char *name, *path;
    bool is_default;
} model_setting;

typedef struct settings {
    model_setting *models;
    size_t n_models;
    bool embedded; /* serving the embedded model (models empty) */
    char *embedded_name, *embedded_preset, *embedded_dir;
    uint64_t embedded_seed;
    ds41_engine_mode mode;
    uint32_t threads; /* fast backend workers, 0 = one per CPU */
    uint32_t max_sequences, max_batch_tokens, prefill_chunk;
    bool test_forced_output;
    uint64_t test_fault_expert_read;
    uint64_t kv_cache_bytes;
    uint64_t expert_cache_bytes;
    uint64_t engram_cache_bytes; /* Engram row tier budget, 0 = tables resident */
    uint32_t max_queue, max_tokens_default, max_context, request_timeout_s;
    uint32_t drain_ms; /* limits.drain_timeout_s: what a replaced model's requests get to end */
    bool prefix_cache;
    uint64_t prefix_cache_max_bytes;
    bool prefix_share; /* prefix_cache.share_across_users */
    bool snapshots;
    uint64_t snapshots_max_bytes;
    uint32_t snapshot_delay_ms; /* TEST ONLY */
    char *snapshots_dir;        /* <state_directory>/snapshots */
} settings;

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
    st->max_sequences = cfg->engine.max_sequences;
    st->max_batch_tokens = cfg->engine.max_batch_tokens;
    st->prefill_chunk = cfg->engine.prefill_chunk;
    st->test_forced_output = cfg->engine.test_forced_output;
    st->kv_cache_bytes = cfg->memory.kv_cache_bytes;
    st->expert_cache_bytes = cfg->memory.expert_cache_bytes;
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

typedef struct model {
    struct ds41_engine_service *svc;
    char *name, *path;
    bool is_default;
    bool embedded;

    pthread_rwlock_t lock; /* the fields below; readers use the engine, writers swap it */
    ds41_model_state state;
    char detail[256];
    int64_t created;
    ds41_engine *engine;
    ds41_vocab *vocab;
    ds41_tokenizer *tok;
    ds41_scheduler *sched;
    ds41_snapshot_store *store; /* the disk tier (NULL: snapshots off) */
    ds41_kv_pool *layout_pool;  /* an empty pool: the KV layout for snapshot size bounds */
    uint32_t n_vocab;
    uint64_t context;
    uint64_t bytes; /* checkpoint bytes (mapped) */
    char budgets[512]; /* the memory budgets decided at load ("budgets: auto -> ..."), "" before */
    /* What "auto" means for the expert budget at run time (ds41ctl cache --set-expert-bytes auto):
     * the auto decision at load, given the Engram budget then chosen; when that decision found
     * no room, auto_expert_error says why (and "auto" is refused). */
    uint64_t auto_expert_bytes;
    char auto_expert_error[256];

    pthread_mutex_t loader_mu;
    bool loader_started; /* a loader thread exists and has not been joined */
    pthread_t loader;
    /* A reload changed the path of a loaded model: this one loads the new directory outside the
     * model list while `replaces` (the running one) keeps serving, and takes its place once
     * READY (swap_in).  NULL otherwise.  Under the service's cfg_lock. */
    struct model *replaces;
} model;

typedef struct job job;

struct ds41_engine_service {
    ds41_service iface;
    ds41_engine_service_progress progress;
    void *progress_ctx;

    pthread_rwlock_t cfg_lock; /* settings, the model list and the pending swaps */
    settings st;
    model **models;
    size_t n_models;
    model **pending; /* models loading for a path change (model.replaces), not in the list yet */
    size_t n_pending;

    pthread_mutex_t jobs_mu;
    job *jobs;
};

static void progress(ds41_engine_service *s, const model *m, ds41_model_state state, const char *detail) {
    if (s->progress) s->progress(s->progress_ctx, m->name, state, detail);
}

/* The state clients see (callers hold m->lock): a READY model whose engine lost a mapped shard
 * (truncated under it: storage/map_guard.h) is FAILED -- every step fails from then on -- with the
 * engine's message in *lost.  The next load replaces the engine (model_start_load). */
static ds41_model_state effective_state(const model *m, ds41_error *lost) {
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
static ds41_snapshot_owner owner_of(const ds41_sched_partition *part) {
    ds41_snapshot_owner o = {.uid = part->owner_uid};
    _Static_assert(sizeof o.key == sizeof part->key, "partition keys differ in size");
    memcpy(o.key, part->key, sizeof o.key);
    return o;
}

static ds41_sched_partition partition_of(const ds41_snapshot_owner *o) {
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
    const ds41_snapshot_owner owner = owner_of(part);
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
    const ds41_snapshot_owner owner = owner_of(part);
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
    progress(s, m, DS41_MODEL_LOADING, "loading the checkpoint");
    pthread_rwlock_wrlock(&m->lock);
    snprintf(m->detail, sizeof m->detail, "loading %s", m->path);
    pthread_rwlock_unlock(&m->lock);
    ds41_engine_opts eo = {.reference = a->st.mode == DS41_ENGINE_MODE_REFERENCE,
                           .cpu = {.threads = (int)a->st.threads},
                           .expert_cache_bytes = a->st.expert_cache_bytes,
                           .engram_cache_bytes = a->st.engram_cache_bytes};
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
    bool is_lost = effective_state(m, &lost) != m->state;
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
static model *find_model(ds41_engine_service *s, const char *name) {
    for (size_t i = 0; i < s->n_models; i++)
        if (name ? strcmp(s->models[i]->name, name) == 0 : s->models[i]->is_default) return s->models[i];
    return NULL;
}

/* Find a READY model and take its read lock.  On error fills err (404 / 503). */
static model *acquire_model(ds41_engine_service *s, const char *name, ds41_svc_error *err) {
    model *m = find_model(s, name);
    if (!m) {
        ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "model", "The model '%s' does not exist", name ? name : "(default)");
        snprintf(err->code, sizeof err->code, "model_not_found");
        return NULL;
    }
    pthread_rwlock_rdlock(&m->lock);
    ds41_error lost;
    const ds41_model_state state = effective_state(m, &lost);
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

/* ---- generation jobs -------------------------------------------------------------------------- */

struct job {
    ds41_engine_service *svc;
    model *m;
    uint64_t ipc_id;
    uint64_t sched_id;
    ds41_gen_sink sink;
    bool logprobs;
    int top_logprobs;
    bool cancel_requested;
    bool timed_out;
    int refs;
    struct timespec started;
    int tool_index;
    bool stream; /* tool calls go out as fragments while generated (else whole, at the end) */
    job *next;
};

static void job_unref(ds41_engine_service *s, job *j) {
    pthread_mutex_lock(&s->jobs_mu);
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&s->jobs_mu);
    if (last) free(j);
}

static void job_unlink(ds41_engine_service *s, job *j) {
    pthread_mutex_lock(&s->jobs_mu);
    for (job **pp = &s->jobs; *pp; pp = &(*pp)->next) {
        if (*pp == j) {
            *pp = j->next;
            break;
        }
    }
    pthread_mutex_unlock(&s->jobs_mu);
}

static void on_delta(void *ctx, const ds41_generation *g, const ds41_generation_delta *d) {
    (void)g;
    job *j = ctx;
    ds41_gen_event ev = {.type = DS41_GEN_DELTA};
    ev.content = d->content;
    ev.content_len = d->content_len;
    ev.reasoning = d->reasoning;
    ev.reasoning_len = d->reasoning_len;
    ds41_gen_logprob lp;
    ds41_gen_top_logprob top[DS41_SAMPLER_MAX_TOP_LOGPROBS];
    if (j->logprobs && d->emitted) {
        size_t len = 0;
        const uint8_t *b = ds41_tokenizer_token_bytes(j->m->tok, d->token, &len);
        lp = (ds41_gen_logprob){.token = b ? (const char *)b : "", .token_len = b ? len : 0,
                                .logprob = d->sample.logprob, .reasoning = d->reasoning_token};
        size_t nt = d->sample.n_top < (uint32_t)j->top_logprobs ? d->sample.n_top : (size_t)j->top_logprobs;
        for (size_t k = 0; k < nt; k++) {
            size_t tl = 0;
            const uint8_t *tb = ds41_tokenizer_token_bytes(j->m->tok, d->sample.top[k].token, &tl);
            top[k] = (ds41_gen_top_logprob){.token = tb ? (const char *)tb : "", .token_len = tb ? tl : 0,
                                            .logprob = d->sample.top[k].logprob};
        }
        lp.top = top;
        lp.n_top = nt;
        ev.logprobs = &lp;
        ev.n_logprobs = 1;
    }
    if (ev.content_len || ev.reasoning_len || ev.n_logprobs) j->sink.event(j->sink.sink_ctx, &ev);
    if (j->stream) {
        for (size_t i = 0; i < d->n_tool_deltas; i++) {
            const ds41_generation_tool_delta *td = &d->tool_deltas[i];
            if (td->index > INT_MAX) continue;
            ds41_gen_event tc = {.type = DS41_GEN_TOOL_CALL, .tool_index = (int)td->index, .tool_name = td->name,
                                 .arguments = td->arguments, .arguments_len = td->arguments_len};
            j->sink.event(j->sink.sink_ctx, &tc);
        }
        return;
    }
    for (size_t i = 0; i < d->n_tool_calls; i++) {
        const ds41_chat_tool_call *c = &d->tool_calls[i];
        ds41_gen_event tc = {.type = DS41_GEN_TOOL_CALL, .tool_index = j->tool_index++, .tool_name = c->name,
                             .arguments = c->arguments, .arguments_len = c->arguments_len};
        j->sink.event(j->sink.sink_ctx, &tc);
    }
}

static void on_done(void *ctx, const ds41_generation *g, ds41_sched_status status, const char *message) {
    job *j = ctx;
    ds41_gen_event ev = {0};
    ev.usage.prompt_tokens = ds41_generation_prompt_tokens(g);
    ev.usage.completion_tokens = ds41_generation_completion_tokens(g);
    ev.usage.cached_tokens = ds41_generation_cached_tokens(g);
    ev.usage.reasoning_tokens = ds41_generation_reasoning_tokens(g);
    pthread_mutex_lock(&j->svc->jobs_mu);
    bool timed_out = j->timed_out;
    pthread_mutex_unlock(&j->svc->jobs_mu);
    if (status == DS41_SCHED_DONE || (status == DS41_SCHED_CANCELLED && timed_out)) {
        ev.type = DS41_GEN_FINISH;
        const char *f = ds41_generation_finish_name(g);
        ev.finish_reason = timed_out                         ? DS41_FINISH_LENGTH
                           : strcmp(f, "length") == 0        ? DS41_FINISH_LENGTH
                           : strcmp(f, "tool_calls") == 0    ? DS41_FINISH_TOOL_CALLS
                                                             : DS41_FINISH_STOP;
    } else {
        ev.type = DS41_GEN_ERROR;
        switch (status) {
        case DS41_SCHED_CANCELLED: ds41_svc_fail(&ev.error, DS41_SVC_CANCELLED, NULL, "cancelled"); break;
        case DS41_SCHED_KV_FULL:
            ds41_svc_fail(&ev.error, DS41_SVC_KV_FULL, NULL, "%s", message ? message : "the KV cache is full");
            ev.error.retry_after_s = 1;
            break;
        default: ds41_svc_fail(&ev.error, DS41_SVC_INTERNAL, NULL, "%s", message ? message : "internal error"); break;
        }
    }
    job_unlink(j->svc, j);
    j->sink.event(j->sink.sink_ctx, &ev);
    job_unref(j->svc, j);
}

/* ---- request translation ---------------------------------------------------------------------- */

typedef struct gen_inputs {
    json_t *messages, *tools, *response_format, *tool_choice;
    ds41_logit_bias *bias;
    uint32_t *ids;
    ds41_token_ids forced;
    size_t *stop_lens;
} gen_inputs;

static void gen_inputs_free(gen_inputs *in) {
    json_decref(in->messages);
    json_decref(in->tools);
    json_decref(in->response_format);
    json_decref(in->tool_choice);
    free(in->bias);
    free(in->ids);
    ds41_token_ids_free(&in->forced);
    free(in->stop_lens);
}

static int load_json(const char *text, const char *param, json_t **out, ds41_svc_error *err) {
    if (!text) return 0;
    json_error_t je;
    *out = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!*out) return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, param, "'%s' is not valid JSON: %s", param, je.text);
    return 0;
}

static int build_params(ds41_engine_service *s, model *m, const ds41_gen_request *req, gen_inputs *in,
                        ds41_generation_params *p, ds41_svc_error *err) {
    *p = ds41_generation_params_default();
    if (req->kind == DS41_GEN_CHAT) {
        p->kind = DS41_GENERATION_CHAT;
        if (load_json(req->messages_json, "messages", &in->messages, err) ||
            load_json(req->tools_json, "tools", &in->tools, err) ||
            load_json(req->response_format_json, "response_format", &in->response_format, err))
            return -1;
        bool choice_none = req->tool_choice_json && strcmp(req->tool_choice_json, "\"none\"") == 0;
        p->messages = in->messages;
        p->tools = choice_none ? NULL : in->tools;
        p->parse_tool_calls = !choice_none;
        p->parallel_tool_calls = req->parallel_tool_calls;
        if (!choice_none && load_json(req->tool_choice_json, "tool_choice", &in->tool_choice, err)) return -1;
        if (json_is_string(in->tool_choice) && strcmp(json_string_value(in->tool_choice), "required") == 0) {
            p->tool_choice = DS41_GENERATION_TOOL_CHOICE_REQUIRED;
        } else if (json_is_object(in->tool_choice)) {
            p->tool_choice = DS41_GENERATION_TOOL_CHOICE_NAMED;
            p->tool_choice_name = json_string_value(json_object_get(json_object_get(in->tool_choice, "function"), "name"));
        }
        p->response_format = in->response_format;
        p->thinking = req->thinking == DS41_THINKING_ENABLED;
        p->reasoning_effort = p->thinking ? req->reasoning_effort : 0;
    } else if (req->prompt_tokens) {
        p->kind = DS41_GENERATION_IDS;
        in->ids = malloc((req->n_prompt_tokens ? req->n_prompt_tokens : 1) * sizeof *in->ids);
        if (!in->ids) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        for (size_t i = 0; i < req->n_prompt_tokens; i++) {
            if (req->prompt_tokens[i] < 0 || (uint32_t)req->prompt_tokens[i] >= m->n_vocab)
                return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "prompt", "token id %d is outside the vocabulary (%u)",
                                     req->prompt_tokens[i], m->n_vocab);
            in->ids[i] = (uint32_t)req->prompt_tokens[i];
        }
        p->ids = in->ids;
        p->n_ids = req->n_prompt_tokens;
    } else {
        p->kind = DS41_GENERATION_RAW;
        p->text = req->prompt ? req->prompt : "";
        p->text_len = req->prompt ? req->prompt_len : 0;
    }
    ds41_sampler_params *sp = &p->sampler;
    if (req->temperature.set) sp->temperature = (float)req->temperature.value;
    if (req->top_p.set) sp->top_p = (float)req->top_p.value;
    sp->top_k = req->top_k > 0 ? (uint32_t)req->top_k : 0;
    if (req->min_p.set) sp->min_p = (float)req->min_p.value;
    if (req->repetition_penalty.set) sp->repetition_penalty = (float)req->repetition_penalty.value;
    if (req->presence_penalty.set) sp->presence_penalty = (float)req->presence_penalty.value;
    if (req->frequency_penalty.set) sp->frequency_penalty = (float)req->frequency_penalty.value;
    sp->has_seed = req->has_seed;
    sp->seed = (uint64_t)req->seed;
    if (req->n_logit_bias) {
        in->bias = calloc(req->n_logit_bias, sizeof *in->bias);
        if (!in->bias) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        for (size_t i = 0; i < req->n_logit_bias; i++) {
            int32_t t = req->logit_bias[i].token;
            if (t < 0 || (uint32_t)t >= m->n_vocab)
                return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "logit_bias",
                                     "logit_bias names token %d, outside the vocabulary (%u)", t, m->n_vocab);
            in->bias[i] = (ds41_logit_bias){.token = (uint32_t)t, .bias = req->logit_bias[i].bias};
        }
        sp->logit_bias = in->bias;
        sp->n_logit_bias = (uint32_t)req->n_logit_bias;
    }
    sp->logprobs = req->logprobs || req->top_logprobs > 0;
    sp->top_logprobs = req->top_logprobs > 0 ? (uint32_t)req->top_logprobs : 0;
    if (req->n_stop) {
        in->stop_lens = malloc(req->n_stop * sizeof *in->stop_lens);
        if (!in->stop_lens) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        for (size_t i = 0; i < req->n_stop; i++) in->stop_lens[i] = strlen(req->stop[i]);
        p->stop = req->stop;
        p->stop_lens = in->stop_lens;
        p->n_stop = req->n_stop;
    }
    p->max_tokens = req->max_tokens ? req->max_tokens : s->st.max_tokens_default;
    p->max_context = m->context > UINT32_MAX ? UINT32_MAX : (uint32_t)m->context;
    p->ignore_eos = req->ignore_eos;
    p->skip_special = !req->keep_special_tokens;
    if (req->forced_output) {
        if (!s->st.test_forced_output)
            return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "ds41_forced_output",
                                 "'ds41_forced_output' is a test hook; this server does not enable it "
                                 "(engine.test_forced_output)");
        ds41_error e;
        if (ds41_tokenizer_encode(m->tok, req->forced_output, strlen(req->forced_output), &in->forced, &e) != 0)
            return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "ds41_forced_output", "%s", e.msg);
        p->forced_ids = in->forced.ids;
        p->n_forced = in->forced.n;
    }
    return 0;
}

/* A generation error: context errors are 400 context_length_exceeded, the rest 400. */
static int generation_error(const ds41_error *e, bool chat, ds41_svc_error *err) {
    if (strstr(e->msg, "context"))
        return ds41_svc_fail(err, DS41_SVC_CONTEXT_LENGTH, chat ? "messages" : "prompt", "%s", e->msg);
    const char *param = strncmp(e->msg, "tool_choice", 11) == 0 ? "tool_choice"
                        : strncmp(e->msg, "sampling", 8) == 0  ? "logit_bias"
                        : strncmp(e->msg, "stop", 4) == 0     ? "stop"
                        : strncmp(e->msg, "prompt", 6) == 0   ? "prompt"
                                                              : "messages";
    return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, param, "%s", e->msg);
}

static int svc_submit(void *ctx, const ds41_gen_request *req, const ds41_gen_sink *sink, ds41_gen_accept *accept,
                      ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    int rc = -1;
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = acquire_model(s, req->model, err);
    if (!m) {
        pthread_rwlock_unlock(&s->cfg_lock);
        return -1;
    }
    gen_inputs in = {0};
    ds41_generation_params p;
    ds41_generation *g = NULL;
    ds41_error e = {{0}};
    if (build_params(s, m, req, &in, &p, err) != 0) goto out;
    if (ds41_generation_new(m->tok, &p, m->n_vocab, &g, &e) != 0) {
        generation_error(&e, req->kind == DS41_GEN_CHAT, err);
        goto out;
    }
    job *j = calloc(1, sizeof *j);
    if (!j) {
        ds41_generation_free(g);
        ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        goto out;
    }
    j->svc = s;
    j->m = m;
    j->ipc_id = req->id;
    j->sink = *sink;
    j->logprobs = p.sampler.logprobs != 0;
    j->top_logprobs = (int)p.sampler.top_logprobs;
    j->stream = req->stream;
    j->refs = 2;
    clock_gettime(CLOCK_MONOTONIC, &j->started);
    snprintf(accept->model, sizeof accept->model, "%s", m->name);
    pthread_mutex_lock(&s->jobs_mu);
    j->next = s->jobs;
    s->jobs = j;
    pthread_mutex_unlock(&s->jobs_mu);
    ds41_sched_sink ss = {.delta = on_delta, .done = on_done, .ctx = j};
    uint64_t id = 0;
    /* Its prefix-cache partition: the peer's uid (unless shared) and its cache_salt (issue 13). */
    ds41_sched_partition part;
    ds41_sched_partition_make(req->peer_uid, s->st.prefix_share, req->cache_salt,
                              req->cache_salt ? strlen(req->cache_salt) : 0, &part);
    ds41_sched_status st = ds41_scheduler_submit_in(m->sched, &part, g, &ss, &id, &e);
    if (st != DS41_SCHED_DONE) {
        job_unlink(s, j);
        free(j);
        switch (st) {
        case DS41_SCHED_QUEUE_FULL:
            ds41_svc_fail(err, DS41_SVC_QUEUE_FULL, NULL, "%s", e.msg);
            err->retry_after_s = 1;
            break;
        case DS41_SCHED_KV_FULL:
            ds41_svc_fail(err, DS41_SVC_KV_FULL, NULL, "%s", e.msg);
            err->retry_after_s = 5;
            break;
        case DS41_SCHED_TOO_LARGE: /* waiting would not help: 400, not 503 + Retry-After */
            ds41_svc_fail(
                err, DS41_SVC_BAD_REQUEST, "max_tokens", "%s%s", e.msg,
                req->max_tokens ? "" : "; the request gave no max_tokens, limits.max_tokens_default applied");
            snprintf(err->code, sizeof err->code, "request_too_large_for_kv_pool");
            break;
        case DS41_SCHED_STOPPING: ds41_svc_fail(err, DS41_SVC_UNAVAILABLE, NULL, "%s", e.msg); break;
        default: ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "%s", e.msg); break;
        }
        goto out;
    }
    pthread_mutex_lock(&s->jobs_mu);
    j->sched_id = id;
    if (j->cancel_requested && j->refs == 2) ds41_scheduler_cancel(m->sched, id);
    pthread_mutex_unlock(&s->jobs_mu);
    job_unref(s, j);
    rc = 0;
out:
    gen_inputs_free(&in);
    pthread_rwlock_unlock(&m->lock);
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

static void svc_cancel(void *ctx, uint64_t request_id) {
    ds41_engine_service *s = ctx;
    pthread_mutex_lock(&s->jobs_mu);
    for (job *j = s->jobs; j; j = j->next) {
        if (j->ipc_id != request_id) continue;
        j->cancel_requested = true;
        /* Under jobs_mu: the job has not ended, so its scheduler cannot have been freed (its
         * done() needs this lock). */
        if (j->sched_id) ds41_scheduler_cancel(j->m->sched, j->sched_id);
        break;
    }
    pthread_mutex_unlock(&s->jobs_mu);
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
        const ds41_model_state state = effective_state(m, &lost);
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
        const ds41_model_state state = effective_state(m, &lost);
        ds41_svc_model sm = {.id = m->name,
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

static int svc_tokenize(void *ctx, const ds41_tokenize_request *req, int32_t **tokens, size_t *n_tokens,
                        ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = acquire_model(s, req->model, err);
    int rc = -1;
    if (!m) goto out_cfg;
    if (req->messages_json) {
        gen_inputs in = {0};
        ds41_generation_params p = ds41_generation_params_default();
        if (load_json(req->messages_json, "messages", &in.messages, err) ||
            load_json(req->tools_json, "tools", &in.tools, err)) {
            gen_inputs_free(&in);
            goto out;
        }
        p.messages = in.messages;
        p.tools = in.tools;
        p.thinking = req->thinking == DS41_THINKING_ENABLED;
        p.reasoning_effort = p.thinking ? req->reasoning_effort : 0;
        ds41_generation *g = NULL;
        ds41_error e;
        if (ds41_generation_new(m->tok, &p, m->n_vocab, &g, &e) != 0) {
            gen_inputs_free(&in);
            generation_error(&e, true, err);
            goto out;
        }
        size_t n;
        const int32_t *ids = ds41_generation_tokens(g, &n);
        *tokens = malloc((n ? n : 1) * sizeof **tokens);
        if (*tokens) {
            memcpy(*tokens, ids, n * sizeof *ids);
            *n_tokens = n;
            rc = 0;
        } else {
            ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        }
        ds41_generation_free(g);
        gen_inputs_free(&in);
    } else {
        ds41_token_ids ids = {0};
        ds41_error e;
        int32_t bos = ds41_vocab_bos_id(m->vocab);
        if (bos < 0) bos = ds41_vocab_find(m->vocab, DS41_CHAT_BOS, strlen(DS41_CHAT_BOS));
        if (ds41_tokenizer_encode(m->tok, req->text, req->text_len, &ids, &e) != 0) {
            ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "content", "%s", e.msg);
            goto out;
        }
        size_t extra = req->add_special && bos >= 0 ? 1 : 0;
        *tokens = malloc((ids.n + extra + 1) * sizeof **tokens);
        if (!*tokens) {
            ds41_token_ids_free(&ids);
            ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
            goto out;
        }
        if (extra) (*tokens)[0] = bos;
        for (size_t i = 0; i < ids.n; i++) (*tokens)[extra + i] = (int32_t)ids.ids[i];
        *n_tokens = ids.n + extra;
        ds41_token_ids_free(&ids);
        rc = 0;
    }
out:
    pthread_rwlock_unlock(&m->lock);
out_cfg:
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

static int svc_detokenize(void *ctx, const char *model_name, const int32_t *tokens, size_t n_tokens, char **text,
                          size_t *text_len, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = acquire_model(s, model_name, err);
    int rc = -1;
    if (!m) goto out_cfg;
    uint32_t *ids = malloc((n_tokens ? n_tokens : 1) * sizeof *ids);
    if (!ids) {
        ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n_tokens; i++) {
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= m->n_vocab) {
            ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "tokens", "token id %d is outside the vocabulary (%u)", tokens[i],
                          m->n_vocab);
            free(ids);
            goto out;
        }
        ids[i] = (uint32_t)tokens[i];
    }
    *text = ds41_tokenizer_decode(m->tok, ids, n_tokens, false, text_len);
    free(ids);
    if (!*text) {
        ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        goto out;
    }
    rc = 0;
out:
    pthread_rwlock_unlock(&m->lock);
out_cfg:
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

/* ---- metrics ---------------------------------------------------------------------------------- */

static void metric_head(ds41_buf *b, const char *name, const char *type, const char *help) {
    ds41_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* The storage tiers' ds41_tier_* series of every ready model: the routed
 * experts (tier="experts", always present; streamed 0 while everything is
 * resident) and the Engram rows (tier="engram", only when streamed).  Each
 * family's HELP/TYPE comes once, its samples labelled by tier.  Called with
 * cfg_lock held. */
enum tier_field {
    TF_STREAMED,
    TF_BUDGET,
    TF_USED,
    TF_TOTAL,
    TF_ENTRIES,
    TF_HITS,
    TF_MISSES,
    TF_EARLY,
    TF_WAITED,
    TF_READ_BYTES,
    TF_DEVICE_BYTES,
    TF_ERRORS,
    TF_EVICTIONS,
    TF_PREDICTED,
    TF_PREDICTED_USED,
};

/* A field of the expert tier's statistics; false when it has no such field. */
static bool expert_field(const ds41_expert_cache_stats *x, bool streamed, int f, uint64_t *v) {
    switch (f) {
    case TF_STREAMED: *v = streamed; return true;
    case TF_BUDGET: *v = x->budget_bytes; return true;
    case TF_USED: *v = x->slots_used * x->slot_bytes; return true;
    case TF_TOTAL: *v = x->total_bytes; return true;
    case TF_HITS: *v = x->hits + x->prefetch_hits; return true;
    case TF_MISSES: *v = x->misses; return true;
    case TF_READ_BYTES: *v = x->bytes_read; return true;
    case TF_ERRORS: *v = x->read_errors; return true;
    case TF_PREDICTED: *v = x->predicted; return true;
    case TF_PREDICTED_USED: *v = x->predicted_used; return true;
    default: return false;
    }
}

/* The same for the Engram row tier. */
static bool engram_field(const ds41_engram_cache_stats *g, int f, uint64_t *v) {
    switch (f) {
    case TF_STREAMED: *v = 1; return true;
    case TF_BUDGET: *v = g->budget_bytes; return true;
    case TF_ENTRIES: *v = g->entries_used; return true;
    case TF_HITS: *v = g->hits; return true;
    case TF_MISSES: *v = g->misses; return true;
    case TF_EARLY: *v = g->prefetched_early; return true;
    case TF_WAITED: *v = g->waited; return true;
    case TF_READ_BYTES: *v = g->bytes_read; return true;
    case TF_DEVICE_BYTES: *v = g->bytes_device; return true;
    case TF_ERRORS: *v = g->read_errors; return true;
    case TF_EVICTIONS: *v = g->evictions; return true;
    default: return false;
    }
}

static void tier_metrics(ds41_engine_service *s, ds41_buf *b, const bool *ready, size_t n) {
    const size_t cap = n ? n : 1;
    ds41_expert_cache_stats *xs = calloc(cap, sizeof *xs);
    ds41_engram_cache_stats *es = calloc(cap, sizeof *es);
    bool *have = calloc(cap, sizeof *have), *x_streamed = calloc(cap, sizeof *x_streamed),
         *e_on = calloc(cap, sizeof *e_on);
    if (!xs || !es || !have || !x_streamed || !e_on) goto out;
    for (size_t i = 0; i < n; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        if (ready[i] && m->state == DS41_MODEL_READY && m->engine) {
            have[i] = true;
            x_streamed[i] = ds41_engine_expert_stats(m->engine, &xs[i], false);
            e_on[i] = ds41_engine_engram_stats(m->engine, &es[i]);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    static const struct {
        const char *name, *type, *help;
        int field;
    } series[] = {
        {"ds41_tier_streamed", "gauge", "1 when the tier reads from disk under its budget, 0 when all resident.",
         TF_STREAMED},
        {"ds41_tier_budget_bytes", "gauge", "The tier's memory budget (0: auto, all resident).", TF_BUDGET},
        {"ds41_tier_used_bytes", "gauge", "Bytes of the expert tier's slots holding data.", TF_USED},
        {"ds41_tier_total_bytes", "gauge", "Bytes of everything the expert tier serves (all routed experts).",
         TF_TOTAL},
        {"ds41_tier_entries", "gauge", "Engram rows cached or being read.", TF_ENTRIES},
        {"ds41_tier_hits_total", "counter",
         "Uses served from memory (experts: incl. predicted loads in time; Engram: distinct rows a step found "
         "cached).",
         TF_HITS},
        {"ds41_tier_misses_total", "counter", "Uses that had to be read from the device.", TF_MISSES},
        {"ds41_tier_prefetched_early_total", "counter",
         "Engram misses whose read had completed when the step needed them.", TF_EARLY},
        {"ds41_tier_waited_total", "counter", "Engram misses the step waited for.", TF_WAITED},
        {"ds41_tier_read_bytes_total", "counter", "Bytes of the tensors read from the shards into the tier.",
         TF_READ_BYTES},
        {"ds41_tier_device_bytes_total", "counter", "Bytes the device returned for Engram rows (alignment included).",
         TF_DEVICE_BYTES},
        {"ds41_tier_read_errors_total", "counter", "Failed reads.", TF_ERRORS},
        {"ds41_tier_evictions_total", "counter", "Engram rows evicted.", TF_EVICTIONS},
        {"ds41_tier_predictions_total", "counter", "Experts predicted for the next layer.", TF_PREDICTED},
        {"ds41_tier_predictions_used_total", "counter", "Predicted experts the layer then used.", TF_PREDICTED_USED},
    };
    for (size_t k = 0; k < sizeof series / sizeof series[0]; k++) {
        metric_head(b, series[k].name, series[k].type, series[k].help);
        for (size_t i = 0; i < n; i++) {
            if (!have[i]) continue;
            uint64_t v;
            if (expert_field(&xs[i], x_streamed[i], series[k].field, &v))
                ds41_buf_printf(b, "%s{model=\"%s\",tier=\"experts\"} %llu\n", series[k].name, s->models[i]->name,
                                (unsigned long long)v);
            if (e_on[i] && engram_field(&es[i], series[k].field, &v))
                ds41_buf_printf(b, "%s{model=\"%s\",tier=\"engram\"} %llu\n", series[k].name, s->models[i]->name,
                                (unsigned long long)v);
        }
    }
    metric_head(b, "ds41_tier_read_latency_seconds", "gauge",
                "Read latency quantiles of the tier's reads, submission to last byte (bucket upper bounds).");
    for (size_t i = 0; i < n; i++) {
        if (!have[i]) continue;
        if (x_streamed[i]) {
            ds41_buf_printf(b, "ds41_tier_read_latency_seconds{model=\"%s\",tier=\"experts\",quantile=\"0.5\"} %.9f\n",
                            s->models[i]->name, (double)xs[i].latency_p50_ns * 1e-9);
            ds41_buf_printf(b, "ds41_tier_read_latency_seconds{model=\"%s\",tier=\"experts\",quantile=\"0.99\"} %.9f\n",
                            s->models[i]->name, (double)xs[i].latency_p99_ns * 1e-9);
        }
        if (e_on[i]) {
            ds41_buf_printf(b, "ds41_tier_read_latency_seconds{model=\"%s\",tier=\"engram\",quantile=\"0.5\"} %.9f\n",
                            s->models[i]->name, (double)es[i].latency_p50_ns * 1e-9);
            ds41_buf_printf(b, "ds41_tier_read_latency_seconds{model=\"%s\",tier=\"engram\",quantile=\"0.99\"} %.9f\n",
                            s->models[i]->name, (double)es[i].latency_p99_ns * 1e-9);
        }
    }
out:
    free(xs);
    free(es);
    free(have);
    free(x_streamed);
    free(e_on);
}

static int svc_metrics(void *ctx, char **text, size_t *text_len, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    ds41_buf b = {0};
    pthread_rwlock_rdlock(&s->cfg_lock);
    size_t n = s->n_models;
    ds41_sched_stats *st = calloc(n ? n : 1, sizeof *st);
    bool *ready = calloc(n ? n : 1, sizeof *ready);
    ds41_model_state *state = calloc(n ? n : 1, sizeof *state);
    ds41_snapshot_store_stats *sn = calloc(n ? n : 1, sizeof *sn);
    bool *has_store = calloc(n ? n : 1, sizeof *has_store);
    if (!st || !ready || !state || !sn || !has_store) {
        pthread_rwlock_unlock(&s->cfg_lock);
        free(st);
        free(ready);
        free(state);
        free(sn);
        free(has_store);
        return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        state[i] = effective_state(m, NULL);
        if (m->state == DS41_MODEL_READY) {
            ds41_scheduler_stats(m->sched, &st[i]);
            ready[i] = true;
            if (m->store) {
                ds41_snapshot_store_get_stats(m->store, &sn[i]);
                has_store[i] = true;
            }
        }
        pthread_rwlock_unlock(&m->lock);
    }
    static const char *const state_names[] = {"unloaded", "loading", "ready", "failed"};
    metric_head(&b, "ds41_model_state", "gauge", "1 for the state each configured model is in.");
    for (size_t i = 0; i < n; i++)
        for (int k = 0; k < 4; k++)
            ds41_buf_printf(&b, "ds41_model_state{model=\"%s\",state=\"%s\"} %d\n", s->models[i]->name, state_names[k],
                            (int)state[i] == k);

#define PER_MODEL(metric, type, help, expr)                                                              \
    do {                                                                                                 \
        metric_head(&b, metric, type, help);                                                             \
        for (size_t i = 0; i < n; i++)                                                                   \
            if (ready[i])                                                                                \
                ds41_buf_printf(&b, metric "{model=\"%s\"} %llu\n", s->models[i]->name,                      \
                                (unsigned long long)(expr));                                             \
    } while (0)

    metric_head(&b, "ds41_requests_total", "counter", "Generation requests by outcome.");
    for (size_t i = 0; i < n; i++) {
        if (!ready[i]) continue;
        const struct {
            const char *o;
            uint64_t v;
        } outs[] = {{"stop", st[i].requests_stop},
                    {"length", st[i].requests_length},
                    {"tool_calls", st[i].requests_tool_calls},
                    {"cancelled", st[i].requests_cancelled},
                    {"kv_full", st[i].requests_kv_full},
                    {"error", st[i].requests_error},
                    {"rejected_queue_full", st[i].rejected_queue_full},
                    {"rejected_kv_full", st[i].rejected_kv_full}};
        for (size_t k = 0; k < sizeof outs / sizeof outs[0]; k++)
            ds41_buf_printf(&b, "ds41_requests_total{model=\"%s\",outcome=\"%s\"} %llu\n", s->models[i]->name,
                            outs[k].o, (unsigned long long)outs[k].v);
    }
    PER_MODEL("ds41_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", st[i].prompt_tokens);
    PER_MODEL("ds41_prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.",
              st[i].cached_tokens);
    PER_MODEL("ds41_prefill_tokens_total", "counter", "Prompt tokens that went through the model.", st[i].prefill_tokens);
    PER_MODEL("ds41_generated_tokens_total", "counter", "Sampled tokens.", st[i].generated_tokens);
    metric_head(&b, "ds41_generated_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.");
    for (size_t i = 0; i < n; i++)
        if (ready[i])
            ds41_buf_printf(&b, "ds41_generated_tokens_per_second{model=\"%s\"} %.3f\n", s->models[i]->name,
                            st[i].tokens_per_s);
    PER_MODEL("ds41_queue_depth", "gauge", "Requests waiting for a decode slot.", st[i].queued);
    PER_MODEL("ds41_running_sequences", "gauge", "Sequences in prefill or decode.", st[i].running);
    PER_MODEL("ds41_forward_steps_total", "counter", "Forward passes (batched steps).", st[i].steps);
    PER_MODEL("ds41_preemptions_total", "counter", "Sequences preempted because the KV cache was full.",
              st[i].preemptions);
#define PER_STORE(metric, type, help, expr)                                                              \
    do {                                                                                                 \
        metric_head(&b, metric, type, help);                                                             \
        for (size_t i = 0; i < n; i++)                                                                   \
            if (has_store[i])                                                                            \
                ds41_buf_printf(&b, metric "{model=\"%s\"} %llu\n", s->models[i]->name,                      \
                                (unsigned long long)(expr));                                             \
    } while (0)
    PER_STORE("ds41_snapshot_files", "gauge", "Session snapshots on disk.", sn[i].entries);
    PER_STORE("ds41_snapshot_bytes", "gauge", "Bytes of the session snapshots on disk.", sn[i].bytes);
    PER_STORE("ds41_snapshot_hits_total", "counter", "Prefix-cache misses served by a snapshot on disk.", sn[i].hits);
    PER_STORE("ds41_snapshot_misses_total", "counter", "Prefix-cache misses no snapshot on disk covered.",
              sn[i].misses);
    PER_STORE("ds41_snapshot_restored_tokens_total", "counter", "Tokens of the snapshots loaded.",
              sn[i].restored_tokens);
    PER_STORE("ds41_snapshot_load_errors_total", "counter", "Snapshots refused when loading (and deleted).",
              sn[i].load_errors);
    PER_STORE("ds41_snapshot_saves_total", "counter", "Snapshots written.", sn[i].saves);
    PER_STORE("ds41_snapshot_save_errors_total", "counter", "Snapshot writes that failed.", sn[i].save_errors);
    PER_STORE("ds41_snapshot_evictions_total", "counter", "Snapshots deleted by the snapshots.max_bytes cap.",
              sn[i].evictions);
#undef PER_STORE
    metric_head(&b, "ds41_kv_cache_bytes", "gauge", "KV cache page bytes in use and free (free: under the budget).");
    for (size_t i = 0; i < n; i++) {
        if (!ready[i]) continue;
        uint64_t used = st[i].kv_pages_in_use * st[i].kv_page_bytes;
        ds41_buf_printf(&b, "ds41_kv_cache_bytes{model=\"%s\",state=\"used\"} %llu\n", s->models[i]->name,
                        (unsigned long long)used);
        if (st[i].kv_pages_max)
            ds41_buf_printf(&b, "ds41_kv_cache_bytes{model=\"%s\",state=\"free\"} %llu\n", s->models[i]->name,
                            (unsigned long long)((st[i].kv_pages_max - st[i].kv_pages_in_use) * st[i].kv_page_bytes));
    }
    metric_head(&b, "ds41_decode_batch_sequences", "histogram", "Sequences decoded together per forward step.");
    for (size_t i = 0; i < n; i++) {
        if (!ready[i]) continue;
        uint64_t cum = 0;
        for (int k = 0; k < DS41_SCHED_HIST_BUCKETS; k++) {
            cum += st[i].decode_hist[k];
            if (k < DS41_SCHED_HIST_BUCKETS - 1)
                ds41_buf_printf(&b, "ds41_decode_batch_sequences_bucket{model=\"%s\",le=\"%u\"} %llu\n",
                                s->models[i]->name, ds41_sched_hist_bounds[k], (unsigned long long)cum);
            else
                ds41_buf_printf(&b, "ds41_decode_batch_sequences_bucket{model=\"%s\",le=\"+Inf\"} %llu\n",
                                s->models[i]->name, (unsigned long long)cum);
        }
        ds41_buf_printf(&b, "ds41_decode_batch_sequences_sum{model=\"%s\"} %llu\n", s->models[i]->name,
                        (unsigned long long)st[i].decode_seqs_sum);
        ds41_buf_printf(&b, "ds41_decode_batch_sequences_count{model=\"%s\"} %llu\n", s->models[i]->name,
                        (unsigned long long)st[i].decode_steps);
    }
    metric_head(&b, "ds41_cache_hits_total", "counter", "Cache hits by tier.");
    for (size_t i = 0; i < n; i++)
        if (ready[i])
            ds41_buf_printf(&b, "ds41_cache_hits_total{model=\"%s\",tier=\"prefix\"} %llu\n", s->models[i]->name,
                            (unsigned long long)st[i].prefix_hits);
    metric_head(&b, "ds41_cache_misses_total", "counter", "Cache misses by tier.");
    for (size_t i = 0; i < n; i++)
        if (ready[i])
            ds41_buf_printf(&b, "ds41_cache_misses_total{model=\"%s\",tier=\"prefix\"} %llu\n", s->models[i]->name,
                            (unsigned long long)st[i].prefix_misses);
    metric_head(&b, "ds41_cache_hit_ratio", "gauge", "Hits / (hits + misses) by tier since start.");
    for (size_t i = 0; i < n; i++) {
        if (!ready[i]) continue;
        uint64_t t = st[i].prefix_hits + st[i].prefix_misses;
        ds41_buf_printf(&b, "ds41_cache_hit_ratio{model=\"%s\",tier=\"prefix\"} %.6f\n", s->models[i]->name,
                        t ? (double)st[i].prefix_hits / (double)t : 0.0);
    }
    PER_MODEL("ds41_prefix_cache_entries", "gauge", "Prefix-cache snapshots kept.", st[i].cache_entries);
    PER_MODEL("ds41_prefix_cache_bytes", "gauge", "KV page bytes the prefix-cache snapshots reference.",
              st[i].cache_bytes);
    tier_metrics(s, &b, ready, n);
#undef PER_MODEL
    pthread_rwlock_unlock(&s->cfg_lock);
    free(st);
    free(ready);
    free(state);
    free(sn);
    free(has_store);
    *text = ds41_buf_take(&b, text_len);
    if (!*text) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
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
        m = find_model(s, name);
        if (!m) {
            pthread_rwlock_unlock(&s->cfg_lock);
            ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "name", "The model '%s' is not configured", name ? name : "");
            snprintf(err->code, sizeof err->code, "model_not_found");
            return -1;
        }
    }
    pthread_rwlock_rdlock(&m->lock);
    bool ready = effective_state(m, NULL) == DS41_MODEL_READY; /* a lost model loads again */
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
    model *m = find_model(s, name);
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

typedef struct sess_acc {
    const char *model;
    ds41_svc_session_emit emit;
    void *acc;
} sess_acc;

static void emit_session(void *p, const ds41_sched_session *ss) {
    sess_acc *a = p;
    char id[200];
    snprintf(id, sizeof id, "%s:%s", a->model, ss->id);
    ds41_svc_session out = {.id = id,
                            .model = a->model,
                            .state = ss->state,
                            .request_id = 0,
                            .prompt_tokens = ss->prompt_tokens,
                            .generated_tokens = ss->generated_tokens,
                            .cached_tokens = ss->cached_tokens,
                            .kv_tokens = ss->kv_tokens,
                            .kv_pages = ss->kv_pages,
                            .kv_bytes = ss->kv_bytes,
                            .created = ss->created,
                            .last_used = ss->last_used,
                            .owner_uid = ss->owner_uid};
    a->emit(a->acc, &out);
}

static int svc_list_sessions(void *ctx, ds41_svc_session_emit emit, void *acc, ds41_svc_error *err) {
    (void)err;
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    for (size_t i = 0; i < s->n_models; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        if (m->state == DS41_MODEL_READY) {
            sess_acc a = {.model = m->name, .emit = emit, .acc = acc};
            ds41_scheduler_sessions(m->sched, emit_session, &a);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return 0;
}

static int svc_delete_session(void *ctx, const char *id, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    const char *colon = strrchr(id, ':');
    if (!colon) return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, NULL, "no session '%s'", id);
    char name[160];
    snprintf(name, sizeof name, "%.*s", (int)(colon - id), id);
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = find_model(s, name);
    int rc = -1;
    if (m) {
        pthread_rwlock_rdlock(&m->lock);
        if (m->state == DS41_MODEL_READY) rc = ds41_scheduler_delete_session(m->sched, colon + 1);
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    if (rc != 0) return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, NULL, "no session '%s'", id);
    return 0;
}

static int svc_cache_info(void *ctx, void (*emit)(void *acc, const ds41_svc_cache *cache), void *acc,
                          ds41_svc_error *err) {
    (void)err;
    ds41_engine_service *s = ctx;
    ds41_svc_cache c = {0};
    uint64_t kv_used = 0, kv_cap = 0, pc_bytes = 0, hits = 0, misses = 0;
    uint64_t sn_bytes = 0, sn_cap = 0, sn_hits = 0, sn_misses = 0;
    bool first = true;
    ds41_svc_cache_tier xt = {.name = "experts"}, gt = {.name = "engram"};
    bool have_experts = false, have_engram = false;
    char budgets[sizeof s->models[0]->budgets] = "";
    pthread_rwlock_rdlock(&s->cfg_lock);
    c.prefix_shared_across_users = s->st.prefix_share;
    for (size_t i = 0; i < s->n_models; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        if (m->state == DS41_MODEL_READY) {
            ds41_sched_stats st;
            ds41_scheduler_stats(m->sched, &st);
            if (first || m->is_default) {
                c.page_tokens = st.kv_page_tokens;
                c.page_bytes = st.kv_page_bytes;
                c.bytes_per_token = st.kv_bytes_per_token;
                first = false;
            }
            c.pages_total += st.kv_pages_max;
            c.pages_used += st.kv_pages_in_use;
            kv_used += st.kv_pages_in_use * st.kv_page_bytes;
            kv_cap += st.kv_pages_max * st.kv_page_bytes;
            pc_bytes += st.cache_bytes;
            hits += st.prefix_hits;
            misses += st.prefix_misses;
            if (m->store) {
                ds41_snapshot_store_stats ss;
                ds41_snapshot_store_get_stats(m->store, &ss);
                sn_bytes += ss.bytes;
                sn_cap += ss.max_bytes;
                sn_hits += ss.hits;
                sn_misses += ss.misses;
            }
            if (m->budgets[0] && (!budgets[0] || m->is_default)) snprintf(budgets, sizeof budgets, "%s", m->budgets);
            ds41_expert_cache_stats xs;
            const bool streamed = ds41_engine_expert_stats(m->engine, &xs, false);
            /* Summed over models; latency of the default (or first) model. */
            if (!have_experts || m->is_default) {
                xt.latency_p50_ns = xs.latency_p50_ns;
                xt.latency_p99_ns = xs.latency_p99_ns;
            }
            have_experts = true;
            xt.streamed = xt.streamed || streamed;
            xt.used_bytes += xs.slots_used * xs.slot_bytes;
            xt.capacity_bytes += xs.budget_bytes;
            xt.total_bytes += xs.total_bytes;
            xt.hits += xs.hits + xs.prefetch_hits;
            xt.misses += xs.misses;
            xt.bytes_read += xs.bytes_read;
            xt.predicted += xs.predicted;
            xt.predicted_used += xs.predicted_used;
            ds41_engram_cache_stats gs;
            if (ds41_engine_engram_stats(m->engine, &gs)) {
                if (!have_engram || m->is_default) {
                    gt.latency_p50_ns = gs.latency_p50_ns;
                    gt.latency_p99_ns = gs.latency_p99_ns;
                }
                have_engram = true;
                gt.streamed = true;
                gt.used_bytes += gs.entries_used * gs.row_bytes;
                gt.capacity_bytes += gs.budget_bytes;
                gt.hits += gs.hits;
                gt.misses += gs.misses;
                gt.bytes_read += gs.bytes_read;
            }
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    c.pages_free = c.pages_total > c.pages_used ? c.pages_total - c.pages_used : 0;
    ds41_svc_cache_tier tiers[5] = {
        {.name = "kv", .used_bytes = kv_used, .capacity_bytes = kv_cap},
        {.name = "prefix", .used_bytes = pc_bytes, .capacity_bytes = s->st.prefix_cache_max_bytes, .hits = hits,
         .misses = misses},
        {.name = "snapshots", .used_bytes = sn_bytes, .capacity_bytes = sn_cap, .hits = sn_hits, .misses = sn_misses},
        xt,
    };
    c.budgets = budgets[0] ? budgets : NULL;
    c.tiers = tiers;
    c.n_tiers = 2;
    if (s->st.snapshots) c.n_tiers++;
    if (have_experts) tiers[c.n_tiers++] = xt;
    if (have_engram) tiers[c.n_tiers++] = gt; /* only while its rows are streamed */
    emit(acc, &c);
    return 0;
}

/* ---- session snapshots (admin) ------------------------------------------------------------------ */

typedef struct snap_acc {
    const char *model;
    ds41_svc_snapshot_emit emit;
    void *acc;
} snap_acc;

static void emit_snapshot(void *p, const ds41_snapshot_entry *e) {
    snap_acc *a = p;
    char id[256];
    snprintf(id, sizeof id, "%s:%s", a->model, e->name);
    ds41_svc_snapshot out = {.id = id,
                             .model = a->model,
                             .tokens = e->n_ids,
                             .bytes = e->bytes,
                             .created = e->created,
                             .last_used = e->last_used,
                             .has_sampler = e->has_sampler,
                             .owner_uid = e->owner.uid};
    a->emit(a->acc, &out);
}

static int svc_list_snapshots(void *ctx, ds41_svc_snapshot_emit emit, void *acc, ds41_svc_error *err) {
    (void)err;
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    for (size_t i = 0; i < s->n_models; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        if (m->state == DS41_MODEL_READY && m->store) {
            snap_acc a = {.model = m->name, .emit = emit, .acc = acc};
            ds41_snapshot_store_list(m->store, emit_snapshot, &a);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return 0;
}

/* Split "<model>:<rest>" and take the READY model's read lock (cfg_lock held by the caller).
 * NULL: no such model (or not loaded). */
static model *model_of_id(ds41_engine_service *s, const char *id, const char **rest) {
    const char *colon = id ? strrchr(id, ':') : NULL;
    if (!colon || colon == id || (size_t)(colon - id) >= 160) return NULL;
    char name[160];
    snprintf(name, sizeof name, "%.*s", (int)(colon - id), id);
    model *m = find_model(s, name);
    if (!m) return NULL;
    pthread_rwlock_rdlock(&m->lock);
    if (m->state != DS41_MODEL_READY) {
        pthread_rwlock_unlock(&m->lock);
        return NULL;
    }
    *rest = colon + 1;
    return m;
}

static int svc_save_snapshot(void *ctx, const char *session_id, ds41_svc_snapshot_emit emit, void *acc,
                             ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    const char *sid = NULL;
    model *m = model_of_id(s, session_id, &sid);
    int rc = -1;
    if (!m) {
        ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "session", "no session '%.200s'", session_id);
    } else if (!m->store) {
        ds41_svc_fail(err, DS41_SVC_CONFLICT, NULL, "snapshots are disabled for model %s (snapshots.enabled)",
                      m->name);
    } else {
        ds41_sched_export x;
        ds41_error e = {{0}};
        if (ds41_scheduler_export(m->sched, sid, &x, &e) != 0) {
            ds41_svc_fail(err, strstr(e.msg, "no session") ? DS41_SVC_NOT_FOUND : DS41_SVC_CONFLICT, "session",
                          "%.200s: %s", session_id, e.msg);
        } else {
            size_t len = ds41_kv_seq_serialized_size(x.seq), written = 0;
            uint8_t *kv = malloc(len);
            ds41_snapshot_entry entry;
            const ds41_snapshot_owner owner = owner_of(&x.part); /* the file keeps the session's partition */
            if (!kv || ds41_kv_seq_serialize(x.seq, kv, len, &written, &e) != 0 ||
                ds41_snapshot_store_save(m->store, &owner, x.ids, x.n_ids, kv, len, x.sampler, x.sampler_len,
                                         &entry, &e) != 0) {
                ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "%s", e.msg[0] ? e.msg : "out of memory");
            } else {
                snap_acc a = {.model = m->name, .emit = emit, .acc = acc};
                emit_snapshot(&a, &entry);
                ds41_log(DS41_LOG_INFO, "model %s: saved %s (%zu tokens) as snapshot %s", m->name, session_id,
                         x.n_ids, entry.name);
                rc = 0;
            }
            free(kv);
            ds41_sched_export_free(&x);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

static int svc_restore_snapshot(void *ctx, const char *snapshot_id, char *session_id, size_t session_id_size,
                                uint64_t *tokens, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    const char *name = NULL;
    model *m = model_of_id(s, snapshot_id, &name);
    int rc = -1;
    if (!m || !m->store) {
        ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "id", "no snapshot '%.200s'", snapshot_id);
        if (m) pthread_rwlock_unlock(&m->lock);
    } else {
        ds41_snapshot snap;
        ds41_error e = {{0}};
        if (ds41_snapshot_store_load(m->store, name, &snap, &e) != 0) {
            bool missing = strncmp(e.msg, "no snapshot", 11) == 0;
            ds41_svc_fail(err, missing ? DS41_SVC_NOT_FOUND : DS41_SVC_BAD_REQUEST, "id", "%s%s",
                          missing ? "" : "snapshot refused: ", e.msg);
        } else {
            char cid[32];
            const ds41_sched_partition part = partition_of(&snap.owner); /* back into its own partition */
            if (ds41_scheduler_import(m->sched, &part, snap.kv, snap.kv_len, snap.ids, snap.n_ids, cid, &e) !=
                0) {
                bool full = strstr(e.msg, "KV cache full") || strstr(e.msg, "cannot keep");
                ds41_svc_fail(err, full ? DS41_SVC_KV_FULL : DS41_SVC_BAD_REQUEST, "id", "snapshot %.200s: %s",
                              snapshot_id, e.msg);
                if (!full && !strstr(e.msg, "stopping") && !strstr(e.msg, "disabled")) {
                    ds41_log(DS41_LOG_WARNING, "model %s: snapshot %s refused: %s (deleted)", m->name, name, e.msg);
                    ds41_snapshot_store_remove(m->store, name, NULL);
                }
            } else {
                snprintf(session_id, session_id_size, "%s:%s", m->name, cid);
                *tokens = snap.n_ids;
                rc = 0;
            }
            ds41_snapshot_free(&snap);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

static int svc_delete_snapshot(void *ctx, const char *snapshot_id, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    const char *name = NULL;
    model *m = model_of_id(s, snapshot_id, &name);
    int rc = -1;
    if (m) {
        if (m->store) rc = ds41_snapshot_store_remove(m->store, name, NULL);
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    if (rc != 0) return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, NULL, "no snapshot '%.200s'", snapshot_id);
    return 0;
}

static int svc_set_expert_budget(void *ctx, const char *name, uint64_t bytes, uint64_t *chosen,
                                 ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    int rc = 0;
    size_t matched = 0;
    bool chosen_default = false;
    pthread_rwlock_rdlock(&s->cfg_lock);
    for (size_t i = 0; i < s->n_models && rc == 0; i++) {
        model *m = s->models[i];
        if (name && strcmp(name, m->name) != 0) continue;
        pthread_rwlock_rdlock(&m->lock);
        if (m->state == DS41_MODEL_READY && m->engine) {
            matched++;
            ds41_error e2 = {{0}};
            /* "auto" (0): the budget the auto sizing chose at load. */
            const uint64_t want = bytes ? bytes : m->auto_expert_bytes;
            if (!bytes && m->auto_expert_error[0])
                rc = ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "bytes", "model %s: auto: %s", m->name,
                                   m->auto_expert_error);
            else if (ds41_engine_request_expert_budget(m->engine, want, &e2) != 0)
                rc = ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "bytes", "model %s: %s", m->name, e2.msg);
            else if (!bytes)
                ds41_log(DS41_LOG_INFO, "model %s: expert budget auto = %llu bytes (%s)", m->name,
                         (unsigned long long)want, want ? "streamed" : "resident");
            if (rc == 0 && chosen && (matched == 1 || (m->is_default && !chosen_default))) {
                *chosen = want;
                chosen_default = m->is_default;
            }
        } else if (name) {
            matched++;
            rc = ds41_svc_fail(err, DS41_SVC_UNAVAILABLE, NULL, "model %s is not loaded", m->name);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    if (rc == 0 && !name) { /* the budget of models loaded later too */
        pthread_rwlock_wrlock(&s->cfg_lock);
        s->st.expert_cache_bytes = bytes;
        pthread_rwlock_unlock(&s->cfg_lock);
    }
    if (rc == 0 && name && !matched) return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "model", "no model '%s'", name);
    if (rc == 0 && !matched) return ds41_svc_fail(err, DS41_SVC_UNAVAILABLE, NULL, "no model is loaded");
    if (rc == 0)
        ds41_log(DS41_LOG_INFO, "expert budget set to %llu bytes (%s) from the next step", (unsigned long long)bytes,
                 name ? name : "every model");
    return rc;
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
                              .submit = svc_submit,
                              .cancel = svc_cancel,
                              .tokenize = svc_tokenize,
                              .detokenize = svc_detokenize,
                              .metrics = svc_metrics,
                              .load_model = svc_load_model,
                              .unload_model = svc_unload_model,
                              .list_sessions = svc_list_sessions,
                              .delete_session = svc_delete_session,
                              .cache_info = svc_cache_info,
                              .list_snapshots = svc_list_snapshots,
                              .save_snapshot = svc_save_snapshot,
                              .restore_snapshot = svc_restore_snapshot,
                              .delete_snapshot = svc_delete_snapshot,
                              .set_expert_budget = svc_set_expert_budget};
    *out = s;
    return 0;
}

const ds41_service *ds41_engine_service_iface(ds41_engine_service *s) { return &s->iface; }

int ds41_engine_service_load(ds41_engine_service *s, const char *name, ds41_error *err) {
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = find_model(s, name);
    int rc = m ? model_start_load(s, m, err) : ds41_fail(err, "no model '%s'", name ? name : "(default)");
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

ds41_model_state ds41_engine_service_default_state(ds41_engine_service *s, char *detail, size_t detail_size) {
    ds41_model_state st = DS41_MODEL_FAILED;
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = find_model(s, NULL);
    if (m) {
        pthread_rwlock_rdlock(&m->lock);
        ds41_error lost;
        st = effective_state(m, &lost);
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
    model *old_def = find_model(s, NULL);
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
    model *def = find_model(s, NULL);
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
