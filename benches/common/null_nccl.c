/* A null NCCL for `cargo bench --bench overhead -- --backend fake-cuda`: every entry point
 * that the crate's table requires (and that cudarc::nccl calls) returns ncclSuccess at
 * once, so the bench times only the CPU work of the callers around it.
 *
 * It is a shared library, not Rust functions, because cudarc::nccl finds NCCL only through
 * dlopen: the bench loads this file, and the crate's Library and cudarc's loader both
 * resolve to it (see `cudarc_nccl` in benches/overhead.rs). Built at bench start with the
 * system C compiler, soname libnccl.so.2 as NVIDIA's, so that both columns load it exactly
 * as they load NVIDIA's NCCL on a GPU. */
#include <stddef.h>

typedef int ncclResult_t;
typedef void *ncclComm_t;
typedef void *cudaStream_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef int ncclScalarResidence_t;
typedef struct { char internal[128]; } ncclUniqueId;

#define OK 0
#define EXPORT __attribute__((visibility("default")))

/* The one communicator handed out: an address nobody dereferences. */
static char the_comm;

EXPORT ncclResult_t ncclGetVersion(int *v) { if (v) *v = 22800; return OK; }
EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (id) for (size_t i = 0; i < sizeof id->internal; i++) id->internal[i] = (char)i;
    return OK;
}
EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *c, int n, ncclUniqueId id, int r, void *cfg) {
    (void)n; (void)id; (void)r; (void)cfg;
    if (c) *c = &the_comm;
    return OK;
}
EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *c, int n, ncclUniqueId id, int r) {
    (void)n; (void)id; (void)r;
    if (c) *c = &the_comm;
    return OK;
}
EXPORT ncclResult_t ncclCommInitAll(ncclComm_t *c, int n, const int *devs) {
    (void)devs;
    for (int i = 0; c && i < n; i++) c[i] = &the_comm;
    return OK;
}
EXPORT ncclResult_t ncclCommFinalize(ncclComm_t c) { (void)c; return OK; }
EXPORT ncclResult_t ncclCommDestroy(ncclComm_t c) { (void)c; return OK; }
EXPORT ncclResult_t ncclCommAbort(ncclComm_t c) { (void)c; return OK; }
EXPORT ncclResult_t ncclCommSplit(ncclComm_t c, int color, int key, ncclComm_t *out, void *cfg) {
    (void)c; (void)color; (void)key; (void)cfg;
    if (out) *out = &the_comm;
    return OK;
}
EXPORT const char *ncclGetErrorString(ncclResult_t r) { (void)r; return "null NCCL"; }
EXPORT const char *ncclGetLastError(ncclComm_t c) { (void)c; return ""; }
EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *e) {
    (void)c;
    if (e) *e = OK;
    return OK;
}
EXPORT ncclResult_t ncclCommCount(ncclComm_t c, int *n) { (void)c; if (n) *n = 1; return OK; }
EXPORT ncclResult_t ncclCommCuDevice(ncclComm_t c, int *d) { (void)c; if (d) *d = 0; return OK; }
EXPORT ncclResult_t ncclCommUserRank(ncclComm_t c, int *r) { (void)c; if (r) *r = 0; return OK; }
EXPORT ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *s, ncclDataType_t t,
                                             ncclScalarResidence_t res, ncclComm_t c) {
    (void)s; (void)t; (void)res; (void)c;
    if (op) *op = 5;
    return OK;
}
EXPORT ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t c) { (void)op; (void)c; return OK; }
EXPORT ncclResult_t ncclReduce(const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                               int root, ncclComm_t c, cudaStream_t st) {
    (void)s; (void)r; (void)n; (void)t; (void)op; (void)root; (void)c; (void)st;
    return OK;
}
EXPORT ncclResult_t ncclBcast(void *b, size_t n, ncclDataType_t t, int root, ncclComm_t c,
                              cudaStream_t st) {
    (void)b; (void)n; (void)t; (void)root; (void)c; (void)st;
    return OK;
}
EXPORT ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, ncclDataType_t t, int root,
                                  ncclComm_t c, cudaStream_t st) {
    (void)s; (void)r; (void)n; (void)t; (void)root; (void)c; (void)st;
    return OK;
}
EXPORT ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, ncclDataType_t t,
                                  ncclRedOp_t op, ncclComm_t c, cudaStream_t st) {
    (void)s; (void)r; (void)n; (void)t; (void)op; (void)c; (void)st;
    return OK;
}
EXPORT ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, ncclDataType_t t,
                                      ncclRedOp_t op, ncclComm_t c, cudaStream_t st) {
    (void)s; (void)r; (void)n; (void)t; (void)op; (void)c; (void)st;
    return OK;
}
EXPORT ncclResult_t ncclAllGather(const void *s, void *r, size_t n, ncclDataType_t t,
                                  ncclComm_t c, cudaStream_t st) {
    (void)s; (void)r; (void)n; (void)t; (void)c; (void)st;
    return OK;
}
EXPORT ncclResult_t ncclSend(const void *s, size_t n, ncclDataType_t t, int peer, ncclComm_t c,
                             cudaStream_t st) {
    (void)s; (void)n; (void)t; (void)peer; (void)c; (void)st;
    return OK;
}
EXPORT ncclResult_t ncclRecv(void *r, size_t n, ncclDataType_t t, int peer, ncclComm_t c,
                             cudaStream_t st) {
    (void)r; (void)n; (void)t; (void)peer; (void)c; (void)st;
    return OK;
}
EXPORT ncclResult_t ncclGroupStart(void) { return OK; }
EXPORT ncclResult_t ncclGroupEnd(void) { return OK; }
