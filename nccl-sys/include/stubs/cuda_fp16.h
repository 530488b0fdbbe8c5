/* Stand-in for cuda_fp16.h: nccl.h includes it but names none of its types. */
