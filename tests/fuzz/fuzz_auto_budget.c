/* Automatic budgets (engine/serve/auto_budget.h) on arbitrary inputs.  Byte 0 selects:
 *   0: the rest as a /proc/meminfo text;
 *   1: the rest as a /proc/self/cgroup text (into a 64-byte path buffer);
 *   else: a budget request from the next 8 little-endian uint64 fields (available, dense, KV,
 *         experts, Engram, layer minimum, explicit expert and Engram bytes) and byte 0's bits
 *         for the two auto flags.
 * Checks, trapping on violation: parsers never read past the text and return their documented
 * codes; a decision keeps headroom + usable = available, copies explicit budgets unchanged,
 * streams a tier only below its total, gives auto experts at least the layer minimum, and its
 * description is NUL-terminated within the buffer. */
#include "engine/serve/auto_budget.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                          \
    do {                                                                                                     \
        if (!(cond)) __builtin_trap();                                                                       \
    } while (0)

static uint64_t u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const uint8_t sel = data[0];
    if (sel == 0 || sel == 1) {
        char *text = malloc(size); /* size - 1 bytes + NUL */
        if (!text) return 0;
        memcpy(text, data + 1, size - 1);
        text[size - 1] = 0;
        ds41_error err;
        if (sel == 0) {
            uint64_t b = 0;
            int rc = ds41_mem_parse_meminfo(text, &b, &err);
            CHECK(rc == 0 || rc == -1);
            if (rc == 0) CHECK(b % 1024 == 0 && strstr(text, "MemAvailable:"));
        } else {
            char path[64];
            int rc = ds41_mem_parse_proc_cgroup(text, path, sizeof path, &err);
            CHECK(rc >= -1 && rc <= 1);
            if (rc == 1) CHECK(path[0] == '/' && strlen(path) < sizeof path && strstr(text, path));
        }
        free(text);
        return 0;
    }
    if (size < 1 + 8 * 8) return 0;
    const uint8_t *p = data + 1;
    ds41_budget_request r = {.available = u64(p),
                             .dense_bytes = u64(p + 8),
                             .kv_bytes = u64(p + 16),
                             .expert_total = u64(p + 24),
                             .engram_total = u64(p + 32),
                             .expert_layer_min = u64(p + 40),
                             .expert_auto = sel & 4,
                             .engram_auto = sel & 8,
                             .expert_bytes = u64(p + 48),
                             .engram_bytes = u64(p + 56)};
    ds41_budget_plan plan;
    ds41_error err;
    if (ds41_budget_decide(&r, &plan, &err) == 0) {
        CHECK(plan.headroom + plan.usable == r.available && plan.headroom <= r.available);
        if (!r.expert_auto) CHECK(plan.expert_bytes == r.expert_bytes);
        if (!r.engram_auto) CHECK(plan.engram_bytes == r.engram_bytes);
        CHECK(!plan.experts_streamed || (plan.expert_bytes && plan.expert_bytes < r.expert_total));
        CHECK(!plan.engram_streamed || (plan.engram_bytes && plan.engram_bytes < r.engram_total));
        if (r.expert_auto && plan.expert_bytes) CHECK(plan.expert_bytes >= r.expert_layer_min);
        if (r.expert_auto && plan.expert_bytes) CHECK(plan.expert_bytes <= plan.usable);
        char line[160];
        memset(line, 'x', sizeof line);
        ds41_budget_describe(&r, &plan, line, sizeof line);
        CHECK(memchr(line, 0, sizeof line) != NULL);
    } else {
        CHECK(r.expert_auto && strstr(err.msg, "not enough memory"));
    }
    return 0;
}
