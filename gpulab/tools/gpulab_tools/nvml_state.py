"""The lab host's GPU state as the stand-in libnvidia-ml.so.1 reads it (gpulab/nvml/libnvidia-ml.c).

One ``key value`` line per NVML answer, ``gpu N`` before each GPU's lines, printed at every
nvmlInit_v2; a per-link answer's key ends in ``.LINK``. The values are the lab's nvidia-smi cells (nvidia_smi.gpu_field, the same state
and faults), so both tools say the same; a cell nvidia-smi prints as ``[error]`` becomes ``!N``,
NVML error N (nvml.h's nvmlReturn_t), and N/A becomes NVML_ERROR_NOT_SUPPORTED. The fault
``nvml_hang`` (true, or an NVML function name) prints ``hang NAME``: that call blocks forever.

A host with the fault ``unknown_fields`` models another driver's nvidia-smi vocabulary (field
names NVML does not have): it prints nothing and exits 1, so nvmlInit_v2 fails and the health
probe reads nvidia-smi, whose field names those tests are about.
"""

from __future__ import annotations

import sys

from gpulab_tools import GpuView, Host
from gpulab_tools.nvidia_smi import _memory_temp_max, _remap_fields, fabric, gpu_field, nvlinks
from gpulab_tools.nvidia_smi_nvlink import NVLINK4, counter_faults, counter_names
from gpulab_tools.nvidia_smi_nvlink import value as counter_value

# nvmlReturn_t codes (https://github.com/NVIDIA/go-nvml/blob/main/gen/nvml/nvml.h, 1296-1329) by
# nvmlErrorString's text, the text nvidia-smi prints in brackets
ERRORS = {
    "Not Supported": 3,
    "N/A": 3,
    "Insufficient Permissions": 4,
    "Driver Not Loaded": 9,
    "Timeout": 10,
    "Corrupted infoROM": 14,
    "GPU is lost": 15,
    "GPU requires reset": 16,
    "GPU access blocked by the operating system": 17,
    "Driver/library version mismatch": 18,
    "No data": 21,
}
UNKNOWN = 999
HANG_DEFAULT = "nvmlDeviceGetTemperature"
# nvmlGpuRecoveryAction_t (nvml.h 2195-2200) by nvidia-smi's words
RECOVERY = {"None": 0, "Reset": 1, "Reboot": 2, "Drain P2P": 3, "Drain and Reset": 4}
# NVML answer -> nvidia-smi --query-gpu field it mirrors
FIELDS = (
    ("name", "name"),
    ("uuid", "uuid"),
    ("busid", "pci.bus_id"),
    ("pci_device_id", "pci.device_id"),
    ("pci_subsystem_id", "pci.sub_device_id"),
    ("persistence", "persistence_mode"),
    ("temp", "temperature.gpu"),
    ("ecc_mode", "ecc.mode.current"),
    # nvmlDeviceGetMigMode's current and pending mode (get_mode reads KEY_pending where there is one)
    ("mig", "mig.mode.current"),
    ("mig_pending", "mig.mode.pending"),
    ("ecc_corrected", "ecc.errors.corrected.volatile.total"),
    ("ecc_uncorrected", "ecc.errors.uncorrected.volatile.total"),
    ("retired_pending", "retired_pages.pending"),
    ("clocks_event", "clocks_event_reasons.active"),
    ("pcie_gen", "pcie.link.gen.current"),
    ("pcie_gen_max", "pcie.link.gen.max"),
    ("pcie_width", "pcie.link.width.current"),
    ("pcie_width_max", "pcie.link.width.max"),
    # nvmlDeviceGetPerformanceState: the number of nvidia-smi's "P0".."P15"
    ("pstate", "pstate"),
    # nvmlDeviceGetFieldValues ids (nvml.h): NVML_FI_DEV_MEMORY_TEMP 82, NVML_FI_DEV_RESET_STATUS
    # 226, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230
    ("fi_82", "temperature.memory"),
    ("fi_226", "reset_status.reset_required"),
    ("fi_230", "gpu_recovery_action"),
)
# NVML_FI_DEV_CLOCKS_EVENT_REASON_* (nvml.h 2845-2849; nanoseconds) by nvidia-smi's counter (microseconds)
COUNTERS = (
    ("fi_74", "sw_power_cap"),
    ("fi_269", "sw_thermal_slowdown"),
    ("fi_270", "hw_thermal_slowdown"),
    ("fi_271", "hw_power_brake_slowdown"),
)
WORDS = {"Enabled": "1", "Disabled": "0", "Yes": "1", "No": "0"}
# NVLink: NVML_FI_DEV_NVLINK_LINK_COUNT 91, NVML_FI_DEV_NVLINK_GET_SPEED 164 (MBps), the link in
# scopeId (nvml.h 2503, 2675); the counters nvidia-smi nvlink -e prints, by its names: NVLink 2-4
# through nvmlDeviceGetNvLinkErrorCounter's nvmlNvLinkErrorCounter_t (nvml.h 517-523), NVLink 5 as
# NVML_FI_DEV_NVLINK_COUNT_* field values (nvml.h 2752-2777); keys "fi_F.LINK" and "nvl_err_C.LINK"
DL_COUNTER = {"Replay Errors": 0, "Recovery Errors": 1, "CRC Errors": 2}
NVLINK5_FIELD = {
    "Malformed packet Errors": 206,
    "Buffer overrun Errors": 207,
    "Rx Errors": 208,
    "Rx remote Errors": 209,
    "Rx General Errors": 210,
    "Local link integrity Errors": 211,
    "Tx discards": 212,
    "Link recovery successful events": 213,
    "Link recovery failed events": 214,
    "Total link recovery events": 215,
    "Effective Errors": 219,
    "Symbol Errors": 221,
}
# NVML_GPU_FABRIC_STATE_* (nvml.h 3800-3803) by -q's words; "N/A" is NVML_ERROR_NOT_SUPPORTED
FABRIC_STATE = {"Not Started": 1, "In Progress": 2, "Completed": 3}


def link_lines(host: Host, g: GpuView) -> list[str]:
    """The GPU's NVLink answers: the link count, each link's state and speed, its error counters."""
    speeds = nvlinks(host, g)
    out = [f"fi_91 {len(speeds)}"]
    faults, names = counter_faults(host, g), counter_names(g)
    for i, bw in enumerate(speeds):
        out.append(f"nvl_state.{i} {0 if bw is None else 1}")
        out.append(f"fi_164.{i} {0 if bw is None else round(bw * 1000)}")
        for name in names:
            key = f"nvl_err_{DL_COUNTER[name]}" if names is NVLINK4 else f"fi_{NVLINK5_FIELD.get(name)}"
            if names is NVLINK4 or name in NVLINK5_FIELD:  # BER and the FEC bins: not answered
                out.append(f"{key}.{i} {counter_value(faults, i, name)}")
    state, status = fabric(host, g)
    if state in FABRIC_STATE:
        out.append(f"fabric_state {FABRIC_STATE[state]}")
        out.append(f"fabric_status {0 if status in ('Success', 'N/A') else ERRORS.get(status, UNKNOWN)}")
    limit = _memory_temp_max(g, host)
    if limit.endswith(" C"):
        out.append(f"temp_mem_max {limit[:-2]}")
    return out


def value(cell: str | None) -> str:
    """Return one NVML answer from a nvidia-smi cell: the number, or ``!N`` for NVML error N."""
    if cell is None:
        return "!3"  # a field this driver lacks: NVML_ERROR_NOT_SUPPORTED
    c = cell.strip()
    if c.startswith("[") and c.endswith("]"):
        return f"!{ERRORS.get(c[1:-1], UNKNOWN)}"
    if c in ("N/A", "Not Supported"):
        return "!3"
    if c in RECOVERY:
        return str(RECOVERY[c])
    if len(c) > 1 and c[0] == "P" and c[1:].isdigit():  # a performance state: nvmlPstates_t's number
        return c[1:]
    return WORDS.get(c, c)


def lines(host: Host) -> list[str]:
    """Return the state's lines for every GPU the driver sees."""
    out = [f"driver {host.driver_version}"]
    hang = host.faults.get("nvml_hang")
    if hang:
        out.append(f"hang {hang if isinstance(hang, str) else HANG_DEFAULT}")
    for g in host.gpus:
        out.append(f"gpu {g.index}")
        for key, field in FIELDS:
            got = gpu_field(host, g, field)
            v = value(got[0] if got else None)
            out.append(f"{key} {v}")
        for key, reason in COUNTERS:
            got = gpu_field(host, g, "clocks_event_reasons_counters." + reason)
            v = value(got[0] if got else None)
            out.append(f"{key} {v if v.startswith('!') else int(v) * 1000}")
        err = ((host.faults.get("gpus") or {}).get(g.bdf) or {}).get("nvml_error")
        remap = _remap_fields(host, g)
        for key in ("correctable", "uncorrectable", "pending", "failure"):
            name = "remap_" + {"correctable": "corrected", "uncorrectable": "uncorrected"}.get(key, key)
            out.append(f"{name} {value(f'[{err}]') if err else remap['remapped_rows.' + key]}")
        out.append("temp_shutdown " + str(g.spec.get("temp_shutdown", 92)))
        out.append("temp_slowdown " + str(g.spec.get("temp_slowdown", 89)))
        out.extend(link_lines(host, g))
    return out


def main() -> int:
    host = Host()
    if host.faults.get("unknown_fields"):
        return 1
    sys.stdout.write("\n".join(lines(host)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
