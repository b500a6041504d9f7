#!/usr/bin/env python3
"""Write a random-weight gpt-oss GGUF matched to a ds41 checkpoint's shapes.

usage: mkgguf.py DS41_MODEL_DIR OUT.gguf [--seed N] [--print-shapes]

The llama.cpp side of the peer benchmark (tests/perf/peer/run.sh).  From the
ds41 checkpoint's inference/config.json it takes what the two architectures
share and keeps it equal: dim, layer count, vocabulary (ds41's own
tokenizer.json, converted to the GGUF gpt2-style BPE keys), routed experts,
their width and top-k, the sliding window.  The formats are the ones the issue
fixes: MXFP4 experts (e2m1 codes with one ue8m0 scale per 32 values, the same
numbers and the same 4.25 bits per weight as ds41's FP4 experts; ggml keeps
the scale in front of each block's 16 code bytes and pairs element j with
j+16 in a byte), Q8_0 attention, bf16 embedding and head.  gpt-oss attention
(grouped-query, head_dim 64, 8 KV heads) has no low-rank projections; its
query-head count is chosen so that its parameters per layer equal ds41's
attention projections (wq_a, wq_b, wkv, wo_a, wo_b).  ds41's shared expert,
hyper-connections, compressor, indexer and Engram have no gpt-oss
counterpart: summary.py counts each model's own bytes per token.

Weights are random (uniform codes, constant scales sized so activations stay
O(1)): the benchmark measures speed, not text.
"""

import json
import math
import os
import random
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf  # noqa: E402

ARCH = "gpt-oss"
HEAD_DIM = 64
KV_HEADS = 8

# llama.cpp token types
TT_NORMAL, TT_CONTROL, TT_UNUSED = 1, 3, 5


def load_config(model_dir):
    with open(os.path.join(model_dir, "inference", "config.json")) as f:
        return json.load(f)


def attention_params_ds41(c):
    """Parameters of one ds41 layer's attention projections (REFERENCE 2.8)."""
    dim, hd, H = c["dim"], c["head_dim"], c["n_heads"]
    return (dim * c["q_lora_rank"] + c["q_lora_rank"] * H * hd + dim * hd + H * hd * c["o_lora_rank"] +
            c["o_groups"] * c["o_lora_rank"] * dim)


def shapes(c):
    """The gpt-oss hyperparameters matched to ds41 config c."""
    dim = c["dim"]
    kv = KV_HEADS * HEAD_DIM
    # q and o: 2 * dim * H * HEAD_DIM; k and v: 2 * dim * kv.
    h = (attention_params_ds41(c) - 2 * dim * kv) / (2 * dim * HEAD_DIM)
    n_head = max(KV_HEADS, int(round(h / KV_HEADS)) * KV_HEADS)
    return {
        "dim": dim,
        "n_layer": c["n_layers"],
        "n_head": n_head,
        "n_head_kv": KV_HEADS,
        "head_dim": HEAD_DIM,
        "n_expert": c["n_routed_experts"],
        "n_expert_used": c["n_activated_experts"],
        "n_ff_exp": c["moe_inter_dim"],
        "window": c["window_size"],
        "vocab": c["vocab_size"],
    }


def bytes_per_token(s):
    """Weight bytes one decode token reads in the gpt-oss model (every tensor
    once, the routed experts' n_expert_used slices, one embedding row)."""
    dim, L = s["dim"], s["n_layer"]
    q8 = 34 / 32
    qd, kvd = s["n_head"] * s["head_dim"], s["n_head_kv"] * s["head_dim"]
    attn = (2 * dim * qd + 2 * dim * kvd) * q8 + 4 * (qd + 2 * kvd + dim + s["n_head"])
    router = 4 * (dim * s["n_expert"] + s["n_expert"])
    experts = s["n_expert_used"] * (3 * dim * s["n_ff_exp"] * 17 / 32 + 4 * (2 * s["n_ff_exp"] + dim))
    norms = 4 * 2 * dim
    per_layer = attn + router + experts + norms
    return L * per_layer + 2 * dim * s["vocab"] + 2 * dim + 4 * dim


def tokenizer_kv(model_dir, vocab_size):
    """ds41's tokenizer.json as GGUF gpt2-style BPE metadata."""
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    model = tj["model"]
    if model.get("type") != "BPE":
        raise SystemExit(f"{model_dir}/tokenizer.json: model.type {model.get('type')!r}, expected BPE")
    tokens = [None] * vocab_size
    types = [TT_NORMAL] * vocab_size
    for tok, i in model["vocab"].items():
        if 0 <= i < vocab_size:
            tokens[i] = tok
    for a in tj.get("added_tokens", []):
        i = a["id"]
        if 0 <= i < vocab_size:
            tokens[i] = a["content"]
            types[i] = TT_CONTROL if a.get("special") else TT_NORMAL
    for i in range(vocab_size):
        if tokens[i] is None:
            tokens[i] = f"<unused_{i}>"
            types[i] = TT_UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    special = {}
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            tc = json.load(f)
        index = {t: i for i, t in enumerate(tokens)}
        for key in ("bos_token", "eos_token", "pad_token"):
            v = tc.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if v in index:
                special[key] = index[v]
    kv = [
        ("tokenizer.ggml.model", gguf.STRING, "gpt2"),
        # ds41's pre-tokenizer is DeepSeek-V3's (digits, CJK runs, then the byte-level split).
        ("tokenizer.ggml.pre", gguf.STRING, "deepseek-v3"),
        ("tokenizer.ggml.tokens", gguf.ARRAY, (gguf.STRING, tokens)),
        ("tokenizer.ggml.token_type", gguf.ARRAY, (gguf.I32, types)),
        ("tokenizer.ggml.merges", gguf.ARRAY, (gguf.STRING, merges)),
        ("tokenizer.ggml.add_bos_token", gguf.BOOL, False),
    ]
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding")):
        if key in special:
            kv.append((f"tokenizer.ggml.{name}_token_id", gguf.U32, special[key]))
    return kv


class Fill:
    """Random tensor contents, generated in chunks (deterministic per seed and name)."""

    CHUNK = 1 << 22

    def __init__(self, seed):
        self.seed = seed

    def rng(self, name):
        return random.Random(f"{self.seed}:{name}")

    def const_f32(self, value, n):
        data = struct.pack("<f", value) * n

        def produce(f):
            f.write(data)
        return produce

    def _limited(self, name, n_bytes, elem, hi_index, hi_values):
        """Random bytes where byte hi_index of each elem-byte element is drawn
        from hi_values (sign and high exponent bits of bf16 / f32)."""
        table = bytes(hi_values[b % len(hi_values)] for b in range(256))

        def produce(f):
            r = self.rng(name)
            left = n_bytes
            while left:
                n = min(left, self.CHUNK)
                buf = bytearray(r.randbytes(n))
                buf[hi_index::elem] = r.randbytes(n // elem).translate(table)
                f.write(buf)
                left -= n
        return produce

    def bf16(self, name, n, hi_values):
        return self._limited(name, 2 * n, 2, 1, hi_values)

    def f32(self, name, n, hi_values):
        return self._limited(name, 4 * n, 4, 3, hi_values)

    def _blocks(self, name, n_blocks, block_bytes, head):
        """Blocks of random bytes, each starting with the bytes `head` (a
        quantized block's scale)."""

        def produce(f):
            r = self.rng(name)
            per = self.CHUNK // block_bytes
            left = n_blocks
            while left:
                m = min(left, per)
                buf = bytearray(r.randbytes(block_bytes * m))
                for i, byte in enumerate(head):
                    buf[i::block_bytes] = bytes([byte]) * m
                f.write(buf)
                left -= m
        return produce

    def q8_0(self, name, n, k):
        """Q8_0 blocks (fp16 scale + 32 int8): uniform int8 codes, one scale
        making the weights' standard deviation 1/sqrt(k)."""
        return self._blocks(name, n // 32, 34, struct.pack("<e", 1.0 / (73.6 * k ** 0.5)))

    def mxfp4(self, name, n, k):
        """MXFP4 blocks (ue8m0 scale + 16 code bytes): uniform e2m1 codes
        (RMS 2.93) under one power-of-two scale near 1/(2.93 sqrt(k))."""
        return self._blocks(name, n // 32, 17, bytes([127 - round(math.log2(2.93 * k ** 0.5))]))


# High bytes: bf16 / f32 sign + top 7 exponent bits.
EMBED_HI = (0x3F, 0xBF)              # |v| in [0.5, 2): O(1) embeddings
HEAD_HI = (0x3B, 0x3C, 0xBB, 0xBC)   # |v| in [2^-9, 2^-5): ~1/sqrt(2048)
ROUTER_HI = (0x3C, 0xBC)             # f32 |v| in [2^-7, 2^-5)


def build(model_dir, out, seed=1):
    c = load_config(model_dir)
    s = shapes(c)
    dim, L, V = s["dim"], s["n_layer"], s["vocab"]
    qd, kvd = s["n_head"] * s["head_dim"], s["n_head_kv"] * s["head_dim"]
    E, F = s["n_expert"], s["n_ff_exp"]
    w = gguf.Writer()
    fill = Fill(seed)
    a = ARCH
    for key, t, v in [
        ("general.architecture", gguf.STRING, a),
        ("general.name", gguf.STRING, "ds41 peer benchmark (random weights)"),
        (f"{a}.context_length", gguf.U32, 4096),
        (f"{a}.embedding_length", gguf.U32, dim),
        (f"{a}.block_count", gguf.U32, L),
        (f"{a}.feed_forward_length", gguf.U32, F),
        (f"{a}.expert_feed_forward_length", gguf.U32, F),
        (f"{a}.expert_count", gguf.U32, E),
        (f"{a}.expert_used_count", gguf.U32, s["n_expert_used"]),
        (f"{a}.attention.head_count", gguf.U32, s["n_head"]),
        (f"{a}.attention.head_count_kv", gguf.U32, s["n_head_kv"]),
        (f"{a}.attention.key_length", gguf.U32, s["head_dim"]),
        (f"{a}.attention.value_length", gguf.U32, s["head_dim"]),
        (f"{a}.attention.layer_norm_rms_epsilon", gguf.F32, 1e-5),
        (f"{a}.attention.sliding_window", gguf.U32, s["window"]),
        (f"{a}.rope.dimension_count", gguf.U32, s["head_dim"]),
        (f"{a}.rope.freq_base", gguf.F32, 150000.0),
    ]:
        w.add_kv(key, t, v)
    for key, t, v in tokenizer_kv(model_dir, V):
        w.add_kv(key, t, v)

    w.add_tensor("token_embd.weight", gguf.GGML_BF16, [dim, V], fill.bf16("token_embd", dim * V, EMBED_HI))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", gguf.GGML_F32, [dim], fill.const_f32(1.0, dim))
        w.add_tensor(p + "post_attention_norm.weight", gguf.GGML_F32, [dim], fill.const_f32(1.0, dim))
        for name, n_out in (("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)):
            w.add_tensor(p + name + ".weight", gguf.GGML_Q8_0, [dim, n_out], fill.q8_0(p + name, dim * n_out, dim))
            w.add_tensor(p + name + ".bias", gguf.GGML_F32, [n_out], fill.const_f32(0.0, n_out))
        w.add_tensor(p + "attn_output.weight", gguf.GGML_Q8_0, [qd, dim], fill.q8_0(p + "attn_output", qd * dim, qd))
        w.add_tensor(p + "attn_output.bias", gguf.GGML_F32, [dim], fill.const_f32(0.0, dim))
        w.add_tensor(p + "attn_sinks.weight", gguf.GGML_F32, [s["n_head"]], fill.const_f32(0.0, s["n_head"]))
        w.add_tensor(p + "ffn_gate_inp.weight", gguf.GGML_F32, [dim, E], fill.f32(p + "router", dim * E, ROUTER_HI))
        w.add_tensor(p + "ffn_gate_inp.bias", gguf.GGML_F32, [E], fill.const_f32(0.0, E))
        for name, k, n_out in (("ffn_gate_exps", dim, F), ("ffn_up_exps", dim, F), ("ffn_down_exps", F, dim)):
            w.add_tensor(p + name + ".weight", gguf.GGML_MXFP4, [k, n_out, E], fill.mxfp4(p + name, k * n_out * E, k))
            w.add_tensor(p + name + ".bias", gguf.GGML_F32, [n_out, E], fill.const_f32(0.0, n_out * E))
    w.add_tensor("output_norm.weight", gguf.GGML_F32, [dim], fill.const_f32(1.0, dim))
    w.add_tensor("output.weight", gguf.GGML_BF16, [dim, V], fill.bf16("output", dim * V, HEAD_HI))
    w.write(out)
    return s


def main(argv):
    args = [x for x in argv if not x.startswith("--")]
    seed = 1
    for x in argv:
        if x.startswith("--seed="):
            seed = int(x.split("=", 1)[1])
    if len(args) == 1 and "--print-shapes" in argv:
        s = shapes(load_config(args[0]))
        s["bytes_per_token"] = bytes_per_token(s)
        print(json.dumps(s))
        return 0
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    s = build(args[0], args[1], seed)
    s["bytes_per_token"] = bytes_per_token(s)
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
