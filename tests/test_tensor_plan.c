/* The tensor plan of the released config must reproduce the published
 * inventory of the real checkpoint (REFERENCE §0, §3): 96,085 tensors,
 * 510,286,023,000 payload bytes, BF16 520 / F32 387 / F8_E4M3 357 /
 * F8_E8M0 47,589 / I8 47,232, and the shapes §3 lists. */
#include "config/model_config.h"
#include "engine/model/model_gen.h"
#include "engine/model/tensor_plan.h"
#include "tests/tap.h"

#include <stdio.h>
#include <string.h>

static int has(const ds41_tensor_plan *p, const char *name, ds41_dtype dt, int64_t d0, int64_t d1) {
    const ds41_planned_tensor *t = ds41_tensor_plan_find(p, name);
    if (!t || t->dtype != dt || t->shape[0] != d0) return 0;
    return d1 < 0 ? t->ndim == 1 : (t->ndim == 2 && t->shape[1] == d1);
}

/* ds41-mkmodel --preset release-slice (its config and plan only: the
 * checkpoint is ~33 GB): the released layer dimensions, and each of its four
 * layers is, tensor for tensor, the released layer of the same role. */
static void release_slice(const ds41_model_config *rel, const ds41_tensor_plan *rel_plan) {
    ds41_model_config c;
    ds41_error err;
    if (!TAP_CHECK(ds41_model_gen_preset_config("release-slice", NULL, 0, &c, &err) == 0 &&
                       ds41_model_config_finalize(&c, &err) == 0,
                   "release-slice: the preset's config finalizes")) {
        TAP_NOTE("%s", err.msg);
        return;
    }
#define SAME(f) (c.f == rel->f)
    TAP_CHECK(SAME(vocab_size) && SAME(dim) && SAME(moe_inter_dim) && SAME(n_heads) && SAME(head_dim) &&
                  SAME(rope_head_dim) && SAME(q_lora_rank) && SAME(o_groups) && SAME(o_lora_rank) &&
                  SAME(n_routed_experts) && SAME(n_activated_experts) && SAME(n_shared_experts) &&
                  SAME(score_func) && SAME(route_scale) && SAME(swiglu_limit) && SAME(norm_eps) &&
                  SAME(window_size) && SAME(original_seq_len) && SAME(rope_theta) && SAME(rope_factor) &&
                  SAME(beta_fast) && SAME(beta_slow) && SAME(compress_rope_theta) && SAME(index_n_heads) &&
                  SAME(index_head_dim) && SAME(index_topk) && SAME(candidate_topk_blocks) &&
                  SAME(candidate_block_size) && SAME(hc_mult) && SAME(hc_sinkhorn_iters) && SAME(hc_eps) &&
                  SAME(engram_max_ngram_size) && SAME(engram_n_heads) && SAME(engram_head_dim) &&
                  SAME(engram_pad_id) && SAME(dtype) && SAME(expert_dtype),
              "release-slice: every dimension and value of REFERENCE §0.1 but the layer lists");
#undef SAME
    TAP_CHECK(c.n_layers == 4 && c.engram_vocab_size < rel->engram_vocab_size && !c.dspark_enabled,
              "release-slice: 4 layers, Engram vocabulary scaled down (%lld), DSpark off",
              (long long)c.engram_vocab_size);
    /* The released layer each slice layer stands for: same ratio and role. */
    static const int like[4] = {2, 20, 24, 25};
    const ds41_layer_role *r = c.roles;
    TAP_CHECK(r[0].ratio == 2 && r[0].kv_source && r[0].index_source && r[0].has_wgate &&
                  !r[0].candidate_source && r[1].ratio == 1 && r[1].kv_source && r[1].index_source &&
                  r[1].candidate_source && !r[1].has_wgate && r[2].ratio == 1 && !r[2].kv_source &&
                  r[2].kv_from == 1 && r[2].index_source && r[2].candidate_user &&
                  r[2].index_keys_from == 1 && r[3].ratio == 1 && !r[3].kv_source && !r[3].index_source &&
                  r[3].kv_from == 1 && r[3].index_from == 2,
              "release-slice: roles ratio-2 source, ratio-1 candidate source, candidate user, consumer");
    for (int l = 0; l < 4; l++) {
        const ds41_layer_role *a = &r[l], *b = &rel->roles[like[l]];
        TAP_CHECK(a->ratio == b->ratio && a->kv_source == b->kv_source &&
                      a->index_source == b->index_source && a->candidate_source == b->candidate_source &&
                      a->candidate_user == b->candidate_user && a->has_wgate == b->has_wgate &&
                      a->rope_theta == b->rope_theta && a->yarn == b->yarn && a->n_experts == b->n_experts &&
                      a->n_active_experts == b->n_active_experts,
                  "release-slice: layer %d has the role of released layer %d", l, like[l]);
    }
    TAP_CHECK(r[1].engram_slot == 0 && r[3].engram_slot == 1 && r[0].engram_slot < 0 && r[2].engram_slot < 0,
              "release-slice: Engram before blocks 1 and 3");

    ds41_tensor_plan plan;
    if (!TAP_CHECK(ds41_tensor_plan_build(&c, &plan, &err) == 0, "release-slice: plan builds")) {
        TAP_NOTE("%s", err.msg);
        ds41_model_config_free(&c);
        return;
    }
    /* Every tensor of slice layer l is the released layer like[l]'s tensor
     * of the same name (its Engram module aside: it has other row counts),
     * and the released layer has no tensor the slice lacks. */
    size_t mismatched = 0, matched[4] = {0}, released[4] = {0};
    uint64_t total = 0, expert_bytes[4] = {0};
    for (size_t i = 0; i < plan.n; i++) {
        const ds41_planned_tensor *t = &plan.t[i];
        total += t->nbytes;
        if (t->layer < 0 || t->layer >= 4 || t->kind == DS41_KIND_ENGRAM_TABLES ||
            strstr(t->name, ".engram."))
            continue;
        if (t->kind == DS41_KIND_ROUTED_EXPERTS) expert_bytes[t->layer] += t->nbytes;
        const char *rest = strchr(t->name + strlen("layers."), '.');
        char name[DS41_PLAN_NAME_MAX + 16];
        snprintf(name, sizeof name, "layers.%d%s", like[t->layer], rest ? rest : "");
        const ds41_planned_tensor *u = ds41_tensor_plan_find(rel_plan, name);
        if (u && u->dtype == t->dtype && u->ndim == t->ndim && u->shape[0] == t->shape[0] &&
            (t->ndim == 1 || u->shape[1] == t->shape[1]))
            matched[t->layer]++;
        else if (mismatched++ < 3)
            TAP_NOTE("release-slice: %s has no released twin %s", t->name, name);
    }
    for (size_t i = 0; i < rel_plan->n; i++)
        for (int l = 0; l < 4; l++)
            if (rel_plan->t[i].layer == like[l] && rel_plan->t[i].kind != DS41_KIND_ENGRAM_TABLES &&
                !strstr(rel_plan->t[i].name, ".engram."))
                released[l]++;
    TAP_CHECK(mismatched == 0 && matched[0] == released[0] && matched[1] == released[1] &&
                  matched[2] == released[2] && matched[3] == released[3],
              "release-slice: tensor for tensor the released layers 2, 20, 24, 25 (%zu/%zu %zu/%zu %zu/%zu "
              "%zu/%zu)",
              matched[0], released[0], matched[1], released[1], matched[2], released[2], matched[3],
              released[3]);
    const uint64_t expert = 3ull * (2304ull * 2560 + 2304ull * 160);
    TAP_CHECK(expert_bytes[0] == 384 * expert && expert_bytes[3] == 384 * expert,
              "release-slice: 384 routed experts of 2304 per layer, %.2f GB each layer",
              expert_bytes[0] / 1e9);
    TAP_CHECK(total > 30e9 && total < 36e9, "release-slice: %.1f GB payload (the size the man page states)",
              total / 1e9);
    ds41_tensor_plan_free(&plan);
    ds41_model_config_free(&c);
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
    release_slice(&cfg, &plan);
    ds41_tensor_plan_free(&plan);
    ds41_model_config_free(&cfg);
    return tap_done();
}
