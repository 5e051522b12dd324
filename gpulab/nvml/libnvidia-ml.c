/*
 * The lab's libnvidia-ml.so.1: the NVML calls the health probe makes, answered from the lab
 * host's GPU state (the same state the lab's nvidia-smi reads).
 *
 * nvmlInit_v2 runs `python3 -m gpulab_tools.nvml_state` (gpulab/tools/), which prints
 * one "key value" line per fact, "gpu N" before each GPU's lines; GPULAB_NVML_STATE_FILE names a
 * file to read instead (tests outside a lab host). A value "!N" is NVML error N for that call.
 * A line "hang NAME" makes the call NAME block forever (the lab fault nvml_hang).
 *
 * Every signature, constant and error code is NVIDIA's nvml.h, as vendored by NVIDIA/go-nvml:
 * https://github.com/NVIDIA/go-nvml/blob/main/gen/nvml/nvml.h (line numbers below are that file's
 * at commit 2f9e261fe40a7a1c54783d66805e8920564763b4).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;              /* nvml.h:1296 enum nvmlReturn_enum */
#define NVML_SUCCESS 0                 /* nvml.h:1298 */
#define NVML_ERROR_UNINITIALIZED 1     /* nvml.h:1299 */
#define NVML_ERROR_INVALID_ARGUMENT 2  /* nvml.h:1300 */
#define NVML_ERROR_NOT_SUPPORTED 3     /* nvml.h:1301 */
#define NVML_ERROR_INSUFFICIENT_SIZE 7 /* nvml.h:1305 */
#define NVML_ERROR_DRIVER_NOT_LOADED 9 /* nvml.h:1307 */
#define NVML_ERROR_UNKNOWN 999         /* nvml.h:1329 */

#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32    /* nvml.h:165 */
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16 /* nvml.h:170 */

typedef struct nvmlPciInfo_st { /* nvml.h:196-208 */
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

typedef union nvmlValue_st { /* nvml.h:665-674 */
    double dVal;
    int siVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct nvmlFieldValue_st { /* nvml.h:3010-3019 */
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType; /* nvmlValueType_t, nvml.h:648 */
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3 /* nvml.h:653 */

#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25 /* nvml.h:1323 */
#define NVML_NVLINK_MAX_LINKS 36                 /* nvml.h:455 */

typedef struct { /* nvmlGpuFabricInfo_t, nvml.h:3813-3819 */
    unsigned char clusterUuid[16]; /* NVML_GPU_FABRIC_UUID_LEN */
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state; /* nvmlGpuFabricState_t */
} nvmlGpuFabricInfo_t;

typedef struct { /* nvmlGpuFabricInfo_v2_t, nvml.h:3924-3932 */
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
} nvmlGpuFabricInfo_v2_t;

/* NVML_STRUCT_VERSION(GpuFabricInfo, 2), nvml.h:141 and 3937 */
#define nvmlGpuFabricInfo_v2 ((unsigned int)(sizeof(nvmlGpuFabricInfo_v2_t) | (2 << 24U)))

#define MAX_GPUS 64
#define MAX_KEYS 384 /* a B200's 18 links answer 14 keys each */
#define KEY_LEN 24
#define VAL_LEN 96

struct gpu {
    int n;
    char key[MAX_KEYS][KEY_LEN];
    char val[MAX_KEYS][VAL_LEN];
};

typedef struct gpu *nvmlDevice_t; /* nvml.h: typedef struct nvmlDevice_st* nvmlDevice_t */

static struct gpu gpus[MAX_GPUS];
static int gpu_count = -1; /* -1: not initialised */
static char driver[VAL_LEN];
static char hang[64]; /* an NVML function name */

static void maybe_hang(const char *call)
{
    if (hang[0] && strcmp(hang, call) == 0)
        for (;;)
            pause(); /* a driver call that never returns: only SIGKILL ends it */
}

static const char *lookup(struct gpu *g, const char *key)
{
    for (int i = 0; i < g->n; i++)
        if (strcmp(g->key[i], key) == 0)
            return g->val[i];
    return NULL;
}

/* The value of `key` for a device: NVML_SUCCESS and *out, or the error the state says. */
static nvmlReturn_t get(nvmlDevice_t d, const char *key, const char **out)
{
    if (gpu_count < 0)
        return NVML_ERROR_UNINITIALIZED;
    if (d == NULL || d < gpus || d >= gpus + gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    const char *v = lookup(d, key);
    if (v == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    if (v[0] == '!')
        return (nvmlReturn_t)atoi(v + 1);
    *out = v;
    return NVML_SUCCESS;
}

static nvmlReturn_t get_uint(nvmlDevice_t d, const char *key, unsigned int *out)
{
    const char *v = NULL;
    nvmlReturn_t r;
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = get(d, key, &v);
    if (r == NVML_SUCCESS)
        *out = (unsigned int)strtoul(v, NULL, 0);
    return r;
}

static nvmlReturn_t get_ull(nvmlDevice_t d, const char *key, unsigned long long *out)
{
    const char *v = NULL;
    nvmlReturn_t r;
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = get(d, key, &v);
    if (r == NVML_SUCCESS)
        *out = strtoull(v, NULL, 0);
    return r;
}

/* A (current, pending) mode pair: pending from KEY_pending where the state has it (a mode change
 * waiting for a GPU reset, as `nvidia-smi -mig 1` leaves it), else the current mode. */
static nvmlReturn_t get_mode(nvmlDevice_t d, const char *key, unsigned int *current, unsigned int *pending)
{
    char pkey[KEY_LEN];
    if (pending == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = get_uint(d, key, current);
    if (r != NVML_SUCCESS)
        return r;
    snprintf(pkey, sizeof pkey, "%s_pending", key);
    if (get_uint(d, pkey, pending) != NVML_SUCCESS)
        *pending = *current;
    return r;
}

static nvmlReturn_t get_str(nvmlDevice_t d, const char *key, char *buf, unsigned int length)
{
    const char *v = NULL;
    nvmlReturn_t r;
    if (buf == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = get(d, key, &v);
    if (r != NVML_SUCCESS)
        return r;
    if (strlen(v) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, v);
    return NVML_SUCCESS;
}

static void parse(FILE *f)
{
    char line[KEY_LEN + VAL_LEN + 8];
    struct gpu *cur = NULL;
    gpu_count = 0;
    driver[0] = hang[0] = '\0';
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *sp = strchr(line, ' ');
        if (sp == NULL)
            continue;
        *sp = '\0';
        const char *k = line, *v = sp + 1;
        if (strcmp(k, "gpu") == 0) {
            cur = gpu_count < MAX_GPUS ? &gpus[gpu_count++] : NULL;
            if (cur)
                cur->n = 0;
        } else if (strcmp(k, "driver") == 0) {
            snprintf(driver, sizeof driver, "%s", v);
        } else if (strcmp(k, "hang") == 0) {
            snprintf(hang, sizeof hang, "%s", v);
        } else if (cur && cur->n < MAX_KEYS && strlen(k) < KEY_LEN) {
            snprintf(cur->key[cur->n], KEY_LEN, "%s", k);
            snprintf(cur->val[cur->n], VAL_LEN, "%s", v);
            cur->n++;
        }
    }
}

/* nvml.h:4002 nvmlReturn_t nvmlInit_v2(void); DRIVER_NOT_LOADED when the driver is not there. */
nvmlReturn_t nvmlInit_v2(void)
{
    const char *file = getenv("GPULAB_NVML_STATE_FILE");
    FILE *f;
    int status;
    if (file && *file) {
        f = fopen(file, "r");
        if (f == NULL)
            return NVML_ERROR_DRIVER_NOT_LOADED;
        parse(f);
        fclose(f);
    } else {
        f = popen("exec python3 -m gpulab_tools.nvml_state", "r");
        if (f == NULL)
            return NVML_ERROR_DRIVER_NOT_LOADED;
        parse(f);
        status = pclose(f);
        if (status != 0) {
            gpu_count = -1;
            return NVML_ERROR_DRIVER_NOT_LOADED; /* no profile, or a host modelled for nvidia-smi alone */
        }
    }
    maybe_hang("nvmlInit_v2");
    return NVML_SUCCESS;
}

/* nvml.h:4031 nvmlReturn_t nvmlShutdown(void); UNINITIALIZED when not initialised. */
nvmlReturn_t nvmlShutdown(void)
{
    if (gpu_count < 0)
        return NVML_ERROR_UNINITIALIZED;
    gpu_count = -1;
    return NVML_SUCCESS;
}

/* nvml.h:4057 const char *nvmlErrorString(nvmlReturn_t result); the strings NVIDIA's library returns. */
const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires reset";
    case 17: return "GPU access blocked by the operating system";
    case 18: return "Driver/library version mismatch";
    case 21: return "No data";
    default: return "Unknown Error";
    }
}

/* nvml.h:4194 nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length); */
nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (gpu_count < 0)
        return NVML_ERROR_UNINITIALIZED;
    if (version == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(driver) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(version, driver);
    return NVML_SUCCESS;
}

/* nvml.h:4573 nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount); */
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (gpu_count < 0)
        return NVML_ERROR_UNINITIALIZED;
    if (deviceCount == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    maybe_hang("nvmlDeviceGetCount_v2");
    *deviceCount = (unsigned int)gpu_count;
    return NVML_SUCCESS;
}

/* nvml.h:4641 nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device); */
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    const char *v = NULL;
    if (gpu_count < 0)
        return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= (unsigned int)gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    maybe_hang("nvmlDeviceGetHandleByIndex_v2");
    /* a GPU fallen off the bus or in need of a reset is still counted, but has no handle */
    nvmlReturn_t r = get(&gpus[index], "handle", &v);
    if (r != NVML_SUCCESS && r != NVML_ERROR_NOT_SUPPORTED)
        return r;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

#define STR_CALL(fn, key)                                                     \
    nvmlReturn_t fn(nvmlDevice_t device, char *buf, unsigned int length)      \
    {                                                                         \
        maybe_hang(#fn);                                                      \
        return get_str(device, key, buf, length);                             \
    }

/* nvml.h:4784 nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length); */
STR_CALL(nvmlDeviceGetName, "name")
/* nvml.h:5186 nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length); */
STR_CALL(nvmlDeviceGetUUID, "uuid")

/* nvml.h:5471 nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci); */
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    char bus[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned int dom = 0, b = 0, dev = 0, fn = 0;
    if (pci == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    maybe_hang("nvmlDeviceGetPciInfo_v3");
    nvmlReturn_t r = get_str(device, "busid", bus, sizeof bus);
    if (r != NVML_SUCCESS)
        return r;
    memset(pci, 0, sizeof *pci);
    sscanf(bus, "%x:%x:%x.%x", &dom, &b, &dev, &fn);
    snprintf(pci->busId, sizeof pci->busId, "%s", bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", dom & 0xffff, b, dev, fn);
    pci->domain = dom;
    pci->bus = b;
    pci->device = dev;
    get_uint(device, "pci_device_id", &pci->pciDeviceId);
    get_uint(device, "pci_subsystem_id", &pci->pciSubSystemId);
    return NVML_SUCCESS;
}

#define UINT_CALL(fn, key)                                                    \
    nvmlReturn_t fn(nvmlDevice_t device, unsigned int *out)                   \
    {                                                                         \
        maybe_hang(#fn);                                                      \
        return get_uint(device, key, out);                                    \
    }

/* nvml.h nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, nvmlPstates_t *pState);
   nvmlPstates_t: NVML_PSTATE_0 (maximum) .. NVML_PSTATE_15 (minimum), 32 unknown */
UINT_CALL(nvmlDeviceGetPerformanceState, "pstate")
/* nvml.h:5433 nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode); */
UINT_CALL(nvmlDeviceGetPersistenceMode, "persistence")
/* nvml.h:5549 nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *currLinkGen); */
UINT_CALL(nvmlDeviceGetCurrPcieLinkGeneration, "pcie_gen")
/* nvml.h:5492 nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *maxLinkGen); */
UINT_CALL(nvmlDeviceGetMaxPcieLinkGeneration, "pcie_gen_max")
/* nvml.h:5567 nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *currLinkWidth); */
UINT_CALL(nvmlDeviceGetCurrPcieLinkWidth, "pcie_width")
/* nvml.h:5531 nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device, unsigned int *maxLinkWidth); */
UINT_CALL(nvmlDeviceGetMaxPcieLinkWidth, "pcie_width_max")
/* nvml.h:8407 nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, nvmlEnableState_t *isPending); */
UINT_CALL(nvmlDeviceGetRetiredPagesPendingStatus, "retired_pending")

/* nvml.h:5958 nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType, unsigned int *temp);
 * NVML_TEMPERATURE_GPU = 0 (nvml.h:964) is the only sensor. */
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensorType, unsigned int *temp)
{
    maybe_hang("nvmlDeviceGetTemperature");
    if (sensorType != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    return get_uint(device, "temp", temp);
}

/* nvml.h:6044 nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, nvmlTemperatureThresholds_t thresholdType, unsigned int *temp);
 * NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0, _SLOWDOWN = 1, _MEM_MAX = 2 (nvml.h:939-943). */
nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, int thresholdType, unsigned int *temp)
{
    maybe_hang("nvmlDeviceGetTemperatureThreshold");
    if (thresholdType == 0)
        return get_uint(device, "temp_shutdown", temp);
    if (thresholdType == 1)
        return get_uint(device, "temp_slowdown", temp);
    if (thresholdType == 2)
        return get_uint(device, "temp_mem_max", temp);
    return NVML_ERROR_NOT_SUPPORTED;
}

/* nvml.h:6886 nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, nvmlEnableState_t *current, nvmlEnableState_t *pending); */
nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    maybe_hang("nvmlDeviceGetEccMode");
    return get_mode(device, "ecc_mode", current, pending);
}

/* nvml.h:6986 nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
 *     nvmlEccCounterType_t counterType, unsigned long long *eccCounts);
 * NVML_MEMORY_ERROR_TYPE_CORRECTED = 0, _UNCORRECTED = 1 (nvml.h:1073-1080); NVML_VOLATILE_ECC = 0 (nvml.h:1097). */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType, unsigned long long *eccCounts)
{
    maybe_hang("nvmlDeviceGetTotalEccErrors");
    if (counterType != 0 && counterType != 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (errorType == 0)
        return get_ull(device, "ecc_corrected", eccCounts);
    if (errorType == 1)
        return get_ull(device, "ecc_uncorrected", eccCounts);
    return NVML_ERROR_INVALID_ARGUMENT;
}

/* nvml.h:8434 nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
 *     unsigned int *uncRows, unsigned int *isPending, unsigned int *failureOccurred); */
nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred)
{
    nvmlReturn_t r;
    maybe_hang("nvmlDeviceGetRemappedRows");
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((r = get_uint(device, "remap_corrected", corrRows)) != NVML_SUCCESS)
        return r;
    if ((r = get_uint(device, "remap_uncorrected", uncRows)) != NVML_SUCCESS)
        return r;
    if ((r = get_uint(device, "remap_pending", isPending)) != NVML_SUCCESS)
        return r;
    return get_uint(device, "remap_failure", failureOccurred);
}

/* nvml.h:6121 nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *clocksEventReasons); */
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *clocksEventReasons)
{
    maybe_hang("nvmlDeviceGetCurrentClocksEventReasons");
    return get_ull(device, "clocks_event", clocksEventReasons);
}

/* nvml.h:10230 nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values);
 * Each value's own nvmlReturn says whether it was read; field N is the state's key "fi_N" (the
 * state tool lists the NVML_FI_* ids it answers), every value an unsigned long long. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    maybe_hang("nvmlDeviceGetFieldValues");
    if (gpu_count < 0)
        return NVML_ERROR_UNINITIALIZED;
    if (values == NULL || valuesCount < 0 || device == NULL || device < gpus || device >= gpus + gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < valuesCount; i++) {
        char key[KEY_LEN];
        /* a per-link field (the link in scopeId) is "fi_N.LINK"; any other field "fi_N" */
        snprintf(key, sizeof key, "fi_%u.%u", values[i].fieldId, values[i].scopeId);
        if (lookup(device, key) == NULL)
            snprintf(key, sizeof key, "fi_%u", values[i].fieldId);
        values[i].valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
        values[i].value.ullVal = 0;
        values[i].nvmlReturn = get_ull(device, key, &values[i].value.ullVal);
    }
    return NVML_SUCCESS;
}

/* nvml.h:12803 nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode);
 * NOT_SUPPORTED on a GPU without MIG: the lab's GPUs answer it only where the state says "mig". */
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    maybe_hang("nvmlDeviceGetMigMode");
    return get_mode(device, "mig", currentMode, pendingMode);
}

/* nvml.h:9506 nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive);
 * INVALID_ARGUMENT for a link past NVML_NVLINK_MAX_LINKS; NOT_SUPPORTED for a link the GPU lacks. */
nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, unsigned int *isActive)
{
    char key[KEY_LEN];
    maybe_hang("nvmlDeviceGetNvLinkState");
    if (link >= NVML_NVLINK_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(key, sizeof key, "nvl_state.%u", link);
    return get_uint(device, key, isActive);
}

/* nvml.h:9585 nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link,
 *     nvmlNvLinkErrorCounter_t counter, unsigned long long *counterValue);
 * counters NVML_NVLINK_ERROR_DL_REPLAY 0 .. _DL_ECC_DATA 4 (nvml.h:517-523); NOT_SUPPORTED on
 * NVLink 5, whose counters are field values (nvml.h:2649-2668). */
nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link, int counter,
                                             unsigned long long *counterValue)
{
    char key[KEY_LEN];
    maybe_hang("nvmlDeviceGetNvLinkErrorCounter");
    if (link >= NVML_NVLINK_MAX_LINKS || counter < 0 || counter > 4)
        return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(key, sizeof key, "nvl_err_%d.%u", counter, link);
    return get_ull(device, key, counterValue);
}

/* The fabric state (NVML_GPU_FABRIC_STATE_*, nvml.h:3800-3803) and its status: NOT_SUPPORTED on
 * a GPU off NVSwitch (no "fabric_state" in the state). */
static nvmlReturn_t fabric(nvmlDevice_t device, nvmlReturn_t *status, unsigned char *state)
{
    unsigned int st = 0, code = 0;
    nvmlReturn_t r = get_uint(device, "fabric_state", &st);
    if (r != NVML_SUCCESS)
        return r;
    get_uint(device, "fabric_status", &code);
    *state = (unsigned char)st;
    *status = (nvmlReturn_t)code;
    return NVML_SUCCESS;
}

/* nvml.h:7852 nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *gpuFabricInfo);
 * The caller sets `version`; this stand-in knows nvmlGpuFabricInfo_v2 (a real driver also v3). */
nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfo_v2_t *info)
{
    maybe_hang("nvmlDeviceGetGpuFabricInfoV");
    if (info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlGpuFabricInfo_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memset(info->clusterUuid, 0, sizeof info->clusterUuid);
    info->cliqueId = 0;
    info->healthMask = 0;
    return fabric(device, &info->status, &info->state);
}

/* nvml.h:7829 nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *gpuFabricInfo); deprecated */
nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info)
{
    maybe_hang("nvmlDeviceGetGpuFabricInfo");
    if (info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(info, 0, sizeof *info);
    return fabric(device, &info->status, &info->state);
}
