#!/usr/bin/python3
"""TAP self-check of the numpy reference (ds41_ref.py) and the checkpoint generator (gen_ckpt.py).

Checks: scalar codecs (bf16 RNE, all 256 e4m3 codes, e2m1 ties, ue8m0 scale edges), the canonical
exact-sum rounding, RoPE/YaRN frequencies and layer roles of the released config, Engram hashing
(960 external vectors, release multipliers/primes), the Engram token-map normalisation, the
generated checkpoint layout, and on generated checkpoints: prefill of the whole prompt == prefill
in chunks of 1, 3, 7 (and random schedules) == token-by-token decode, bit for bit; greedy decode
== prefill of the extended sequence; the CLI output format, the stream dump and the layer-local
check.  DS41_LONG_TESTS=1 adds longer prompts, more seeds and more chunk schedules.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from fractions import Fraction

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import ds41_ref as R  # noqa: E402
import gen_ckpt as G  # noqa: E402

DATA = os.path.join(HERE, '..', 'data', 'reference')
LONG = os.environ.get('DS41_LONG_TESTS') == '1'


class Tap:
    def __init__(self):
        self.n = 0
        self.failed = 0

    def ok(self, cond, desc, diag=None):
        self.n += 1
        if cond:
            print(f"ok {self.n} - {desc}")
        else:
            self.failed += 1
            print(f"not ok {self.n} - {desc}")
            if diag:
                for line in str(diag).splitlines():
                    print(f"# {line}")
        sys.stdout.flush()
        return cond

    def run(self, desc, fn):
        """Run a group; an exception is one failing line."""
        try:
            fn()
        except Exception:  # noqa: BLE001 - report, keep going
            self.ok(False, f"{desc}: raised", traceback.format_exc())


T = Tap()


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def same_bits(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


def rne_f32_oracle(q):
    """fp32 RNE of a Fraction, by comparing neighbours."""
    if q == 0:
        return 0.0
    x = np.float32(float(q))
    cands = [c for c in (x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(-np.inf)))
             if np.isfinite(c)]
    return float(min(cands, key=lambda c: (abs(Fraction(float(c)) - q), int(bits(c)) & 1)))


# ================================================================================================
# scalar formats
# ================================================================================================

def test_bf16():
    one = 1.0
    cases = [
        (one + 2 ** -8, one),                       # tie -> even (1.0)
        (one + 3 * 2 ** -8, one + 2 ** -6),         # tie -> even (up)
        (one + 2 ** -8 + 2 ** -20, one + 2 ** -7),  # above tie -> up
        (-(one + 2 ** -8), -one),
        (float(np.finfo(np.float32).max), math.inf),
        (-0.0, -0.0),
        (2.0 ** -134, 0.0),                         # half the smallest bf16 subnormal: tie -> 0
        (3 * 2.0 ** -134, 2.0 ** -132),             # tie -> even (up)
        (2.0 ** -149, 0.0),                         # fp32 subnormal far below the bf16 grid
    ]
    bad = [(v, e, float(R.bf16(np.float32(v)))) for v, e in cases
           if not same_bits(R.bf16(np.float32(v)), np.float32(e))]
    T.ok(not bad, "bf16 RNE edge cases (ties to even, overflow to inf, signed zero, subnormals)", bad)
    T.ok(bool(np.isnan(R.bf16(np.float32(np.nan)))), "bf16 keeps NaN")
    rng = np.random.default_rng(1)
    v = (rng.standard_normal(3000) * 2.0 ** rng.integers(-30, 30, 3000)).astype(np.float32)
    got = R.bf16(v)
    bad = []
    for x, g in zip(v, got):
        # bf16 grid step at x: 2^(exponent-7)
        q = Fraction(float(x))
        e = math.frexp(float(x))[1] - 1
        step = Fraction(2) ** (e - 7)
        k = q / step
        fl = math.floor(k)
        r = k - fl
        kk = fl + (1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and fl % 2) else 0)
        if float(kk * step) != float(g):
            bad.append((float(x), float(g), float(kk * step)))
    T.ok(not bad, "bf16 RNE equals an exact rational rounding on 3000 random values", bad[:3])


def test_e4m3():
    tab = R.E4M3_TABLE
    spot = {0x00: 0.0, 0x01: 2.0 ** -9, 0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x38: 1.0, 0x3F: 1.875,
            0x40: 2.0, 0x7E: 448.0, 0x80: -0.0, 0xB8: -1.0, 0xFE: -448.0}
    bad = [(hex(c), float(tab[c]), v) for c, v in spot.items() if not same_bits(tab[c], np.float32(v))]
    T.ok(not bad, "e4m3 decode spot values (subnormal, normal, max 448, signed zero)", bad)
    T.ok(bool(np.isnan(tab[0x7F]) and np.isnan(tab[0xFF]) and np.isnan(tab).sum() == 2),
         "e4m3 NaN only at 0x7F / 0xFF")
    pos = tab[:0x7F].astype(np.float64)
    T.ok(bool(np.all(np.diff(pos) > 0)), "e4m3 codes 0x00..0x7E strictly increasing")
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
    rt = R.e4m3_encode(tab[codes])
    T.ok(np.array_equal(rt, codes), "e4m3 encode(decode(c)) == c for all 254 finite codes")
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    assert np.array_equal(mids.astype(np.float64), (pos[:-1] + pos[1:]) / 2)   # exact in fp32
    enc = R.e4m3_encode(mids)
    even = np.where(np.arange(0x7E) % 2 == 0, np.arange(0x7E), np.arange(1, 0x7F))
    T.ok(np.array_equal(enc, even.astype(np.uint8)), "e4m3 ties between consecutive codes go to the even code")
    sat = R.e4m3_encode(np.array([448.0, 460.0, 1e6, np.inf, -1e6, 2.0 ** -10, 2.0 ** -10 * 1.0001,
                                  -2.0 ** -10], np.float32))
    T.ok(list(sat) == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x00, 0x01, 0x80],
         "e4m3 saturates to +-448, 2^-10 ties to 0, just above goes to 2^-9, -2^-10 -> -0", list(sat))
    rng = np.random.default_rng(2)
    v = (rng.standard_normal(20000) * 2.0 ** rng.integers(-12, 10, 20000)).astype(np.float32)
    T.ok(np.array_equal(R.e4m3_encode(v), G.enc_e4m3(v)) and np.array_equal(R.e4m3_encode(mids), G.enc_e4m3(mids)),
         "e4m3 encoder agrees with the generator's independent table-search encoder")


def test_e2m1():
    v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, -0.0, 0.0, 6.0, 0.2500001,
                  1.2500001, 4.9999995], np.float32)
    want = [0, 2, 2, 4, 4, 6, 6, 8, 10, 14, 8, 0, 7, 1, 3, 6]
    got = list(R.e2m1_encode(v))
    T.ok(got == want, "e2m1 ties (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), -0 sign bit", got)
    T.ok([float(x) for x in R.E2M1_TABLE] == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6],
         "e2m1 16-entry table")
    rng = np.random.default_rng(3)
    r = np.clip(rng.standard_normal(20000) * 3, -6, 6).astype(np.float32)
    T.ok(np.array_equal(R.e2m1_encode(r), G.enc_e2m1(r)), "e2m1 encoder agrees with the generator's encoder")


def test_ue8m0():
    def k(amax, recip, floor):
        return int(R.ue8m0_exponent(np.maximum(np.float32(amax), np.float32(floor)), recip))
    cases = [
        ('fp8 amax 448 -> 2^0', k(448, R.R448, 1e-4), 0),
        ('fp8 amax 449 -> 2^1', k(449, R.R448, 1e-4), 1),
        ('fp8 amax 224 -> 2^0 (fp32(224/448 recip) = 0.5 + ulp, rounded up)',
         k(224, R.R448, 1e-4), int(math.ceil(math.log2(Fraction(float(np.float32(224) * R.R448)))))),
        ('fp8 amax 0 floored at 1e-4 -> 2^-22', k(0, R.R448, 1e-4), -22),
        ('fp4 amax 6 -> 2^0', k(6, R.R6, 6 * 2.0 ** -126), 0),
        ('fp4 amax 6.0000005 -> 2^1', k(6.0000005, R.R6, 6 * 2.0 ** -126), 1),
        ('fp4 amax 0 floored at 6*2^-126 -> 2^-126', k(0, R.R6, 6 * 2.0 ** -126), -126),
        ('fp4 amax 3 -> 2^-1', k(3, R.R6, 6 * 2.0 ** -126), -1),
    ]
    bad = [(d, g, w) for d, g, w in cases if g != w]
    T.ok(not bad, "ue8m0 scale: power of two rounded up from fp32(amax * fp32 reciprocal), floors", bad)
    T.ok(float(R.R448) == 0.0022321429569274187 and float(R.R6) == 0.1666666716337204,
         "ue8m0 reciprocals are the fp32 constants of REFERENCE.md 1.2")
    rng = np.random.default_rng(4)
    am = np.abs(rng.standard_normal(5000) * 2.0 ** rng.integers(-20, 20, 5000)).astype(np.float32)
    ks = R.ue8m0_exponent(am, R.R448)
    want = [math.ceil(math.log2(Fraction(float(np.float32(a) * R.R448)))) for a in am]
    T.ok(list(ks) == want, "ue8m0 exponent == ceil(log2 t) exactly on 5000 random amax")
    ev = R.e8m0_value(np.array([0, 1, 127, 128, 254, 255], np.uint8))
    T.ok(same_bits(ev[:5], np.array([2.0 ** -127, 2.0 ** -126, 1, 2, 2.0 ** 127], np.float32)) and np.isnan(ev[5]),
         "e8m0 decode: 0 -> 2^-127, 127 -> 1, 254 -> 2^127, 255 -> NaN")


def test_act_quant():
    rng = np.random.default_rng(5)
    x = R.bf16((rng.standard_normal((6, 64)) * 3).astype(np.float32))
    x[0, :32] = 0.0
    q, s = R.act_quant_fp8(x)
    T.ok(same_bits(s[0, 0], np.float32(2.0 ** -22)) and not q[0, :32].any(),
         "act_quant: all-zero group gets the floor scale 2^-22 and zero codes")
    amax = np.abs(x.reshape(6, 2, 32)).max(-1)
    ok = np.all((amax[1:] / s[1:] <= 448) & (amax[1:] / s[1:] > 224))
    T.ok(bool(ok), "act_quant: amax/scale in (224, 448] (tight power-of-two scale)")
    y = R.qdq_fp4_e4m3scale(x, 16)
    xb = x.reshape(6, 4, 16)
    am = np.maximum(np.abs(xb).max(-1), np.float32(6 * 2.0 ** -9))
    sc = R.e4m3_rne(am / np.float32(6.0))
    manual = R.bf16(R.E2M1_TABLE[R.e2m1_encode(np.clip(xb / sc[..., None], -6, 6))] * sc[..., None]).reshape(6, 64)
    T.ok(same_bits(y, manual) and not y[0, :32].any(),
         "FP4 1x16 e4m3-scale QDQ (non-power-of-two scale, zero group stays zero)")


# ================================================================================================
# canonical reductions
# ================================================================================================

def test_exact_sum():
    t = np.array([1.0, 2.0 ** -24, 2.0 ** -80])
    naive = np.float32(t[0] + t[1] + t[2])
    got = R.xsum(t)
    T.ok(same_bits(got, np.float32(1 + 2.0 ** -23)) and not same_bits(naive, got),
         "exact sum: 1 + 2^-24 + 2^-80 rounds up to 1+2^-23 (naive double sum gives 1.0)")
    t = np.array([2.0 ** 60, 1.0, -2.0 ** 60])
    T.ok(same_bits(R.xsum(t), np.float32(1.0)), "exact sum survives cancellation (2^60 + 1 - 2^60 = 1)")
    T.ok(same_bits(R.xsum(np.array([-0.0, -0.0])), np.float32(0.0)) and
         same_bits(R.xsum(np.array([1.5, -1.5])), np.float32(0.0)),
         "exact zero sum is +0.0 (decision)")
    T.ok(same_bits(R.xsum(np.array([-2.0 ** -160, 0.0])), np.float32(-0.0)),
         "non-zero sum rounding to zero keeps its sign")
    mid = 1 + 2.0 ** -24
    T.ok(same_bits(R.xsum(np.array([mid, 0.0])), np.float32(1.0)) and
         same_bits(R.xsum(np.array([1 + 3 * 2.0 ** -24, 0.0])), np.float32(1 + 2.0 ** -22)),
         "exact sum at an fp32 midpoint ties to even")
    A = np.array([[3.0, 5.0]], np.float32)
    T.ok(same_bits(R.xsum(np.array([[1.0, 2.0, 3.0]]), divisor=3)[0], np.float32(2.0)) and
         same_bits(R.xsum(np.array([1.0]), divisor=3), np.float32(1 / 3)) and
         same_bits(R.xdot(A, A)[0, 0], np.float32(34.0)),
         "divided sums and dot products round once")
    rng = np.random.default_rng(6)
    bad = []
    n_checked = 0
    for trial in range(1500 if not LONG else 6000):
        n = int(rng.integers(1, 70))
        kind = trial % 4
        if kind == 0:
            a = R.bf16(rng.standard_normal(n).astype(np.float32))
            b = R.bf16(rng.standard_normal(n).astype(np.float32))
        elif kind == 1:
            a = R.bf16((rng.standard_normal(n) * 2.0 ** rng.integers(-40, 40, n)).astype(np.float32))
            b = R.bf16(rng.standard_normal(n).astype(np.float32))
        elif kind == 2:
            a = rng.standard_normal(n).astype(np.float32)
            b = np.where(rng.integers(0, 2, n) == 0, 1.0, -1.0).astype(np.float32)
            a = np.concatenate([a, a[:n // 2]])
            b = np.concatenate([b, -b[:n // 2]])
        else:
            a = R.bf16(rng.standard_normal(n).astype(np.float32))
            b = rng.standard_normal(n).astype(np.float32)
        terms = a.astype(np.float64) * b.astype(np.float64)
        div = int(rng.choice([1, 1, 64, 96, 20480]))
        want = rne_f32_oracle(sum(Fraction(float(x)) for x in terms) / div)
        got = float(R.xsum(terms, divisor=div))
        n_checked += 1
        if not same_bits(np.float32(got), np.float32(want)):
            bad.append((kind, div, got, want))
        if div == 1 and not same_bits(R.xdot(a[None], b[None])[0, 0], np.float32(want)):
            bad.append(('xdot', kind, want))
    T.ok(not bad, f"exact sum / dot product == rational oracle on {n_checked} random rows "
                  "(bf16 products, wide exponent ranges, cancellations, fp32 x bf16)", bad[:4])


# ================================================================================================
# released configuration: roles, rope, engram
# ================================================================================================

def release_cfg():
    with open(os.path.join(DATA, 'release_inference_config.json'), encoding='utf-8') as fh:
        return R.Config(json.load(fh))


def test_release_roles():
    c = release_cfg()
    want_kv = {L: None for L in (0, 1)}
    want_kv.update({L: 2 for L in range(2, 8)})
    want_kv.update({L: 8 for L in range(8, 14)})
    want_kv.update({L: 14 for L in range(14, 20)})
    want_kv.update({L: 20 for L in range(20, 40)})
    want_idx = {L: want_kv[L] for L in range(0, 24)}
    for s in (24, 28, 32, 36):
        for L in range(s, s + 4):
            want_idx[L] = s
    got_kv = {L: c.kv_src[L] for L in range(40)}
    got_idx = {L: c.idx_src[L] for L in range(40)}
    T.ok(got_kv == want_kv, "release roles: KV source per layer (REFERENCE.md 0.1 table)",
         {L: (got_kv[L], want_kv[L]) for L in got_kv if got_kv[L] != want_kv[L]})
    T.ok(got_idx == want_idx, "release roles: index source per layer",
         {L: (got_idx[L], want_idx[L]) for L in got_idx if got_idx[L] != want_idx[L]})
    T.ok(c.cand_src == 20 and c.cand_users == [24, 28, 32, 36], "release roles: candidate source 20, users 24..36",
         (c.cand_src, c.cand_users))
    T.ok(c.engram_layers == [1, 14] and c.ratios[40:] == [0, 0, 0], "release roles: engram 1, 14; DSpark ratio 0")
    ok = all(c.rope_params(L) == (10000.0, None) for L in (0, 1)) and \
        all(c.rope_params(L) == (160000.0, (65536.0, 16.0, 32.0, 1.0)) for L in range(2, 40))
    T.ok(ok, "release rope: ratio-0 layers theta 10000 no YaRN; ratio>0 layers 160000 + YaRN")
    msgs = []
    for key, val in (('index_topk', None), ('compress_ratios', None), ('kv_source_layers', [2, 3])):
        d = dict(c.raw)
        if val is None:
            del d[key]
        else:
            d[key] = val
        try:
            R.Config(d)
            msgs.append((key, 'accepted'))
        except R.RefError as e:
            msgs.append((key, str(e)))
    T.ok('missing key index_topk' in msgs[0][1] and 'missing key compress_ratios' in msgs[1][1] and
         ('layer 3' in msgs[2][1] or 'KV source 3' in msgs[2][1]),
         "config errors name the key / layer (missing keys, a consumer whose KV source has another ratio)", msgs)


def test_rope():
    T.ok(R.yarn_low_high(64, 160000.0, 65536.0, 32.0, 1.0) == (15, 25), "YaRN band of the release: low 15, high 25")
    plain = R.rope_frequencies(64, 160000, None)
    yarn = R.rope_frequencies(64, 160000, (65536, 16, 32, 1))
    T.ok(same_bits(yarn[:16], plain[:16]) and same_bits(yarn[25:], plain[25:] / np.float32(16)),
         "YaRN: pairs 0..15 unchanged, 25..31 divided by 16 exactly")
    mid = yarn[16:25]
    T.ok(bool(np.all(mid < plain[16:25]) and np.all(mid > plain[16:25] / 16)), "YaRN: pairs 16..24 blended")
    ref = np.array([1.0 / 10000.0 ** (2 * i / 64) for i in range(32)])
    f = R.rope_frequencies(64, 10000, None).astype(np.float64)
    T.ok(bool(np.all(np.abs(f / ref - 1) < 2 ** -22)), "rope frequencies within 2 fp32 ulp of 1/base^(2i/rd)")
    rp = R.Rope(16, 10000, None)
    x = R.bf16(np.random.default_rng(7).standard_normal((3, 2, 32)).astype(np.float32))
    pos = np.array([0, 5, 1000])
    y = rp.apply(x, pos)
    T.ok(same_bits(y[0], x[0]) and same_bits(y[..., :16], x[..., :16]) and not same_bits(y[2], x[2]),
         "rope touches only the last rd features and is the identity at position 0")
    c, s = rp.table(np.array([1000]))
    a, b = x[2, 0, 16], x[2, 0, 17]
    T.ok(same_bits(y[2, 0, 16], R.bf16(a * c[0, 0] - b * s[0, 0])) and
         same_bits(y[2, 0, 17], R.bf16(a * s[0, 0] + b * c[0, 0])),
         "rope rotates adjacent pairs (a c - b s, a s + b c)")


def test_engram_release():
    mult = {L: R.engram_multipliers(L, 4, 99092) for L in (1, 14)}
    T.ok(mult[1] == [76632096046245, 4839876093313, 35959672319349, 73987337458391] and
         mult[14] == [67716810739261, 51510806800915, 30921347202721, 82619226485591],
         "engram multipliers of the release (REFERENCE.md 6.2)", mult)
    primes = R.engram_primes([1, 14], 4, 8, 16000000)
    T.ok(primes[0][0] == [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183] and
         primes[1][2] == [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889] and
         sum(map(sum, primes[0])) == 384006168 and sum(map(sum, primes[1])) == 384016682,
         "engram primes of the release (global seen set; sums = engram_num_embeddings)")
    with open(os.path.join(DATA, 'engram_rng_values_numpy1.24.json'), encoding='utf-8') as fh:
        d = json.load(fh)
    rel = d['release']
    offs = []
    for per_layer in primes:
        flat = [p for pn in per_layer for p in pn]
        offs.append([sum(flat[:i]) for i in range(len(flat))])
    T.ok(rel['multipliers'] == [mult[1], mult[14]] and rel['primes_[layer][ngram-2][head]'] == primes and
         rel['offsets_[layer][col]'] == offs and offs[0][-1] == 368005705,
         "engram multipliers / primes / offsets equal the numpy-1.24 vector file")
    tiny = d['ishizuki_tiny']
    tm = [R.engram_multipliers(L, 4, 270) for L in (1, 4)]
    tp = R.engram_primes([1, 4], 4, 2, 101)
    T.ok(tm == tiny['multipliers'] and tp == tiny['primes'] and [sum(map(sum, p)) for p in tp] == tiny['rows'],
         "engram multipliers / primes of a tiny config (compressed vocab 270, vocab 101)")


def test_engram_hash_vectors():
    with open(os.path.join(DATA, 'dsv41_engram_hash_vectors.json'), encoding='utf-8') as fh:
        d = json.load(fh)
    lay = d['layout']
    layers = lay['layer_ids']
    N, H = lay['max_ngram_size'], lay['n_heads']
    primes = R.engram_primes(layers, N, H, lay['engram_vocab_size'])
    tm = d['token_map']
    pad = tm[lay['pad_id_raw']]
    per = []
    for k, L in enumerate(layers):
        flat = [p for pn in primes[k] for p in pn]
        per.append((R.engram_multipliers(L, N, lay['compressed_vocab_size']), primes[k],
                    [sum(flat[:i]) for i in range(len(flat))]))

    def rows(cids):
        out = []
        for p in range(len(cids)):
            for mult, pr, off in per:
                out += R.engram_hash_rows(cids, [p], mult, pr, off, pad)[0].tolist()
        return out
    f1 = [tm[t] for t in d['f1_tokens']]
    f2 = [c if m else -1 for c, m in zip(f1, d['f2_mask'])]
    r1, r2 = rows(f1), rows(f2)
    r3a = rows([tm[t] for t in d['f3a_tokens']])
    r3b = rows([tm[t] for t in d['f3b_tokens']])
    n = len(r1) + len(r2) + len(r3a)
    T.ok(r1 == d['f1_rows'] and r2 == d['f2_rows'] and r3a == d['f3_rows'] and r3b == d['f3_rows'] and n == 960,
         f"engram hash row ids equal the {n} external vectors (prefill, DEAD position, shared compressed id)")


def test_token_map():
    N = R.engram_normalize
    cases = [("  Hello\t\nWorld  ", "hello world"), ("café", "cafe"), ("ﬁne", "fine"), (" ", " "),
             ("\n", " "), ("\t\t", " "), ("\u00a0", " "), ("\u3000", " "), ("ΣΑΣ", "σασ"), ("İ", "i"),
             ("Å", "a"), ("x\u00a0", "x"), ("\u00a0x\u2003", "x"), ("１２", "12"), ("½", "1⁄2"),
             ("ẞ", "ß"), ("A\u0301\u0300", "a"), ("\u200b", "\u200b"), ("\u0301", "")]
    bad = [(s, N(s), w) for s, w in cases if N(s) != w]
    T.ok(not bad, "engram normalisation: NFKC, NFD + drop marks, per-char lowercase, whitespace rules", bad)
    T.ok(R.byte_level_decode(R.BYTE_TO_UNICODE[0xE4] + R.BYTE_TO_UNICODE[0xBD]) == '\ufffd' and
         R.byte_level_decode('<｜User｜>') == '<｜User｜>' and
         R.byte_level_decode(''.join(R.BYTE_TO_UNICODE[b] for b in ' é'.encode())) == ' é',
         "byte-level decode: partial UTF-8 -> U+FFFD, added tokens decode to themselves")
    tok, sp = G.make_tokenizer(400)
    cmap, n = R.compressed_token_map(tok, 400)
    rev = {s: i for s, i in tok['model']['vocab'].items()}

    def tid(text):
        return rev[''.join(R.BYTE_TO_UNICODE[b] for b in text.encode('utf-8'))]
    ok = (cmap[tid('Hello')] == cmap[tid('hello')] == cmap[tid('HELLO')] and
          cmap[tid('é')] == cmap[tid('e')] and cmap[tid('café')] == cmap[tid('cafe')] and
          cmap[tid('ﬁne')] == cmap[tid('fine')] and cmap[tid(' the')] == cmap[tid('the')] and
          cmap[tid('  ')] == cmap[tid(' ')] and cmap[tid('naïve')] == cmap[tid('naive')] and
          cmap[tid('Hello')] != cmap[tid('World')])
    partial = rev[R.BYTE_TO_UNICODE[0xE4] + R.BYTE_TO_UNICODE[0xBD]]
    T.ok(ok, "compressed token map merges case / accent / NFKC / whitespace variants")
    T.ok(cmap[partial] != cmap[tid(' ')] and len(set(cmap)) == n and cmap[:3] == [0, 1, 2] and
         max(cmap) == n - 1, "compressed ids by first appearance; partial-UTF-8 tokens keyed by raw string", n)


# ================================================================================================
# generated checkpoint
# ================================================================================================

def test_checkpoint_layout(ck, preset):
    with open(os.path.join(ck, 'model.safetensors.index.json'), encoding='utf-8') as fh:
        wm = json.load(fh)['weight_map']
    shards = sorted(set(wm.values()))
    T.ok(len(shards) >= 2 and all(re.fullmatch(r'model-\d{5}-of-\d{5}\.safetensors', s) for s in shards),
         f"{preset}: >= 2 shards + index ({len(shards)} shards)")
    ckp = R.Checkpoint(ck)
    dtypes = {}
    for name in wm:
        dt = ckp.where[name].tensors[name][0]
        dtypes[name] = dt
    with open(os.path.join(ck, 'inference', 'config.json'), encoding='utf-8') as fh:
        c = R.Config(json.load(fh))
    bad = [n for n, d in dtypes.items() if n.endswith('.scale') and d != 'F8_E8M0'
           and not n.endswith(('hc_attn_scale', 'hc_ffn_scale'))]
    bad += [n for n, d in dtypes.items() if '.experts.' in n and n.endswith('.weight') and d != 'I8']
    T.ok(not bad, f"{preset}: every .scale is F8_E8M0, every routed expert weight is I8", bad[:4])
    want = {
        'layers.2.attn.compressor.wgate.weight': True, 'layers.4.attn.compressor.wkv.weight': True,
        'layers.4.attn.compressor.wgate.weight': False, 'layers.6.attn.compressor.wkv.weight': False,
        'layers.6.attn.indexer.wq_b.weight': True, 'layers.6.attn.indexer.wk.weight': False,
        'layers.3.attn.indexer.wq_b.weight': False, 'layers.1.engram.embed.weight': True,
        'layers.4.engram.wkv.weight': True, 'layers.0.engram.q_weight': False,
        'mtp.0.main_proj.weight': True, f'mtp.{c.n_mtp - 1}.markov_head.head.weight': True,
        f'mtp.{c.n_mtp - 1}.confidence_head.proj.weight': True, 'mtp.0.attn.compressor.wkv.weight': False,
        f'mtp.0.ffn.experts.{c.raw["dspark_n_routed_experts"] - 1}.w2.weight': True,
        'head.weight': True, 'image_newline': True,
    }
    bad = [(n, w) for n, w in want.items() if (n in wm) != w]
    T.ok(not bad, f"{preset}: role tensors present exactly where the roles need them", bad)
    roles = c.roles()
    T.ok([r['ratio'] for r in roles] == G.LAYOUT['compress_ratios_backbone'] and
         c.cand_users == [6, 8] and c.kv_src[3] == 2 and c.idx_src[7] == 6 and c.idx_src[5] == 4 and
         c.idx_src[9] == 8, f"{preset}: derived roles (consumers, candidate users) from the generated config")
    rel = release_cfg().raw
    differ = ['route_scale', 'swiglu_limit', 'rope_theta', 'compress_rope_theta', 'original_seq_len',
              'rope_factor', 'beta_fast', 'window_size', 'index_topk', 'candidate_topk_blocks',
              'candidate_block_size', 'engram_vocab_size', 'engram_n_heads', 'vocab_size']
    same = [k for k in differ if c.raw[k] == rel[k]]
    T.ok(not same, f"{preset}: constants differ from the release", same)
    with open(os.path.join(ck, 'tokenizer.json'), encoding='utf-8') as fh:
        tok = json.load(fh)
    added = {a['id']: a['content'] for a in tok['added_tokens']}
    V = c.vocab
    T.ok(added.get(0) == G.BOS and added.get(1) == G.EOS and added.get(2) == G.PAD and
         [added.get(i) for i in range(V - 5, V)] == G.TOP_SPECIALS and
         len(R.tokenizer_id_strings(tok, V)) == V,
         f"{preset}: tokenizer ids 0/1/2 and the chat specials at the top")
    vocab = tok['model']['vocab']
    bad = [m for m in tok['model']['merges'] if len(m.split(' ')) != 2 or
           any(p not in vocab for p in m.split(' ')) or m.replace(' ', '') not in vocab]
    T.ok(not bad and len(tok['model']['merges']) > 20, f"{preset}: BPE merges are consistent with the vocab", bad[:3])


def test_quantizers():
    rng = np.random.default_rng(8)
    W = (rng.standard_normal((70, 96)) * np.exp(rng.standard_normal((70, 1)))).astype(np.float32)
    W[:32, :32] = 0
    codes, sb = G.quant_fp8(W)
    s = R.e8m0_value(sb)
    sf = np.repeat(np.repeat(s, 32, 0), 32, 1)[:70, :96]
    deq = R.E4M3_TABLE[codes] * sf
    same = same_bits(deq, R.e4m3_rne(np.clip(W / sf, -448, 448)) * sf)
    blocks = np.abs(np.pad(W, ((0, 26), (0, 0)))).reshape(3, 32, 3, 32).max(axis=(1, 3))
    tight = np.all(((blocks / s > 224) & (blocks / s <= 448)) | (blocks == 0))
    T.ok(bool(same and tight and sb[0, 0] == 127 - 22), "FP8 weight encoder: 32x32 ue8m0 scales (tight, floor 1e-4), RNE codes")
    W4 = rng.standard_normal((8, 64)).astype(np.float32)
    packed, sb4 = G.quant_fp4(W4)
    codes4 = np.empty((8, 64), np.uint8)
    codes4[:, 0::2] = packed & 15
    codes4[:, 1::2] = packed >> 4
    s4 = np.repeat(R.e8m0_value(sb4), 32, 1)
    deq4 = R.E2M1_TABLE[codes4] * s4
    T.ok(same_bits(deq4, R.E2M1_TABLE[R.e2m1_encode(np.clip(W4 / s4, -6, 6))] * s4),
         "FP4 weight encoder: 1x32 ue8m0 scales, RNE, element 2i in the low nibble")


# ================================================================================================
# model: chunked prefill == whole prefill == token-by-token decode
# ================================================================================================

def prompt(rng, V, n):
    """BOS, then random ids with repeated spans (engram n-gram history) and a few specials."""
    ids = [0]
    while len(ids) < n:
        r = rng.random()
        if r < 0.15 and len(ids) > 4:
            k = int(rng.integers(2, 5))
            st = int(rng.integers(0, len(ids) - k))
            ids += ids[st:st + k]
        elif r < 0.2:
            ids.append(int(rng.choice([1, 2, V - 1, V - 5])))
        else:
            ids.append(int(rng.integers(3, V)))
    return ids[:n]


def run_chunks(model, ids, schedule):
    st = model.new_state()
    outs = []
    i = 0
    k = 0
    while i < len(ids):
        c = schedule[k % len(schedule)]
        outs.append(model.forward(st, ids[i:i + c]))
        i += c
        k += 1
    return np.concatenate(outs)


def check_model(ck, preset, lengths, schedules, need):
    model = R.Model(ck)
    rng = np.random.default_rng(11)
    for n in lengths:
        ids = prompt(rng, model.cfg.vocab, n)
        for k in model.stats:
            model.stats[k] = 0
        full = run_chunks(model, ids, [len(ids)])
        stats = dict(model.stats)
        for sch in schedules:
            got = run_chunks(model, ids, sch)
            T.ok(same_bits(got, full), f"{preset} len {n}: prefill in chunks {sch} == whole prefill, bit for bit",
                 f"max |diff| {float(np.max(np.abs(got - full)))}")
        if n >= 2 * model.cfg.window:
            miss = [k for k in need if stats.get(k, 0) == 0]
            T.ok(not miss, f"{preset} len {n}: exercised {', '.join(need)}", stats)
        else:
            T.ok(stats['window_wrapped'] == 0, f"{preset} len {n}: prompt shorter than the window", stats)
        T.ok(bool(np.all(np.isfinite(full)) and 0.3 < float(full.std()) < 30),
             f"{preset} len {n}: logits finite with O(1) spread (std {float(full.std()):.3f})")
    ids = prompt(rng, model.cfg.vocab, lengths[0])
    pre, greedy, _ = R.run_ids(model, ids, chunk=5, decode=4)
    ext = ids + [t for t, _ in greedy]
    full = run_chunks(model, ext, [len(ext)])
    toks_ok = greedy[0][0] == int(np.argmax(pre[-1])) and all(
        greedy[i + 1][0] == int(np.argmax(greedy[i][1])) for i in range(len(greedy) - 1))
    T.ok(toks_ok and same_bits(np.stack([g[1] for g in greedy]), full[len(ids):]) and same_bits(pre, full[:len(ids)]),
         f"{preset}: greedy decode logits == prefill of prompt + greedy tokens")
    return model


def test_cli(ck, model):
    tmp = tempfile.mkdtemp(prefix='ds41ref-cli-')
    try:
        rng = np.random.default_rng(12)
        ids = prompt(rng, model.cfg.vocab, 40)
        out = os.path.join(tmp, 'o.json')
        dump = os.path.join(tmp, 'd.safetensors')
        cmd = [sys.executable, os.path.join(HERE, 'ds41_ref.py'), '--model', ck, '--ids', ','.join(map(str, ids)),
               '--chunk', '6', '--decode', '3', '--dump', dump, '--out', out]
        p = subprocess.run(cmd, capture_output=True, text=True)
        T.ok(p.returncode == 0, "CLI: ds41_ref.py --chunk 6 --decode 3 --dump runs", p.stderr)
        with open(out, encoding='utf-8') as fh:
            text = fh.read()
        pre, greedy, dmp = R.run_ids(model, ids, chunk=None, decode=3, want_dump=True)
        T.ok(text == R.result_json(ids, pre, greedy), "CLI: output equals the library result (chunked == whole)")
        T.ok(text.startswith('{"ids":[' + str(ids[0]) + ',') and text.endswith(']}\n') and ' ' not in text and
             '"prefill_logits":[[' in text and '"greedy":[{"token":' in text,
             "CLI: compact JSON layout")
        d = json.loads(text)
        back = np.array(d['prefill_logits'], np.float64).astype(np.float32)
        T.ok(same_bits(back, pre) and len(d['greedy']) == 3 and len(d['greedy'][0]['logits']) == model.cfg.vocab,
             "CLI: %.9g floats round-trip to the exact float32 logits")
        f = R.SafetensorsFile(dump)
        n = model.cfg.n_layers
        S = len(ids)
        hc, D = model.cfg.hc, model.cfg.dim
        shp = {'ids': ('I64', [S]), 'decode_ids': ('I64', [3]), f'prefill.h.{n}': ('F32', [S, hc, D]),
               'prefill.pre.0': ('F32', [S, hc]), f'prefill.attn.{n - 1}': ('F32', [S, D]),
               'prefill.ffn.3': ('F32', [S, D]), 'prefill.logits': ('F32', [S, model.cfg.vocab]),
               'decode.2.h.0': ('F32', [1, hc, D]), 'decode.0.logits': ('F32', [1, model.cfg.vocab])}
        c = model.cfg
        src = c.index_sources[0]
        shp.update({'prefill.experts.0': ('I32', [S, c.topk_experts]),
                    'prefill.expert_score.0': ('F32', [S, c.n_experts]),
                    f'prefill.index_sel.{src}': ('I32', [S, c.index_topk]),
                    f'decode.1.index_sel.{src}': ('I32', [1, c.index_topk])})
        bad = [(k, f.tensors.get(k, (None, None))[:2], v) for k, v in shp.items() if f.tensors.get(k, (None, None))[:2] != v]
        decisions = ('.index_sel.', '.index_score.', '.cand.', '.cand_score.', '.experts.', '.expert_score.')
        streams = [k for k in f.tensors if not any(d in k for d in decisions)]
        T.ok(not bad and len(streams) == 2 + 4 * (4 * n + 2) and
             sum('.experts.' in k for k in f.tensors) == 4 * n,
             "dump: names, dtypes and shapes of section 10.1 (streams and decisions)", bad)
        lib = {name: arr for name, _, arr in dmp}
        same = all(np.array_equal(f.array(k), lib[k], equal_nan=True) for k in f.tensors)
        T.ok(same and same_bits(f.array('prefill.logits'), pre) and
             same_bits(f.array('prefill.pre.0'), np.tile(np.float32([1, 0, 0, 0]), (S, 1))) and
             list(f.array('decode_ids')) == [g[0] for g in greedy],
             "dump: chunked prefill dump has one prefill part equal to the whole-prompt streams")
        rep_path = os.path.join(tmp, 'lc.json')
        p = subprocess.run([sys.executable, os.path.join(HERE, 'ds41_ref.py'), '--model', ck,
                            '--layer-check', dump, '--out', rep_path], capture_output=True, text=True)
        with open(rep_path, encoding='utf-8') as fh:
            rep = json.load(fh)
        zero = all(e[k]['max'] == 0 for e in rep['layers'] for k in ('out', 'attn', 'ffn')) and rep['logits']['max'] == 0
        T.ok(p.returncode == 0 and rep['pass'] and zero and rep['parts'] == ['prefill', 'decode.0', 'decode.1', 'decode.2'],
             "layer-check of the reference's own dump: every block reproduces exactly", p.stderr)
        # perturb the stream entering block 5 (= output of block 4) by 10%: block 4 must fail,
        # blocks 0..3 stay exact
        tens = [(k, f.tensors[k][0], f.array(k)) for k in f.tensors]
        bad_t = []
        for k, dt, a in tens:
            if k == 'prefill.h.5':
                a = (a * np.float32(1.1)).astype(np.float32)
            bad_t.append((k, dt, a.astype({'F32': '<f4', 'I32': '<i4'}.get(dt, '<i8'))))
        dump2 = os.path.join(tmp, 'd2.safetensors')
        R.write_safetensors(dump2, bad_t)
        p = subprocess.run([sys.executable, os.path.join(HERE, 'ds41_ref.py'), '--model', ck,
                            '--layer-check', dump2, '--out', rep_path], capture_output=True, text=True)
        with open(rep_path, encoding='utf-8') as fh:
            rep = json.load(fh)
        L4 = rep['layers'][4]['out']['max']
        T.ok(p.returncode == 1 and not rep['pass'] and not rep['layers'][4]['pass'] and 0.05 < L4 < 0.2 and
             all(rep['layers'][L]['out']['max'] == 0 for L in range(4)),
             f"layer-check flags a 10% error entering block 5 at block 4 only (rel {L4:.3f})")
        p = subprocess.run([sys.executable, os.path.join(HERE, 'ds41_ref.py'), '--model', ck, '--ids', '0,99999',
                            '--out', out], capture_output=True, text=True)
        T.ok(p.returncode == 2 and '99999' in p.stderr, "CLI: out-of-range token id -> exit 2 naming the id", p.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_load_errors(ck, model):
    tmp = tempfile.mkdtemp(prefix='ds41ref-bad-')
    try:
        one = os.path.join(tmp, 'single')
        os.makedirs(os.path.join(one, 'inference'))
        shutil.copy(os.path.join(ck, 'inference', 'config.json'), os.path.join(one, 'inference'))
        shutil.copy(os.path.join(ck, 'tokenizer.json'), one)
        ckp = R.Checkpoint(ck)
        tens = []
        for name, f in ckp.where.items():
            buf, dt, shape = f.raw(name)
            tens.append((name, dt, np.array(buf, np.uint8)))
        # write raw bytes with the original dtype strings and shapes
        hdr, off, blobs = {}, 0, []
        for name, dt, b in tens:
            shape = ckp.where[name].tensors[name][1]
            hdr[name] = {'dtype': dt, 'shape': shape, 'data_offsets': [off, off + b.nbytes]}
            off += b.nbytes
            blobs.append(b.tobytes())
        h = json.dumps(hdr).encode()
        with open(os.path.join(one, 'model.safetensors'), 'wb') as fh:
            fh.write(len(h).to_bytes(8, 'little') + h + b''.join(blobs))
        m1 = R.Model(one)
        ids = [0, 5, 9, 300, 17, 17, 2]
        T.ok(same_bits(m1.forward(m1.new_state(), ids), model.forward(model.new_state(), ids)),
             "load: a single model.safetensors gives the same logits as the sharded checkpoint")
        bad = os.path.join(tmp, 'ck')
        shutil.copytree(ck, bad)
        idx = os.path.join(bad, 'model.safetensors.index.json')
        with open(idx, encoding='utf-8') as fh:
            j = json.load(fh)
        del j['weight_map']['layers.3.attn.wkv.scale']
        with open(idx, 'w', encoding='utf-8') as fh:
            json.dump(j, fh)
        try:
            R.Model(bad)
            msg = ''
        except R.RefError as e:
            msg = str(e)
        T.ok('layers.3.attn.wkv.scale' in msg and 'missing' in msg, "load: a missing tensor is named", msg)
        shard = os.path.join(bad, sorted(set(j['weight_map'].values()))[0])
        with open(shard, 'r+b') as fh:
            fh.write(b'\xff' * 8)
        try:
            R.Model(bad)
            msg = ''
        except R.RefError as e:
            msg = str(e)
        T.ok(os.path.basename(shard) in msg and 'header' in msg, "load: a corrupt shard header names the file", msg)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    T.run('bf16', test_bf16)
    T.run('e4m3', test_e4m3)
    T.run('e2m1', test_e2m1)
    T.run('ue8m0', test_ue8m0)
    T.run('act_quant', test_act_quant)
    T.run('exact sum', test_exact_sum)
    T.run('release roles', test_release_roles)
    T.run('rope', test_rope)
    T.run('engram release', test_engram_release)
    T.run('engram hash vectors', test_engram_hash_vectors)
    T.run('token map', test_token_map)
    T.run('quantizers', test_quantizers)
    tmp = tempfile.mkdtemp(prefix='ds41ref-')
    try:
        need_small = ['index_ties', 'neg_inf_picks', 'candidate_masked', 'window_wrapped', 'groups', 'engram_blocked']
        small = os.path.join(tmp, 'small')
        G.build('small', 1, small)
        T.run('layout small', lambda: test_checkpoint_layout(small, 'small'))
        holder = {}

        def small_model():
            sch = [[1], [3], [7], [5, 1, 9, 2, 16, 4]]
            holder['m'] = check_model(small, 'small', [72, 11], sch, need_small)
        T.run('model small', small_model)
        if 'm' in holder:
            T.run('cli', lambda: test_cli(small, holder['m']))
            T.run('loading', lambda: test_load_errors(small, holder['m']))
        wide = os.path.join(tmp, 'wide')
        G.build('wide', 2, wide)
        T.run('layout wide', lambda: test_checkpoint_layout(wide, 'wide'))
        sch = [[7], [64, 3]] if not LONG else [[1], [3], [7], [64, 3], [13, 1, 40]]
        T.run('model wide', lambda: check_model(wide, 'wide', [110] if not LONG else [260, 30], sch,
                                                ['attn_chunks_gt1', 'window_wrapped', 'groups', 'index_ties']))
        if LONG:
            for seed in (3, 4):
                ck = os.path.join(tmp, f'small{seed}')
                G.build('small', seed, ck)
                T.run(f'model small seed {seed}', lambda ck=ck, seed=seed: check_model(
                    ck, f'small(seed {seed})', [200, 15], [[1], [3], [7], [64], [5, 1, 9, 2, 16, 4]], need_small))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"1..{T.n}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
