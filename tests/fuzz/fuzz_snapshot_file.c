/* Snapshot files from untrusted bytes: ds41_snapshot_parse must refuse (a message naming the
 * file, nothing returned) or accept a consistent snapshot.  When the first byte is odd the rest
 * is taken as a file whose two checksums are recomputed first, so the checks behind them (lengths,
 * ids, the zstd frame) are reached too. */
#include "storage/snapshot.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                          \
    do {                                                                                                     \
        if (!(cond)) __builtin_trap();                                                                       \
    } while (0)

static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const bool fix = data[0] & 1;
    size_t len = size - 1;
    uint8_t *b = malloc(len ? len : 1);
    CHECK(b);
    if (len) memcpy(b, data + 1, len);
    if (fix && len >= DS41_SNAPSHOT_HEAD_BYTES + 8) {
        uint64_t n_ids = 0;
        for (int i = 0; i < 8; i++) n_ids |= (uint64_t)b[48 + i] << (8 * i);
        if (n_ids <= (len - DS41_SNAPSHOT_HEAD_BYTES - 8) / 4) {
            uint64_t hc = ds41_crc64(0, b, 128); /* head_check covers the head before it */
            hc = ds41_crc64(hc, b + DS41_SNAPSHOT_HEAD_BYTES, 4 * (size_t)n_ids);
            put64(b + 128, hc);
        }
        put64(b + len - 8, ds41_crc64(0, b, len - 8));
    }
    ds41_snapshot s;
    ds41_error err;
    err.msg[0] = 0;
    if (ds41_snapshot_parse(b, len, "FUZZ", NULL, 1 << 20, &s, &err) != 0) {
        CHECK(!s.ids && !s.kv && !s.sampler && strstr(err.msg, "FUZZ"));
    } else {
        CHECK(s.n_ids >= 1 && s.ids && s.kv && s.kv_len >= 1 && s.kv_len + s.sampler_len <= (1u << 20));
        CHECK((s.sampler != NULL) == (s.sampler_len != 0));
        for (size_t i = 0; i < s.n_ids; i++) CHECK(s.ids[i] >= 0);
        ds41_snapshot_free(&s);
    }
    free(b);
    return 0;
}
