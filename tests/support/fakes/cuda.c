/*
 * A fake CUDA driver (`libcuda.so`) for tests on machines without a GPU.
 *
 * It implements the driver entry points that cudarc and nccl-safe call, with "device
 * memory" that is host memory and streams on which every operation completes inside the
 * call. Paired with the host provider presented as NCCL, it runs nccl-safe's CUDA code
 * path (cudarc buffers, streams, events, the watchdog's CUDA tracker) on a CPU.
 *
 * What the tests control and observe, through the `fake_cuda_*` functions at the end:
 * - every entry point's calls are counted, in all and on the threads a test marks as the
 *   caller's (the per-operation path must make no driver call of its own);
 * - a stream can be stalled: events recorded on it stay incomplete, and synchronizing it
 *   blocks, as behind a kernel that never ends (the wait gives up after a bound, counted,
 *   so that a test fails rather than hangs);
 * - the device can be held behind (`fake_cuda_hold_completion`): every event's query reads
 *   not ready, as while a GPU still runs the work before it, until released; so a test
 *   decides when the watchdog may first see work complete;
 * - a stream can report a capture in progress. An event recorded on it then is a captured
 *   event, counted: as CUDA's, it stands for no work on the stream, and a query or a
 *   synchronization of it fails with CUDA_ERROR_CAPTURED_EVENT until it is recorded again
 *   outside a capture. A query made while the capture that recorded it is still open
 *   (which CUDA calls invalid) is counted as well, so that tests can forbid it; and the
 *   fake NCCL asks which capture a launch falls in (`fake_cuda_capture_of`, uncounted);
 * - streams, events and allocations alive now, to find leaks and double releases;
 * - on request (`fake_cuda_check_order`), the order CUDA guarantees between streams: see
 *   "stream order" below. Work still runs inside the call, in the order the host issued it
 *   (one of the orders a GPU may pick); the model reports every pair of accesses to the
 *   same memory, one a write, that CUDA leaves unordered, because a GPU may run those in
 *   the other order;
 * - a few of candle's kernels (by name, run on the host) for the candle crate's tests.
 *
 * Built by the test support code with the system C compiler; it is not part of the crate.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fake_ctx *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_event *CUevent;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_CAPTURED_EVENT = 907,
};

#define MAX_DEVICES 16
#define MAX_STREAMS 4096
#define STALL_WAIT_LIMIT_MS 5000

/* ---- call counting ---------------------------------------------------------------- */

#define CALLS(X)                                                                          \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) X(cuDeviceGet)                    \
    X(cuDeviceGetAttribute) X(cuDeviceGetName) X(cuDeviceTotalMem_v2) X(cuDeviceGetUuid)  \
    X(cuDeviceGetUuid_v2) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease_v2)     \
    X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxGetDevice) X(cuCtxSynchronize)           \
    X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) X(cuCtxGetStreamPriorityRange)           \
    X(cuStreamCreate) X(cuStreamCreateWithPriority) X(cuStreamDestroy_v2)                 \
    X(cuStreamSynchronize) X(cuStreamQuery) X(cuStreamWaitEvent) X(cuStreamIsCapturing)   \
    X(cuThreadExchangeStreamCaptureMode) X(cuLaunchHostFunc) X(cuEventCreate)             \
    X(cuEventDestroy_v2) X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize)           \
    X(cuEventElapsedTime) X(cuEventElapsedTime_v2) X(cuMemAlloc_v2) X(cuMemFree_v2)       \
    X(cuMemAllocAsync) X(cuMemFreeAsync) X(cuMemcpyHtoDAsync_v2) X(cuMemcpyDtoHAsync_v2)  \
    X(cuMemcpyDtoDAsync_v2) X(cuMemcpyHtoD_v2) X(cuMemcpyDtoH_v2) X(cuMemcpyDtoD_v2)      \
    X(cuMemsetD8Async) X(cuMemsetD8_v2) X(cuMemHostAlloc) X(cuMemFreeHost)                \
    X(cuMemGetInfo_v2) X(cuGetErrorString) X(cuGetErrorName) X(cuModuleLoadData)          \
    X(cuModuleUnload) X(cuModuleGetFunction) X(cuLaunchKernel)

#define ENUM(f) N_##f,
enum { CALLS(ENUM) N_CALLS };
#undef ENUM
#define NAME(f) #f,
static const char *const call_names[N_CALLS] = {CALLS(NAME)};
#undef NAME

static uint64_t calls_all[N_CALLS];
static uint64_t calls_marked[N_CALLS];
static __thread int thread_marked;

#define COUNT(f)                                                                          \
    do {                                                                                  \
        __atomic_fetch_add(&calls_all[N_##f], 1, __ATOMIC_RELAXED);                       \
        if (thread_marked)                                                                \
            __atomic_fetch_add(&calls_marked[N_##f], 1, __ATOMIC_RELAXED);                \
    } while (0)

static int64_t live_streams, live_events, live_allocs, live_host_allocs;
static uint64_t records_on_capturing, queries_in_capture, stalled_waits, stalled_wait_timeouts, bad_handles;
/* Releases (NCCL's teardown through the driver) that waited behind a stall; in progress. */
static uint64_t release_waits;
static int64_t releases_blocked;

static void add(int64_t *v, int64_t d) { __atomic_fetch_add(v, d, __ATOMIC_RELAXED); }
static void bump(uint64_t *v) { __atomic_fetch_add(v, 1, __ATOMIC_RELAXED); }

/* ---- devices, contexts ---------------------------------------------------------------- */

struct fake_ctx {
    int device;
};

static int device_count = 8;

/* A sticky error (0: none), as a device fault leaves the context: from the moment it is
 * set, every call that touches the device's work (queries, records, synchronizations,
 * copies, frees, launches) returns it, as CUDA's do after, say, an illegal address. Set
 * by `fake_cuda_sticky_error`. */
static int sticky_error;

/* Set by `fake_cuda_hold_completion`: every event query reads not ready (captured events
 * still fail as CUDA's do: the hold models a device behind, not a capture). */
static int completion_held;
#define STICKY()                                                                          \
    do {                                                                                  \
        int sticky_ = __atomic_load_n(&sticky_error, __ATOMIC_ACQUIRE);                   \
        if (sticky_)                                                                      \
            return (CUresult)sticky_;                                                     \
    } while (0)
static struct fake_ctx contexts[MAX_DEVICES];

static int valid_device(CUdevice d) { return d >= 0 && d < device_count; }

/* ---- streams, events ----------------------------------------------------------------- */

#define MAX_CLOCKS 128

/* A vector clock: `vc[k]` counts the operations of the stream with clock id k known to be
 * done before this point. Id 0: none assigned yet (or none left). */
struct clock {
    int id;
    uint32_t vc[MAX_CLOCKS];
};

struct fake_stream {
    struct clock clock; /* stream order (only while `order_on`) */
    int in_use;
    int device;
    int stalled;     /* work queued now never completes, until released */
    uint64_t gen;    /* bumped at each release */
    int capturing;   /* reports CU_STREAM_CAPTURE_STATUS_ACTIVE */
    uint64_t capture_gen; /* bumped as each capture begins */
};

static struct fake_stream streams[MAX_STREAMS];
static struct fake_stream default_stream; /* the legacy stream (a null handle) */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t released = PTHREAD_COND_INITIALIZER;

/* CU_STREAM_PER_THREAD (handle 2) is the calling thread's own stream, as in CUDA: one per
 * host thread (given at first use, never freed; past MAX_THREAD_STREAMS threads share the
 * last), on the device current at first use. Stalling it from one thread stalls only that
 * thread's. */
#define MAX_THREAD_STREAMS 64
static struct fake_stream thread_streams[MAX_THREAD_STREAMS];
static int thread_streams_given;
static __thread struct fake_stream *my_thread_stream;
static __thread CUcontext current;

static struct fake_stream *per_thread_stream(void) {
    if (!my_thread_stream) {
        int i = __atomic_fetch_add(&thread_streams_given, 1, __ATOMIC_RELAXED);
        my_thread_stream = &thread_streams[i < MAX_THREAD_STREAMS ? i : MAX_THREAD_STREAMS - 1];
        pthread_mutex_lock(&lock);
        my_thread_stream->device = current ? current->device : 0;
        my_thread_stream->in_use = 1;
        pthread_mutex_unlock(&lock);
    }
    return my_thread_stream;
}

static int is_thread_stream(const struct fake_stream *st) {
    return st >= &thread_streams[0] && st < &thread_streams[MAX_THREAD_STREAMS];
}

static void wait_unstalled_as(struct fake_stream *st, uint64_t *counter);

/* Waits (bounded, counting in `counter`) for every stalled stream of `device` (-1: every
 * device), the per-thread streams of all threads included. */
static void wait_device_streams(int device, uint64_t *counter) {
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i].in_use && (device < 0 || streams[i].device == device))
            wait_unstalled_as(&streams[i], counter);
    for (int i = 0; i < MAX_THREAD_STREAMS; i++)
        if (__atomic_load_n(&thread_streams[i].in_use, __ATOMIC_ACQUIRE) &&
            (device < 0 || thread_streams[i].device == device))
            wait_unstalled_as(&thread_streams[i], counter);
}

static struct fake_stream *stream_of(CUstream s) {
    if (s == (CUstream)2)
        return per_thread_stream();
    if (s == NULL || s == (CUstream)1)
        return &default_stream;
    if (s < &streams[0] || s >= &streams[MAX_STREAMS] || !s->in_use) {
        bump(&bad_handles);
        return NULL;
    }
    return s;
}

#define EVENT_MAGIC 0x4556454e54ull
struct fake_event {
    uint64_t magic;
    struct fake_stream *stream; /* NULL: never recorded */
    int pending;                /* recorded while its stream was stalled */
    uint64_t gen;
    int captured;               /* last recorded on a capturing stream */
    uint64_t capture_gen;       /* that capture, as its stream's `capture_gen` */
    uint32_t vc[MAX_CLOCKS];    /* the recording stream's clock at the record */
};

static int event_ok(CUevent e) {
    if (e == NULL || e->magic != EVENT_MAGIC) {
        bump(&bad_handles);
        return 0;
    }
    return 1;
}

/* Whether an event's work is done. Call with `lock` held. */
static int event_done(CUevent e) {
    return !(e->pending && e->stream->stalled && e->stream->gen == e->gen);
}

/* Waits (bounded) until the stream is no longer stalled; counts the wait in `counter`. */
static void wait_unstalled_as(struct fake_stream *st, uint64_t *counter) {
    pthread_mutex_lock(&lock);
    if (st->stalled) {
        bump(counter);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += STALL_WAIT_LIMIT_MS / 1000;
        while (st->stalled) {
            if (pthread_cond_timedwait(&released, &lock, &until) != 0) {
                bump(&stalled_wait_timeouts);
                break;
            }
        }
    }
    pthread_mutex_unlock(&lock);
}

/* Waits (bounded) until the stream is no longer stalled: a synchronization of it. */
static void wait_unstalled(struct fake_stream *st) {
    wait_unstalled_as(st, &stalled_waits);
}

/* ---- stream order ---------------------------------------------------------------------
 *
 * CUDA's rules, as vector clocks (off unless a test calls `fake_cuda_check_order(1)`):
 * - work on one stream runs in issue order;
 * - `cuEventRecord(e, s)` captures the work issued to `s` so far; `cuStreamWaitEvent(t, e)`
 *   orders the work later issued to `t` after it;
 * - a host synchronization (`cuStreamSynchronize`, `cuEventSynchronize`,
 *   `cuCtxSynchronize`, the synchronous `cuMemFree`) orders whatever that thread issues
 *   afterwards, on any stream, after the work it waited for;
 * - nothing else orders two streams: not issue order on the host, not the per-thread or
 *   legacy stream (cudarc's streams are non-blocking), not the same thread.
 * Each access (copies, memsets, kernels, frees, and NCCL's through `fake_cuda_access`) is
 * checked against the earlier accesses to overlapping memory: a pair on two streams, one
 * of them a write, with the earlier not ordered before the later, is a race. A free removes
 * its allocation's accesses (the allocator orders reuse itself). The per-thread stream
 * (`CU_STREAM_PER_THREAD`, candle's) has a clock per host thread. */

static int order_on;
static uint64_t races, accesses_checked, untracked_ops, unknown_kernels;
static char last_race[512];
static __thread uint32_t host_vc[MAX_CLOCKS];
static __thread struct clock per_thread_clock;
static int clocks_given;

struct access {
    uint64_t lo, hi;
    int id;
    uint32_t epoch;
    int write;
    const char *what;
};
static struct access *log_;
static size_t log_len, log_cap;

struct allocation {
    uint64_t p;
    size_t n;
};
static struct allocation *allocs_;
static size_t allocs_len, allocs_cap;

static void merge(uint32_t *into, const uint32_t *from) {
    for (int k = 0; k < MAX_CLOCKS; k++)
        if (from[k] > into[k])
            into[k] = from[k];
}

/* The clock of stream handle `s`. Call with `lock` held. */
static struct clock *clock_of(CUstream s) {
    if (s == (CUstream)2)
        return &per_thread_clock;
    struct fake_stream *st = stream_of(s);
    return st ? &st->clock : NULL;
}

/* One more operation issued to `c`: after what this thread has synchronized with. Returns
 * 0 when no clock id is left (the operation is not tracked). Call with `lock` held. */
static int tick(struct clock *c) {
    if (!c->id) {
        if (clocks_given + 1 >= MAX_CLOCKS) {
            bump(&untracked_ops);
            return 0;
        }
        c->id = ++clocks_given;
    }
    merge(c->vc, host_vc);
    c->vc[c->id]++;
    return 1;
}

static void note_race(const struct access *a, const struct access *b) {
    races++;
    snprintf(last_race, sizeof last_race,
             "%s (%s, stream clock %d) of [%#llx, %#llx) and %s (%s, stream clock %d) of "
             "[%#llx, %#llx) are not ordered",
             a->write ? "write" : "read", a->what, a->id, (unsigned long long)a->lo,
             (unsigned long long)a->hi, b->write ? "write" : "read", b->what, b->id,
             (unsigned long long)b->lo, (unsigned long long)b->hi);
}

/* Checks and logs an access of [p, p + n) by the operation just counted on clock `c`.
 * Call with `lock` held, after `tick`. */
static void access_as(struct clock *c, uint64_t p, size_t n, int write, const char *what) {
    if (!n)
        return;
    struct access a = {p, p + n, c->id, c->vc[c->id], write, what};
    bump(&accesses_checked);
    for (size_t i = 0; i < log_len; i++) {
        const struct access *b = &log_[i];
        if (b->hi <= a.lo || a.hi <= b->lo || b->id == a.id || !(a.write || b->write))
            continue;
        if (b->epoch > c->vc[b->id])
            note_race(b, &a);
    }
    if (log_len == log_cap) {
        log_cap = log_cap ? 2 * log_cap : 1024;
        log_ = realloc(log_, log_cap * sizeof *log_);
        if (!log_)
            abort();
    }
    log_[log_len++] = a;
}

/* An operation on stream `s` that reads `rn` bytes at `r` and writes `wn` bytes at `w`. */
static void stream_op(CUstream s, uint64_t r, size_t rn, uint64_t w, size_t wn,
                      const char *what) {
    if (!__atomic_load_n(&order_on, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&lock);
    struct clock *c = clock_of(s);
    if (c && tick(c)) {
        access_as(c, r, rn, 0, what);
        access_as(c, w, wn, 1, what);
    }
    pthread_mutex_unlock(&lock);
}

/* The allocation's size (0 when unknown), forgotten. Call with `lock` held. */
static size_t forget_allocation(uint64_t p) {
    for (size_t i = 0; i < allocs_len; i++) {
        if (allocs_[i].p == p) {
            size_t n = allocs_[i].n;
            allocs_[i] = allocs_[--allocs_len];
            return n;
        }
    }
    return 0;
}

static void remember_allocation(uint64_t p, size_t n) {
    if (!__atomic_load_n(&order_on, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&lock);
    if (allocs_len == allocs_cap) {
        allocs_cap = allocs_cap ? 2 * allocs_cap : 256;
        allocs_ = realloc(allocs_, allocs_cap * sizeof *allocs_);
        if (!allocs_)
            abort();
    }
    allocs_[allocs_len++] = (struct allocation){p, n};
    pthread_mutex_unlock(&lock);
}

/* A free of `p`, on stream `s` (NULL: the synchronous free, after the host's sync): a write
 * of the whole allocation, then its accesses are forgotten. */
static void free_op(CUstream s, uint64_t p) {
    if (!__atomic_load_n(&order_on, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&lock);
    size_t n = forget_allocation(p);
    struct clock *c = s ? clock_of(s) : NULL;
    if (c && n && tick(c))
        access_as(c, p, n, 1, "free");
    size_t kept = 0;
    for (size_t i = 0; i < log_len; i++)
        if (!(n && log_[i].lo >= p && log_[i].lo < p + n))
            log_[kept++] = log_[i];
    log_len = kept;
    pthread_mutex_unlock(&lock);
}

/* This thread waited for the work `vc` stands for. */
static void host_sync(const uint32_t *vc) {
    if (!__atomic_load_n(&order_on, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&lock);
    merge(host_vc, vc);
    pthread_mutex_unlock(&lock);
}

/* This thread waited for the work issued to stream `s` so far. */
static void host_sync_stream(CUstream s) {
    if (!__atomic_load_n(&order_on, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&lock);
    struct clock *c = clock_of(s);
    if (c)
        merge(host_vc, c->vc);
    pthread_mutex_unlock(&lock);
}

/* This thread waited for every stream of `device` (-1: of every device), its own
 * per-thread stream included. */
static void host_sync_device(int device) {
    if (!__atomic_load_n(&order_on, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&lock);
    merge(host_vc, per_thread_clock.vc);
    merge(host_vc, default_stream.clock.vc);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i].in_use && (device < 0 || streams[i].device == device))
            merge(host_vc, streams[i].clock.vc);
    pthread_mutex_unlock(&lock);
}

/* ---- the driver API ------------------------------------------------------------------- */

CUresult cuInit(unsigned int flags) {
    COUNT(cuInit);
    (void)flags;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *v) {
    COUNT(cuDriverGetVersion);
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    *v = 12080;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *n) {
    COUNT(cuDeviceGetCount);
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    *n = device_count;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    COUNT(cuDeviceGet);
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *v, int attrib, CUdevice d) {
    COUNT(cuDeviceGetAttribute);
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d))
        return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case 75: /* compute capability major */
        *v = 9;
        break;
    case 115: /* memory pools supported: cudarc then allocates with cuMemAllocAsync */
        *v = 1;
        break;
    default:
        *v = 0;
    }
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    COUNT(cuDeviceGetName);
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "nccl-safe fake CUDA device %d", d);
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    COUNT(cuDeviceTotalMem_v2);
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)1 << 32;
    return CUDA_SUCCESS;
}

static CUresult uuid(unsigned char *out, CUdevice d) {
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d))
        return CUDA_ERROR_INVALID_DEVICE;
    memset(out, 0, 16);
    out[0] = 0xfa;
    out[15] = (unsigned char)d;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(unsigned char *out, CUdevice d) {
    COUNT(cuDeviceGetUuid);
    return uuid(out, d);
}

CUresult cuDeviceGetUuid_v2(unsigned char *out, CUdevice d) {
    COUNT(cuDeviceGetUuid_v2);
    return uuid(out, d);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) {
    COUNT(cuDevicePrimaryCtxRetain);
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d))
        return CUDA_ERROR_INVALID_DEVICE;
    contexts[d].device = d;
    *ctx = &contexts[d];
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    COUNT(cuDevicePrimaryCtxRelease_v2);
    return valid_device(d) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    COUNT(cuCtxGetCurrent);
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    *ctx = current;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    COUNT(cuCtxSetCurrent);
    current = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *d) {
    COUNT(cuCtxGetDevice);
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    *d = current->device;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    COUNT(cuCtxSynchronize);
    STICKY();
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    wait_device_streams(current->device, &stalled_waits);
    host_sync_device(current->device);
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    COUNT(cuCtxPushCurrent_v2);
    current = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *ctx) {
    COUNT(cuCtxPopCurrent_v2);
    if (ctx)
        *ctx = current;
    current = NULL;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    COUNT(cuCtxGetStreamPriorityRange);
    if (least)
        *least = 0;
    if (greatest)
        *greatest = -5;
    return CUDA_SUCCESS;
}

static CUresult new_stream(CUstream *s) {
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_STREAMS; i++) {
        if (!streams[i].in_use) {
            memset(&streams[i], 0, sizeof streams[i]);
            streams[i].in_use = 1;
            streams[i].device = current->device;
            pthread_mutex_unlock(&lock);
            add(&live_streams, 1);
            *s = &streams[i];
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuStreamCreate(CUstream *s, unsigned int flags) {
    COUNT(cuStreamCreate);
    (void)flags;
    return new_stream(s);
}

CUresult cuStreamCreateWithPriority(CUstream *s, unsigned int flags, int priority) {
    COUNT(cuStreamCreateWithPriority);
    (void)flags;
    (void)priority;
    return new_stream(s);
}

CUresult cuStreamDestroy_v2(CUstream s) {
    COUNT(cuStreamDestroy_v2);
    struct fake_stream *st = stream_of(s);
    if (!st || st == &default_stream || is_thread_stream(st))
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    st->in_use = 0;
    __atomic_store_n(&st->stalled, 0, __ATOMIC_RELEASE);
    st->gen++;
    pthread_cond_broadcast(&released);
    pthread_mutex_unlock(&lock);
    add(&live_streams, -1);
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream s) {
    COUNT(cuStreamSynchronize);
    STICKY();
    struct fake_stream *st = stream_of(s);
    if (!st)
        return CUDA_ERROR_INVALID_HANDLE;
    wait_unstalled(st);
    host_sync_stream(s);
    return CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream s) {
    COUNT(cuStreamQuery);
    STICKY();
    struct fake_stream *st = stream_of(s);
    if (!st)
        return CUDA_ERROR_INVALID_HANDLE;
    return __atomic_load_n(&st->stalled, __ATOMIC_ACQUIRE) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags) {
    COUNT(cuStreamWaitEvent);
    STICKY();
    (void)flags;
    if (!stream_of(s) || !event_ok(e))
        return CUDA_ERROR_INVALID_HANDLE;
    if (__atomic_load_n(&order_on, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&lock);
        struct clock *c = clock_of(s);
        if (c && e->stream)
            merge(c->vc, e->vc);
        pthread_mutex_unlock(&lock);
    }
    return CUDA_SUCCESS;
}

/* Whether the calling thread may use stream `st`: CUDA does not document whether a call on
 * a stream of its own needs the stream's context current, so this fake takes the unkind
 * reading (cuda-api-wrappers found recording without it unreliable): no current context,
 * or another device's, is CUDA_ERROR_INVALID_CONTEXT. The legacy and per-thread streams
 * are the current context's, so only a current context is needed. */
static CUresult context_for(const struct fake_stream *st) {
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (st >= &streams[0] && st < &streams[MAX_STREAMS] && st->device != current->device)
        return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream s, int *status) {
    COUNT(cuStreamIsCapturing);
    struct fake_stream *st = stream_of(s);
    if (!st)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = context_for(st);
    if (rc != CUDA_SUCCESS)
        return rc;
    *status = __atomic_load_n(&st->capturing, __ATOMIC_ACQUIRE) ? 1 /* ACTIVE */ : 0 /* NONE */;
    return CUDA_SUCCESS;
}

CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    COUNT(cuThreadExchangeStreamCaptureMode);
    static __thread int thread_mode;
    if (!mode)
        return CUDA_ERROR_INVALID_VALUE;
    int old = thread_mode;
    thread_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

CUresult cuLaunchHostFunc(CUstream s, void (*fn)(void *), void *data) {
    COUNT(cuLaunchHostFunc);
    if (!stream_of(s) || !fn)
        return CUDA_ERROR_INVALID_VALUE;
    fn(data);
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent *e, unsigned int flags) {
    COUNT(cuEventCreate);
    (void)flags;
    if (!e)
        return CUDA_ERROR_INVALID_VALUE;
    struct fake_event *ev = calloc(1, sizeof *ev);
    if (!ev)
        return CUDA_ERROR_OUT_OF_MEMORY;
    ev->magic = EVENT_MAGIC;
    add(&live_events, 1);
    *e = ev;
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent e) {
    COUNT(cuEventDestroy_v2);
    if (!event_ok(e))
        return CUDA_ERROR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    add(&live_events, -1);
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent e, CUstream s) {
    COUNT(cuEventRecord);
    STICKY();
    struct fake_stream *st = stream_of(s);
    if (!st || !event_ok(e))
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = context_for(st);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&lock);
    e->stream = st;
    e->captured = __atomic_load_n(&st->capturing, __ATOMIC_ACQUIRE);
    if (e->captured) {
        /* A captured event: the capture's nodes so far, no work on the stream. */
        bump(&records_on_capturing);
        e->capture_gen = st->capture_gen;
        e->pending = 0;
    } else {
        e->pending = st->stalled;
    }
    e->gen = st->gen;
    if (__atomic_load_n(&order_on, __ATOMIC_ACQUIRE)) {
        /* The work issued to `s` so far, and what this thread synchronized with before. */
        memcpy(e->vc, clock_of(s)->vc, sizeof e->vc);
        merge(e->vc, host_vc);
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* Whether `e` was last recorded in a capture (then its query or synchronization fails);
 * counts it when that capture is still open. Call with `lock` held. */
static int captured_event(CUevent e) {
    if (!e->captured)
        return 0;
    if (__atomic_load_n(&e->stream->capturing, __ATOMIC_ACQUIRE) &&
        e->stream->capture_gen == e->capture_gen)
        bump(&queries_in_capture);
    return 1;
}

CUresult cuEventQuery(CUevent e) {
    COUNT(cuEventQuery);
    STICKY();
    if (!event_ok(e))
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    if (captured_event(e)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_CAPTURED_EVENT;
    }
    int done = !e->stream || (event_done(e) && !__atomic_load_n(&completion_held, __ATOMIC_ACQUIRE));
    pthread_mutex_unlock(&lock);
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuEventSynchronize(CUevent e) {
    COUNT(cuEventSynchronize);
    STICKY();
    if (!event_ok(e))
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    if (captured_event(e)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_CAPTURED_EVENT;
    }
    struct fake_stream *st = e->pending && !event_done(e) ? e->stream : NULL;
    pthread_mutex_unlock(&lock);
    if (st)
        wait_unstalled(st);
    if (__atomic_load_n(&order_on, __ATOMIC_ACQUIRE) && e->stream)
        host_sync(e->vc);
    return CUDA_SUCCESS;
}

static CUresult elapsed(float *ms, CUevent a, CUevent b) {
    if (!ms)
        return CUDA_ERROR_INVALID_VALUE;
    if (!event_ok(a) || !event_ok(b))
        return CUDA_ERROR_INVALID_HANDLE;
    *ms = 0.0f;
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    COUNT(cuEventElapsedTime);
    return elapsed(ms, a, b);
}

CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) {
    COUNT(cuEventElapsedTime_v2);
    return elapsed(ms, a, b);
}

static CUresult alloc(CUdeviceptr *p, size_t bytes) {
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    void *m = calloc(1, bytes ? bytes : 1);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    add(&live_allocs, 1);
    *p = (CUdeviceptr)(uintptr_t)m;
    remember_allocation(*p, bytes);
    return CUDA_SUCCESS;
}

static CUresult release(CUdeviceptr p) {
    if (!p)
        return CUDA_SUCCESS;
    free((void *)(uintptr_t)p);
    add(&live_allocs, -1);
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
    COUNT(cuMemAlloc_v2);
    return alloc(p, bytes);
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    COUNT(cuMemFree_v2);
    STICKY();
    /* As CUDA's: a free waits for the device's work, so it blocks behind a stalled
     * stream (until it is released). */
    if (current) {
        wait_device_streams(current->device, &stalled_waits);
        host_sync_device(current->device);
    }
    free_op(NULL, p);
    return release(p);
}

CUresult cuMemAllocAsync(CUdeviceptr *p, size_t bytes, CUstream s) {
    COUNT(cuMemAllocAsync);
    if (!stream_of(s))
        return CUDA_ERROR_INVALID_HANDLE;
    return alloc(p, bytes);
}

CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    COUNT(cuMemFreeAsync);
    STICKY();
    if (!stream_of(s))
        return CUDA_ERROR_INVALID_HANDLE;
    free_op(s, p);
    return release(p);
}

/* A copy; `rd` and `wd`: whether its source and destination are device memory (tracked by
 * the stream-order model). A synchronous one (`s` NULL) runs on the legacy stream, and the
 * host waits for it. */
#define COPY(name, dst, src, n, s, rd, wd)                                                \
    do {                                                                                  \
        COUNT(name);                                                                      \
        STICKY();                                                                         \
        if ((s) != NULL && !stream_of(s))                                                 \
            return CUDA_ERROR_INVALID_HANDLE;                                             \
        if ((n) && (!(dst) || !(src)))                                                    \
            return CUDA_ERROR_INVALID_VALUE;                                              \
        stream_op((s), (uint64_t)(uintptr_t)(src), (rd) ? (n) : 0,                        \
                  (uint64_t)(uintptr_t)(dst), (wd) ? (n) : 0, #name);                     \
        if ((s) == NULL)                                                                  \
            host_sync_stream(NULL);                                                       \
        if (n)                                                                            \
            memmove((dst), (src), (n));                                                   \
        return CUDA_SUCCESS;                                                              \
    } while (0)

#define PTR(p) ((void *)(uintptr_t)(p))

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    COPY(cuMemcpyHtoDAsync_v2, PTR(dst), src, n, s, 0, 1);
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    COPY(cuMemcpyDtoHAsync_v2, dst, PTR(src), n, s, 1, 0);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    COPY(cuMemcpyDtoDAsync_v2, PTR(dst), PTR(src), n, s, 1, 1);
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    COPY(cuMemcpyHtoD_v2, PTR(dst), src, n, NULL, 0, 1);
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    COPY(cuMemcpyDtoH_v2, dst, PTR(src), n, NULL, 1, 0);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    COPY(cuMemcpyDtoD_v2, PTR(dst), PTR(src), n, NULL, 1, 1);
}

CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
    COUNT(cuMemsetD8Async);
    if (!stream_of(s))
        return CUDA_ERROR_INVALID_HANDLE;
    if (n && !p)
        return CUDA_ERROR_INVALID_VALUE;
    stream_op(s, 0, 0, p, n, "cuMemsetD8Async");
    memset(PTR(p), v, n);
    return CUDA_SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
    COUNT(cuMemsetD8_v2);
    if (n && !p)
        return CUDA_ERROR_INVALID_VALUE;
    stream_op(NULL, 0, 0, p, n, "cuMemsetD8_v2");
    host_sync_stream(NULL);
    memset(PTR(p), v, n);
    return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned int flags) {
    COUNT(cuMemHostAlloc);
    (void)flags;
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    *p = calloc(1, bytes ? bytes : 1);
    if (!*p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    add(&live_host_allocs, 1);
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void *p) {
    COUNT(cuMemFreeHost);
    if (p) {
        free(p);
        add(&live_host_allocs, -1);
    }
    return CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    COUNT(cuMemGetInfo_v2);
    if (free_bytes)
        *free_bytes = (size_t)1 << 31;
    if (total)
        *total = (size_t)1 << 32;
    return CUDA_SUCCESS;
}

static const char *error_text(CUresult r) {
    switch (r) {
    case CUDA_SUCCESS: return "no error";
    case CUDA_ERROR_INVALID_VALUE: return "invalid argument";
    case CUDA_ERROR_OUT_OF_MEMORY: return "out of memory";
    case CUDA_ERROR_INVALID_DEVICE: return "invalid device ordinal";
    case CUDA_ERROR_INVALID_CONTEXT: return "invalid device context";
    case CUDA_ERROR_INVALID_HANDLE: return "invalid resource handle";
    case CUDA_ERROR_NOT_READY: return "device not ready";
    default: return "unknown error";
    }
}

CUresult cuGetErrorString(CUresult r, const char **s) {
    COUNT(cuGetErrorString);
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    *s = error_text(r);
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult r, const char **s) {
    COUNT(cuGetErrorName);
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    *s = error_text(r);
    return CUDA_SUCCESS;
}

/* ---- kernels ---------------------------------------------------------------------------
 *
 * Modules load from any image; a function is found only when the fake knows its name, and
 * then runs on the host inside `cuLaunchKernel` (an unknown name fails with
 * CUDA_ERROR_NOT_FOUND, counted). Known: candle's `copy2d_<type>(src, dst, d1, d2, src_s,
 * dst_s)`, which copies d1 rows of d2 elements between row strides, and `bmul_f32(numel,
 * num_dims, info, lhs, rhs, out)` on contiguous operands (`info` null). */

#define CUDA_ERROR_NOT_FOUND 500

typedef struct fake_module *CUmodule;
struct fake_module {
    int unused;
};
static struct fake_module the_module;

typedef const struct fake_function *CUfunction;
enum kernel { COPY2D, BMUL_F32 };
struct fake_function {
    const char *name;
    size_t elem; /* the element's size in bytes */
    enum kernel kind;
};
static const struct fake_function functions[] = {
    {"copy2d_u8", 1, COPY2D},  {"copy2d_i16", 2, COPY2D}, {"copy2d_f16", 2, COPY2D},
    {"copy2d_bf16", 2, COPY2D}, {"copy2d_u32", 4, COPY2D}, {"copy2d_i32", 4, COPY2D},
    {"copy2d_f32", 4, COPY2D}, {"copy2d_i64", 8, COPY2D}, {"copy2d_f64", 8, COPY2D},
    {"bmul_f32", 4, BMUL_F32},
};

CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    COUNT(cuModuleLoadData);
    if (!m || !image)
        return CUDA_ERROR_INVALID_VALUE;
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    *m = &the_module;
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule m) {
    COUNT(cuModuleUnload);
    return m == &the_module ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    COUNT(cuModuleGetFunction);
    if (!f || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (m != &the_module)
        return CUDA_ERROR_INVALID_HANDLE;
    for (size_t i = 0; i < sizeof functions / sizeof functions[0]; i++) {
        if (strcmp(functions[i].name, name) == 0) {
            *f = &functions[i];
            return CUDA_SUCCESS;
        }
    }
    bump(&unknown_kernels);
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, CUstream s, void **params,
                        void **extra) {
    COUNT(cuLaunchKernel);
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shared, (void)extra;
    if (!stream_of(s))
        return CUDA_ERROR_INVALID_HANDLE;
    if (f < &functions[0] || f >= &functions[sizeof functions / sizeof functions[0]] ||
        !params)
        return CUDA_ERROR_INVALID_VALUE;
    if (f->kind == BMUL_F32) {
        size_t numel = *(const size_t *)params[0];
        uint64_t info = *(const uint64_t *)params[2], lhs = *(const uint64_t *)params[3],
                 rhs = *(const uint64_t *)params[4], out = *(const uint64_t *)params[5];
        if (info)
            return CUDA_ERROR_NOT_SUPPORTED; /* strided operands: not modelled */
        if (!numel)
            return CUDA_SUCCESS;
        if (!lhs || !rhs || !out)
            return CUDA_ERROR_INVALID_VALUE;
        stream_op(s, lhs, numel * 4, out, numel * 4, f->name);
        stream_op(s, rhs, numel * 4, 0, 0, f->name);
        const float *l = PTR(lhs), *r = PTR(rhs);
        float *o = PTR(out);
        for (size_t i = 0; i < numel; i++)
            o[i] = l[i] * r[i];
        return CUDA_SUCCESS;
    }
    /* copy2d */
    uint64_t src = *(const uint64_t *)params[0], dst = *(const uint64_t *)params[1];
    uint32_t d1 = *(const uint32_t *)params[2], d2 = *(const uint32_t *)params[3];
    uint32_t src_s = *(const uint32_t *)params[4], dst_s = *(const uint32_t *)params[5];
    if (!d1 || !d2)
        return CUDA_SUCCESS;
    if (!src || !dst)
        return CUDA_ERROR_INVALID_VALUE;
    size_t e = f->elem;
    stream_op(s, src, ((size_t)(d1 - 1) * src_s + d2) * e, dst,
              ((size_t)(d1 - 1) * dst_s + d2) * e, f->name);
    for (uint32_t i = 0; i < d1; i++)
        memmove(PTR(dst + (uint64_t)i * dst_s * e), PTR(src + (uint64_t)i * src_s * e), d2 * e);
    return CUDA_SUCCESS;
}

/* ---- what the tests control and observe ------------------------------------------------ */

/* Marks (1) or unmarks (0) the calling thread as the one whose calls are counted apart. */
void fake_cuda_mark_thread(int on) { thread_marked = on; }

/* Calls of entry point `i` so far: on marked threads (`marked` != 0) or on all; -1 past
 * the last. */
int64_t fake_cuda_calls_at(int i, int marked) {
    if (i < 0 || i >= N_CALLS)
        return -1;
    return (int64_t)__atomic_load_n(marked ? &calls_marked[i] : &calls_all[i], __ATOMIC_RELAXED);
}

/* The name of entry point `i` (NULL past the last), to list the counters. */
const char *fake_cuda_call_name(int i) { return i >= 0 && i < N_CALLS ? call_names[i] : NULL; }

void fake_cuda_set_device_count(int n) {
    device_count = n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

/* NCCL's release of a communicator's resources (abort, destroy, deregistration, ncclMemFree):
 * NCCL makes the communicator's device current itself and frees through the driver, which
 * waits for that device's work. So it blocks behind a stalled stream of `device` whatever
 * context the calling thread has, or none (a teardown on a thread of its own). A negative
 * `device` (one the fake NCCL did not see made) waits for every device. */
void fake_cuda_release_wait(int device) {
    __atomic_fetch_add(&releases_blocked, 1, __ATOMIC_RELAXED);
    wait_device_streams(device, &release_waits);
    __atomic_fetch_sub(&releases_blocked, 1, __ATOMIC_RELAXED);
}

/* Sets the sticky error every later call of the device's work returns (0 clears it, which
 * a real context never does: tests end with it). */
void fake_cuda_sticky_error(int code) {
    __atomic_store_n(&sticky_error, code, __ATOMIC_RELEASE);
}

/* Stalls (1) or releases (0) a stream. Returns 0, or -1 for an unknown stream. */
int fake_cuda_stall(CUstream s, int on) {
    struct fake_stream *st = stream_of(s);
    if (!st)
        return -1;
    pthread_mutex_lock(&lock);
    if (st->stalled && !on) {
        st->gen++;
        pthread_cond_broadcast(&released);
    }
    __atomic_store_n(&st->stalled, on, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&lock);
    return 0;
}

/* Holds (1) or releases (0) the device behind: while held, every event query reads not
 * ready (its work still runs); stalls still decide what completes once released. */
void fake_cuda_hold_completion(int on) {
    __atomic_store_n(&completion_held, on, __ATOMIC_RELEASE);
}

/* Makes a stream report a capture in progress (1: a new capture begins) or none (0). */
int fake_cuda_set_capturing(CUstream s, int on) {
    struct fake_stream *st = stream_of(s);
    if (!st)
        return -1;
    pthread_mutex_lock(&lock);
    if (on && !st->capturing)
        st->capture_gen++;
    pthread_mutex_unlock(&lock);
    __atomic_store_n(&st->capturing, on, __ATOMIC_RELEASE);
    return 0;
}

/* The capture `s` is in (not counted as a driver call): its stream as the driver resolves
 * the handle (0x2: the calling thread's own) in `*resolved`, and the number of the capture
 * in progress on it, or 0 when none is (or -1 when `s` is no stream). What NCCL asks at a
 * launch (`ncclCudaGetCapturingGraph`, a capture's graph holds the launch's plans): the
 * fake NCCL asks here, so the caller's counted calls stay the crate's own. */
int64_t fake_cuda_capture_of(CUstream s, void **resolved) {
    /* As `stream_of`, without counting a bad handle (the caller's, not the driver's). */
    struct fake_stream *st = s == (CUstream)2                    ? per_thread_stream()
                             : (s == NULL || s == (CUstream)1) ? &default_stream
                             : (s >= &streams[0] && s < &streams[MAX_STREAMS] && s->in_use) ? s
                                                                                            : NULL;
    if (resolved)
        *resolved = st;
    if (!st)
        return -1;
    pthread_mutex_lock(&lock);
    int64_t gen = st->capturing ? (int64_t)st->capture_gen : 0;
    pthread_mutex_unlock(&lock);
    return gen;
}

/* Gauges: 0 live streams, 1 live events, 2 live device allocations, 3 live pinned host
 * allocations, 4 events recorded on a capturing stream, 5 waits behind a stalled stream,
 * 6 of those that gave up, 7 calls with an invalid or released handle, 8 NCCL releases that
 * waited behind a stalled stream, 9 NCCL releases in progress (blocked while one is);
 * with the stream-order model on: 10 races found, 11 accesses checked, 12 operations left
 * untracked (no clock id left); 13 kernels looked up that the fake does not know; 14 queries
 * or synchronizations of a captured event while the capture that recorded it was open. */
int64_t fake_cuda_gauge(int which) {
    switch (which) {
    case 0: return __atomic_load_n(&live_streams, __ATOMIC_RELAXED);
    case 1: return __atomic_load_n(&live_events, __ATOMIC_RELAXED);
    case 2: return __atomic_load_n(&live_allocs, __ATOMIC_RELAXED);
    case 3: return __atomic_load_n(&live_host_allocs, __ATOMIC_RELAXED);
    case 4: return (int64_t)__atomic_load_n(&records_on_capturing, __ATOMIC_RELAXED);
    case 5: return (int64_t)__atomic_load_n(&stalled_waits, __ATOMIC_RELAXED);
    case 6: return (int64_t)__atomic_load_n(&stalled_wait_timeouts, __ATOMIC_RELAXED);
    case 7: return (int64_t)__atomic_load_n(&bad_handles, __ATOMIC_RELAXED);
    case 8: return (int64_t)__atomic_load_n(&release_waits, __ATOMIC_RELAXED);
    case 9: return __atomic_load_n(&releases_blocked, __ATOMIC_RELAXED);
    case 10: return (int64_t)__atomic_load_n(&races, __ATOMIC_RELAXED);
    case 11: return (int64_t)__atomic_load_n(&accesses_checked, __ATOMIC_RELAXED);
    case 12: return (int64_t)__atomic_load_n(&untracked_ops, __ATOMIC_RELAXED);
    case 13: return (int64_t)__atomic_load_n(&unknown_kernels, __ATOMIC_RELAXED);
    case 14: return (int64_t)__atomic_load_n(&queries_in_capture, __ATOMIC_RELAXED);
    default: return -1;
    }
}

/* Turns the stream-order model on (1) or off (0). Turn it on before the work to check is
 * issued: what was issued while it was off is not known to it. */
void fake_cuda_check_order(int on) { __atomic_store_n(&order_on, on, __ATOMIC_RELEASE); }

/* NCCL's accesses (or any other work the driver does not see), as an operation on stream
 * `s` reading `rn` bytes at `r` and writing `wn` bytes at `w`. Returns 0 (also while the
 * model is off, without a look at `s`), or -1 for an unknown stream. */
int fake_cuda_access(CUstream s, CUdeviceptr r, size_t rn, CUdeviceptr w, size_t wn) {
    if (!__atomic_load_n(&order_on, __ATOMIC_ACQUIRE))
        return 0;
    if (!stream_of(s))
        return -1;
    stream_op(s, r, rn, w, wn, "nccl");
    return 0;
}

/* The latest race found, described (empty while none). */
const char *fake_cuda_last_race(void) {
    pthread_mutex_lock(&lock);
    static char copy[sizeof last_race];
    memcpy(copy, last_race, sizeof copy);
    pthread_mutex_unlock(&lock);
    return copy;
}
