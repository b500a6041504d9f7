/* ds41 automatic memory budgets: what stays resident and what is streamed
 * when `memory.expert_cache_bytes` / `memory.engram_cache_bytes` are "auto".
 *
 * The released checkpoint is ~510 GB (289 GB routed experts, 203 GB Engram
 * tables, ~18 GB of everything else); a workstation has 24-128 GB.  With
 * "auto" the daemon (and ds41-eval / ds41-bench when their budget flags are
 * absent or "auto") decide from the memory the process may use.
 *
 * Three parts, each usable alone:
 *   1. ds41_mem_read: the memory the process may use (MemAvailable, capped by
 *      the cgroup v2 limits of the process; a test hook can force a value).
 *   2. ds41_model_footprint_*: the model's bytes by class (dense, routed
 *      experts, Engram tables) and the size of one expert slot, from the
 *      config's tensor plan (engine/model/tensor_plan.h, which the engine checks the
 *      checkpoint against at load, so the figures are the checkpoint's).
 *   3. ds41_budget_decide: the policy, a pure function of its inputs.
 *
 * Policy (ds41_budget_decide):
 *   headroom = max(available / 10, min(1 GiB, available / 8)): 10% of the
 *              memory, at least 1 GiB on machines with 8 GiB or more, an
 *              eighth on smaller ones (the tiny test models run in a few MiB);
 *   usable   = available - headroom;
 *   fixed    = dense + KV budget (+ an explicit budget's bytes, see below).
 *   a. If fixed + every routed expert + every Engram table fit in `usable`:
 *      everything resident (used in place from the checkpoint's mapping).
 *   b. Else the Engram tables are streamed first (a step touches n_cols rows
 *      per token and layer, so a small row cache suffices): row cache =
 *      min(1 GiB, available / 20), at least 4 KiB.  (When that would hold the
 *      whole tables anyway, they stay resident.)  If the experts then fit,
 *      they stay resident.
 *   c. Else the routed experts are streamed with what is left:
 *      expert budget = usable - fixed - Engram row cache, which must hold the
 *      slots one layer needs at the configured decode batch,
 *      min(n_routed, batch x n_activated) x slot bytes; if it does not, the
 *      decision fails with a message naming every size.
 *   An explicit budget (a byte value in the YAML or a flag) wins over auto
 *   and is never changed; its bytes (min(budget, the tier's total); 0 = the
 *   whole tier resident) count as fixed when the other budget is decided.
 *
 * Thread safety: every function is reentrant (no global state; ds41_mem_read
 * reads the environment). */
#ifndef DS41_ENGINE_AUTO_BUDGET_H
#define DS41_ENGINE_AUTO_BUDGET_H

#include "config/error.h"
#include "config/model_config.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- 1. memory the process may use ------------------------------------------------ */

/* Test hook: when this environment variable holds a size (as ds41_size_parse
 * reads it: "64MiB", "1000000"), ds41_mem_read(NULL, ...) reports it as the
 * available memory instead of reading /proc and /sys (so tests can make a
 * tiny model "not fit").  Never set it in production. */
#define DS41_TEST_MEM_AVAILABLE_ENV "DS41_TEST_MEM_AVAILABLE"

typedef struct ds41_mem_info {
    uint64_t mem_available; /* MemAvailable of /proc/meminfo, bytes */
    /* The smallest (memory.max - (memory.current - the "file" bytes of
     * memory.stat, page cache the kernel reclaims under the limit)) over the
     * process's cgroup v2 and its ancestors that have a limit; UINT64_MAX when
     * none has one (or there is no cgroup v2). */
    uint64_t cgroup_free;
    char cgroup_dir[256];   /* the cgroup directory whose limit binds ("" if none) */
    uint64_t available;     /* min(mem_available, cgroup_free), or the test hook's value */
    bool test_override;     /* `available` came from DS41_TEST_MEM_AVAILABLE */
} ds41_mem_info;

/* The MemAvailable line of a /proc/meminfo text (NUL-terminated), in bytes.
 * Errors: no such line, a malformed or overflowing number. */
int ds41_mem_parse_meminfo(const char *text, uint64_t *bytes, ds41_error *err);

/* The cgroup v2 path ("0::/user.slice/x.scope" -> "/user.slice/x.scope") of
 * a /proc/self/cgroup text into path[size].  Returns 1 when found, 0 when the
 * text has no v2 line (a v1-only system), -1 when the path is too long or
 * does not start with '/'. */
int ds41_mem_parse_proc_cgroup(const char *text, char *path, size_t size, ds41_error *err);

/* Read the process's memory figures.  root NULL: the real system (/proc,
 * /sys/fs/cgroup), with the DS41_TEST_MEM_AVAILABLE hook honoured; else a
 * directory standing in for "/" (tests build fake proc/meminfo,
 * proc/self/cgroup and sys/fs/cgroup/<path>/memory.{max,current,stat} under it;
 * the hook is ignored).  A missing or unreadable cgroup file means no limit
 * from it.  Errors: /proc/meminfo unreadable or without MemAvailable, the
 * hook's value malformed (names the variable). */
int ds41_mem_read(const char *root, ds41_mem_info *out, ds41_error *err);

/* ---- 2. the model's footprint -------------------------------------------------------- */

typedef struct ds41_model_footprint {
    uint64_t total_bytes;   /* every planned tensor */
    uint64_t expert_bytes;  /* routed experts of the text layers (what the expert tier streams) */
    uint64_t engram_bytes;  /* Engram tables + their scales (what the Engram tier streams) */
    uint64_t dense_bytes;   /* everything else (embed, head, attention, shared experts, DSpark, ...) */
    uint64_t expert_slot_bytes; /* one expert slot: its largest expert's w1/w2/w3 + scales, aligned */
    uint32_t n_routed_experts, n_activated_experts;
    double kv_bytes_per_token; /* compressed-cache bytes per token of context */
    uint64_t session_bytes;    /* fixed per-sequence state (window rings, carries, Engram history) */
} ds41_model_footprint;

/* Footprint of a finalized config.  Errors: the plan cannot be built. */
int ds41_model_footprint_of(const ds41_model_config *cfg, ds41_model_footprint *out, ds41_error *err);

/* Footprint of the checkpoint directory DIR: inference/config.json, and the
 * shard headers for the exact slot size (as the tier lays its slots out); a
 * directory without weights (no index, no model.safetensors) keeps the
 * plan's slot size.  Errors: the config's, prefixed by nothing (they name the
 * file), a checkpoint that does not open. */
int ds41_model_footprint_load(const char *dir, ds41_model_footprint *out, ds41_error *err);

/* Bytes of the expert slots one layer needs with `batch` sequences decoding
 * together: min(n_routed, batch x n_activated) x slot bytes (batch 0 = 1). */
uint64_t ds41_model_footprint_layer_min(const ds41_model_footprint *fp, uint32_t batch);

/* ---- 3. the decision ------------------------------------------------------------------ */

typedef struct ds41_budget_request {
    uint64_t available;       /* ds41_mem_info.available */
    uint64_t dense_bytes;     /* resident whatever happens */
    uint64_t kv_bytes;        /* the KV cache budget */
    uint64_t expert_total;    /* all routed experts */
    uint64_t engram_total;    /* all Engram tables */
    uint64_t expert_layer_min; /* ds41_model_footprint_layer_min at the configured batch */
    bool expert_auto;         /* decide the expert budget; else expert_bytes is explicit */
    bool engram_auto;         /* decide the Engram budget; else engram_bytes is explicit */
    uint64_t expert_bytes;    /* explicit engine value (0 = resident), used when !expert_auto */
    uint64_t engram_bytes;    /* explicit engine value (0 = resident), used when !engram_auto */
} ds41_budget_request;

typedef struct ds41_budget_plan {
    uint64_t headroom, usable;  /* see the policy */
    /* The engine options (ds41_engine_opts): 0 = resident, else the budget. */
    uint64_t expert_bytes, engram_bytes;
    bool experts_streamed, engram_streamed;
} ds41_budget_plan;

/* Apply the policy.  Explicit budgets are copied unchanged.  Errors (plan
 * zeroed): the auto expert budget below one layer's slots, or dense + KV (+
 * the Engram row cache) over the usable memory; the message names available,
 * headroom, dense, KV, Engram, the experts' total and the minimum. */
int ds41_budget_decide(const ds41_budget_request *req, ds41_budget_plan *plan, ds41_error *err);

/* One line describing a decision and its inputs, for logs, `ds41ctl cache`
 * and `ds41ctl doctor`:
 * "budgets: auto -> experts 3.1 MiB streamed with 1.2 MiB budget, Engram
 *  2.0 MiB resident (available 16.0 MiB, headroom 2.0 MiB, dense 1.5 MiB,
 *  KV 4.0 MiB)"; an explicit budget is marked "(explicit)". */
void ds41_budget_describe(const ds41_budget_request *req, const ds41_budget_plan *plan, char *buf, size_t size);

/* Human size with a binary unit, one decimal ("1.5 GiB", "512 B"). */
void ds41_budget_format_size(uint64_t bytes, char *buf, size_t size);

/* ---- the whole thing for a checkpoint ----------------------------------------------- */

typedef struct ds41_auto_budget_opts {
    const char *dir;          /* checkpoint directory */
    bool expert_auto, engram_auto;
    uint64_t expert_bytes, engram_bytes; /* explicit values when not auto */
    /* KV budget.  0 with kv_tokens 0: the daemon's automatic size, a quarter of
     * the available memory.  0 with kv_tokens > 0 (the offline tools, which
     * know their prompt): batch x (session state + the compressed cache of
     * kv_tokens tokens). */
    uint64_t kv_bytes;
    uint64_t kv_tokens;
    uint32_t batch;           /* sequences decoded together (0 = 1) */
    const ds41_mem_info *mem; /* NULL = ds41_mem_read(NULL, ...) */
} ds41_auto_budget_opts;

/* Read the footprint of o->dir and the memory (unless given), decide, and
 * write the description line into line[line_size] (may be NULL/0).  *req_out
 * (may be NULL) gets the request used.  Errors: those of the parts. */
int ds41_auto_budget(const ds41_auto_budget_opts *o, ds41_budget_plan *plan, ds41_budget_request *req_out,
                     char *line, size_t line_size, ds41_error *err);

#endif
