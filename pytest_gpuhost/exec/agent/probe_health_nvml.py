"""Agent probe: the `health_nvml` fact, the health checks' GPU facts read through NVML.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py).  Reads, through
libnvidia-ml.so.1 (probe_nvml.py: the ctypes binding, and the forked child each read runs in
under the deadline, params `timeout`), for every GPU what the `gpus`, `remap` and `nvlink` parts
of the `health` fact read from nvidia-smi, and the GPU side of its `fabric` part (fabric state,
the memory temperature limit), in the same shape (modules/health/ judges them unchanged), with
`"source": "nvml"`.  NVML's calls do not change wording between drivers as nvidia-smi's text
does.  A call that hangs is named in the answer, with how long it was waited for.

The fact is asked for before `health` in the same request and leaves its result in the
request's params (`_health_nvml`), where the `health` fact takes it instead of starting
nvidia-smi; without the library the `health` fact reads nvidia-smi as before and says why.
Field ids and constants: NVIDIA's nvml.h, as vendored by NVIDIA/go-nvml,
https://github.com/NVIDIA/go-nvml/blob/main/gen/nvml/nvml.h (line numbers at commit 2f9e261).
"""

import ctypes

from pytest_gpuhost.exec.agent.core import fact, read_str
from pytest_gpuhost.exec.agent.probe_health_smi import LINK_FIELDS, SYSFS_LINK, short_bdf
from pytest_gpuhost.exec.agent.probe_nvml import (
    DRIVER_BUFFER,
    FABRIC_V2,
    LIBRARY,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_SUCCESS,
    FabricInfo,
    FabricInfoV2,
    Handle,
    PciInfo,
    bounded,
    read_fields,
    text,
)

CACHE_KEY = "_health_nvml"  # the request's params: the `health` fact reads the result there
# nvmlDeviceGetFieldValues ids (nvml.h:2475-2849)
FI_MEMORY_TEMP = 82
FI_RESET_STATUS = 226  # deprecated for FI_GPU_RECOVERY_ACTION; what drivers before it answer
FI_GPU_RECOVERY_ACTION = 230
FI_COUNTERS = (  # NVML_FI_DEV_CLOCKS_EVENT_REASON_*, nanoseconds: nvidia-smi's counters in us
    (74, "clocks_event_reasons_counters.sw_power_cap"),
    (269, "clocks_event_reasons_counters.sw_thermal_slowdown"),
    (270, "clocks_event_reasons_counters.hw_thermal_slowdown"),
    (271, "clocks_event_reasons_counters.hw_power_brake_slowdown"),
)
FI_NVLINK_LINK_COUNT = 91  # NVML_FI_DEV_NVLINK_LINK_COUNT (nvml.h:2503)
FI_NVLINK_SPEED = 164  # NVML_FI_DEV_NVLINK_GET_SPEED, MBps, the link in scopeId (nvml.h:2675)
FI_NVLINK_SPEED_COMMON = 90  # NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON, drivers before 164 (nvml.h:2501)
MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS (nvml.h:455)
# The counters `nvidia-smi nvlink -e` prints, by its names (probe_health.parse_nvlink_errors keeps
# the same ones): NVLink 2-4 through nvmlDeviceGetNvLinkErrorCounter (nvmlNvLinkErrorCounter_t,
# nvml.h:517-523); NVLink 5 (Blackwell, where those are unsupported) as field values with the link
# in scopeId, NVML_FI_DEV_NVLINK_COUNT_* (nvml.h:2752-2777). BER and the FEC histogram are not read.
DL_COUNTERS = ((0, "Replay Errors"), (1, "Recovery Errors"), (2, "CRC Errors"))
NVLINK5_FIELDS = (
    (206, "Malformed packet Errors"),
    (207, "Buffer overrun Errors"),
    (208, "Rx Errors"),
    (209, "Rx remote Errors"),
    (210, "Rx General Errors"),
    (211, "Local link integrity Errors"),
    (212, "Tx discards"),
    (213, "Link recovery successful events"),
    (214, "Link recovery failed events"),
    (215, "Total link recovery events"),
    (219, "Effective Errors"),
    (221, "Symbol Errors"),
)
# NVML_GPU_FABRIC_STATE_* (nvml.h:3800-3803) as nvidia-smi -q prints the fabric's State
FABRIC_STATE = {0: "N/A", 1: "Not Started", 2: "In Progress", 3: "Completed"}
FABRIC_COMPLETED = 3
THRESHOLD_MEM_MAX = 2  # NVML_TEMPERATURE_THRESHOLD_MEM_MAX (nvml.h:943)
MIG_ENABLE = 1  # NVML_DEVICE_MIG_ENABLE (nvml.h:12488)
# nvmlGpuRecoveryAction_t (nvml.h:2195-2200) as nvidia-smi's gpu_recovery_action prints it
RECOVERY = {0: "None", 1: "Reset", 2: "Reboot", 3: "Drain P2P", 4: "Drain and Reset"}


class Row:
    """One GPU's row, as probe_health_smi.smi_gpus builds it from nvidia-smi's csv."""

    def __init__(self, nv, index):
        self.nv = nv
        self.links = (None, None)  # type: tuple
        self.fabric = {}  # type: dict
        self.out = {"index": index, "raw": {"index": str(index)}}  # type: dict
        self.errors = {}  # type: dict

    def put(self, key, rc, value, text=None):
        """Store one field: its value, None where NVML has none, the error where the GPU failed."""
        if rc == NVML_SUCCESS:
            self.out[key] = value
            self.out["raw"][key] = str(value) if text is None else text
            return
        self.out[key] = None
        if rc == NVML_ERROR_NOT_SUPPORTED:
            self.out["raw"][key] = "[N/A]"
        else:
            self.errors[key] = self.nv.error(rc)
            self.out["raw"][key] = "[" + self.errors[key] + "]"

    def uint(self, key, name, *args):
        v = ctypes.c_uint()
        rc = self.nv.call(name, *(args + (ctypes.byref(v),)))
        self.put(key, rc, v.value)
        return rc, v.value


def read_gpu(nv, index, driver):
    """Return one GPU's `gpus` row and its `remap` entry."""
    row = Row(nv, index)
    h = Handle()
    rc = nv.call("nvmlDeviceGetHandleByIndex_v2", index, ctypes.byref(h))
    if rc != NVML_SUCCESS:
        row.put("handle", rc, None)
        row.out.update(bdf="", cell_errors=row.errors)
        return row, None
    for key, name in (("name", "nvmlDeviceGetName"), ("uuid", "nvmlDeviceGetUUID")):
        rc, value = text(nv, name, h)
        row.out[key] = value if rc == NVML_SUCCESS else None
        row.out["raw"][key] = value
    row.out["driver_version"] = row.out["raw"]["driver_version"] = driver
    pci = PciInfo()
    rc = nv.call("nvmlDeviceGetPciInfo_v3", h, ctypes.byref(pci))
    bus = pci.busId.decode("ascii", "replace") if rc == NVML_SUCCESS else ""
    row.out["raw"]["pci.bus_id"] = bus
    row.out["bdf"] = short_bdf(bus)
    row.uint("persistence_mode", "nvmlDeviceGetPersistenceMode", h)
    row.uint("temperature.gpu", "nvmlDeviceGetTemperature", h, 0)  # NVML_TEMPERATURE_GPU (964)
    for key, kind in (
        ("ecc.errors.corrected.volatile.total", 0),
        ("ecc.errors.uncorrected.volatile.total", 1),
    ):
        v = ctypes.c_ulonglong()
        # NVML_MEMORY_ERROR_TYPE_CORRECTED/_UNCORRECTED (1073-1080), NVML_VOLATILE_ECC (1097)
        rc = nv.call("nvmlDeviceGetTotalEccErrors", h, kind, 0, ctypes.byref(v))
        row.put(key, rc, v.value)
    cur, pend = ctypes.c_uint(), ctypes.c_uint()
    rc = nv.call("nvmlDeviceGetEccMode", h, ctypes.byref(cur), ctypes.byref(pend))
    row.put("ecc.mode.current", rc, cur.value, "Enabled" if cur.value else "Disabled")
    cur, pend = ctypes.c_uint(), ctypes.c_uint()
    rc = nv.call("nvmlDeviceGetMigMode", h, ctypes.byref(cur), ctypes.byref(pend))
    for key, mode in (("mig.mode.current", cur.value), ("mig.mode.pending", pend.value)):
        row.put(key, rc, int(mode == MIG_ENABLE), "Enabled" if mode == MIG_ENABLE else "Disabled")
    row.uint("retired_pages.pending", "nvmlDeviceGetRetiredPagesPendingStatus", h)
    rows = [ctypes.c_uint() for _ in range(4)]
    rc = nv.call("nvmlDeviceGetRemappedRows", h, *[ctypes.byref(x) for x in rows])
    row.put("remapped_rows.failure", rc, rows[3].value)
    remap = {
        "remapped_rows.correctable": rows[0].value,
        "remapped_rows.uncorrectable": rows[1].value,
        "remapped_rows.pending": rows[2].value,
        "remapped_rows.failure": rows[3].value,
    }  # type: dict
    if rc != NVML_SUCCESS:
        remap = {k: None for k in remap}
        if rc != NVML_ERROR_NOT_SUPPORTED:
            remap["cell_errors"] = {k: nv.error(rc) for k in list(remap)}
    v = ctypes.c_ulonglong()
    rc = nv.call("nvmlDeviceGetCurrentClocksEventReasons", h, ctypes.byref(v))
    row.put("clocks_throttle_reasons.active", rc, v.value, f"0x{v.value:016X}")
    row.uint("pcie.link.gen.current", "nvmlDeviceGetCurrPcieLinkGeneration", h)
    row.uint("pcie.link.gen.max", "nvmlDeviceGetMaxPcieLinkGeneration", h)
    row.uint("pcie.link.width.current", "nvmlDeviceGetCurrPcieLinkWidth", h)
    row.uint("pcie.link.width.max", "nvmlDeviceGetMaxPcieLinkWidth", h)
    ps = ctypes.c_uint()
    rc = nv.call("nvmlDeviceGetPerformanceState", h, ctypes.byref(ps))
    if rc == NVML_SUCCESS and ps.value > 15:  # NVML_PSTATE_UNKNOWN (32)
        rc = NVML_ERROR_NOT_SUPPORTED
    row.put("pstate", rc, "P%d" % ps.value)  # noqa: UP031 - as nvidia-smi prints it
    if not all(isinstance(row.out.get(k), int) for k in LINK_FIELDS):
        # as probe_health.part_gpus: where the driver does not report the PCIe link, sysfs does
        base = "/sys/bus/pci/devices/" + row.out["bdf"]
        row.out["sysfs_link"] = {key: read_str(base + "/" + name) for key, name in SYSFS_LINK}
    fields = read_fields(
        nv,
        h,
        [FI_MEMORY_TEMP, FI_GPU_RECOVERY_ACTION, FI_RESET_STATUS, FI_NVLINK_LINK_COUNT]
        + [i for i, _ in FI_COUNTERS],
    )
    rc, count = fields[FI_NVLINK_LINK_COUNT]
    row.links = read_links(nv, h, int(count) if rc == NVML_SUCCESS else None)
    row.fabric = read_fabric(nv, h)
    limit = ctypes.c_uint()
    rc = nv.call("nvmlDeviceGetTemperatureThreshold", h, THRESHOLD_MEM_MAX, ctypes.byref(limit))
    row.fabric["memory_temp_max"] = float(limit.value) if rc == NVML_SUCCESS else None
    row.put("temperature.memory", *fields[FI_MEMORY_TEMP])
    rc, action = fields[FI_GPU_RECOVERY_ACTION]
    if rc == NVML_SUCCESS:
        row.put("gpu_recovery_action", rc, RECOVERY.get(action, str(action)))
    else:
        row.put("reset_status.reset_required", *fields[FI_RESET_STATUS])
    for fid, key in FI_COUNTERS:
        rc, ns = fields[fid]
        row.put(key, rc, ns // 1000 if rc == NVML_SUCCESS else None)
    if row.errors:
        row.out["cell_errors"] = row.errors
    if remap.get("cell_errors") is None and row.errors and "remapped_rows.failure" in row.errors:
        remap["cell_errors"] = {"remapped_rows.failure": row.errors["remapped_rows.failure"]}
    return row, remap


def read_links(nv, h, count):
    """Return one GPU's `nvlink` entry and its `nvlink -e` entry (None without NVLink).

    `count` is NVML_FI_DEV_NVLINK_LINK_COUNT's answer; where a driver has no such field, links
    are asked for from 0 until one is refused. A GPU in MIG mode answers no NVLink query: its
    entry says so (`mig`), as nvidia-smi does.
    """
    cur, pend = ctypes.c_uint(), ctypes.c_uint()
    if nv.call("nvmlDeviceGetMigMode", h, ctypes.byref(cur), ctypes.byref(pend)) == NVML_SUCCESS:
        if cur.value == MIG_ENABLE:
            return {"links": {}, "mig": "MIG mode (nvmlDeviceGetMigMode): NVLink queries unsupported"}, None
    states = []
    active = ctypes.c_uint()
    for link in range(count if count is not None else MAX_LINKS):
        rc = nv.call("nvmlDeviceGetNvLinkState", h, link, ctypes.byref(active))
        if rc != NVML_SUCCESS and count is None:
            break
        states.append((link, rc, active.value if rc == NVML_SUCCESS else 0))
    if not states:
        return None, None
    speeds = read_fields(nv, h, [FI_NVLINK_SPEED_COMMON] + [(FI_NVLINK_SPEED, link) for link, _, _ in states])
    links = {}
    for link, rc, on in states:
        up = rc == NVML_SUCCESS and on == 1  # NVML_FEATURE_ENABLED (nvml.h:887)
        mbps = speeds[(FI_NVLINK_SPEED, link)][1] or speeds[FI_NVLINK_SPEED_COMMON][1]
        gbps = mbps / 1000.0 if up and mbps else None
        if rc != NVML_SUCCESS:
            text = "[" + nv.error(rc) + "]"
        else:
            text = (f"{gbps:g} GB/s" if gbps else "active") if up else "<inactive>"
        links[str(link)] = {"up": up, "gbps": gbps, "text": text}
    errors = {"read": 0, "links": {}}  # type: dict
    got = read_fields(nv, h, [(fid, link) for link, _, _ in states for fid, _ in NVLINK5_FIELDS])
    counts = [((link, name), got[(fid, link)]) for link, _, _ in states for fid, name in NVLINK5_FIELDS]
    if not any(rc == NVML_SUCCESS for _, (rc, _) in counts):  # not NVLink 5: the data-link counters
        counts = []
        for link, _, _ in states:
            for counter, name in DL_COUNTERS:
                v = ctypes.c_ulonglong()
                rc = nv.call("nvmlDeviceGetNvLinkErrorCounter", h, link, counter, ctypes.byref(v))
                counts.append(((link, name), (rc, v.value)))
    for (link, name), (rc, value) in counts:
        if rc == NVML_SUCCESS:
            errors["read"] += 1
            if value:  # zeros are not sent, as parse_nvlink_errors
                errors["links"].setdefault(str(link), {})[name] = int(value)
    return {"links": links}, errors


def read_fabric(nv, h):
    """Return one GPU's fabric {state, status} as nvidia-smi -q prints them (N/A off NVSwitch)."""
    if nv.has("nvmlDeviceGetGpuFabricInfoV"):
        info = FabricInfoV2(version=FABRIC_V2)
        rc = nv.call("nvmlDeviceGetGpuFabricInfoV", h, ctypes.byref(info))
    else:
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    if rc == NVML_ERROR_ARGUMENT_VERSION_MISMATCH:  # a driver before the versioned structure
        info = FabricInfo()  # type: ignore[assignment]
        rc = nv.call("nvmlDeviceGetGpuFabricInfo", h, ctypes.byref(info))
    if rc == NVML_ERROR_NOT_SUPPORTED:
        return {"state": "N/A", "status": "N/A"}
    if rc != NVML_SUCCESS:
        return {"state": "[" + nv.error(rc) + "]", "status": None}
    state = FABRIC_STATE.get(info.state, str(info.state))
    # the status "must be checked only if the state returns complete" (nvml.h:3817)
    return {"state": state, "status": nv.error(info.status) if info.state == FABRIC_COMPLETED else "N/A"}


def read_all(nv):
    """Read every GPU through the library at `path`: the `gpus`, `remap` and `nvlink` parts, the
    GPUs' side of `fabric`, and counts."""
    rc = nv.call("nvmlInit_v2")
    if rc != NVML_SUCCESS:
        return {"ok": False, "error": "nvmlInit_v2: " + nv.error(rc), "rc": rc}
    try:
        buf = ctypes.create_string_buffer(DRIVER_BUFFER)
        rc = nv.call("nvmlSystemGetDriverVersion", buf, DRIVER_BUFFER)
        driver = buf.value.decode("ascii", "replace") if rc == NVML_SUCCESS else None
        count = ctypes.c_uint()
        rc = nv.call("nvmlDeviceGetCount_v2", ctypes.byref(count))
        if rc != NVML_SUCCESS:
            return {"ok": False, "error": "nvmlDeviceGetCount_v2: " + nv.error(rc), "rc": rc}
        gpus, remap, links, errors, fabric = [], {}, {}, {}, {}
        for i in range(count.value):
            row, rm = read_gpu(nv, i, driver)
            gpus.append(row.out)
            if rm is not None:
                remap[row.out["bdf"]] = rm
            if row.links[0] is not None:
                links[str(i)] = row.links[0]
            if row.links[1] is not None:
                errors[str(i)] = dict(row.links[1], uuid=row.out.get("uuid"))
            if row.fabric:
                fabric[row.out["bdf"]] = row.fabric
    finally:
        nv.call("nvmlShutdown")
    nvlink = {"ok": True, "gpus": links, "source": "nvml"}  # type: dict
    if any(g["links"] for g in links.values()):  # as nvidia-smi: counters where links are listed
        nvlink["errors"] = {"ok": True, "gpus": errors, "source": "nvml"}
    renamed = (
        {"reset_status.reset_required": "gpu_recovery_action"}
        if any("gpu_recovery_action" in g for g in gpus)
        else {}
    )
    return {
        "ok": True,
        "driver_version": driver,
        "calls": nv.calls,
        "gpus": {"ok": True, "gpus": gpus, "dropped": [], "renamed": renamed, "source": "nvml"},
        "remap": {"ok": True, "gpus": remap, "source": "nvml"},
        "nvlink": nvlink,
        "fabric": {"ok": True, "gpus": fabric, "source": "nvml"},
    }


@fact("health_nvml")
def fact_health_nvml(params):
    """Read the GPUs through NVML, bounded; leave the result for the `health` fact in `params`."""
    timeout = float(params.get("nvml_timeout") or params.get("timeout", 20))
    path = params.get("nvml_library") or LIBRARY
    out = bounded(path, read_all, timeout)
    out["library"] = path
    params[CACHE_KEY] = out
    summary = {k: v for k, v in out.items() if k not in ("gpus", "remap", "nvlink", "fabric")}
    summary["source"] = "nvml"
    return summary
