/* DS41_HD: functions written once for the host and the device.
 *
 * The CUDA backend's arithmetic lives in small inline functions (cuda/num_*.h)
 * that nvcc compiles into the kernels (cuda/k_*.cu) and the C compiler into
 * the host emulation of the same kernels (cuda/emu_*.c, the op table
 * "cuda-emu" that runs on a fake device, cuda/gpu_fake.c).  So every rounding
 * point and every reduction order of a kernel is tested on the host, against
 * the reference and for batch / chunk invariance, even where no GPU exists;
 * what only a GPU can check is the mapping of that work onto threads.
 *
 * These headers are in the common subset of C17 and C++17: no designated
 * initializers, compound literals, `restrict`, VLAs or implicit conversions
 * from void *; fixed-width integer types and memcpy-free bit casts through
 * the helpers below.  Double-precision exp / log1p / sqrt come from the C
 * library on the host and from CUDA's libdevice on the device; both are
 * within one double ulp, so their fp32 roundings agree except within one
 * double ulp of an fp32 rounding boundary (the same class of difference the
 * fast CPU path documents for its double sums). */
#ifndef DS41_CUDA_HD_H
#define DS41_CUDA_HD_H

#include <stdint.h>

#ifdef __CUDACC__
#define DS41_HD __host__ __device__ static inline
#else
#define DS41_HD static inline
#endif

/* Bit casts without memcpy (usable in device code; unions are the C idiom
 * and nvcc defines their use for type punning). */
DS41_HD float ds41_hd_f32_from_bits(uint32_t u) {
    union {
        uint32_t u;
        float f;
    } v;
    v.u = u;
    return v.f;
}
DS41_HD uint32_t ds41_hd_f32_bits(float f) {
    union {
        uint32_t u;
        float f;
    } v;
    v.f = f;
    return v.u;
}

#endif
