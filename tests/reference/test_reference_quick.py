#!/usr/bin/env python3
"""The attention, indexer, compressor and MoE decisions against the numpy reference, quickly
(issue 19): one tiny checkpoint, one routing 6 experts and one with gate_temp 0.75, prompts just long enough to wrap the
window, fill index_topk, pass the candidate budget and complete compressed groups at ratios 2 and 1,
whole and in chunks, plus a few greedy steps; ds41-eval --reference must equal ds41_ref.py byte
for byte.  reference_bitexact covers more seeds, presets and lengths in minutes; this one names
the decisions mutation testing plants bugs in and fails in tens of seconds.  TAP on stdout.
"""
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_bitexact as tb  # noqa: E402  (shares compare_case and the checkpoints)
from tap_out import plan  # noqa: E402  (the TAP counters every reference test shares)


def main():
    for exe in (tb.MKMODEL, tb.EVAL):
        if not os.path.exists(exe):
            print(f"1..0 # SKIP {exe} not built")
            return 0
    tmp = tempfile.mkdtemp(prefix='ds41-refquick-')
    try:
        d = os.path.join(tmp, 'tiny')
        tb.run([tb.MKMODEL, d, '--preset', 'tiny', '--seed', '1', '--quiet'])
        ck = tb.Checkpoint(d, 'mkmodel tiny seed 1')
        w, topk = ck.cfg['window_size'], ck.cfg['index_topk']
        blocks = ck.cfg['candidate_topk_blocks'] * ck.cfg['candidate_block_size']
        n = max(3 * w, 2 * topk + 20, blocks + 24) + 1  # odd: a ratio-2 group left open at the end
        tb.compare_case(ck, tb.make_prompt(ck, n, 700), tmp, decode=4,
                        tag=f' (window {w} wrapped, index_topk {topk} filled, {blocks} candidate positions)')
        tb.compare_case(ck, tb.make_prompt(ck, n - 6, 701), tmp, decode=3, chunk=5,
                        tag=' (C in chunks of 5: window rows from the ring and the chunk)')
        d = os.path.join(tmp, 'six')
        tb.run([tb.MKMODEL, d, '--preset', 'tiny', '--seed', '11', '--set', 'n_activated_experts=6', '--quiet'])
        six = tb.Checkpoint(d, 'mkmodel tiny seed 11, 6 routed experts per token')
        tb.compare_case(six, tb.make_prompt(six, 24, 702), tmp, decode=4, tag=' (6 routed experts: combine order)')
        d = os.path.join(tmp, 'temp')
        tb.run([tb.MKMODEL, d, '--preset', 'tiny', '--seed', '9', '--set', 'gate_temp=0.75', '--quiet'])
        gt = tb.Checkpoint(d, 'mkmodel tiny seed 9 gate_temp 0.75')
        tb.compare_case(gt, tb.make_prompt(gt, 12, 703), tmp, decode=2, tag=' (router logits / gate_temp)')
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return plan()


if __name__ == '__main__':
    sys.exit(main())
