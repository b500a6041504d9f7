/* The CUDA backend's op tables (cuda/ops_cuda.h), assembled from the op
 * families: each member points at the family's ds41_cuda_emu_<op> (host
 * emulation) or ds41_cuda_k_<op> (device kernels) of the same name. */
#include "cuda/ops_cuda.h"

#include "cuda/op_attn.h"
#include "cuda/op_linear.h"
#include "cuda/op_misc.h"

#define DS41_EMU_MEMBER(op) .op = ds41_cuda_emu_##op,
const ds41_ops ds41_cuda_ops_emulated = {.name = "cuda-emu", DS41_CUDA_OP_LIST(DS41_EMU_MEMBER)};

#ifdef DS41_HAVE_CUDA
#define DS41_K_MEMBER(op) .op = ds41_cuda_k_##op,
const ds41_ops ds41_cuda_ops_device = {.name = "cuda", DS41_CUDA_OP_LIST(DS41_K_MEMBER)};
#endif
