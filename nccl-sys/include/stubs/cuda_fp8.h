/* Stand-in for cuda_fp8.h: nccl.h includes it (in C++ only) but names none of its types. */
