/*
 * cuBLAS, cuRAND and NVRTC, as far as candle's `CudaDevice::new` uses them: a handle and a
 * generator that can be made, bound to a stream, seeded and destroyed. Nothing else works:
 * `scripts/candle-ddp-cuda-check.sh` adds a weak definition of every other entry point of
 * cudarc's bindings, which fails (so a test that reaches a matrix product or a random
 * number fails with candle's error instead of linking against a real library).
 *
 * The script links this file as each of libcublas.so, libcublasLt.so, libcurand.so and
 * libnvrtc.so, beside nccl-safe's fake CUDA driver as libcuda.so.
 */
static int handle, generator;

int cublasCreate_v2(void **h) {
    if (!h)
        return 7; /* CUBLAS_STATUS_INVALID_VALUE */
    *h = &handle;
    return 0;
}
int cublasSetStream_v2(void *h, void *stream) {
    (void)stream;
    return h == &handle ? 0 : 7;
}
int cublasDestroy_v2(void *h) { return h == &handle ? 0 : 7; }

int curandCreateGenerator(void **g, int kind) {
    (void)kind;
    if (!g)
        return 102; /* CURAND_STATUS_NOT_INITIALIZED */
    *g = &generator;
    return 0;
}
int curandSetStream(void *g, void *stream) {
    (void)stream;
    return g == &generator ? 0 : 102;
}
int curandSetPseudoRandomGeneratorSeed(void *g, unsigned long long seed) {
    (void)seed;
    return g == &generator ? 0 : 102;
}
int curandSetGeneratorOffset(void *g, unsigned long long offset) {
    (void)offset;
    return g == &generator ? 0 : 102;
}
int curandDestroyGenerator(void *g) { return g == &generator ? 0 : 102; }
