#include "engine/backend/refmath.h"

#include "engine/model/quant.h"

#include <math.h>
#include <string.h>

/* ---- exact accumulator ---------------------------------------------------- */

#define LIMB_BITS 32
#define LIMB_MASK 0xffffffffu
/* Propagate carries before a limb could overflow: each add puts less than
 * 2^32 into a limb, so 2^30 adds keep |limb| < 2^62 (with the 2^32 left by a
 * previous propagation). */
#define MAX_PENDING (1u << 30)

void ds41_xacc_init(ds41_xacc *a) {
    memset(a, 0, sizeof *a);
    a->lo = DS41_XACC_LIMBS;
    a->hi = -1;
}

/* Carry-propagate: afterwards limbs [lo, hi-1] lie in [0, 2^32) and the top
 * limb hi holds the sign, with |limb[hi]| < 2^32 (it is split upwards while
 * larger).  The represented value is unchanged. */
static void xacc_normalize(ds41_xacc *a) {
    a->pending = 0;
    if (a->lo > a->hi) return;
    int64_t carry = 0;
    for (int i = a->lo; i < a->hi; i++) {
        int64_t v = a->limb[i] + carry;
        int64_t low = (int64_t)((uint64_t)v & LIMB_MASK);
        carry = (v - low) / ((int64_t)1 << LIMB_BITS); /* exact: v - low is a multiple of 2^32 */
        a->limb[i] = low;
    }
    a->limb[a->hi] += carry;
    while (a->hi < DS41_XACC_LIMBS - 1 &&
           (a->limb[a->hi] >= ((int64_t)1 << LIMB_BITS) || a->limb[a->hi] <= -((int64_t)1 << LIMB_BITS))) {
        int64_t v = a->limb[a->hi];
        int64_t low = (int64_t)((uint64_t)v & LIMB_MASK);
        a->limb[a->hi] = low;
        a->limb[a->hi + 1] += (v - low) / ((int64_t)1 << LIMB_BITS);
        a->hi++;
    }
}

void ds41_xacc_add(ds41_xacc *a, double x) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    int neg = (int)(bits >> 63);
    int e = (int)((bits >> 52) & 0x7ff);
    uint64_t m = bits & ((UINT64_C(1) << 52) - 1);
    if (e == 0x7ff) {
        if (m)
            a->nan = 1;
        else if (neg)
            a->ninf = 1;
        else
            a->pinf = 1;
        return;
    }
    if (e == 0) {
        if (!m) return; /* +-0 adds nothing */
        e = 1;          /* subnormal: m * 2^-1074 */
    } else {
        m |= UINT64_C(1) << 52;
    }
    /* x = m * 2^(e - 1075); bit 0 of the accumulator weighs 2^-1074. */
    int b = e - 1;
    int i = b >> 5, s = b & 31;
    uint64_t p0 = (m << s) & LIMB_MASK;
    uint64_t p1 = (s ? (m >> (32 - s)) : (m >> 32)) & LIMB_MASK;
    uint64_t p2 = s ? (m >> (64 - s)) : 0;
    if (neg) {
        a->limb[i] -= (int64_t)p0;
        a->limb[i + 1] -= (int64_t)p1;
        a->limb[i + 2] -= (int64_t)p2;
    } else {
        a->limb[i] += (int64_t)p0;
        a->limb[i + 1] += (int64_t)p1;
        a->limb[i + 2] += (int64_t)p2;
    }
    if (i < a->lo) a->lo = i;
    if (i + 2 > a->hi) a->hi = i + 2;
    if (++a->pending >= MAX_PENDING) xacc_normalize(a);
}

static void xacc_clear(ds41_xacc *a) {
    if (a->lo <= a->hi) memset(&a->limb[a->lo], 0, (size_t)(a->hi - a->lo + 1) * sizeof a->limb[0]);
    a->lo = DS41_XACC_LIMBS;
    a->hi = -1;
    a->pending = 0;
    a->nan = a->pinf = a->ninf = 0;
}

/* Round the magnitude m * 2^e (+ a non-zero remainder below bit 0 when
 * sticky) to fp32, RNE, on the fp32 grid including subnormals.  m != 0. */
static float round_to_f32(uint64_t m, int e, int sticky) {
    int lz = __builtin_clzll(m);
    m <<= lz; /* exact: no bits lost */
    e -= lz;
    if (sticky) m |= 1; /* below the round bit (the kept part is <= 24 bits of 64) */
    int top = e + 63;   /* value in [2^top, 2^(top+1)) */
    int lsb = top - 23 > -149 ? top - 23 : -149;
    int shift = lsb - e; /* >= 40 */
    uint64_t keep;
    int up;
    if (shift < 64) {
        keep = m >> shift;
        uint64_t rem = m & ((UINT64_C(1) << shift) - 1);
        uint64_t half = UINT64_C(1) << (shift - 1);
        up = rem > half || (rem == half && (keep & 1));
    } else if (shift == 64) {
        keep = 0;
        up = m > (UINT64_C(1) << 63); /* a tie rounds to the even 0 */
    } else {
        keep = 0;
        up = 0; /* below half of the smallest subnormal */
    }
    keep += (uint64_t)up;
    /* keep <= 2^24: exact in fp32; ldexpf is exact here or overflows to inf. */
    return ldexpf((float)keep, lsb);
}

/* Propagate carries, take the sign, and return the magnitude's top 64 bits:
 * *m (top bit set), weight of its bit 0 as 2^*e, *sticky for anything below.
 * Returns 0 for an exact zero, else +1 / -1 (the sign). */
static int xacc_extract(ds41_xacc *a, uint64_t *m, int *e, int *sticky) {
    xacc_normalize(a);
    int t = a->hi;
    while (t >= a->lo && a->limb[t] == 0) t--;
    if (t < a->lo) return 0;
    int sign = 1;
    if (a->limb[t] < 0) {
        /* Lower limbs are non-negative and below one unit of limb t, so the
         * value is negative: negate and propagate again. */
        sign = -1;
        for (int i = a->lo; i <= a->hi; i++) a->limb[i] = -a->limb[i];
        xacc_normalize(a);
        t = a->hi;
        while (t >= a->lo && a->limb[t] == 0) t--;
    }
    /* Now every limb in [lo, t] is in [0, 2^32) and limb[t] > 0. */
    uint64_t l0 = (uint64_t)a->limb[t];
    uint64_t l1 = t - 1 >= a->lo ? (uint64_t)a->limb[t - 1] : 0;
    uint64_t l2 = t - 2 >= a->lo ? (uint64_t)a->limb[t - 2] : 0;
    int hb = 63 - __builtin_clzll(l0); /* 0..31 */
    *m = (l0 << (63 - hb)) | (l1 << (31 - hb)) | (l2 >> (hb + 1));
    int st = (l2 & ((UINT64_C(1) << (hb + 1)) - 1)) != 0;
    for (int i = a->lo; !st && i <= t - 3; i++) st = a->limb[i] != 0;
    *sticky = st;
    int p = 32 * t + hb; /* global bit of the top 1 */
    *e = p - 63 - 1074;
    return sign;
}

static int special_result(const ds41_xacc *a, float *out) {
    if (a->nan || (a->pinf && a->ninf)) {
        *out = NAN;
        return 1;
    }
    if (a->pinf || a->ninf) {
        *out = a->pinf ? INFINITY : -INFINITY;
        return 1;
    }
    return 0;
}

float ds41_xacc_round(ds41_xacc *a) {
    float r;
    if (special_result(a, &r)) {
        xacc_clear(a);
        return r;
    }
    uint64_t m;
    int e, sticky;
    int sign = xacc_extract(a, &m, &e, &sticky);
    xacc_clear(a);
    if (sign == 0) return 0.0f; /* an exact zero is +0 */
    r = round_to_f32(m, e, sticky);
    return sign < 0 ? -r : r;
}

float ds41_xacc_round_div(ds41_xacc *a, uint64_t n) {
    float r;
    if (special_result(a, &r)) {
        xacc_clear(a);
        return r;
    }
    uint64_t m;
    int e, sticky;
    int sign = xacc_extract(a, &m, &e, &sticky);
    xacc_clear(a);
    if (sign == 0) return 0.0f;
    if (n == 0) return sign < 0 ? -INFINITY : INFINITY;
    /* S = (m + d) 2^e with 0 <= d < 1 (d > 0 iff sticky).  S/n = (q + (rem + d)/n) 2^e
     * with q = m / n, rem = m % n; rem + d < n, so q is the floor and the
     * fraction is non-zero iff rem > 0 or d > 0.  q keeps 64 - log2(n) bits,
     * plenty for fp32 while n < 2^32. */
    if (n >= (UINT64_C(1) << 32)) {
        /* Not used by the engine; keep the result defined: drop low bits of n
         * and m together (inexact, documented limit). */
        while (n >= (UINT64_C(1) << 32)) {
            sticky |= (int)(m & 1);
            m >>= 1;
            e++;
            n >>= 1;
        }
    }
    uint64_t q = m / n, rem = m % n;
    r = round_to_f32(q, e, sticky || rem != 0);
    return sign < 0 ? -r : r;
}

/* ---- reductions ---------------------------------------------------------------- */

/* Fast path of every reduction: s is the plain double sum of n exact terms
 * and abs_sum the double sum of their magnitudes.  Recursive summation keeps
 * |s - exact| <= (n-1) u sum|t| / (1 - (n-1) u) with u = 2^-53, in any
 * summation order (the callers may keep several partial sums); we use the
 * looser bound e = (n+2) 2^-52 abs_sum (which also covers the rounding of
 * abs_sum itself).  [lo, hi] = [s - e, s + e], each pushed one more double
 * outward, strictly contains the exact sum; rounding to fp32 is monotonic,
 * so if both ends round to the same float, so does the exact sum, and that
 * float is the correctly rounded result.  Otherwise (including a sum sitting
 * on an fp32 tie, non-finite values, and divisions) the caller falls back to
 * the exact accumulator.  div > 1 checks round(exact / div) the same way. */
static int fast_round(double s, double abs_sum, size_t n, uint64_t div, float *out) {
    if (!isfinite(s) || !isfinite(abs_sum)) return 0;
    if (abs_sum == 0.0) {
        *out = 0.0f; /* every term is +-0: the exact sum is +0 */
        return 1;
    }
    const double e = (double)(n + 2) * 0x1p-52 * abs_sum;
    if (!isfinite(e)) return 0;
    double lo = nextafter(s - e, -INFINITY), hi = nextafter(s + e, INFINITY);
    if (div > 1) {
        lo = nextafter(lo / (double)div, -INFINITY);
        hi = nextafter(hi / (double)div, INFINITY);
    }
    const float flo = (float)lo, fhi = (float)hi;
    /* Equal floats, and not a zero: a zero result needs the exact sign rule
     * (an exact zero is +0, a tiny non-zero keeps its sign). */
    if (flo != fhi || flo == 0.0f) return 0;
    *out = flo;
    return 1;
}

int ds41_xsum_try_round(double s, double abs_sum, size_t n, float *out) {
    return fast_round(s, abs_sum, n, 1, out);
}

/* Second chance before the exact accumulator: when every term is a multiple
 * of 2^g and n * max|t| < 2^(g+52), every partial sum in any order is an
 * integer multiple of 2^g below 2^53 units, i.e. exactly representable: the
 * double sum s IS the exact sum and one conversion rounds it correctly
 * (ties included).  This is the common case of ties on the fp32 grid. */
typedef struct grid {
    int g;     /* lowest set bit exponent over the terms */
    double mx; /* max |t| */
} grid;

static inline void grid_add(grid *gr, double t) {
    uint64_t b;
    memcpy(&b, &t, sizeof b);
    const int e = (int)((b >> 52) & 0x7ff);
    uint64_t m = b & ((UINT64_C(1) << 52) - 1);
    if (e == 0 && m == 0) return;
    if (e != 0) m |= UINT64_C(1) << 52;
    const int lsb = (e ? e : 1) - 1075 + __builtin_ctzll(m);
    if (lsb < gr->g) gr->g = lsb;
    const double a = fabs(t);
    if (a > gr->mx) gr->mx = a;
}

static int grid_exact(const grid *gr, double s, size_t n, float *out) {
    if (!isfinite(s) || gr->mx == 0.0 || gr->g > 900) return 0;
    if (gr->mx * (double)(n + 1) >= ldexp(1.0, gr->g + 52)) return 0;
    *out = s == 0.0 ? 0.0f : (float)s;
    return 1;
}

float ds41_xsum_f64(const double *t, size_t n) {
    double s = 0.0, a = 0.0;
    for (size_t i = 0; i < n; i++) {
        s += t[i];
        a += fabs(t[i]);
    }
    float r;
    if (fast_round(s, a, n, 1, &r)) return r;
    grid gr = {INT32_MAX, 0.0};
    for (size_t i = 0; i < n; i++) grid_add(&gr, t[i]);
    if (grid_exact(&gr, s, n, &r)) return r;
    ds41_xacc acc;
    ds41_xacc_init(&acc);
    for (size_t i = 0; i < n; i++) ds41_xacc_add(&acc, t[i]);
    return ds41_xacc_round(&acc);
}

float ds41_xsum_f32(const float *x, size_t n) {
    double s = 0.0, a = 0.0;
    for (size_t i = 0; i < n; i++) {
        s += (double)x[i];
        a += fabs((double)x[i]);
    }
    float r;
    if (fast_round(s, a, n, 1, &r)) return r;
    grid gr = {INT32_MAX, 0.0};
    for (size_t i = 0; i < n; i++) grid_add(&gr, (double)x[i]);
    if (grid_exact(&gr, s, n, &r)) return r;
    ds41_xacc acc;
    ds41_xacc_init(&acc);
    for (size_t i = 0; i < n; i++) ds41_xacc_add(&acc, (double)x[i]);
    return ds41_xacc_round(&acc);
}

float ds41_xdot_f32(const float *x, const float *y, size_t n) {
    /* Two interleaved partial sums: the error bound of fast_round holds for
     * any summation order. */
    double s0 = 0.0, s1 = 0.0, a0 = 0.0, a1 = 0.0;
    size_t i = 0;
    for (; i + 2 <= n; i += 2) {
        const double p = (double)x[i] * (double)y[i], q = (double)x[i + 1] * (double)y[i + 1];
        s0 += p;
        s1 += q;
        a0 += fabs(p);
        a1 += fabs(q);
    }
    for (; i < n; i++) {
        const double p = (double)x[i] * (double)y[i];
        s0 += p;
        a0 += fabs(p);
    }
    const double s = s0 + s1, a = a0 + a1;
    float r;
    if (fast_round(s, a, n, 1, &r)) return r;
    grid gr = {INT32_MAX, 0.0};
    for (i = 0; i < n; i++) grid_add(&gr, (double)x[i] * (double)y[i]);
    if (grid_exact(&gr, s, n, &r)) return r;
    ds41_xacc acc;
    ds41_xacc_init(&acc);
    for (i = 0; i < n; i++) ds41_xacc_add(&acc, (double)x[i] * (double)y[i]);
    return ds41_xacc_round(&acc);
}

/* bf16 bits -> fp32 (exact), inlined for the dot product loops. */
static inline float widen_bf16(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float ds41_xdot_f32_bf16(const float *x, const uint16_t *y, size_t n) {
    double s0 = 0.0, s1 = 0.0, a0 = 0.0, a1 = 0.0;
    size_t i = 0;
    for (; i + 2 <= n; i += 2) {
        const double p = (double)x[i] * (double)widen_bf16(y[i]);
        const double q = (double)x[i + 1] * (double)widen_bf16(y[i + 1]);
        s0 += p;
        s1 += q;
        a0 += fabs(p);
        a1 += fabs(q);
    }
    for (; i < n; i++) {
        const double p = (double)x[i] * (double)widen_bf16(y[i]);
        s0 += p;
        a0 += fabs(p);
    }
    const double s = s0 + s1, a = a0 + a1;
    float r;
    if (fast_round(s, a, n, 1, &r)) return r;
    grid gr = {INT32_MAX, 0.0};
    for (i = 0; i < n; i++) grid_add(&gr, (double)x[i] * (double)widen_bf16(y[i]));
    if (grid_exact(&gr, s, n, &r)) return r;
    ds41_xacc acc;
    ds41_xacc_init(&acc);
    for (i = 0; i < n; i++) ds41_xacc_add(&acc, (double)x[i] * (double)widen_bf16(y[i]));
    return ds41_xacc_round(&acc);
}

float ds41_mean_sq_f32(const float *x, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) {
        const float sq = x[i] * x[i];
        s += (double)sq; /* squares are non-negative: abs_sum = s */
    }
    float r;
    if (fast_round(s, s, n, n, &r)) return r;
    ds41_xacc acc;
    ds41_xacc_init(&acc);
    for (size_t i = 0; i < n; i++) {
        const float sq = x[i] * x[i];
        ds41_xacc_add(&acc, (double)sq);
    }
    return ds41_xacc_round_div(&acc, n);
}

/* ---- elementwise ---------------------------------------------------------------- */

float ds41_rm_exp(float x) {
    return (float)exp((double)x);
}

float ds41_rm_sqrt(float x) {
    return (float)sqrt((double)x);
}

float ds41_rm_rsqrt(float x) {
    return (float)(1.0 / sqrt((double)x));
}

float ds41_rm_sigmoid(float x) {
    return (float)(1.0 / (1.0 + exp(-(double)x)));
}

float ds41_rm_silu(float x) {
    return (float)((double)x / (1.0 + exp(-(double)x)));
}

float ds41_rm_softplus(float x) {
    if (x > 20.0f) return x;
    return (float)log1p(exp((double)x));
}

/* ---- rope ------------------------------------------------------------------------ */

/* YaRN correction dimension (§2.6): rd * ln(orig / (r * 2 pi)) / (2 ln base). */
static double yarn_dim(double r, int rd, double orig, double base) {
    return (double)rd * log(orig / (r * 2.0 * M_PI)) / (2.0 * log(base));
}

void ds41_rope_freqs(int rd, double base, int64_t original_seq_len, double factor, double beta_fast,
                     double beta_slow, float *f) {
    const int n = rd / 2;
    const float base32 = (float)base;
    for (int i = 0; i < n; i++) {
        float ex = (float)(2 * i) / (float)rd;
        float p = (float)pow((double)base32, (double)ex);
        f[i] = 1.0f / p;
    }
    if (original_seq_len <= 0) return;
    double low = floor(yarn_dim(beta_fast, rd, (double)original_seq_len, base));
    double high = ceil(yarn_dim(beta_slow, rd, (double)original_seq_len, base));
    if (low < 0) low = 0;
    if (high > rd - 1) high = rd - 1;
    double span = high - low > 1e-3 ? high - low : 1e-3;
    const float span32 = (float)span;
    const float factor32 = (float)factor;
    for (int i = 0; i < n; i++) {
        float ramp = (float)((double)i - low) / span32;
        if (ramp < 0.0f) ramp = 0.0f;
        if (ramp > 1.0f) ramp = 1.0f;
        float smooth = 1.0f - ramp;
        float scaled = f[i] / factor32;
        float a = scaled * (1.0f - smooth);
        float b = f[i] * smooth;
        f[i] = a + b;
    }
}

void ds41_rope_cos_sin(const float *f, int n_pairs, uint64_t pos, float *cs) {
    const float t = (float)pos;
    for (int i = 0; i < n_pairs; i++) {
        float ang = t * f[i];
        cs[2 * i] = (float)cos((double)ang);
        cs[2 * i + 1] = (float)sin((double)ang);
    }
}

void ds41_rope_apply(float *x, int n_pairs, const float *cs, int inverse) {
    for (int i = 0; i < n_pairs; i++) {
        const float a = x[2 * i], b = x[2 * i + 1];
        const float c = cs[2 * i], s = cs[2 * i + 1];
        float na, nb;
        if (!inverse) {
            float ac = a * c, bs = b * s, as = a * s, bc = b * c;
            na = ac - bs;
            nb = as + bc;
        } else {
            float ac = a * c, bs = b * s, bc = b * c, as = a * s;
            na = ac + bs;
            nb = bc - as;
        }
        x[2 * i] = ds41_bf16_round(na);
        x[2 * i + 1] = ds41_bf16_round(nb);
    }
}

/* see refmath.h */
void ds41_rm_moe_combine_token(const float *oe, const uint32_t *slot, size_t n, const float *shared, size_t D,
                               float *out) {
    for (size_t d = 0; d < D; d++) out[d] = 0.0f;
    for (size_t j = 0; j < n; j++) {
        const float *o = oe + (size_t)slot[j] * D;
        for (size_t d = 0; d < D; d++) out[d] = out[d] + o[d];
    }
    for (size_t d = 0; d < D; d++) out[d] = ds41_bf16_round(out[d] + shared[d]);
}

/* see refmath.h */
void ds41_rm_compress_pool(const float *ckv, const float *csc, int ratio, size_t hd, float *ex,
                           float *pooled) {
    for (size_t ch = 0; ch < hd; ch++) {
        float mx = csc[ch];
        for (int t = 1; t < ratio; t++) mx = csc[(size_t)t * hd + ch] > mx ? csc[(size_t)t * hd + ch] : mx;
        float sum = 0.0f;
        for (int t = 0; t < ratio; t++) {
            ex[t] = ds41_rm_exp(csc[(size_t)t * hd + ch] - mx);
            sum = t ? sum + ex[t] : ex[t];
        }
        float acc = 0.0f;
        for (int t = 0; t < ratio; t++) {
            const float w = ex[t] / sum;
            const float term = ckv[(size_t)t * hd + ch] * w;
            acc = t ? acc + term : term;
        }
        pooled[ch] = ds41_bf16_round(acc);
    }
}

/* see refmath.h */
void ds41_rm_hc_sinkhorn(const float *mix, const float *scale, const float *base, int hc, int iters, float eps,
                         float *pre, float *post, float *c) {
    for (int i = 0; i < hc; i++) {
        const float t = mix[i] * scale[0];
        pre[i] = ds41_rm_sigmoid(t + base[i]) + eps;
    }
    for (int i = 0; i < hc; i++) {
        const float t = mix[hc + i] * scale[1];
        post[i] = 2.0f * ds41_rm_sigmoid(t + base[hc + i]);
    }
    for (int i = 0; i < hc * hc; i++) {
        const float t = mix[2 * hc + i] * scale[2];
        c[i] = t + base[2 * hc + i];
    }
    for (int i = 0; i < hc; i++) {
        float *row = c + i * hc;
        float mx = row[0];
        for (int j = 1; j < hc; j++) mx = row[j] > mx ? row[j] : mx;
        float sum = 0.0f;
        for (int j = 0; j < hc; j++) {
            row[j] = ds41_rm_exp(row[j] - mx);
            sum = j ? sum + row[j] : row[j];
        }
        for (int j = 0; j < hc; j++) row[j] = row[j] / sum + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            for (int i = 0; i < hc; i++) {
                float s = c[i * hc];
                for (int j = 1; j < hc; j++) s = s + c[i * hc + j];
                const float d = s + eps;
                for (int j = 0; j < hc; j++) c[i * hc + j] = c[i * hc + j] / d;
            }
        }
        for (int j = 0; j < hc; j++) {
            float s = c[j];
            for (int i = 1; i < hc; i++) s = s + c[i * hc + j];
            const float d = s + eps;
            for (int i = 0; i < hc; i++) c[i * hc + j] = c[i * hc + j] / d;
        }
    }
}
