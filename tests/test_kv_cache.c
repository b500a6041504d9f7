/* The packed KV cache: exact round trips, bytes per token at the released
 * config, copy-on-write forks, page reuse and the budget; its bytes living in
 * the pool's memory and moved only by that memory's calls. */
#include "config/model_config.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/model/kv_cache.h"
#include "engine/model/quant.h"
#include "tests/protected_memory.h"
#include "tests/tap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x1234567;
static float rnd(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    float u = (float)(rng_state >> 40) / 16777216.0f * 2.0f - 1.0f;
    return ds41_bf16_round(u * 3.0f);
}

static void fill(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = rnd();
}

/* Two sequences driven alike: h in a host pool, p in a pool of protected
 * memory, whose packed inputs come from `scratch` (that memory, as the
 * engine's scratch is). */
typedef struct twin {
    ds41_kv_seq *h, *p;
    protected_memory *pm;
    uint8_t *scratch; /* protected: entry_bytes + ring_row_bytes */
} twin;

/* Consume token t: the entries it completes (by values on even tokens,
 * packed on odd ones), two ring rows likewise, and a carry row written as
 * the forward pass does (a memory call into the carry's backend pointer). */
static int twin_token(twin *w, uint64_t t, ds41_error *err) {
    const ds41_kv_layout *l = ds41_kv_pool_layout(ds41_kv_seq_pool(w->p));
    const ds41_memory *m = &w->pm->mem;
    float lat[512], key[128];
    uint8_t packed[512 + 16];
    int ok = 1;
    for (int src = 0; src < l->n_sources; src++) {
        if ((t + 1) % (uint64_t)l->source_ratio[src] == 0) {
            fill(lat, l->latent_dim);
            fill(key, l->index_dim);
            if (t % 2 == 0) {
                ok &= ds41_kv_seq_append(w->h, src, lat, key, err) == 0;
                ok &= ds41_kv_seq_append(w->p, src, lat, key, err) == 0;
            } else {
                ds41_kv_pack_entry(l, lat, key, packed);
                m->upload(m, w->scratch, packed, l->entry_bytes);
                ok &= ds41_kv_seq_append_packed(w->h, src, packed, err) == 0;
                ok &= ds41_kv_seq_append_packed(w->p, src, w->scratch, err) == 0;
            }
        }
        if (l->source_carry[src] >= 0) {
            const size_t slot = (size_t)(t % (uint64_t)l->source_ratio[src]) * l->latent_dim;
            fill(lat, l->latent_dim);
            memcpy(ds41_kv_carry_kv(w->h, src) + slot, lat, l->latent_dim * sizeof(float));
            m->upload(m, ds41_kv_carry_kv(w->p, src) + slot, lat, l->latent_dim * sizeof(float));
        }
    }
    const int layers[2] = {5, l->n_layers - 1};
    for (int i = 0; i < 2; i++) {
        if (l->ring_of_layer[layers[i]] < 0) continue;
        fill(lat, l->latent_dim);
        if (t % 2 == 0) {
            ds41_kv_ring_write(w->h, layers[i], t, lat);
            ds41_kv_ring_write(w->p, layers[i], t, lat);
        } else {
            ds41_act_quant(lat, l->latent_dim, packed, packed + l->latent_dim);
            m->upload(m, w->scratch + l->entry_bytes, packed, l->ring_row_bytes);
            ds41_kv_ring_put(w->h, layers[i], t, packed);
            ds41_kv_ring_put(w->p, layers[i], t, w->scratch + l->entry_bytes);
        }
    }
    ds41_kv_seq_set_tokens(w->h, t + 1);
    ds41_kv_seq_set_tokens(w->p, t + 1);
    return ok;
}

/* The serialized bytes of s (malloc'd), NULL on error. */
static uint8_t *serialized(const ds41_kv_seq *s, size_t *len) {
    ds41_error err;
    *len = ds41_kv_seq_serialized_size(s);
    uint8_t *b = malloc(*len);
    size_t written = 0;
    if (b && ds41_kv_seq_serialize(s, b, *len, &written, &err) == 0 && written == *len) return b;
    free(b);
    return NULL;
}

/* Same state, read through the API (entries, ring rows, carries) and serialized. */
static int same_state(const ds41_kv_seq *a, const ds41_kv_seq *b) {
    const ds41_kv_layout *l = ds41_kv_pool_layout(ds41_kv_seq_pool(a));
    uint8_t ea[512 + 16], eb[512 + 16];
    int ok = ds41_kv_seq_tokens(a) == ds41_kv_seq_tokens(b);
    for (int src = 0; src < l->n_sources && ok; src++) {
        ok &= ds41_kv_seq_entries(a, src) == ds41_kv_seq_entries(b, src);
        for (uint64_t e = 0; e < ds41_kv_seq_entries(a, src) && ok; e++) {
            ds41_kv_seq_read_entry(a, src, e, ea);
            ds41_kv_seq_read_entry(b, src, e, eb);
            ok &= memcmp(ea, eb, l->entry_bytes) == 0;
        }
        if (l->source_carry[src] >= 0 && ok) {
            const size_t n = (size_t)l->source_ratio[src] * l->latent_dim;
            float *c = malloc(4 * n * sizeof *c);
            ok &= c && ds41_kv_carry_read(a, src, c, c + n) == 0 &&
                  ds41_kv_carry_read(b, src, c + 2 * n, c + 3 * n) == 0 &&
                  memcmp(c, c + 2 * n, 2 * n * sizeof *c) == 0;
            free(c);
        }
    }
    /* The rings twin_token writes (the snapshot below covers all of them). */
    const int layers[2] = {5, l->n_layers - 1};
    for (int i = 0; i < 2 && ok; i++) {
        if (l->ring_of_layer[layers[i]] < 0) continue;
        for (uint32_t slot = 0; slot < l->window && ok; slot++) {
            ds41_kv_ring_read_row(a, layers[i], slot, ea);
            ds41_kv_ring_read_row(b, layers[i], slot, eb);
            ok &= memcmp(ea, eb, l->ring_row_bytes) == 0;
        }
    }
    size_t na = 0, nb = 0;
    uint8_t *sa = ok ? serialized(a, &na) : NULL, *sb = ok ? serialized(b, &nb) : NULL;
    ok &= sa && sb && na == nb && memcmp(sa, sb, na) == 0;
    free(sa);
    free(sb);
    return ok;
}

/* Every pointer into the pool the API hands out lies in the protected memory. */
static int owned(const protected_memory *pm, ds41_kv_seq *s) {
    const ds41_kv_pool *pool = ds41_kv_seq_pool(s);
    const ds41_kv_layout *l = ds41_kv_pool_layout(pool);
    int ok = 1;
    for (int src = 0; src < l->n_sources; src++) {
        uint32_t np = 0;
        const uint32_t *ids = ds41_kv_seq_page_ids(s, src, &np);
        for (uint32_t i = 0; i < np; i++)
            ok &= protected_memory_owns(pm, ds41_kv_pool_page(pool, ids[i]), l->page_bytes);
        for (uint64_t e = 0; e < ds41_kv_seq_entries(s, src); e++)
            ok &= protected_memory_owns(pm, ds41_kv_seq_entry(s, src, e), l->entry_bytes);
        if (l->source_carry[src] >= 0) {
            const size_t n = (size_t)l->source_ratio[src] * l->latent_dim * sizeof(float);
            ok &= protected_memory_owns(pm, ds41_kv_carry_kv(s, src), n) &&
                  protected_memory_owns(pm, ds41_kv_carry_score(s, src), n);
        }
    }
    for (int layer = 0; layer < l->n_layers; layer++)
        if (l->ring_of_layer[layer] >= 0)
            ok &= protected_memory_owns(pm, ds41_kv_ring_row(s, layer, 0),
                                        (size_t)l->window * l->ring_row_bytes);
    return ok;
}

/* The pool's pages, rings and carries live in its memory and are moved only by
 * that memory's calls: run against memory the host cannot touch, any plain
 * access faults (the test dies); the states and snapshots equal a host pool's
 * byte for byte. */
static void memory_seam(const ds41_model_config *cfg) {
    ds41_error err;
    protected_memory pm;
    protected_memory_init(&pm);
    /* 4 entries per page: page boundaries and partly filled shared pages come early. */
    ds41_kv_pool *hp = ds41_kv_pool_new(cfg, 0, 4, &err);
    ds41_kv_pool *pp = ds41_kv_pool_new_in(&pm.mem, cfg, 0, 4, &err);
    if (!TAP_CHECK(hp && pp && ds41_kv_pool_memory(hp) == &ds41_memory_host &&
                       ds41_kv_pool_memory(pp) == &pm.mem,
                   "ds41_kv_pool_new uses host memory, _new_in the memory it is given"))
        return;
    const ds41_kv_layout *l = ds41_kv_pool_layout(pp);
    twin w = {ds41_kv_seq_new(hp, &err), ds41_kv_seq_new(pp, &err), &pm,
              pm.mem.alloc(&pm.mem, l->entry_bytes + l->ring_row_bytes)};
    int ok = w.h && w.p && w.scratch;
    /* Fresh state: empty rings, kv 0 and score -inf carries (copied from the pool's template). */
    ok &= same_state(w.h, w.p);
    for (uint64_t t = 0; t < 42 && ok; t++) ok &= twin_token(&w, t, &err);
    TAP_CHECK(
        ok && same_state(w.h, w.p),
        "appends (values, and packed from backend memory), ring writes and puts, carries: the protected "
        "pool holds the host pool's bytes");
    /* Forks share the pages; their appends copy the shared partly filled ones. */
    twin f = {ds41_kv_seq_fork(w.h, &err), ds41_kv_seq_fork(w.p, &err), &pm, w.scratch};
    ds41_kv_pool_stats before, after;
    ds41_kv_pool_get_stats(pp, &before);
    ok = f.h && f.p && twin_token(&f, 42, &err) && twin_token(&f, 43, &err);
    ds41_kv_pool_get_stats(pp, &after);
    TAP_CHECK(
        ok && after.pages_in_use > before.pages_in_use && same_state(f.h, f.p) && same_state(w.h, w.p),
        "fork and copy on write through the memory: forks equal, parents unchanged (%llu -> %llu pages)",
        (unsigned long long)before.pages_in_use, (unsigned long long)after.pages_in_use);
    /* Snapshots: the protected sequence's bytes restored into the protected pool. */
    size_t n = 0;
    uint8_t *snap = serialized(f.p, &n);
    ds41_kv_seq *d = NULL;
    ok = snap && ds41_kv_seq_deserialize(pp, snap, n, &d, &err) == 0 && same_state(d, f.h);
    TAP_CHECK(ok, "serialize and deserialize through the memory: byte-identical to the host pool's snapshot");
    free(snap);
    TAP_CHECK(owned(&pm, w.p) && owned(&pm, f.p) && (!d || owned(&pm, d)),
              "every page, entry, ring and carry pointer lies in an allocation of the pool's memory");
    TAP_CHECK(pm.uploads > 0 && pm.downloads > 0 && pm.copies > 0,
              "bytes moved by the memory's calls (%llu uploads, %llu downloads, %llu copies)",
              (unsigned long long)pm.uploads, (unsigned long long)pm.downloads,
              (unsigned long long)pm.copies);
    ds41_kv_seq_free(d);
    ds41_kv_seq_free(f.h);
    ds41_kv_seq_free(f.p);
    ds41_kv_seq_free(w.h);
    ds41_kv_seq_free(w.p);
    pm.mem.free(&pm.mem, w.scratch, l->entry_bytes + l->ring_row_bytes);
    ds41_kv_pool_get_stats(pp, &after);
    ds41_kv_pool_free(pp);
    ds41_kv_pool_free(hp);
    TAP_CHECK(after.sequences == 0 && after.pages_in_use == 0 && pm.allocs > 0 && pm.frees == pm.allocs &&
                  pm.n_regions == 0 && pm.bytes_now == 0 && !pm.bad_free,
              "every allocation given back with its size (%llu allocs, %llu frees)",
              (unsigned long long)pm.allocs, (unsigned long long)pm.frees);

    /* A backend's pool lives in the backend's memory. */
    protected_memory bm;
    protected_memory_init(&bm);
    ds41_backend *be = ds41_backend_cpu_new(NULL, &err);
    if (be) {
        const ds41_memory *was = be->mem;
        be->mem = &bm.mem;
        ds41_kv_pool *bp = be->new_pool(be, cfg, 0, 0, &err);
        ds41_kv_seq *bs = bp ? ds41_kv_seq_new(bp, &err) : NULL;
        TAP_CHECK(bp && bs && ds41_kv_pool_memory(bp) == &bm.mem && owned(&bm, bs),
                  "the cpu backend's new_pool puts the pool in the backend's memory");
        ds41_kv_seq_free(bs);
        ds41_kv_pool_free(bp);
        be->mem = was;
        be->destroy(be);
    } else {
        TAP_CHECK(0, "cpu backend: %s", err.msg);
    }
    protected_memory_fini(&bm);
    protected_memory_fini(&pm);
}

int main(void) {
    ds41_model_config cfg;
    ds41_error err;
    if (!TAP_CHECK(ds41_model_config_load("tests/data/config/release", &cfg, &err) == 0, "release config")) {
        TAP_NOTE("%s", err.msg);
        return tap_done();
    }
    ds41_kv_pool *pool = ds41_kv_pool_new(&cfg, 0, 64, &err);
    const ds41_kv_layout *l = ds41_kv_pool_layout(pool);
    TAP_CHECK(l->n_sources == 4 && l->source_layer[0] == 2 && l->source_layer[3] == 20 && l->source_ratio[3] == 1,
              "kv sources 2, 8, 14, 20 with their ratios");
    TAP_CHECK(l->latent_bytes == 288 && l->index_bytes == 68, "entry = 288 B latent + 68 B index key");
    TAP_CHECK(l->source_of_layer[7] == 0 && l->source_of_layer[39] == 3 && l->source_of_layer[0] == -1,
              "layers map to the source they read");

    /* Bytes per token: N tokens give N/ratio entries per source. */
    ds41_kv_seq *s = ds41_kv_seq_new(pool, &err);
    float lat[512], key[128], out[512];
    const uint64_t N = 1024;
    int ok = 1;
    for (uint64_t t = 0; t < N && ok; t++)
        for (int src = 0; src < l->n_sources; src++)
            if ((t + 1) % (uint64_t)l->source_ratio[src] == 0) {
                fill(lat, 512);
                fill(key, 128);
                ok &= ds41_kv_seq_append(s, src, lat, key, &err) == 0;
            }
    ds41_kv_pool_stats st;
    ds41_kv_pool_get_stats(pool, &st);
    uint64_t want = N * ds41_model_config_cache_bytes_per_token(&cfg, NULL, NULL);
    TAP_CHECK(ok && st.bytes_in_use == want && ds41_kv_seq_page_bytes(s) == want,
              "after %llu tokens the pool holds exactly %llu bytes = 890 B/token (got %llu)",
              (unsigned long long)N, (unsigned long long)want, (unsigned long long)st.bytes_in_use);

    /* Exact round trips. */
    ds41_kv_seq *r = ds41_kv_seq_new(pool, &err);
    int exact = 1;
    for (int i = 0; i < 100 && exact; i++) {
        fill(lat, 512);
        fill(key, 128);
        if (i == 7) memset(lat, 0, sizeof lat); /* all-zero group: floored scale */
        ds41_kv_seq_append(r, 1, lat, key, &err);
        uint8_t e[356];
        ds41_kv_seq_read_entry(r, 1, (uint64_t)i, e);
        ds41_fp4_act_quant_e4m3_qdq(lat, 512);
        ds41_fp4_act_quant_ue8m0_qdq(key, 128);
        ds41_kv_decode_latent(l, e, out);
        exact &= memcmp(out, lat, sizeof lat) == 0;
        ds41_kv_decode_index_key(l, e, out);
        exact &= memcmp(out, key, sizeof key) == 0;
    }
    TAP_CHECK(exact, "latents and index keys decode to the reference QDQ values bit for bit");
    int ring = 1;
    for (uint64_t pos = 0; pos < 300 && ring; pos++) {
        fill(lat, 512);
        ds41_kv_ring_write(r, 5, pos, lat);
        ds41_act_quant_qdq(lat, 512);
        uint8_t row[512 + 16];
        ds41_kv_ring_read_row(r, 5, (uint32_t)(pos % 128), row);
        ds41_kv_decode_ring_row(l, row, out);
        ring &= memcmp(out, lat, sizeof lat) == 0;
    }
    TAP_CHECK(ring, "window ring rows decode to act_quant QDQ values, slot = pos %% window");

    /* The packed forms a backend op hands over: append_packed of ds41_kv_pack_entry = append (across
     * a page boundary), ring_put of act_quant = ring_write; page ids + pool pages reach the entries. */
    {
        ds41_kv_seq *a = ds41_kv_seq_new(pool, &err), *pk = ds41_kv_seq_new(pool, &err);
        uint8_t packed[356], row[512 + 16], got_a[512 + 16], got_pk[512 + 16];
        int same = a && pk;
        for (uint64_t i = 0; i < 70 && same; i++) {
            fill(lat, 512);
            fill(key, 128);
            ds41_kv_pack_entry(l, lat, key, packed);
            same &= ds41_kv_seq_append(a, 1, lat, key, &err) == 0 &&
                    ds41_kv_seq_append_packed(pk, 1, packed, &err) == 0;
            ds41_kv_seq_read_entry(a, 1, i, got_a);
            ds41_kv_seq_read_entry(pk, 1, i, got_pk);
            same &= memcmp(got_a, got_pk, l->entry_bytes) == 0;
        }
        uint32_t np = 0;
        const uint32_t *ids = same ? ds41_kv_seq_page_ids(pk, 1, &np) : NULL;
        same &= np == 2 &&
                ds41_kv_pool_page(pool, ids[1]) + 5 * (size_t)l->entry_bytes == ds41_kv_seq_entry(pk, 1, 69);
        TAP_CHECK(same,
                  "append_packed of a packed entry = append; page ids and pool pages reach the entries");
        int rows_same = same;
        for (uint64_t pos = 0; pos < 300 && rows_same; pos++) {
            fill(lat, 512);
            ds41_kv_ring_write(a, 5, pos, lat);
            ds41_act_quant(lat, 512, row, row + 512);
            ds41_kv_ring_put(pk, 5, pos, row);
            ds41_kv_ring_read_row(a, 5, (uint32_t)(pos % 128), got_a);
            ds41_kv_ring_read_row(pk, 5, (uint32_t)(pos % 128), got_pk);
            rows_same &= memcmp(got_a, got_pk, l->ring_row_bytes) == 0;
        }
        TAP_CHECK(rows_same, "ring_put of an act_quant row = ring_write of the values");
        ds41_kv_seq_free(a);
        ds41_kv_seq_free(pk);
    }
    {
        float ckv[1024], csc[1024];
        TAP_CHECK(ds41_kv_carry_kv(r, 3) == NULL && ds41_kv_carry_read(r, 3, ckv, csc) == -1 &&
                      ds41_kv_carry_read(r, 0, ckv, csc) == 0 && csc[0] == -INFINITY &&
                      csc[1023] == -INFINITY && ckv[0] == 0.0f && ckv[1023] == 0.0f,
                  "carries: none for ratio 1; kv 0, score -inf for ratio 2");
    }

    /* Fork shares pages; the first append to a shared partial page copies it. */
    ds41_kv_seq *f = ds41_kv_seq_fork(r, &err);
    ds41_kv_pool_get_stats(pool, &st);
    uint64_t before = st.pages_in_use;
    uint8_t saved[356], got_f[356], got_r[356];
    ds41_kv_seq_read_entry(r, 1, 99, saved);
    fill(lat, 512);
    fill(key, 128);
    ds41_kv_seq_append(f, 1, lat, key, &err);
    ds41_kv_pool_get_stats(pool, &st);
    TAP_CHECK(ds41_kv_seq_entries(f, 1) == 101 && ds41_kv_seq_entries(r, 1) == 100 && st.pages_in_use == before + 1,
              "fork then append: child grows, one page copied");
    ds41_kv_seq_read_entry(f, 1, 99, got_f);
    ds41_kv_seq_read_entry(r, 1, 99, got_r);
    TAP_CHECK(memcmp(saved, got_f, 356) == 0 && memcmp(saved, got_r, 356) == 0 &&
                  ds41_kv_seq_entry(f, 1, 0) == ds41_kv_seq_entry(r, 1, 0),
              "shared entries unchanged; full pages still shared");
    ds41_kv_seq_free(f);
    ds41_kv_seq_free(r);
    ds41_kv_seq_free(s);

    /* Page reuse: 1,000 short sequences never grow the pool past one round. */
    ds41_kv_pool_get_stats(pool, &st);
    uint64_t allocated = st.pages_allocated;
    for (int i = 0; i < 1000; i++) {
        ds41_kv_seq *q = ds41_kv_seq_new(pool, &err);
        for (int t = 0; t < 20; t++) ds41_kv_seq_append(q, t % 4, lat, key, &err);
        ds41_kv_seq_free(q);
    }
    ds41_kv_pool_get_stats(pool, &st);
    TAP_CHECK(st.pages_allocated == allocated && st.pages_in_use == 0 && st.sequences == 0,
              "1,000 short sequences reuse freed pages (%llu allocated, %llu in use)",
              (unsigned long long)st.pages_allocated, (unsigned long long)st.pages_in_use);
    ds41_kv_pool_free(pool);

    /* Budget. */
    pool = ds41_kv_pool_new(&cfg, 3ull * 64 * 356, 64, &err);
    s = ds41_kv_seq_new(pool, &err);
    int filled = 1;
    for (int i = 0; i < 192; i++) filled &= ds41_kv_seq_append(s, 0, lat, key, &err) == 0;
    int full = ds41_kv_seq_append(s, 0, lat, key, &err) != 0 && strstr(err.msg, "KV cache full") != NULL;
    TAP_CHECK(filled && full && ds41_kv_seq_entries(s, 0) == 192, "budget of 3 pages: the 193rd entry is refused");
    ds41_kv_seq_free(s);
    ds41_kv_pool_free(pool);
    memory_seam(&cfg);
    ds41_model_config_free(&cfg);
    return tap_done();
}
