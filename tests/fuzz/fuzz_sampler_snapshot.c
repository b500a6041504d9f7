/* Sampler snapshots from untrusted bytes: ds41_sampler_restore must refuse or accept cleanly.
 * An accepted snapshot is canonical: snapshotting the restored state gives the same bytes back.
 * Small vocabularies are then sampled a few times with whatever parameters the snapshot holds
 * (and tokens accepted), which must never fail or crash. */
#include "engine/serve/sampler.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                          \
    do {                                                                                                     \
        if (!(cond)) __builtin_trap();                                                                       \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds41_sampler *s = NULL;
    ds41_error err;
    if (ds41_sampler_restore(&s, data, size, &err) != 0) {
        CHECK(s == NULL);
        return 0;
    }
    const size_t again_size = ds41_sampler_snapshot_size(s);
    CHECK(again_size == size);
    uint8_t *again = malloc(size);
    size_t written = 0;
    CHECK(again && ds41_sampler_snapshot(s, again, size, &written, &err) == 0 && written == size);
    CHECK(memcmp(again, data, size) == 0);
    free(again);

    const uint32_t n = ds41_sampler_n_vocab(s);
    if (n <= 4096) {
        ds41_sampler_scratch *sc = NULL;
        CHECK(ds41_sampler_scratch_new(&sc, n, &err) == 0);
        float *logits = malloc(n * sizeof *logits);
        CHECK(logits);
        for (uint32_t i = 0; i < n; i++) logits[i] = (float)(i % 17) * 0.7f - 5.0f;
        for (int step = 0; step < 3; step++) {
            ds41_sample_result r;
            CHECK(ds41_sampler_sample(s, sc, logits, n, &r, &err) == 0);
            CHECK(r.token < n && r.n_top <= DS41_SAMPLER_MAX_TOP_LOGPROBS);
            CHECK(ds41_sampler_accept(s, r.token, &err) == 0);
        }
        free(logits);
        ds41_sampler_scratch_free(sc);
    }
    ds41_sampler_free(s);
    return 0;
}
