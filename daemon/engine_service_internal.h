/* What daemon/engine_service*.c share: the service, its models and generation jobs (the contract
 * is engine_service.h).  engine_service.c owns the settings, the models' life (loads, swaps,
 * reloads, the disk tier hooks) and the model routes; each route family lives in its own file and
 * installs its functions into the ds41_service table:
 *   engine_service_gen.c      generation (chat/completions, cancel) and tokenize/detokenize
 *   engine_service_metrics.c  /metrics
 *   engine_service_cache.c    sessions, caches, snapshots, the expert budget (admin) */
#ifndef DS41_DAEMON_ENGINE_SERVICE_INTERNAL_H
#define DS41_DAEMON_ENGINE_SERVICE_INTERNAL_H

#include "cuda/cuda_backend.h"
#include "daemon/engine_service.h"
#include "engine/forward/forward.h"
#include "engine/serve/scheduler.h"
#include "engine/text/tokenizer.h"
#include "storage/snapshot_store.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

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
    ds41_cfg_backend backend; /* engine.backend (fast mode) */
    uint32_t cuda_device;
    uint32_t max_sequences, max_batch_tokens, prefill_chunk;
    bool speculative;
    uint32_t spec_max_draft, spec_min_confidence_pct;
    bool test_forced_output;
    uint64_t test_fault_expert_read;
    uint64_t kv_cache_bytes;
    uint64_t expert_cache_bytes;
    uint64_t host_expert_cache_bytes; /* the expert cache's host tier with a device backend, 0 = none */
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

    /* Progress of the last load (ds41_engine_opts.progress): written by the loader thread, read by
     * the admin listing from any thread without the lock.  load_state: a load_state value
     * (engine_service.c); 0 = never loaded. */
    _Atomic uint64_t load_tensors_done, load_tensors_total, load_bytes_done, load_bytes_total;
    _Atomic int load_state;
    int load_reported;     /* loader thread only: the last stage x tenth sent to STATUS= */
    unsigned load_step_ms; /* loader thread only: the DS41_TEST_LOAD_STEP_MS test hook */

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

/* The model called name (NULL: the default one); cfg_lock held. */
model *es_find_model(ds41_engine_service *s, const char *name);
/* The READY model for a request, its read lock taken (cfg_lock held); NULL with *err set. */
model *es_acquire_model(ds41_engine_service *s, const char *name, ds41_svc_error *err);
/* The state clients see (m->lock held): FAILED when the engine lost a mapped shard. */
ds41_model_state es_effective_state(const model *m, ds41_error *lost);
/* A scheduler partition <-> the owner a snapshot file keeps. */
ds41_snapshot_owner es_owner_of(const ds41_sched_partition *part);
ds41_sched_partition es_partition_of(const ds41_snapshot_owner *o);

/* Device memory by what holds it (cuda/cuda_backend.h) of m's backend (m->lock held, m ready):
 * false, *out zeroed, when m does not run on the CUDA backend (/metrics and /admin/cache then
 * show no device lines). */
bool es_device_mem(const model *m, ds41_cuda_mem_stats *out);
/* The device-memory tiers of /admin/cache, in this order ("device-weights", ... "pinned-host"). */
#define ES_DEVICE_TIERS 6
extern const char *const es_device_tier_names[ES_DEVICE_TIERS];
void es_device_tier_bytes(const ds41_cuda_mem_stats *d, uint64_t out[ES_DEVICE_TIERS]);

/* Each route family fills its entries of the service table. */
void es_generation_routes(ds41_service *iface);
void es_metrics_routes(ds41_service *iface);
void es_cache_routes(ds41_service *iface);

#endif
