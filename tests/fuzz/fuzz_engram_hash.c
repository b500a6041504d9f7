/* Fuzz the Engram layout and hashing: small layouts from the first bytes (including invalid
 * parameters), then a token stream of arbitrary int32 compressed ids (valid, DEAD, negative,
 * out of range) hashed for every layer.  Invariant: on success every row id lies inside its
 * column's range [offset, offset + prime). */
#include "engine/model/engram_layout.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 8) return 0;
    int layer_ids[4] = {data[0] % 50, data[1] % 50, data[2] % 50, data[3] % 50};
    int n_layers = data[4] % 4;                        /* 0..3 */
    int max_ngram = data[5] % 6;                       /* 0..5: 0 and 1 are invalid */
    int n_heads = data[6] % 5;                         /* 0..4: 0 is invalid */
    int64_t vocab = (int64_t)(data[7] % 64) * 37 - 10; /* includes <= 0 */
    int64_t cvocab = size > 8 ? (int64_t)data[8] * 131 - 100 : 1;
    data += 9 < size ? 9 : size;
    size = size > 9 ? size - 9 : 0;

    ds41_engram_layout l;
    ds41_error err;
    if (ds41_engram_layout_compute(layer_ids, n_layers, max_ngram, n_heads, vocab, cvocab, &l, &err) != 0)
        return 0;
    int32_t pad = (int32_t)(cvocab > 1 ? cvocab / 2 : 0);
    size_t n = size / 4;
    if (n > 64) n = 64;
    int32_t toks[64];
    for (size_t t = 0; t < n; t++) {
        uint32_t v;
        memcpy(&v, data + 4 * t, 4);
        /* mostly small ids, sometimes DEAD or arbitrary values */
        toks[t] = (v >> 30) == 0   ? (int32_t)(v % (uint32_t)(cvocab + 2))
                  : (v >> 30) == 1 ? DS41_ENGRAM_DEAD
                                   : (int32_t)v;
    }
    int64_t *ids = malloc((n ? n : 1) * (size_t)(l.n_layers ? l.n_layers : 1) *
                          (size_t)(l.n_cols ? l.n_cols : 1) * sizeof *ids);
    if (!ids) return 0;
    ds41_engram_history h;
    ds41_engram_history_init(&h);
    if (ds41_engram_hash_tokens(&l, &h, pad, toks, n, ids, &err) == 0) {
        for (size_t t = 0; t < n; t++)
            for (int s = 0; s < l.n_layers; s++)
                for (int c = 0; c < l.n_cols; c++) {
                    int64_t id = ids[(t * (size_t)l.n_layers + (size_t)s) * (size_t)l.n_cols + (size_t)c];
                    const ds41_engram_layer_layout *ll = &l.layers[s];
                    if (id < ll->offsets[c] || id >= ll->offsets[c] + ll->primes[c] || id >= ll->rows)
                        abort();
                }
        if (h.n_pushed != (int64_t)n) abort();
    }
    free(ids);
    return 0;
}
