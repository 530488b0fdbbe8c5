/* Stand-in for the CUDA runtime header: only the opaque types nccl.h names.
 * It lets bindgen read nccl.h without a CUDA toolkit. */
#ifndef NCCL_SYS_STUB_CUDA_RUNTIME_H
#define NCCL_SYS_STUB_CUDA_RUNTIME_H
#include <stddef.h>
#define CUDART_VERSION 12080
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#endif
