#include "engine/model/engram_tokens.h"

#include "engine/model/engram_token_map.h"

#include <stdlib.h>

static int vocab_text(void *ctx, uint32_t id, char **text, size_t *text_len, const char **raw,
                      size_t *raw_len, ds41_error *err) {
    const ds41_vocab *v = ctx;
    size_t len = 0;
    const char *s = ds41_vocab_token_string(v, id, &len);
    if (!s) {
        /* A hole: no token has this id.  Rust's decode of an unknown id
         * yields nothing, so its text is "" (and so is its key). */
        *text = NULL;
        *text_len = 0;
        *raw = "";
        *raw_len = 0;
        return 0;
    }
    *raw = s;
    *raw_len = len;
    *text = ds41_vocab_decode_id_lossy(v, id, text_len);
    if (!*text) return ds41_fail(err, "token id %u: cannot decode (out of memory)", id);
    return 0;
}

int ds41_engram_token_map_from_vocab(const ds41_vocab *v, int32_t **map, uint32_t *n_ids,
                                     uint32_t *n_compressed, ds41_error *err) {
    uint32_t n = ds41_vocab_size(v);
    int32_t *m = malloc((size_t)(n ? n : 1) * sizeof *m);
    if (!m) return ds41_fail(err, "engram token map: out of memory");
    if (ds41_engram_token_map_build(n, vocab_text, (void *)v, m, n_compressed, err) != 0) {
        free(m);
        return ds41_error_prefix(err, "engram token map");
    }
    *map = m;
    *n_ids = n;
    return 0;
}
