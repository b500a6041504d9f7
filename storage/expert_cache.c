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
    uint8_t unused;     /* host tier: read from the shards and not yet used by a layer */
    int32_t h;          /* host tier: a device slot's host slot until its upload (-1: none) */
    uint32_t pins;      /* host tier: the device slots staging from it */
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

    unsigned char *pool;    /* host slots: where reads land (the staging tier with a twin pool);
                             * NULL with a host tier of its own (reads land in hpool) */
    const ds41_memory *mem; /* the twin pool's memory; NULL: the backend computes on pool */
    unsigned char *twin;    /* [n_slots * slot_bytes] of mem, NULL without one */
    slot *slots;
    size_t n_slots;
    int32_t *index; /* [n_layers * max_experts] slot or -1 */
    uint64_t tick, uses_since_aging;
    ds41_host_alloc halloc; /* where pool / hpool come from */

    /* The host tier of its own (opts.host_tier_bytes with a twin pool). */
    bool tier;
    uint64_t host_budget;
    unsigned char *hpool; /* [n_hs * slot_bytes] */
    slot *hs;
    size_t n_hs;
    int32_t *hindex; /* [n_layers * max_experts] host slot or -1 */
    uint64_t htick, h_uses_since_aging;
    uint64_t dev_seen; /* reader bytes_device already added to st.device_bytes */

    ds41_read_req *reqs; /* scratch: PARTS per slot (per host slot when more) */

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

static void free_host_tier(ds41_expert_cache *c) {
    ds41_host_alloc_put(&c->halloc, c->hpool, c->n_hs * (size_t)c->slot_bytes);
    free(c->hs);
    free(c->hindex);
    c->hpool = NULL;
    c->hs = NULL;
    c->hindex = NULL;
    c->n_hs = 0;
}

/* The device tier (or, without a twin pool, the only tier) of
 * floor(budget / slot) slots; with a host tier of its own, that tier too the
 * first time (it is kept across device resizes: its experts stay valid). */
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
    uint64_t nh = 0;
    if (c->tier) {
        nh = c->host_budget / c->slot_bytes;
        if (nh > all) nh = all;
        /* Every device load is staged in a host slot until its upload. */
        if (nh < n)
            return ds41_fail(err,
                             "expert cache: the host tier's budget of %" PRIu64 " bytes holds %" PRIu64
                             " slots, fewer than the device tier's %" PRIu64
                             " (each device load is staged in a host slot): it needs at least %" PRIu64
                             " bytes",
                             c->host_budget, nh, n, n * c->slot_bytes);
    }
    const uint64_t nr = n > nh ? n : nh;
    if (nr > SIZE_MAX / c->slot_bytes || nr > SIZE_MAX / sizeof(slot) / PARTS)
        return ds41_fail(err, "expert cache: budget too large for this machine");
    const size_t bytes = (size_t)(n * c->slot_bytes);
    const bool new_host = c->tier && !c->hs;
    unsigned char *pool = c->tier ? NULL : ds41_host_alloc_get(&c->halloc, bytes);
    slot *slots = calloc((size_t)n, sizeof *slots);
    ds41_read_req *reqs = malloc((size_t)nr * PARTS * sizeof *reqs);
    unsigned char *hpool = new_host ? ds41_host_alloc_get(&c->halloc, (size_t)(nh * c->slot_bytes)) : NULL;
    slot *hs = new_host ? calloc((size_t)nh, sizeof *hs) : NULL;
    int32_t *hindex = new_host ? malloc((size_t)(all ? all : 1) * sizeof *hindex) : NULL;
    const bool host_ok = (c->tier || pool) && slots && reqs && (!new_host || (hpool && hs && hindex));
    /* The twin pool: one allocation; the old one is kept until this one
     * exists, so that a failed resize leaves a working cache. */
    unsigned char *twin = host_ok && c->mem ? c->mem->alloc(c->mem, bytes) : NULL;
    if (!host_ok || (c->mem && !twin)) {
        const char *where = !host_ok ? "" : c->mem->name ? c->mem->name : "backend";
        ds41_host_alloc_put(&c->halloc, pool, bytes);
        ds41_host_alloc_put(&c->halloc, hpool, (size_t)(nh * c->slot_bytes));
        free(slots);
        free(reqs);
        free(hs);
        free(hindex);
        return ds41_fail(err, "expert cache: cannot allocate %" PRIu64 " slots of %" PRIu64 " bytes%s%s%s", n,
                         c->slot_bytes, host_ok ? " in " : "", where, host_ok ? " memory" : "");
    }
    for (uint64_t i = 0; i < n; i++) {
        slots[i].layer = slots[i].expert = -1;
        slots[i].h = -1;
    }
    if (new_host) {
        for (uint64_t i = 0; i < nh; i++) {
            hs[i].layer = hs[i].expert = -1;
            hs[i].h = -1;
        }
        for (size_t i = 0; i < (size_t)all; i++) hindex[i] = -1;
        c->hpool = hpool;
        c->hs = hs;
        c->hindex = hindex;
        c->n_hs = (size_t)nh;
    }
    /* The device slots go: no host slot stages for them any more. */
    for (size_t i = 0; i < c->n_hs; i++) c->hs[i].pins = 0;
    ds41_host_alloc_put(&c->halloc, c->pool, c->n_slots * (size_t)c->slot_bytes);
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
    c->st.host_budget_bytes = c->tier ? c->host_budget : 0;
    c->st.host_slots = c->tier ? c->n_hs : n;
    c->st.host_bytes = c->tier ? c->n_hs * c->slot_bytes : bytes;
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
    c->halloc = o.host_alloc;
    /* A host tier of its own only above a twin pool: on the host the slots
     * the backend computes on are the host tier. */
    c->tier = c->mem && o.host_tier_bytes;
    c->host_budget = o.host_tier_bytes;
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
    ds41_host_alloc_put(&c->halloc, c->pool, c->n_slots * (size_t)c->slot_bytes);
    free_host_tier(c);
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

static int32_t *hindex_of(ds41_expert_cache *c, int L, int ex) {
    return &c->hindex[(size_t)L * (size_t)c->max_experts + (size_t)ex];
}

static const xloc *loc_of(const ds41_expert_cache *c, int L, int ex) {
    return &c->loc[(size_t)L * (size_t)c->max_experts + (size_t)ex];
}

/* The state of an empty slot of either tier (pins, spec and the index
 * are the callers'). */
static void slot_clear(slot *s) {
    s->layer = s->expert = -1;
    s->state = SLOT_EMPTY;
    s->predicted = s->pred_fresh = 0;
    s->twin_ok = s->unused = 0;
    s->has_fail = 0;
    s->freq = 0;
}

/* Empty host slot h (nothing of it in flight, no device slot staging). */
static void hslot_drop(ds41_expert_cache *c, slot *h) {
    if (h->layer >= 0) *hindex_of(c, h->layer, h->expert) = -1;
    slot_clear(h);
    h->spec = 0;
    h->pins = 0;
}

/* Device slot s no longer stages from its host slot (uploaded, or gone). */
static void unstage(ds41_expert_cache *c, slot *s) {
    if (s->h < 0) return;
    slot *h = &c->hs[s->h];
    if (h->pins) h->pins--;
    s->h = -1;
}

static void slot_drop(ds41_expert_cache *c, slot *s) {
    unstage(c, s);
    if (s->layer >= 0) *index_of(c, s->layer, s->expert) = -1;
    slot_clear(s);
}

static void record_latency(ds41_expert_cache *c, uint64_t ns) {
    c->lat[c->lat_pos] = ns;
    c->lat_pos = (c->lat_pos + 1) % LAT_RING;
    if (c->lat_n < LAT_RING) c->lat_n++;
}

/* Host tier: host slot hi has settled.  The device slot staging from it
 * (loading) takes its outcome; a failed host slot is emptied at once, so
 * that the next use reads again.  Under c->mu. */
static void host_settled(ds41_expert_cache *c, size_t hi) {
    slot *h = &c->hs[hi];
    const int32_t di = *index_of(c, h->layer, h->expert);
    slot *s = di >= 0 && c->slots[di].h == (int32_t)hi ? &c->slots[di] : NULL;
    if (s && s->state == SLOT_LOADING) {
        s->state = h->state;
        if (h->state == SLOT_FAILED) {
            s->has_fail = 1;
            s->fail = h->fail;
            s->fail_run = h->fail_run;
        }
    }
    if (h->state == SLOT_FAILED) {
        if (s) unstage(c, s);
        hslot_drop(c, h);
    }
}

/* Process completions: wait for at least min of them (0: poll).  Tags name
 * the slot a read lands in: a device-tier slot (its pool), or with a host
 * tier of its own a host slot. */
static int reap(ds41_expert_cache *c, size_t min, ds41_error *err) {
    ds41_read_completion comp[64];
    for (;;) {
        long got = ds41_reader_wait(c->r, min, min ? -1 : 0, comp, 64, err);
        if (got < 0) return -1;
        const uint64_t t = now_ns();
        pthread_mutex_lock(&c->mu);
        for (long i = 0; i < got; i++) {
            const uint64_t si = comp[i].tag / PARTS;
            if (si >= (c->tier ? c->n_hs : c->n_slots)) continue;
            slot *s = c->tier ? &c->hs[si] : &c->slots[si];
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
                if (c->tier) host_settled(c, (size_t)si);
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

/* One use of s in a tier of n slots (LFU with aging, see the header). */
static void touch_in(slot *all, size_t n, slot *s, uint64_t *tick, uint64_t *since_aging) {
    s->freq++;
    s->last_use = ++*tick;
    if (++*since_aging >= 8 * (uint64_t)n) {
        *since_aging = 0;
        for (size_t i = 0; i < n; i++) all[i].freq /= 2;
    }
}

static void touch(ds41_expert_cache *c, slot *s) {
    touch_in(c->slots, c->n_slots, s, &c->tick, &c->uses_since_aging);
}

/* The unpinned, settled slot of the lowest frequency, least recently used
 * among those; empty slots first.  NULL when none. */
static slot *victim_in(slot *all, size_t n) {
    slot *best = NULL;
    for (size_t i = 0; i < n; i++) {
        slot *s = &all[i];
        if (s->pins || s->predicted || s->state == SLOT_LOADING) continue;
        if (s->state == SLOT_EMPTY) return s;
        if (!best || s->freq < best->freq || (s->freq == best->freq && s->last_use < best->last_use)) best = s;
    }
    return best;
}

static slot *victim(ds41_expert_cache *c) {
    return victim_in(c->slots, c->n_slots);
}

/* A slot of the tier loading with nobody holding it: waiting for reads
 * frees one. */
static bool any_unpinned_loading_in(const slot *all, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (all[i].state == SLOT_LOADING && !all[i].pins && !all[i].predicted) return true;
    return false;
}

static bool any_unpinned_loading(const ds41_expert_cache *c) {
    return any_unpinned_loading_in(c->slots, c->n_slots);
}

/* Append the reads of l into base (tagged for slot idx) at reqs[*nreq]. */
static void append_reads(ds41_expert_cache *c, const xloc *l, unsigned char *base, size_t idx, size_t *nreq) {
    for (int k = 0; k < l->n_runs; k++)
        c->reqs[(*nreq)++] = (ds41_read_req){.file = l->shard[k],
                                             .offset = l->run_off[k],
                                             .len = (size_t)l->run_len[k],
                                             .buf = base + l->run_slot[k],
                                             .tag = idx * PARTS + (uint64_t)k};
}

/* One more eviction in *counter (a field of c->st). */
static void count_eviction(ds41_expert_cache *c, uint64_t *counter) {
    pthread_mutex_lock(&c->mu);
    (*counter)++;
    pthread_mutex_unlock(&c->mu);
}

/* Host tier: claim host slot h for (L, ex) and append its reads. */
static void hstart_load(ds41_expert_cache *c, slot *h, int L, int ex, bool spec, size_t *nreq) {
    if (h->layer >= 0) count_eviction(c, &c->st.host_evictions);
    hslot_drop(c, h);
    const size_t hi = (size_t)(h - c->hs);
    const xloc *l = loc_of(c, L, ex);
    h->layer = L;
    h->expert = ex;
    h->spec = spec;
    h->unused = 1;
    h->state = l->n_runs ? SLOT_LOADING : SLOT_READY;
    h->pending = l->n_runs;
    h->t_submit = now_ns();
    *hindex_of(c, L, ex) = (int32_t)hi;
    append_reads(c, l, c->hpool + hi * c->slot_bytes, hi, nreq);
}

/* Host tier: the host slot of (L, ex): the one holding it or loading it
 * (*hit), else an evicted one whose read is appended at reqs[*nreq] (spec:
 * for a prediction).  When every host slot is busy, with `wait` waits for
 * the host-only predictions in flight.  Returns the slot, -1 when none is
 * free (err filled), -2 when waiting failed (err). */
static int32_t host_slot_for(ds41_expert_cache *c, int L, int ex, bool spec, bool wait, size_t *nreq,
                             bool *hit, ds41_error *err) {
    const int32_t have = *hindex_of(c, L, ex);
    *hit = have >= 0;
    if (have >= 0) {
        touch_in(c->hs, c->n_hs, &c->hs[have], &c->htick, &c->h_uses_since_aging);
        return have;
    }
    slot *h = victim_in(c->hs, c->n_hs);
    while (!h && wait && any_unpinned_loading_in(c->hs, c->n_hs)) {
        if (reap(c, 1, err) != 0) return -2;
        h = victim_in(c->hs, c->n_hs);
    }
    if (!h) {
        ds41_fail(err, "expert cache: every host slot is busy");
        return -1;
    }
    hstart_load(c, h, L, ex, spec, nreq);
    touch_in(c->hs, c->n_hs, h, &c->htick, &c->h_uses_since_aging);
    return (int32_t)(h - c->hs);
}

/* Claim device slot s for (L, ex).  Without a host tier of its own: its
 * reads are appended at reqs[*nreq] (*read set).  With one: s stages from
 * the host slot holding the expert (no read), else from a host slot read
 * now (*read).  Returns 0, or with a host tier -1 (no host slot free; s
 * untouched) / -2 (waiting failed), err filled. */
static int start_load(ds41_expert_cache *c, slot *s, int L, int ex, bool spec, bool wait, size_t *nreq,
                      bool *read, ds41_error *err) {
    int32_t hi = -1;
    bool hit = false;
    if (c->tier) {
        hi = host_slot_for(c, L, ex, spec, wait, nreq, &hit, err);
        if (hi < 0) return hi;
    }
    *read = !hit;
    if (s->layer >= 0) count_eviction(c, &c->st.evictions);
    slot_drop(c, s);
    const size_t si = (size_t)(s - c->slots);
    const xloc *l = loc_of(c, L, ex);
    s->layer = L;
    s->expert = ex;
    s->spec = 0;
    s->t_submit = now_ns();
    *index_of(c, L, ex) = (int32_t)si;
    if (c->tier) {
        slot *h = &c->hs[hi];
        h->pins++;
        s->h = hi;
        s->pending = 0;
        s->state = h->state == SLOT_READY ? SLOT_READY : SLOT_LOADING;
        /* A host-only prediction still in flight: as speculative as one. */
        s->spec = hit && h->state == SLOT_LOADING && h->spec;
        return 0;
    }
    s->state = l->n_runs ? SLOT_LOADING : SLOT_READY;
    s->pending = l->n_runs;
    append_reads(c, l, c->pool + si * c->slot_bytes, si, nreq);
    return 0;
}

/* A submission of reqs[0..nreq) failed or was never made: nothing of it is
 * in flight.  Empty the slots it was to fill (and their device slots). */
static void undo_reads(ds41_expert_cache *c, size_t nreq) {
    for (size_t i = 0; i < nreq; i++) {
        const size_t k = (size_t)(c->reqs[i].tag / PARTS);
        slot *s = c->tier ? &c->hs[k] : &c->slots[k];
        if (s->state != SLOT_LOADING) continue;
        if (c->tier) {
            const int32_t di = *index_of(c, s->layer, s->expert);
            if (di >= 0 && c->slots[di].h == (int32_t)k) {
                c->slots[di].pins = 0;
                slot_drop(c, &c->slots[di]);
            }
            hslot_drop(c, s);
        } else {
            s->pins = 0;
            slot_drop(c, s);
        }
    }
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
    uint64_t used = 0, hused = 0;
    for (size_t i = 0; i < c->n_slots; i++) used += c->slots[i].layer >= 0;
    for (size_t i = 0; i < c->n_hs; i++) hused += c->hs[i].layer >= 0;
    pthread_mutex_lock(&c->mu);
    c->st.slots_used = used;
    c->st.host_slots_used = c->tier ? hused : used;
    pthread_mutex_unlock(&c->mu);
}

long ds41_expert_cache_acquire(ds41_expert_cache *c, int L, const int32_t *experts, size_t n, uint8_t *got,
                               ds41_error *err) {
    if (check_args(c, L, experts, n, err) != 0) return -1;
    uint64_t hits = 0, pf_hits = 0, pf_inflight = 0, pred_used = 0, misses = 0, reads = 0, used_bytes = 0;
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
            if (!c->tier) used_bytes += load_bytes(c, L, experts[i]);
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
            if (reap(c, 1, err) != 0) goto undo;
            s = victim(c);
        }
        if (!s) break;
        bool read;
        if (start_load(c, s, L, experts[i], false, true, &nreq, &read, err) != 0) goto undo;
        s->pins = 1;
        touch(c, s);
        got[i] = 1;
        pinned++;
        misses++;
        reads += read;
        if (!c->tier) used_bytes += load_bytes(c, L, experts[i]);
    }
    /* Nothing of this submission is in flight when it fails: undo it. */
    if (nreq && ds41_reader_submit(c->r, c->reqs, nreq, err) != 0) goto undo;
    /* Host tier: the bytes a layer uses are those of the host slots' reads
     * (a prediction's at its first use; none for a host hit of a read that
     * was used before). */
    for (size_t i = 0; c->tier && i < n; i++) {
        if (!got[i]) continue;
        const slot *s = &c->slots[*index_of(c, L, experts[i])];
        if (s->h >= 0 && c->hs[s->h].unused) {
            c->hs[s->h].unused = 0;
            used_bytes += load_bytes(c, L, experts[i]);
        }
    }
    pthread_mutex_lock(&c->mu);
    c->st.requests += pinned;
    c->st.hits += hits;
    c->st.prefetch_hits += pf_hits;
    c->st.prefetch_inflight += pf_inflight;
    c->st.misses += misses;
    c->st.reads += reads;
    c->st.host_hits += misses - reads;
    c->st.bytes_used += used_bytes;
    c->st.predicted_used += pred_used;
    if (pinned < n) c->st.waves++;
    pthread_mutex_unlock(&c->mu);
    slots_used_stat(c);
    return (long)pinned;
undo:
    undo_reads(c, nreq);
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
    const xloc *l = loc_of(c, L, ex);
    size_t nreq = 0;
    int32_t hi = -1;
    bool hit = false;
    if (c->tier) {
        /* The failed host slot went at once; another may hold it by now. */
        hi = host_slot_for(c, L, ex, false, true, &nreq, &hit, err);
        if (hi < 0) return -1;
    } else {
        append_reads(c, l, c->pool + si * c->slot_bytes, si, &nreq);
    }
    if (nreq && ds41_reader_submit(c->r, c->reqs, nreq, err) != 0) {
        if (c->tier) undo_reads(c, nreq);
        return -1;
    }
    s->has_fail = 0;
    s->twin_ok = 0;
    s->t_submit = now_ns();
    if (c->tier) {
        c->hs[hi].pins++;
        c->hs[hi].unused = 0; /* a demand read: its bytes count as used now */
        s->h = hi;
        s->pending = 0;
        s->state = c->hs[hi].state == SLOT_READY ? SLOT_READY : SLOT_LOADING;
    } else {
        s->pending = l->n_runs;
        s->state = l->n_runs ? SLOT_LOADING : SLOT_READY;
    }
    pthread_mutex_lock(&c->mu);
    c->st.reads += !hit;
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
    const unsigned char *base = c->pool ? c->pool + at : NULL;
    if (c->mem) {
        if (!s->twin_ok) {
            const uint64_t used = loc_used(l);
            if (c->tier) {
                if (s->h < 0)
                    return ds41_fail(err, "expert cache: layer %d expert %d has no host slot to upload from",
                                     L, (int)ex);
                base = c->hpool + (size_t)s->h * (size_t)c->slot_bytes;
            }
            c->mem->upload(c->mem, c->twin + at, base, (size_t)used);
            s->twin_ok = 1;
            /* The device holds it now; the host slot stays in the host tier. */
            unstage(c, s);
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
    uint64_t skipped = 0, loads = 0, again = 0, host_only = 0;
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
        bool read = false;
        if (s && start_load(c, s, L, experts[i], true, false, &nreq, &read, &err) == 0) {
            s->predicted = 1;
            s->pred_fresh = 1;
            s->spec = 1;
            s->freq = 0;
            s->last_use = ++c->tick;
            loads += read;
            done++;
            continue;
        }
        /* No device slot free: the host tier can still take the read, so
         * that the layer's miss costs an upload only. */
        slot *h = c->tier && *hindex_of(c, L, experts[i]) < 0 ? victim_in(c->hs, c->n_hs) : NULL;
        if (h) {
            hstart_load(c, h, L, experts[i], true, &nreq);
            h->freq = 0;
            h->last_use = ++c->htick;
            loads++;
            host_only++;
            done++;
        } else if (c->tier && *hindex_of(c, L, experts[i]) >= 0) {
            done++; /* already in the host tier */
        } else {
            skipped++;
        }
    }
    if (nreq && ds41_reader_submit(c->r, c->reqs, nreq, &err) != 0) {
        undo_reads(c, nreq);
        skipped += loads;
        done -= loads;
        loads = host_only = 0;
    }
    pthread_mutex_lock(&c->mu);
    c->st.predicted += n - again;
    c->st.predict_skipped += skipped;
    c->st.predict_host += host_only;
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
        c->st.host_budget_bytes = keep.host_budget_bytes;
        c->st.host_slots = keep.host_slots;
        c->st.host_slots_used = keep.host_slots_used;
        c->st.host_bytes = keep.host_bytes;
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
