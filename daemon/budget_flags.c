/* Budget flags of ds41-eval and ds41-bench (see budget_flags.h). */
#include "daemon/budget_flags.h"

#include "config/daemon_config.h"
#include "engine/serve/auto_budget.h"

#include <stdio.h>
#include <string.h>

int ds41_budget_flags_option(ds41_budget_flags *f, int opt, const char *arg) {
    uint64_t *bytes;
    bool *set, *is_auto;
    const char *name;
    switch (opt) {
    case DS41_BUDGET_OPT_CONFIG: f->config_path = arg; return 1;
    case DS41_BUDGET_OPT_HOST_EXPERT: {
        ds41_error herr = {{0}};
        if (ds41_size_parse(arg, &f->host_expert_bytes, &herr) != 0) {
            fprintf(stderr, "%s: --host-expert-cache-bytes: %s\n", f->tool, herr.msg);
            return -1;
        }
        f->host_expert_set = true;
        return 1;
    }
    case DS41_BUDGET_OPT_EXPERT:
        bytes = &f->expert_bytes;
        set = &f->expert_set;
        is_auto = &f->expert_auto_flag;
        name = "--expert-cache-bytes";
        break;
    case DS41_BUDGET_OPT_ENGRAM:
        bytes = &f->engram_bytes;
        set = &f->engram_set;
        is_auto = &f->engram_auto_flag;
        name = "--engram-cache-bytes";
        break;
    default: return 0;
    }
    if (arg && strcmp(arg, "auto") == 0) { /* "decide": wins over --config too (the last flag counts) */
        *bytes = 0;
        *set = false;
        *is_auto = true;
        return 1;
    }
    ds41_error serr = {{0}};
    if (ds41_size_parse(arg, bytes, &serr) != 0) {
        fprintf(stderr, "%s: %s: %s\n", f->tool, name, serr.msg);
        return -1;
    }
    *set = true;
    *is_auto = false;
    return 1;
}

int ds41_budget_flags_apply(const ds41_budget_flags *f, const char *model_dir, const ds41_budget_run *run,
                            ds41_engine_opts *eo, char *line, size_t line_size) {
    if (line && line_size) line[0] = 0;
    ds41_error err = {{0}};
    bool expert_auto = !f->expert_set, engram_auto = !f->engram_set;
    uint64_t expert = f->expert_bytes, engram = f->engram_bytes, host_expert = f->host_expert_bytes;
    /* --config: memory.expert_cache_bytes / engram_cache_bytes ("auto" and 0 read as 0 =
     * auto) under the flags; a flag given as "auto" stays auto. */
    if (f->config_path) {
        ds41_daemon_config dc;
        if (ds41_daemon_config_load(f->config_path, &dc, &err) != 0) {
            fprintf(stderr, "%s: --config: %s\n", f->tool, err.msg);
            return 2;
        }
        if (expert_auto && !f->expert_auto_flag && dc.memory.expert_cache_bytes) {
            expert = dc.memory.expert_cache_bytes;
            expert_auto = false;
        }
        if (engram_auto && !f->engram_auto_flag && dc.memory.engram_cache_bytes) {
            engram = dc.memory.engram_cache_bytes;
            engram_auto = false;
        }
        if (!f->host_expert_set) host_expert = dc.memory.host_expert_cache_bytes;
        ds41_daemon_config_free(&dc);
    }
    eo->expert_cache_bytes = expert;
    eo->engram_cache_bytes = engram;
    eo->host_expert_cache_bytes = host_expert;
    if (!expert_auto && !engram_auto) return 0;
    ds41_auto_budget_opts ao = {.dir = model_dir,
                                .expert_auto = expert_auto,
                                .engram_auto = engram_auto,
                                .expert_bytes = expert,
                                .engram_bytes = engram,
                                .kv_tokens = run && run->kv_tokens ? run->kv_tokens : 1,
                                .batch = run ? run->batch : 1};
    ds41_mem_info mem;
    if (ds41_mem_read(NULL, &mem, &err) != 0) {
        fprintf(stderr, "%s: warning: cannot size the budgets automatically (%s): tiers resident\n", f->tool,
                err.msg);
        return 0;
    }
    ao.mem = &mem;
    ds41_budget_plan plan;
    char buf[512];
    if (ds41_auto_budget(&ao, &plan, NULL, buf, sizeof buf, &err) != 0) {
        if (strncmp(err.msg, "budgets:", 8) == 0) { /* the decision itself: not enough memory */
            fprintf(stderr, "%s: %s\n", f->tool, err.msg);
            return 2;
        }
        /* The checkpoint's config unreadable: ds41_engine_load reports it in its own words. */
        return 0;
    }
    eo->expert_cache_bytes = plan.expert_bytes;
    eo->engram_cache_bytes = plan.engram_bytes;
    if ((expert_auto && plan.experts_streamed) || (engram_auto && plan.engram_streamed))
        fprintf(stderr, "%s: %s\n", f->tool, buf);
    if (line && line_size) snprintf(line, line_size, "%s", buf);
    return 0;
}
