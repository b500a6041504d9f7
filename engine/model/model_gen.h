/* ds41_model_gen: random-weight checkpoints of the DeepSeek-V4.1 architecture,
 * written in exactly the Hugging Face release layout (REFERENCE §3), so that
 * everything in ds41 runs and is tested without the 510 GB download.
 *
 * A generated directory holds: >= 2 safetensors shards + the index
 * (model.safetensors.index.json), inference/config.json, a root config.json,
 * tokenizer.json + tokenizer_config.json (synthetic byte-level BPE with the
 * DeepSeek special tokens, or a copy of a given tokenizer).  The content is a
 * pure function of (preset, --set overrides, seed, tokenizer): each tensor is
 * drawn from its own stream seeded by (seed, tensor name).
 *
 * Weights are quantized with the real encoders (engine/model/quant.h): FP8 32x32
 * blocks and FP4 1x32 groups get per-block magnitudes that differ by powers
 * of two, so the ue8m0 scales vary across blocks as in a trained checkpoint.
 * Magnitudes follow fan-in (std ~ 1/sqrt(K)) so activations stay O(1) through
 * every layer.
 *
 * Derived keys are computed, never taken from the preset: vocab_size (the
 * tokenizer's), dspark_noise_token_id (`<｜System｜>`), image_token_id
 * (`<｜deepseek_image｜>`), engram_compressed_vocab_size (the token map of the
 * tokenizer, REFERENCE §6.1) and engram_num_embeddings (the prime layout,
 * §6.2). */
#ifndef DS41_ENGINE_MODEL_GEN_H
#define DS41_ENGINE_MODEL_GEN_H

#include "config/error.h"
#include "config/model_config.h"

#include <stddef.h>
#include <stdint.h>

/* Names of the built-in presets, NULL-terminated: "tiny", "long", "bench",
 * "release-slice". */
extern const char *const ds41_model_presets[];

typedef struct ds41_model_gen_opts {
    const char *preset;           /* NULL = "tiny" */
    uint64_t seed;
    const char *tokenizer;        /* tokenizer.json to copy (tokenizer_config.json beside it too); NULL = synthetic */
    const char *const *sets;      /* "key=value" overrides (value is JSON), applied after the preset */
    size_t n_sets;
    uint64_t shard_bytes;         /* 0 = automatic (at least 2 shards, at most ~2 GiB each) */
    /* Progress lines ("writing tensor 120/612 ..."); NULL = silent. */
    void (*progress)(void *ctx, const char *line);
    void *progress_ctx;
} ds41_model_gen_opts;

/* The config a generation would use, before the tokenizer-derived keys are
 * filled in (preset + overrides, not finalized).  For tools that show it. */
int ds41_model_gen_preset_config(const char *preset, const char *const *sets, size_t n_sets,
                                 ds41_model_config *cfg, ds41_error *err);

/* Write a checkpoint into outdir (created if missing; it must not already
 * hold a checkpoint).  On success, if cfg_out is not NULL it receives the
 * finalized config written (free with ds41_model_config_free).  Errors name
 * the preset key, the override, the file or the tensor at fault. */
int ds41_model_generate(const char *outdir, const ds41_model_gen_opts *opts, ds41_model_config *cfg_out,
                        ds41_error *err);

#endif
