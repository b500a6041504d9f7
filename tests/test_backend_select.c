/* cuda/backend_select.h: backends by name, and what `auto` and `cuda` do on
 * this machine (no GPU here and in CI: auto is the CPU backend and says why,
 * cuda is an error naming the reason; on a machine with a usable GPU, auto
 * is whatever the CUDA backend's constructor gives). */
#include "cuda/backend_select.h"
#include "cuda/cuda_backend.h"
#include "cuda/gpu.h"
#include "tap.h"

#include <string.h>

int main(void) {
    const char *names[] = {"auto", "cpu", "cuda", "cuda-emu", "reference"};
    bool round = true;
    for (int i = 0; i < 5; i++)
        round &= ds41_backend_kind_parse(names[i]) == i && strcmp(ds41_backend_kind_name(i), names[i]) == 0;
    TAP_CHECK(round && ds41_backend_kind_parse("CUDA") < 0 && ds41_backend_kind_parse("") < 0 &&
                  ds41_backend_kind_parse(NULL) < 0 && ds41_backend_kind_parse("cuda_emu") < 0,
              "the five kinds parse and name themselves; nothing else parses");

    ds41_error err = {{0}};
    char why[256];
    ds41_backend *be = ds41_backend_open("gpu", NULL, 0, &err);
    TAP_CHECK(!be && strstr(err.msg, "backend 'gpu'") &&
                  strstr(err.msg, "auto, cpu, cuda, cuda-emu, reference"),
              "an unknown kind is an error naming it and the choices (%s)", err.msg);

    ds41_cpu_opts cpu = {.threads = 2};
    be = ds41_backend_open_why("cpu", &cpu, 0, why, sizeof why, &err);
    TAP_CHECK(be && ds41_backend_cpu_level(be) != DS41_CPU_AUTO && ds41_backend_threads(be) == 2 &&
                  strcmp(why, "backend cpu") == 0,
              "cpu: the fast CPU backend with the options given (%s)", be ? be->name : err.msg);
    ds41_backend_free(be);
    be = ds41_backend_open("reference", NULL, 0, &err);
    TAP_CHECK(be && ds41_backend_cpu_level(be) == DS41_CPU_AUTO && ds41_backend_threads(be) == 1,
              "reference: the reference backend (%s)", be ? be->name : err.msg);
    ds41_backend_free(be);

    /* What this machine has decides auto and cuda. */
    ds41_error gerr = {{0}};
    ds41_gpu *g = ds41_gpu_cuda_open(0, &gerr);
    if (g) g->destroy(g);
    TAP_CHECK(g || (gerr.msg[0] && (strstr(gerr.msg, "CUDA") || strstr(gerr.msg, "GPU"))),
              "opening the GPU either works or says why not, without aborting (%s)", g ? "opened" : gerr.msg);
#ifndef DS41_HAVE_CUDA
    TAP_CHECK(!g && strstr(gerr.msg, "built without CUDA"), "a build without CUDA says so (%s)", gerr.msg);
#endif
    be = ds41_backend_open_why(NULL, &cpu, 0, why, sizeof why, &err);
    if (!g) {
        TAP_CHECK(be && ds41_backend_cpu_level(be) != DS41_CPU_AUTO && strstr(why, "backend auto: cpu") &&
                      strstr(why, gerr.msg),
                  "auto without a usable GPU: the CPU backend, and a line with the reason (%s)", why);
        ds41_backend_free(be);
        be = ds41_backend_open("cuda", &cpu, 0, &err);
        TAP_CHECK(!be && strstr(err.msg, "backend cuda: no usable GPU") && strstr(err.msg, gerr.msg),
                  "cuda without a usable GPU: an error with the reason (%s)", err.msg);
    } else {
        TAP_CHECK(be && strstr(why, "backend auto: "), "auto with a GPU opens a backend and says which (%s)",
                  why);
        ds41_backend_free(be);
        ds41_backend_free(ds41_backend_open("cuda", &cpu, 0, &err));
    }
    be = ds41_backend_open("cuda", &cpu, 4096, &err);
    TAP_CHECK(!be && strstr(err.msg, "backend cuda: no usable GPU"),
              "cuda on a device that is not there: an error (%s)", err.msg);

    /* cuda-emu: the emulated CUDA backend (cuda/cuda_backend.h) whenever it is
     * built; it runs on any machine. */
    be = ds41_backend_open_why("cuda-emu", NULL, 0, why, sizeof why, &err);
    if (be) {
        TAP_CHECK(ds41_backend_is_cuda(be) && strstr(why, "cuda-emu"),
                  "cuda-emu: the emulated CUDA backend (%s)", be->name);
        ds41_backend_free(be);
    } else {
        TAP_CHECK(strstr(err.msg, "backend cuda-emu"), "cuda-emu failing says so (%s)", err.msg);
    }
    return tap_done();
}
