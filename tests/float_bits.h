/* Bit-level float comparison and the exact reference sum, shared by the
 * numeric tests (header-only, like tap.h). */
#ifndef DS41_TESTS_FLOAT_BITS_H
#define DS41_TESTS_FLOAT_BITS_H

#include <stdint.h>
#include <string.h>

#include "engine/backend/refmath.h"

__attribute__((unused)) static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Same bits: tells -0 from +0 and compares NaN payloads. */
__attribute__((unused)) static int same(float a, float b) {
    return bits(a) == bits(b);
}

/* The exact sum of t[0..n) rounded once to fp32 (the accumulator, no fast path). */
__attribute__((unused)) static float sum_of(const double *t, size_t n) {
    ds41_xacc a;
    ds41_xacc_init(&a);
    for (size_t i = 0; i < n; i++) ds41_xacc_add(&a, t[i]);
    return ds41_xacc_round(&a);
}

#endif
