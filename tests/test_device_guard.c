/* device_guard (issue 14): the engine on the guard backend (tests/guard_backend.h),
 * whose memory the host cannot touch outside the backend's own ops and memory
 * calls, gives logits byte-identical to the plain fast CPU backend. */
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/forward/forward.h"
#include "engine/model/model_gen.h"
#include "tests/guard_backend.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char root[3000];

static int make(const char *preset, uint64_t seed, char *dir_out) {
    snprintf(dir_out, 4096, "%s/%s", root, preset);
    ds41_model_gen_opts o = {.preset = preset, .seed = seed};
    ds41_error err;
    if (ds41_model_generate(dir_out, &o, NULL, &err) != 0) {
        TAP_NOTE("generate %s: %s", preset, err.msg);
        return -1;
    }
    return 0;
}

static ds41_engine *load(const char *dir, bool guarded) {
    ds41_error err;
    ds41_engine_opts o = {.cpu = {.threads = 2}};
    if (guarded && !(o.backend = ds41_guard_backend_new(&o.cpu, &err))) {
        TAP_NOTE("guard backend: %s", err.msg);
        return NULL;
    }
    ds41_engine *e = ds41_engine_load(dir, &o, &err);
    if (!e) TAP_NOTE("load %s: %s", dir, err.msg);
    return e;
}

/* Prefill n tokens then `steps` greedy decode steps; every position's logits. */
static int run(ds41_engine *e, const int32_t *prompt, size_t n, size_t steps, float *logits) {
    ds41_error err;
    const size_t V = (size_t)ds41_engine_config(e)->vocab_size;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    ds41_kv_seq *seq = pool ? ds41_kv_seq_new(pool, &err) : NULL;
    int rc = seq ? 0 : -1;
    if (rc == 0) {
        ds41_fwd_item it = {.seq = seq, .ids = prompt, .n_ids = n, .logits = logits};
        rc = ds41_forward(e, &it, 1, NULL, &err);
    }
    for (size_t s = 0; s < steps && rc == 0; s++) {
        const float *last = logits + (n + s - 1) * V;
        const int32_t tok = ds41_argmax(last, V);
        ds41_fwd_item it = {.seq = seq, .ids = &tok, .n_ids = 1, .logits = logits + (n + s) * V};
        rc = ds41_forward(e, &it, 1, NULL, &err);
    }
    if (rc != 0) TAP_NOTE("forward: %s", err.msg);
    ds41_kv_seq_free(seq);
    ds41_kv_pool_free(pool);
    return rc;
}

static void smoke(const char *dir, const char *name) {
    ds41_engine *plain = load(dir, false), *guarded = load(dir, true);
    if (!TAP_CHECK(plain && guarded, "%s: both engines load", name)) goto out;
    const size_t V = (size_t)ds41_engine_config(plain)->vocab_size, n = 40, steps = 6;
    int32_t prompt[40];
    for (size_t i = 0; i < n; i++) prompt[i] = (int32_t)((i * 7919u + 13u) % V);
    float *a = calloc((n + steps) * V, sizeof *a), *b = calloc((n + steps) * V, sizeof *b);
    const int ra = run(plain, prompt, n, steps, a), rb = run(guarded, prompt, n, steps, b);
    TAP_CHECK(ra == 0 && rb == 0 && memcmp(a, b, (n + steps) * V * sizeof *a) == 0,
              "%s: prefill %zu + %zu decode steps: guarded logits byte-identical", name, n, steps);
    ds41_guard_stats st;
    ds41_guard_backend_stats(ds41_engine_backend(guarded), &st);
    TAP_CHECK(st.op_calls > 0 && st.bytes_peak > 0, "%s: the guard ran %llu ops on %llu bytes at most", name,
              (unsigned long long)st.op_calls, (unsigned long long)st.bytes_peak);
    free(a);
    free(b);
out:
    ds41_engine_free(plain);
    ds41_engine_free(guarded);
}

int main(void) {
    ds41_guard_install_fault_handler();
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-test-device-guard-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    char dir[4096];
    if (TAP_CHECK(make("tiny", 31, dir) == 0, "tiny checkpoint generated")) smoke(dir, "tiny");
    tmpdir_remove(root);
    return tap_done();
}
