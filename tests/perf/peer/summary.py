#!/usr/bin/env python3
"""Peer benchmark report: per-pair figures, medians, ratios ds41 / llama.cpp.

usage: summary.py RUNS.jsonl LLAMA_SHAPES.json [--pair N]

RUNS.jsonl has one record per run, written by run.sh:
  {"who": "ds41", "pair": N, "order": K, "load": [1m, 5m, 15m], "bench": <ds41-bench --json>,
   "prefill_runs": [<ds41-bench --json of a run for each further prompt length>]}
  {"who": "llama", "pair": N, "order": K, "load": [...], "bench": <llama_bench.mjs output>}
LLAMA_SHAPES.json is mkgguf.py's output (the gpt-oss shapes and its weight
bytes per token).  With --pair N only pair N's lines are printed (run.sh
prints them as the pairs finish); without, the whole report.
"""

import json
import statistics
import sys


def load_runs(path):
    runs = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                runs.append(json.loads(line))
    return runs


def ds41_figures(r):
    b = r["bench"]
    out = {"load": r["load"][0], "bandwidth_gbs": b["machine"]["read_bandwidth_gbs"]}
    for d in b["decode"]:
        out[f"decode{d['batch']}"] = d["tokens_per_s"]
        out[f"bytes_step{d['batch']}"] = d["weight_bytes_per_step"]
    out[f"prefill{b['prefill']['tokens']}"] = b["prefill"]["tokens_per_s"]
    for extra in r.get("prefill_runs", []):
        p = extra["prefill"]
        out[f"prefill{p['tokens']}"] = p["tokens_per_s"]
        out["bandwidth_gbs"] = max(out["bandwidth_gbs"], extra["machine"]["read_bandwidth_gbs"])
    return out


def llama_step_bytes(shapes, batch):
    """Weight bytes one llama.cpp step of `batch` tokens reads: every tensor
    once, the routed experts each layer's batch selected counted once (their
    expected number under uniform routing, E (1 - (1 - k/E)^B); random
    weights route close to uniformly)."""
    per_tok = shapes["bytes_per_token"]
    E, k, L = shapes["n_expert"], shapes["n_expert_used"], shapes["n_layer"]
    expert = (3 * shapes["dim"] * shapes["n_ff_exp"] * 17 / 32 + 4 * (2 * shapes["n_ff_exp"] + shapes["dim"]))
    distinct = E * (1 - (1 - k / E) ** batch)
    return per_tok + L * (distinct - k) * expert + (batch - 1) * 2 * shapes["dim"]


def llama_figures(r):
    b = r["bench"]
    out = {"load": r["load"][0]}
    for d in b["decode"]:
        out[f"decode{d['batch']}"] = d["tokens_per_s"]
        out[f"generated{d['batch']}"] = min(d["generated"])
    for p in b["prefill"]:
        out[f"prefill{p['tokens']}"] = p["tokens_per_s"]
    return out


def fmt(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def keys_of(figs, prefix):
    ks = set()
    for f in figs:
        ks.update(int(k[len(prefix):]) for k in f if k.startswith(prefix) and k[len(prefix):].isdigit())
    return sorted(ks)


def pair_lines(runs, pair):
    lines = []
    for r in sorted((r for r in runs if r["pair"] == pair), key=lambda r: r["order"]):
        f = ds41_figures(r) if r["who"] == "ds41" else llama_figures(r)
        dec = " ".join(f"B={b}:{fmt(f[f'decode{b}'])}" for b in keys_of([f], "decode"))
        pre = " ".join(f"{p}:{fmt(f[f'prefill{p}'], 1)}" for p in keys_of([f], "prefill"))
        extra = f", read bandwidth {f['bandwidth_gbs']:.1f} GB/s" if "bandwidth_gbs" in f else ""
        lines.append(f"pair {pair} {r['who']:<9} decode tok/s {dec}; prefill tok/s {pre}; "
                     f"load {r['load'][0]:.2f}{extra}")
    return lines


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def report(runs, shapes):
    ds = [ds41_figures(r) for r in runs if r["who"] == "ds41"]
    ll = [llama_figures(r) for r in runs if r["who"] == "llama"]
    pairs = sorted({r["pair"] for r in runs})
    out = []
    for p in pairs:
        out.extend(pair_lines(runs, p))
    loads = [r["load"][0] for r in runs]
    bw = median([f["bandwidth_gbs"] for f in ds])
    out.append("")
    out.append(f"medians of {len(ds)} ds41 and {len(ll)} llama.cpp runs, alternating; load average (1 min) at the "
               f"runs' starts: min {min(loads):.2f} median {statistics.median(loads):.2f} max {max(loads):.2f}; "
               f"measured read bandwidth (ds41-bench, median) {fmt(bw, 1)} GB/s")
    out.append(f"{'':34}{'ds41':>12}{'llama.cpp':>12}{'ds41/llama':>12}")

    def row(name, a, b, digits=2):
        ratio = a / b if a is not None and b else None
        out.append(f"{name:<34}{fmt(a, digits):>12}{fmt(b, digits):>12}{fmt(ratio, 2):>12}")

    for b in keys_of(ds + ll, "decode"):
        row(f"decode tok/s, batch {b}", median([f.get(f"decode{b}") for f in ds]),
            median([f.get(f"decode{b}") for f in ll]))
    for p in keys_of(ds + ll, "prefill"):
        row(f"prefill tok/s, {p} tokens", median([f.get(f"prefill{p}") for f in ds]),
            median([f.get(f"prefill{p}") for f in ll]), 1)
    for b in keys_of(ds + ll, "decode"):
        d_step = median([f.get(f"bytes_step{b}") for f in ds])
        l_step = llama_step_bytes(shapes, b)
        d_tps, l_tps = median([f.get(f"decode{b}") for f in ds]), median([f.get(f"decode{b}") for f in ll])
        row(f"weight MB per token, batch {b}", d_step / b / 1e6 if d_step else None, l_step / b / 1e6, 1)
        d_bps = d_step * d_tps / b if d_step and d_tps else None
        l_bps = l_step * l_tps / b if l_tps else None
        row(f"weight GB/s moved, batch {b}", d_bps / 1e9 if d_bps else None, l_bps / 1e9 if l_bps else None)
        if bw:
            row(f"  share of read bandwidth, batch {b}", 100 * d_bps / 1e9 / bw if d_bps else None,
                100 * l_bps / 1e9 / bw if l_bps else None, 1)
    gen = [f.get(k) for f in ll for k in f if k.startswith("generated")]
    out.append(f"llama.cpp generated tokens on every sequence of every decode run: "
               f"{'yes' if gen and min(gen) > 0 else 'NO'} (fewest per sequence: {min(gen) if gen else 0})")
    out.append("ds41 bytes: ds41-bench's kernel counters (experts the step used counted once); llama.cpp bytes: "
               "from the GGUF's shapes (batch > 1: the expected distinct experts under uniform routing)")
    return out


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    runs = load_runs(args[0])
    with open(args[1]) as f:
        shapes = json.load(f)
    for a in argv:
        if a.startswith("--pair="):
            print("\n".join(pair_lines(runs, int(a.split("=", 1)[1]))))
            return 0
    print("\n".join(report(runs, shapes)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
