#!/usr/bin/python3
"""Write a tiny random DeepSeek-V4.1 checkpoint in the release layout (REFERENCE.md section 3).

Independent of the project's C generator.  The output directory holds
    model-0000N-of-0000M.safetensors (>= 2 shards), model.safetensors.index.json,
    inference/config.json, config.json, tokenizer.json, tokenizer_config.json
with every layer role of the release present (window-only layers, a ratio-2 KV+index source with
a consumer, a ratio-1 KV+index+candidate source with consumers, index sources that are candidate
users with consumers, two Engram layers, DSpark stages with their tensors) but constants that
differ from the release (route_scale, swiglu_limit, rope thetas and YaRN, window, index_topk,
candidate sizes, engram sizes, vocab).

Weights are quantized with their own encoders (written here, not shared with ds41_ref's
decoders): FP8 e4m3 32x32 blocks with ue8m0 scales rounded up from amax*fp32(1/448) (floor 1e-4),
FP4 e2m1 1x32 with ue8m0 scales from amax*fp32(1/6) (floor 6*2^-126), RNE everywhere.

    gen_ckpt.py --out DIR [--preset small|wide] [--seed N]
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds41_ref as ref  # noqa: E402  (token map, engram primes, safetensors writer)

BOS = '<｜begin▁of▁sentence｜>'
EOS = '<｜end▁of▁sentence｜>'
PAD = '<｜▁pad▁｜>'
TOP_SPECIALS = ['<｜User｜>', '<｜Assistant｜>', '<think>', '</think>', '<｜System｜>']

# Layer layout shared by the presets (absolute layer ids):
#   0, 1 window only (1 also Engram); 2 ratio-2 KV+index source; 3 its consumer;
#   4 ratio-1 KV+index+candidate source (also Engram); 5 consumer; 6, 8 index sources that are
#   candidate users (keys from 4); 7, 9 their consumers; then DSpark stages (ratio 0).
LAYOUT = dict(
    n_layers=10,
    compress_ratios_backbone=[0, 0, 2, 2, 1, 1, 1, 1, 1, 1],
    kv_source_layers=[2, 4],
    index_source_layers=[2, 4, 6, 8],
    candidate_source_layer=4,
    engram_layer_ids=[1, 4],
    dspark_target_layer_ids=[7, 8, 9],
)

PRESETS = {
    'small': dict(vocab_size=400, dim=64, moe_inter_dim=64, n_mtp_layers=2, n_heads=4, head_dim=64,
                  rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, n_routed_experts=8,
                  n_activated_experts=2, n_shared_experts=1, route_scale=2.0, swiglu_limit=6.0,
                  window_size=16, candidate_topk_blocks=3, candidate_block_size=2, index_n_heads=4,
                  index_head_dim=32, index_topk=6, rope_theta=5000, compress_rope_theta=40000,
                  original_seq_len=4096, rope_factor=8, beta_fast=16, beta_slow=1,
                  engram_vocab_size=500, engram_max_ngram_size=3, engram_n_heads=4,
                  engram_head_dim=32, dspark_block_size=3, dspark_markov_rank=32,
                  dspark_n_routed_experts=4, dspark_n_activated_experts=2),
    'wide': dict(vocab_size=448, dim=128, moe_inter_dim=64, n_mtp_layers=3, n_heads=8, head_dim=64,
                 rope_head_dim=16, q_lora_rank=96, o_groups=4, o_lora_rank=32, n_routed_experts=16,
                 n_activated_experts=3, n_shared_experts=1, route_scale=1.25, swiglu_limit=8.0,
                 window_size=48, candidate_topk_blocks=12, candidate_block_size=4, index_n_heads=8,
                 index_head_dim=64, index_topk=40, rope_theta=20000, compress_rope_theta=80000,
                 original_seq_len=2048, rope_factor=4, beta_fast=24, beta_slow=2,
                 engram_vocab_size=800, engram_max_ngram_size=4, engram_n_heads=2,
                 engram_head_dim=64, dspark_block_size=4, dspark_markov_rank=32,
                 dspark_n_routed_experts=4, dspark_n_activated_experts=2),
}

# ------------------------------------------------------------------------------------------------
# Encoders (independent of ds41_ref's decoders: table search instead of exponent arithmetic)
# ------------------------------------------------------------------------------------------------

# all 127 finite non-negative e4m3 magnitudes with their codes, ascending
_E4M3_POS = []
for _c in range(0x7F):
    _e, _m = _c >> 3, _c & 7
    _E4M3_POS.append((_m * 2.0 ** -9) if _e == 0 else (1 + _m / 8) * 2.0 ** (_e - 7))
_E4M3_POS = np.array(_E4M3_POS)
_E2M1_POS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def _nearest_even_code(a, grid):
    """Index of the grid value nearest to a (a within [0, grid[-1]]), ties to the even index."""
    hi = np.clip(np.searchsorted(grid, a, side='left'), 1, len(grid) - 1)
    lo = hi - 1
    dlo = a - grid[lo]
    dhi = grid[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    return np.where(pick_hi, hi, lo)


def enc_e4m3(v):
    """float -> e4m3 codes: clamp to +-448, RNE (ties to even mantissa)."""
    v = np.asarray(v, np.float64)
    a = np.minimum(np.abs(v), 448.0)
    code = _nearest_even_code(a, _E4M3_POS)
    return (code | (np.signbit(v).astype(np.int64) << 7)).astype(np.uint8)


def enc_e2m1(v):
    v = np.asarray(v, np.float64)
    a = np.minimum(np.abs(v), 6.0)
    code = _nearest_even_code(a, _E2M1_POS)
    return (code | (np.signbit(v).astype(np.int64) << 3)).astype(np.uint8)


def ue8m0_byte(amax, floor, recip):
    """Scale byte: 2^ceil(log2(fp32(max(amax, floor) * fp32(recip)))) as k+127."""
    t = (np.maximum(np.asarray(amax, np.float32), np.float32(floor)) * np.float32(recip)).astype(np.float32)
    m, e = np.frexp(t.astype(np.float64))         # t = m * 2^e, m in [0.5, 1)
    k = np.where(m == 0.5, e - 1, e)               # exact power of two -> its own exponent
    return (k + 127).astype(np.uint8), k


def quant_fp8(W):
    """[N,K] float -> (e4m3 codes [N,K], e8m0 scale bytes [ceil(N/32), ceil(K/32)])."""
    W = np.asarray(W, np.float32)
    N, K = W.shape
    NB, KB = -(-N // 32), -(-K // 32)
    P = np.zeros((NB * 32, KB * 32), np.float32)
    P[:N, :K] = W
    blocks = np.abs(P).reshape(NB, 32, KB, 32).max(axis=(1, 3))
    sb, k = ue8m0_byte(blocks, 1e-4, 1.0 / 448.0)
    scale = np.ldexp(1.0, k)                                  # [NB, KB]
    full = np.repeat(np.repeat(scale, 32, 0), 32, 1)[:N, :K]
    return enc_e4m3(W.astype(np.float64) / full), sb


def quant_fp4(W):
    """[N,K] float -> (packed I8 bytes [N, K/2], e8m0 scale bytes [N, K/32])."""
    W = np.asarray(W, np.float32)
    N, K = W.shape
    g = np.abs(W).reshape(N, K // 32, 32).max(axis=2)
    sb, k = ue8m0_byte(g, 6 * 2.0 ** -126, 1.0 / 6.0)
    full = np.repeat(np.ldexp(1.0, k), 32, 1)
    codes = enc_e2m1(W.astype(np.float64) / full)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, sb


def quant_rows_fp8(W, block=32):
    """[R, C] -> (e4m3 codes, e8m0 [R, C/32]): one scale per row per 32 channels (engram tables)."""
    W = np.asarray(W, np.float32)
    R, C = W.shape
    g = np.abs(W).reshape(R, C // block, block).max(axis=2)
    sb, k = ue8m0_byte(g, 1e-4, 1.0 / 448.0)
    full = np.repeat(np.ldexp(1.0, k), block, 1)
    return enc_e4m3(W.astype(np.float64) / full), sb


def to_bf16_bits(x):
    """float -> bf16 bit patterns (uint16), RNE."""
    return (ref.bf16(np.asarray(x, np.float32)).view(np.uint32) >> 16).astype(np.uint16)


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------

# Words whose merges make a vocabulary where the Engram normalisation merges keys (case, accents,
# NFKC compatibility forms, whitespace runs) and where partial UTF-8 tokens exist.
_WORDS = ['Hello', 'hello', 'HELLO', ' the', ' The', 'the', 'The', ' world', 'World', 'café', 'cafe',
          'é', 'É', 'ﬁne', 'fine', '你好', '世界', '  ', '    ', '\n\n', ' \n', '\t\t', '123', '１２',
          'Å', 'straße', 'İ', 'Σ', 'σ', 'ὈΔΥΣΣΕΎΣ', ' and', ' of', 'ing', ' a', ' to', '\u00a0\u00a0',
          '...', '--', '==', '  \n', 'Ωmega', 'naïve', 'naive', '½', 'x²']


def make_tokenizer(vocab_size):
    b2u = ref.BYTE_TO_UNICODE
    vocab = {BOS: 0, EOS: 1, PAD: 2}
    for b in range(256):
        vocab[b2u[b]] = 3 + b
    n_base = vocab_size - len(TOP_SPECIALS)
    merges = []
    words = list(_WORDS)
    extra = 0
    while len(vocab) < n_base:
        if not words:
            # filler merges from letter pairs
            a = 'abcdefghijklmnopqrstuvwxyz'[extra % 26]
            b = 'etaoinshrdlu'[(extra // 26) % 12]
            words.append(' ' + a + b + 'x' * (extra // 312))
            extra += 1
            continue
        w = words.pop(0)
        toks = [b2u[b] for b in w.encode('utf-8')]
        while len(toks) > 1 and len(vocab) < n_base:
            new = toks[0] + toks[1]
            if new not in vocab:
                vocab[new] = len(vocab)
                merges.append(toks[0] + ' ' + toks[1])
            toks = [new] + toks[2:]
    added = []
    for i, c in enumerate([BOS, EOS, PAD]):
        added.append({'id': i, 'content': c, 'single_word': False, 'lstrip': False, 'rstrip': False,
                      'normalized': False, 'special': True})
    for j, c in enumerate(TOP_SPECIALS):
        is_sys = c == '<｜System｜>'
        added.append({'id': n_base + j, 'content': c, 'single_word': False, 'lstrip': False,
                      'rstrip': False, 'normalized': is_sys, 'special': not is_sys})
    split3 = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?"
              "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
    tok = {
        'version': '1.0', 'truncation': None, 'padding': None, 'added_tokens': added,
        'normalizer': {'type': 'Sequence', 'normalizers': []},
        'pre_tokenizer': {'type': 'Sequence', 'pretokenizers': [
            {'type': 'Split', 'pattern': {'Regex': '\\p{N}{1,3}'}, 'behavior': 'Isolated', 'invert': False},
            {'type': 'Split', 'pattern': {'Regex': '[一-龥぀-ゟ゠-ヿ]+'}, 'behavior': 'Isolated', 'invert': False},
            {'type': 'Split', 'pattern': {'Regex': split3}, 'behavior': 'Isolated', 'invert': False},
            {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': True, 'use_regex': False}]},
        'post_processor': {'type': 'ByteLevel', 'add_prefix_space': True, 'trim_offsets': False, 'use_regex': True},
        'decoder': {'type': 'ByteLevel', 'add_prefix_space': True, 'trim_offsets': True, 'use_regex': True},
        'model': {'type': 'BPE', 'dropout': None, 'unk_token': None, 'continuing_subword_prefix': None,
                  'end_of_word_suffix': None, 'fuse_unk': False, 'byte_fallback': False,
                  'vocab': vocab, 'merges': merges},
    }
    return tok, {c['content']: c['id'] for c in added}


# ------------------------------------------------------------------------------------------------
# Checkpoint
# ------------------------------------------------------------------------------------------------

def make_config(preset, tok):
    p = dict(PRESETS[preset])
    n_mtp = p.pop('n_mtp_layers')
    cfg = dict(vocab_size=p['vocab_size'], dim=p['dim'], moe_inter_dim=p['moe_inter_dim'],
               n_layers=LAYOUT['n_layers'], n_mtp_layers=n_mtp,
               dspark_block_size=p['dspark_block_size'],
               dspark_noise_token_id=None,
               dspark_target_layer_ids=LAYOUT['dspark_target_layer_ids'],
               dspark_markov_rank=p['dspark_markov_rank'],
               dspark_n_routed_experts=p['dspark_n_routed_experts'],
               dspark_n_activated_experts=p['dspark_n_activated_experts'],
               n_heads=p['n_heads'], n_routed_experts=p['n_routed_experts'],
               n_shared_experts=p['n_shared_experts'], n_activated_experts=p['n_activated_experts'],
               score_func='sqrtsoftplus', route_scale=p['route_scale'], swiglu_limit=p['swiglu_limit'],
               q_lora_rank=p['q_lora_rank'], head_dim=p['head_dim'], rope_head_dim=p['rope_head_dim'],
               norm_eps=1e-20, o_groups=p['o_groups'], o_lora_rank=p['o_lora_rank'],
               window_size=p['window_size'], kv_source_layers=LAYOUT['kv_source_layers'],
               index_source_layers=LAYOUT['index_source_layers'],
               original_seq_len=p['original_seq_len'], rope_theta=p['rope_theta'],
               rope_factor=p['rope_factor'], beta_fast=p['beta_fast'], beta_slow=p['beta_slow'],
               index_n_heads=p['index_n_heads'], index_head_dim=p['index_head_dim'],
               index_topk=p['index_topk'], candidate_source_layer=LAYOUT['candidate_source_layer'],
               candidate_topk_blocks=p['candidate_topk_blocks'],
               candidate_block_size=p['candidate_block_size'], hc_mult=4, hc_sinkhorn_iters=20,
               hc_eps=1e-6, engram_layer_ids=LAYOUT['engram_layer_ids'],
               engram_vocab_size=p['engram_vocab_size'], engram_num_embeddings=None,
               engram_max_ngram_size=p['engram_max_ngram_size'], engram_pad_id=2,
               engram_compressed_vocab_size=None, dtype='fp8', expert_dtype='fp4',
               compress_rope_theta=p['compress_rope_theta'],
               compress_ratios=LAYOUT['compress_ratios_backbone'] + [0] * n_mtp,
               vision_n_layers=0, engram_n_heads=p['engram_n_heads'],
               engram_head_dim=p['engram_head_dim'])
    return cfg


def build(preset='small', seed=1, out='ckpt'):
    if preset not in PRESETS:
        raise SystemExit(f"gen_ckpt: unknown preset {preset!r} (choose from {sorted(PRESETS)})")
    rng = np.random.default_rng(seed)
    V = PRESETS[preset]['vocab_size']
    tok, special_ids = make_tokenizer(V)
    cfg = make_config(preset, tok)
    cfg['dspark_noise_token_id'] = special_ids['<｜System｜>']
    cmap, ncv = ref.compressed_token_map(tok, V)
    cfg['engram_compressed_vocab_size'] = ncv
    primes = ref.engram_primes(cfg['engram_layer_ids'], cfg['engram_max_ngram_size'],
                               cfg['engram_n_heads'], cfg['engram_vocab_size'])
    cfg['engram_num_embeddings'] = [sum(sum(pn) for pn in pl) for pl in primes]

    D = cfg['dim']
    hc = cfg['hc_mult']
    H, hd = cfg['n_heads'], cfg['head_dim']
    G, olr = cfg['o_groups'], cfg['o_lora_rank']
    ql = cfg['q_lora_rank']
    inter = cfg['moe_inter_dim']
    nmix = (2 + hc) * hc
    tensors = []          # (name, dtype, array in storage layout)
    big = []              # engram tables go to their own shards

    def rn(*shape, std=1.0):
        return rng.standard_normal(shape) * std

    def add_bf16(name, x):
        tensors.append((name, 'BF16', to_bf16_bits(x)))

    def add_f32(name, x):
        tensors.append((name, 'F32', np.asarray(x, np.float32)))

    def add_fp8(name, W):
        c, s = quant_fp8(W)
        tensors.append((name + '.weight', 'F8_E4M3', c))
        tensors.append((name + '.scale', 'F8_E8M0', s))

    def add_fp4(name, W):
        c, s = quant_fp4(W)
        tensors.append((name + '.weight', 'I8', c))
        tensors.append((name + '.scale', 'F8_E8M0', s))

    def norm_w(n):
        return 1.0 + rn(n, std=0.1)

    add_bf16('embed.weight', rn(V, D))
    add_bf16('head.weight', rn(V, D, std=2.5 / np.sqrt(D)))
    add_bf16('norm.weight', norm_w(D))
    for nm in ('image_start', 'image_end', 'image_newline'):
        add_bf16(nm, rn(D, std=0.5))

    def block(p, L, n_exp):
        add_bf16(p + 'attn_norm.weight', norm_w(D))
        add_bf16(p + 'ffn_norm.weight', norm_w(D))
        add_f32(p + 'attn.attn_sink', rn(H))
        add_bf16(p + 'attn.q_norm.weight', norm_w(ql))
        add_bf16(p + 'attn.kv_norm.weight', norm_w(hd))
        add_fp8(p + 'attn.wq_a', rn(ql, D, std=1 / np.sqrt(D)))
        add_fp8(p + 'attn.wq_b', rn(H * hd, ql, std=1.5 / np.sqrt(ql)))
        add_fp8(p + 'attn.wkv', rn(hd, D, std=1 / np.sqrt(D)))
        add_fp8(p + 'attn.wo_a', rn(G * olr, H * hd // G, std=1 / np.sqrt(H * hd // G)))
        add_fp8(p + 'attn.wo_b', rn(D, G * olr, std=0.7 / np.sqrt(G * olr)))
        for sub in ('attn', 'ffn'):
            add_f32(p + f'hc_{sub}_fn', rn(nmix, hc * D, std=1 / np.sqrt(hc * D)))
            add_f32(p + f'hc_{sub}_base', rn(nmix, std=0.5))
            add_f32(p + f'hc_{sub}_scale', np.array([0.7, 0.7, 1.5]) * (1 + rn(3, std=0.2)))
        add_bf16(p + 'ffn.gate.weight', rn(n_exp, D, std=1.5 / np.sqrt(D)))
        add_f32(p + 'ffn.gate.bias', rn(n_exp, std=0.1))
        add_f32(p + 'ffn.gate.bias_vl', rn(n_exp, std=0.1))
        for e in range(n_exp):
            q = p + f'ffn.experts.{e}.'
            add_fp4(q + 'w1', rn(inter, D, std=1 / np.sqrt(D)))
            add_fp4(q + 'w3', rn(inter, D, std=1 / np.sqrt(D)))
            add_fp4(q + 'w2', rn(D, inter, std=0.7 / np.sqrt(inter)))
        si = cfg['n_shared_experts'] * inter
        add_fp8(p + 'ffn.shared_experts.w1', rn(si, D, std=1 / np.sqrt(D)))
        add_fp8(p + 'ffn.shared_experts.w3', rn(si, D, std=1 / np.sqrt(D)))
        add_fp8(p + 'ffn.shared_experts.w2', rn(D, si, std=0.7 / np.sqrt(si)))

    ihd, inh = cfg['index_head_dim'], cfg['index_n_heads']
    ehd, enh = cfg['engram_head_dim'], cfg['engram_n_heads']
    ncol = (cfg['engram_max_ngram_size'] - 1) * enh
    for L in range(cfg['n_layers']):
        p = f'layers.{L}.'
        block(p, L, cfg['n_routed_experts'])
        ratio = cfg['compress_ratios'][L]
        if L in cfg['kv_source_layers']:
            add_bf16(p + 'attn.compressor.wkv.weight', rn(hd, D, std=1 / np.sqrt(D)))
            if ratio > 1:
                add_bf16(p + 'attn.compressor.wgate.weight', rn(hd, D, std=1 / np.sqrt(D)))
            add_bf16(p + 'attn.compressor.norm.weight', norm_w(hd))
            add_bf16(p + 'attn.indexer.wk.weight', rn(ihd, hd, std=1 / np.sqrt(hd)))
            add_bf16(p + 'attn.indexer.k_norm.weight', norm_w(ihd))
        if L in cfg['index_source_layers']:
            add_fp8(p + 'attn.indexer.wq_b', rn(inh * ihd, ql, std=1 / np.sqrt(ql)))
            add_bf16(p + 'attn.indexer.weights_proj.weight', rn(inh, D, std=1 / np.sqrt(D)))
        if L in cfg['engram_layer_ids']:
            rows = cfg['engram_num_embeddings'][cfg['engram_layer_ids'].index(L)]
            c, s = quant_rows_fp8(rn(rows, ehd))
            big.append([(p + 'engram.embed.weight', 'F8_E4M3', c), (p + 'engram.embed.scale', 'F8_E8M0', s)])
            wkv = rn((hc + 1) * D, ncol * ehd, std=1 / np.sqrt(ncol * ehd))
            wkv[hc * D:] *= 0.5
            add_fp8(p + 'engram.wkv', wkv)
            add_bf16(p + 'engram.q_weight', 1 + rn(hc, D, std=0.2))
            add_bf16(p + 'engram.k_weight', 1 + rn(hc, D, std=0.2))
    n_mtp = cfg['n_mtp_layers']
    mr = cfg['dspark_markov_rank']
    for k in range(n_mtp):
        p = f'mtp.{k}.'
        block(p, cfg['n_layers'] + k, cfg['dspark_n_routed_experts'])
        if k == 0:
            nt = len(cfg['dspark_target_layer_ids'])
            add_fp8(p + 'main_proj', rn(D, nt * D, std=1 / np.sqrt(nt * D)))
            add_bf16(p + 'main_norm.weight', norm_w(D))
        if k == n_mtp - 1:
            add_bf16(p + 'norm.weight', norm_w(D))
            add_bf16(p + 'markov_head.embed.weight', rn(V, mr))
            add_bf16(p + 'markov_head.head.weight', rn(V, mr, std=1 / np.sqrt(mr)))
            add_bf16(p + 'confidence_head.proj.weight', rn(1, D + mr, std=1 / np.sqrt(D + mr)))

    # shards: the ordinary tensors split in two by size, then one shard per engram table
    total = sum(a.nbytes for _, _, a in tensors)
    first, second, acc = [], [], 0
    for t in tensors:
        (first if acc < total / 2 else second).append(t)
        acc += t[2].nbytes
    shards = [first, second] + big
    os.makedirs(os.path.join(out, 'inference'), exist_ok=True)
    n = len(shards)
    weight_map = {}
    size = 0
    for i, sh in enumerate(shards):
        fn = f'model-{i + 1:05d}-of-{n:05d}.safetensors'
        ref.write_safetensors(os.path.join(out, fn), sh, metadata={'format': 'pt'})
        for name, _, a in sh:
            weight_map[name] = fn
            size += a.nbytes
    with open(os.path.join(out, 'model.safetensors.index.json'), 'w', encoding='utf-8') as fh:
        json.dump({'metadata': {'total_size': size}, 'weight_map': weight_map}, fh, indent=2)
    with open(os.path.join(out, 'inference', 'config.json'), 'w', encoding='utf-8') as fh:
        json.dump(cfg, fh, indent=4)
    root_cfg = {
        'architectures': ['DeepseekV41ForCausalLM'], 'model_type': 'deepseek_v41',
        'bos_token_id': 0, 'eos_token_id': 1, 'pad_token_id': 2, 'vocab_size': V,
        'hidden_size': D, 'num_hidden_layers': cfg['n_layers'], 'torch_dtype': 'bfloat16',
        'quantization_config': {'quant_method': 'fp8', 'activation_scheme': 'dynamic',
                                'weight_block_size': [32, 32], 'scale_fmt': 'ue8m0',
                                'expert_dtype': 'fp4'},
        'generator': f'tests/reference/gen_ckpt.py preset={preset} seed={seed}',
    }
    with open(os.path.join(out, 'config.json'), 'w', encoding='utf-8') as fh:
        json.dump(root_cfg, fh, indent=2)
    with open(os.path.join(out, 'tokenizer.json'), 'w', encoding='utf-8') as fh:
        json.dump(tok, fh, ensure_ascii=False, indent=1)
    with open(os.path.join(out, 'tokenizer_config.json'), 'w', encoding='utf-8') as fh:
        json.dump({'add_bos_token': False, 'add_eos_token': False, 'bos_token': BOS, 'eos_token': EOS,
                   'pad_token': EOS, 'clean_up_tokenization_spaces': False, 'legacy': True,
                   'model_max_length': 1048576, 'tokenizer_class': 'PreTrainedTokenizerFast'}, fh, indent=2)
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description='write a tiny random DeepSeek-V4.1 checkpoint')
    ap.add_argument('--out', required=True)
    ap.add_argument('--preset', default='small', choices=sorted(PRESETS))
    ap.add_argument('--seed', type=int, default=1)
    a = ap.parse_args(argv)
    build(a.preset, a.seed, a.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
