/* The memory-budget flags shared by ds41-eval and ds41-bench:
 *   --expert-cache-bytes SIZE|auto   routed-expert slot pool (0: every expert resident)
 *   --engram-cache-bytes SIZE|auto   Engram row cache (0: the tables resident)
 *   --host-expert-cache-bytes SIZE   with a GPU backend, the expert cache's host tier
 *                                    (memory.host_expert_cache_bytes; 0: none)
 *   --config FILE                    memory.expert_cache_bytes / engram_cache_bytes of a
 *                                    ds41d YAML (the flags win)
 * A flag that is absent (and not set by --config), "auto", or a YAML "auto"/0
 * is decided by engine/serve/auto_budget.h from the memory the process may use;
 * an explicit size is used as given.
 *
 * Usage: put DS41_BUDGET_LONGOPTS in the getopt_long table, pass every
 * option to ds41_budget_flags_option first, then call ds41_budget_flags_apply
 * before ds41_engine_load.  Messages go to stderr prefixed with the tool's
 * name ("ds41-eval: --expert-cache-bytes: ..."). */
#ifndef DS41_DAEMON_BUDGET_FLAGS_H
#define DS41_DAEMON_BUDGET_FLAGS_H

#include "engine/forward/forward.h"

#include <getopt.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* getopt_long values of the three options (outside the ASCII letters the tools use). */
#define DS41_BUDGET_OPT_EXPERT 0x1001
#define DS41_BUDGET_OPT_ENGRAM 0x1002
#define DS41_BUDGET_OPT_CONFIG 0x1003
#define DS41_BUDGET_OPT_HOST_EXPERT 0x1004

#define DS41_BUDGET_LONGOPTS                                                       \
    {"expert-cache-bytes", required_argument, NULL, DS41_BUDGET_OPT_EXPERT},        \
        {"engram-cache-bytes", required_argument, NULL, DS41_BUDGET_OPT_ENGRAM},    \
        {"config", required_argument, NULL, DS41_BUDGET_OPT_CONFIG},               \
        {"host-expert-cache-bytes", required_argument, NULL, DS41_BUDGET_OPT_HOST_EXPERT}

typedef struct ds41_budget_flags {
    const char *tool;        /* program name for messages, e.g. "ds41-eval" */
    const char *config_path; /* --config, or NULL */
    bool expert_set, engram_set;   /* the flag was given with a size */
    bool expert_auto_flag, engram_auto_flag; /* the flag was given as "auto" (wins over --config) */
    uint64_t expert_bytes, engram_bytes;
    bool host_expert_set;       /* --host-expert-cache-bytes given (wins over --config) */
    uint64_t host_expert_bytes;
} ds41_budget_flags;

/* Handle one getopt_long result.  Returns 1 when opt was a budget option
 * (consumed), 0 when it is not one, -1 when its value is malformed (the
 * message is printed: "<tool>: --engram-cache-bytes: <why>"; exit with 2). */
int ds41_budget_flags_option(ds41_budget_flags *f, int opt, const char *arg);

/* What the tool's sizing needs to know about its run. */
typedef struct ds41_budget_run {
    uint64_t kv_tokens; /* context tokens per sequence (prompt + decode) */
    uint32_t batch;     /* sequences decoded together (0 = 1) */
} ds41_budget_run;

/* Resolve the budgets into eo->expert_cache_bytes / engram_cache_bytes (and
 * eo->host_expert_cache_bytes: the flag, else --config's, never auto):
 * --config's values under the flags, then auto sizing for what is still
 * auto (engine/serve/auto_budget.h).  When the auto sizing streams a tier, the
 * decision line ("budgets: auto -> ...") is printed to stderr.  line (may be
 * NULL) gets the decision line ("" when nothing was auto).  When the memory
 * cannot be read, a warning is printed and the tiers stay resident; when the
 * checkpoint's config cannot be, nothing is printed and the tiers stay
 * resident (ds41_engine_load then reports the bad checkpoint in its own
 * words).  Returns 0, or 2
 * after printing the error ("<tool>: --config: ...", "<tool>: budgets: ..."),
 * the tools' exit status for bad arguments/checkpoints. */
int ds41_budget_flags_apply(const ds41_budget_flags *f, const char *model_dir, const ds41_budget_run *run,
                            ds41_engine_opts *eo, char *line, size_t line_size);

#endif
