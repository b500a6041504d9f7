/* KV sequence snapshots from untrusted bytes: ds41_kv_seq_deserialize must refuse (with a
 * message, nothing allocated) or accept; an accepted snapshot is canonical (serializing the
 * restored sequence gives the same bytes back) and decodes to finite values.  The pool is the
 * tiny preset's geometry (window 8, kv sources at ratios 2 and 1), with a small page budget so
 * "KV cache full" paths run too. */
#include "engine/model/kv_cache.h"
#include "engine/model/model_gen.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                          \
    do {                                                                                                     \
        if (!(cond)) __builtin_trap();                                                                       \
    } while (0)

static ds41_model_config CFG;
static ds41_kv_pool *POOL;

static void setup(void) {
    ds41_error err;
    CHECK(ds41_model_gen_preset_config("tiny", NULL, 0, &CFG, &err) == 0);
    CHECK(ds41_model_config_finalize(&CFG, &err) == 0);
    const ds41_kv_layout *l;
    ds41_kv_pool *probe = ds41_kv_pool_new(&CFG, 0, 4, &err);
    CHECK(probe);
    l = ds41_kv_pool_layout(probe);
    uint64_t budget = (uint64_t)l->page_bytes * 64;
    ds41_kv_pool_free(probe);
    POOL = ds41_kv_pool_new(&CFG, budget, 4, &err);
    CHECK(POOL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!POOL) setup();
    ds41_kv_seq *s = NULL;
    ds41_error err;
    err.msg[0] = 0;
    if (ds41_kv_seq_deserialize(POOL, data, size, &s, &err) != 0) {
        CHECK(s == NULL && err.msg[0]);
        ds41_kv_pool_stats st;
        ds41_kv_pool_get_stats(POOL, &st);
        CHECK(st.pages_in_use == 0 && st.sequences == 0);
        return 0;
    }
    CHECK(ds41_kv_seq_serialized_size(s) == size);
    uint8_t *again = malloc(size);
    size_t written = 0;
    CHECK(again && ds41_kv_seq_serialize(s, again, size, &written, &err) == 0 && written == size);
    CHECK(memcmp(again, data, size) == 0);
    free(again);
    const ds41_kv_layout *l = ds41_kv_pool_layout(POOL);
    float *v = malloc((l->latent_dim + l->index_dim) * sizeof *v);
    uint8_t *p = malloc(l->entry_bytes);
    CHECK(v && p);
    for (int src = 0; src < l->n_sources; src++)
        for (uint64_t e = 0; e < ds41_kv_seq_entries(s, src); e++) {
            ds41_kv_seq_read_entry(s, src, e, p);
            ds41_kv_decode_latent(l, p, v);
            ds41_kv_decode_index_key(l, p, v + l->latent_dim);
            for (uint32_t i = 0; i < l->latent_dim + l->index_dim; i++) CHECK(isfinite(v[i]));
        }
    free(v);
    free(p);
    ds41_kv_seq_free(s);
    return 0;
}
