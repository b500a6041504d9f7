#!/usr/bin/python3
"""TAP: the SIMD levels of the fast CPU path against its scalar level, layer by layer and decision by
decision, on many random checkpoints (issue 13, item 1: close the class of the indexer defect).

For each checkpoint (ds41-mkmodel `tiny` with random --set overrides: window, index_topk, index
heads x dim, compress-ratio layouts, candidate blocks, Engram layers, experts, dim; and
gen_ckpt.py `small` / `wide`, an independent generator) and a prompt several windows long followed
by decode steps (sometimes prefilled in chunks):

1. `ds41-eval --cpu scalar --dump S` (the scalar level, exact against the reference on the
   regression fixture and by construction on the indexer's path);
2. for every other level the host has, `ds41-eval --cpu LEVEL --replay S --dump X`: the same
   tokens, every block fed the scalar run's input stream and pre-mix, so X holds each block's own
   work on the scalar level's inputs (a level the host lacks is skipped, saying so);
3. compare per part, layer and row:
   - block outputs (h.L+1) and logits: max |d| / max |ref| per row within the layer-check
     tolerance (2e-2 per row, 5e-3 median per layer; REFERENCE §10), rows whose routed experts
     differ admissibly at that layer excepted (counted); branches and pre-mixes reported;
   - index scores and candidate block scores: bit-identical (the documented error is 0,
     engine/backend/cpu/cpu_backend.h "Decisions"), and so the index top-k and the kept blocks;
   - expert selection scores within the sum of both levels' documented route error
     (ds41_ref.route_error_bound: 2^-8 * (1 + |score|)), and the routed experts either the scalar
     level's or a ranking admissible within those errors (REFERENCE §10.1 decision contract);
     anything else is a violation.

Figures printed at the end: checkpoints, levels, positions, decisions compared, differences within
the documented margin, violations.  Environment: DS41_BUILD_DIR; DS41_LONG_TESTS=1 for the long
sweep (more checkpoints, longer prompts); DS41_SANITIZED=1 scales the short one down;
DS41_SIMD_DIFF_N overrides the checkpoint count; DS41_SIMD_DIFF_ONLY=i,j reruns only checkpoints
#i, #j of the same sequence (the others are generated, not run).
DS41_CHECK_BACKEND=NAME (e.g. cuda; tests/gpu/check.sh) compares that backend (ds41-eval --backend NAME
--replay) with the scalar level instead of the SIMD levels, under the same rules; the teeth and the
--replay argument checks (the CPU backend's and the tool's) are left out.
"""

import json
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ds41_ref as R  # noqa: E402

from tap_out import note, plan, run, tap  # noqa: E402
from test_layer_check import Ckpt  # noqa: E402

BUILD = os.environ.get('DS41_BUILD_DIR', os.path.join(HERE, '..', '..', 'build'))
MKMODEL = os.path.join(BUILD, 'daemon', 'ds41-mkmodel')
EVAL = os.path.join(BUILD, 'daemon', 'ds41-eval')
GEN = os.path.join(HERE, 'gen_ckpt.py')
PY = sys.executable
LONG = os.environ.get('DS41_LONG_TESTS') == '1'
SANITIZED = os.environ.get('DS41_SANITIZED') == '1'
LEVELS = ('avx2', 'avx512', 'amx')
BACKEND = os.environ.get('DS41_CHECK_BACKEND') or None


def level_args(lv):
    """ds41-eval's flags for one compared run: a CPU level, or DS41_CHECK_BACKEND."""
    return ['--backend', BACKEND] if BACKEND else ['--cpu', lv]



# ---- checkpoints -------------------------------------------------------------------------------

# Layer layouts of a 10-layer tiny model: (compress_ratios, kv sources, index sources, candidate
# source).  Two ratio-2 KV sources back to back (the regression's shape), a ratio-1 tail, a short
# ratio-2 part, layer 1 compressed, no candidates.
LAYOUTS = [
    ([0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0], [2, 5], [2, 5, 7], 5),
    ([0, 0, 2, 2, 2, 2, 2, 2, 1, 1, 0, 0, 0], [2, 5, 8], [2, 5, 8], 8),
    ([0, 2, 2, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], [1, 3], [1, 3, 5, 7, 9], 3),
    ([0, 0, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0], [2, 4], [2, 4, 6, 8], 4),
    ([0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0], [2, 6], [2, 4, 6, 9], -1),
]


def random_sets(rnd):
    """--set overrides for ds41-mkmodel --preset tiny."""
    ratios, kv, idx, cand = rnd.choice(LAYOUTS)
    e = rnd.choice([4, 8, 16])
    blocks, bsize = rnd.choice([1, 2, 3, 5, 8]), rnd.choice([1, 2, 3, 4])
    # the engine wants at least index_topk candidate positions: (blocks - 1) * size + 1
    topk_max = (blocks - 1) * bsize + 1 if cand >= 0 else 12
    engram = rnd.choice([[], [1, 5], [3, 6], [0, 4], [2, 7]])
    s = {
        'compress_ratios': ratios, 'kv_source_layers': kv, 'index_source_layers': idx,
        'candidate_source_layer': cand,
        'window_size': rnd.choice([4, 6, 8, 12, 16]),
        'index_topk': rnd.choice([k for k in (1, 2, 3, 5, 8, 12) if k <= topk_max]),
        'index_n_heads': rnd.choice([1, 2, 3, 4, 8]),
        'index_head_dim': rnd.choice([32, 64, 96, 128]),
        'candidate_topk_blocks': blocks,
        'candidate_block_size': bsize,
        'engram_layer_ids': engram,
        'engram_num_embeddings': [2477, 2593][:len(engram)],
        'n_routed_experts': e,
        'n_activated_experts': rnd.choice([k for k in (1, 2, 3, 4) if k <= e]),
        'dim': rnd.choice([64, 96, 128, 160]),
    }
    return s


def make_ckpt(tmp, i, rnd):
    d = os.path.join(tmp, f'ck{i}')
    if i % 6 == 5:
        # (gen_ckpt's `small` holds fewer candidates than index_topk on purpose, which the engine
        # refuses; `wide` runs.)
        run([PY, GEN, '--out', d, '--preset', 'wide', '--seed', str(rnd.randrange(1 << 30))])
        return Ckpt(d, 'gen_ckpt wide'), None
    for _ in range(20):
        sets = random_sets(rnd)
        cmd = [MKMODEL, d, '--preset', 'tiny', '--seed', str(rnd.randrange(1 << 30)), '--quiet']
        for k, v in sets.items():
            cmd += ['--set', f'{k}={json.dumps(v, separators=(",", ":"))}']
        p = run(cmd, check=False)
        if p.returncode == 0:
            return Ckpt(d, 'mkmodel tiny'), sets
        shutil.rmtree(d, ignore_errors=True)
        last = p.stderr.strip()[-300:]
    raise RuntimeError(f"ds41-mkmodel refused 20 random configurations; last: {last}")


def make_prompt(rnd, cfg):
    W = cfg['window_size']
    lo = max(3 * W, 2 * cfg['index_topk'] + 8)
    hi = max(lo + 8, (8 if LONG else 5) * W)
    n = min(rnd.randrange(lo, hi + 1), 260 if LONG else 120)
    ids = [rnd.randrange(cfg['vocab_size']) for _ in range(n)]
    if n >= 24:
        ids[n // 2:n // 2 + 8] = ids[3:11]           # a repeated 8-gram (Engram history)
        ids[n // 3:n // 3 + 5] = [ids[n // 3]] * 5    # a run of one token (index-score ties)
    return ids


# ---- comparison ---------------------------------------------------------------------------------

def load(path):
    f = R.SafetensorsFile(path)
    return {k: f.array(k) for k in f.tensors}


class Figures:
    def __init__(self):
        self.checkpoints = 0
        self.runs = 0            # (checkpoint, level) pairs compared
        self.positions = 0       # rows compared, over every level
        self.dec = {k: {'compared': 0, 'differ': 0, 'within': 0, 'violations': 0}
                    for k in ('index', 'cand', 'experts')}
        self.score_mismatch = {'index': 0, 'cand': 0, 'experts_beyond_bound': 0}
        self.rows_excused = 0
        self.worst = 0.0
        self.worst_at = ''
        self.worst_branch = 0.0
        self.worst_branch_at = ''
        self.expert_err_max = 0.0   # largest |expert score delta| / allowed


def compare(ck, S, X, level, fig, problems):
    """Compare dump X (level, replayed on S's inputs) with the scalar dump S."""
    c = ck.cfg
    n = c['n_layers']
    parts = ['prefill'] + [f'decode.{k}' for k in range(len(S['decode_ids']))]
    per_layer_rel = {}
    for p in parts:
        rows = S[f'{p}.h.0'].shape[0]
        fig.positions += rows
        for L in range(n):
            excused = np.zeros(rows, bool)
            # decisions
            for kind, sel_name, sc_name in (('index', 'index_sel', 'index_score'), ('cand', 'cand', 'cand_score'),
                                            ('experts', 'experts', 'expert_score')):
                k_sel = f'{p}.{sel_name}.{L}'
                if k_sel not in S and k_sel not in X:
                    continue
                if (k_sel in S) != (k_sel in X):
                    problems.append(f"{level} {p} layer {L}: {sel_name} present on one side only")
                    continue
                a, b = S[k_sel], X[k_sel]
                k_sc = f'{p}.{sc_name}.{L}'
                sa, sb = S.get(k_sc), X.get(k_sc)
                if (sa is None) != (sb is None) or (sa is not None and sa.shape != sb.shape):
                    problems.append(f"{level} {p} layer {L}: {sc_name} shapes differ")
                    continue
                st = fig.dec[kind]
                for r in range(rows):
                    st['compared'] += 1
                    if kind == 'experts':
                        err = R.route_error_bound(sa[r]) + R.route_error_bound(sb[r])
                        ratio = np.max(np.abs(sa[r].astype(np.float64) - sb[r]) / err)
                        fig.expert_err_max = max(fig.expert_err_max, float(ratio))
                        if ratio > 1:
                            fig.score_mismatch['experts_beyond_bound'] += 1
                            problems.append(f"{level} {p} layer {L} row {r}: expert scores differ by {ratio:.2f}x "
                                            f"the documented bound")
                    elif sa is not None and sa[r].tobytes() != sb[r].tobytes():
                        fig.score_mismatch[kind] += 1
                        bad = np.flatnonzero(sa[r].view(np.uint32) != sb[r].view(np.uint32))
                        problems.append(f"{level} {p} layer {L} row {r}: {sc_name} differs at {bad[:5].tolist()} "
                                        f"({sa[r][bad[:3]].tolist()} vs {sb[r][bad[:3]].tolist()}); "
                                        f"the documented error is 0")
                    if np.array_equal(a[r], b[r]):
                        continue
                    st['differ'] += 1
                    ok = False
                    if kind == 'experts':
                        # admissible iff X's ranking fits scores within both levels' errors of the
                        # scalar level's (each level within e_route of the exact scores)
                        err = R.route_error_bound(sa[r]) + R.route_error_bound(sb[r])
                        ok = R.ranking_admissible([int(v) for v in b[r] if v >= 0], sa[r].astype(np.float64),
                                                  err)
                    if ok:
                        st['within'] += 1
                        excused[r] = True
                    else:
                        st['violations'] += 1
                        m = R.boundary_margin(sa[r], int(np.sum(a[r] >= 0))) if sa is not None else None
                        problems.append(f"{level} {p} layer {L} row {r}: {kind} {a[r].tolist()} (scalar) vs "
                                        f"{b[r].tolist()} ({level}); scalar margin {m}")
            fig.rows_excused += int(excused.sum())
            # arithmetic of the block
            for name, got, ref in (('out', X[f'{p}.h.{L + 1}'], S[f'{p}.h.{L + 1}']),
                                   ('attn', X[f'{p}.attn.{L}'], S[f'{p}.attn.{L}']),
                                   ('ffn', X[f'{p}.ffn.{L}'], S[f'{p}.ffn.{L}'])) + \
                    ((('pre', X[f'{p}.pre.{L + 1}'], S[f'{p}.pre.{L + 1}']),) if L + 1 < n else ()):
                rel = R.row_rel_error(got, ref)[~excused]
                per_layer_rel.setdefault((L, name), []).extend(rel.tolist())
        rel = R.row_rel_error(X[f'{p}.logits'], S[f'{p}.logits'])
        per_layer_rel.setdefault((n, 'logits'), []).extend(rel.tolist())
    for (L, name), v in per_layer_rel.items():
        if not v:
            continue
        mx, med = float(np.max(v)), float(np.median(v))
        if name in ('attn', 'ffn', 'pre'):
            # branches and the pre-mix are reported; the tolerance is the block output's (§10)
            if mx > fig.worst_branch:
                fig.worst_branch, fig.worst_branch_at = mx, f"{ck.label} {level} layer {L} {name}"
            continue
        if mx > fig.worst:
            fig.worst, fig.worst_at = mx, f"{ck.label} {level} layer {L} {name}"
        if mx > 2e-2 or med > 5e-3:
            problems.append(f"{level} layer {L} {name}: max {mx:.3e} median {med:.3e} beyond 2e-2 / 5e-3")


def teeth(ck, sd, S, level, tmp):
    """The comparison catches what it is for: (1) a build whose index scores skip a bf16 rounding
    (DS41_FAST_BREAK=index_bf16) shows index score mismatches; (2) a routed expert swapped for one
    far below the routing boundary is a violation, one within the margin is not."""
    xd = os.path.join(tmp, 'teeth.dump')
    env = dict(os.environ, DS41_FAST_BREAK='index_bf16')
    run([EVAL, '--model', ck.path, '--replay', sd, '--dump', xd, '--out', os.path.join(tmp, 't.json'), '--cpu', level],
        env=env)
    f, probs = Figures(), []
    compare(ck, S, load(xd), level, f, probs)
    tap(f.score_mismatch['index'] > 0,
        f"teeth: with the index head sum left unrounded (DS41_FAST_BREAK=index_bf16) the sweep sees "
        f"{f.score_mismatch['index']} index score mismatches")
    # (2) on the scalar dump against itself, with one routing changed
    X = {k: v.copy() for k, v in S.items()}
    sel, sc = X['prefill.experts.0'], S['prefill.expert_score.0'].astype(np.float64)
    far = None
    for r in range(sel.shape[0]):
        order = np.argsort(-sc[r], kind='stable')
        k = int(np.sum(sel[r] >= 0))
        if k >= len(order):
            continue
        gap = sc[r][order[k - 1]] - sc[r][order[-1]]
        if far is None and gap > 4 * (R.route_error_bound(sc[r][order[k - 1]]) * 2):
            far = (r, order[-1])
    if far is not None:
        r, worst = far
        X['prefill.experts.0'][r, -1] = worst  # the last pick replaced by the lowest-scoring expert
        f, probs = Figures(), []
        compare(ck, S, X, 'teeth', f, probs)
        tap(f.dec['experts']['violations'] == 1, f"teeth: an expert swapped far beyond the margin is a violation "
            f"({f.dec['experts']['violations']} counted)")
    # within the margin: a row whose k-th and (k+1)-th scores are moved to a near tie, then swapped
    X = {k: v.copy() for k, v in S.items()}
    xs = X['prefill.expert_score.0']
    r = 0
    order = np.argsort(-xs[r].astype(np.float64), kind='stable')
    k = int(np.sum(X['prefill.experts.0'][r] >= 0))
    if k < len(order):
        a, b = order[k - 1], order[k]
        Sx = {kk: v.copy() for kk, v in S.items()}
        Sx['prefill.expert_score.0'][r, b] = Sx['prefill.expert_score.0'][r, a] - np.float32(1e-4)
        X['prefill.expert_score.0'][r] = Sx['prefill.expert_score.0'][r]
        X['prefill.experts.0'][r, k - 1] = b
        f, probs = Figures(), []
        compare(ck, Sx, X, 'teeth', f, probs)
        tap(f.dec['experts']['within'] == 1 and f.dec['experts']['violations'] == 0,
            f"teeth: two experts 1e-4 apart at the boundary swapped is a difference within the margin "
            f"({f.dec['experts']['within']} within, {f.dec['experts']['violations']} violations)", probs)


def replay_errors(ck, sd, tmp):
    """--replay reads an untrusted file: a missing or misshapen tensor, a file that is not a dump,
    and a missing --dump are refused with exit 2 naming what is wrong."""
    f = R.SafetensorsFile(sd)
    L = ck.cfg['n_layers'] // 2
    keep = [(k, f.tensors[k][0], f.array(k)) for k in f.tensors if k != f'prefill.h.{L}']
    bad = os.path.join(tmp, 'bad.dump')
    R.write_safetensors(bad, keep)
    base = [EVAL, '--model', ck.path, '--out', os.path.join(tmp, 'r.json')]
    p = run(base + ['--replay', bad, '--dump', os.path.join(tmp, 'r.dump')], check=False)
    tap(p.returncode == 2 and f'prefill.h.{L}' in p.stderr and 'missing' in p.stderr,
        "ds41-eval --replay of a dump without one block's stream: exit 2 naming the tensor", p.stderr)
    short = [(k, dt, a[:, :1] if k == f'prefill.pre.{L}' else a) for k, dt, a in
             ((k, f.tensors[k][0], f.array(k)) for k in f.tensors)]
    R.write_safetensors(bad, short)
    p = run(base + ['--replay', bad, '--dump', os.path.join(tmp, 'r.dump')], check=False)
    tap(p.returncode == 2 and f'prefill.pre.{L}' in p.stderr and 'shape' in p.stderr,
        "ds41-eval --replay of a dump with a misshapen pre-mix: exit 2 naming the tensor", p.stderr)
    with open(bad, 'wb') as fh:
        fh.write(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":1}')
    p = run(base + ['--replay', bad, '--dump', os.path.join(tmp, 'r.dump')], check=False)
    tap(p.returncode == 2 and bad in p.stderr, "ds41-eval --replay of a file that is not a dump: exit 2 naming it",
        p.stderr)
    p = run(base + ['--replay', sd], check=False)
    tap(p.returncode == 2 and '--dump' in p.stderr, "ds41-eval --replay without --dump: exit 2", p.stderr)


def main():
    for exe in (MKMODEL, EVAL):
        if not os.path.exists(exe):
            print(f"1..0 # SKIP {exe} not built")
            return 0
    # DS41_SIMD_DIFF_ONLY=i,j: rerun only those checkpoints of the sweep (the same random sequence)
    only = {int(v) for v in os.environ.get('DS41_SIMD_DIFF_ONLY', '').split(',') if v.strip()}
    n_ck = int(os.environ.get('DS41_SIMD_DIFF_N', '0')) or (120 if LONG else 6 if SANITIZED else 36)
    seed = 20261205 + (7 if LONG else 0)
    rnd = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix='ds41-simddiff-')
    t0 = time.time()
    fig = Figures()
    levels_seen = set()
    try:
        # Which levels the host runs (ds41-eval says when it lowers a --cpu cap).
        probe = os.path.join(tmp, 'probe')
        run([MKMODEL, probe, '--preset', 'tiny', '--quiet'])
        levels = [BACKEND] if BACKEND else []
        for lv in LEVELS if not BACKEND else ():
            p = run([EVAL, '--model', probe, '--ids', '1,2,3', '--out', os.path.join(tmp, 'p.json'), '--cpu', lv])
            if 'running at' in p.stderr:
                tap(True, f"level {lv} # SKIP this host has no {lv} ({p.stderr.strip()})")
            else:
                levels.append(lv)
        shutil.rmtree(probe, ignore_errors=True)
        note(f"levels compared with scalar: {', '.join(levels) or 'none'}; {n_ck} checkpoints, seed {seed}")
        if not levels:
            tap(True, "differential sweep # SKIP the host has only the scalar level")
            return plan()
        for i in range(n_ck):
            ck, sets = make_ckpt(tmp, i, rnd)
            ids = make_prompt(rnd, ck.cfg)
            decode = rnd.randrange(2, 9 if LONG else 6)
            chunk = rnd.choice([None, None, 1, 5, 16])
            if only and i not in only:
                shutil.rmtree(ck.path, ignore_errors=True)
                continue
            sd = os.path.join(tmp, 's.dump')
            cmd = [EVAL, '--model', ck.path, '--ids', ','.join(map(str, ids)), '--decode', str(decode),
                   '--dump', sd, '--out', os.path.join(tmp, 's.json'), '--cpu', 'scalar']
            if chunk:
                cmd += ['--chunk', str(chunk)]
            run(cmd)
            S = load(sd)
            problems = []
            for lv in levels:
                xd = os.path.join(tmp, f'{lv}.dump')
                run([EVAL, '--model', ck.path, '--replay', sd, '--dump', xd, '--out', os.path.join(tmp, 'x.json')] +
                    level_args(lv))
                compare(ck, S, load(xd), lv, fig, problems)
                fig.runs += 1
                levels_seen.add(lv)
            if i == 0 and not only and not BACKEND:
                teeth(ck, sd, S, levels[0], tmp)
                replay_errors(ck, sd, tmp)
            fig.checkpoints += 1
            what = (f"{ck.label} #{i} ({len(ids)} tokens{', chunks of %d' % chunk if chunk else ''}, {decode} decode "
                    f"steps; window {ck.cfg['window_size']}, index_topk {ck.cfg['index_topk']}, index "
                    f"{ck.cfg['index_n_heads']}x{ck.cfg['index_head_dim']}, dim {ck.cfg['dim']}, ratios "
                    f"{ck.cfg['compress_ratios'][:ck.cfg['n_layers']]})")
            tap(not problems, f"{what}: every level matches scalar within the tolerance and the decision contract",
                '\n'.join(problems[:12] + ([f"... {len(problems) - 12} more"] if len(problems) > 12 else [])) +
                f"\nsets: {json.dumps(sets)}")
            shutil.rmtree(ck.path, ignore_errors=True)
            if (i + 1) % 25 == 0 and i + 1 < n_ck:
                note('so far: ' + figures(fig, levels_seen, t0))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    note(figures(fig, levels_seen, t0))
    d = fig.dec
    viol = sum(v['violations'] for v in d.values())
    within = sum(v['within'] for v in d.values())
    tap(viol == 0 and fig.score_mismatch['index'] == 0 and fig.score_mismatch['cand'] == 0 and
        fig.score_mismatch['experts_beyond_bound'] == 0,
        f"decision contract over the sweep: {viol} decisions outside the documented margin, {within} within")
    return plan()


def figures(fig, levels_seen, t0):
    d = fig.dec
    total = sum(v['compared'] for v in d.values())
    within = sum(v['within'] for v in d.values())
    viol = sum(v['violations'] for v in d.values())
    return (f"figures: {fig.checkpoints} checkpoints x {len(levels_seen)} level(s) ({', '.join(sorted(levels_seen))}) = "
            f"{fig.runs} comparisons, {fig.positions} positions; decisions compared {total} (index top-k "
            f"{d['index']['compared']}, candidate blocks {d['cand']['compared']}, routed experts "
            f"{d['experts']['compared']}); differing from scalar: {within} within the documented margin, {viol} "
            f"outside; index/candidate score mismatches {fig.score_mismatch['index'] + fig.score_mismatch['cand']}; "
            f"expert score deltas at most {fig.expert_err_max:.3f} of the documented bound "
            f"({fig.score_mismatch['experts_beyond_bound']} beyond); rows excused from the arithmetic tolerance for an "
            f"admissible routing difference {fig.rows_excused}; worst block output / logits row error {fig.worst:.2e} "
            f"({fig.worst_at}), worst branch {fig.worst_branch:.2e} ({fig.worst_branch_at}); {time.time() - t0:.0f} s")


if __name__ == '__main__':
    sys.exit(main())
