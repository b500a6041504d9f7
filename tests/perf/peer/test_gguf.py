#!/usr/bin/env python3
"""The peer benchmark's GGUF writer (tests/perf/peer/mkgguf.py, gguf.py), on
the tiny preset: the file parses back with the reader, every GGUF v3 layout
invariant a loader relies on holds, the gpt-oss tensors and keys llama.cpp
loads are there with the matched shapes, the tokenizer is ds41's, the
quantized blocks carry the scales the writer meant, and the bytes per token
the report uses agree with the tensors written.  The reader refuses broken
files.  No network, a few seconds."""

import json
import math
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gguf  # noqa: E402
import mkgguf  # noqa: E402

n_test = 0
failed = 0


def check(ok, what):
    global n_test, failed
    n_test += 1
    print(f"{'ok' if ok else 'not ok'} {n_test} - {what}")
    if not ok:
        failed += 1
    return ok


def refused(tmp, data, needle, what):
    """The reader refuses `data` with a message containing `needle`."""
    path = os.path.join(tmp, "broken.gguf")
    with open(path, "wb") as f:
        f.write(data)
    try:
        gguf.Reader(path)
        check(False, what)
    except gguf.ParseError as ex:
        check(needle in str(ex), f"{what} ({ex})")


def e2m1(code):
    v = [0, 0.5, 1, 1.5, 2, 3, 4, 6][code & 7]
    return -v if code & 8 else v


def main():
    build = os.environ.get("DS41_BUILD_DIR", "build")
    tmp = tempfile.mkdtemp(prefix="ds41-peer-gguf-")
    model = os.path.join(tmp, "tiny")
    subprocess.run([os.path.join(build, "daemon", "ds41-mkmodel"), model, "--quiet"], check=True,
                   stdout=subprocess.DEVNULL)
    out = os.path.join(tmp, "tiny.gguf")
    s = mkgguf.build(model, out, seed=3)
    with open(os.path.join(model, "inference", "config.json")) as f:
        c = json.load(f)

    r = gguf.Reader(out)
    size = os.path.getsize(out)
    check(True, "the file parses back (magic, version 3, bounds, unique names, aligned and disjoint tensors)")
    end = max(t["offset"] + t["nbytes"] for t in r.tensors)
    check(r.data_offset % r.alignment == 0 and r.data_offset + end <= size < r.data_offset + end + r.alignment,
          f"data section aligned at {r.data_offset}; file ends within one alignment of the last tensor")

    kv = r.kv
    a = "gpt-oss"
    check(kv.get("general.architecture") == a, "general.architecture is gpt-oss")
    want = {"embedding_length": c["dim"], "block_count": c["n_layers"], "expert_count": c["n_routed_experts"],
            "expert_used_count": c["n_activated_experts"], "expert_feed_forward_length": c["moe_inter_dim"],
            "attention.sliding_window": c["window_size"], "attention.head_count": s["n_head"],
            "attention.head_count_kv": 8, "attention.key_length": 64, "rope.dimension_count": 64}
    bad = {k: kv.get(f"{a}.{k}") for k, v in want.items() if kv.get(f"{a}.{k}") != v}
    check(not bad, f"hyperparameters match the ds41 config ({bad or 'all'})")
    check(isinstance(kv.get(f"{a}.attention.layer_norm_rms_epsilon"), float) and
          isinstance(kv.get(f"{a}.context_length"), int), "rms epsilon and context length present")

    # Tokenizer: ds41's tokenizer.json id for id.
    with open(os.path.join(model, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    toks = kv.get("tokenizer.ggml.tokens", [])
    types = kv.get("tokenizer.ggml.token_type", [])
    same = len(toks) == c["vocab_size"] == len(types) and all(toks[i] == t for t, i in tj["model"]["vocab"].items())
    added = all(toks[x["id"]] == x["content"] and types[x["id"]] == (3 if x["special"] else 1)
                for x in tj["added_tokens"])
    check(same and added, f"tokens: {len(toks)} = vocab_size, every BPE and added token at its ds41 id")
    check(kv.get("tokenizer.ggml.merges") == tj["model"]["merges"] and kv.get("tokenizer.ggml.model") == "gpt2",
          "gpt2-style BPE with ds41's merges in order")
    bos = tj["added_tokens"][0]
    check(kv.get("tokenizer.ggml.bos_token_id") == bos["id"] and
          toks[kv.get("tokenizer.ggml.eos_token_id", 0)] == "<｜end▁of▁sentence｜>",
          "bos / eos ids are ds41's")

    # Tensors llama.cpp's gpt-oss loader creates, with their ggml shapes.
    D, L, E, F, V = c["dim"], c["n_layers"], c["n_routed_experts"], c["moe_inter_dim"], c["vocab_size"]
    qd, kvd = s["n_head"] * 64, 8 * 64
    expect = {"token_embd.weight": (gguf.GGML_BF16, [D, V]), "output_norm.weight": (gguf.GGML_F32, [D]),
              "output.weight": (gguf.GGML_BF16, [D, V])}
    for i in range(L):
        p = f"blk.{i}."
        expect.update({
            p + "attn_norm.weight": (gguf.GGML_F32, [D]), p + "post_attention_norm.weight": (gguf.GGML_F32, [D]),
            p + "attn_q.weight": (gguf.GGML_Q8_0, [D, qd]), p + "attn_q.bias": (gguf.GGML_F32, [qd]),
            p + "attn_k.weight": (gguf.GGML_Q8_0, [D, kvd]), p + "attn_k.bias": (gguf.GGML_F32, [kvd]),
            p + "attn_v.weight": (gguf.GGML_Q8_0, [D, kvd]), p + "attn_v.bias": (gguf.GGML_F32, [kvd]),
            p + "attn_output.weight": (gguf.GGML_Q8_0, [qd, D]), p + "attn_output.bias": (gguf.GGML_F32, [D]),
            p + "attn_sinks.weight": (gguf.GGML_F32, [s["n_head"]]),
            p + "ffn_gate_inp.weight": (gguf.GGML_F32, [D, E]), p + "ffn_gate_inp.bias": (gguf.GGML_F32, [E]),
            p + "ffn_gate_exps.weight": (gguf.GGML_MXFP4, [D, F, E]), p + "ffn_gate_exps.bias": (gguf.GGML_F32, [F, E]),
            p + "ffn_up_exps.weight": (gguf.GGML_MXFP4, [D, F, E]), p + "ffn_up_exps.bias": (gguf.GGML_F32, [F, E]),
            p + "ffn_down_exps.weight": (gguf.GGML_MXFP4, [F, D, E]), p + "ffn_down_exps.bias": (gguf.GGML_F32, [D, E]),
        })
    got = {t["name"]: (t["type"], t["dims"]) for t in r.tensors}
    diff = [k for k in sorted(set(got) | set(expect)) if got.get(k) != expect.get(k)]
    check(not diff, f"the {len(expect)} gpt-oss tensors, types and dims ({diff[:4] or 'all match'})")

    # MXFP4: 17-byte blocks, ue8m0 scale first, e2m1 codes at RMS ~1/sqrt(k).
    blk = r.tensor_bytes("blk.0.ffn_gate_exps.weight")
    scales = set(blk[0::17])
    e = 127 - round(math.log2(2.93 * D ** 0.5))
    vals = [e2m1(b & 15) for j in range(64) for b in blk[17 * j + 1:17 * j + 17]]
    vals += [e2m1(b >> 4) for j in range(64) for b in blk[17 * j + 1:17 * j + 17]]
    rms = math.sqrt(sum(v * v for v in vals) / len(vals)) * 2.0 ** (e - 127)
    check(scales == {e} and 0.5 / D ** 0.5 < rms < 2 / D ** 0.5,
          f"MXFP4 experts: every block's scale byte {sorted(scales)} = {e}; weight RMS {rms:.4f} ~ 1/sqrt({D})")
    q8 = r.tensor_bytes("blk.0.attn_q.weight")
    d = {struct.unpack("<e", q8[i:i + 2])[0] for i in range(0, len(q8), 34)}
    check(len(d) == 1 and abs(d.pop() * 73.6 * D ** 0.5 - 1) < 1e-2, "Q8_0 attention: one fp16 scale 1/(73.6 sqrt(k))")
    head = r.tensor_bytes("output.weight")
    hi = set(head[1::2][:4096])
    check(hi <= set(mkgguf.HEAD_HI), f"bf16 head: high bytes within {sorted(mkgguf.HEAD_HI)}")

    # Bytes per token (the report's llama.cpp figure) against the file.
    per_tok = 0
    for t in r.tensors:
        n = t["nbytes"]
        if t["name"] == "token_embd.weight":
            n = n // V
        elif "_exps." in t["name"]:
            n = n * s["n_expert_used"] // E
        per_tok += n
    check(abs(per_tok - mkgguf.bytes_per_token(s)) < 1, f"bytes per token {per_tok} = mkgguf.bytes_per_token")

    # The bench preset's shapes (config only): the figures the issue quotes.
    bench = {"dim": 2048, "n_layers": 8, "n_routed_experts": 64, "n_activated_experts": 6, "moe_inter_dim": 512,
             "window_size": 128, "vocab_size": 129280, "head_dim": 512, "n_heads": 16, "q_lora_rank": 512,
             "o_lora_rank": 512, "o_groups": 4}
    bs = mkgguf.shapes(bench)
    check(bs["n_head"] == 48 and 735e6 < mkgguf.bytes_per_token(bs) < 745e6,
          f"bench preset: 48 query heads, {mkgguf.bytes_per_token(bs) / 1e6:.1f} MB per token")

    # The reader refuses broken files.
    with open(out, "rb") as f:
        raw = f.read()
    refused(tmp, raw[:r.data_offset + end - 1], "past the end", "a truncated file is refused")
    # Shift the first tensor's offset by one byte: misaligned.
    first = r.tensors[0]
    name_b = first["name"].encode()
    at = raw.index(struct.pack("<Q", len(name_b)) + name_b) + 8 + len(name_b)
    nd = struct.unpack("<I", raw[at:at + 4])[0]
    off_at = at + 4 + 8 * nd + 4
    bad = bytearray(raw)
    bad[off_at:off_at + 8] = struct.pack("<Q", first["offset"] + 1)
    refused(tmp, bad, "not aligned", "a misaligned tensor offset is refused")
    bad = bytearray(raw)
    bad[4:8] = struct.pack("<I", 2)
    refused(tmp, bad, "version 2", "GGUF version 2 is refused")

    subprocess.run(["rm", "-rf", tmp], check=True)
    print(f"1..{n_test}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
