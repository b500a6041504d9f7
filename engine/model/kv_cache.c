#include "engine/model/kv_cache.h"

#include "engine/model/quant.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* Pages are carved from chunks that never move, so a page pointer stays
 * valid for the pool's life; a page id is chunk * PAGES_PER_CHUNK + index.
 * Every chunk holds PAGES_PER_CHUNK pages except the last one a budget
 * allows, which holds what is left of it. */
#define PAGES_PER_CHUNK 64u

/* Every byte in chunks, rings and carries is memory of `mem`: it is reached
 * only through mem's calls (engine/backend/memory.h), never dereferenced. */
struct ds41_kv_pool {
    ds41_kv_layout layout;
    const ds41_memory *mem;
    pthread_mutex_t lock;
    size_t ring_bytes;   /* a sequence's rings, as allocated (>= 1) */
    size_t carry_floats; /* a sequence's carries */
    size_t carry_bytes;  /* as allocated (>= 1) */
    float *carry_init;   /* mem: kv 0, score -inf, copied into every new sequence */
    uint8_t **chunks;
    uint32_t n_chunks, cap_chunks;
    uint32_t *refcount; /* per page id */
    uint32_t *free_ids; /* free-list stack */
    uint32_t n_free;
    uint64_t pages_allocated;
    uint64_t pages_in_use;
    uint64_t pages_max; /* 0 = unlimited */
    uint64_t sequences;
};

/* A sequence's undo journal (ds41_kv_seq_journal_begin): what every journaled write overwrote,
 * by the row (position - pos0) that wrote it, so a rewind restores positions newest first.
 * The saved bytes stay in the pool's memory (memory copies, no host round trip). */
typedef struct kv_journal {
    bool active;
    uint64_t pos0;        /* tokens when it began */
    uint32_t rows;        /* rows it can take (max_rows of the begin) */
    uint32_t cap;         /* rows allocated */
    uint8_t *ring_undo;   /* mem: [cap][n_rings][ring_row_bytes] */
    float *carry_undo;    /* mem: [cap][n_carries] kv row then score row, latent_dim each */
    uint8_t *ring_saved;  /* host: [cap][n_rings] flags */
    uint8_t *carry_saved; /* host: [cap][n_carries] flags */
    ds41_engram_history engram0;
    int32_t *engram_ids; /* host: [cap] ids pushed since pos0, in order */
    uint32_t n_engram;
    bool overflow; /* a write beyond `rows`: the journal cannot rewind */
} kv_journal;

typedef struct page_table {
    uint32_t *pages;
    uint32_t n_pages, cap;
    uint64_t n_entries;
} page_table;

struct ds41_kv_seq {
    ds41_kv_pool *pool;
    uint64_t tokens;
    page_table src[DS41_KV_MAX_SOURCES];
    uint8_t *rings; /* mem: [n_rings][window][ring_row_bytes] */
    float *carries; /* mem: per carry: kv [ratio][dim] then score [ratio][dim] */
    size_t carry_floats;
    uint8_t *stage; /* host: one entry or ring row packed before its upload */
    ds41_engram_history engram;
    kv_journal jr;
};

/* ---- pool ------------------------------------------------------------------ */

static uint8_t *page_ptr(const ds41_kv_pool *p, uint32_t id) {
    return p->chunks[id / PAGES_PER_CHUNK] + (size_t)(id % PAGES_PER_CHUNK) * p->layout.page_bytes;
}

static int layout_init(ds41_kv_layout *l, const ds41_model_config *cfg, uint32_t per_page, ds41_error *err) {
    memset(l, 0, sizeof *l);
    if (!cfg->finalized || !cfg->roles) return ds41_fail(err, "kv cache: the model config is not finalized");
    if (cfg->head_dim % 32 != 0 || cfg->index_head_dim % 32 != 0)
        return ds41_fail(err, "kv cache: head_dim and index_head_dim must be multiples of 32");
    l->n_layers = (int)cfg->n_roles;
    l->source_of_layer = malloc(cfg->n_roles * sizeof *l->source_of_layer);
    l->ring_of_layer = malloc(cfg->n_roles * sizeof *l->ring_of_layer);
    if (!l->source_of_layer || !l->ring_of_layer) return ds41_fail(err, "kv cache: out of memory");
    for (size_t i = 0; i < cfg->n_roles; i++) {
        const ds41_layer_role *r = &cfg->roles[i];
        l->ring_of_layer[i] = r->present ? l->n_rings++ : -1;
        if (r->present && r->kv_source) {
            if (l->n_sources == DS41_KV_MAX_SOURCES)
                return ds41_fail(err, "kv cache: more than %d kv source layers", DS41_KV_MAX_SOURCES);
            int s = l->n_sources++;
            l->source_layer[s] = (int)i;
            l->source_ratio[s] = r->ratio;
            l->source_carry[s] = r->ratio > 1 ? l->n_carries++ : -1;
        }
    }
    for (size_t i = 0; i < cfg->n_roles; i++) {
        const ds41_layer_role *r = &cfg->roles[i];
        l->source_of_layer[i] = -1;
        if (!r->present || r->kv_from < 0) continue;
        for (int s = 0; s < l->n_sources; s++)
            if (l->source_layer[s] == r->kv_from) l->source_of_layer[i] = s;
    }
    l->latent_dim = (uint32_t)cfg->head_dim;
    l->index_dim = (uint32_t)cfg->index_head_dim;
    l->latent_bytes = l->latent_dim / 2 + l->latent_dim / DS41_FP4_E4M3_BLOCK;
    l->index_bytes = l->index_dim / 2 + l->index_dim / DS41_QUANT_BLOCK;
    l->entry_bytes = l->latent_bytes + l->index_bytes;
    l->entries_per_page = per_page ? per_page : DS41_KV_DEFAULT_ENTRIES_PER_PAGE;
    l->page_bytes = l->entries_per_page * l->entry_bytes;
    l->window = (uint32_t)cfg->window_size;
    l->ring_row_bytes = l->latent_dim + l->latent_dim / DS41_QUANT_BLOCK;
    return 0;
}

/* The initial carries of every sequence (kv_state 0, score_state -inf),
 * built once on the host and uploaded: a new sequence copies them inside the
 * pool's memory. */
static int carry_init(ds41_kv_pool *p) {
    const ds41_kv_layout *l = &p->layout;
    p->carry_init = p->mem->alloc(p->mem, p->carry_bytes);
    float *host = calloc(p->carry_bytes / sizeof(float), sizeof(float));
    if (!p->carry_init || !host) {
        free(host);
        return -1;
    }
    float *c = host;
    for (int src = 0; src < l->n_sources; src++) {
        if (l->source_carry[src] < 0) continue;
        size_t n = (size_t)l->source_ratio[src] * l->latent_dim;
        for (size_t i = 0; i < n; i++) c[n + i] = -INFINITY; /* kv_state stays 0 */
        c += 2 * n;
    }
    p->mem->upload(p->mem, p->carry_init, host, p->carry_bytes);
    free(host);
    return 0;
}

ds41_kv_pool *ds41_kv_pool_new_in(const ds41_memory *mem, const ds41_model_config *cfg, uint64_t budget_bytes,
                                  uint32_t entries_per_page, ds41_error *err) {
    ds41_kv_pool *p = calloc(1, sizeof *p);
    if (!p) {
        ds41_fail(err, "kv cache: out of memory");
        return NULL;
    }
    p->mem = mem;
    pthread_mutex_init(&p->lock, NULL);
    if (layout_init(&p->layout, cfg, entries_per_page, err) != 0) {
        ds41_kv_pool_free(p);
        return NULL;
    }
    p->pages_max = budget_bytes ? budget_bytes / p->layout.page_bytes : 0;
    if (budget_bytes && p->pages_max == 0) {
        ds41_fail(err, "kv cache: budget %llu bytes is below one page (%u bytes)",
                  (unsigned long long)budget_bytes, p->layout.page_bytes);
        ds41_kv_pool_free(p);
        return NULL;
    }
    const ds41_kv_layout *l = &p->layout;
    p->ring_bytes = (size_t)l->n_rings * l->window * l->ring_row_bytes;
    if (p->ring_bytes == 0) p->ring_bytes = 1; /* alloc takes n >= 1 */
    for (int src = 0; src < l->n_sources; src++)
        if (l->source_carry[src] >= 0) p->carry_floats += 2 * (size_t)l->source_ratio[src] * l->latent_dim;
    p->carry_bytes = (p->carry_floats ? p->carry_floats : 1) * sizeof(float);
    if (carry_init(p) != 0) {
        ds41_fail(err, "kv cache: out of memory");
        ds41_kv_pool_free(p);
        return NULL;
    }
    return p;
}

ds41_kv_pool *ds41_kv_pool_new(const ds41_model_config *cfg, uint64_t budget_bytes, uint32_t entries_per_page,
                               ds41_error *err) {
    return ds41_kv_pool_new_in(&ds41_memory_host, cfg, budget_bytes, entries_per_page, err);
}

const ds41_memory *ds41_kv_pool_memory(const ds41_kv_pool *p) {
    return p->mem;
}

/* Pages in chunk i (only the last one may be short). */
static uint64_t chunk_pages(const ds41_kv_pool *p, uint32_t i) {
    return i + 1 < p->n_chunks ? PAGES_PER_CHUNK : p->pages_allocated - (uint64_t)i * PAGES_PER_CHUNK;
}

void ds41_kv_pool_free(ds41_kv_pool *p) {
    if (!p) return;
    for (uint32_t i = 0; i < p->n_chunks; i++)
        p->mem->free(p->mem, p->chunks[i], (size_t)chunk_pages(p, i) * p->layout.page_bytes);
    if (p->carry_init) p->mem->free(p->mem, p->carry_init, p->carry_bytes);
    free(p->chunks);
    free(p->refcount);
    free(p->free_ids);
    free(p->layout.source_of_layer);
    free(p->layout.ring_of_layer);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

const ds41_kv_layout *ds41_kv_pool_layout(const ds41_kv_pool *p) {
    return &p->layout;
}

void ds41_kv_pool_get_stats(ds41_kv_pool *p, ds41_kv_pool_stats *out) {
    pthread_mutex_lock(&p->lock);
    out->page_bytes = p->layout.page_bytes;
    out->pages_in_use = p->pages_in_use;
    out->pages_allocated = p->pages_allocated;
    out->pages_max = p->pages_max;
    out->bytes_in_use = p->pages_in_use * p->layout.page_bytes;
    out->sequences = p->sequences;
    pthread_mutex_unlock(&p->lock);
}

/* Add one chunk of pages to the free list.  Called with the lock held. */
static int pool_grow(ds41_kv_pool *p) {
    if (p->n_chunks == p->cap_chunks) {
        uint32_t cap = p->cap_chunks ? p->cap_chunks * 2 : 16;
        uint8_t **c = realloc(p->chunks, cap * sizeof *c);
        if (!c) return -1;
        p->chunks = c;
        uint32_t *rc = realloc(p->refcount, (size_t)cap * PAGES_PER_CHUNK * sizeof *rc);
        if (!rc) return -1;
        p->refcount = rc;
        uint32_t *fl = realloc(p->free_ids, (size_t)cap * PAGES_PER_CHUNK * sizeof *fl);
        if (!fl) return -1;
        p->free_ids = fl;
        p->cap_chunks = cap;
    }
    uint64_t n = PAGES_PER_CHUNK;
    if (p->pages_max && p->pages_allocated + n > p->pages_max) n = p->pages_max - p->pages_allocated;
    if (n == 0) return -1;
    uint8_t *mem = p->mem->alloc(p->mem, (size_t)n * p->layout.page_bytes);
    if (!mem) return -1;
    uint32_t chunk = p->n_chunks++;
    p->chunks[chunk] = mem;
    /* Push in reverse so pages are handed out in ascending id order. */
    for (uint64_t i = n; i-- > 0;) {
        uint32_t id = chunk * PAGES_PER_CHUNK + (uint32_t)i;
        p->refcount[id] = 0;
        p->free_ids[p->n_free++] = id;
    }
    p->pages_allocated += n;
    return 0;
}

static int page_alloc(ds41_kv_pool *p, uint32_t *id) {
    pthread_mutex_lock(&p->lock);
    if (p->n_free == 0 && pool_grow(p) != 0) {
        pthread_mutex_unlock(&p->lock);
        return -1;
    }
    *id = p->free_ids[--p->n_free];
    p->refcount[*id] = 1;
    p->pages_in_use++;
    pthread_mutex_unlock(&p->lock);
    return 0;
}

static void page_ref(ds41_kv_pool *p, uint32_t id) {
    pthread_mutex_lock(&p->lock);
    p->refcount[id]++;
    pthread_mutex_unlock(&p->lock);
}

static void page_unref(ds41_kv_pool *p, uint32_t id) {
    pthread_mutex_lock(&p->lock);
    if (--p->refcount[id] == 0) {
        p->free_ids[p->n_free++] = id;
        p->pages_in_use--;
    }
    pthread_mutex_unlock(&p->lock);
}

static uint32_t page_refcount(ds41_kv_pool *p, uint32_t id) {
    pthread_mutex_lock(&p->lock);
    uint32_t rc = p->refcount[id];
    pthread_mutex_unlock(&p->lock);
    return rc;
}

/* ---- sequences ------------------------------------------------------------- */

static void journal_free(ds41_kv_seq *s);

static void seq_release(ds41_kv_seq *s) {
    const ds41_memory *m = s->pool->mem;
    journal_free(s);
    if (s->rings) m->free(m, s->rings, s->pool->ring_bytes);
    if (s->carries) m->free(m, s->carries, s->pool->carry_bytes);
    free(s->stage);
    free(s);
}

/* A sequence with empty rings (alloc zeroes them) and carries to be filled
 * by the caller. */
static ds41_kv_seq *seq_alloc(ds41_kv_pool *pool, ds41_error *err) {
    const ds41_kv_layout *l = &pool->layout;
    const ds41_memory *m = pool->mem;
    ds41_kv_seq *s = calloc(1, sizeof *s);
    if (!s) goto oom;
    s->pool = pool;
    s->carry_floats = pool->carry_floats;
    s->rings = m->alloc(m, pool->ring_bytes);
    s->carries = m->alloc(m, pool->carry_bytes);
    s->stage = malloc(l->entry_bytes > l->ring_row_bytes ? l->entry_bytes : l->ring_row_bytes);
    if (!s->rings || !s->carries || !s->stage) goto oom;
    pthread_mutex_lock(&pool->lock);
    pool->sequences++;
    pthread_mutex_unlock(&pool->lock);
    return s;
oom:
    if (s) seq_release(s);
    ds41_fail(err, "kv cache: out of memory for a new sequence");
    return NULL;
}

/* Page-table entries a new sequence starts with: its first pages are taken
 * inside a forward step, which should not allocate (issue 14). */
#define FIRST_PAGES 8

ds41_kv_seq *ds41_kv_seq_new(ds41_kv_pool *pool, ds41_error *err) {
    ds41_kv_seq *s = seq_alloc(pool, err);
    if (!s) return NULL;
    for (int src = 0; src < pool->layout.n_sources; src++) {
        s->src[src].pages = malloc(FIRST_PAGES * sizeof *s->src[src].pages);
        if (!s->src[src].pages) {
            ds41_kv_seq_free(s);
            ds41_fail(err, "kv cache: out of memory for a new sequence");
            return NULL;
        }
        s->src[src].cap = FIRST_PAGES;
    }
    pool->mem->copy(pool->mem, s->carries, pool->carry_init, pool->carry_bytes);
    ds41_engram_history_init(&s->engram);
    return s;
}

ds41_kv_seq *ds41_kv_seq_fork(const ds41_kv_seq *from, ds41_error *err) {
    ds41_kv_pool *pool = from->pool;
    const ds41_kv_layout *l = &pool->layout;
    ds41_kv_seq *s = seq_alloc(pool, err);
    if (!s) return NULL;
    s->tokens = from->tokens;
    pool->mem->copy(pool->mem, s->rings, from->rings, pool->ring_bytes);
    pool->mem->copy(pool->mem, s->carries, from->carries, pool->carry_bytes);
    s->engram = from->engram;
    for (int src = 0; src < l->n_sources; src++) {
        const page_table *ft = &from->src[src];
        page_table *t = &s->src[src];
        if (ft->n_pages) {
            t->pages = malloc(ft->n_pages * sizeof *t->pages);
            if (!t->pages) {
                ds41_kv_seq_free(s);
                ds41_fail(err, "kv cache: out of memory forking a sequence");
                return NULL;
            }
            t->cap = ft->n_pages;
            for (uint32_t i = 0; i < ft->n_pages; i++) {
                t->pages[i] = ft->pages[i];
                page_ref(pool, ft->pages[i]);
            }
            t->n_pages = ft->n_pages;
        }
        t->n_entries = ft->n_entries;
    }
    return s;
}

void ds41_kv_seq_free(ds41_kv_seq *s) {
    if (!s) return;
    const ds41_kv_layout *l = &s->pool->layout;
    for (int src = 0; src < l->n_sources; src++) {
        for (uint32_t i = 0; i < s->src[src].n_pages; i++) page_unref(s->pool, s->src[src].pages[i]);
        free(s->src[src].pages);
    }
    pthread_mutex_lock(&s->pool->lock);
    s->pool->sequences--;
    pthread_mutex_unlock(&s->pool->lock);
    seq_release(s);
}

ds41_kv_pool *ds41_kv_seq_pool(const ds41_kv_seq *s) {
    return s->pool;
}

uint64_t ds41_kv_seq_tokens(const ds41_kv_seq *s) {
    return s->tokens;
}

void ds41_kv_seq_set_tokens(ds41_kv_seq *s, uint64_t n) {
    s->tokens = n;
}

uint64_t ds41_kv_seq_entries(const ds41_kv_seq *s, int source) {
    return s->src[source].n_entries;
}

void ds41_kv_pack_entry(const ds41_kv_layout *l, const float *latent, const float *index_key, uint8_t *e) {
    ds41_fp4_act_quant_e4m3(latent, l->latent_dim, e, e + l->latent_dim / 2);
    uint8_t *k = e + l->latent_bytes;
    ds41_fp4_act_quant_ue8m0(index_key, l->index_dim, k, k + l->index_dim / 2);
}

/* The next entry's bytes of a source (a fresh page, or the last one, copied
 * first when a fork shares it); the caller fills them and counts the entry. */
static uint8_t *append_slot(ds41_kv_seq *s, int source, ds41_error *err) {
    ds41_kv_pool *p = s->pool;
    const ds41_kv_layout *l = &p->layout;
    page_table *t = &s->src[source];
    uint32_t slot = (uint32_t)(t->n_entries % l->entries_per_page);
    uint32_t id;
    if (slot == 0) {
        /* A fresh page. */
        if (t->n_pages == t->cap) {
            uint32_t cap = t->cap ? t->cap * 2 : FIRST_PAGES;
            uint32_t *np = realloc(t->pages, cap * sizeof *np);
            if (!np) {
                ds41_fail(err, "kv cache: out of memory");
                return NULL;
            }
            t->pages = np;
            t->cap = cap;
        }
        if (page_alloc(p, &id) != 0) {
            ds41_fail(err, "KV cache full (%llu pages of %u bytes)", (unsigned long long)p->pages_max,
                      l->page_bytes);
            return NULL;
        }
        t->pages[t->n_pages++] = id;
    } else {
        id = t->pages[t->n_pages - 1];
        if (page_refcount(p, id) > 1) {
            /* Shared with a fork: copy before writing. */
            uint32_t copy;
            if (page_alloc(p, &copy) != 0) {
                ds41_fail(err, "KV cache full (%llu pages of %u bytes)", (unsigned long long)p->pages_max,
                          l->page_bytes);
                return NULL;
            }
            p->mem->copy(p->mem, page_ptr(p, copy), page_ptr(p, id), (size_t)slot * l->entry_bytes);
            page_unref(p, id);
            t->pages[t->n_pages - 1] = copy;
            id = copy;
        }
    }
    return page_ptr(p, id) + (size_t)slot * l->entry_bytes;
}

int ds41_kv_seq_append(ds41_kv_seq *s, int source, const float *latent, const float *index_key,
                       ds41_error *err) {
    uint8_t *e = append_slot(s, source, err);
    if (!e) return -1;
    ds41_kv_pack_entry(&s->pool->layout, latent, index_key, s->stage);
    s->pool->mem->upload(s->pool->mem, e, s->stage, s->pool->layout.entry_bytes);
    s->src[source].n_entries++;
    return 0;
}

int ds41_kv_seq_append_packed(ds41_kv_seq *s, int source, const uint8_t *entry, ds41_error *err) {
    uint8_t *e = append_slot(s, source, err);
    if (!e) return -1;
    s->pool->mem->copy(s->pool->mem, e, entry, s->pool->layout.entry_bytes);
    s->src[source].n_entries++;
    return 0;
}

const uint32_t *ds41_kv_seq_page_ids(const ds41_kv_seq *s, int source, uint32_t *n_pages) {
    *n_pages = s->src[source].n_pages;
    return s->src[source].pages;
}

const uint8_t *ds41_kv_pool_page(const ds41_kv_pool *pool, uint32_t id) {
    return page_ptr(pool, id);
}

const uint8_t *ds41_kv_seq_entry(const ds41_kv_seq *s, int source, uint64_t entry) {
    const ds41_kv_layout *l = &s->pool->layout;
    uint32_t id = s->src[source].pages[entry / l->entries_per_page];
    return page_ptr(s->pool, id) + (size_t)(entry % l->entries_per_page) * l->entry_bytes;
}

void ds41_kv_seq_read_entry(const ds41_kv_seq *s, int source, uint64_t entry, uint8_t *out) {
    const ds41_memory *m = s->pool->mem;
    m->download(m, out, ds41_kv_seq_entry(s, source, entry), s->pool->layout.entry_bytes);
}

void ds41_kv_decode_latent(const ds41_kv_layout *l, const uint8_t *e, float *out) {
    ds41_dequant_fp4_e4m3_1x16(e, e + l->latent_dim / 2, l->latent_dim, out);
}

void ds41_kv_decode_index_key(const ds41_kv_layout *l, const uint8_t *e, float *out) {
    const uint8_t *k = e + l->latent_bytes;
    for (uint32_t i = 0; i < l->index_dim; i++) {
        uint8_t code = (uint8_t)((k[i / 2] >> ((i & 1) * 4)) & 15);
        out[i] = ds41_e2m1_to_f32(code) * ds41_ue8m0_to_f32(k[l->index_dim / 2 + i / 32]);
    }
}

static uint8_t *ring_row(const ds41_kv_seq *s, int layer, uint32_t slot) {
    const ds41_kv_layout *l = &s->pool->layout;
    int r = l->ring_of_layer[layer];
    return s->rings + ((size_t)r * l->window + slot) * l->ring_row_bytes;
}

/* ---- journal ----------------------------------------------------------------- */

static float *carry(const ds41_kv_seq *s, int source, int which);

/* The journal row of a write at pos, or -1 when nothing is journaled (inactive) or the
 * position is outside what it can take (then it overflows: a rewind fails). */
static int64_t journal_row(ds41_kv_seq *s, uint64_t pos) {
    kv_journal *j = &s->jr;
    if (!j->active) return -1;
    if (pos < j->pos0 || pos - j->pos0 >= j->rows) {
        j->overflow = true;
        return -1;
    }
    return (int64_t)(pos - j->pos0);
}

static void journal_ring(ds41_kv_seq *s, int layer, uint64_t pos) {
    const int64_t row = journal_row(s, pos);
    if (row < 0) return;
    const ds41_kv_layout *l = &s->pool->layout;
    const int r = l->ring_of_layer[layer];
    uint8_t *flag = &s->jr.ring_saved[(size_t)row * l->n_rings + r];
    if (*flag) return; /* the first write of the row holds what was there before it */
    s->pool->mem->copy(s->pool->mem, s->jr.ring_undo + ((size_t)row * l->n_rings + r) * l->ring_row_bytes,
                       ring_row(s, layer, (uint32_t)(pos % l->window)), l->ring_row_bytes);
    *flag = 1;
}

static void journal_free(ds41_kv_seq *s) {
    const ds41_memory *m = s->pool->mem;
    const ds41_kv_layout *l = &s->pool->layout;
    kv_journal *j = &s->jr;
    if (j->ring_undo) m->free(m, j->ring_undo, (size_t)j->cap * l->n_rings * l->ring_row_bytes);
    if (j->carry_undo)
        m->free(m, j->carry_undo, (size_t)j->cap * l->n_carries * 2 * l->latent_dim * sizeof(float));
    free(j->ring_saved);
    free(j->carry_saved);
    free(j->engram_ids);
    memset(j, 0, sizeof *j);
}

int ds41_kv_seq_journal_begin(ds41_kv_seq *s, uint32_t max_rows, ds41_error *err) {
    const ds41_kv_layout *l = &s->pool->layout;
    const ds41_memory *m = s->pool->mem;
    if (max_rows == 0) return ds41_fail(err, "kv journal: max_rows is 0");
    if (s->jr.active) return ds41_fail(err, "kv journal: already active");
    if (s->jr.cap < max_rows) {
        journal_free(s);
        kv_journal *j = &s->jr;
        const size_t rb = (size_t)max_rows * l->n_rings * l->ring_row_bytes;
        const size_t cb = (size_t)max_rows * l->n_carries * 2 * l->latent_dim * sizeof(float);
        j->ring_undo = rb ? m->alloc(m, rb) : NULL;
        j->carry_undo = cb ? m->alloc(m, cb) : NULL;
        j->ring_saved = calloc((size_t)max_rows * (l->n_rings ? l->n_rings : 1), 1);
        j->carry_saved = calloc((size_t)max_rows * (l->n_carries ? l->n_carries : 1), 1);
        j->engram_ids = malloc((size_t)max_rows * sizeof *j->engram_ids);
        j->cap = max_rows;
        if ((rb && !j->ring_undo) || (cb && !j->carry_undo) || !j->ring_saved || !j->carry_saved ||
            !j->engram_ids) {
            journal_free(s);
            return ds41_fail(err, "kv journal: out of memory for %u rows", max_rows);
        }
    } else {
        memset(s->jr.ring_saved, 0, (size_t)s->jr.cap * (l->n_rings ? l->n_rings : 1));
        memset(s->jr.carry_saved, 0, (size_t)s->jr.cap * (l->n_carries ? l->n_carries : 1));
    }
    s->jr.active = true;
    s->jr.overflow = false;
    s->jr.pos0 = s->tokens;
    s->jr.rows = max_rows;
    s->jr.engram0 = s->engram;
    s->jr.n_engram = 0;
    return 0;
}

bool ds41_kv_seq_journal_active(const ds41_kv_seq *s) {
    return s->jr.active;
}

uint64_t ds41_kv_seq_journal_room(const ds41_kv_seq *s) {
    if (!s->jr.active) return UINT64_MAX;
    const uint64_t used = s->tokens - s->jr.pos0;
    return used >= s->jr.rows ? 0 : s->jr.rows - used;
}

void ds41_kv_seq_journal_end(ds41_kv_seq *s) {
    s->jr.active = false;
}

int ds41_kv_seq_rewind(ds41_kv_seq *s, uint64_t tokens, ds41_error *err) {
    ds41_kv_pool *p = s->pool;
    const ds41_kv_layout *l = &p->layout;
    const ds41_memory *m = p->mem;
    kv_journal *j = &s->jr;
    if (!j->active) return ds41_fail(err, "kv journal: rewind without a journal");
    if (j->overflow)
        return ds41_fail(err, "kv journal: more than %u rows were written, cannot rewind", j->rows);
    if (tokens < j->pos0 || tokens > s->tokens)
        return ds41_fail(err, "kv journal: rewind to %llu tokens outside [%llu, %llu]",
                         (unsigned long long)tokens, (unsigned long long)j->pos0,
                         (unsigned long long)s->tokens);
    /* Newest position first: each saved row holds what its position's write overwrote. */
    for (uint64_t row = s->tokens - j->pos0; row-- > tokens - j->pos0;) {
        const uint64_t pos = j->pos0 + row;
        for (int r = 0; r < l->n_rings; r++) {
            uint8_t *flag = &j->ring_saved[row * l->n_rings + r];
            if (!*flag) continue;
            m->copy(m, s->rings + ((size_t)r * l->window + pos % l->window) * l->ring_row_bytes,
                    j->ring_undo + (row * l->n_rings + r) * l->ring_row_bytes, l->ring_row_bytes);
            *flag = 0;
        }
        for (int src = 0; src < l->n_sources; src++) {
            const int c = l->source_carry[src];
            if (c < 0) continue;
            uint8_t *flag = &j->carry_saved[row * l->n_carries + c];
            if (!*flag) continue;
            const size_t hd = l->latent_dim, slot = pos % (uint64_t)l->source_ratio[src];
            const float *undo = j->carry_undo + (row * l->n_carries + c) * 2 * hd;
            m->copy(m, carry(s, src, 0) + slot * hd, undo, hd * sizeof(float));
            m->copy(m, carry(s, src, 1) + slot * hd, undo + hd, hd * sizeof(float));
            *flag = 0;
        }
    }
    /* Compressed entries: a source holds tokens / ratio of them; pages past them go back. */
    for (int src = 0; src < l->n_sources; src++) {
        page_table *t = &s->src[src];
        const uint64_t keep = tokens / (uint64_t)l->source_ratio[src];
        if (keep >= t->n_entries) continue;
        t->n_entries = keep;
        const uint32_t pages = (uint32_t)((keep + l->entries_per_page - 1) / l->entries_per_page);
        while (t->n_pages > pages) page_unref(p, t->pages[--t->n_pages]);
    }
    /* The Engram history: the one at pos0 with the kept pushes replayed (they succeeded once). */
    const uint64_t kept = tokens - j->pos0;
    if (kept < j->n_engram) {
        ds41_engram_history h = j->engram0;
        for (uint64_t i = 0; i < kept; i++)
            if (ds41_engram_history_push(&h, j->engram_ids[i], err) != 0) return -1;
        s->engram = h;
        j->n_engram = (uint32_t)kept;
    }
    s->tokens = tokens;
    return 0;
}

int ds41_kv_seq_engram_push(ds41_kv_seq *s, int32_t compressed_id_or_dead, ds41_error *err) {
    kv_journal *j = &s->jr;
    if (j->active) {
        if (j->n_engram >= j->rows) {
            j->overflow = true;
        } else {
            j->engram_ids[j->n_engram++] = compressed_id_or_dead;
        }
    }
    return ds41_engram_history_push(&s->engram, compressed_id_or_dead, err);
}

void ds41_kv_ring_write(ds41_kv_seq *s, int layer, uint64_t pos, const float *kv) {
    const ds41_kv_layout *l = &s->pool->layout;
    journal_ring(s, layer, pos);
    ds41_act_quant(kv, l->latent_dim, s->stage, s->stage + l->latent_dim);
    s->pool->mem->upload(s->pool->mem, ring_row(s, layer, (uint32_t)(pos % l->window)), s->stage,
                         l->ring_row_bytes);
}

void ds41_kv_ring_put(ds41_kv_seq *s, int layer, uint64_t pos, const uint8_t *row) {
    const ds41_kv_layout *l = &s->pool->layout;
    journal_ring(s, layer, pos);
    s->pool->mem->copy(s->pool->mem, ring_row(s, layer, (uint32_t)(pos % l->window)), row, l->ring_row_bytes);
}

const uint8_t *ds41_kv_ring_row(const ds41_kv_seq *s, int layer, uint32_t slot) {
    return ring_row(s, layer, slot);
}

void ds41_kv_ring_read_row(const ds41_kv_seq *s, int layer, uint32_t slot, uint8_t *out) {
    const ds41_memory *m = s->pool->mem;
    m->download(m, out, ring_row(s, layer, slot), s->pool->layout.ring_row_bytes);
}

void ds41_kv_decode_ring_row(const ds41_kv_layout *l, const uint8_t *row, float *out) {
    for (uint32_t i = 0; i < l->latent_dim; i++)
        out[i] = ds41_bf16_round(ds41_e4m3_to_f32(row[i]) * ds41_ue8m0_to_f32(row[l->latent_dim + i / 32]));
}

static float *carry(const ds41_kv_seq *s, int source, int which) {
    const ds41_kv_layout *l = &s->pool->layout;
    if (l->source_carry[source] < 0) return NULL;
    float *c = s->carries;
    for (int src = 0; src < source; src++)
        if (l->source_carry[src] >= 0) c += 2 * (size_t)l->source_ratio[src] * l->latent_dim;
    return c + (size_t)which * l->source_ratio[source] * l->latent_dim;
}

void ds41_kv_carry_put(ds41_kv_seq *s, int source, uint64_t pos, const float *kv, const float *score) {
    const ds41_kv_layout *l = &s->pool->layout;
    const ds41_memory *m = s->pool->mem;
    const int c = l->source_carry[source];
    if (c < 0) return;
    const size_t hd = l->latent_dim, slot = pos % (uint64_t)l->source_ratio[source];
    float *ckv = carry(s, source, 0) + slot * hd, *csc = carry(s, source, 1) + slot * hd;
    const int64_t row = journal_row(s, pos);
    if (row >= 0 && !s->jr.carry_saved[(size_t)row * l->n_carries + c]) {
        float *undo = s->jr.carry_undo + ((size_t)row * l->n_carries + c) * 2 * hd;
        m->copy(m, undo, ckv, hd * sizeof(float));
        m->copy(m, undo + hd, csc, hd * sizeof(float));
        s->jr.carry_saved[(size_t)row * l->n_carries + c] = 1;
    }
    m->copy(m, ckv, kv, hd * sizeof(float));
    m->copy(m, csc, score, hd * sizeof(float));
}

float *ds41_kv_carry_kv(ds41_kv_seq *s, int source) {
    return carry(s, source, 0);
}

float *ds41_kv_carry_score(ds41_kv_seq *s, int source) {
    return carry(s, source, 1);
}

int ds41_kv_carry_read(const ds41_kv_seq *s, int source, float *kv, float *score) {
    const ds41_kv_layout *l = &s->pool->layout;
    const ds41_memory *m = s->pool->mem;
    if (l->source_carry[source] < 0) return -1;
    const size_t n = (size_t)l->source_ratio[source] * l->latent_dim * sizeof(float);
    if (kv) m->download(m, kv, carry(s, source, 0), n);
    if (score) m->download(m, score, carry(s, source, 1), n);
    return 0;
}

ds41_engram_history *ds41_kv_seq_engram(ds41_kv_seq *s) {
    return &s->engram;
}

uint64_t ds41_kv_seq_pages(const ds41_kv_seq *s) {
    uint64_t n = 0;
    for (int src = 0; src < s->pool->layout.n_sources; src++) n += s->src[src].n_pages;
    return n;
}

uint64_t ds41_kv_seq_page_bytes(const ds41_kv_seq *s) {
    return ds41_kv_seq_pages(s) * s->pool->layout.page_bytes;
}

uint64_t ds41_kv_pages_for_tokens(const ds41_kv_layout *l, uint64_t tokens) {
    uint64_t n = 0;
    for (int src = 0; src < l->n_sources; src++) {
        const uint64_t entries = tokens / (uint64_t)l->source_ratio[src];
        n += (entries + l->entries_per_page - 1) / l->entries_per_page;
    }
    return n;
}

uint64_t ds41_kv_seq_pages_to_grow(const ds41_kv_seq *s, uint64_t n_tokens) {
    const ds41_kv_layout *l = &s->pool->layout;
    const uint64_t epp = l->entries_per_page, p1 = s->tokens + n_tokens;
    uint64_t need = 0;
    for (int src = 0; src < l->n_sources; src++) {
        const page_table *t = &s->src[src];
        const uint64_t e0 = t->n_entries, e1 = p1 / (uint64_t)l->source_ratio[src];
        if (e1 <= e0) continue;
        need += (e1 + epp - 1) / epp - (e0 + epp - 1) / epp;
        /* the first append to a partly filled page shared with a fork copies it */
        if (e0 % epp != 0 && t->n_pages && page_refcount(s->pool, t->pages[t->n_pages - 1]) > 1) need++;
    }
    return need;
}

uint64_t ds41_kv_seq_state_bytes(const ds41_kv_seq *s) {
    const ds41_kv_layout *l = &s->pool->layout;
    return (uint64_t)l->n_rings * l->window * l->ring_row_bytes + s->carry_floats * sizeof(float) +
           sizeof(ds41_engram_history);
}

/* ---- serialization ----------------------------------------------------------- */

#define KV_SNAP_MAGIC "DS41KVSQ"
#define KV_SNAP_VERSION 1u
#define KV_SNAP_MAX_TOKENS (1ull << 40) /* far beyond any context; keeps every size product small */

static void put_u32(uint8_t **p, uint32_t v) {
    for (int i = 0; i < 4; i++) *(*p)++ = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t **p, uint64_t v) {
    for (int i = 0; i < 8; i++) *(*p)++ = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static size_t kv_snap_header_bytes(const ds41_kv_layout *l) {
    return 8 + 4 + 8 * 4 + (size_t)l->n_sources * 4 + 8 + (size_t)l->n_sources * 8;
}

static size_t kv_snap_ring_bytes(const ds41_kv_layout *l) {
    return (size_t)l->n_rings * l->window * l->ring_row_bytes;
}

#define KV_SNAP_ENGRAM_BYTES (8 + 4 * DS41_ENGRAM_MAX_NGRAM)

size_t ds41_kv_seq_serialized_size(const ds41_kv_seq *s) {
    const ds41_kv_layout *l = &s->pool->layout;
    size_t n = kv_snap_header_bytes(l);
    for (int src = 0; src < l->n_sources; src++) n += (size_t)s->src[src].n_entries * l->entry_bytes;
    return n + kv_snap_ring_bytes(l) + s->carry_floats * 4 + KV_SNAP_ENGRAM_BYTES;
}

uint64_t ds41_kv_serialized_size_for(const ds41_kv_layout *l, uint64_t tokens) {
    if (tokens > KV_SNAP_MAX_TOKENS) tokens = KV_SNAP_MAX_TOKENS;
    uint64_t n = kv_snap_header_bytes(l) + kv_snap_ring_bytes(l) + KV_SNAP_ENGRAM_BYTES;
    for (int src = 0; src < l->n_sources; src++) {
        n += tokens / (uint64_t)l->source_ratio[src] * l->entry_bytes;
        if (l->source_carry[src] >= 0) n += 2ull * (uint64_t)l->source_ratio[src] * l->latent_dim * 4;
    }
    return n;
}

int ds41_kv_seq_serialize(const ds41_kv_seq *s, uint8_t *buf, size_t cap, size_t *written, ds41_error *err) {
    const ds41_kv_layout *l = &s->pool->layout;
    size_t need = ds41_kv_seq_serialized_size(s);
    if (written) *written = 0;
    if (!buf || cap < need) return ds41_fail(err, "kv snapshot: buffer of %zu bytes, %zu needed", cap, need);
    uint8_t *p = buf;
    memcpy(p, KV_SNAP_MAGIC, 8);
    p += 8;
    put_u32(&p, KV_SNAP_VERSION);
    put_u32(&p, (uint32_t)l->n_sources);
    put_u32(&p, (uint32_t)l->n_rings);
    put_u32(&p, (uint32_t)l->n_carries);
    put_u32(&p, l->latent_dim);
    put_u32(&p, l->index_dim);
    put_u32(&p, l->window);
    put_u32(&p, l->entry_bytes);
    put_u32(&p, l->ring_row_bytes);
    for (int src = 0; src < l->n_sources; src++) put_u32(&p, (uint32_t)l->source_ratio[src]);
    put_u64(&p, s->tokens);
    for (int src = 0; src < l->n_sources; src++) put_u64(&p, s->src[src].n_entries);
    const ds41_memory *m = s->pool->mem;
    for (int src = 0; src < l->n_sources; src++) {
        const page_table *t = &s->src[src];
        for (uint64_t e = 0; e < t->n_entries; e += l->entries_per_page) {
            uint64_t k = t->n_entries - e < l->entries_per_page ? t->n_entries - e : l->entries_per_page;
            m->download(m, p, page_ptr(s->pool, t->pages[e / l->entries_per_page]),
                        (size_t)k * l->entry_bytes);
            p += (size_t)k * l->entry_bytes;
        }
    }
    if (kv_snap_ring_bytes(l)) m->download(m, p, s->rings, kv_snap_ring_bytes(l));
    p += kv_snap_ring_bytes(l);
    /* The carries' host floats, then each rewritten in place as its
     * little-endian bit pattern (a no-op on a little-endian host). */
    if (s->carry_floats) m->download(m, p, s->carries, s->carry_floats * sizeof(float));
    for (size_t i = 0; i < s->carry_floats; i++) {
        uint32_t bits;
        memcpy(&bits, p, 4);
        put_u32(&p, bits);
    }
    put_u64(&p, (uint64_t)s->engram.n_pushed);
    for (int k = 0; k < DS41_ENGRAM_MAX_NGRAM; k++) put_u32(&p, (uint32_t)s->engram.recent[k]);
    if (written) *written = (size_t)(p - buf);
    return 0;
}

static bool e4m3_is_nan(uint8_t b) {
    return (b & 0x7F) == 0x7F;
}

/* A packed compressed entry must decode to finite values only.  The NaN
 * encodings get their own message; beyond them, a ue8m0 scale near 2^127
 * times a large code overflows float, which the quantizer never writes, so
 * the values are decoded with the engine's own decoders and checked.  out:
 * room for max(latent_dim, index_dim) floats. */
static int check_entry(const ds41_kv_layout *l, const uint8_t *e, int src, uint64_t i, float *out,
                       ds41_error *err) {
    for (uint32_t k = 0; k < l->latent_dim / DS41_FP4_E4M3_BLOCK; k++)
        if (e4m3_is_nan(e[l->latent_dim / 2 + k]))
            return ds41_fail(err, "kv snapshot: source %d entry %llu: latent scale %u is NaN", src,
                             (unsigned long long)i, k);
    const uint8_t *key = e + l->latent_bytes;
    for (uint32_t k = 0; k < l->index_dim / DS41_QUANT_BLOCK; k++)
        if (key[l->index_dim / 2 + k] == 0xFF)
            return ds41_fail(err, "kv snapshot: source %d entry %llu: index-key scale %u is NaN", src,
                             (unsigned long long)i, k);
    ds41_kv_decode_latent(l, e, out);
    for (uint32_t k = 0; k < l->latent_dim; k++)
        if (!isfinite(out[k]))
            return ds41_fail(err, "kv snapshot: source %d entry %llu: latent value %u overflows", src,
                             (unsigned long long)i, k);
    ds41_kv_decode_index_key(l, e, out);
    for (uint32_t k = 0; k < l->index_dim; k++)
        if (!isfinite(out[k]))
            return ds41_fail(err, "kv snapshot: source %d entry %llu: index-key value %u overflows", src,
                             (unsigned long long)i, k);
    return 0;
}

/* A written ring row: likewise, through ds41_kv_decode_ring_row. */
static int check_ring_row(const ds41_kv_layout *l, const uint8_t *row, uint32_t r, uint32_t slot, float *out,
                          ds41_error *err) {
    for (uint32_t b = 0; b < l->latent_dim; b++)
        if (e4m3_is_nan(row[b]))
            return ds41_fail(err, "kv snapshot: ring %u slot %u: value %u is NaN", r, slot, b);
    for (uint32_t b = l->latent_dim; b < l->ring_row_bytes; b++)
        if (row[b] == 0xFF)
            return ds41_fail(err, "kv snapshot: ring %u slot %u: scale %u is NaN", r, slot,
                             b - l->latent_dim);
    ds41_kv_decode_ring_row(l, row, out);
    for (uint32_t b = 0; b < l->latent_dim; b++)
        if (!isfinite(out[b]))
            return ds41_fail(err, "kv snapshot: ring %u slot %u: value %u overflows", r, slot, b);
    return 0;
}

/* Every packed entry, then every ring row of a snapshot: p points at the
 * entries, the rings follow them. */
static int check_packed(const ds41_kv_layout *l, const uint8_t *p, const uint64_t *entries, uint64_t tokens,
                        ds41_error *err) {
    float *out = malloc((size_t)(l->latent_dim > l->index_dim ? l->latent_dim : l->index_dim) * sizeof *out);
    if (!out) return ds41_fail(err, "kv snapshot: out of memory");
    int rc = 0;
    for (int src = 0; src < l->n_sources && rc == 0; src++)
        for (uint64_t i = 0; i < entries[src] && rc == 0; i++, p += l->entry_bytes)
            rc = check_entry(l, p, src, i, out, err);
    for (uint32_t r = 0; r < (uint32_t)l->n_rings && rc == 0; r++) {
        for (uint32_t slot = 0; slot < l->window && rc == 0; slot++, p += l->ring_row_bytes) {
            if (slot < tokens) {
                rc = check_ring_row(l, p, r, slot, out, err);
                continue;
            }
            for (uint32_t b = 0; b < l->ring_row_bytes && rc == 0; b++)
                if (p[b])
                    rc = ds41_fail(err, "kv snapshot: ring %u slot %u is beyond the tokens but not empty", r,
                                   slot);
        }
    }
    free(out);
    return rc;
}

int ds41_kv_seq_deserialize(ds41_kv_pool *pool, const uint8_t *buf, size_t len, ds41_kv_seq **out,
                            ds41_error *err) {
    if (out) *out = NULL;
    if (!pool || !buf || !out) return ds41_fail(err, "kv snapshot: no pool, input or output");
    const ds41_kv_layout *l = &pool->layout;
    const size_t head = kv_snap_header_bytes(l);
    if (len < 12 || memcmp(buf, KV_SNAP_MAGIC, 8) != 0) return ds41_fail(err, "kv snapshot: bad magic");
    if (get_u32(buf + 8) != KV_SNAP_VERSION)
        return ds41_fail(err, "kv snapshot: version %u, this build reads %u", get_u32(buf + 8),
                         KV_SNAP_VERSION);
    if (len < 16) return ds41_fail(err, "kv snapshot: truncated header (%zu bytes)", len);
    if (get_u32(buf + 12) != (uint32_t)l->n_sources)
        return ds41_fail(err, "kv snapshot: %u kv sources, the model has %d", get_u32(buf + 12),
                         l->n_sources);
    if (len < head) return ds41_fail(err, "kv snapshot: truncated header (%zu of %zu bytes)", len, head);
    const uint8_t *p = buf + 16;
    const struct {
        const char *name;
        uint32_t want;
    } fields[] = {{"n_rings", (uint32_t)l->n_rings},
                  {"n_carries", (uint32_t)l->n_carries},
                  {"latent_dim", l->latent_dim},
                  {"index_dim", l->index_dim},
                  {"window", l->window},
                  {"entry_bytes", l->entry_bytes},
                  {"ring_row_bytes", l->ring_row_bytes}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++, p += 4)
        if (get_u32(p) != fields[i].want)
            return ds41_fail(err, "kv snapshot: %s is %u, the model has %u", fields[i].name, get_u32(p),
                             fields[i].want);
    for (int src = 0; src < l->n_sources; src++, p += 4)
        if (get_u32(p) != (uint32_t)l->source_ratio[src])
            return ds41_fail(err, "kv snapshot: source %d has ratio %u, the model %d", src, get_u32(p),
                             l->source_ratio[src]);
    const uint64_t tokens = get_u64(p);
    p += 8;
    if (tokens > KV_SNAP_MAX_TOKENS)
        return ds41_fail(err, "kv snapshot: %llu tokens is beyond any context", (unsigned long long)tokens);
    uint64_t entries[DS41_KV_MAX_SOURCES];
    uint64_t body = 0;
    for (int src = 0; src < l->n_sources; src++, p += 8) {
        entries[src] = get_u64(p);
        const uint64_t want = tokens / (uint64_t)l->source_ratio[src];
        if (entries[src] != want)
            return ds41_fail(err,
                             "kv snapshot: source %d has %llu entries, %llu tokens at ratio %d need %llu",
                             src, (unsigned long long)entries[src], (unsigned long long)tokens,
                             l->source_ratio[src], (unsigned long long)want);
        body += entries[src] * l->entry_bytes; /* <= 2^40 * 2^32: no overflow */
    }
    const uint64_t ring_bytes = kv_snap_ring_bytes(l);
    uint64_t carry_floats = 0;
    for (int src = 0; src < l->n_sources; src++)
        if (l->source_carry[src] >= 0) carry_floats += 2 * (uint64_t)l->source_ratio[src] * l->latent_dim;
    const uint64_t total = head + body + ring_bytes + carry_floats * 4 + KV_SNAP_ENGRAM_BYTES;
    if ((uint64_t)len != total)
        return ds41_fail(err, "kv snapshot: %zu bytes, the header describes %llu", len,
                         (unsigned long long)total);

    /* Check every value before building anything. */
    const uint8_t *ent = p;
    if (check_packed(l, p, entries, tokens, err) != 0) return -1;
    p += body;
    const uint8_t *rings = p;
    p += ring_bytes;
    const uint8_t *carries = p;
    {
        const uint8_t *c = p;
        for (int src = 0; src < l->n_sources; src++) {
            if (l->source_carry[src] < 0) continue;
            const size_t n = (size_t)l->source_ratio[src] * l->latent_dim;
            for (size_t i = 0; i < 2 * n; i++, c += 4) {
                uint32_t bits = get_u32(c);
                float v;
                memcpy(&v, &bits, 4);
                bool ok = isfinite(v) || (i >= n && v == -INFINITY); /* score slots start at -inf */
                if (!ok)
                    return ds41_fail(err, "kv snapshot: source %d carry %s value %zu is not finite", src,
                                     i < n ? "kv" : "score", i % n);
            }
        }
        p = c;
    }
    ds41_engram_history hist;
    memset(&hist, 0, sizeof hist);
    hist.n_pushed = (int64_t)get_u64(p);
    p += 8;
    /* A model without Engram layers never pushes: 0 positions then. */
    if ((uint64_t)hist.n_pushed != tokens && hist.n_pushed != 0)
        return ds41_fail(err, "kv snapshot: the Engram history has %lld positions, the sequence %llu tokens",
                         (long long)hist.n_pushed, (unsigned long long)tokens);
    for (int k = 0; k < DS41_ENGRAM_MAX_NGRAM; k++, p += 4) {
        int32_t v = (int32_t)get_u32(p);
        if (k >= hist.n_pushed ? v != 0 : v < DS41_ENGRAM_DEAD)
            return ds41_fail(err, "kv snapshot: Engram history slot %d holds %d", k, (int)v);
        hist.recent[k] = v;
    }

    /* Build. */
    ds41_kv_seq *s = seq_alloc(pool, err);
    if (!s) return -1;
    s->tokens = tokens;
    const ds41_memory *m = pool->mem;
    if (ring_bytes) m->upload(m, s->rings, rings, ring_bytes);
    if (s->carry_floats) {
        /* The bit patterns as host floats, then one upload. */
        float *host = malloc(s->carry_floats * sizeof *host);
        if (!host) {
            ds41_kv_seq_free(s);
            return ds41_fail(err, "kv snapshot: out of memory");
        }
        for (size_t i = 0; i < s->carry_floats; i++) {
            uint32_t bits = get_u32(carries + 4 * i);
            memcpy(&host[i], &bits, 4);
        }
        m->upload(m, s->carries, host, s->carry_floats * sizeof *host);
        free(host);
    }
    s->engram = hist;
    const uint8_t *e = ent;
    for (int src = 0; src < l->n_sources; src++) {
        page_table *t = &s->src[src];
        const uint64_t n_pages = (entries[src] + l->entries_per_page - 1) / l->entries_per_page;
        if (n_pages > UINT32_MAX) {
            ds41_kv_seq_free(s);
            return ds41_fail(err, "kv snapshot: source %d needs too many pages", src);
        }
        if (n_pages) {
            t->pages = malloc((size_t)n_pages * sizeof *t->pages);
            if (!t->pages) {
                ds41_kv_seq_free(s);
                return ds41_fail(err, "kv snapshot: out of memory");
            }
            t->cap = (uint32_t)n_pages;
        }
        for (uint64_t i = 0; i < entries[src]; i += l->entries_per_page) {
            uint32_t id;
            if (page_alloc(pool, &id) != 0) {
                ds41_kv_seq_free(s);
                return ds41_fail(err, "KV cache full (%llu pages of %u bytes)",
                                 (unsigned long long)pool->pages_max, l->page_bytes);
            }
            t->pages[t->n_pages++] = id;
            uint64_t k = entries[src] - i < l->entries_per_page ? entries[src] - i : l->entries_per_page;
            m->upload(m, page_ptr(pool, id), e, (size_t)k * l->entry_bytes);
            e += (size_t)k * l->entry_bytes;
        }
        t->n_entries = entries[src];
    }
    *out = s;
    return 0;
}
