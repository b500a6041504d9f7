/* The packed KV cache: exact round trips, bytes per token at the released
 * config, copy-on-write forks, page reuse and the budget. */
#include "config/model_config.h"
#include "engine/model/kv_cache.h"
#include "engine/model/quant.h"
#include "tests/tap.h"

#include <math.h>
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
    ds41_model_config_free(&cfg);
    return tap_done();
}
