/*
 * A fake CUDA runtime, over the fake driver (`cuda.c`, included: one object, one memory
 * and stream model), for NCCL built from source with a dynamic runtime
 * (`scripts/build-nccl.sh`). It implements the runtime functions that NCCL's host code
 * calls and the driver entry points it fetches through `cudaGetDriverEntryPointByVersion`
 * (misc/cudawrap.cc), with:
 * - device memory that is host memory, as the driver's (`cudaMalloc` is `cuMemAlloc`);
 * - streams and events that are the driver's: a stall, a sticky error, a capture and the
 *   stream-order model apply to NCCL's own streams and events as to the crate's;
 * - kernels that are recorded (counted) and never run: NCCL's device code is not built
 *   (its kernels are empty host functions), so no collective moves data between ranks.
 *   A kernel launch completes at once on its stream, as a stream op of the fake;
 * - no peer access, no IPC handles and no VMM (the device's attributes say so, and those
 *   entry points fail): NCCL then uses `cudaMalloc` and the socket transport, as set up by
 *   the tests (`NCCL_P2P_DISABLE`, `NCCL_SHM_DISABLE`, `NCCL_CUMEM_ENABLE=0`);
 * - PCI bus ids `0000:f<d>:00.0` for device d, which no machine's sysfs has (NCCL's
 *   topology then comes from `NCCL_TOPO_FILE` or its own defaults).
 *
 * Compiled with the CUDA runtime's headers (the PyPI wheels of `scripts/build-nccl.sh`)
 * for its types only; it is not part of the crate.
 */
#include "cuda.c"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

/* ---- the runtime's own state -------------------------------------------------------- */

static __thread cudaError_t last_error;
static uint64_t kernel_launches, host_funcs, pools_live, registered_live;

static cudaError_t rt(CUresult r) {
    cudaError_t e;
    switch (r) {
    case CUDA_SUCCESS: return cudaSuccess;
    case CUDA_ERROR_INVALID_VALUE: e = cudaErrorInvalidValue; break;
    case CUDA_ERROR_OUT_OF_MEMORY: e = cudaErrorMemoryAllocation; break;
    case CUDA_ERROR_NOT_INITIALIZED: e = cudaErrorInitializationError; break;
    case CUDA_ERROR_NO_DEVICE: e = cudaErrorNoDevice; break;
    case CUDA_ERROR_INVALID_DEVICE: e = cudaErrorInvalidDevice; break;
    case CUDA_ERROR_INVALID_CONTEXT: e = cudaErrorDeviceUninitialized; break;
    case CUDA_ERROR_INVALID_HANDLE: e = cudaErrorInvalidResourceHandle; break;
    case CUDA_ERROR_NOT_READY: return cudaErrorNotReady; /* not an error: not kept */
    case CUDA_ERROR_NOT_SUPPORTED: e = cudaErrorNotSupported; break;
    case CUDA_ERROR_CAPTURED_EVENT: e = cudaErrorCapturedEvent; break;
    default: e = (cudaError_t)r; break; /* a sticky error: the driver's and runtime's codes
                                           agree for those (700 and up) */
    }
    last_error = e;
    return e;
}

static cudaError_t fail(cudaError_t e) {
    last_error = e;
    return e;
}

/* As CUDA's runtime: the first call on a thread with no current context makes device 0's
 * primary context current. */
static void ensure_ctx(void) {
    if (!current) {
        contexts[0].device = 0;
        current = &contexts[0];
    }
}

/* Device allocations (cudaMalloc, cudaMallocFromPoolAsync), for pointer queries. */
struct rt_alloc {
    uintptr_t p;
    size_t n;
    int device;
};
static struct rt_alloc *rt_allocs;
static size_t rt_allocs_len, rt_allocs_cap;
static pthread_mutex_t rt_lock = PTHREAD_MUTEX_INITIALIZER;

static void rt_remember(uintptr_t p, size_t n, int device) {
    pthread_mutex_lock(&rt_lock);
    if (rt_allocs_len == rt_allocs_cap) {
        rt_allocs_cap = rt_allocs_cap ? 2 * rt_allocs_cap : 256;
        rt_allocs = realloc(rt_allocs, rt_allocs_cap * sizeof *rt_allocs);
        if (!rt_allocs)
            abort();
    }
    rt_allocs[rt_allocs_len++] = (struct rt_alloc){p, n, device};
    pthread_mutex_unlock(&rt_lock);
}

static void rt_forget(uintptr_t p) {
    pthread_mutex_lock(&rt_lock);
    for (size_t i = 0; i < rt_allocs_len; i++)
        if (rt_allocs[i].p == p) {
            rt_allocs[i] = rt_allocs[--rt_allocs_len];
            break;
        }
    pthread_mutex_unlock(&rt_lock);
}

/* The device allocation holding `p`; 0 when none does. */
static int rt_find(uintptr_t p, struct rt_alloc *out) {
    int found = 0;
    pthread_mutex_lock(&rt_lock);
    for (size_t i = 0; i < rt_allocs_len; i++)
        if (p >= rt_allocs[i].p && p < rt_allocs[i].p + (rt_allocs[i].n ? rt_allocs[i].n : 1)) {
            *out = rt_allocs[i];
            found = 1;
            break;
        }
    pthread_mutex_unlock(&rt_lock);
    return found;
}

/* ---- devices ------------------------------------------------------------------------- */

cudaError_t cudaGetDeviceCount(int *count) { return rt(cuDeviceGetCount(count)); }

cudaError_t cudaGetDevice(int *device) {
    if (!device)
        return fail(cudaErrorInvalidValue);
    ensure_ctx();
    *device = current->device;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    CUcontext ctx;
    CUresult r = cuDevicePrimaryCtxRetain(&ctx, device);
    if (r != CUDA_SUCCESS)
        return rt(r);
    return rt(cuCtxSetCurrent(ctx));
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
    if (!value)
        return fail(cudaErrorInvalidValue);
    if (!valid_device(device))
        return fail(cudaErrorInvalidDevice);
    switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 232448; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 49152; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrPciBusId: *value = 0xf0 + device; break;
    case cudaDevAttrPciDeviceId: *value = 0; break;
    case cudaDevAttrPciDomainId: *value = 0; break;
    case cudaDevAttrUnifiedAddressing: *value = 1; break;
    case cudaDevAttrMemoryPoolsSupported: *value = 1; break;
    case cudaDevAttrCanMapHostMemory: *value = 1; break;
    default: *value = 0; break;
    }
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
    if (!prop)
        return fail(cudaErrorInvalidValue);
    if (!valid_device(device))
        return fail(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "nccl-safe fake CUDA device %d", device);
    memcpy(prop->uuid.bytes, "\xfa\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 15);
    prop->uuid.bytes[15] = (char)device;
    prop->totalGlobalMem = (size_t)1 << 32;
    prop->sharedMemPerBlock = 49152;
    prop->sharedMemPerBlockOptin = 232448;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = 132;
    prop->pciBusID = 0xf0 + device;
    prop->pciDeviceID = 0;
    prop->pciDomainID = 0;
    prop->unifiedAddressing = 1;
    prop->canMapHostMemory = 1;
    prop->managedMemory = 1;
    prop->concurrentKernels = 1;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char *bus_id, int len, int device) {
    if (!bus_id || len <= 0)
        return fail(cudaErrorInvalidValue);
    if (!valid_device(device))
        return fail(cudaErrorInvalidDevice);
    snprintf(bus_id, (size_t)len, "0000:%02x:00.0", 0xf0 + device);
    return cudaSuccess;
}

cudaError_t cudaDeviceGetByPCIBusId(int *device, const char *bus_id) {
    unsigned domain, bus, dev, fn;
    if (!device || !bus_id || sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &fn) != 4)
        return fail(cudaErrorInvalidValue);
    int d = (int)bus - 0xf0;
    if (domain != 0 || dev != 0 || !valid_device(d))
        return fail(cudaErrorInvalidDevice);
    *device = d;
    return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer) {
    if (!can)
        return fail(cudaErrorInvalidValue);
    if (!valid_device(device) || !valid_device(peer))
        return fail(cudaErrorInvalidDevice);
    *can = 0;
    return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
    (void)peer, (void)flags;
    return fail(cudaErrorPeerAccessUnsupported);
}

cudaError_t cudaDeviceSetLimit(enum cudaLimit limit, size_t value) {
    (void)limit, (void)value;
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *v) { return rt(cuDriverGetVersion(v)); }

cudaError_t cudaDeviceSynchronize(void) {
    ensure_ctx();
    return rt(cuCtxSynchronize());
}

cudaError_t cudaRuntimeGetVersion(int *v) {
    if (!v)
        return fail(cudaErrorInvalidValue);
    *v = CUDART_VERSION;
    return cudaSuccess;
}

/* ---- errors ------------------------------------------------------------------------- */

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorPeerAccessUnsupported: return "peer access is not supported between these two devices";
    default: return "unknown error (fake CUDA runtime)";
    }
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

/* ---- memory ------------------------------------------------------------------------- */

cudaError_t cudaMalloc(void **p, size_t size) {
    if (!p)
        return fail(cudaErrorInvalidValue);
    ensure_ctx();
    CUdeviceptr d;
    CUresult r = cuMemAlloc_v2(&d, size);
    if (r != CUDA_SUCCESS)
        return rt(r);
    *p = PTR(d);
    rt_remember((uintptr_t)d, size, current->device);
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    if (!p)
        return cudaSuccess;
    ensure_ctx();
    rt_forget((uintptr_t)p);
    return rt(cuMemFree_v2((CUdeviceptr)(uintptr_t)p));
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t s) {
    if (!p)
        return cudaSuccess;
    rt_forget((uintptr_t)p);
    return rt(cuMemFreeAsync((CUdeviceptr)(uintptr_t)p, (CUstream)s));
}

/* A pool: a handle only (allocations come from the driver's allocator). */
struct fake_pool {
    int device;
};

cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const struct cudaMemPoolProps *props) {
    if (!pool || !props)
        return fail(cudaErrorInvalidValue);
    struct fake_pool *fp = calloc(1, sizeof *fp);
    if (!fp)
        return fail(cudaErrorMemoryAllocation);
    fp->device = props->location.id;
    add((int64_t *)&pools_live, 1);
    *pool = (cudaMemPool_t)fp;
    return cudaSuccess;
}

cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool) {
    if (!pool)
        return fail(cudaErrorInvalidValue);
    free(pool);
    add((int64_t *)&pools_live, -1);
    return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value) {
    (void)attr;
    if (!pool || !value)
        return fail(cudaErrorInvalidValue);
    return cudaSuccess;
}

cudaError_t cudaMallocFromPoolAsync(void **p, size_t size, cudaMemPool_t pool, cudaStream_t s) {
    if (!p || !pool)
        return fail(cudaErrorInvalidValue);
    CUdeviceptr d;
    CUresult r = cuMemAllocAsync(&d, size, (CUstream)s);
    if (r != CUDA_SUCCESS)
        return rt(r);
    *p = PTR(d);
    rt_remember((uintptr_t)d, size, ((struct fake_pool *)pool)->device);
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t size, unsigned int flags) {
    return rt(cuMemHostAlloc(p, size, flags));
}

cudaError_t cudaFreeHost(void *p) { return rt(cuMemFreeHost(p)); }

cudaError_t cudaHostGetDevicePointer(void **dev, void *host, unsigned int flags) {
    if (!dev || !host || flags)
        return fail(cudaErrorInvalidValue);
    *dev = host; /* one address space: mapped host memory has the same address */
    return cudaSuccess;
}

cudaError_t cudaHostRegister(void *p, size_t size, unsigned int flags) {
    (void)flags;
    if (!p || !size)
        return fail(cudaErrorInvalidValue);
    add((int64_t *)&registered_live, 1);
    return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *p) {
    if (!p)
        return fail(cudaErrorInvalidValue);
    add((int64_t *)&registered_live, -1);
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
    if (!a)
        return fail(cudaErrorInvalidValue);
    memset(a, 0, sizeof *a);
    struct rt_alloc found;
    if (p && rt_find((uintptr_t)p, &found)) {
        a->type = cudaMemoryTypeDevice;
        a->device = found.device;
        a->devicePointer = (void *)p;
    } else {
        a->type = cudaMemoryTypeUnregistered;
        a->device = -2;
        a->hostPointer = (void *)p;
    }
    return cudaSuccess;
}

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p) {
    (void)h, (void)p;
    return fail(cudaErrorNotSupported);
}
cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned int flags) {
    (void)p, (void)h, (void)flags;
    return fail(cudaErrorNotSupported);
}
cudaError_t cudaIpcCloseMemHandle(void *p) {
    (void)p;
    return fail(cudaErrorNotSupported);
}

/* Copies and sets: the driver's, by kind (one address space, so any kind copies). */
static cudaError_t copy(void *dst, const void *src, size_t n, cudaStream_t s, int sync) {
    CUdeviceptr d = (CUdeviceptr)(uintptr_t)dst, sp = (CUdeviceptr)(uintptr_t)src;
    return rt(sync ? cuMemcpyDtoD_v2(d, sp, n) : cuMemcpyDtoDAsync_v2(d, sp, n, (CUstream)s));
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
    (void)kind;
    return copy(dst, src, n, NULL, 1);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                            cudaStream_t s) {
    (void)kind;
    return copy(dst, src, n, s, 0);
}

cudaError_t cudaMemcpyBatchAsync(void *const *dsts, const void *const *srcs, const size_t *sizes,
                                 size_t count, struct cudaMemcpyAttributes *attrs,
                                 size_t *attrs_idxs, size_t num_attrs, cudaStream_t s) {
    (void)attrs, (void)attrs_idxs, (void)num_attrs;
    if (!dsts || !srcs || !sizes)
        return fail(cudaErrorInvalidValue);
    for (size_t i = 0; i < count; i++) {
        cudaError_t e = copy(dsts[i], srcs[i], sizes[i], s, 0);
        if (e != cudaSuccess)
            return e;
    }
    return cudaSuccess;
}

cudaError_t cudaMemset(void *p, int v, size_t n) {
    return rt(cuMemsetD8_v2((CUdeviceptr)(uintptr_t)p, (unsigned char)v, n));
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
    return rt(cuMemsetD8Async((CUdeviceptr)(uintptr_t)p, (unsigned char)v, n, (CUstream)s));
}

/* ---- streams, events, host functions, capture ---------------------------------------- */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
    ensure_ctx();
    return rt(cuStreamCreate((CUstream *)s, flags));
}
cudaError_t cudaStreamDestroy(cudaStream_t s) { return rt(cuStreamDestroy_v2((CUstream)s)); }
/* A stream's id: unique per live stream (its handle; the per-thread stream, the calling
 * thread's own). */
cudaError_t cudaStreamGetId(cudaStream_t s, unsigned long long *id) {
    if (!id)
        return fail(cudaErrorInvalidValue);
    struct fake_stream *st = stream_of((CUstream)s);
    if (!st)
        return fail(cudaErrorInvalidResourceHandle);
    *id = (unsigned long long)(uintptr_t)st;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) { return rt(cuStreamSynchronize((CUstream)s)); }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
    return rt(cuStreamWaitEvent((CUstream)s, (CUevent)e, flags));
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { return rt(cuEventCreate((CUevent *)e, 0)); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
    return rt(cuEventCreate((CUevent *)e, flags));
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { return rt(cuEventDestroy_v2((CUevent)e)); }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    return rt(cuEventRecord((CUevent)e, (CUstream)s));
}
cudaError_t cudaEventQuery(cudaEvent_t e) { return rt(cuEventQuery((CUevent)e)); }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { return rt(cuEventSynchronize((CUevent)e)); }

cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *data) {
    bump(&host_funcs);
    return rt(cuLaunchHostFunc((CUstream)s, fn, data));
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status) {
    int st = 0;
    CUresult r = cuStreamIsCapturing((CUstream)s, &st);
    if (r != CUDA_SUCCESS)
        return rt(r);
    if (!status)
        return fail(cudaErrorInvalidValue);
    *status = (enum cudaStreamCaptureStatus)st;
    return cudaSuccess;
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, enum cudaStreamCaptureStatus *status,
                                     unsigned long long *id, cudaGraph_t *graph,
                                     const cudaGraphNode_t **deps,
                                     const cudaGraphEdgeData **edges, size_t *ndeps) {
    cudaError_t e = cudaStreamIsCapturing(s, status);
    if (e != cudaSuccess)
        return e;
    if (*status != cudaStreamCaptureStatusNone)
        return fail(cudaErrorNotSupported); /* NCCL's graph path is not modelled */
    if (id)
        *id = 0;
    if (graph)
        *graph = NULL;
    if (deps)
        *deps = NULL;
    if (edges)
        *edges = NULL;
    if (ndeps)
        *ndeps = 0;
    return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
    return rt(cuThreadExchangeStreamCaptureMode((int *)mode));
}

/* NCCL calls these only on a capturing stream, which `cudaStreamGetCaptureInfo` refuses. */
cudaError_t cudaStreamUpdateCaptureDependencies(cudaStream_t s, cudaGraphNode_t *deps,
                                                const cudaGraphEdgeData *data, size_t n,
                                                unsigned int flags) {
    (void)s, (void)deps, (void)data, (void)n, (void)flags;
    return fail(cudaErrorNotSupported);
}
cudaError_t cudaGraphAddDependencies(cudaGraph_t g, const cudaGraphNode_t *from,
                                     const cudaGraphNode_t *to, const cudaGraphEdgeData *data,
                                     size_t n) {
    (void)g, (void)from, (void)to, (void)data, (void)n;
    return fail(cudaErrorNotSupported);
}
cudaError_t cudaGraphAddEventRecordNode(cudaGraphNode_t *node, cudaGraph_t g,
                                        const cudaGraphNode_t *deps, size_t n, cudaEvent_t e) {
    (void)node, (void)g, (void)deps, (void)n, (void)e;
    return fail(cudaErrorNotSupported);
}
cudaError_t cudaGraphRetainUserObject(cudaGraph_t g, cudaUserObject_t o, unsigned int count,
                                      unsigned int flags) {
    (void)g, (void)o, (void)count, (void)flags;
    return fail(cudaErrorNotSupported);
}
cudaError_t cudaUserObjectCreate(cudaUserObject_t *o, void *p, cudaHostFn_t destroy,
                                 unsigned int refs, unsigned int flags) {
    (void)o, (void)p, (void)destroy, (void)refs, (void)flags;
    return fail(cudaErrorNotSupported);
}

/* ---- kernels ------------------------------------------------------------------------ */

cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes *a, const void *fn) {
    if (!a || !fn)
        return fail(cudaErrorInvalidDeviceFunction);
    memset(a, 0, sizeof *a);
    a->maxThreadsPerBlock = 1024;
    a->numRegs = 64;
    a->ptxVersion = 90;
    a->binaryVersion = 90;
    return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void *fn, enum cudaFuncAttribute attr, int value) {
    (void)attr, (void)value;
    return fn ? cudaSuccess : fail(cudaErrorInvalidDeviceFunction);
}

/* A kernel's function handle: its host stub's address. */
cudaError_t cudaGetFuncBySymbol(cudaFunction_t *f, const void *sym) {
    if (!f || !sym)
        return fail(cudaErrorInvalidDeviceFunction);
    *f = (cudaFunction_t)sym;
    return cudaSuccess;
}

/* The driver's launch configuration (CUlaunchConfig), as cuda.h lays it out. */
struct fake_launch_config {
    unsigned grid[3], block[3], shared;
    CUstream stream;
    void *attrs;
    unsigned num_attrs;
};

/* A kernel of NCCL's: recorded on its stream (counted), never run. */
static CUresult launch_nccl_kernel(const void *f, CUstream s) {
    STICKY();
    if (!f)
        return CUDA_ERROR_INVALID_VALUE;
    if (!stream_of(s))
        return CUDA_ERROR_INVALID_HANDLE;
    bump(&kernel_launches);
    stream_op(s, 0, 0, 0, 0, "NCCL kernel (not run)");
    return CUDA_SUCCESS;
}

static CUresult fake_cuLaunchKernelEx(const struct fake_launch_config *cfg, const void *f,
                                      void **params, void **extra) {
    (void)params, (void)extra;
    if (!cfg)
        return CUDA_ERROR_INVALID_VALUE;
    return launch_nccl_kernel(f, cfg->stream);
}

static CUresult fake_cuLaunchKernel(const void *f, unsigned gx, unsigned gy, unsigned gz,
                                    unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                    CUstream s, void **params, void **extra) {
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shared, (void)params;
    (void)extra;
    return launch_nccl_kernel(f, s);
}

static CUresult fake_cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    struct rt_alloc found;
    if (!rt_find((uintptr_t)p, &found))
        return CUDA_ERROR_NOT_FOUND;
    if (base)
        *base = (CUdeviceptr)found.p;
    if (size)
        *size = found.n;
    return CUDA_SUCCESS;
}

/* CUpointer_attribute: the ones NCCL asks; any other is not supported. */
static CUresult fake_cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    struct rt_alloc found;
    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    if (!rt_find((uintptr_t)p, &found))
        return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case 2: /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE: CU_MEMORYTYPE_DEVICE */
        *(unsigned *)data = 2;
        return CUDA_SUCCESS;
    case 9: /* CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL */
        *(int *)data = found.device;
        return CUDA_SUCCESS;
    case 11: /* CU_POINTER_ATTRIBUTE_RANGE_START_ADDR */
        *(CUdeviceptr *)data = (CUdeviceptr)found.p;
        return CUDA_SUCCESS;
    case 12: /* CU_POINTER_ATTRIBUTE_RANGE_SIZE */
        *(size_t *)data = found.n;
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_NOT_SUPPORTED;
    }
}

/* cuMemGetAllocationGranularity: 2 MiB, an H100's. NCCL 2.28 asks it unconditionally when
 * it sets up windows (dev_runtime.cc:87), as every driver since CUDA 10.2 has it. */
static CUresult fake_cuMemGetAllocationGranularity(size_t *granularity, const void *prop,
                                                   int option) {
    (void)option;
    if (!granularity || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = (size_t)2 << 20;
    return CUDA_SUCCESS;
}

/* Every other entry point NCCL fetches exists, as on a real driver, and fails: VMM,
 * multicast, stream memory operations, DMA-BUF. The device's attributes say it has none of
 * them (cuDeviceGetAttribute answers 0), so NCCL keeps to cudaMalloc, sockets and
 * host-side flags; a call made anyway gets CUDA_ERROR_NOT_SUPPORTED, not a null pointer.
 * (One function for every signature: its arguments are ignored, which the x86-64 and
 * AArch64 calling conventions allow.) */
static CUresult not_modelled(void) { return CUDA_ERROR_NOT_SUPPORTED; }

static const char *const not_modelled_names[] = {
    "cuCtxCreate", "cuCtxDestroy", "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate",
    "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle", "cuMemMap",
    "cuMemRelease", "cuMemRetainAllocationHandle", "cuMemSetAccess", "cuMemUnmap",
    "cuMemGetAllocationPropertiesFromHandle", "cuMemGetHandleForAddressRange",
    "cuMulticastAddDevice", "cuMulticastBindMem", "cuMulticastBindAddr", "cuMulticastCreate",
    "cuMulticastGetGranularity", "cuMulticastUnbind", "cuStreamBatchMemOp",
    "cuStreamWaitValue32", "cuStreamWaitValue64", "cuStreamWriteValue32",
    "cuStreamWriteValue64",
};

/* The driver entry points NCCL fetches (misc/cudawrap.cc). */
static void *entry_point(const char *symbol) {
    static const struct {
        const char *name;
        void *fn;
    } table[] = {
        {"cuGetErrorString", (void *)cuGetErrorString},
        {"cuGetErrorName", (void *)cuGetErrorName},
        {"cuDeviceGet", (void *)cuDeviceGet},
        {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute},
        {"cuMemGetAddressRange", (void *)fake_cuMemGetAddressRange},
        {"cuCtxGetCurrent", (void *)cuCtxGetCurrent},
        {"cuCtxSetCurrent", (void *)cuCtxSetCurrent},
        {"cuCtxGetDevice", (void *)cuCtxGetDevice},
        {"cuLaunchKernel", (void *)fake_cuLaunchKernel},
        {"cuLaunchKernelEx", (void *)fake_cuLaunchKernelEx},
        {"cuPointerGetAttribute", (void *)fake_cuPointerGetAttribute},
        {"cuMemGetAllocationGranularity", (void *)fake_cuMemGetAllocationGranularity},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(table[i].name, symbol) == 0)
            return table[i].fn;
    for (size_t i = 0; i < sizeof not_modelled_names / sizeof not_modelled_names[0]; i++)
        if (strcmp(not_modelled_names[i], symbol) == 0)
            return (void *)not_modelled;
    return NULL;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                             unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status) {
    (void)version, (void)flags;
    if (!symbol || !fn)
        return fail(cudaErrorInvalidValue);
    *fn = entry_point(symbol);
    if (status)
        *status = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
    return cudaSuccess;
}

cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **fn, unsigned long long flags,
                                    enum cudaDriverEntryPointQueryResult *status) {
    return cudaGetDriverEntryPointByVersion(symbol, fn, CUDART_VERSION, flags, status);
}

/* ---- what the tests observe ---------------------------------------------------------- */

/* 0: NCCL kernels launched; 1: host functions enqueued; 2: memory pools alive; 3: host
 * ranges registered now; -1 past the last. */
int64_t fake_cudart_gauge(int which) {
    switch (which) {
    case 0: return (int64_t)__atomic_load_n(&kernel_launches, __ATOMIC_RELAXED);
    case 1: return (int64_t)__atomic_load_n(&host_funcs, __ATOMIC_RELAXED);
    case 2: return (int64_t)__atomic_load_n(&pools_live, __ATOMIC_RELAXED);
    case 3: return (int64_t)__atomic_load_n(&registered_live, __ATOMIC_RELAXED);
    default: return -1;
    }
}
