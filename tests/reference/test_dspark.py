#!/usr/bin/python3
"""TAP: the DSpark draft head (REFERENCE §7, §10.7) of `ds41-eval --drafts` against `ds41_ref.py`
forward_spec.

Checkpoints with DSpark on: ds41-mkmodel `tiny` (window 8, block 5) and `long` (window 32), a `tiny`
variant with two target layers, three routed experts per stage token and block 3, and gen_ckpt.py
`wide` (window 48, block 4, its own constants).  Prompts are longer than the stages' window (the
draft attends a wrapped stage ring), the C side also runs in chunks.  Each greedy step drafts a block
from its token before feeding it.

* Reference mode: the JSON of `ds41-eval --reference --drafts` equals ds41_ref.py's byte for byte,
  so every draft id and every confidence (written as %.9g, which round-trips float32) has the same
  float32 bits; and `--drafts` changes nothing else (the file without the "drafts" member equals
  the run without --drafts: drafting leaves the sequence as it was).
* Fast path (the default CPU backend), end to end on the same prompts, while its greedy tokens are
  the reference's: a draft id may differ from the reference's only where the reference's corrected
  logits of that row put the two ids within DRAFT_LOGIT_TOL x max|logit| of each other (the §10
  per-row relative tolerance 2e-2, the same bound as the layer-local check), and from the first
  such difference on the block's later rows are not compared (their Markov inputs differ);
  confidences of the rows compared are within CONF_TOL x (1 + |reference|).  --drafts again
  changes nothing else.
Environment: DS41_BUILD_DIR (meson build tree).
"""

import json
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np

from tap_out import missing, note, plan, run, tap

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ds41_ref as R  # noqa: E402

BUILD = os.environ.get('DS41_BUILD_DIR', os.path.join(HERE, '..', '..', 'build'))
MKMODEL = os.path.join(BUILD, 'daemon', 'ds41-mkmodel')
EVAL = os.path.join(BUILD, 'daemon', 'ds41-eval')
GEN = os.path.join(HERE, 'gen_ckpt.py')
PY = sys.executable

# The fast path's documented error (REFERENCE §10: a block's output within 2e-2 of the reference,
# relative to the row's largest value), applied to the drafts' corrected logits.
DRAFT_LOGIT_TOL = 2e-2
# Confidence: a dot product over [x ; e] (dim + markov_rank values), x within the same 2e-2.
CONF_TOL = 2e-2


def prompt(vocab, n, seed):
    rnd = random.Random(seed)
    ids = [rnd.randrange(vocab) for _ in range(n)]
    ids[n // 2:n // 2 + 4] = ids[2:6]  # a repeated 4-gram (Engram history)
    return ids


def strip_drafts(raw):
    """The JSON bytes without the "drafts" member (the file --drafts would not have written)."""
    i = raw.find(b',"drafts":[')
    return raw if i < 0 else raw[:i] + b'}\n'


def eval_c(ck, ids, decode, tmp, extra):
    out = os.path.join(tmp, 'c.json')
    run([EVAL, '--model', ck, '--ids', ','.join(map(str, ids)), '--decode', str(decode), '--out', out] + extra)
    with open(out, 'rb') as f:
        return f.read()


def check_fast(label, ref_doc, drafts_ref, fast_raw):
    """(ok, figures, problems): the fast path's drafts against the reference's (module doc)."""
    fd = json.loads(fast_raw)
    blocks = rows = differ = 0
    max_conf = 0.0
    problems = []
    for k, (rb, fb) in enumerate(zip(drafts_ref, fd['drafts'])):
        if [g['token'] for g in fd['greedy'][:k + 1]] != [g['token'] for g in ref_doc['greedy'][:k + 1]]:
            break  # the backbones' greedy paths parted: the blocks draft from different tokens
        pos, ids, conf, logits = rb
        if fb['position'] != pos:
            problems.append(f"block {k}: position {fb['position']} != {pos}")
            break
        blocks += 1
        for j, (a, b) in enumerate(zip(ids, fb['ids'])):
            rows += 1
            err = abs(fb['confidence'][j] - float(conf[j]))
            max_conf = max(max_conf, err / (1 + abs(float(conf[j]))))
            if err > CONF_TOL * (1 + abs(float(conf[j]))):
                problems.append(f"block {k} row {j}: confidence {fb['confidence'][j]} vs {conf[j]}")
            if a == b:
                continue
            differ += 1
            row = logits[j].astype(np.float64)
            gap = row[a] - row[b]
            if gap > DRAFT_LOGIT_TOL * np.max(np.abs(row)):
                problems.append(f"block {k} row {j}: draft {b} vs {a}, reference gap {gap:.4g} beyond "
                                f"{DRAFT_LOGIT_TOL} x {np.max(np.abs(row)):.4g}")
            break  # later rows' Markov inputs differ
    figures = (f"{label}: fast path {blocks} blocks, {rows} drafts compared, {differ} admissible id "
               f"differences, max confidence error {max_conf:.2e} x (1 + |c|)")
    return blocks > 0 and not problems, figures, problems


def main():
    if missing(MKMODEL, EVAL):
        return 0
    tmp = tempfile.mkdtemp(prefix='ds41-dspark-')
    t0 = time.time()
    try:
        cks = []
        for preset, seed, sets in (('tiny', 1, []), ('long', 3, []),
                                   ('tiny', 4, ['dspark_target_layer_ids=[5,9]', 'dspark_n_activated_experts=3',
                                                'dspark_block_size=3'])):
            d = os.path.join(tmp, f'{preset}-{seed}')
            cmd = [MKMODEL, d, '--preset', preset, '--seed', str(seed), '--quiet']
            for s in sets:
                cmd += ['--set', s]
            run(cmd)
            cks.append((d, f"mkmodel {preset} seed {seed}" + (f" ({', '.join(sets)})" if sets else '')))
        d = os.path.join(tmp, 'wide-7')
        run([PY, GEN, '--out', d, '--preset', 'wide', '--seed', '7'])
        cks.append((d, 'gen_ckpt wide seed 7'))

        for i, (d, label) in enumerate(cks):
            with open(os.path.join(d, 'inference', 'config.json')) as f:
                cfg = json.load(f)
            W, B, V = cfg['window_size'], cfg['dspark_block_size'], cfg['vocab_size']
            n = 2 * W + 5 if W < 40 else W + 9
            decode = 6 if W < 40 else 4
            ids = prompt(V, n, 100 + i)
            model = R.Model(d)
            drafts = []
            pre, greedy, _ = R.run_ids(model, ids, decode=decode, drafts=drafts)
            ref_raw = R.result_json(ids, pre, greedy, drafts).encode()
            ref_doc = json.loads(ref_raw)
            desc = (f"{label}: {n}-token prompt (stage window {W}), {decode} greedy steps, a {B}-row draft "
                    f"block each")
            chunk = ['--chunk', str(5 + i)] if i % 2 else []
            c_raw = eval_c(d, ids, decode, tmp, ['--reference', '--drafts'] + chunk)
            ok = c_raw == ref_raw
            diag = ''
            if not ok:
                try:
                    cd = json.loads(c_raw)
                    diag = (f"greedy equal: {cd['greedy'] == ref_doc['greedy']}; drafts C {cd.get('drafts')} "
                            f"numpy {ref_doc['drafts']}")
                except ValueError as e:
                    diag = str(e)
            tap(ok, desc + f": ds41-eval --reference --drafts{' --chunk ' + chunk[1] if chunk else ''} == "
                "ds41_ref.py forward_spec byte for byte (ids, confidences' float32 bits)", diag)
            plain = eval_c(d, ids, decode, tmp, ['--reference'])
            tap(plain == strip_drafts(c_raw) and plain != c_raw,
                f"{label}: --reference --drafts leaves ids, prefill logits, greedy tokens and logits unchanged")
            fast = eval_c(d, ids, decode, tmp, ['--drafts', '--threads', '2'])
            ok, figures, problems = check_fast(label, ref_doc, drafts, fast)
            note(figures)
            tap(ok, f"{label}: fast path drafts within the documented error of the reference", '\n'.join(problems))
            fast_plain = eval_c(d, ids, decode, tmp, ['--threads', '2'])
            tap(fast_plain == strip_drafts(fast), f"{label}: fast path --drafts leaves the logits unchanged")

        # The command line: --drafts on a model without DSpark stages is refused.
        d = os.path.join(tmp, 'no-dspark')
        run([MKMODEL, d, '--preset', 'tiny', '--seed', '1', '--set', 'dspark_block_size=0', '--quiet'])
        p = run([EVAL, '--model', d, '--ids', '1,2', '--decode', '1', '--drafts', '--out',
                 os.path.join(tmp, 'x.json')], check=False)
        tap(p.returncode == 2 and 'no DSpark stages' in p.stderr,
            "ds41-eval --drafts on a model without DSpark: exit status 2 and a message", p.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    note(f"{time.time() - t0:.0f} s")
    return plan()


if __name__ == '__main__':
    sys.exit(main())
