/* Automatic expert/Engram budgets (engine/serve/auto_budget.h): the /proc and
 * cgroup v2 readers on fake trees, the policy over a table of inputs, the
 * footprint of a generated checkpoint against its own tensors. */
#include "engine/serve/auto_budget.h"

#include "engine/model/model_gen.h"
#include "storage/expert_cache.h"
#include "storage/safetensors.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <ftw.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define KIB ((uint64_t)1 << 10)
#define MIB ((uint64_t)1 << 20)
#define GIB ((uint64_t)1 << 30)

static char root[4096];

/* Write text to root/rel, creating the directories on the way. */
static int put(const char *base, const char *rel, const char *text) {
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", base, rel);
    for (char *p = path + strlen(root) + 1; (p = strchr(p, '/')); p++) {
        *p = 0;
        mkdir(path, 0700);
        *p = '/';
    }
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

static void test_parsers(void) {
    ds41_error err = {{0}};
    uint64_t b = 0;
    const char *mi = "MemTotal:       32768000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
    int rc0 = ds41_mem_parse_meminfo(mi, &b, &err);
    TAP_CHECK(rc0 == 0 && b == 20000000ull * 1024, "meminfo: MemAvailable read in bytes (%" PRIu64 ")", b);
    TAP_CHECK(ds41_mem_parse_meminfo("MemTotal: 5 kB\n", &b, &err) != 0 && strstr(err.msg, "no MemAvailable"),
              "meminfo: missing MemAvailable refused (%s)", err.msg);
    bool bad_ok = ds41_mem_parse_meminfo("MemAvailable: x kB\n", &b, &err) != 0 &&
                  ds41_mem_parse_meminfo("MemAvailable: 12 MB\n", &b, &err) != 0 &&
                  ds41_mem_parse_meminfo("MemAvailable: 99999999999999999999 kB\n", &b, &err) != 0;
    TAP_CHECK(bad_ok, "meminfo: malformed, wrong unit and overflowing values refused");

    char path[256];
    int rc = ds41_mem_parse_proc_cgroup("12:memory:/x\n0::/user.slice/a.scope\n", path, sizeof path, &err);
    TAP_CHECK(rc == 1 && strcmp(path, "/user.slice/a.scope") == 0, "proc cgroup: the v2 path found (%s)", path);
    TAP_CHECK(ds41_mem_parse_proc_cgroup("12:memory:/x\n3:cpu:/y\n", path, sizeof path, &err) == 0,
              "proc cgroup: a v1-only file has no v2 path");
    TAP_CHECK(ds41_mem_parse_proc_cgroup("0::relative\n", path, sizeof path, &err) == -1 &&
                  ds41_mem_parse_proc_cgroup("0::/abcdefgh\n", path, 4, &err) == -1,
              "proc cgroup: a relative or too long path refused");
}

static void test_mem_read(void) {
    char base[4600];
    ds41_error err = {{0}};
    ds41_mem_info mi;

    /* No cgroup v2: MemAvailable alone. */
    snprintf(base, sizeof base, "%s/fs1", root);
    put(base, "proc/meminfo", "MemAvailable: 4194304 kB\n");
    put(base, "proc/self/cgroup", "5:memory:/legacy\n");
    int rc = ds41_mem_read(base, &mi, &err);
    TAP_CHECK(rc == 0 && mi.available == 4 * GIB && mi.cgroup_free == UINT64_MAX && !mi.test_override,
              "mem_read: no cgroup v2 -> MemAvailable (4 GiB) %s", rc ? err.msg : "");

    /* cgroup v2 with a limit on the parent smaller than MemAvailable, none on the leaf. */
    snprintf(base, sizeof base, "%s/fs2", root);
    put(base, "proc/meminfo", "MemAvailable: 33554432 kB\n"); /* 32 GiB */
    put(base, "proc/self/cgroup", "0::/system.slice/ds41d.service\n");
    put(base, "sys/fs/cgroup/system.slice/ds41d.service/memory.max", "max\n");
    put(base, "sys/fs/cgroup/system.slice/ds41d.service/memory.current", "1048576\n");
    put(base, "sys/fs/cgroup/system.slice/memory.max", "8589934592\n");     /* 8 GiB */
    put(base, "sys/fs/cgroup/system.slice/memory.current", "1073741824\n"); /* 1 GiB used */
    rc = ds41_mem_read(base, &mi, &err);
    TAP_CHECK(rc == 0 && mi.mem_available == 32 * GIB && mi.cgroup_free == 7 * GIB && mi.available == 7 * GIB &&
                  strcmp(mi.cgroup_dir, "/system.slice") == 0,
              "mem_read: the parent cgroup's memory.max - memory.current (7 GiB) caps MemAvailable (32 GiB), "
              "found in %s", mi.cgroup_dir);

    /* Page cache charged to the cgroup (memory.stat "file") is not counted as used. */
    put(base, "sys/fs/cgroup/system.slice/memory.stat", "anon 1000\nfile 536870912\nkernel 0\n"); /* 512 MiB */
    rc = ds41_mem_read(base, &mi, &err);
    TAP_CHECK(rc == 0 && mi.cgroup_free == 7 * GIB + 512 * MIB && mi.available == 7 * GIB + 512 * MIB,
              "mem_read: the cgroup's page cache (memory.stat file, 512 MiB) is reclaimable: 7.5 GiB free");

    /* A cgroup limit larger than MemAvailable does not raise it. */
    snprintf(base, sizeof base, "%s/fs3", root);
    put(base, "proc/meminfo", "MemAvailable: 1048576 kB\n"); /* 1 GiB */
    put(base, "proc/self/cgroup", "0::/\n");
    put(base, "sys/fs/cgroup/memory.max", "68719476736\n");
    rc = ds41_mem_read(base, &mi, &err);
    TAP_CHECK(rc == 0 && mi.available == GIB && mi.cgroup_free == 64 * GIB,
              "mem_read: a cgroup limit above MemAvailable leaves MemAvailable (1 GiB)");

    snprintf(base, sizeof base, "%s/fs4", root);
    put(base, "proc/self/cgroup", "0::/\n");
    rc = ds41_mem_read(base, &mi, &err);
    TAP_CHECK(rc != 0 && strstr(err.msg, "meminfo"), "mem_read: no /proc/meminfo -> error naming it (%s)", err.msg);

    /* The test hook (real system only). */
    setenv(DS41_TEST_MEM_AVAILABLE_ENV, "48MiB", 1);
    rc = ds41_mem_read(NULL, &mi, &err);
    TAP_CHECK(rc == 0 && mi.test_override && mi.available == 48 * MIB,
              "mem_read: DS41_TEST_MEM_AVAILABLE=48MiB is reported as available");
    setenv(DS41_TEST_MEM_AVAILABLE_ENV, "lots", 1);
    rc = ds41_mem_read(NULL, &mi, &err);
    TAP_CHECK(rc != 0 && strstr(err.msg, DS41_TEST_MEM_AVAILABLE_ENV),
              "mem_read: a malformed hook value is an error naming the variable (%s)", err.msg);
    unsetenv(DS41_TEST_MEM_AVAILABLE_ENV);
    rc = ds41_mem_read(NULL, &mi, &err);
    TAP_CHECK(rc == 0 && !mi.test_override && mi.available > 0 && mi.available <= mi.mem_available,
              "mem_read: this machine: %" PRIu64 " MiB available (MemAvailable %" PRIu64 " MiB, cgroup %s)",
              (uint64_t)(mi.available / MIB), (uint64_t)(mi.mem_available / MIB), mi.cgroup_dir[0] ? mi.cgroup_dir : "none");
}

typedef struct decide_case {
    const char *what;
    ds41_budget_request req;
    int rc;
    bool experts_streamed, engram_streamed;
    uint64_t expert_bytes, engram_bytes; /* expected engine values (checked when rc == 0) */
} decide_case;

static void test_decide(void) {
    /* The release's proportions on a 64 GiB box: dense 18 GiB, experts 289 GB, Engram 203 GB. */
    const uint64_t dense = 18 * GIB, experts = 289000000000ull, engram = 203000000000ull;
    const uint64_t slot = 26 * MIB, layer_min = 256 * slot;
    /* 64 GiB: headroom 6.4 GiB, Engram row cache 1 GiB, KV 8 GiB. */
    const uint64_t a64 = 64 * GIB, h64 = a64 / 10;
    const uint64_t a512 = 512 * GIB;
    decide_case cases[] = {
        {"release on 1 TiB: everything fits -> resident",
         {1024 * GIB, dense, 16 * GIB, experts, engram, layer_min, true, true, 0, 0}, 0, false, false, 0, 0},
        {"release on 512 GiB: Engram streamed (1 GiB rows), experts resident",
         {a512, dense, 16 * GIB, experts, engram, layer_min, true, true, 0, 0}, 0, false, true, 0, GIB},
        {"release on 64 GiB: both streamed, experts get the rest",
         {a64, dense, 8 * GIB, experts, engram, layer_min, true, true, 0, 0}, 0, true, true,
         a64 - h64 - dense - 8 * GIB - GIB, GIB},
        {"release on 24 GiB: too small for one layer's slots -> error",
         {24 * GIB, dense, 2 * GIB, experts, engram, layer_min, true, true, 0, 0}, -1, false, false, 0, 0},
        {"dense + KV above the memory -> error",
         {8 * GIB, dense, 2 * GIB, experts, engram, slot, true, true, 0, 0}, -1, false, false, 0, 0},
        {"tiny model in 16 MiB: headroom 2 MiB, Engram rows 819 KiB, experts 6.2 MiB",
         {16 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 3 * MIB, 64 * KIB, true, true, 0, 0}, 0, true, true,
         16 * MIB - 2 * MIB - 2 * MIB - 4 * MIB - 16 * MIB / 20, 16 * MIB / 20},
        {"Engram smaller than its row cache: stays resident, experts streamed",
         {64 * GIB, dense, 8 * GIB, experts, 512 * MIB, layer_min, true, true, 0, 0}, 0, true, false,
         a64 - h64 - dense - 8 * GIB - 512 * MIB, 0},
        {"explicit expert budget wins; Engram auto decided around it",
         {a64, dense, 8 * GIB, experts, engram, layer_min, false, true, 20 * GIB, 0}, 0, true, true, 20 * GIB, GIB},
        {"explicit 0 (resident) experts on 64 GiB: kept, Engram streamed",
         {a64, dense, 8 * GIB, experts, engram, layer_min, false, true, 0, 0}, 0, false, true, 0, GIB},
        {"explicit Engram budget wins; experts auto",
         {a64, dense, 8 * GIB, experts, engram, layer_min, true, false, 0, 2 * GIB}, 0, true, true,
         a64 - h64 - dense - 8 * GIB - 2 * GIB, 2 * GIB},
        {"model without Engram on 64 GiB: experts streamed",
         {a64, dense, 8 * GIB, experts, 0, layer_min, true, true, 0, 0}, 0, true, false, a64 - h64 - dense - 8 * GIB,
         0},
        {"small machine (4 GiB): headroom an eighth (512 MiB), not 1 GiB",
         {4 * GIB, GIB, 512 * MIB, 4 * GIB, 0, 64 * MIB, true, true, 0, 0}, 0, true, false,
         4 * GIB - 512 * MIB - GIB - 512 * MIB, 0},
        {"nothing available -> error", {0, MIB, 0, MIB, MIB, KIB, true, true, 0, 0}, -1, false, false, 0, 0},
    };
    const size_t n = sizeof cases / sizeof cases[0];
    for (size_t i = 0; i < n; i++) {
        const decide_case *c = &cases[i];
        ds41_budget_plan p;
        ds41_error err = {{0}};
        int rc = ds41_budget_decide(&c->req, &p, &err);
        bool ok = rc == c->rc;
        if (ok && rc == 0)
            ok = p.experts_streamed == c->experts_streamed && p.engram_streamed == c->engram_streamed &&
                 p.expert_bytes == c->expert_bytes && p.engram_bytes == c->engram_bytes &&
                 p.headroom + p.usable == c->req.available;
        if (ok && rc != 0) ok = strstr(err.msg, "not enough memory") && strstr(err.msg, "needs");
        char line[512];
        if (rc == 0) ds41_budget_describe(&c->req, &p, line, sizeof line);
        TAP_CHECK(ok, "decide: %s: %s", c->what, rc == 0 ? line : err.msg);
        if (!ok && rc == 0)
            TAP_NOTE("got experts %d/%" PRIu64 " engram %d/%" PRIu64 ", headroom %" PRIu64, p.experts_streamed,
                     p.expert_bytes, p.engram_streamed, p.engram_bytes, p.headroom);
    }
    /* The headroom rule: 10%, at least min(1 GiB, an eighth). */
    bool hr_ok = true;
    for (uint64_t a = 0; a <= 256 * GIB && hr_ok; a += a < GIB ? 7 * MIB + 3 : 3 * GIB + 1) {
        ds41_budget_request r = {.available = a, .expert_total = 0, .engram_total = 0, .expert_auto = true,
                                 .engram_auto = true};
        ds41_budget_plan p;
        if (ds41_budget_decide(&r, &p, NULL) != 0) {
            hr_ok = false;
            break;
        }
        uint64_t want = a / 10 > (a / 8 < GIB ? a / 8 : GIB) ? a / 10 : (a / 8 < GIB ? a / 8 : GIB);
        hr_ok = p.headroom == want && (a == 0 || p.headroom < a);
        if (!hr_ok) TAP_NOTE("available %" PRIu64 ": headroom %" PRIu64 ", want %" PRIu64, a, p.headroom, want);
    }
    TAP_CHECK(hr_ok, "decide: headroom = max(10%%, min(1 GiB, 12.5%%)) of the available memory, 0..256 GiB");

    char line[512];
    ds41_budget_request r = {64 * GIB, 18 * GIB, 8 * GIB, 289 * GIB, 203 * GIB, GIB, true, true, 0, 0};
    ds41_budget_plan p;
    ds41_budget_decide(&r, &p, NULL);
    ds41_budget_describe(&r, &p, line, sizeof line);
    TAP_CHECK(strcmp(line, "budgets: auto -> experts 289.0 GiB streamed with 30.6 GiB budget, Engram 203.0 GiB "
                           "streamed with 1.0 GiB row cache (available 64.0 GiB, headroom 6.4 GiB, dense 18.0 GiB, "
                           "KV 8.0 GiB)") == 0,
              "describe: %s", line);
}

static void test_footprint(void) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/tiny", root);
    ds41_model_gen_opts o = {.preset = "tiny", .seed = 5};
    ds41_error err = {{0}};
    if (!TAP_CHECK(ds41_model_generate(dir, &o, NULL, &err) == 0, "tiny checkpoint generated %s", err.msg)) return;
    ds41_model_footprint fp;
    int rc = ds41_model_footprint_load(dir, &fp, &err);
    if (!TAP_CHECK(rc == 0, "footprint of tiny loaded %s", rc ? err.msg : "")) return;
    ds41_checkpoint *ck = ds41_checkpoint_open(dir, &err);
    ds41_model_config cfg;
    if (!ck || ds41_model_config_load(dir, &cfg, &err) != 0) {
        TAP_CHECK(0, "tiny reopened: %s", err.msg);
        ds41_checkpoint_close(ck);
        return;
    }
    uint64_t experts = 0, engram = 0;
    for (size_t i = 0; i < ds41_checkpoint_tensor_count(ck); i++) {
        const ds41_tensor *t = ds41_checkpoint_tensor_at(ck, i);
        int L, E;
        char rest[64];
        if (sscanf(t->name, "layers.%d.ffn.experts.%d.%63s", &L, &E, rest) == 3 && L < cfg.n_layers)
            experts += t->nbytes;
        else if (strstr(t->name, ".engram.embed."))
            engram += t->nbytes;
    }
    uint64_t slot = 0, total = 0;
    ds41_expert_cache_geometry(ck, &cfg, &slot, &total, &err);
    TAP_CHECK(fp.total_bytes == ds41_checkpoint_payload_bytes(ck) && fp.expert_bytes == experts &&
                  fp.engram_bytes == engram && engram > 0 && fp.dense_bytes == fp.total_bytes - experts - engram,
              "footprint: total %" PRIu64 " = the checkpoint's payload, experts %" PRIu64 ", Engram %" PRIu64
              " as its tensors say, dense the rest",
              fp.total_bytes, fp.expert_bytes, fp.engram_bytes);
    if (fp.total_bytes != ds41_checkpoint_payload_bytes(ck) || fp.expert_bytes != experts || fp.engram_bytes != engram)
        TAP_NOTE("checkpoint payload %" PRIu64 ", experts %" PRIu64 ", Engram %" PRIu64,
                 ds41_checkpoint_payload_bytes(ck), experts, engram);
    TAP_CHECK(fp.expert_slot_bytes == slot && total >= fp.expert_bytes,
              "footprint: the slot size is the expert tier's (%" PRIu64 " bytes)", slot);
    uint64_t want1 = (uint64_t)cfg.n_activated_experts * slot;
    TAP_CHECK(ds41_model_footprint_layer_min(&fp, 1) == want1 &&
                  ds41_model_footprint_layer_min(&fp, 4096) == (uint64_t)cfg.n_routed_experts * slot,
              "footprint: one layer needs top-k slots at batch 1, every expert at a large batch");
    ds41_model_config_free(&cfg);
    ds41_checkpoint_close(ck);

    ds41_mem_info mem = {.available = 4 * MIB, .mem_available = 4 * MIB, .cgroup_free = UINT64_MAX};
    ds41_budget_plan p;
    ds41_budget_request rq;
    char line[512];
    /* 8 MiB with a 2.5 MiB KV cache: headroom 1 MiB, dense ~3 MiB: tiny's ~2 MiB of experts and
     * Engram do not fit, the Engram rows get 5% (409.6 KiB), the experts the rest. */
    mem.available = 8 * MIB;
    ds41_auto_budget_opts ao = {.dir = dir, .expert_auto = true, .engram_auto = true, .kv_bytes = 5 * MIB / 2,
                                .batch = 1, .mem = &mem};
    rc = ds41_auto_budget(&ao, &p, &rq, line, sizeof line, &err);
    uint64_t want_x = 7 * MIB - fp.dense_bytes - 5 * MIB / 2 - 8 * MIB / 20;
    TAP_CHECK(rc == 0 && p.experts_streamed && p.engram_streamed && p.engram_bytes == 8 * MIB / 20 &&
                  p.expert_bytes == want_x && rq.dense_bytes == fp.dense_bytes && rq.kv_bytes == 5 * MIB / 2,
              "auto_budget on tiny with 8 MiB, KV 2.5 MiB: %s", rc ? err.msg : line);
    mem.available = 4 * MIB;
    ao.kv_bytes = 0; /* a quarter of the memory */
    rc = ds41_auto_budget(&ao, &p, &rq, line, sizeof line, &err);
    TAP_CHECK(rc != 0 && rq.kv_bytes == MIB && strstr(err.msg, "not enough memory"),
              "auto_budget on tiny with 4 MiB, KV auto (1 MiB): %s", err.msg);
    mem.available = 64 * GIB;
    rc = ds41_auto_budget(&ao, &p, &rq, line, sizeof line, &err);
    TAP_CHECK(rc == 0 && !p.experts_streamed && !p.engram_streamed && p.expert_bytes == 0 && p.engram_bytes == 0,
              "auto_budget on tiny with 64 GiB: everything resident");
    ao.dir = root; /* no checkpoint there */
    rc = ds41_auto_budget(&ao, &p, &rq, line, sizeof line, &err);
    TAP_CHECK(rc != 0 && strstr(err.msg, "config.json"), "auto_budget on a directory without a model: %s", err.msg);
}

int main(void) {
    if (!tmpdir_make(root, sizeof root, "DS41_BUILD_DIR", "ds41-test-auto-budget-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    test_parsers();
    test_mem_read();
    test_decide();
    test_footprint();
    tmpdir_remove(root);
    return tap_done();
}
