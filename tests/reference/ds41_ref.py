#!/usr/bin/python3
"""Independent numpy reference of the DeepSeek-V4.1 text forward pass.

Written from /work/shared/spec/REFERENCE.md only (sections 0.1, 1, 2, 3, 6, 8, 9, 10), in ds41's
canonical "reference mode" (REFERENCE.md section 10): every reduction is the exact sum of its terms
rounded once to fp32, bf16 rounding (RNE) at every point section 10.1 lists, FP8/FP4 GEMMs per
section 10.3, transcendental functions in double rounded to fp32, elementwise fp32 operations in the
spec's expression order without fused multiply-add.  A C engine's reference mode is meant to agree
with this file bit for bit.

Every place where the spec leaves a choice open is marked with a comment starting `# DECISION:`;
tests/reference/README.md lists them all.

Library use:
    model = Model('/path/to/checkpoint')
    state = model.new_state()
    logits = model.forward(state, [0, 17, 42])      # any chunk, any position
    logits = model.forward(state, [5])              # decode = a chunk of one

CLI (same interface as the C tool ds41-eval):
    ds41_ref.py --model DIR --ids 0,17,42 [--chunk N] [--decode K] [--drafts] [--dump STREAMS.safetensors] --out FILE.json
    ds41_ref.py --model DIR --layer-check DUMP.safetensors --out REPORT.json
"""

import argparse
import json
import math
import os
import re
import struct
import sys
import unicodedata

import numpy as np

f32 = np.float32
F64 = np.float64
INF32 = f32(np.inf)


class RefError(Exception):
    """A checkpoint, config or input problem; the message names the file / tensor / key."""


# ================================================================================================
# Scalar formats (REFERENCE.md section 1)
# ================================================================================================

def bf16(x):
    """Round float32 values to bfloat16 with round-to-nearest-even; returned as float32.

    NaN stays NaN (quiet); values that round past the largest bf16 become +-inf (plain RNE).
    """
    a = np.array(x, dtype=np.float32, copy=False, ndmin=1)
    u = a.view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    nan = np.isnan(a)
    if nan.any():
        r = np.where(nan, (u | 0x00400000) & 0xFFFF0000, r)
    out = r.astype(np.uint32).view(np.float32)
    return out.reshape(np.shape(x))


def _build_e4m3_table():
    t = np.empty(256, np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 15
        m = b & 7
        if e == 15 and m == 7:
            v = math.nan
        elif e == 0:
            v = sign * m * 2.0 ** -9
        else:
            v = sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)
        t[b] = v
    return t


E4M3_TABLE = _build_e4m3_table()
E2M1_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
R448 = f32(1.0 / 448.0)   # 0.0022321429569274187
R6 = f32(1.0 / 6.0)       # 0.1666666716337204


def e8m0_value(b):
    """F8_E8M0 byte -> float32 2^(b-127); 255 -> NaN; 0 -> 2^-127 (an fp32 subnormal, exact)."""
    b = np.asarray(b, np.uint8)
    with np.errstate(over='ignore'):
        v = np.ldexp(np.ones(b.shape, np.float32), b.astype(np.int32) - 127).astype(np.float32)
    return np.where(b == 255, np.float32(np.nan), v).astype(np.float32)


def e4m3_rne(v):
    """Round float32 values (already clamped to [-448, 448]) to the e4m3 grid, RNE; float32 out.

    Normal binades [2^e, 2^(e+1)) with e >= -6 have quantum 2^(e-3); below 2^-6 the subnormal
    quantum 2^-9 applies.  The sign of zero is kept; NaN stays NaN.
    """
    v64 = np.asarray(v, np.float32).astype(np.float64)
    _, ex = np.frexp(v64)
    ex = np.maximum(ex - 1, -6)
    q = np.ldexp(1.0, ex - 3)
    r = np.rint(v64 / q) * q
    return np.copysign(r, v64).astype(np.float32)


def e4m3_encode(v):
    """float32 -> e4m3 codes (uint8): clamp to [-448, 448], RNE, sign of zero kept, NaN -> 0x7F/0xFF."""
    x = np.clip(np.asarray(v, np.float32), f32(-448), f32(448))
    r = e4m3_rne(x).astype(np.float64)
    neg = np.signbit(r)
    a = np.abs(r)
    _, ex = np.frexp(a)
    ex = ex - 1
    sub = a < 2.0 ** -6
    e = np.where(sub, 0, ex + 7)
    with np.errstate(invalid='ignore'):
        m = np.where(sub, a / 2.0 ** -9, a / np.ldexp(1.0, np.where(sub, 0, ex)) * 8.0 - 8.0)
    nan = np.isnan(a)
    m = np.where(nan, 7, m)
    e = np.where(nan, 15, e)
    code = (neg.astype(np.int64) << 7) | (e.astype(np.int64) << 3) | m.astype(np.int64)
    return code.astype(np.uint8)


# thresholds between consecutive E2M1 magnitudes; True = a tie goes up (to the even code)
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                    (2.5, False), (3.5, True), (5.0, False))


def e2m1_encode(v):
    """float32 in [-6, 6] -> 4-bit E2M1 codes (uint8 0..15), RNE (ties to the even code)."""
    v = np.asarray(v, np.float32)
    a = np.abs(v)
    c = np.zeros(v.shape, np.uint8)
    for thr, tie_up in _E2M1_THRESHOLDS:
        c += (a >= thr) if tie_up else (a > thr)
    c |= (np.signbit(v).astype(np.uint8) << 3)
    return c


def ue8m0_exponent(amax, recip):
    """REFERENCE.md 1.2 steps 2-3: k with scale 2^k, from an (already floored) fp32 amax.

    t = fp32(amax * recip) (multiplication by the fp32 reciprocal), k = E-127 + (M != 0).
    """
    t = (np.asarray(amax, np.float32) * recip).astype(np.float32)
    bits = np.array(t, ndmin=1).view(np.uint32).reshape(np.shape(t))
    E = ((bits >> 23) & 0xFF).astype(np.int64)
    M = bits & 0x7FFFFF
    return E - 127 + (M != 0).astype(np.int64)


def pow2_f32(k):
    """float32 2^k for integer arrays k.

    # DECISION: a scale exponent outside the fp32 range (only reachable with inf/NaN amax, which
    # the floors exclude for finite data) is produced by ldexp (0, subnormal or inf), not by the
    # bit construction (k+127)<<23.
    """
    k = np.asarray(k, np.int64)
    return np.ldexp(np.ones(k.shape, np.float32), np.clip(k, -300, 300).astype(np.int32)).astype(np.float32)


def act_quant_fp8(x):
    """act_quant(x, 32, ue8m0) of bf16-valued float32 x [..., K] -> (e4m3 values float32 [..., K],
    scales float32 [..., K/32])."""
    shp = x.shape
    xb = np.asarray(x, np.float32).reshape(shp[:-1] + (shp[-1] // 32, 32))
    amax = np.maximum(np.max(np.abs(xb), axis=-1), f32(1e-4))
    s = pow2_f32(ue8m0_exponent(amax, R448))
    q = e4m3_rne(np.clip(xb / s[..., None], f32(-448), f32(448)))
    return q.reshape(shp), s


def qdq_fp8(x):
    """FP8 1x32 ue8m0 QDQ (the window KV cache): bf16(e4m3(q) * s)."""
    q, s = act_quant_fp8(x)
    shp = x.shape
    qb = q.reshape(shp[:-1] + (shp[-1] // 32, 32))
    return bf16(qb * s[..., None]).reshape(shp)


def qdq_fp4_ue8m0(x, block=32):
    """fp4_act_quant, indexer variant: 1x32, E8M0 scale, amax floor 6*2^-126, inplace QDQ."""
    shp = x.shape
    xb = np.asarray(x, np.float32).reshape(shp[:-1] + (shp[-1] // block, block))
    amax = np.maximum(np.max(np.abs(xb), axis=-1), f32(6 * 2.0 ** -126))
    s = pow2_f32(ue8m0_exponent(amax, R6))[..., None]
    v = np.clip(xb / s, f32(-6), f32(6))
    val = E2M1_TABLE[e2m1_encode(v)]
    return bf16(val * s).reshape(shp)


def qdq_fp4_e4m3scale(x, block=16):
    """fp4_act_quant, compressed-KV variant: 1x16, e4m3 scale fp32(amax/6) (true division),
    amax floor 6*2^-9, inplace QDQ."""
    shp = x.shape
    xb = np.asarray(x, np.float32).reshape(shp[:-1] + (shp[-1] // block, block))
    amax = np.maximum(np.max(np.abs(xb), axis=-1), f32(6 * 2.0 ** -9))
    s = e4m3_rne(np.clip(amax / f32(6.0), f32(-448), f32(448)))[..., None]
    v = np.clip(xb / s, f32(-6), f32(6))
    val = E2M1_TABLE[e2m1_encode(v)]
    return bf16(val * s).reshape(shp)


# ================================================================================================
# Canonical reductions (REFERENCE.md 10.2): exact sum of the terms, rounded once to fp32
# ================================================================================================

_SHIFT = 1100            # every finite double is an integer multiple of 2^-1074
_FLT_LIMIT = 2.0 ** 128  # a rounded magnitude reaching 2^128 is +-inf
STATS = {'exact_fallbacks': 0}


def round_rational_f32(num, den):
    """Correctly rounded (RNE) fp32 value of the rational num/den (Python ints, den > 0).

    # DECISION: an exact zero sum is +0.0 (the sum is a real number; the sign of the terms' zeros
    # does not survive an exact reduction).  A non-zero value that rounds to zero keeps its sign.
    """
    if num == 0:
        return 0.0
    neg = num < 0
    num = -num if neg else num
    e = num.bit_length() - den.bit_length()
    if (num << max(0, -e)) < (den << max(0, e)):
        e -= 1
    q = max(e - 23, -149)
    if q >= 0:
        D = den << q
        t, r = divmod(num, D)
    else:
        D = den
        t, r = divmod(num << -q, den)
    if 2 * r > D or (2 * r == D and (t & 1)):
        t += 1
    v = math.ldexp(t, q) if t else 0.0
    if v >= _FLT_LIMIT:
        v = math.inf
    return -v if neg else v


def exact_sum_f32(terms, divisor=1):
    """fp32(exact(sum(terms)) / divisor) for finite float terms, via Python integers."""
    num = 0
    for t in terms:
        n, d = float(t).as_integer_ratio()
        num += n << (_SHIFT - (d.bit_length() - 1))
    return round_rational_f32(num, int(divisor) << _SHIFT)


def _double_sum_is_exact(T):
    """Per row of T [m, n]: True when every partial sum of the row, in any order, is exactly
    representable in double (all terms are multiples of 2^g and n * max|t| < 2^(g+53))."""
    n = T.shape[1]
    nz = T != 0
    mant, e = np.frexp(T)                                   # T = mant * 2^e, |mant| in [0.5, 1)
    M = (mant * 2.0 ** 53).astype(np.int64)                 # exact integer significand
    low = (M & -M).astype(np.float64)                        # lowest set bit, 2^(tz)
    _, tz1 = np.frexp(low)                                   # low = 2^(tz1-1)
    lowexp = e - 53 + (tz1 - 1)
    big = 1 << 20
    g = np.where(nz, lowexp, big).min(axis=1)
    emax = np.where(nz, e, -big).max(axis=1)
    grow = int(math.ceil(math.log2(n))) if n > 1 else 0
    return emax + grow <= g + 53


def _finish(s, a, n, divisor, get_terms):
    """Turn a floating sum `s` (any order, double) of n exact double terms whose absolute values
    sum to `a` into the correctly rounded fp32 of the exact sum (divided by divisor).

    1. The floating result is accepted when its error bound cannot change the fp32 rounding.
    2. Otherwise (typically sums that land exactly on an fp32 midpoint, or heavy cancellation) the
       terms are re-examined: when they provably sum exactly in double, the double sum is exact
       and one RNE conversion (plus the division, checked the same way) gives the answer.
    3. What remains is rounded from the exact rational with Python integers.
    Rows containing inf/NaN follow IEEE addition.
    """
    shape = np.shape(s)
    s = np.array(s, np.float64, ndmin=1).reshape(-1)
    a = np.array(a, np.float64, ndmin=1).reshape(-1)
    with np.errstate(invalid='ignore', over='ignore'):
        err = a * ((n + 2) * 2.0 ** -52)
        q = s / divisor
        qerr = err / divisor + np.abs(q) * 2.0 ** -51
        lo = (q - qerr).astype(np.float32)
        hi = (q + qerr).astype(np.float32)
        r = q.astype(np.float32)
    ok = (lo == r) & (hi == r) & (r != 0)
    zero = a == 0
    r[zero] = 0.0
    ok |= zero
    nonfin = ~np.isfinite(a)
    if nonfin.any():
        r[nonfin] = s[nonfin].astype(np.float32)
        ok |= nonfin
    bad = np.nonzero(~ok)[0]
    if len(bad):
        T = np.asarray(get_terms(bad), np.float64).reshape(len(bad), -1)
        exact = _double_sum_is_exact(T)
        se = T.sum(axis=1)
        qe = se / divisor
        pow2 = divisor & (divisor - 1) == 0
        with np.errstate(invalid='ignore', over='ignore'):
            re = qe.astype(np.float32)
            if not pow2:
                d = np.abs(qe) * 2.0 ** -51
                exact &= ((qe - d).astype(np.float32) == re) & ((qe + d).astype(np.float32) == re)
        re[se == 0] = 0.0
        r[bad[exact]] = re[exact]
        hard = bad[~exact]
        T = T[~exact]
        STATS['exact_fallbacks'] += len(hard)
        for j, i in enumerate(hard):
            r[i] = exact_sum_f32(T[j], divisor)
    return r.reshape(shape)


def xsum(T, axis=-1, divisor=1):
    """fp32 of the exact sum of the (double-exact) terms T along axis, divided by divisor."""
    T = np.moveaxis(np.asarray(T, np.float64), axis, -1)
    n = T.shape[-1]
    s = T.sum(axis=-1)
    a = np.abs(T).sum(axis=-1)
    T2 = T.reshape(-1, n)
    return _finish(s, a, n, divisor, lambda idx: T2[idx])


def xdot(A, B):
    """fp32 of the exact A @ B.T: A [..., K], B [N, K]; every product must be exact in double
    (true for fp32 x fp32 products)."""
    A = np.asarray(A, np.float64)
    B = np.asarray(B, np.float64)
    lead = A.shape[:-1]
    K = A.shape[-1]
    A2 = A.reshape(-1, K)
    N = B.shape[0]
    s = A2 @ B.T
    a = np.abs(A2) @ np.abs(B).T
    r = _finish(s, a, K, 1, lambda idx: A2[idx // N] * B[idx % N])
    return r.reshape(lead + (N,))


def seqsum(x, axis=-1):
    """Short sum in index order ((x0 + x1) + x2) + ... with fp32 rounding after every addition
    (REFERENCE.md 10.4)."""
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    acc = x[..., 0].copy()
    for i in range(1, x.shape[-1]):
        acc = acc + x[..., i]
    return acc


# ================================================================================================
# Transcendentals (REFERENCE.md 10.5): computed in double with the C library (Python's math
# module calls libm), rounded once to fp32.
# ================================================================================================

def _exp(x):
    return math.inf if x > 709.0 else math.exp(x)


def _sigmoid(x):
    # DECISION: sigmoid(x) = 1 / (1 + exp(-x)), evaluated in double, rounded once.
    return 1.0 / (1.0 + _exp(-x))


def _silu(x):
    # DECISION: silu(x) = x / (1 + exp(-x)), evaluated in double, rounded once.
    return x / (1.0 + _exp(-x))


def _softplus(x):
    # REFERENCE.md 10.5: x if x > 20 else log1p(exp(x)), in double, rounded once.
    return x if x > 20.0 else math.log1p(_exp(x))


def _mathfn(fn):
    uf = np.frompyfunc(fn, 1, 1)

    def apply(x):
        x = np.asarray(x, np.float32).astype(np.float64)
        return np.asarray(uf(x), dtype=np.float64).astype(np.float32)
    return apply


f_exp = _mathfn(_exp)
f_sigmoid = _mathfn(_sigmoid)
f_silu = _mathfn(_silu)
f_softplus = _mathfn(_softplus)
f_cos = _mathfn(math.cos)
f_sin = _mathfn(math.sin)


def f_sqrt(x):
    with np.errstate(invalid='ignore'):
        return np.sqrt(np.asarray(x, np.float32).astype(np.float64)).astype(np.float32)


def f_rsqrt(x):
    # DECISION: rsqrt(x) = 1 / sqrt(x) with sqrt and the division both in double (IEEE, correctly
    # rounded), then rounded once to fp32.  No fp32 rsqrt approximation anywhere.
    with np.errstate(divide='ignore', invalid='ignore'):
        return (1.0 / np.sqrt(np.asarray(x, np.float32).astype(np.float64))).astype(np.float32)


# ================================================================================================
# Building blocks
# ================================================================================================

def rmsnorm(x, w, eps):
    """RMSNorm: bf16(w * fp32(x * rsqrt(fp32(mean(fp32(x^2)) + eps)))) over the last dim.

    mean = the exact sum of the fp32 squares divided by n, rounded once (10.5)."""
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    ms = xsum((x * x).astype(np.float64), axis=-1, divisor=n)
    r = f_rsqrt(ms + eps)
    y = x * r[..., None]
    return bf16(w * y)


def bf16_linear(x, W):
    """Plain bf16 F.linear: bf16 of the exact fp32-accumulated dot products."""
    return bf16(xdot(x, W))


class QWeight:
    """An FP8 (32x32 block scales) or FP4 (1x32 scales) linear weight.

    vals: float64 [N, K] decoded element values (e4m3 or e2m1); scale: float32 [N, K/32] (the
    scale that applies to row n and K block kb)."""

    def __init__(self, vals, scale, name):
        self.vals = vals
        self.scale = scale
        self.name = name
        self.N, self.K = vals.shape
        # [KB, 32, N] layout for the per-block partial products
        self.blocks = np.ascontiguousarray(vals.reshape(self.N, self.K // 32, 32).transpose(1, 2, 0))


def qlinear(x, W):
    """FP8 / FP4 linear (REFERENCE.md 2.2, 2.3, 10.3): act_quant the bf16 input per 32, then per K
    block in K order p = fp32(exact block sum), acc = fp32(acc + fp32(p * fp32(a_s * b_s))),
    output bf16(acc)."""
    x = np.asarray(x, np.float32)
    lead = x.shape[:-1]
    K = x.shape[-1]
    if K != W.K:
        raise RefError(f"{W.name}: input width {K} != weight K {W.K}")
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    q, sa = act_quant_fp8(x2)
    KB = K // 32
    A = q.astype(np.float64).reshape(M, KB, 32).transpose(1, 0, 2)
    # The block partials are exact in double: e4m3 x e4m3 (or e2m1) products are multiples of
    # 2^-18 below 2^18, and 32 of them sum below 2^23 (41 significant bits at most).
    P = np.matmul(A, W.blocks).astype(np.float32)
    acc = np.zeros((M, W.N), np.float32)
    for kb in range(KB):
        sc = sa[:, kb, None] * W.scale[None, :, kb]
        acc = acc + P[kb] * sc
    return bf16(acc).reshape(lead + (W.N,))


# ---------------------------------------------------------------------------------------------
# RoPE (REFERENCE.md 2.6 + 10.5 + 10.6)
# ---------------------------------------------------------------------------------------------

def yarn_low_high(rd, base, orig, beta_fast, beta_slow):
    """The YaRN correction range (low, high), computed in double (REFERENCE.md 2.6)."""
    def cd(r):
        return rd * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(cd(beta_fast)), 0)
    high = min(math.ceil(cd(beta_slow)), rd - 1)
    return low, high


def rope_frequencies(rd, base, yarn=None):
    """f_i (float32 [rd/2]) per REFERENCE.md 10.5; yarn = (orig, factor, beta_fast, beta_slow)."""
    half = rd // 2
    # DECISION: the base enters pow() as its fp32 value (exact for the integer thetas in use).
    b = float(f32(base))
    f = []
    for i in range(half):
        e = f32(f32(2 * i) / f32(rd))
        p = f32(math.pow(b, float(e)))
        f.append(f32(f32(1.0) / p))
    if yarn is not None:
        orig, factor, beta_fast, beta_slow = yarn
        low, high = yarn_low_high(rd, float(base), float(orig), float(beta_fast), float(beta_slow))
        den = f32(max(high - low, 1e-3))
        fac = f32(factor)
        one = f32(1.0)
        for i in range(half):
            ramp = f32(f32(i - low) / den)
            ramp = min(max(ramp, f32(0.0)), f32(1.0))
            smooth = f32(one - ramp)
            f[i] = f32(f32(f32(f[i] / fac) * f32(one - smooth)) + f32(f[i] * smooth))
    return np.array(f, np.float32)


class Rope:
    """Per-layer rope parameters with a cos/sin table that grows with the positions used."""

    def __init__(self, rd, base, yarn):
        self.rd = rd
        self.freqs = rope_frequencies(rd, base, yarn)
        self.cos = np.zeros((0, rd // 2), np.float32)
        self.sin = np.zeros((0, rd // 2), np.float32)

    def table(self, pos):
        pos = np.asarray(pos, np.int64)
        need = int(pos.max()) + 1 if pos.size else 0
        if need > len(self.cos):
            n = max(need, 2 * len(self.cos), 64)
            t = np.arange(len(self.cos), n).astype(np.float32)
            ang = t[:, None] * self.freqs[None, :]           # fp32(fp32(t) * f_i)
            self.cos = np.concatenate([self.cos, f_cos(ang)])
            self.sin = np.concatenate([self.sin, f_sin(ang)])
        return self.cos[pos], self.sin[pos]

    def apply(self, x, pos, inverse=False):
        """Rotate the last rd features of x [S, ..., W] (adjacent pairs) at positions pos [S];
        fp32 math, bf16 write-back.  Returns a new array."""
        x = np.array(x, np.float32)
        S = x.shape[0]
        c, s = self.table(pos)
        shp = (S,) + (1,) * (x.ndim - 2) + (self.rd // 2,)
        c = c.reshape(shp)
        s = s.reshape(shp)
        part = x[..., x.shape[-1] - self.rd:]
        a = part[..., 0::2]
        b = part[..., 1::2]
        if not inverse:
            ra = (a * c) - (b * s)
            rb = (a * s) + (b * c)
        else:
            ra = (a * c) + (b * s)
            rb = (b * c) - (a * s)
        out = np.empty_like(part)
        out[..., 0::2] = ra
        out[..., 1::2] = rb
        x[..., x.shape[-1] - self.rd:] = bf16(out)
        return x


# ---------------------------------------------------------------------------------------------
# Hyper-connections (REFERENCE.md 2.5, 2.7)
# ---------------------------------------------------------------------------------------------

def hc_split_sinkhorn(mixes, scale, base, hc, iters, eps):
    """pre [S,hc], post [S,hc], comb [S,hc,hc] (fp32) from mixes [S,(2+hc)*hc]."""
    m_pre = mixes[:, :hc] * scale[0] + base[:hc]
    pre = f_sigmoid(m_pre) + eps
    m_post = mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc]
    post = f32(2.0) * f_sigmoid(m_post)
    c = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc)
    # DECISION: the softmax inside Sinkhorn sums its exps as a short sum in index order (it is a
    # Sinkhorn row sum, 10.4), not as an exact reduction.
    mx = np.max(c, axis=-1, keepdims=True)
    e = f_exp(c - mx)
    c = e / seqsum(e, axis=-1)[..., None]
    c = c + eps
    c = c / (seqsum(c, axis=1) + eps)[:, None, :]
    for _ in range(iters - 1):
        c = c / (seqsum(c, axis=-1) + eps)[..., None]
        c = c / (seqsum(c, axis=1) + eps)[:, None, :]
    return pre.astype(np.float32), post.astype(np.float32), c.astype(np.float32)


def hc_pre(x, pre):
    """bf16(((p0*x0 + p1*x1) + p2*x2) + p3*x3): x [S,hc,D] bf16 values, pre [S,hc] fp32."""
    # DECISION: the short sum starts with the first product (no leading 0 + ...).
    acc = pre[:, 0, None] * x[:, 0]
    for c in range(1, x.shape[1]):
        acc = acc + pre[:, c, None] * x[:, c]
    return bf16(acc)


def hc_post(o, res, post, comb):
    """copy j = bf16(fp32(post_j * o) + (((c0j*r0 + c1j*r1) + c2j*r2) + c3j*r3))."""
    # DECISION: the comb sum is a short sum in index order computed first, then added to post*o
    # (the reference's expression `post*o + sum_i(comb*res)`).
    hc = res.shape[1]
    out = np.empty_like(res)
    for j in range(hc):
        s = comb[:, 0, j, None] * res[:, 0]
        for i in range(1, hc):
            s = s + comb[:, i, j, None] * res[:, i]
        out[:, j] = bf16(post[:, j, None] * o + s)
    return out


# ---------------------------------------------------------------------------------------------
# Sparse attention with sink over the canonical list (REFERENCE.md 2.4, 10.7)
# ---------------------------------------------------------------------------------------------

def sparse_attn(q, rows, sink, scale):
    """q [H, hd] bf16 values; rows [L, hd] the canonical list (window ascending, then compressed
    ascending); sink [H] fp32; returns bf16 [H, hd]."""
    # DECISION: per 64-chunk of the canonical list, with every operation rounded to fp32:
    #   z = fp32(exact(q.kv) ) * scale, m' = max(m, max z), corr = exp(m - m'), p = exp(z - m'),
    #   den = fp32(den * corr) + fp32(exact sum of the chunk's p),
    #   acc = fp32(acc * corr) + fp32(exact sum over the chunk of bf16(p) * kv),
    # then den = den + exp(sink - m_final) and out = bf16(acc / den).
    H, hd = q.shape
    z = xdot(q, rows) * scale                             # [H, L]
    m = np.full(H, f32(-1e30), np.float32)
    den = np.zeros(H, np.float32)
    acc = np.zeros((H, hd), np.float32)
    L = rows.shape[0]
    for c0 in range(0, L, 64):
        zc = z[:, c0:c0 + 64]
        vc = rows[c0:c0 + 64]
        m_new = np.maximum(m, np.max(zc, axis=1))
        corr = f_exp(m - m_new)
        p = f_exp(zc - m_new[:, None])
        den = den * corr + xsum(p.astype(np.float64), axis=1)
        pv = xdot(bf16(p), vc.T)                           # [H, hd]
        acc = acc * corr[:, None] + pv
        m = m_new
    den = den + f_exp(sink - m)
    return bf16(acc / den[:, None])


def topk_lowest_index(scores, k):
    """Indices of the k highest scores, equal scores -> lower index first (REFERENCE.md 9.2).
    Returned in selection order (descending score)."""
    return np.argsort(-np.asarray(scores, np.float32), axis=-1, kind='stable')[..., :k]


def record(ctx, kind, L, s, sel, score, err=None):
    """Keep decision `kind` of layer L, row s of the chunk (layer-local check)."""
    if getattr(ctx, 'dec', None) is None:
        return
    ctx.dec.setdefault((kind, L), {})[s] = (np.asarray(sel, np.int64), None if score is None else
                                            np.asarray(score, np.float32), err)


def forced_rows(ctx, kind, L):
    """The candidate's decisions of layer L forced into the reference, per row (or None)."""
    f = getattr(ctx, 'force', None)
    if not f or (kind, L) not in f:
        return None
    return [np.asarray([v for v in row if v >= 0], np.int64) for row in f[(kind, L)]]


def candidate_blocks(row, topk_blocks, block):
    """select_candidate_blocks for one query (REFERENCE.md 2.11) as (kept blocks ascending, block
    scores with the newest block pinned to +inf): row = index scores over the query's reachable
    positions [0, compress_len)."""
    T = len(row)
    if T == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    nb = -(-T // block)
    pad = np.full(nb * block, -np.inf, np.float32)
    pad[:T] = row
    bs = pad.reshape(nb, block).max(axis=1)
    bs[(T - 1) // block] = np.inf
    pick = topk_lowest_index(bs, min(topk_blocks, nb))
    pick = pick[bs[pick] > -np.inf]
    return np.sort(pick), bs


def blocks_to_mask(blocks, block, T):
    m = np.zeros(max(T, 1) + block, bool)
    for b in blocks:
        m[int(b) * block:(int(b) + 1) * block] = True
    return m[:T]


def candidate_mask(row, topk_blocks, block):
    """The candidate blocks of one query expanded to its reachable positions (bool [T])."""
    pick, _ = candidate_blocks(row, topk_blocks, block)
    return blocks_to_mask(pick, block, len(row))


# ================================================================================================
# Engram (REFERENCE.md 6)
# ================================================================================================

def bytes_to_unicode():
    """The GPT-2 byte-level alphabet: byte -> unicode character."""
    bs = list(range(ord('!'), ord('~') + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_UNICODE = bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}

WHITE_SPACE = frozenset(chr(c) for c in (0x9, 0xA, 0xB, 0xC, 0xD, 0x20, 0x85, 0xA0, 0x1680,
                                         *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F,
                                         0x3000))
_WS_RUN = re.compile(r'[ \t\r\n]+')


def byte_level_decode(token):
    """Decode one token string like the tokenizer's ByteLevel decoder + Rust from_utf8_lossy.

    # DECISION: a token string containing a character outside the byte-level alphabet (added
    # tokens such as <｜User｜>) contributes its own UTF-8 bytes; otherwise every character maps to
    # its byte.  The bytes are decoded with U+FFFD replacement of invalid sequences.
    """
    if all(ch in UNICODE_TO_BYTE for ch in token):
        raw = bytes(UNICODE_TO_BYTE[ch] for ch in token)
    else:
        raw = token.encode('utf-8')
    return raw.decode('utf-8', errors='replace')


def engram_normalize(text):
    """NFKC -> NFD -> drop combining marks (M*) -> per-character full lowercase -> runs of
    [ \\t\\r\\n]+ -> ' ' -> whole ' ' -> U+E000 -> strip White_Space at both ends -> U+E000 -> ' '."""
    t = unicodedata.normalize('NFKC', text)
    t = unicodedata.normalize('NFD', t)
    t = ''.join(ch for ch in t if not unicodedata.category(ch).startswith('M'))
    t = ''.join(ch.lower() for ch in t)
    t = _WS_RUN.sub(' ', t)
    if t == ' ':
        t = '\ue000'
    i, j = 0, len(t)
    while i < j and t[i] in WHITE_SPACE:
        i += 1
    while j > i and t[j - 1] in WHITE_SPACE:
        j -= 1
    return t[i:j].replace('\ue000', ' ')


def tokenizer_id_strings(tok, vocab_size, where='tokenizer.json'):
    """id -> raw token string for ids 0..vocab_size-1 (added tokens override the BPE vocab)."""
    try:
        vocab = tok['model']['vocab']
        added = tok.get('added_tokens') or []
    except (KeyError, TypeError) as e:
        raise RefError(f"{where}: missing model.vocab ({e})")
    strs = [None] * vocab_size
    for s, i in vocab.items():
        if isinstance(i, int) and 0 <= i < vocab_size:
            strs[i] = s
    for a in added:
        i = a.get('id')
        if isinstance(i, int) and 0 <= i < vocab_size:
            strs[i] = a['content']
    missing = [i for i, s in enumerate(strs) if s is None]
    if missing:
        raise RefError(f"{where}: token id {missing[0]} (< vocab_size {vocab_size}) is not defined")
    return strs


def compressed_token_map(tok, vocab_size, where='tokenizer.json'):
    """build_compressed_token_map (REFERENCE.md 6.1) -> (list id -> compressed id, count)."""
    strs = tokenizer_id_strings(tok, vocab_size, where)
    keys = {}
    cmap = []
    for raw in strs:
        text = byte_level_decode(raw)
        if '\ufffd' in text:
            key = raw
        else:
            key = engram_normalize(text)
            if key == '':
                key = text
        cmap.append(keys.setdefault(key, len(keys)))
    return cmap, len(keys)


def _is_prime(n):
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


def engram_primes(layer_ids, max_ngram, n_heads, vocab):
    """primes[layer_index][n-2][head] (REFERENCE.md 6.2, global seen set)."""
    seen = set()
    out = []
    for _ in layer_ids:
        per_layer = []
        for _n in range(2, max_ngram + 1):
            cur = vocab - 1
            ps = []
            for _h in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                ps.append(cur)
            per_layer.append(ps)
        out.append(per_layer)
    return out


def engram_multipliers(layer_id, max_ngram, compressed_vocab):
    """numpy default_rng(10007*L).integers(0, bound, size=max_ngram, int64)*2+1 (REFERENCE.md 6.2)."""
    bound = max(1, ((2 ** 63 - 1) // compressed_vocab) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    draws = rng.integers(0, bound, size=max_ngram, dtype=np.int64)
    return [int(v) * 2 + 1 for v in draws]


def engram_hash_rows(cids, positions, mult, primes, offsets, pad):
    """Row ids [len(positions), n_cols] (REFERENCE.md 6.3). cids: compressed id per absolute
    position (-1 = DEAD)."""
    N = len(mult)
    out = []
    for p in positions:
        toks = []
        blocked = False
        for k in range(N):
            if not blocked and (p < k or cids[p - k] < 0):
                blocked = True
            toks.append(pad if blocked else cids[p - k])
        h = toks[0] * mult[0]
        row = []
        for i in range(1, N):
            h ^= toks[i] * mult[i]
            for pr in primes[i - 1]:
                row.append(h % pr)
        out.append([c + o for c, o in zip(row, offsets)])
    return np.array(out, np.int64).reshape(len(positions), len(offsets))


# ================================================================================================
# Safetensors
# ================================================================================================

DTYPE_SIZES = {'BF16': 2, 'F32': 4, 'F8_E4M3': 1, 'F8_E8M0': 1, 'I8': 1, 'I64': 8, 'F16': 2,
               'U8': 1, 'I32': 4, 'F64': 8}


class SafetensorsFile:
    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, 'rb') as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise RefError(f"{path}: shorter than the 8-byte header length")
            n = struct.unpack('<Q', head)[0]
            if n > size - 8 or n > 100 * 2 ** 20:
                raise RefError(f"{path}: header length {n} exceeds the file")
            try:
                hdr = json.loads(fh.read(n).decode('utf-8'))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RefError(f"{path}: header is not JSON ({e})")
        if not isinstance(hdr, dict):
            raise RefError(f"{path}: header is not a JSON object")
        self.data_start = 8 + n
        self.data_size = size - self.data_start
        self.tensors = {}
        for name, info in hdr.items():
            if name == '__metadata__':
                continue
            try:
                dt = info['dtype']
                shape = [int(v) for v in info['shape']]
                b, e = (int(v) for v in info['data_offsets'])
            except (KeyError, TypeError, ValueError) as ex:
                raise RefError(f"{path}: tensor {name}: malformed entry ({ex})")
            if dt not in DTYPE_SIZES:
                raise RefError(f"{path}: tensor {name}: unsupported dtype {dt}")
            cnt = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if any(v < 0 for v in shape) or not (0 <= b <= e <= self.data_size) or e - b != cnt * DTYPE_SIZES[dt]:
                raise RefError(f"{path}: tensor {name}: offsets [{b},{e}) do not fit dtype {dt} shape {shape}")
            self.tensors[name] = (dt, shape, b, e)
        self._mm = None

    def raw(self, name):
        dt, shape, b, e = self.tensors[name]
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode='r')
        return self._mm[self.data_start + b:self.data_start + e], dt, shape

    def array(self, name):
        """Decode a tensor: BF16/F32 -> float32, I64 -> int64, F8/I8 -> uint8 bytes."""
        buf, dt, shape = self.raw(name)
        if dt == 'BF16':
            a = (np.frombuffer(buf, '<u2').astype(np.uint32) << 16).view(np.float32)
        elif dt == 'F32':
            a = np.frombuffer(buf, '<f4').astype(np.float32)
        elif dt == 'I64':
            a = np.frombuffer(buf, '<i8').astype(np.int64)
        elif dt in ('F8_E4M3', 'F8_E8M0', 'I8', 'U8'):
            a = np.frombuffer(buf, np.uint8).copy()
        elif dt == 'I32':
            a = np.frombuffer(buf, '<i4').astype(np.int32)
        elif dt == 'F16':
            a = np.frombuffer(buf, '<f2').astype(np.float32)
        else:
            a = np.frombuffer(buf, '<f8').astype(np.float64)
        return a.reshape(shape)


def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, dtype string, numpy array already in that dtype's byte layout)."""
    hdr = {}
    off = 0
    blobs = []
    for name, dt, arr in tensors:
        arr = np.ascontiguousarray(arr)
        data = arr.tobytes()
        hdr[name] = {'dtype': dt, 'shape': list(arr.shape), 'data_offsets': [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    if metadata:
        hdr['__metadata__'] = metadata
    h = json.dumps(hdr, separators=(',', ':')).encode('utf-8')
    h += b' ' * ((8 - len(h) % 8) % 8)
    with open(path, 'wb') as fh:
        fh.write(struct.pack('<Q', len(h)))
        fh.write(h)
        for b in blobs:
            fh.write(b)


class Checkpoint:
    """A Hugging Face checkpoint directory: model.safetensors.index.json + shards, or one
    model.safetensors."""

    def __init__(self, root):
        self.root = root
        idx = os.path.join(root, 'model.safetensors.index.json')
        self.files = {}
        self.where = {}
        if os.path.exists(idx):
            try:
                with open(idx, encoding='utf-8') as fh:
                    wm = json.load(fh)['weight_map']
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise RefError(f"{idx}: unreadable weight_map ({e})")
            for name, fn in wm.items():
                if not isinstance(fn, str) or '/' in fn or fn.startswith('.'):
                    raise RefError(f"{idx}: tensor {name}: bad shard name {fn!r}")
                if fn not in self.files:
                    self.files[fn] = SafetensorsFile(os.path.join(root, fn))
                if name not in self.files[fn].tensors:
                    raise RefError(f"{idx}: tensor {name} is not in shard {fn}")
                self.where[name] = self.files[fn]
        else:
            single = os.path.join(root, 'model.safetensors')
            if not os.path.exists(single):
                raise RefError(f"{root}: neither model.safetensors.index.json nor model.safetensors")
            f = SafetensorsFile(single)
            self.files['model.safetensors'] = f
            for name in f.tensors:
                self.where[name] = f

    def has(self, name):
        return name in self.where

    def get(self, name, dtype, shape):
        if name not in self.where:
            raise RefError(f"{self.root}: tensor {name} missing")
        f = self.where[name]
        dt, shp, _, _ = f.tensors[name]
        if dt != dtype or list(shp) != list(shape):
            raise RefError(f"{f.path}: tensor {name}: expected {dtype} {list(shape)}, found {dt} {shp}")
        return f.array(name)


# ================================================================================================
# Configuration and derived layer roles (REFERENCE.md 0.1)
# ================================================================================================

_DEFAULTS = {
    'n_shared_experts': 1, 'score_func': 'sqrtsoftplus', 'route_scale': 1.0, 'swiglu_limit': 0.0,
    'norm_eps': 1e-20, 'compress_rope_theta': 40000.0, 'original_seq_len': 0, 'rope_theta': 10000.0,
    'rope_factor': 40.0, 'beta_fast': 32.0, 'beta_slow': 1.0, 'candidate_source_layer': -1,
    'candidate_topk_blocks': 0, 'candidate_block_size': 0, 'hc_mult': 4, 'hc_sinkhorn_iters': 20,
    'hc_eps': 1e-6, 'engram_layer_ids': [], 'engram_max_ngram_size': 1, 'engram_pad_id': 2,
    'n_mtp_layers': 0, 'kv_source_layers': [], 'index_source_layers': [], 'gate_temp': 1.0,
}
_REQUIRED = ['vocab_size', 'dim', 'moe_inter_dim', 'n_layers', 'n_heads', 'head_dim', 'rope_head_dim',
             'q_lora_rank', 'o_groups', 'o_lora_rank', 'n_routed_experts', 'n_activated_experts',
             'window_size', 'compress_ratios']


class Config:
    def __init__(self, d, where='inference/config.json'):
        if not isinstance(d, dict):
            raise RefError(f"{where}: not a JSON object")
        self.raw = d
        self.where = where
        for k in _REQUIRED:
            if k not in d:
                raise RefError(f"{where}: missing key {k}")

        def g(k):
            if k in d and d[k] is not None:
                return d[k]
            if k not in _DEFAULTS:
                raise RefError(f"{where}: missing key {k}")
            return _DEFAULTS[k]

        def gi(k, lo=None):
            v = g(k)
            if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo):
                raise RefError(f"{where}: {k} must be an integer >= {lo}, got {v!r}")
            return v

        def gl(k):
            v = g(k)
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise RefError(f"{where}: {k} must be a list of integers")
            return list(v)

        self.vocab = gi('vocab_size', 1)
        self.dim = gi('dim', 32)
        self.inter = gi('moe_inter_dim', 32)
        self.n_layers = gi('n_layers', 1)
        self.n_mtp = gi('n_mtp_layers', 0)
        self.n_heads = gi('n_heads', 1)
        self.head_dim = gi('head_dim', 32)
        self.rd = gi('rope_head_dim', 2)
        self.q_lora = gi('q_lora_rank', 32)
        self.o_groups = gi('o_groups', 1)
        self.o_lora = gi('o_lora_rank', 1)
        self.n_experts = gi('n_routed_experts', 1)
        self.topk_experts = gi('n_activated_experts', 1)
        self.n_shared = gi('n_shared_experts', 0)
        self.window = gi('window_size', 1)
        self.hc = gi('hc_mult', 1)
        self.sinkhorn_iters = gi('hc_sinkhorn_iters', 1)
        self.score_func = g('score_func')
        if self.score_func != 'sqrtsoftplus':
            raise RefError(f"{where}: score_func {self.score_func!r} is not supported (only sqrtsoftplus)")
        # DECISION: float constants from the config enter fp32 arithmetic as their fp32 values.
        self.route_scale = f32(g('route_scale'))
        # gate_temp is a ModelArgs field (default 1.0) that a config may set; REFERENCE §2.6 Gate
        # divides the fp32 router logits by it (one fp32 division, skipped when it is 1).
        self.gate_temp = f32(g('gate_temp'))
        self.swiglu_limit = f32(g('swiglu_limit'))
        self.eps = f32(g('norm_eps'))
        self.hc_eps = f32(g('hc_eps'))
        self.ratios = gl('compress_ratios')
        if len(self.ratios) < self.n_layers:
            raise RefError(f"{where}: compress_ratios has {len(self.ratios)} entries < n_layers {self.n_layers}")
        for L in range(self.n_layers):
            if self.ratios[L] < 0:
                raise RefError(f"{where}: compress_ratios[{L}] is negative")
        for k, m in (('dim', 32), ('head_dim', 32), ('q_lora_rank', 32), ('moe_inter_dim', 32)):
            if d[k] % m:
                raise RefError(f"{where}: {k} must be a multiple of {m}")
        if self.rd % 2 or self.rd > self.head_dim:
            raise RefError(f"{where}: rope_head_dim must be even and <= head_dim")
        if self.n_heads % self.o_groups or (self.o_groups * self.o_lora) % 32:
            raise RefError(f"{where}: n_heads must be a multiple of o_groups and o_groups*o_lora_rank of 32")
        if self.topk_experts > self.n_experts:
            raise RefError(f"{where}: n_activated_experts > n_routed_experts")

        self.rope_theta = float(g('rope_theta'))
        self.compress_rope_theta = float(g('compress_rope_theta'))
        self.orig_seq = float(g('original_seq_len'))
        self.rope_factor = float(g('rope_factor'))
        self.beta_fast = float(g('beta_fast'))
        self.beta_slow = float(g('beta_slow'))

        nl = self.n_layers
        self.kv_sources = sorted(set(gl('kv_source_layers')))
        self.index_sources = sorted(set(gl('index_source_layers')))
        for L in self.kv_sources + self.index_sources:
            if not 0 <= L < nl or self.ratios[L] == 0:
                raise RefError(f"{where}: kv/index source layer {L} is out of range or has ratio 0")
        # kv source of a layer: the nearest KV-source layer at or before it
        self.kv_src = [None] * nl
        self.idx_src = [None] * nl
        for L in range(nl):
            if self.ratios[L] == 0:
                continue
            prev = [s for s in self.kv_sources if s <= L]
            if not prev:
                raise RefError(f"{where}: layer {L} has compress ratio {self.ratios[L]} but no KV source at or before it")
            src = prev[-1]
            if self.ratios[src] != self.ratios[L]:
                raise RefError(f"{where}: layer {L} (ratio {self.ratios[L]}) reads KV source {src} with ratio {self.ratios[src]}")
            self.kv_src[L] = src
            # DECISION: the index source of a layer is the nearest index-source layer at or before
            # it that reads the same KV source.
            iprev = [s for s in self.index_sources if src <= s <= L]
            if not iprev:
                raise RefError(f"{where}: layer {L} has no index source between its KV source {src} and itself")
            self.idx_src[L] = iprev[-1]
        self.cand_src = g('candidate_source_layer')
        self.cand_topk_blocks = gi('candidate_topk_blocks', 0)
        self.cand_block = gi('candidate_block_size', 0)
        self.cand_users = []
        if self.cand_src is not None and self.cand_src >= 0:
            if self.cand_src not in self.index_sources:
                raise RefError(f"{where}: candidate_source_layer {self.cand_src} is not an index source")
            if self.cand_topk_blocks < 1 or self.cand_block < 1:
                raise RefError(f"{where}: candidate_topk_blocks / candidate_block_size must be >= 1")
            # DECISION: candidate users are the index-source layers after the candidate source that
            # read the same KV source (layers 24, 28, 32, 36 for the release).
            self.cand_users = [L for L in self.index_sources
                               if L > self.cand_src and self.kv_src[L] == self.kv_src[self.cand_src]]
        else:
            self.cand_src = -1

        if self.index_sources:
            self.idx_nh = gi('index_n_heads', 1)
            self.idx_hd = gi('index_head_dim', 32)
            self.index_topk = gi('index_topk', 1)
            if self.idx_hd % 32 or self.rd > self.idx_hd:
                raise RefError(f"{where}: index_head_dim must be a multiple of 32 and >= rope_head_dim")

        self.engram_layers = gl('engram_layer_ids')
        if self.engram_layers:
            for L in self.engram_layers:
                if not 0 <= L < nl:
                    raise RefError(f"{where}: engram layer {L} out of range")
            self.engram_vocab = gi('engram_vocab_size', 1)
            self.engram_rows = gl('engram_num_embeddings')
            if len(self.engram_rows) != len(self.engram_layers):
                raise RefError(f"{where}: engram_num_embeddings must have one entry per engram layer")
            self.engram_max_ngram = gi('engram_max_ngram_size', 2)
            self.engram_nh = gi('engram_n_heads', 1)
            self.engram_hd = gi('engram_head_dim', 32)
            if self.engram_hd % 32:
                raise RefError(f"{where}: engram_head_dim must be a multiple of 32")
            self.engram_pad = gi('engram_pad_id', 0)
            self.engram_cvocab = gi('engram_compressed_vocab_size', 1)
            if not 0 <= self.engram_pad < self.vocab:
                raise RefError(f"{where}: engram_pad_id out of range")

        # DSpark (REFERENCE.md 7): on when dspark_block_size > 0 and n_mtp_layers >= 1.
        self.dspark_block = g('dspark_block_size') if d.get('dspark_block_size') else 0
        self.dspark = self.dspark_block > 0 and self.n_mtp > 0
        if self.dspark:
            self.dspark_noise = gi('dspark_noise_token_id', 0)
            self.dspark_targets = gl('dspark_target_layer_ids')
            self.dspark_rank = gi('dspark_markov_rank', 1)
            self.dspark_experts = d.get('dspark_n_routed_experts') or self.n_experts
            self.dspark_topk = d.get('dspark_n_activated_experts') or self.topk_experts
            if not self.dspark_targets or any(not 0 <= L < nl for L in self.dspark_targets):
                raise RefError(f"{where}: dspark_target_layer_ids must list backbone layers")
            if len(self.ratios) < nl + self.n_mtp or any(self.ratios[nl:nl + self.n_mtp]):
                raise RefError(f"{where}: compress_ratios must give ratio 0 to the {self.n_mtp} DSpark stages")
            if self.dspark_noise >= self.vocab or self.dspark_topk > self.dspark_experts:
                raise RefError(f"{where}: dspark_noise_token_id or dspark_n_activated_experts out of range")

        self.ropes = {}

    def rope_params(self, L):
        """(base, yarn) of a backbone layer: ratio 0 -> rope_theta, no YaRN; ratio > 0 ->
        compress_rope_theta with YaRN when original_seq_len > 0 (REFERENCE.md 2.6)."""
        if self.ratios[L] == 0:
            return self.rope_theta, None
        yarn = None
        if self.orig_seq > 0:
            yarn = (self.orig_seq, self.rope_factor, self.beta_fast, self.beta_slow)
        return self.compress_rope_theta, yarn

    def roles(self):
        """Human-readable role table (for tests and --roles)."""
        out = []
        for L in range(self.n_layers):
            out.append({'layer': L, 'ratio': self.ratios[L], 'kv_source': self.kv_src[L],
                        'index_source': self.idx_src[L],
                        'kv_owner': L in self.kv_sources, 'indexer': L in self.index_sources,
                        'candidate_source': L == self.cand_src, 'candidate_user': L in self.cand_users,
                        'engram': L in self.engram_layers, 'rope': self.rope_params(L)})
        return out


# ================================================================================================
# Model
# ================================================================================================

class _Obj:
    pass


def _ceil32(n):
    return -(-n // 32)


class Model:
    def __init__(self, root):
        self.root = root
        cfg_path = os.path.join(root, 'inference', 'config.json')
        try:
            with open(cfg_path, encoding='utf-8') as fh:
                self.cfg = Config(json.load(fh), cfg_path)
        except (OSError, ValueError) as e:
            raise RefError(f"{cfg_path}: {e}")
        cfg = self.cfg
        ck = Checkpoint(root)
        self.ck = ck
        D, V = cfg.dim, cfg.vocab

        def bf(name, shape):
            return ck.get(name, 'BF16', shape)

        def fl(name, shape):
            return ck.get(name, 'F32', shape)

        def fp8(name, N, K):
            w = ck.get(name + '.weight', 'F8_E4M3', [N, K])
            s = ck.get(name + '.scale', 'F8_E8M0', [_ceil32(N), _ceil32(K)])
            sv = e8m0_value(s)[np.arange(N) // 32]          # [N, K/32]
            return QWeight(E4M3_TABLE[w].astype(np.float64), sv, name)

        def fp4(name, N, K):
            w = ck.get(name + '.weight', 'I8', [N, K // 2])
            s = ck.get(name + '.scale', 'F8_E8M0', [N, K // 32])
            codes = np.empty((N, K), np.uint8)
            codes[:, 0::2] = w & 15          # element 2i = low nibble
            codes[:, 1::2] = w >> 4
            return QWeight(E2M1_TABLE[codes].astype(np.float64), e8m0_value(s), name)

        def fp8_dequant_bf16(name, N, K):
            # convert.py: wo_a dequantized to bf16 per 32x32 block.
            # DECISION: bf16(fp32(fp32(e4m3) * fp32(2^(s-127)))).
            w = ck.get(name + '.weight', 'F8_E4M3', [N, K])
            s = ck.get(name + '.scale', 'F8_E8M0', [_ceil32(N), _ceil32(K)])
            sv = e8m0_value(s)[np.arange(N) // 32][:, np.arange(K) // 32]
            return bf16(E4M3_TABLE[w] * sv)

        self.embed = bf('embed.weight', [V, D])
        self.head = bf('head.weight', [V, D])          # held as fp32 (exact upcast)
        self.norm = bf('norm.weight', [D])
        H, hd = cfg.n_heads, cfg.head_dim
        nmix = (2 + cfg.hc) * cfg.hc
        self.layers = []
        stage_layers = list(range(cfg.n_layers, cfg.n_layers + cfg.n_mtp)) if cfg.dspark else []
        for L in list(range(cfg.n_layers)) + stage_layers:
            stage = L >= cfg.n_layers
            p = f'mtp.{L - cfg.n_layers}.' if stage else f'layers.{L}.'
            n_experts = cfg.dspark_experts if stage else cfg.n_experts
            w = _Obj()
            w.topk = cfg.dspark_topk if stage else cfg.topk_experts
            w.attn_norm = bf(p + 'attn_norm.weight', [D])
            w.ffn_norm = bf(p + 'ffn_norm.weight', [D])
            w.sink = fl(p + 'attn.attn_sink', [H])
            w.q_norm = bf(p + 'attn.q_norm.weight', [cfg.q_lora])
            w.kv_norm = bf(p + 'attn.kv_norm.weight', [hd])
            w.wq_a = fp8(p + 'attn.wq_a', cfg.q_lora, D)
            w.wq_b = fp8(p + 'attn.wq_b', H * hd, cfg.q_lora)
            w.wkv = fp8(p + 'attn.wkv', hd, D)
            w.wo_a = fp8_dequant_bf16(p + 'attn.wo_a', cfg.o_groups * cfg.o_lora, H * hd // cfg.o_groups)
            w.wo_b = fp8(p + 'attn.wo_b', D, cfg.o_groups * cfg.o_lora)
            for sub in ('attn', 'ffn'):
                setattr(w, 'hc_' + sub, (fl(p + f'hc_{sub}_fn', [nmix, cfg.hc * D]),
                                         fl(p + f'hc_{sub}_scale', [3]),
                                         fl(p + f'hc_{sub}_base', [nmix])))
            w.gate = bf(p + 'ffn.gate.weight', [n_experts, D])
            w.gate_bias = fl(p + 'ffn.gate.bias', [n_experts])
            w.experts = [None] * n_experts
            w.expert_names = [p + f'ffn.experts.{e}.' for e in range(n_experts)]
            for e in range(n_experts):
                q = w.expert_names[e]
                ew = _Obj()
                ew.w1 = fp4(q + 'w1', cfg.inter, D)
                ew.w3 = fp4(q + 'w3', cfg.inter, D)
                ew.w2 = fp4(q + 'w2', D, cfg.inter)
                w.experts[e] = ew
            w.shared = None
            if cfg.n_shared > 0:
                si = cfg.n_shared * cfg.inter
                sw = _Obj()
                sw.w1 = fp8(p + 'ffn.shared_experts.w1', si, D)
                sw.w3 = fp8(p + 'ffn.shared_experts.w3', si, D)
                sw.w2 = fp8(p + 'ffn.shared_experts.w2', D, si)
                w.shared = sw
            if L in cfg.kv_sources:
                w.c_wkv = bf(p + 'attn.compressor.wkv.weight', [hd, D])
                if cfg.ratios[L] > 1:
                    w.c_wgate = bf(p + 'attn.compressor.wgate.weight', [hd, D])
                w.c_norm = bf(p + 'attn.compressor.norm.weight', [hd])
                w.i_wk = bf(p + 'attn.indexer.wk.weight', [cfg.idx_hd, hd])
                w.i_knorm = bf(p + 'attn.indexer.k_norm.weight', [cfg.idx_hd])
            if L in cfg.index_sources:
                w.i_wq_b = fp8(p + 'attn.indexer.wq_b', cfg.idx_nh * cfg.idx_hd, cfg.q_lora)
                w.i_wproj = bf(p + 'attn.indexer.weights_proj.weight', [cfg.idx_nh, D])
            if L in cfg.engram_layers:
                k = cfg.engram_layers.index(L)
                ncol = (cfg.engram_max_ngram - 1) * cfg.engram_nh
                rows = cfg.engram_rows[k]
                w.e_codes = ck.get(p + 'engram.embed.weight', 'F8_E4M3', [rows, cfg.engram_hd])
                w.e_scale = ck.get(p + 'engram.embed.scale', 'F8_E8M0', [rows, cfg.engram_hd // 32])
                w.e_wkv = fp8(p + 'engram.wkv', (cfg.hc + 1) * D, ncol * cfg.engram_hd)
                w.e_q = bf(p + 'engram.q_weight', [cfg.hc, D])
                w.e_k = bf(p + 'engram.k_weight', [cfg.hc, D])
            base, yarn = cfg.rope_params(L)
            w.rope = Rope(cfg.rd, base, yarn)
            self.layers.append(w)
        if cfg.dspark:
            # The DSpark extras (REFERENCE.md 3): stage 0's main_proj / main_norm, the last stage's
            # norm, Markov head and confidence projection (fp32 parameters: exact upcasts).
            nt, r, last = len(cfg.dspark_targets), cfg.dspark_rank, f'mtp.{cfg.n_mtp - 1}.'
            self.main_proj = fp8('mtp.0.main_proj', D, D * nt)
            self.main_norm = bf('mtp.0.main_norm.weight', [D])
            self.mtp_norm = bf(last + 'norm.weight', [D])
            self.markov_embed = bf(last + 'markov_head.embed.weight', [V, r])
            self.markov_head = bf(last + 'markov_head.head.weight', [V, r])
            self.w_conf = bf(last + 'confidence_head.proj.weight', [1, D + r])

        self.softmax_scale = f32(float(hd) ** -0.5)
        if cfg.index_sources:
            # DECISION: index_head_dim^-0.5 * index_n_heads^-0.5 in double, then one fp32 rounding.
            self.index_scale = f32(float(cfg.idx_hd) ** -0.5 * float(cfg.idx_nh) ** -0.5)

        self.cmap = None
        if cfg.engram_layers:
            tok_path = os.path.join(root, 'tokenizer.json')
            try:
                with open(tok_path, encoding='utf-8') as fh:
                    tok = json.load(fh)
            except (OSError, ValueError) as e:
                raise RefError(f"{tok_path}: {e}")
            self.cmap, n = compressed_token_map(tok, V, tok_path)
            if n != cfg.engram_cvocab:
                raise RefError(f"{tok_path}: {n} compressed token ids, config engram_compressed_vocab_size is {cfg.engram_cvocab}")
            self.engram_pad = self.cmap[cfg.engram_pad]
            primes = engram_primes(cfg.engram_layers, cfg.engram_max_ngram, cfg.engram_nh, cfg.engram_vocab)
            self.engram = {}
            for k, L in enumerate(cfg.engram_layers):
                flat = [pr for per_n in primes[k] for pr in per_n]
                if sum(flat) != cfg.engram_rows[k]:
                    raise RefError(f"{cfg_path}: engram_num_embeddings[{k}] = {cfg.engram_rows[k]} != sum of primes {sum(flat)}")
                offs = [0]
                for pr in flat[:-1]:
                    offs.append(offs[-1] + pr)
                self.engram[L] = (engram_multipliers(L, cfg.engram_max_ngram, cfg.engram_cvocab),
                                  primes[k], offs)
        self.stats = {'index_ties': 0, 'neg_inf_picks': 0, 'candidate_masked': 0,
                      'window_wrapped': 0, 'attn_chunks_gt1': 0, 'groups': 0, 'engram_blocked': 0}

    # ---------------------------------------------------------------------------------------------
    def new_state(self):
        cfg = self.cfg
        st = _Obj()
        st.pos = 0
        st.ids = []
        st.cids = []
        # window KV rows per absolute position, backbone layers then DSpark stages
        st.win = [[] for _ in range(cfg.n_layers + (cfg.n_mtp if cfg.dspark else 0))]
        st.carry = {L: [] for L in cfg.kv_sources}       # ratio>1 compressor carry: (kv, score) fp32
        st.ckv = {L: np.zeros((0, cfg.head_dim), np.float32) for L in cfg.kv_sources}
        st.kcache = {L: np.zeros((0, getattr(cfg, 'idx_hd', 32)), np.float32) for L in cfg.kv_sources}
        return st

    # ---------------------------------------------------------------------------------------------
    def hc_mixes(self, x, params):
        fn, scale, base = params
        S = x.shape[0]
        xf = x.reshape(S, -1)
        ms = xsum((xf * xf).astype(np.float64), axis=-1, divisor=xf.shape[1])
        r = f_rsqrt(ms + self.cfg.eps)
        mixes = xdot(xf, fn) * r[:, None]
        return hc_split_sinkhorn(mixes, scale, base, self.cfg.hc, self.cfg.sinkhorn_iters, self.cfg.hc_eps)

    # ---------------------------------------------------------------------------------------------
    def engram_apply(self, L, st, x, pos):
        cfg = self.cfg
        w = self.layers[L]
        mult, primes, offs = self.engram[L]
        rows = engram_hash_rows(st.cids, pos, mult, primes, offs, self.engram_pad)   # [S, ncol]
        for p in pos:
            if p < cfg.engram_max_ngram - 1:
                self.stats['engram_blocked'] += 1
        S = x.shape[0]
        codes = w.e_codes[rows]                                          # [S, ncol, ehd]
        sc = e8m0_value(w.e_scale[rows])                                 # [S, ncol, ehd/32]
        vals = E4M3_TABLE[codes].reshape(S, rows.shape[1], -1, 32)
        E = bf16(vals * sc[..., None]).reshape(S, -1)
        kv = qlinear(E, w.e_wkv)                                         # [S, (hc+1)*D]
        hc, D = cfg.hc, cfg.dim
        key = kv[:, :hc * D].reshape(S, hc, D)
        value = kv[:, hc * D:]
        ww = w.e_q * w.e_k                                               # [hc, D] fp32
        ms_h = xsum((x * x).astype(np.float64), axis=-1, divisor=D)
        ms_k = xsum((key * key).astype(np.float64), axis=-1, divisor=D)
        rstd = f_rsqrt(ms_h + cfg.eps) * f_rsqrt(ms_k + cfg.eps)
        dsum = xsum(((x * ww[None]) * key).astype(np.float64), axis=-1)
        dot = (dsum * rstd) * f32(float(D) ** -0.5)
        sgn = np.where(np.signbit(dot), f32(-1.0), f32(1.0)).astype(np.float32)
        mag = f_sqrt(np.maximum(np.abs(dot), f32(1e-6)))
        gate = f_sigmoid(sgn * mag)                                      # [S, hc]
        return bf16(x + gate[..., None] * value[:, None, :])

    # ---------------------------------------------------------------------------------------------
    def compress(self, L, st, x, pos):
        """Compressor + index keys of KV-source layer L for the chunk; appends completed groups to
        the layer's compressed KV cache and index-key cache."""
        cfg = self.cfg
        w = self.layers[L]
        r = cfg.ratios[L]
        if r == 1:
            lat = rmsnorm(bf16_linear(x, w.c_wkv), w.c_norm, cfg.eps)
            gpos = np.asarray(pos)
        else:
            kvt = xdot(x, w.c_wkv)          # fp32, no bf16 rounding (fp32 weights)
            sct = xdot(x, w.c_wgate)
            pooled = []
            gp = []
            for s, a in enumerate(pos):
                st.carry[L].append((kvt[s], sct[s]))
                if (a + 1) % r == 0:
                    if len(st.carry[L]) != r:
                        raise RefError(f"layer {L}: compressor carry out of step at position {a}")
                    kv = np.stack([c[0] for c in st.carry[L]])      # [r, hd]
                    sc = np.stack([c[1] for c in st.carry[L]])
                    st.carry[L] = []
                    # DECISION: per channel m = max_t sc, e_t = exp(sc_t - m), w_t = e_t / (short
                    # sum of e), pooled = short sum of fp32(kv_t * w_t), all in token order.
                    mx = np.max(sc, axis=0)
                    e = f_exp(sc - mx[None])
                    den = seqsum(e, axis=0)
                    wt = e / den[None]
                    pooled.append(seqsum(kv * wt, axis=0))
                    gp.append(a + 1 - r)
            if not gp:
                return
            lat = rmsnorm(bf16(np.stack(pooled)), w.c_norm, cfg.eps)
            gpos = np.array(gp)
        self.stats['groups'] += len(gpos)
        # index keys: from the unrotated, unquantized latent
        k = rmsnorm(bf16_linear(lat, w.i_wk), w.i_knorm, cfg.eps)
        k = qdq_fp4_ue8m0(w.rope.apply(k, gpos), 32)
        st.kcache[L] = np.concatenate([st.kcache[L], k])
        # attention copy: rope at the group's first position, FP4 1x16 e4m3-scale QDQ
        c = qdq_fp4_e4m3scale(w.rope.apply(lat, gpos), 16)
        st.ckv[L] = np.concatenate([st.ckv[L], c])

    # ---------------------------------------------------------------------------------------------
    def indexer(self, L, st, ctx, x, qr, pos):
        """Top-k compressed positions for every query of the chunk (index-source layer L).

        # DECISION: selection is formulated per query at absolute position a: the reachable
        # positions are t < (a+1)//r; the candidate mask, the candidate masking and the top
        # min(index_topk, (a+1)//r) run over exactly those.  With the tie rule of 9.2 this selects
        # the same set as the reference's chunk-wide top-k with its causal -inf mask and -1
        # clean-up (future positions are -inf and lose every tie against lower positions), and it
        # is what a decode step computes, so chunked prefill == decode by construction.
        # DECISION: a -inf pick below the query's compress_len (a candidate user whose candidate
        # mask holds fewer than k positions) is kept and attended, as REFERENCE.md 2.10 step 7
        # says the reference does; consumers reuse such lists verbatim.
        """
        cfg = self.cfg
        w = self.layers[L]
        src = cfg.kv_src[L]
        r = cfg.ratios[src]
        S = x.shape[0]
        K = st.kcache[src]
        T = K.shape[0]
        lists = [np.zeros(0, np.int64)] * S
        if L == cfg.cand_src:
            ctx.cand = [np.zeros(0, bool)] * S
        if T == 0:
            return lists
        nh, ihd = cfg.idx_nh, cfg.idx_hd
        qi = qlinear(qr, w.i_wq_b).reshape(S, nh, ihd)
        qi = qdq_fp4_ue8m0(w.rope.apply(qi, pos), 32)
        wp = bf16(bf16_linear(x, w.i_wproj) * self.index_scale)              # [S, nh]
        score = bf16(xdot(qi.reshape(S * nh, ihd), K)).reshape(S, nh, T)
        terms = bf16(np.maximum(score, f32(0.0)) * wp[:, :, None])
        I = bf16(xsum(terms.astype(np.float64), axis=1))                     # [S, T]
        for s in range(S):
            Ta = (int(pos[s]) + 1) // r
            if Ta == 0:
                continue
            row = I[s, :Ta].copy()
            if L == cfg.cand_src:
                blocks, bs = candidate_blocks(row, cfg.cand_topk_blocks, cfg.cand_block)
                ctx.cand[s] = blocks_to_mask(blocks, cfg.cand_block, Ta)
                record(ctx, 'cand', L, s, blocks, bs)
            if L in cfg.cand_users:
                m = ctx.cand[s]
                if len(m) != Ta:
                    raise RefError(f"layer {L}: candidate mask width {len(m)} != {Ta}")
                self.stats['candidate_masked'] += int((~m).sum())
                row[~m] = -np.inf
            k = min(cfg.index_topk, Ta)
            sel = topk_lowest_index(row, k)
            if k < Ta:
                # a finite tie straddling the top-k boundary, decided by the lower-index rule
                kth = row[sel[-1]]
                if np.isfinite(kth) and np.count_nonzero(row == kth) > np.count_nonzero(row[sel] == kth):
                    self.stats['index_ties'] += 1
            self.stats['neg_inf_picks'] += int(np.isneginf(row[sel]).sum())
            lists[s] = np.sort(sel)
            record(ctx, 'index', L, s, lists[s], row)
        return lists

    # ---------------------------------------------------------------------------------------------
    def window_kv(self, L, x, pos):
        """QDQ_fp8(rope(kv_norm(wkv(x)))) at positions pos (REFERENCE.md 2.8 step 2)."""
        w = self.layers[L]
        kv = rmsnorm(qlinear(x, w.wkv), w.kv_norm, self.cfg.eps)
        return qdq_fp8(w.rope.apply(kv, pos))

    def attention(self, L, st, ctx, x, pos, draft=False):
        """draft: x is a DSpark draft block (REFERENCE.md 7, 10.7): every row attends the stage's
        window before the block, then all rows of the block; the window is not written."""
        cfg = self.cfg
        w = self.layers[L]
        S = x.shape[0]
        H, hd = cfg.n_heads, cfg.head_dim
        qr = rmsnorm(qlinear(x, w.wq_a), w.q_norm, cfg.eps)
        q = w.rope.apply(qlinear(qr, w.wq_b).reshape(S, H, hd), pos)
        kv = self.window_kv(L, x, pos)
        if draft:
            p0 = int(pos[0])
            # DECISION: the canonical list of a draft row (REFERENCE.md 10.7): the stage window's
            # positions max(0, p0-W) .. p0-1 ascending, then the S block rows in order; no causal
            # mask, the same list for every row.
            rows = np.concatenate([np.stack(st.win[L][max(0, p0 - cfg.window):p0]), kv])
            o = np.stack([sparse_attn(q[s], rows, w.sink, self.softmax_scale) for s in range(S)])
            return self.attn_out(w, o, pos)
        st.win[L].extend(list(kv))
        ratio = cfg.ratios[L]
        lists = None
        if ratio > 0:
            src = cfg.kv_src[L]
            if src == L:
                self.compress(L, st, x, pos)
            if L in cfg.index_sources:
                ctx.idx[L] = self.indexer(L, st, ctx, x, qr, pos)
                ctx.idx_own[L] = ctx.idx[L]
                forced = forced_rows(ctx, 'index', L)
                if forced is not None:
                    # The candidate's selections (layer-local check, REFERENCE.md 10.1): the
                    # arithmetic is compared with the candidate's decisions.
                    ctx.idx[L] = forced
            lists = ctx.idx[cfg.idx_src[L]]
            if L not in cfg.index_sources:
                for s_ in range(S):
                    record(ctx, 'index', L, s_, ctx.idx_own[cfg.idx_src[L]][s_], None)
            ckv = st.ckv[src]
        win = st.win[L]
        W = cfg.window
        o = np.empty((S, H, hd), np.float32)
        for s in range(S):
            a = int(pos[s])
            lo = max(0, a - W + 1)
            if lo > 0:
                self.stats['window_wrapped'] += 1
            rows = np.stack(win[lo:a + 1])
            if lists is not None and len(lists[s]):
                rows = np.concatenate([rows, ckv[lists[s]]])
            if rows.shape[0] > 64:
                self.stats['attn_chunks_gt1'] += 1
            o[s] = sparse_attn(q[s], rows, w.sink, self.softmax_scale)
        return self.attn_out(w, o, pos)

    def attn_out(self, w, o, pos):
        """Inverse rope of the attention output, grouped wo_a, wo_b (REFERENCE.md 2.6, 2.8 step 4)."""
        cfg = self.cfg
        S = o.shape[0]
        o = w.rope.apply(o, pos, inverse=True)
        G = cfg.o_groups
        og = o.reshape(S, G, -1)
        olr = cfg.o_lora
        r = np.concatenate([bf16_linear(og[:, g], w.wo_a[g * olr:(g + 1) * olr]) for g in range(G)], axis=-1)
        return qlinear(r, w.wo_b)

    # ---------------------------------------------------------------------------------------------
    def expert(self, ew, x, route_w):
        lim = self.cfg.swiglu_limit
        g = qlinear(x, ew.w1)
        u = qlinear(x, ew.w3)
        if lim > 0:
            u = np.clip(u, -lim, lim)
            g = np.minimum(g, lim)
        h = f_silu(g) * u
        if route_w is not None:
            h = route_w[:, None] * h
        return qlinear(bf16(h), ew.w2)

    def moe(self, w, x, L=None, ctx=None):
        cfg = self.cfg
        S = x.shape[0]
        # REFERENCE §2.6 Gate: scores = fp32(x) @ fp32(W)^T / gate_temp.  (Was: gate_temp assumed
        # 1 and ignored; a config may set it, so divide unless it is 1, which is the identity.)
        logits = xdot(x, w.gate)
        if cfg.gate_temp != f32(1.0):
            logits = (logits / cfg.gate_temp).astype(np.float32)
        sc = f_sqrt(f_softplus(logits))
        biased = sc + w.gate_bias
        k = w.topk
        sel = topk_lowest_index(biased, k)                                 # [S, k], top-k order
        if ctx is not None and getattr(ctx, 'dec', None) is not None:
            eps = route_error_bound(biased)
            for s in range(S):
                record(ctx, 'experts', L, s, sel[s], biased[s], eps[s])
        forced = forced_rows(ctx, 'experts', L) if ctx is not None else None
        if forced is not None:
            sel = np.array([np.asarray(f, np.int64) for f in forced])
        rw = np.take_along_axis(sc, sel, axis=1)
        if k > 1:
            rw = rw / (seqsum(rw, axis=1) + f32(1e-20))[:, None]
        # DECISION: route_scale multiplies the weights for every k (also k == 1).
        rw = rw * cfg.route_scale
        # DECISION: the MoE accumulator starts at +0.0 (torch zeros) and every expert output,
        # then the shared expert's, is added with one fp32 rounding each.
        y = np.zeros((S, cfg.dim), np.float32)
        for e in np.unique(sel):
            tok, slot = np.nonzero(sel == e)
            y[tok] = y[tok] + self.expert(w.experts[e], x[tok], rw[tok, slot])
        if w.shared is not None:
            # DECISION: the shared expert is the same Expert (swiglu_limit clamp included) without
            # a routing weight.
            y = y + self.expert(w.shared, x, None)
        return bf16(y)

    # ---------------------------------------------------------------------------------------------
    def block(self, L, st, ctx, x, pre_mix, pos, draft=False):
        cfg = self.cfg
        w = self.layers[L]
        a_pre, a_post, a_comb = self.hc_mixes(x, w.hc_attn)
        ha = self.attention(L, st, ctx, rmsnorm(hc_pre(x, pre_mix), w.attn_norm, cfg.eps), pos, draft)
        x = hc_post(ha, x, a_post, a_comb)
        f_pre, f_post, f_comb = self.hc_mixes(x, w.hc_ffn)
        hf = self.moe(w, rmsnorm(hc_pre(x, a_pre), w.ffn_norm, cfg.eps), L, ctx)
        x = hc_post(hf, x, f_post, f_comb)
        return x, f_pre, ha, hf

    # ---------------------------------------------------------------------------------------------
    def forward(self, st, ids, rec=None, override=None):
        """Process one chunk of token ids at positions st.pos .. st.pos+len(ids)-1; returns fp32
        logits [S, vocab] for every position.

        rec: optional dict name -> list of arrays; the section 10.1 streams of this chunk are
        appended under the names h.L, pre.L, attn.L, ffn.L, logits.
        override: optional dict with 'h' (list of [S,hc,D] for L=0..n_layers) and 'pre' (list of
        [S,hc] for L=0..n_layers-1): each block's input stream and pre-mix are taken from it
        instead of from the previous block (the layer-local check); the caches then evolve from
        the overriding inputs.
        """
        cfg = self.cfg
        ids = [int(i) for i in ids]
        S = len(ids)
        if S == 0:
            raise RefError("forward: empty chunk")
        for i in ids:
            if not 0 <= i < cfg.vocab:
                raise RefError(f"forward: token id {i} outside [0, {cfg.vocab})")
        p0 = st.pos
        pos = np.arange(p0, p0 + S, dtype=np.int64)
        st.ids.extend(ids)
        if self.cmap is not None:
            st.cids.extend(self.cmap[i] for i in ids)
        x = np.repeat(self.embed[ids][:, None, :], cfg.hc, axis=1)
        pre = np.zeros((S, cfg.hc), np.float32)
        pre[:, 0] = 1.0
        ctx = _Obj()
        ctx.idx = {}
        ctx.idx_own = {}
        ctx.cand = None
        ctx.dec = {} if rec is not None else None
        ctx.force = override.get('force') if override is not None else None

        def put(name, arr):
            if rec is not None:
                rec.setdefault(name, []).append(np.array(arr, np.float32))

        taps = {}
        for L in range(cfg.n_layers):
            if override is not None:
                x = np.asarray(override['h'][L], np.float32)
                pre = np.asarray(override['pre'][L], np.float32)
            put(f'h.{L}', x)
            put(f'pre.{L}', pre)
            if L in cfg.engram_layers:
                x = self.engram_apply(L, st, x, pos)
            if cfg.dspark and L in cfg.dspark_targets:
                taps[L] = self.tap(x)
            x, pre, ha, hf = self.block(L, st, ctx, x, pre, pos)
            put(f'attn.{L}', ha)
            put(f'ffn.{L}', hf)
            if override is not None:
                put(f'out.{L}', x)
                put(f'outpre.{L}', pre)
        if override is not None:
            x = np.asarray(override['h'][cfg.n_layers], np.float32)
        put(f'h.{cfg.n_layers}', x)
        if rec is not None:
            rec.setdefault('decisions', []).append(ctx.dec)
        if cfg.dspark:
            self.seed_stages(st, [taps[L] for L in cfg.dspark_targets], pos)
        h = rmsnorm(hc_pre(x, pre), self.norm, cfg.eps)
        logits = xdot(h, self.head)
        put('logits', logits)
        st.pos += S
        return logits

    # ---------------------------------------------------------------------------------------------
    # DSpark (REFERENCE.md 7, 10.7)
    def tap(self, x):
        """bf16(mean over the hc copies) of the stream x [S,hc,D] entering a target block."""
        # DECISION: the copy mean is hc_pre with every weight fp32(1/hc): the short sum of 10.4 in
        # copy order (as hc_pre), each product rounded; for a power-of-two hc (the release: 4)
        # that is bf16(fp32(((h0+h1)+h2)+h3) / hc) exactly.
        S, hc = x.shape[0], x.shape[1]
        return hc_pre(x, np.full((S, hc), f32(1.0 / hc), np.float32))

    def seed_stages(self, st, taps, pos):
        """main_x = main_norm(main_proj(concat taps)); each stage's window KV of main_x at the chunk's
        positions appended to its window (REFERENCE.md 7 steps 1, 3, 4: prefill seeding and the
        decode-time write of position p are the same rows)."""
        cfg = self.cfg
        # DECISION: every forward call writes the stage windows of all its positions (the official
        # prefill seeds the last window positions and each decode step writes its own; the window
        # read by a draft is the same), so a draft can follow any chunk.
        main_x = rmsnorm(qlinear(np.concatenate(taps, axis=-1), self.main_proj), self.main_norm, cfg.eps)
        for k in range(cfg.n_mtp):
            L = cfg.n_layers + k
            st.win[L].extend(list(self.window_kv(L, main_x, pos)))

    def forward_spec(self, st, token):
        """Draft block after the sequence's last position p = st.pos - 1 for the sampled token at
        p+1: returns (drafts [B] for positions p+2.., corrected logits [B,V], confidence [B]).
        The sequence's state is not changed."""
        cfg = self.cfg
        if not cfg.dspark:
            raise RefError("forward_spec: the model has no DSpark stages")
        if st.pos < 1:
            raise RefError("forward_spec: the sequence is empty")
        B = cfg.dspark_block
        ids = [int(token)] + [cfg.dspark_noise] * (B - 1)
        pos = np.arange(st.pos, st.pos + B, dtype=np.int64)
        x = np.repeat(self.embed[ids][:, None, :], cfg.hc, axis=1)
        pre = np.zeros((B, cfg.hc), np.float32)
        pre[:, 0] = 1.0
        ctx = _Obj()
        ctx.dec = None
        ctx.force = None
        for k in range(cfg.n_mtp):
            x, pre, _, _ = self.block(cfg.n_layers + k, st, ctx, x, pre, pos, draft=True)
        xh = hc_pre(x, pre)
        logits = xdot(rmsnorm(xh, self.mtp_norm, cfg.eps), self.head)
        out = [int(token)]
        conf = np.zeros(B, np.float32)
        for i in range(B):
            e = self.markov_embed[out[i]]
            logits[i] = logits[i] + xdot(e[None, :], self.markov_head)[0]
            out.append(int(np.argmax(logits[i])))          # lowest id on ties
            # DECISION: the confidence input is [x ; e_i] with x = hc_pre(h, pre_mix) of the row
            # (before the stage norm, as REFERENCE.md 7 writes it) and e_i the Markov embedding of
            # the row's input id (the one its logits were corrected with).
            conf[i] = xdot(np.concatenate([xh[i], e])[None, :], self.w_conf)[0, 0]
        return np.array(out[1:], np.int64), logits, conf


# ================================================================================================
# Driver: prefill in chunks, greedy decode, stream dumps, layer-local check
# ================================================================================================

def run_ids(model, ids, chunk=None, decode=0, want_dump=False, drafts=None):
    """Returns (prefill logits [S,V], [(token, logits [V])...], dump tensors list or None).
    drafts: a list that gets, before each greedy step feeds its token, the DSpark draft block from
    that token: (position of the first draft, draft ids, confidences, corrected logits [B,V])."""
    st = model.new_state()
    chunk = chunk or len(ids)
    rec = {} if want_dump else None
    outs = []
    for c0 in range(0, len(ids), chunk):
        outs.append(model.forward(st, ids[c0:c0 + chunk], rec=rec))
    prefill = np.concatenate(outs)
    dump = None
    parts = []
    if want_dump:
        parts.append(('prefill', rec))
    greedy = []
    last = prefill[-1]
    for k in range(decode):
        t = int(np.argmax(last))        # lowest id on ties
        if drafts is not None:
            d_ids, d_logits, d_conf = model.forward_spec(st, t)
            drafts.append((st.pos + 1, d_ids, d_conf, d_logits))
        r = {} if want_dump else None
        out = model.forward(st, [t], rec=r)[0]
        if want_dump:
            parts.append((f'decode.{k}', r))
        greedy.append((t, out))
        last = out
    if want_dump:
        dump = [('ids', 'I64', np.array(ids, '<i8')),
                ('decode_ids', 'I64', np.array([g[0] for g in greedy], '<i8'))]
        n = model.cfg.n_layers
        for pname, r in parts:
            names = [f'h.{L}' for L in range(n + 1)] + [f'pre.{L}' for L in range(n)] + \
                    [f'attn.{L}' for L in range(n)] + [f'ffn.{L}' for L in range(n)] + ['logits']
            for nm in names:
                dump.append((f'{pname}.{nm}', 'F32', np.concatenate(r[nm]).astype('<f4')))
            dump += decision_tensors(model.cfg, pname, r['decisions'], [len(c) for c in r['logits']])
    return prefill, greedy, dump


def decision_tensors(cfg, pname, chunks, chunk_rows):
    """The decisions of one dump part (REFERENCE.md 10.1, the layout ds41-eval writes): per layer
    that makes them, <kind>.L I32 [S, width] (-1 padded) and, where scores exist, the score rows
    F32 [S, widest row] (NaN padded).  chunks: each chunk's ctx.dec; chunk_rows: their sizes."""
    S = sum(chunk_rows)
    widths = {'index': cfg.index_topk, 'cand': cfg.cand_topk_blocks, 'experts': cfg.topk_experts}
    names = {'index': ('index_sel', 'index_score'), 'cand': ('cand', 'cand_score'),
             'experts': ('experts', 'expert_score')}
    out = []
    for kind in ('index', 'cand', 'experts'):
        for L in range(cfg.n_layers):
            rows = {}
            off = 0
            for dec, nrow in zip(chunks, chunk_rows):
                for srow, v in (dec or {}).get((kind, L), {}).items():
                    rows[off + srow] = v
                off += nrow
            if not rows and not any((kind, L) in (dec or {}) for dec in chunks):
                continue
            sel = np.full((S, max(widths[kind], 1)), -1, '<i4')
            wsc = max([len(v[1]) for v in rows.values() if v[1] is not None] + [0])
            sc = np.full((S, wsc), np.nan, '<f4')
            for srow, (sl, score, _err) in rows.items():
                sel[srow, :len(sl)] = sl
                if score is not None:
                    sc[srow, :len(score)] = score
            out.append((f'{pname}.{names[kind][0]}.{L}', 'I32', sel))
            if wsc:
                out.append((f'{pname}.{names[kind][1]}.{L}', 'F32', sc))
    return out


def fmt_floats(v):
    return '[' + ','.join('%.9g' % x for x in np.asarray(v, np.float32).tolist()) + ']'


def result_json(ids, prefill, greedy, drafts=None):
    """The ds41-eval output format: compact JSON, floats as %.9g, one trailing newline; with
    drafts (run_ids), a "drafts" list after "greedy"."""
    parts = ['{"ids":[', ','.join(str(int(i)) for i in ids), '],"prefill_logits":[',
             ','.join(fmt_floats(row) for row in prefill), '],"greedy":[',
             ','.join('{"token":%d,"logits":%s}' % (t, fmt_floats(lg)) for t, lg in greedy), ']']
    if drafts is not None:
        parts += [',"drafts":[',
                  ','.join('{"position":%d,"ids":[%s],"confidence":%s}' %
                           (p, ','.join(str(int(i)) for i in d), fmt_floats(c)) for p, d, c, _ in drafts), ']']
    parts.append('}\n')
    return ''.join(parts)


# The fast path's documented error of a routing selection score (engine/backend/cpu/cpu_backend.h, "Decisions").
ROUTE_ERROR_REL = 2.0 ** -8


def route_error_bound(score):
    """Documented error of each selection score sqrt(softplus(z)) + bias of the fast path, given
    the same block input: ROUTE_ERROR_REL * (1 + |score|)."""
    return ROUTE_ERROR_REL * (1.0 + np.abs(np.asarray(score, np.float64)))


def ranking_admissible(order, scores, err):
    """Whether `order` (expert ids in routing order) is a top-k output of some score vector within
    err[e] of `scores` (REFERENCE.md 10.1): every id it ranks above another, and every id it keeps
    over one it drops, may not trail it by more than the two errors."""
    order = [int(v) for v in order]
    kept = set(order)
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            if scores[b] - scores[a] > err[a] + err[b]:
                return False
        for e in range(len(scores)):
            if e not in kept and scores[e] - scores[a] > err[a] + err[e]:
                return False
    return True


def boundary_margin(scores, k):
    """The gap between the k-th and (k+1)-th highest scores (inf when there is no (k+1)-th)."""
    v = np.sort(np.asarray(scores, np.float64)[np.isfinite(scores) | np.isinf(scores)])[::-1]
    return float(v[k - 1] - v[k]) if 0 < k < len(v) else float('inf')


def compare_decisions(kind, L, part, s, cand, own, stats, examples):
    """One row's decision of the candidate (dump) against the reference's own on the same inputs.
    Index and candidate-block scores have no documented error on the fast path (engine/backend/cpu/cpu_backend.h):
    any difference is a violation.  Expert choices may differ within the route error
    (route_error_bound): the candidate's ranking must fit scores within it of the reference's."""
    st = stats.setdefault(kind, {'compared': 0, 'differ': 0, 'admissible': 0, 'violations': 0})
    ref_sel, ref_score, ref_err = own
    c = [int(v) for v in cand if v >= 0]
    st['compared'] += 1
    same = c == [int(v) for v in ref_sel]
    if same:
        return
    st['differ'] += 1
    ok = kind == 'experts' and ranking_admissible(c, ref_score, ref_err)
    st['admissible' if ok else 'violations'] += 1
    if not ok and len(examples) < 10:
        m = boundary_margin(ref_score, len(ref_sel)) if ref_score is not None else None
        examples.append({'part': part, 'layer': L, 'row': s, 'kind': kind, 'reference': [int(v) for v in ref_sel],
                         'candidate': c, 'reference_margin': m})


def row_rel_error(got, ref):
    """Per row (first axis): max |got - ref| / max |ref| (0 for two zero rows, inf for a non-zero
    difference against a zero row)."""
    got = got.reshape(got.shape[0], -1).astype(np.float64)
    ref = ref.reshape(ref.shape[0], -1).astype(np.float64)
    num = np.max(np.abs(got - ref), axis=1)
    den = np.max(np.abs(ref), axis=1)
    with np.errstate(divide='ignore', invalid='ignore'):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.where(num > 0, np.inf, 0.0))


def layer_check(model, dump_path):
    """Recompute every block from the dumped input stream (and pre-mix) of every part and compare
    with the dumped outputs.  Returns the report dict.

    When the dump has the decisions (REFERENCE.md 10.1: index_sel, cand, experts), the candidate's
    index selections and routed experts are forced into the reference, so the arithmetic is
    compared on the same decisions, and each decision is compared with the reference's own made
    from the same inputs (report 'decisions': per kind compared / differ / admissible /
    violations; a violation fails the check)."""
    f = SafetensorsFile(dump_path)
    cfg = model.cfg
    n = cfg.n_layers

    def get(name):
        if name not in f.tensors:
            raise RefError(f"{dump_path}: tensor {name} missing")
        return f.array(name)

    ids = [int(v) for v in get('ids')]
    dec = [int(v) for v in get('decode_ids')] if 'decode_ids' in f.tensors else []
    st = model.new_state()
    report = {'layers': [], 'parts': [], 'decisions_present': False}
    dstats, dexamples = {}, []
    per_layer = {L: {'out': [], 'attn': [], 'ffn': [], 'pre': []} for L in range(n)}
    logit_rows = []

    def rowrel(got, ref):
        return row_rel_error(got, ref).tolist()

    plan = [('prefill', ids)] + [(f'decode.{k}', [t]) for k, t in enumerate(dec)]
    for pname, toks in plan:
        S = len(toks)
        hs = [get(f'{pname}.h.{L}') for L in range(n + 1)]
        pres = [get(f'{pname}.pre.{L}') for L in range(n)]
        for L in range(n + 1):
            if hs[L].shape != (S, cfg.hc, cfg.dim):
                raise RefError(f"{dump_path}: {pname}.h.{L} has shape {hs[L].shape}, expected {(S, cfg.hc, cfg.dim)}")
        rec = {}
        force = {}
        for L in range(n):
            if L in cfg.index_sources and f'{pname}.index_sel.{L}' in f.tensors:
                force[('index', L)] = get(f'{pname}.index_sel.{L}')
            if f'{pname}.experts.{L}' in f.tensors:
                force[('experts', L)] = get(f'{pname}.experts.{L}')
        logits = model.forward(st, toks, rec=rec, override={'h': hs, 'pre': pres, 'force': force})
        own = rec['decisions'][0]
        for kind, tname in (('index', 'index_sel'), ('cand', 'cand'), ('experts', 'experts')):
            for L in range(n):
                key = f'{pname}.{tname}.{L}'
                if key not in f.tensors:
                    continue
                report['decisions_present'] = True
                got = get(key)
                mine = own.get((kind, L), {})
                for srow in range(S):
                    ref = mine.get(srow, (np.zeros(0, np.int64), None, None))
                    compare_decisions(kind, L, pname, srow, got[srow], ref, dstats, dexamples)
        for L in range(n):
            per_layer[L]['out'] += rowrel(rec[f'out.{L}'][0], hs[L + 1])
            per_layer[L]['attn'] += rowrel(rec[f'attn.{L}'][0], get(f'{pname}.attn.{L}'))
            per_layer[L]['ffn'] += rowrel(rec[f'ffn.{L}'][0], get(f'{pname}.ffn.{L}'))
            if L + 1 < n:
                per_layer[L]['pre'] += rowrel(rec[f'outpre.{L}'][0], pres[L + 1])
        logit_rows += rowrel(logits, get(f'{pname}.logits'))
        report['parts'].append(pname)
    ok = True
    for L in range(n):
        ent = {'layer': L}
        for k, v in per_layer[L].items():
            if v:
                ent[k] = {'max': float(np.max(v)), 'median': float(np.median(v))}
        # REFERENCE.md 10: block output max relative error <= 2e-2, per-layer median <= 5e-3
        ent['pass'] = ent['out']['max'] <= 2e-2 and ent['out']['median'] <= 5e-3
        ok = ok and ent['pass']
        report['layers'].append(ent)
    report['logits'] = {'max': float(np.max(logit_rows)), 'median': float(np.median(logit_rows))}
    report['decisions'] = dstats
    report['decision_violations'] = dexamples
    ok = ok and all(v['violations'] == 0 for v in dstats.values())
    report['pass'] = ok
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--model', required=True, help='checkpoint directory (Hugging Face layout)')
    ap.add_argument('--ids', help='comma-separated prompt token ids')
    ap.add_argument('--chunk', type=int, default=0, help='prefill chunk size (default: whole prompt)')
    ap.add_argument('--decode', type=int, default=0, help='greedy decode steps')
    ap.add_argument('--dump', help='write the section 10.1 stream dump (safetensors)')
    ap.add_argument('--drafts', action='store_true',
                    help='before each greedy step, the DSpark draft block from its token ("drafts")')
    ap.add_argument('--layer-check', help='recompute every block from this stream dump and report')
    ap.add_argument('--out', required=True, help='output JSON file')
    a = ap.parse_args(argv)
    try:
        model = Model(a.model)
        if a.layer_check:
            rep = layer_check(model, a.layer_check)
            with open(a.out, 'w', encoding='utf-8') as fh:
                json.dump(rep, fh, indent=1)
                fh.write('\n')
            return 0 if rep['pass'] else 1
        if not a.ids:
            raise RefError('--ids is required (unless --layer-check)')
        try:
            ids = [int(v) for v in a.ids.split(',') if v.strip() != '']
        except ValueError:
            raise RefError(f"--ids: not a comma-separated list of integers: {a.ids!r}")
        if not ids:
            raise RefError('--ids: empty prompt')
        if a.chunk < 0 or a.decode < 0:
            raise RefError('--chunk and --decode must be >= 0')
        if a.drafts and not model.cfg.dspark:
            raise RefError('--drafts: the model has no DSpark stages')
        drafts = [] if a.drafts else None
        prefill, greedy, dump = run_ids(model, ids, a.chunk or None, a.decode, bool(a.dump), drafts)
        with open(a.out, 'w', encoding='utf-8') as fh:
            fh.write(result_json(ids, prefill, greedy, drafts))
        if a.dump:
            write_safetensors(a.dump, dump)
        return 0
    except RefError as e:
        print(f"ds41_ref: {e}", file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
