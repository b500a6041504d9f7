/* The Engram row tier: see engram_cache.h for the contract and the policy. */
#include "storage/engram_cache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NONE UINT32_MAX
#define BYPASS_TAG ((uint64_t)1 << 62)
#define ROW_BITS 48
#define HIST_BUCKETS (64 * 8)
#define MAX_ROW_BYTES ((size_t)1 << 20)

enum { E_FREE = 0, E_LOADING, E_READY };

typedef struct entry {
    uint64_t key;      /* (table << ROW_BITS) | row */
    uint64_t t_submit; /* ns, for the latency */
    uint32_t hnext;    /* hash chain */
    uint32_t prev, next; /* free list or LRU list (never both) */
    int32_t want;      /* index of the current gather's group waiting for it, -1 none */
    uint8_t state;
    uint8_t pinned;
    uint8_t fresh;   /* read for a use that has not happened yet */
    uint8_t pending; /* requests (payload, scale) not back yet */
    uint8_t failed;
} entry;

/* The budget's per-entry overhead covers the entry and up to two hash buckets. */
_Static_assert(sizeof(entry) + 2 * sizeof(uint32_t) <= DS41_ENGRAM_ENTRY_OVERHEAD, "entry overhead");

typedef struct list {
    uint32_t head, tail; /* head = most recently used */
} list;

typedef struct table {
    const ds41_tensor *payload, *scale;
    uint32_t file_payload, file_scale; /* reader file indices */
    int64_t rows;
} table;

/* Per gather call: rows sorted, grouped by row. */
typedef struct pos_row {
    int64_t row;
    size_t pos;
} pos_row;

typedef struct gather_state {
    uint32_t table;
    pos_row *order;  /* [n] sorted by (row, pos) */
    size_t *ustart;  /* [n_unique + 1] group bounds in order */
    uint8_t *bp_pending, *bp_failed; /* [n_unique] bypass reads */
    uint64_t *bp_t0;
    uint8_t *payload_out, *scale_out;
    size_t remaining; /* groups still waiting */
    int failed;
    ds41_error first_err;
} gather_state;

typedef struct counters {
    ds41_engram_cache_stats s;
    uint64_t hist[HIST_BUCKETS];
} counters;

struct ds41_engram_cache {
    const ds41_checkpoint *ckpt;
    ds41_reader *reader;
    table tables[DS41_ENGRAM_CACHE_MAX_TABLES];
    size_t n_tables;
    size_t rb, sb; /* payload / scale bytes per row */
    uint64_t budget;

    size_t cap;
    entry *e;
    uint8_t *slab; /* [cap][rb + sb], from halloc */
    ds41_host_alloc halloc;
    uint32_t *buckets;
    uint64_t bucket_mask;
    list free_list, lru;
    size_t used;

    uint32_t *pinned; /* entries pinned this step (may repeat; the flag decides) */
    size_t n_pinned, cap_pinned;

    ds41_read_req *reqs;
    size_t n_reqs, cap_reqs;

    gather_state *g; /* the gather in progress, NULL outside one */

    counters acc; /* engine thread only; merged into pub at the end of each call */
    pthread_mutex_t mu;
    counters pub;
    uint64_t device_base; /* reader bytes_device at the last reset */
};

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* ---- latency histogram: 8 buckets per power of two ------------------------------------ */

static size_t hist_bucket(uint64_t v) {
    if (v < 8) return (size_t)v;
    const int e = 63 - __builtin_clzll(v);
    const size_t b = (size_t)e * 8 + (size_t)((v >> (e - 3)) & 7);
    return b < HIST_BUCKETS ? b : HIST_BUCKETS - 1;
}

static uint64_t hist_upper(size_t b) {
    if (b < 8) return b;
    const size_t e = b / 8, sub = b % 8;
    if (e >= 63) return UINT64_MAX;
    return ((uint64_t)(8 + sub + 1) << (e - 3)) - 1;
}

static uint64_t hist_quantile(const uint64_t *h, double q) {
    uint64_t total = 0;
    for (size_t b = 0; b < HIST_BUCKETS; b++) total += h[b];
    if (total == 0) return 0;
    uint64_t want = (uint64_t)(q * (double)total);
    if ((double)want < q * (double)total) want++;
    if (want == 0) want = 1;
    uint64_t cum = 0;
    for (size_t b = 0; b < HIST_BUCKETS; b++) {
        cum += h[b];
        if (cum >= want) return hist_upper(b);
    }
    return hist_upper(HIST_BUCKETS - 1);
}

static void record_latency(ds41_engram_cache *c, uint64_t t0) {
    const uint64_t t = now_ns(), d = t > t0 ? t - t0 : 0;
    c->acc.hist[hist_bucket(d)]++;
    c->acc.s.read_ns += d;
    if (d > c->acc.s.latency_max_ns) c->acc.s.latency_max_ns = d;
}

/* Publish what the engine thread counted. */
static void merge(ds41_engram_cache *c) {
    ds41_reader_stats rs;
    ds41_reader_get_stats(c->reader, &rs);
    pthread_mutex_lock(&c->mu);
    ds41_engram_cache_stats *p = &c->pub.s;
    const ds41_engram_cache_stats *a = &c->acc.s;
    p->uses += a->uses;
    p->hits += a->hits;
    p->misses += a->misses;
    p->prefetched_early += a->prefetched_early;
    p->waited += a->waited;
    p->rows_read += a->rows_read;
    p->bypass_reads += a->bypass_reads;
    p->prefetch_dropped += a->prefetch_dropped;
    p->evictions += a->evictions;
    p->read_errors += a->read_errors;
    p->bytes_read += a->bytes_read;
    p->read_ns += a->read_ns;
    p->gathers += a->gathers;
    p->gather_wait_ns += a->gather_wait_ns;
    if (a->latency_max_ns > p->latency_max_ns) p->latency_max_ns = a->latency_max_ns;
    for (size_t b = 0; b < HIST_BUCKETS; b++) c->pub.hist[b] += c->acc.hist[b];
    p->entries_used = c->used;
    p->bytes_device = rs.bytes_device >= c->device_base ? rs.bytes_device - c->device_base : 0;
    pthread_mutex_unlock(&c->mu);
    memset(&c->acc, 0, sizeof c->acc);
}

/* ---- lists and hash ------------------------------------------------------------------- */

static void list_remove(ds41_engram_cache *c, list *l, uint32_t i) {
    entry *x = &c->e[i];
    if (x->prev != NONE)
        c->e[x->prev].next = x->next;
    else
        l->head = x->next;
    if (x->next != NONE)
        c->e[x->next].prev = x->prev;
    else
        l->tail = x->prev;
    x->prev = x->next = NONE;
}

static void list_push_head(ds41_engram_cache *c, list *l, uint32_t i) {
    entry *x = &c->e[i];
    x->prev = NONE;
    x->next = l->head;
    if (l->head != NONE)
        c->e[l->head].prev = i;
    else
        l->tail = i;
    l->head = i;
}

static uint64_t bucket_of(const ds41_engram_cache *c, uint64_t key) {
    return ((key + 1) * 0x9e3779b97f4a7c15ull >> 17) & c->bucket_mask;
}

static uint32_t lookup(const ds41_engram_cache *c, uint64_t key) {
    if (c->cap == 0) return NONE;
    for (uint32_t i = c->buckets[bucket_of(c, key)]; i != NONE; i = c->e[i].hnext)
        if (c->e[i].key == key) return i;
    return NONE;
}

static void hash_insert(ds41_engram_cache *c, uint32_t i) {
    uint32_t *b = &c->buckets[bucket_of(c, c->e[i].key)];
    c->e[i].hnext = *b;
    *b = i;
}

static void hash_remove(ds41_engram_cache *c, uint32_t i) {
    for (uint32_t *p = &c->buckets[bucket_of(c, c->e[i].key)]; *p != NONE; p = &c->e[*p].hnext)
        if (*p == i) {
            *p = c->e[i].hnext;
            break;
        }
    c->e[i].hnext = NONE;
}

/* A free entry, else the least recently used ready unpinned one (evicted);
 * NONE when every entry is pinned or in flight. */
static uint32_t take_entry(ds41_engram_cache *c) {
    uint32_t i = c->free_list.head;
    if (i != NONE) {
        list_remove(c, &c->free_list, i);
        c->used++;
        return i;
    }
    i = c->lru.tail;
    if (i == NONE) return NONE;
    list_remove(c, &c->lru, i);
    hash_remove(c, i);
    c->acc.s.evictions++;
    return i;
}

/* Back to the free list (after a failed read or a refused submission). */
static void drop_entry(ds41_engram_cache *c, uint32_t i) {
    entry *x = &c->e[i];
    if (x->state == E_READY && !x->pinned) list_remove(c, &c->lru, i);
    hash_remove(c, i);
    x->state = E_FREE;
    x->pinned = 0;
    x->fresh = 0;
    x->pending = 0;
    x->failed = 0;
    x->want = -1;
    list_push_head(c, &c->free_list, i);
    c->used--;
}

static void pin(ds41_engram_cache *c, uint32_t i) {
    entry *x = &c->e[i];
    if (x->pinned) return;
    if (c->n_pinned == c->cap_pinned) {
        size_t cap = c->cap_pinned ? c->cap_pinned * 2 : 256;
        uint32_t *p = realloc(c->pinned, cap * sizeof *p);
        if (!p) return; /* pins are a preference: without memory the row stays evictable */
        c->pinned = p;
        c->cap_pinned = cap;
    }
    if (x->state == E_READY) list_remove(c, &c->lru, i);
    x->pinned = 1;
    c->pinned[c->n_pinned++] = i;
}

void ds41_engram_cache_unpin_all(ds41_engram_cache *c) {
    if (!c) return;
    for (size_t k = 0; k < c->n_pinned; k++) {
        const uint32_t i = c->pinned[k];
        entry *x = &c->e[i];
        if (!x->pinned) continue;
        x->pinned = 0;
        if (x->state == E_READY) list_push_head(c, &c->lru, i);
    }
    c->n_pinned = 0;
}

/* ---- reads ---------------------------------------------------------------------------- */

static int add_req(ds41_engram_cache *c, uint32_t file, uint64_t offset, size_t len, void *buf, uint64_t tag) {
    if (c->n_reqs == c->cap_reqs) {
        size_t cap = c->cap_reqs ? c->cap_reqs * 2 : 512;
        ds41_read_req *r = realloc(c->reqs, cap * sizeof *r);
        if (!r) return -1;
        c->reqs = r;
        c->cap_reqs = cap;
    }
    c->reqs[c->n_reqs++] = (ds41_read_req){.file = file, .offset = offset, .len = len, .buf = buf, .tag = tag};
    return 0;
}

static int add_row_reqs(ds41_engram_cache *c, uint32_t t, int64_t row, uint8_t *pbuf, uint8_t *sbuf, uint64_t tag) {
    const table *tb = &c->tables[t];
    if (add_req(c, tb->file_payload, tb->payload->file_offset + (uint64_t)row * c->rb, c->rb, pbuf, tag) != 0)
        return -1;
    if (add_req(c, tb->file_scale, tb->scale->file_offset + (uint64_t)row * c->sb, c->sb, sbuf, tag) != 0) {
        c->n_reqs--;
        return -1;
    }
    return 0;
}

static uint8_t *entry_data(const ds41_engram_cache *c, uint32_t i) {
    return c->slab + (size_t)i * (c->rb + c->sb);
}

/* The message of a failed row read: tensor, row, then the reader's
 * "SHARD: read of N bytes at offset X: reason". */
static void row_error(ds41_engram_cache *c, uint32_t t, uint64_t key, const ds41_read_completion *comp,
                      ds41_error *out) {
    const table *tb = &c->tables[t];
    const ds41_tensor *tensor = comp->file == tb->file_scale && comp->offset >= tb->scale->file_offset &&
                                        comp->offset < tb->scale->file_offset + tb->scale->nbytes
                                    ? tb->scale
                                    : tb->payload;
    ds41_error e = {{0}};
    ds41_reader_completion_error(c->reader, comp, &e);
    ds41_fail(out, "engram row %llu of '%s' in %s", (unsigned long long)(key & (((uint64_t)1 << ROW_BITS) - 1)),
              tensor->name, e.msg);
}

static void copy_group(ds41_engram_cache *c, gather_state *g, size_t u, const uint8_t *p, const uint8_t *s) {
    for (size_t k = g->ustart[u]; k < g->ustart[u + 1]; k++) {
        const size_t pos = g->order[k].pos;
        uint8_t *dp = g->payload_out + pos * c->rb, *ds = g->scale_out + pos * c->sb;
        if (dp != p) memcpy(dp, p, c->rb);
        if (ds != s) memcpy(ds, s, c->sb);
    }
}

static void complete(ds41_engram_cache *c, const ds41_read_completion *comp) {
    gather_state *g = c->g;
    if (comp->tag & BYPASS_TAG) {
        const size_t u = (size_t)(comp->tag & ~BYPASS_TAG);
        if (!g || g->bp_pending[u] == 0) return; /* cannot happen: bypass reads live inside a gather */
        if (comp->error) {
            if (!g->bp_failed[u]) {
                g->bp_failed[u] = 1;
                c->acc.s.read_errors++;
                if (!g->failed) {
                    g->failed = 1;
                    row_error(c, g->table, ((uint64_t)g->table << ROW_BITS) | (uint64_t)g->order[g->ustart[u]].row,
                              comp, &g->first_err);
                }
            }
        }
        if (--g->bp_pending[u] == 0) {
            g->remaining--;
            record_latency(c, g->bp_t0[u]);
            if (!g->bp_failed[u]) {
                const size_t pos = g->order[g->ustart[u]].pos;
                copy_group(c, g, u, g->payload_out + pos * c->rb, g->scale_out + pos * c->sb);
                c->acc.s.rows_read++;
                c->acc.s.bytes_read += c->rb + c->sb;
            }
        }
        return;
    }
    if (comp->tag >= c->cap) return;
    const uint32_t i = (uint32_t)comp->tag;
    entry *x = &c->e[i];
    if (x->state != E_LOADING || x->pending == 0) return;
    if (comp->error && !x->failed) {
        x->failed = 1;
        c->acc.s.read_errors++;
        if (x->want >= 0 && g && !g->failed) {
            g->failed = 1;
            row_error(c, (uint32_t)(x->key >> ROW_BITS), x->key, comp, &g->first_err);
        }
    }
    if (--x->pending) return;
    record_latency(c, x->t_submit);
    const int32_t want = x->want;
    x->want = -1;
    if (x->failed) {
        if (want >= 0 && g) g->remaining--;
        drop_entry(c, i);
        return;
    }
    x->state = E_READY;
    c->acc.s.rows_read++;
    c->acc.s.bytes_read += c->rb + c->sb;
    if (!x->pinned) list_push_head(c, &c->lru, i);
    if (want >= 0 && g) {
        const uint8_t *d = entry_data(c, i);
        copy_group(c, g, (size_t)want, d, d + c->rb);
        g->remaining--;
    }
}

static int drain(ds41_engram_cache *c, size_t min_complete, ds41_error *err) {
    ds41_read_completion comps[64];
    for (;;) {
        long n = ds41_reader_wait(c->reader, min_complete, min_complete ? -1 : 0, comps, 64, err);
        if (n < 0) return -1;
        for (long k = 0; k < n; k++) complete(c, &comps[k]);
        if (min_complete || n < 64) return 0;
    }
}

int ds41_engram_cache_poll(ds41_engram_cache *c, ds41_error *err) {
    int rc = c->cap ? drain(c, 0, err) : 0;
    merge(c);
    return rc;
}

/* Submit c->reqs (all or none); on refusal the entries taken for them go back. */
static int submit(ds41_engram_cache *c, ds41_error *err) {
    if (c->n_reqs == 0) return 0;
    int rc = ds41_reader_submit(c->reader, c->reqs, c->n_reqs, err);
    if (rc != 0) {
        for (size_t k = 0; k < c->n_reqs; k += 2) {
            const uint64_t tag = c->reqs[k].tag;
            if (!(tag & BYPASS_TAG) && tag < c->cap && c->e[tag].state == E_LOADING) drop_entry(c, (uint32_t)tag);
        }
    }
    c->n_reqs = 0;
    return rc;
}

static int check_rows(const ds41_engram_cache *c, uint32_t t, const int64_t *rows, size_t n, const char *what,
                      ds41_error *err) {
    if (t >= c->n_tables) return ds41_fail(err, "engram cache %s: table %u of %zu", what, t, c->n_tables);
    if (n && !rows) return ds41_fail(err, "engram cache %s: no rows", what);
    for (size_t k = 0; k < n; k++)
        if (rows[k] < 0 || rows[k] >= c->tables[t].rows)
            return ds41_fail(err, "engram cache %s: row %lld of '%s' outside [0, %lld)", what, (long long)rows[k],
                             c->tables[t].payload->name, (long long)c->tables[t].rows);
    return 0;
}

int ds41_engram_cache_request(ds41_engram_cache *c, uint32_t t, const int64_t *rows, size_t n, ds41_error *err) {
    if (check_rows(c, t, rows, n, "request", err) != 0) return -1;
    if (c->cap == 0) {
        c->acc.s.prefetch_dropped += n;
        merge(c);
        return 0;
    }
    if (drain(c, 0, err) != 0) return -1;
    const uint64_t t0 = now_ns();
    int rc = 0;
    for (size_t k = 0; k < n && rc == 0; k++) {
        const uint64_t key = ((uint64_t)t << ROW_BITS) | (uint64_t)rows[k];
        uint32_t i = lookup(c, key);
        if (i != NONE) {
            pin(c, i);
            continue;
        }
        i = take_entry(c);
        if (i == NONE) {
            c->acc.s.prefetch_dropped++;
            continue;
        }
        entry *x = &c->e[i];
        x->key = key;
        x->state = E_LOADING;
        x->pending = 2;
        x->failed = 0;
        x->fresh = 1;
        x->want = -1;
        x->t_submit = t0;
        hash_insert(c, i);
        pin(c, i);
        uint8_t *d = entry_data(c, i);
        if (add_row_reqs(c, t, rows[k], d, d + c->rb, i) != 0) {
            drop_entry(c, i);
            rc = ds41_fail(err, "engram cache: out of memory");
        }
    }
    if (rc == 0) {
        rc = submit(c, err);
    } else {
        ds41_error ignored = {{0}};
        (void)submit(c, &ignored); /* what was queued before running out of memory */
    }
    merge(c);
    return rc;
}

static int cmp_pos_row(const void *a, const void *b) {
    const pos_row *x = a, *y = b;
    if (x->row != y->row) return x->row < y->row ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

int ds41_engram_cache_gather(ds41_engram_cache *c, uint32_t t, const int64_t *rows, size_t n, uint8_t *payload_out,
                             uint8_t *scale_out, ds41_error *err) {
    if (check_rows(c, t, rows, n, "gather", err) != 0) return -1;
    if (n == 0) return 0;
    if (!payload_out || !scale_out) return ds41_fail(err, "engram cache gather: no output buffers");
    if (c->cap && drain(c, 0, err) != 0) return -1;
    gather_state g = {.table = t, .payload_out = payload_out, .scale_out = scale_out};
    g.order = malloc(n * sizeof *g.order);
    g.ustart = malloc((n + 1) * sizeof *g.ustart);
    g.bp_pending = calloc(n, 1);
    g.bp_failed = calloc(n, 1);
    g.bp_t0 = malloc(n * sizeof *g.bp_t0);
    int rc = -1;
    if (!g.order || !g.ustart || !g.bp_pending || !g.bp_failed || !g.bp_t0) {
        ds41_fail(err, "engram cache: out of memory");
        goto out;
    }
    for (size_t k = 0; k < n; k++) g.order[k] = (pos_row){.row = rows[k], .pos = k};
    qsort(g.order, n, sizeof *g.order, cmp_pos_row);
    size_t nu = 0;
    for (size_t k = 0; k < n; k++)
        if (k == 0 || g.order[k].row != g.order[k - 1].row) g.ustart[nu++] = k;
    g.ustart[nu] = n;
    c->g = &g;
    c->acc.s.gathers++;
    c->acc.s.uses += nu;

    /* Pass 1: ready rows are copied now; rows in flight are waited for. */
    uint8_t *absent = calloc(nu ? nu : 1, 1); /* 1: not in the cache when the call began */
    if (!absent) {
        c->g = NULL;
        ds41_fail(err, "engram cache: out of memory");
        goto out;
    }
    for (size_t u = 0; u < nu; u++) {
        const uint64_t key = ((uint64_t)t << ROW_BITS) | (uint64_t)g.order[g.ustart[u]].row;
        const uint32_t i = lookup(c, key);
        if (i == NONE) {
            absent[u] = 1;
            continue;
        }
        entry *x = &c->e[i];
        if (x->fresh)
            c->acc.s.misses++;
        else
            c->acc.s.hits++;
        if (x->state == E_READY) {
            if (x->fresh) c->acc.s.prefetched_early++;
            const uint8_t *d = entry_data(c, i);
            copy_group(c, &g, u, d, d + c->rb);
            if (!x->pinned) {
                list_remove(c, &c->lru, i);
                list_push_head(c, &c->lru, i);
            }
        } else {
            if (x->fresh) c->acc.s.waited++;
            x->want = (int32_t)u;
            g.remaining++;
        }
        x->fresh = 0;
    }
    /* Pass 2: absent rows, one submission; into an entry when one is free or
     * evictable (pass 1 already copied every ready row), else straight into
     * the output. */
    const uint64_t t0 = now_ns();
    int sub_rc = 0;
    for (size_t u = 0; u < nu && sub_rc == 0; u++) {
        if (!absent[u]) continue;
        const int64_t row = g.order[g.ustart[u]].row;
        const uint64_t key = ((uint64_t)t << ROW_BITS) | (uint64_t)row;
        c->acc.s.misses++;
        c->acc.s.waited++;
        const uint32_t i = c->cap ? take_entry(c) : NONE;
        if (i != NONE) {
            entry *x = &c->e[i];
            x->key = key;
            x->state = E_LOADING;
            x->pending = 2;
            x->failed = 0;
            x->fresh = 0;
            x->want = (int32_t)u;
            x->t_submit = t0;
            hash_insert(c, i);
            uint8_t *d = entry_data(c, i);
            if (add_row_reqs(c, t, row, d, d + c->rb, i) != 0) {
                drop_entry(c, i);
                sub_rc = ds41_fail(err, "engram cache: out of memory");
            }
        } else {
            const size_t pos = g.order[g.ustart[u]].pos;
            if (add_row_reqs(c, t, row, payload_out + pos * c->rb, scale_out + pos * c->sb, BYPASS_TAG | u) != 0) {
                sub_rc = ds41_fail(err, "engram cache: out of memory");
            } else {
                g.bp_pending[u] = 2;
                g.bp_t0[u] = t0;
                c->acc.s.bypass_reads++;
            }
        }
        if (sub_rc == 0) g.remaining++;
    }
    free(absent);
    if (sub_rc != 0) {
        /* Nothing of pass 2 was submitted: forget it, then wait for pass 1's rows. */
        for (size_t k = 0; k < c->n_reqs; k += 2) {
            const uint64_t tag = c->reqs[k].tag;
            if (tag & BYPASS_TAG) {
                g.bp_pending[tag & ~BYPASS_TAG] = 0;
                g.remaining--;
            } else if (tag < c->cap) {
                drop_entry(c, (uint32_t)tag);
                g.remaining--;
            }
        }
        c->n_reqs = 0;
    } else {
        const size_t n_sub = c->n_reqs;
        if (submit(c, err) != 0) {
            sub_rc = -1;
            /* submit() dropped the entries; undo the counts of pass 2. */
            g.remaining -= n_sub / 2;
            memset(g.bp_pending, 0, nu);
        }
    }
    const uint64_t w0 = now_ns();
    while (g.remaining > 0) {
        ds41_error werr = {{0}};
        if (drain(c, 1, &werr) != 0) {
            /* The reader itself failed: nothing more will arrive. */
            if (sub_rc == 0) *err = werr;
            for (size_t i = 0; i < c->cap; i++) c->e[i].want = -1; /* no gather waits any more */
            memset(g.bp_pending, 0, nu);
            c->g = NULL;
            sub_rc = -1;
            break;
        }
    }
    c->acc.s.gather_wait_ns += now_ns() - w0;
    c->g = NULL;
    if (sub_rc != 0) goto out;
    if (g.failed) {
        *err = g.first_err;
        goto out;
    }
    rc = 0;
out:
    free(g.order);
    free(g.ustart);
    free(g.bp_pending);
    free(g.bp_failed);
    free(g.bp_t0);
    merge(c);
    return rc;
}

/* ---- life ------------------------------------------------------------------------------- */

static int file_of(ds41_engram_cache *c, uint32_t shard, uint32_t *map, ds41_error *err) {
    if (map[shard] != NONE) return (int)map[shard];
    const char *path = ds41_checkpoint_shard_path(c->ckpt, shard);
    if (!path) return ds41_fail(err, "engram cache: shard %u not in the checkpoint", shard);
    int f = ds41_reader_add_file(c->reader, path, ds41_checkpoint_shard_fd(c->ckpt, shard), err);
    if (f < 0) return -1;
    map[shard] = (uint32_t)f;
    return f;
}

ds41_engram_cache *ds41_engram_cache_new(const ds41_checkpoint *ckpt, const ds41_engram_table_spec *tables,
                                         size_t n_tables, const ds41_engram_cache_opts *opts, ds41_error *err) {
    if (!ckpt || !tables || n_tables == 0 || n_tables > DS41_ENGRAM_CACHE_MAX_TABLES) {
        ds41_fail(err, "engram cache: %zu tables (1..%d)", n_tables, DS41_ENGRAM_CACHE_MAX_TABLES);
        return NULL;
    }
    ds41_engram_cache_opts o = opts ? *opts : (ds41_engram_cache_opts){0};
    ds41_engram_cache *c = calloc(1, sizeof *c);
    uint32_t *map = NULL;
    if (!c) {
        ds41_fail(err, "engram cache: out of memory");
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->ckpt = ckpt;
    c->budget = o.budget_bytes;
    c->halloc = o.host_alloc;
    c->free_list = c->lru = (list){NONE, NONE};
    for (size_t t = 0; t < n_tables; t++) {
        const ds41_tensor *p = tables[t].payload, *s = tables[t].scale;
        if (!p || !s) {
            ds41_fail(err, "engram cache: table %zu: tensor missing", t);
            goto fail;
        }
        const int64_t rows = p->ndim >= 1 ? p->shape[0] : 0;
        if (rows <= 0 || s->ndim < 1 || s->shape[0] != rows || p->nbytes % (uint64_t)rows ||
            s->nbytes % (uint64_t)rows || rows >= ((int64_t)1 << ROW_BITS)) {
            ds41_fail(err, "engram cache: '%s' and '%s' are not tables of the same rows", p->name, s->name);
            goto fail;
        }
        const uint64_t rb = p->nbytes / (uint64_t)rows, sb = s->nbytes / (uint64_t)rows;
        if (rb == 0 || sb == 0 || rb > MAX_ROW_BYTES || sb > MAX_ROW_BYTES) {
            ds41_fail(err, "engram cache: '%s': rows of %llu + %llu bytes (1..%zu each)", p->name,
                      (unsigned long long)rb, (unsigned long long)sb, MAX_ROW_BYTES);
            goto fail;
        }
        if (t > 0 && (rb != c->rb || sb != c->sb)) {
            ds41_fail(err, "engram cache: '%s': rows of %llu + %llu bytes, '%s' has %zu + %zu", p->name,
                      (unsigned long long)rb, (unsigned long long)sb, tables[0].payload->name, c->rb, c->sb);
            goto fail;
        }
        c->rb = (size_t)rb;
        c->sb = (size_t)sb;
        c->tables[t] = (table){.payload = p, .scale = s, .rows = rows};
    }
    c->n_tables = n_tables;

    const size_t n_shards = ds41_checkpoint_shard_count(ckpt);
    map = malloc((n_shards ? n_shards : 1) * sizeof *map);
    if (!map) {
        ds41_fail(err, "engram cache: out of memory");
        goto fail;
    }
    for (size_t i = 0; i < n_shards; i++) map[i] = NONE;
    /* Rows are small: 4 KiB chunks keep each in-flight read's bounce buffer at
     * 12 KiB (a row's unaligned range spans at most two direct-I/O units), so a
     * deep queue costs little memory (1024 reads: 12 MiB). */
    ds41_reader_opts ro = {.queue_depth = o.queue_depth ? o.queue_depth : 1024,
                           .chunk_bytes = 4096,
                           .direct = !o.buffered,
                           .register_buffers = true,
                           .backend = o.backend};
    c->reader = ds41_reader_new(&ro, err);
    if (!c->reader) goto fail;
    for (size_t t = 0; t < n_tables; t++) {
        table *tb = &c->tables[t];
        if (tb->payload->shard >= n_shards || tb->scale->shard >= n_shards) {
            ds41_fail(err, "engram cache: '%s': shard out of range", tb->payload->name);
            goto fail;
        }
        int f = file_of(c, tb->payload->shard, map, err);
        if (f < 0) goto fail;
        tb->file_payload = (uint32_t)f;
        if ((f = file_of(c, tb->scale->shard, map, err)) < 0) goto fail;
        tb->file_scale = (uint32_t)f;
    }

    const uint64_t per = (uint64_t)c->rb + c->sb + DS41_ENGRAM_ENTRY_OVERHEAD;
    uint64_t cap = c->budget / per;
    if (cap > NONE - 1) cap = NONE - 1;
    if (cap > SIZE_MAX / (c->rb + c->sb)) cap = SIZE_MAX / (c->rb + c->sb);
    c->cap = (size_t)cap;
    if (c->cap) {
        uint64_t nb = 1;
        while (nb < cap) nb <<= 1;
        c->bucket_mask = nb - 1;
        c->e = calloc(c->cap, sizeof *c->e);
        c->slab = ds41_host_alloc_get(&c->halloc, c->cap * (c->rb + c->sb));
        c->buckets = malloc(nb * sizeof *c->buckets);
        if (!c->e || !c->slab || !c->buckets) {
            ds41_fail(err, "engram cache: out of memory for %zu entries (budget %llu bytes)", c->cap,
                      (unsigned long long)c->budget);
            goto fail;
        }
        for (uint64_t b = 0; b < nb; b++) c->buckets[b] = NONE;
        for (size_t i = c->cap; i-- > 0;) {
            c->e[i] = (entry){.hnext = NONE, .prev = NONE, .next = NONE, .want = -1};
            list_push_head(c, &c->free_list, (uint32_t)i);
        }
    }
    free(map);
    c->pub.s.budget_bytes = c->budget;
    c->pub.s.capacity = c->cap;
    c->pub.s.row_bytes = c->rb + c->sb;
    return c;
fail:
    free(map);
    ds41_engram_cache_free(c);
    return NULL;
}

void ds41_engram_cache_free(ds41_engram_cache *c) {
    if (!c) return;
    ds41_reader_free(c->reader); /* waits for reads into the slab before it goes */
    free(c->e);
    ds41_host_alloc_put(&c->halloc, c->slab, c->cap * (c->rb + c->sb));
    free(c->buckets);
    free(c->pinned);
    free(c->reqs);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

size_t ds41_engram_cache_capacity(const ds41_engram_cache *c) { return c->cap; }
size_t ds41_engram_cache_row_bytes(const ds41_engram_cache *c) { return c->rb; }
size_t ds41_engram_cache_scale_bytes(const ds41_engram_cache *c) { return c->sb; }
ds41_reader *ds41_engram_cache_reader(ds41_engram_cache *c) { return c->reader; }

void ds41_engram_cache_get_stats(const ds41_engram_cache *c, ds41_engram_cache_stats *out) {
    ds41_engram_cache *m = (ds41_engram_cache *)c; /* the mutex only */
    pthread_mutex_lock(&m->mu);
    *out = c->pub.s;
    out->latency_p50_ns = hist_quantile(c->pub.hist, 0.50);
    out->latency_p99_ns = hist_quantile(c->pub.hist, 0.99);
    pthread_mutex_unlock(&m->mu);
}

void ds41_engram_cache_reset_stats(ds41_engram_cache *c) {
    ds41_reader_stats rs;
    ds41_reader_get_stats(c->reader, &rs);
    pthread_mutex_lock(&c->mu);
    const uint64_t used = c->pub.s.entries_used;
    memset(&c->pub, 0, sizeof c->pub);
    c->pub.s.budget_bytes = c->budget;
    c->pub.s.capacity = c->cap;
    c->pub.s.row_bytes = c->rb + c->sb;
    c->pub.s.entries_used = used;
    c->device_base = rs.bytes_device;
    pthread_mutex_unlock(&c->mu);
}
