/* Stand-in for cuda_bf16.h: nccl.h includes it but names none of its types. */
