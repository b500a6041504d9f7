/* The tensor plan of the released config must reproduce the published
 * inventory of the real checkpoint (REFERENCE §0, §3): 96,085 tensors,
 * 510,286,023,000 payload bytes, BF16 520 / F32 387 / F8_E4M3 357 /
 * F8_E8M0 47,589 / I8 47,232, and the shapes §3 lists. */
#include "config/model_config.h"
#include "engine/model/tensor_plan.h"
#include "tests/tap.h"

#include <string.h>

static int has(const ds41_tensor_plan *p, const char *name, ds41_dtype dt, int64_t d0, int64_t d1) {
    const ds41_planned_tensor *t = ds41_tensor_plan_find(p, name);
    if (!t || t->dtype != dt || t->shape[0] != d0) return 0;
    return d1 < 0 ? t->ndim == 1 : (t->ndim == 2 && t->shape[1] == d1);
}

int main(void) {
    ds41_model_config cfg;
    ds41_error err;
    if (!TAP_CHECK(ds41_model_config_load("tests/data/config/release", &cfg, &err) == 0, "released config loads"))
        TAP_NOTE("%s", err.msg);
    ds41_tensor_plan plan;
    if (!TAP_CHECK(ds41_tensor_plan_build(&cfg, &plan, &err) == 0, "plan builds")) {
        TAP_NOTE("%s", err.msg);
        return tap_done();
    }
    uint64_t total = 0, count[DS41_DTYPE_COUNT] = {0};
    for (size_t i = 0; i < plan.n; i++) {
        total += plan.t[i].nbytes;
        count[plan.t[i].dtype]++;
    }
    TAP_CHECK(plan.n == 96085, "96,085 tensors (got %zu)", plan.n);
    TAP_CHECK(total == 510286023000ull, "510,286,023,000 payload bytes (got %llu)", (unsigned long long)total);
    TAP_CHECK(count[DS41_BF16] == 520 && count[DS41_F32] == 387 && count[DS41_F8_E4M3] == 357 &&
                  count[DS41_F8_E8M0] == 47589 && count[DS41_I8] == 47232,
              "per-dtype counts BF16 %llu F32 %llu E4M3 %llu E8M0 %llu I8 %llu", (unsigned long long)count[DS41_BF16],
              (unsigned long long)count[DS41_F32], (unsigned long long)count[DS41_F8_E4M3],
              (unsigned long long)count[DS41_F8_E8M0], (unsigned long long)count[DS41_I8]);

    int shapes = has(&plan, "embed.weight", DS41_BF16, 129280, 5120) &&
                 has(&plan, "layers.0.attn.wq_a.scale", DS41_F8_E8M0, 40, 160) &&
                 has(&plan, "layers.0.attn.wq_b.weight", DS41_F8_E4M3, 32768, 1280) &&
                 has(&plan, "layers.0.attn.wo_a.weight", DS41_F8_E4M3, 8192, 4096) &&
                 has(&plan, "layers.0.attn.wo_b.scale", DS41_F8_E8M0, 160, 256) &&
                 has(&plan, "layers.0.hc_attn_fn", DS41_F32, 24, 20480) &&
                 has(&plan, "layers.0.ffn.experts.383.w2.weight", DS41_I8, 5120, 1152) &&
                 has(&plan, "layers.0.ffn.experts.383.w2.scale", DS41_F8_E8M0, 5120, 72) &&
                 has(&plan, "layers.39.ffn.shared_experts.w1.scale", DS41_F8_E8M0, 72, 160) &&
                 has(&plan, "layers.2.attn.compressor.wgate.weight", DS41_BF16, 512, 5120) &&
                 !ds41_tensor_plan_find(&plan, "layers.20.attn.compressor.wgate.weight") &&
                 has(&plan, "layers.20.attn.compressor.wkv.weight", DS41_BF16, 512, 5120) &&
                 has(&plan, "layers.24.attn.indexer.wq_b.scale", DS41_F8_E8M0, 128, 40) &&
                 !ds41_tensor_plan_find(&plan, "layers.24.attn.indexer.wk.weight") &&
                 has(&plan, "layers.1.engram.embed.weight", DS41_F8_E4M3, 384006168, 256) &&
                 has(&plan, "layers.14.engram.embed.scale", DS41_F8_E8M0, 384016682, 8) &&
                 has(&plan, "layers.14.engram.wkv.scale", DS41_F8_E8M0, 800, 192) &&
                 has(&plan, "mtp.0.main_proj.weight", DS41_F8_E4M3, 5120, 15360) &&
                 has(&plan, "mtp.2.ffn.experts.127.w1.weight", DS41_I8, 2304, 2560) &&
                 !ds41_tensor_plan_find(&plan, "mtp.2.ffn.experts.128.w1.weight") &&
                 has(&plan, "mtp.2.confidence_head.proj.weight", DS41_BF16, 1, 5376) &&
                 has(&plan, "mtp.2.markov_head.head.weight", DS41_BF16, 129280, 256) &&
                 has(&plan, "vision.blocks.31.mlp.w1.weight", DS41_BF16, 5632, 1024) &&
                 has(&plan, "vision.patch_embed.proj.weight", DS41_BF16, 1024, 588) &&
                 has(&plan, "aligner.w1.weight", DS41_BF16, 5120, 9216);
    TAP_CHECK(shapes, "names, dtypes and shapes of REFERENCE §3");

    ds41_check_counts cc = ds41_tensor_plan_check(&plan, NULL, NULL, NULL);
    TAP_CHECK(cc.missing == plan.n && cc.unexpected == 0, "with no weights every tensor is missing");

    uint64_t kind_bytes[DS41_KIND_COUNT] = {0};
    for (size_t i = 0; i < plan.n; i++) kind_bytes[plan.t[i].kind] += plan.t[i].nbytes;
    /* 40 layers x 384 experts + 3 x 128, each w1/w2/w3 payload + scales. */
    uint64_t expert = 3ull * (2304ull * 2560 + 2304ull * 160);
    TAP_CHECK(kind_bytes[DS41_KIND_ROUTED_EXPERTS] == 40ull * 384 * expert,
              "routed experts %llu bytes (~289 GB)", (unsigned long long)kind_bytes[DS41_KIND_ROUTED_EXPERTS]);
    TAP_CHECK(kind_bytes[DS41_KIND_ENGRAM_TABLES] == (384006168ull + 384016682ull) * 264,
              "engram tables %llu bytes (~203 GB)", (unsigned long long)kind_bytes[DS41_KIND_ENGRAM_TABLES]);
    ds41_tensor_plan_free(&plan);
    ds41_model_config_free(&cfg);
    return tap_done();
}
