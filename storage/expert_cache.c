/* The routed-expert slot pool (see expert_cache.h for the contract and the
 * policy).  Reads go through a ds41_reader; each expert is read as at most
 * six ranges (one per run of adjacent tensors), each range widened to the
 * direct-I/O unit so that O_DIRECT reads land straight in the slot without a
 * bounce copy (the widened bytes are neighbours' data and are not used). */
#include "storage/expert_cache.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PARTS 6 /* w1.weight, w1.scale, w2.weight, w2.scale, w3.weight, w3.scale */
#define SLOT_ALIGN 4096u
#define LAT_RING 4096
#define DEFAULT_QD 64

static const char *const part_suffix[PARTS] = {"w1.weight", "w1.scale", "w2.weight",
                                               "w2.scale",  "w3.weight", "w3.scale"};

/* Where one expert's bytes are in the shards and in a slot. */
typedef struct xloc {
    uint64_t run_off[PARTS];   /* aligned start of each run in its shard */
    uint64_t run_len[PARTS];   /* bytes to read (aligned, clamped to the shard size) */
    uint64_t run_slot[PARTS];  /* offset of the run in the slot */
    uint64_t part_slot[PARTS]; /* offset of each part (part_suffix order) in the slot */
    uint32_t shard[PARTS];     /* per run */
    uint8_t run_first[PARTS];  /* first part of the run (for messages) */
    uint8_t n_runs;
} xloc;

enum { SLOT_EMPTY = 0, SLOT_LOADING, SLOT_READY, SLOT_FAILED };

typedef struct slot {
    int32_t layer, expert; /* -1 when empty */
    uint8_t state;
    uint8_t predicted;  /* holds a prediction pin */
    uint8_t pred_fresh; /* loaded for a prediction and not used yet */
    uint8_t spec;       /* its load was a prediction's, or its last pin went while it was in
                         * flight; not yet read again on demand */
    uint8_t twin_ok;    /* the twin slot holds this slot's current load (device-like memory) */
    uint32_t pins;
    uint32_t pending; /* runs in flight */
    uint32_t freq;
    uint64_t last_use;
    uint64_t t_submit;
    int has_fail;
    ds41_read_completion fail; /* first failed run */
    uint8_t fail_run;
} slot;

struct ds41_expert_cache {
    const ds41_checkpoint *ckpt;
    int n_layers;
    int max_experts;
    int *layer_experts; /* [n_layers] routed experts of each layer (0: none) */
    xloc *loc;          /* [n_layers * max_experts] */
    uint64_t slot_bytes, total_bytes, budget;
    ds41_reader *r;

    unsigned char *pool;    /* host slots: where reads land (the staging tier with a twin pool) */
    const ds41_memory *mem; /* the twin pool's memory; NULL: the backend computes on pool */
    unsigned char *twin;    /* [n_slots * slot_bytes] of mem, NULL without one */
    slot *slots;
    size_t n_slots;
    int32_t *index; /* [n_layers * max_experts] slot or -1 */
    uint64_t tick, uses_since_aging;
    uint64_t dev_seen; /* reader bytes_device already added to st.device_bytes */

    ds41_read_req *reqs; /* scratch: PARTS per slot */

    pthread_mutex_t mu; /* guards st, lat */
    ds41_expert_cache_stats st;
    uint64_t lat[LAT_RING];
    size_t lat_n, lat_pos;
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t round_up(uint64_t v, uint64_t a) {
    return (v + a - 1) / a * a;
}

/* ---- geometry ---------------------------------------------------------------- */

typedef struct part_ref {
    uint32_t shard;
    uint64_t off, len;
    int part;
} part_ref;

static int cmp_part(const void *a, const void *b) {
    const part_ref *x = a, *y = b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    if (x->off != y->off) return x->off < y->off ? -1 : 1;
    return 0;
}

/* Runs of one expert: its parts sorted by position, adjacent ones (gap under
 * one unit) of the same shard merged, each run widened to `unit` and clamped
 * to the shard's size. */
static int locate(const ds41_checkpoint *ck, int L, int ex, uint64_t unit, xloc *out, ds41_error *err) {
    part_ref p[PARTS];
    char name[128];
    for (int i = 0; i < PARTS; i++) {
        snprintf(name, sizeof name, "layers.%d.ffn.experts.%d.%s", L, ex, part_suffix[i]);
        const ds41_tensor *t = ds41_checkpoint_find(ck, name);
        if (!t) return ds41_fail(err, "expert cache: tensor '%s' is not in the checkpoint", name);
        p[i] = (part_ref){t->shard, t->file_offset, t->nbytes, i};
    }
    qsort(p, PARTS, sizeof p[0], cmp_part);
    memset(out, 0, sizeof *out);
    uint64_t at = 0;
    for (int i = 0; i < PARTS;) {
        const uint32_t sh = p[i].shard;
        const uint64_t start = p[i].off;
        uint64_t end = p[i].off + p[i].len;
        int j = i + 1;
        while (j < PARTS && p[j].shard == sh && p[j].off <= end + unit) {
            if (p[j].off + p[j].len > end) end = p[j].off + p[j].len;
            j++;
        }
        const uint64_t astart = start / unit * unit;
        uint64_t aend = round_up(end, unit);
        const uint64_t fsize = ds41_checkpoint_shard_size(ck, sh);
        if (aend > fsize) aend = fsize > end ? fsize : end;
        const int k = out->n_runs++;
        out->shard[k] = sh;
        out->run_off[k] = astart;
        out->run_len[k] = aend - astart;
        out->run_slot[k] = at;
        out->run_first[k] = (uint8_t)p[i].part;
        for (int q = i; q < j; q++) out->part_slot[p[q].part] = at + (p[q].off - astart);
        at += round_up(aend - astart, SLOT_ALIGN);
        i = j;
    }
    return 0;
}

static uint64_t loc_bytes(const xloc *l) {
    return l->n_runs ? l->run_slot[l->n_runs - 1] + round_up(l->run_len[l->n_runs - 1], SLOT_ALIGN) : 0;
}

/* The bytes of a slot one load of l fills: up to the end of its last run. */
static uint64_t loc_used(const xloc *l) {
    return l->n_runs ? l->run_slot[l->n_runs - 1] + l->run_len[l->n_runs - 1] : 0;
}

static int text_layer_experts(const ds41_model_config *cfg, int L) {
    const ds41_layer_role *role = &cfg->roles[L];
    return role->present ? (int)role->n_experts : 0;
}

int ds41_expert_cache_geometry(const ds41_checkpoint *ckpt, const ds41_model_config *cfg, uint64_t *slot_bytes,
                               uint64_t *total_bytes, ds41_error *err) {
    uint64_t biggest = 0, total = 0;
    for (int L = 0; L < (int)cfg->n_layers && L < (int)cfg->n_roles; L++) {
        const int E = text_layer_experts(cfg, L);
        for (int ex = 0; ex < E; ex++) {
            xloc l;
            if (locate(ckpt, L, ex, SLOT_ALIGN, &l, err) != 0) return -1;
            const uint64_t b = loc_bytes(&l);
            if (b > biggest) biggest = b;
            total += b;
        }
    }
    if (slot_bytes) *slot_bytes = biggest;
    if (total_bytes) *total_bytes = total;
    return 0;
}

/* ---- pool -------------------------------------------------------------------- */

static int alloc_pool(ds41_expert_cache *c, uint64_t budget, ds41_error *err) {
    if (c->slot_bytes == 0) return ds41_fail(err, "expert cache: the model has no routed experts");
    if (budget < c->slot_bytes)
        return ds41_fail(err,
                         "expert cache: budget of %" PRIu64 " bytes is below one expert slot (the minimum is %" PRIu64
                         " bytes)",
                         budget, c->slot_bytes);
    uint64_t n = budget / c->slot_bytes;
    const uint64_t all = (uint64_t)c->n_layers * (uint64_t)c->max_experts;
    if (n > all) n = all;
    if (n > SIZE_MAX / c->slot_bytes || n > SIZE_MAX / sizeof(slot) / PARTS)
        return ds41_fail(err, "expert cache: budget too large for this machine");
    const size_t bytes = (size_t)(n * c->slot_bytes);
    unsigned char *pool = aligned_alloc(SLOT_ALIGN, bytes);
    slot *slots = calloc((size_t)n, sizeof *slots);
    ds41_read_req *reqs = malloc((size_t)n * PARTS * sizeof *reqs);
    /* The twin pool: one allocation; the old one is kept until this one
     * exists, so that a failed resize leaves a working cache. */
    unsigned char *twin = pool && slots && reqs && c->mem ? c->mem->alloc(c->mem, bytes) : NULL;
    if (!pool || !slots || !reqs || (c->mem && !twin)) {
        const bool in_mem = pool && slots && reqs; /* only the twin pool failed */
        const char *where = !in_mem ? "" : c->mem->name ? c->mem->name : "backend";
        free(pool);
        free(slots);
        free(reqs);
        return ds41_fail(err, "expert cache: cannot allocate %" PRIu64 " slots of %" PRIu64 " bytes%s%s%s", n,
                         c->slot_bytes, in_mem ? " in " : "", where, in_mem ? " memory" : "");
    }
    for (uint64_t i = 0; i < n; i++) slots[i].layer = slots[i].expert = -1;
    free(c->pool);
    free(c->slots);
    free(c->reqs);
    if (c->twin) c->mem->free(c->mem, c->twin, c->n_slots * (size_t)c->slot_bytes);
    c->twin = twin;
    c->pool = pool;
    c->slots = slots;
    c->reqs = reqs;
    c->n_slots = (size_t)n;
    c->budget = budget;
    for (size_t i = 0; i < (size_t)all; i++) c->index[i] = -1;
    pthread_mutex_lock(&c->mu);
    c->st.budget_bytes = budget;
    c->st.slots = n;
    c->st.slots_used = 0;
    c->st.slot_memory_bytes = c->mem ? bytes : 0;
    pthread_mutex_unlock(&c->mu);
    return 0;
}

ds41_expert_cache *ds41_expert_cache_new(const ds41_checkpoint *ckpt, const ds41_model_config *cfg,
                                         const ds41_expert_cache_opts *opts, ds41_error *err) {
    ds41_expert_cache_opts o = opts ? *opts : (ds41_expert_cache_opts){0};
    ds41_expert_cache *c = calloc(1, sizeof *c);
    if (!c) {
        ds41_fail(err, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->ckpt = ckpt;
    /* Host memory is what the CPU backends compute on: no twin. */
    c->mem = o.slot_memory == &ds41_memory_host ? NULL : o.slot_memory;
    c->n_layers = (int)(cfg->n_layers < (int64_t)cfg->n_roles ? cfg->n_layers : (int64_t)cfg->n_roles);
    c->layer_experts = calloc((size_t)(c->n_layers > 0 ? c->n_layers : 1), sizeof *c->layer_experts);
    if (!c->layer_experts) goto oom;
    for (int L = 0; L < c->n_layers; L++) {
        c->layer_experts[L] = text_layer_experts(cfg, L);
        if (c->layer_experts[L] > c->max_experts) c->max_experts = c->layer_experts[L];
    }
    const size_t all = (size_t)c->n_layers * (size_t)c->max_experts;
    c->loc = calloc(all ? all : 1, sizeof *c->loc);
    c->index = malloc((all ? all : 1) * sizeof *c->index);
    if (!c->loc || !c->index) goto oom;

    ds41_reader_opts ro = {.queue_depth = o.queue_depth ? o.queue_depth : DEFAULT_QD,
                           .chunk_bytes = 1u << 20,
                           .direct = !o.buffered,
                           .register_buffers = true,
                           .backend = o.backend};
    c->r = ds41_reader_new(&ro, err);
    if (!c->r) goto fail;
    for (size_t s = 0; s < ds41_checkpoint_shard_count(ckpt); s++)
        if (ds41_reader_add_file(c->r, ds41_checkpoint_shard_path(ckpt, (uint32_t)s),
                                 ds41_checkpoint_shard_fd(ckpt, (uint32_t)s), err) < 0)
            goto fail;
    /* The widening unit: the largest direct-I/O unit of the shards. */
    uint64_t unit = SLOT_ALIGN;
    for (size_t s = 0; s < ds41_checkpoint_shard_count(ckpt); s++)
        if (ds41_reader_file_align(c->r, (uint32_t)s) > unit) unit = ds41_reader_file_align(c->r, (uint32_t)s);
    bool direct = false;
    for (int L = 0; L < c->n_layers; L++)
        for (int ex = 0; ex < c->layer_experts[L]; ex++) {
            xloc *l = &c->loc[(size_t)L * (size_t)c->max_experts + (size_t)ex];
            if (locate(ckpt, L, ex, unit, l, err) != 0) goto fail;
            const uint64_t b = loc_bytes(l);
            if (b > c->slot_bytes) c->slot_bytes = b;
            c->total_bytes += b;
            if (L == 0 && ex == 0) direct = ds41_reader_file_direct(c->r, l->shard[0]);
        }
    c->st.slot_bytes = c->slot_bytes;
    c->st.total_bytes = c->total_bytes;
    c->st.direct = direct;
    snprintf(c->st.backend, sizeof c->st.backend, "%s", ds41_reader_backend_name(c->r));
    if (alloc_pool(c, o.budget_bytes, err) != 0) goto fail;
    return c;
oom:
    ds41_fail(err, "out of memory");
fail:
    ds41_expert_cache_free(c);
    return NULL;
}

void ds41_expert_cache_free(ds41_expert_cache *c) {
    if (!c) return;
    ds41_reader_free(c->r); /* waits for reads into the pool before it is freed */
    free(c->pool);
    if (c->twin) c->mem->free(c->mem, c->twin, c->n_slots * (size_t)c->slot_bytes);
    free(c->slots);
    free(c->reqs);
    free(c->index);
    free(c->loc);
    free(c->layer_experts);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

uint64_t ds41_expert_cache_slot_bytes(const ds41_expert_cache *c) {
    return c->slot_bytes;
}
size_t ds41_expert_cache_slots(const ds41_expert_cache *c) {
    return c->n_slots;
}
uint64_t ds41_expert_cache_total_bytes(const ds41_expert_cache *c) {
    return c->total_bytes;
}
uint64_t ds41_expert_cache_budget(const ds41_expert_cache *c) {
    return c->budget;
}
ds41_reader *ds41_expert_cache_reader(ds41_expert_cache *c) {
    return c->r;
}

/* ---- slots ------------------------------------------------------------------- */

static int32_t *index_of(ds41_expert_cache *c, int L, int ex) {
    return &c->index[(size_t)L * (size_t)c->max_experts + (size_t)ex];
}

static void slot_drop(ds41_expert_cache *c, slot *s) {
    if (s->layer >= 0) *index_of(c, s->layer, s->expert) = -1;
    s->layer = s->expert = -1;
    s->state = SLOT_EMPTY;
    s->predicted = s->pred_fresh = 0;
    s->twin_ok = 0;
    s->has_fail = 0;
    s->freq = 0;
}

static void record_latency(ds41_expert_cache *c, uint64_t ns) {
    c->lat[c->lat_pos] = ns;
    c->lat_pos = (c->lat_pos + 1) % LAT_RING;
    if (c->lat_n < LAT_RING) c->lat_n++;
}

/* Process completions: wait for at least min of them (0: poll). */
static int reap(ds41_expert_cache *c, size_t min, ds41_error *err) {
    ds41_read_completion comp[64];
    for (;;) {
        long got = ds41_reader_wait(c->r, min, min ? -1 : 0, comp, 64, err);
        if (got < 0) return -1;
        const uint64_t t = now_ns();
        pthread_mutex_lock(&c->mu);
        for (long i = 0; i < got; i++) {
            const uint64_t si = comp[i].tag / PARTS;
            if (si >= c->n_slots) continue;
            slot *s = &c->slots[si];
            if (comp[i].error) {
                if (!s->has_fail) {
                    s->has_fail = 1;
                    s->fail = comp[i];
                    s->fail_run = (uint8_t)(comp[i].tag % PARTS);
                }
            } else {
                c->st.bytes_read += comp[i].len;
            }
            if (s->pending && --s->pending == 0) {
                s->state = s->has_fail ? SLOT_FAILED : SLOT_READY;
                if (!s->has_fail) record_latency(c, t - s->t_submit);
                else c->st.read_errors++;
            }
        }
        ds41_reader_stats rs;
        ds41_reader_get_stats(c->r, &rs);
        c->st.device_bytes += rs.bytes_device - c->dev_seen;
        c->dev_seen = rs.bytes_device;
        pthread_mutex_unlock(&c->mu);
        for (size_t i = 0; i < c->n_slots; i++) {
            slot *s = &c->slots[i];
            if (s->state == SLOT_FAILED && s->pins == 0 && !s->predicted) slot_drop(c, s);
        }
        if ((size_t)got < 64 || min) return 0;
    }
}

static void touch(ds41_expert_cache *c, slot *s) {
    s->freq++;
    s->last_use = ++c->tick;
    if (++c->uses_since_aging >= 8 * (uint64_t)c->n_slots) {
        c->uses_since_aging = 0;
        for (size_t i = 0; i < c->n_slots; i++) c->slots[i].freq /= 2;
    }
}

/* The unpinned, settled slot of the lowest frequency, least recently used
 * among those; empty slots first.  NULL when none. */
static slot *victim(ds41_expert_cache *c) {
    slot *best = NULL;
    for (size_t i = 0; i < c->n_slots; i++) {
        slot *s = &c->slots[i];
        if (s->pins || s->predicted || s->state == SLOT_LOADING) continue;
        if (s->state == SLOT_EMPTY) return s;
        if (!best || s->freq < best->freq || (s->freq == best->freq && s->last_use < best->last_use)) best = s;
    }
    return best;
}

static bool any_unpinned_loading(const ds41_expert_cache *c) {
    for (size_t i = 0; i < c->n_slots; i++)
        if (c->slots[i].state == SLOT_LOADING && !c->slots[i].pins && !c->slots[i].predicted) return true;
    return false;
}

/* Claim s for (L, ex) and append its read requests at reqs[*nreq]. */
static void start_load(ds41_expert_cache *c, slot *s, int L, int ex, size_t *nreq) {
    if (s->layer >= 0) {
        pthread_mutex_lock(&c->mu);
        c->st.evictions++;
        pthread_mutex_unlock(&c->mu);
    }
    slot_drop(c, s);
    const size_t si = (size_t)(s - c->slots);
    const xloc *l = &c->loc[(size_t)L * (size_t)c->max_experts + (size_t)ex];
    s->layer = L;
    s->expert = ex;
    s->spec = 0;
    s->state = SLOT_LOADING;
    s->pending = l->n_runs;
    s->t_submit = now_ns();
    *index_of(c, L, ex) = (int32_t)si;
    unsigned char *base = c->pool + si * c->slot_bytes;
    for (int k = 0; k < l->n_runs; k++)
        c->reqs[(*nreq)++] = (ds41_read_req){.file = l->shard[k],
                                             .offset = l->run_off[k],
                                             .len = (size_t)l->run_len[k],
                                             .buf = base + l->run_slot[k],
                                             .tag = si * PARTS + (uint64_t)k};
    if (l->n_runs == 0) s->state = SLOT_READY;
}

/* Bytes one load of (L, ex) delivers into its slot. */
static uint64_t load_bytes(const ds41_expert_cache *c, int L, int ex) {
    const xloc *l = &c->loc[(size_t)L * (size_t)c->max_experts + (size_t)ex];
    uint64_t b = 0;
    for (int k = 0; k < l->n_runs; k++) b += l->run_len[k];
    return b;
}

static int check_args(const ds41_expert_cache *c, int L, const int32_t *experts, size_t n, ds41_error *err) {
    if (L < 0 || L >= c->n_layers || c->layer_experts[L] == 0)
        return ds41_fail(err, "expert cache: layer %d has no routed experts", L);
    for (size_t i = 0; i < n; i++)
        if (experts[i] < 0 || experts[i] >= c->layer_experts[L])
            return ds41_fail(err, "expert cache: layer %d: expert %d out of range (%d experts)", L, (int)experts[i],
                             c->layer_experts[L]);
    return 0;
}

static void slots_used_stat(ds41_expert_cache *c) {
    uint64_t used = 0;
    for (size_t i = 0; i < c->n_slots; i++) used += c->slots[i].layer >= 0;
    pthread_mutex_lock(&c->mu);
    c->st.slots_used = used;
    pthread_mutex_unlock(&c->mu);
}

long ds41_expert_cache_acquire(ds41_expert_cache *c, int L, const int32_t *experts, size_t n, uint8_t *got,
                               ds41_error *err) {
    if (check_args(c, L, experts, n, err) != 0) return -1;
    uint64_t hits = 0, pf_hits = 0, pf_inflight = 0, pred_used = 0, misses = 0, used_bytes = 0;
    size_t pinned = 0;
    for (size_t i = 0; i < n; i++) got[i] = 0;
    /* Settle what has arrived, so that failed prefetches are retried. */
    if (reap(c, 0, err) != 0) return -1;
    /* Hits first (including predicted experts in flight). */
    for (size_t i = 0; i < n; i++) {
        const int32_t si = *index_of(c, L, experts[i]);
        if (si < 0) continue;
        slot *s = &c->slots[si];
        if (s->predicted) pred_used++;
        if (s->state == SLOT_FAILED && s->pins == 0) {
            slot_drop(c, s);
            continue;
        }
        if (s->pred_fresh) {
            pf_hits++;
            pf_inflight += s->state == SLOT_LOADING;
            used_bytes += load_bytes(c, L, experts[i]);
        } else
            hits++;
        s->pred_fresh = 0;
        s->pins++;
        touch(c, s);
        got[i] = 1;
        pinned++;
    }
    /* This layer's prediction pins have served their purpose. */
    for (size_t i = 0; i < c->n_slots; i++)
        if (c->slots[i].predicted && c->slots[i].layer == L) c->slots[i].predicted = 0;
    /* Misses while slots last: one submission. */
    size_t nreq = 0;
    for (size_t i = 0; i < n; i++) {
        if (got[i]) continue;
        slot *s = victim(c);
        while (!s && any_unpinned_loading(c)) {
            if (reap(c, 1, err) != 0) goto fail;
            s = victim(c);
        }
        if (!s) break;
        start_load(c, s, L, experts[i], &nreq);
        s->pins = 1;
        touch(c, s);
        got[i] = 1;
        pinned++;
        misses++;
        used_bytes += load_bytes(c, L, experts[i]);
    }
    if (nreq && ds41_reader_submit(c->r, c->reqs, nreq, err) != 0) {
        /* Nothing of this submission is in flight: undo it. */
        for (size_t i = 0; i < nreq; i++) {
            slot *s = &c->slots[c->reqs[i].tag / PARTS];
            if (s->state == SLOT_LOADING) {
                s->pins = 0;
                slot_drop(c, s);
            }
        }
        goto fail;
    }
    pthread_mutex_lock(&c->mu);
    c->st.requests += pinned;
    c->st.hits += hits;
    c->st.prefetch_hits += pf_hits;
    c->st.prefetch_inflight += pf_inflight;
    c->st.misses += misses;
    c->st.reads += misses;
    c->st.bytes_used += used_bytes;
    c->st.predicted_used += pred_used;
    if (pinned < n) c->st.waves++;
    pthread_mutex_unlock(&c->mu);
    slots_used_stat(c);
    return (long)pinned;
fail:
    for (size_t i = 0; i < n; i++) {
        if (!got[i]) continue;
        const int32_t si = *index_of(c, L, experts[i]);
        if (si >= 0 && c->slots[si].pins) c->slots[si].pins--;
        got[i] = 0;
    }
    return -1;
}

/* A predicted expert whose read failed and that a layer now waits for is
 * read again, once, as a demand read: a speculative read never fails a
 * request by itself (the demand read does, with its own error).  Returns 1
 * when the read was issued again, 0 when s is not such a slot, -1 when the
 * submission fails (s keeps its first failure). */
static int reread_prediction(ds41_expert_cache *c, int L, int32_t ex, slot *s, ds41_error *err) {
    if (s->state != SLOT_FAILED || !s->spec) return 0;
    s->spec = 0;
    const size_t si = (size_t)(s - c->slots);
    const xloc *l = &c->loc[(size_t)L * (size_t)c->max_experts + (size_t)ex];
    unsigned char *base = c->pool + si * c->slot_bytes;
    size_t nreq = 0;
    for (int k = 0; k < l->n_runs; k++)
        c->reqs[nreq++] = (ds41_read_req){.file = l->shard[k],
                                          .offset = l->run_off[k],
                                          .len = (size_t)l->run_len[k],
                                          .buf = base + l->run_slot[k],
                                          .tag = si * PARTS + (uint64_t)k};
    if (nreq && ds41_reader_submit(c->r, c->reqs, nreq, err) != 0) return -1;
    s->has_fail = 0;
    s->twin_ok = 0;
    s->pending = l->n_runs;
    s->state = l->n_runs ? SLOT_LOADING : SLOT_READY;
    s->t_submit = now_ns();
    pthread_mutex_lock(&c->mu);
    c->st.reads++;
    pthread_mutex_unlock(&c->mu);
    return 1;
}

/* The slot of pinned expert (L, ex), or NULL with err filled. */
static slot *pinned_slot(ds41_expert_cache *c, int L, int32_t ex, ds41_error *err) {
    const int32_t si = *index_of(c, L, ex);
    if (si < 0 || c->slots[si].pins == 0) {
        ds41_fail(err, "expert cache: layer %d expert %d is not pinned", L, (int)ex);
        return NULL;
    }
    return &c->slots[si];
}

/* For a settled slot: its views (0), or the failed read's message (-1).
 * With a twin pool the slot's bytes go to its twin first, once per load. */
static int settled_view(ds41_expert_cache *c, int L, int32_t ex, slot *s, ds41_expert_view *view,
                        ds41_error *err) {
    const xloc *l = &c->loc[(size_t)L * (size_t)c->max_experts + (size_t)ex];
    if (s->state == SLOT_FAILED) {
        ds41_reader_completion_error(c->r, &s->fail, err);
        return ds41_error_prefix(err, "reading routed expert tensor 'layers.%d.ffn.experts.%d.%s' (and the rest of "
                                      "its run)",
                                 L, (int)ex, part_suffix[l->run_first[s->fail_run]]);
    }
    const size_t at = (size_t)(s - c->slots) * (size_t)c->slot_bytes;
    const unsigned char *base = c->pool + at;
    if (c->mem) {
        if (!s->twin_ok) {
            const uint64_t used = loc_used(l);
            c->mem->upload(c->mem, c->twin + at, base, (size_t)used);
            s->twin_ok = 1;
            pthread_mutex_lock(&c->mu);
            c->st.uploads++;
            c->st.bytes_uploaded += used;
            pthread_mutex_unlock(&c->mu);
        }
        base = c->twin + at;
    }
    for (int w = 0; w < 3; w++) {
        view->w[w] = base + l->part_slot[2 * w];
        view->s[w] = base + l->part_slot[2 * w + 1];
    }
    return 0;
}

static void add_stall(ds41_expert_cache *c, uint64_t ns) {
    pthread_mutex_lock(&c->mu);
    c->st.stall_ns += ns;
    pthread_mutex_unlock(&c->mu);
}

long ds41_expert_cache_wait_some(ds41_expert_cache *c, int L, const int32_t *experts, size_t n, const uint8_t *got,
                                 uint8_t *done, size_t min_new, ds41_expert_view *views, ds41_error *err) {
    if (check_args(c, L, experts, n, err) != 0) return -1;
    size_t newly = 0;
    uint64_t stalled = 0;
    /* Take in what has arrived without blocking first. */
    if (reap(c, 0, err) != 0) return -1;
    for (;;) {
        size_t left = 0;
        for (size_t i = 0; i < n; i++) {
            if (!got[i] || done[i]) continue;
            slot *s = pinned_slot(c, L, experts[i], err);
            if (!s) goto fail;
            const int rr = reread_prediction(c, L, experts[i], s, err);
            if (rr < 0) goto fail;
            if (s->state == SLOT_LOADING) {
                left++;
                continue;
            }
            if (settled_view(c, L, experts[i], s, &views[i], err) != 0) goto fail;
            done[i] = 1;
            newly++;
        }
        if (newly >= min_new || left == 0) break;
        const uint64_t t0 = now_ns();
        const int rc = reap(c, 1, err);
        stalled += now_ns() - t0;
        if (rc != 0) goto fail;
    }
    add_stall(c, stalled);
    return (long)newly;
fail:
    add_stall(c, stalled);
    return -1;
}

int ds41_expert_cache_wait(ds41_expert_cache *c, int L, const int32_t *experts, size_t n, const uint8_t *got,
                           ds41_expert_view *views, ds41_error *err) {
    if (check_args(c, L, experts, n, err) != 0) return -1;
    const uint64_t t0 = now_ns();
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        if (!got[i]) continue;
        slot *s = pinned_slot(c, L, experts[i], err);
        if (!s) {
            rc = -1;
            break;
        }
        for (;;) {
            while (s->state == SLOT_LOADING && rc == 0) rc = reap(c, 1, err);
            if (rc != 0) break;
            const int rr = reread_prediction(c, L, experts[i], s, err);
            if (rr <= 0) {
                rc = rr;
                break;
            }
        }
        if (rc != 0) break;
        rc = settled_view(c, L, experts[i], s, &views[i], err);
    }
    pthread_mutex_lock(&c->mu);
    c->st.stall_ns += now_ns() - t0;
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void ds41_expert_cache_release(ds41_expert_cache *c, int L, const int32_t *experts, size_t n,
                               const uint8_t *got) {
    if (L < 0 || L >= c->n_layers) return;
    for (size_t i = 0; i < n; i++) {
        if (got && !got[i]) continue;
        if (experts[i] < 0 || experts[i] >= c->layer_experts[L]) continue;
        const int32_t si = *index_of(c, L, experts[i]);
        if (si < 0) continue;
        slot *s = &c->slots[si];
        if (s->pins) s->pins--;
        if (s->pins == 0 && s->state == SLOT_FAILED && !s->predicted) slot_drop(c, s);
        /* A read still in flight that nobody waits for any more is, from now
         * on, as speculative as a prediction's: if it fails, the next layer
         * that needs the expert reads it again instead of inheriting an
         * error from a request that has gone (e.g. one that failed on another
         * expert's read and released the rest). */
        if (s->pins == 0 && s->state == SLOT_LOADING) s->spec = 1;
    }
}

size_t ds41_expert_cache_predict(ds41_expert_cache *c, int L, const int32_t *experts, size_t n) {
    ds41_error err;
    if (check_args(c, L, experts, n, &err) != 0) return 0;
    size_t nreq = 0, done = 0;
    uint64_t skipped = 0, loads = 0, again = 0;
    for (size_t i = 0; i < n; i++) {
        const int32_t si = *index_of(c, L, experts[i]);
        if (si >= 0) {
            if (c->slots[si].predicted) again++; /* an earlier prediction for this layer named it: count it once */
            if (c->slots[si].state != SLOT_FAILED) {
                c->slots[si].predicted = 1;
                done++;
            }
            continue;
        }
        slot *s = victim(c);
        if (!s) {
            skipped++;
            continue;
        }
        start_load(c, s, L, experts[i], &nreq);
        s->predicted = 1;
        s->pred_fresh = 1;
        s->spec = 1;
        s->freq = 0;
        s->last_use = ++c->tick;
        loads++;
        done++;
    }
    if (nreq && ds41_reader_submit(c->r, c->reqs, nreq, &err) != 0) {
        for (size_t i = 0; i < nreq; i++) {
            slot *s = &c->slots[c->reqs[i].tag / PARTS];
            if (s->state == SLOT_LOADING) slot_drop(c, s);
        }
        skipped += loads;
        done -= loads;
        loads = 0;
    }
    pthread_mutex_lock(&c->mu);
    c->st.predicted += n - again;
    c->st.predict_skipped += skipped;
    c->st.reads += loads;
    pthread_mutex_unlock(&c->mu);
    return done;
}

void ds41_expert_cache_end_step(ds41_expert_cache *c) {
    ds41_error err;
    (void)reap(c, 0, &err);
    for (size_t i = 0; i < c->n_slots; i++) {
        slot *s = &c->slots[i];
        s->predicted = 0;
        if (s->state == SLOT_FAILED && s->pins == 0) slot_drop(c, s);
    }
    slots_used_stat(c);
}

int ds41_expert_cache_set_budget(ds41_expert_cache *c, uint64_t budget_bytes, ds41_error *err) {
    for (size_t i = 0; i < c->n_slots; i++)
        if (c->slots[i].pins) return ds41_fail(err, "expert cache: cannot resize while experts are pinned");
    if (budget_bytes < c->slot_bytes)
        return ds41_fail(err,
                         "expert cache: budget of %" PRIu64 " bytes is below one expert slot (the minimum is %" PRIu64
                         " bytes)",
                         budget_bytes, c->slot_bytes);
    /* Reads in flight land in the old pool: let them finish first. */
    while (ds41_reader_outstanding(c->r))
        if (reap(c, 1, err) != 0) return -1;
    return alloc_pool(c, budget_bytes, err);
}

static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

void ds41_expert_cache_get_stats(ds41_expert_cache *c, ds41_expert_cache_stats *out, bool reset) {
    static uint64_t sorted[LAT_RING];
    static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&sort_mu);
    pthread_mutex_lock(&c->mu);
    *out = c->st;
    const size_t n = c->lat_n;
    memcpy(sorted, c->lat, n * sizeof *sorted);
    if (reset) {
        const ds41_expert_cache_stats keep = c->st;
        memset(&c->st, 0, sizeof c->st);
        c->st.budget_bytes = keep.budget_bytes;
        c->st.slot_bytes = keep.slot_bytes;
        c->st.slots = keep.slots;
        c->st.slots_used = keep.slots_used;
        c->st.total_bytes = keep.total_bytes;
        c->st.slot_memory_bytes = keep.slot_memory_bytes;
        c->st.direct = keep.direct;
        memcpy(c->st.backend, keep.backend, sizeof c->st.backend);
        c->lat_n = c->lat_pos = 0;
    }
    pthread_mutex_unlock(&c->mu);
    qsort(sorted, n, sizeof *sorted, cmp_u64);
    out->latency_p50_ns = n ? sorted[(n - 1) / 2] : 0;
    out->latency_p99_ns = n ? sorted[(n - 1) * 99 / 100] : 0;
    pthread_mutex_unlock(&sort_mu);
}
