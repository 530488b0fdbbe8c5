/*
 * A fake NVML (`libnvidia-ml.so.1`) for NCCL built from source (`scripts/build-nccl.sh`),
 * which opens NVML by that name (misc/nvmlwrap.cc) and fails its init without it.
 *
 * The devices are the fake CUDA driver's (its `cuDeviceGetCount`, found in the process's
 * global scope: the driver is loaded first, RTLD_GLOBAL), with the fake runtime's PCI bus
 * ids (`0000:f<d>:00.0`) and compute capability 9.0; no NVLink, no P2P, no fabric, no
 * confidential computing: every such query answers "not supported", as NVML does on a
 * GPU without them. NCCL's types are restated here (src/include/nvmlwrap.h).
 */
#include <stdio.h>
#include <string.h>

typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_SUPPORTED = 3,
       NVML_ERROR_NOT_FOUND = 6 };
#define MAX_DEVICES 16

struct nvmlDevice_st {
    unsigned index;
};
typedef struct nvmlDevice_st *nvmlDevice_t;
static struct nvmlDevice_st devices[MAX_DEVICES];

extern int cuDeviceGetCount(int *n);

static unsigned count(void) {
    int n = 0;
    if (cuDeviceGetCount(&n) != 0 || n < 0)
        return 0;
    return n > MAX_DEVICES ? MAX_DEVICES : (unsigned)n;
}

static int valid(nvmlDevice_t d) { return d >= &devices[0] && d < &devices[count()]; }

nvmlReturn_t nvmlInit(void) { return NVML_SUCCESS; }
nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

nvmlReturn_t nvmlDeviceGetCount(unsigned *n) {
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = count();
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n) { return nvmlDeviceGetCount(n); }

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned i, nvmlDevice_t *d) {
    if (!d || i >= count())
        return NVML_ERROR_INVALID_ARGUMENT;
    devices[i].index = i;
    *d = &devices[i];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus_id, nvmlDevice_t *d) {
    unsigned domain, bus, dev, fn;
    if (!d || !bus_id || sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &fn) != 4)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (domain != 0 || dev != 0 || bus < 0xf0 || bus - 0xf0 >= count())
        return NVML_ERROR_NOT_FOUND;
    return nvmlDeviceGetHandleByIndex(bus - 0xf0, d);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *i) {
    if (!i || !valid(d))
        return NVML_ERROR_INVALID_ARGUMENT;
    *i = d->index;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    default: return "Unknown Error (fake NVML)";
    }
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor) {
    if (!major || !minor || !valid(d))
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = 9;
    *minor = 0;
    return NVML_SUCCESS;
}

/* NVML_P2P_STATUS_NOT_SUPPORTED (5) for every pair and capability. */
nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t a, nvmlDevice_t b, int index, int *status) {
    (void)index;
    if (!status || !valid(a) || !valid(b))
        return NVML_ERROR_INVALID_ARGUMENT;
    *status = 5;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned link, int *active) {
    (void)d, (void)link, (void)active;
    return NVML_ERROR_NOT_SUPPORTED;
}
nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t d, unsigned link, void *pci) {
    (void)d, (void)link, (void)pci;
    return NVML_ERROR_NOT_SUPPORTED;
}
nvmlReturn_t nvmlDeviceGetNvLinkCapability(nvmlDevice_t d, unsigned link, int cap, unsigned *r) {
    (void)d, (void)link, (void)cap, (void)r;
    return NVML_ERROR_NOT_SUPPORTED;
}

/* nvmlFieldValue_t, as NCCL lays it out: each value answered "not supported". */
struct field_value {
    unsigned field_id, scope_id;
    long long timestamp, latency_usec;
    int value_type;
    nvmlReturn_t ret;
    unsigned long long value;
};
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int n, struct field_value *values) {
    if (!valid(d) || n < 0 || (n && !values))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < n; i++)
        values[i].ret = NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t d, void *info) {
    (void)d, (void)info;
    return NVML_ERROR_NOT_SUPPORTED;
}
nvmlReturn_t nvmlDeviceGetPlatformInfo(nvmlDevice_t d, void *info) {
    (void)d, (void)info;
    return NVML_ERROR_NOT_SUPPORTED;
}
/* Confidential computing off, as on a GPU that has it and does not use it:
 * nvmlConfComputeSystemState_t {environment, ccFeature, devToolsMode} and
 * nvmlSystemConfComputeSettings_v1_t {version, environment, ccFeature, devToolsMode,
 * multiGpuMode}, every field but the version 0 (none, disabled). */
nvmlReturn_t nvmlSystemGetConfComputeState(unsigned *state) {
    if (!state)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(state, 0, 3 * sizeof *state);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetConfComputeSettings(unsigned *settings) {
    if (!settings)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(settings + 1, 0, 4 * sizeof *settings);
    return NVML_SUCCESS;
}
