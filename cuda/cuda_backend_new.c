/* ds41_backend_cuda_new (cuda/cuda_backend.h): the device and the op table,
 * around the backend of cuda/cuda_backend.c.  A file of its own so that
 * programs and tests that build the backend with their own table
 * (cuda/cuda_backend_internal.h) do not pull the tables in. */
#include "cuda/cuda_backend.h"
#include "cuda/cuda_backend_internal.h"
#include "cuda/ops_cuda.h"

ds41_backend *ds41_backend_cuda_new(const ds41_cuda_opts *opts, ds41_error *err) {
    ds41_cuda_opts o = opts ? *opts : (ds41_cuda_opts){0};
    if (!o.gpu) {
        if (o.emulated) {
            const ds41_gpu_fake_opts fo = {0};
            o.gpu = ds41_gpu_fake_new(&fo, err);
        } else {
            o.gpu = ds41_gpu_cuda_open(o.device, err);
        }
        if (!o.gpu) return NULL;
    }
    if (o.emulated) return ds41_backend_cuda_new_with_ops(&o, &ds41_cuda_ops_emulated, err);
#ifdef DS41_HAVE_CUDA
    return ds41_backend_cuda_new_with_ops(&o, &ds41_cuda_ops_device, err);
#else
    ds41_gpu_free(o.gpu);
    ds41_fail(err, "cuda backend: built without CUDA (nvcc was not found): only --backend cuda-emu");
    return NULL;
#endif
}
