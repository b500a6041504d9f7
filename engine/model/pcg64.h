/* PCG64 and numpy's seeding and bounded-integer draws, bit for bit as numpy 1.24.
 *
 * The Engram hash multipliers (REFERENCE.md §6.2) are defined as
 *     numpy.random.default_rng(10007 * L).integers(0, bound, size=n, dtype=np.int64)
 * so an engine that derives them from the config (instead of trusting constants) needs
 * numpy's exact pipeline:
 *   1. SeedSequence(entropy) with the default pool of four 32-bit words, no spawn key;
 *   2. generate_state(4, uint64) -> PCG64 seed (words 0,1) and increment (words 2,3);
 *   3. PCG64: 128-bit LCG (state = state * MULT + inc), XSL-RR output, advance-then-output;
 *   4. Generator.integers(0, high, dtype=int64): numpy's random_bounded_uint64 with
 *      use_masked=False (Lemire's multiply-shift with rejection; 32-bit draws from the
 *      buffered next32 when the range fits in 32 bits, 64-bit draws otherwise).
 *
 * Needs a compiler with unsigned __int128 (gcc, clang).  No allocation, no global state. */
#ifndef DS41_ENGINE_PCG64_H
#define DS41_ENGINE_PCG64_H

#include <stddef.h>
#include <stdint.h>

#include "config/error.h"

/* Generator state.  Plain data: copying the struct forks the stream. */
typedef struct ds41_pcg64 {
    unsigned __int128 state;
    unsigned __int128 inc; /* always odd */
    int has_uint32;        /* next32 has a buffered upper half (numpy's has_uint32) */
    uint32_t uinteger;     /* that buffered half */
} ds41_pcg64;

/* numpy SeedSequence(entropy).generate_state(n_words, dtype=uint32) for a non-negative
 * integer entropy that fits in 64 bits (any value is valid), pool size 4, no spawn key.
 * Writes n_words words to out (out may be NULL when n_words is 0). */
void ds41_seedseq_generate_state32(uint64_t entropy, uint32_t *out, size_t n_words);

/* Seeds rng exactly as numpy.random.PCG64(entropy) (= the bit generator of
 * numpy.random.default_rng(entropy)) does: SeedSequence -> generate_state(4, uint64) ->
 * pcg64_set_seed.  Clears the 32-bit buffer. */
void ds41_seedseq_pcg64(ds41_pcg64 *rng, uint64_t entropy);

/* Sets the raw state the way numpy's pcg64_set_seed(seed, inc) does (srandom_r):
 * inc := (initseq << 1) | 1, one step, state += initstate, one step.  Clears the buffer. */
void ds41_pcg64_set_seed(ds41_pcg64 *rng, unsigned __int128 initstate, unsigned __int128 initseq);

/* Next 64-bit output (numpy PCG64.random_raw()). */
uint64_t ds41_pcg64_next64(ds41_pcg64 *rng);

/* Next 32-bit output as numpy's pcg64_next32: the low half of a 64-bit draw, buffering
 * the high half for the following call. */
uint32_t ds41_pcg64_next32(ds41_pcg64 *rng);

/* numpy Generator.integers(0, high, size=n, dtype=np.int64): n draws in [0, high) into out,
 * consuming the stream exactly as numpy does (high == 1 consumes nothing and yields zeros).
 * Errors (nothing written, stream untouched): high < 1, or out == NULL with n > 0. */
int ds41_pcg64_integers(ds41_pcg64 *rng, int64_t high, int64_t *out, size_t n, ds41_error *err);

#endif
