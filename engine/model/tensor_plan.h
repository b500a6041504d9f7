/* ds41_tensor_plan: every tensor a model config requires, by name, dtype and
 * shape, exactly as the Hugging Face release lays them out (REFERENCE §3).
 *
 * One list serves three users: the checkpoint check (ds41-inspect compares a
 * directory against it), the random-checkpoint generator (ds41-mkmodel writes
 * exactly these tensors) and the weight binder (the engine looks them up).
 * For the released config it reproduces the published inventory: 96,085
 * tensors, 510,286,023,000 payload bytes, and the per-dtype counts.
 *
 * Shapes are functions of the config only: FP8 weights [N,K] E4M3 with a
 * [ceil(N/32), ceil(K/32)] E8M0 `.scale`; FP4 routed experts [N,K/2] I8 with
 * a [N,K/32] E8M0 `.scale`; Engram tables [rows, engram_head_dim] E4M3 with a
 * [rows, engram_head_dim/32] E8M0 `.scale`. */
#ifndef DS41_ENGINE_TENSOR_PLAN_H
#define DS41_ENGINE_TENSOR_PLAN_H

#include "config/error.h"
#include "config/model_config.h"
#include "storage/safetensors.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What a tensor belongs to, for inventories (bytes per module kind). */
typedef enum ds41_tensor_kind {
    DS41_KIND_EMBED_HEAD = 0,  /* embed, head, final norm */
    DS41_KIND_ATTENTION,       /* attn.* incl. compressor and indexer, attn_norm */
    DS41_KIND_HYPER_CONN,      /* hc_attn_*, hc_ffn_* */
    DS41_KIND_ROUTER,          /* ffn.gate.*, ffn_norm */
    DS41_KIND_ROUTED_EXPERTS,  /* ffn.experts.* */
    DS41_KIND_SHARED_EXPERTS,  /* ffn.shared_experts.* */
    DS41_KIND_ENGRAM_TABLES,   /* engram.embed.* (the ~94 GiB hash tables) */
    DS41_KIND_ENGRAM_OTHER,    /* engram.wkv, q_weight, k_weight */
    DS41_KIND_DSPARK,          /* everything under mtp.* */
    DS41_KIND_VISION,          /* vision.*, aligner.*, image_* */
    DS41_KIND_COUNT
} ds41_tensor_kind;

#define DS41_PLAN_NAME_MAX 96

typedef struct ds41_planned_tensor {
    char name[DS41_PLAN_NAME_MAX];
    ds41_dtype dtype;
    int ndim;
    int64_t shape[2];
    uint64_t nbytes;
    ds41_tensor_kind kind;
    int layer;   /* layer id (backbone 0..n_layers-1, DSpark n_layers+k), -1 for globals */
    int expert;  /* routed expert index, -1 otherwise */
} ds41_planned_tensor;

typedef struct ds41_tensor_plan {
    ds41_planned_tensor *t;
    size_t n;
    size_t cap;
} ds41_tensor_plan;

/* Build the plan of a finalized config, in a stable order (globals, then each
 * layer's tensors, DSpark stages, vision).  Errors: allocation failure, an
 * unfinalized config, a shape overflowing int64. */
int ds41_tensor_plan_build(const ds41_model_config *cfg, ds41_tensor_plan *plan, ds41_error *err);
void ds41_tensor_plan_free(ds41_tensor_plan *plan);

/* The planned tensor with this name, or NULL (linear search; the binder and
 * checker build their own hash lookups through the checkpoint). */
const ds41_planned_tensor *ds41_tensor_plan_find(const ds41_tensor_plan *plan, const char *name);

const char *ds41_tensor_kind_name(ds41_tensor_kind kind);

/* One finding of a checkpoint check. */
typedef enum ds41_check_problem {
    DS41_CHECK_MISSING = 0,  /* planned, not in the checkpoint */
    DS41_CHECK_UNEXPECTED,   /* in the checkpoint, not planned */
    DS41_CHECK_WRONG_DTYPE,
    DS41_CHECK_WRONG_SHAPE,
} ds41_check_problem;

typedef void (*ds41_check_report_fn)(void *ctx, ds41_check_problem problem, const char *name,
                                     const ds41_planned_tensor *planned, const ds41_tensor *found);

typedef struct ds41_check_counts {
    size_t missing, unexpected, wrong_dtype, wrong_shape;
} ds41_check_counts;

/* Compare a checkpoint (NULL = no weights at all: everything is missing)
 * against the plan.  Calls report (may be NULL) once per problem, in plan
 * order then checkpoint order, and returns the counts. */
ds41_check_counts ds41_tensor_plan_check(const ds41_tensor_plan *plan, const ds41_checkpoint *ckpt,
                                         ds41_check_report_fn report, void *ctx);

#endif
