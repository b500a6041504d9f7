#!/usr/bin/python3
"""Writes tests/data/engram/numpy_bounded_draws.json: numpy Generator.integers(0, high,
size=n, dtype=int64) draws for bounds that exercise every branch of numpy's bounded
uint64 fill (rng == 0, 32-bit Lemire on the buffered next32 with frequent rejection,
rng == 2^32-1 plain next32, 64-bit Lemire with frequent rejection), called in sequence
on one generator so that the next32 buffer carries across calls.

Needs numpy 1.24 (Debian's /usr/bin/python3):  numpy_bounded_draws.py OUT.json
"""
import json
import sys

import numpy as np

CALLS = [(1, 3), (1000, 7), (3 << 30, 9), (2**40, 3), (1000, 1), ((1 << 32), 5),
         ((1 << 62) + 1, 9), (2**63 - 1, 3), (46539438283891, 4), (7, 5)]


def main():
    out = {"generated_with": "numpy %s, numpy.random.default_rng(seed).integers(0, high, size=n, dtype=np.int64), "
                             "calls made in order on one generator; seeds as decimal strings (they may exceed int64)" % np.__version__,
           "sequences": []}
    for seed in (0, 1, 99, 30021, 2**64 - 1):
        g = np.random.default_rng(seed)
        calls = []
        for high, n in CALLS:
            calls.append({"high": high, "values": [int(v) for v in g.integers(0, high, size=n, dtype=np.int64)]})
        out["sequences"].append({"seed": str(seed), "calls": calls})
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
