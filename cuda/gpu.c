/* What cuda/gpu.h defines for every device. */
#include "cuda/gpu.h"

void ds41_gpu_free(ds41_gpu *g) {
    if (g) g->destroy(g);
}
