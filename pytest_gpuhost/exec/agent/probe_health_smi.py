"""Agent probe library: what suites/health reads from nvidia-smi, parsed.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py); registers no op
or fact: probe_health.py's `health` fact calls these readers for the parts NVML did not read
(probe_health_nvml.py), and always for the header (`smi`) and `topo -p2p`. Each reader runs one
or two nvidia-smi commands under the request's timeout, records them for the evidence, and
returns a part in the shape the verdicts (modules/health/) judge. Read-only.
"""

import json
import os
import re

from pytest_gpuhost.exec.agent.core import read_str, read_text, run_recorded, state_path

STATE_FILE = "health-state.json"  # under the agent's state directory (state_path)
# Row remapping has a query of its own (nvidia-smi --help-query-remapped-rows), on GPUs that remap
# rows (A100 and later data-center GPUs): pending means a GPU reset is needed to apply a remap.
REMAP_FIELDS = (
    "gpu_bus_id",
    "remapped_rows.correctable",
    "remapped_rows.uncorrectable",
    "remapped_rows.pending",
    "remapped_rows.failure",
)
QUERY_FIELDS = (
    "index",
    "pci.bus_id",
    "name",
    "uuid",
    "driver_version",
    "persistence_mode",
    "temperature.gpu",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.failure",
    "clocks_throttle_reasons.active",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
    # Yes while the GPU needs a reset (the driver's reset-required bit, cleared only by a reset):
    # modules/health/xid.settle settles an owed reset by it; R5xx drivers without it drop it (no retry after).
    # Drivers from 590 have no such field (--help-query-gpu of 590.48.01, 595.71.05, 610.57.04)
    # but gpu_recovery_action, NVML's recovery action (None, Reset, Reboot, Drain P2P, Drain and
    # Reset): asked for in its place (FIELD_SUCCESSOR), under its own name
    "reset_status.reset_required",
    # Enabled/Disabled ([N/A] where the GPU has no ECC): health_memory fails ECC left off on a
    # model that supports it; the memory (HBM) temperature, N/A on GDDR boards
    "ecc.mode.current",
    "temperature.memory",
    # Time (microseconds, since the driver loaded) each clock-event reason held the clocks down
    # (nvidia-smi --help-query-gpu, R550+; "[us]" in the csv header): compared with the last run
    "clocks_event_reasons_counters.hw_thermal_slowdown",
    "clocks_event_reasons_counters.hw_power_brake_slowdown",
    "clocks_event_reasons_counters.sw_thermal_slowdown",
    "clocks_event_reasons_counters.sw_power_cap",
    # MIG mode now and after the next GPU reset (Enabled/Disabled, [N/A] on a model without MIG;
    # nvidia-smi --help-query-gpu): health.gpu.check_mig_mode judges them against `mig_mode`
    "mig.mode.current",
    "mig.mode.pending",
    # The performance state (P0 maximum .. P12 minimum) and the busy share of the last sample
    # period: the PCIe link's current generation "may be reduced when the GPU is not in use"
    # (nvidia-smi --help-query-gpu), so pcie_link judges it only where the GPU is at work
    "pstate",
    "utilization.gpu",
)
# Fields a driver has all or none of: one unknown drops its family in one retry, not one each.
FIELD_FAMILIES = ("clocks_event_reasons_counters.",)
TEXT_FIELDS = ("pci.bus_id", "name", "uuid", "driver_version", "pstate")
LINK_FIELDS = ("pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max")
SYSFS_LINK = (
    ("speed", "current_link_speed"),
    ("width", "current_link_width"),
    ("max_speed", "max_link_speed"),
    ("max_width", "max_link_width"),
)
# A field a driver renamed: its new name, asked for in its place (R535 renamed clocks_throttle_reasons.*
# to clocks_event_reasons.*; `nvidia-smi --help-query-gpu` of either driver lists its own name).
FIELD_RENAMED = {"clocks_throttle_reasons.active": "clocks_event_reasons.active"}
# A field a driver replaced by another that says more, in other values: asked for in its place
# where the driver lacks it, and reported under the new name (not as the old field).
FIELD_SUCCESSOR = {"reset_status.reset_required": "gpu_recovery_action"}
# nvidia-smi prints an NVML error in brackets in a cell (nvmlErrorString: "GPU requires reset",
# "GPU is lost", "Unknown Error", ...). These two mean "no value here", not "the GPU is in trouble".
NO_VALUE = ("N/A", "Not Supported")
_BAD_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query')
_BUS_ID = re.compile(r"^([0-9a-f]+):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")


# A line that says what went wrong, in what nvidia-smi prints when it fails ("Failed to initialize
# NVML: Driver/library version mismatch", "NVIDIA-SMI has failed because it couldn't communicate
# with the NVIDIA driver", "No devices were found", "Unable to determine the device handle ...").
_SAYS_ERROR = re.compile(
    r"fail|error|unable|mismatch|couldn't|cannot|invalid|not a valid|not found|no devices", re.IGNORECASE
)


def error_line(text):
    """Return the line of a failed tool's output that says the error, and its last line after it.

    nvidia-smi's NVML errors end with a detail line: `Failed to initialize NVML: Driver/library
    version mismatch` then `NVML library version: 580.178` (exit 18; fixtures/outputs/nvidia-smi-
    nvml-mismatch-580.txt), so the last line alone says nothing of the error. Without a line that
    says one, the last line.
    """
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    if not lines:
        return ""
    says = [ln for ln in lines if _SAYS_ERROR.search(ln)]
    first = says[0] if says else lines[-1]
    out = first if first == lines[-1] else f"{first}; {lines[-1]}"
    return out[:400]


def cmd_error(res, what):
    if res["timed_out"]:
        return what + " timed out"
    if res["rc"] == 127:
        return what + ": command not found"
    err = error_line(res.get("stderr") or res.get("stdout") or "")
    return f"{what} exited {res['rc']}" + (": " + err if err else "")


def csv_cell(text):
    """Parse a nvidia-smi csv cell: int, float, Yes/No as 1/0, or None for N/A."""
    t = text.strip()
    if not t or t.startswith("[") or t in ("N/A", "Unknown"):
        return None
    if t in ("Yes", "Enabled"):
        return 1
    if t in ("No", "Disabled"):
        return 0
    try:
        return int(t, 0) if t.startswith("0x") else int(t)
    except ValueError:
        try:
            return float(t)
        except ValueError:
            return t


def short_bdf(bus):
    """Turn nvidia-smi's 00000000:17:00.0 into sysfs's 0000:17:00.0."""
    bus = bus.strip().lower()
    m = _BUS_ID.match(bus)
    if not m:
        return bus
    return f"{int(m.group(1), 16) & 0xFFFF:04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


#: What a loaded NVIDIA driver leaves on a host (the module, its procfs directory, its control device).
DRIVER_SIGNS = ("/sys/module/nvidia", "/proc/driver/nvidia", "/dev/nvidiactl")


def driver_signs():
    """Return the signs of a loaded NVIDIA driver this node shows (none: no driver here)."""
    return [p for p in DRIVER_SIGNS if os.path.exists(p)]


def smi_gpus(params, record):
    """Query every GPU's fields; a field this driver does not know is dropped, in this request."""
    timeout = float(params.get("timeout", 20))
    fields = list(params.get("query_fields") or QUERY_FIELDS)
    dropped = []
    renamed = {}  # type: dict
    for _ in range(2 * len(fields)):
        res = run_recorded(
            ["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"],
            timeout,
            record,
        )
        bad = _BAD_FIELD.search(res.get("stdout", "") + res.get("stderr", ""))
        name = bad.group(1) if bad else ""
        if res["rc"] != 0 and name in fields and name not in ("index", "pci.bus_id"):
            # Older or newer drivers lack some fields: ask for the field's other name, or drop
            # it, and ask again, still in this request; the verdicts say which (never a silent skip).
            new = FIELD_RENAMED.get(name) or FIELD_SUCCESSOR.get(name)
            if new and new not in fields and new not in dropped:
                fields[fields.index(name)] = new
                renamed[name] = new
            else:
                family = [p for p in FIELD_FAMILIES if name.startswith(p)]
                for f in [f for f in fields if f == name or family and f.startswith(family[0])]:
                    fields.remove(f)
                    dropped.append(f)
                for old, other in list(renamed.items()):
                    if other == name:
                        del renamed[old]
                        dropped.append(old)
            continue
        break
    if res["rc"] != 0:
        out = {
            "ok": False,
            "error": cmd_error(res, "nvidia-smi --query-gpu"),
            "gpus": [],
            "dropped": dropped,
            "renamed": renamed,
        }
        if res["rc"] == 127:
            out["missing"] = "nvidia-smi"
            out["driver_signs"] = driver_signs()
        return out
    back = {new: old for old, new in renamed.items() if FIELD_RENAMED.get(old) == new}
    gpus = []
    for line in res["stdout"].splitlines():
        if not line.strip():
            continue
        raw = dict(zip([back.get(f, f) for f in fields], [c.strip() for c in line.split(",")]))
        row = {"raw": raw, "bdf": short_bdf(raw.get("pci.bus_id", ""))}  # type: dict
        errors = {}
        for key, cell in raw.items():
            if key not in TEXT_FIELDS:
                row[key] = csv_cell(cell)
            if cell.startswith("[") and cell.endswith("]") and cell[1:-1] not in NO_VALUE:
                errors[key] = cell[1:-1]  # an NVML error for this GPU: the checks judge it
        if errors:
            row["cell_errors"] = errors
        for key in ("name", "uuid", "driver_version", "pstate"):
            row[key] = raw.get(key)
        if not all(isinstance(row.get(f), int) for f in LINK_FIELDS):
            # This driver does not report the PCIe link: sysfs does (speeds in GT/s, widths).
            base = "/sys/bus/pci/devices/" + row["bdf"]
            row["sysfs_link"] = {key: read_str(base + "/" + name) for key, name in SYSFS_LINK}
        gpus.append(row)
    return {"ok": True, "gpus": gpus, "dropped": dropped, "renamed": renamed}


def _cached_cuda(params, driver):
    """Return the CUDA version the health state keeps for this driver version, or None."""
    if not driver or params.get("no_cache"):
        return None
    state = params.get("state")  # a --check-only run's state, sent by the controller
    if not isinstance(state, dict):
        try:
            state = json.loads(
                read_text(params.get("state_path") or state_path(STATE_FILE), 1 << 20).decode("utf-8")
            )
        except (OSError, ValueError):
            return None  # no state yet, or unreadable: the kernel-log fact says why
    cached = state.get("cuda") if isinstance(state, dict) else None
    if isinstance(cached, dict) and cached.get("driver_version") == driver and cached.get("cuda_version"):
        return cached
    return None


def part_smi(params, record, driver=None):
    """CUDA and driver version from nvidia-smi's header.

    The CUDA version is a property of the installed driver, so the health state keeps it keyed
    by the driver version (health_commit writes it): with `driver` (the version the `gpus` part
    just read) equal to the cached one, nvidia-smi is not started again.
    """
    cached = _cached_cuda(params, driver)
    if cached is not None:
        return {
            "ok": True,
            "cuda_version": cached["cuda_version"],
            "driver_version": driver,
            "cached": {
                "driver_version": driver,
                "cuda_version": cached["cuda_version"],
                "at": cached.get("at"),
            },
        }
    res = run_recorded(["nvidia-smi"], float(params.get("timeout", 20)), record)
    if res["rc"] != 0:
        return {"ok": False, "error": cmd_error(res, "nvidia-smi")}
    out = {"ok": True, "cuda_version": None, "driver_version": None}  # type: dict
    out["driver_version"], out["cuda_version"] = header_versions(res["stdout"])
    return out


def header_versions(text):
    """Return (driver, CUDA) versions from plain nvidia-smi's header, either spelling, or None each.

    Up to 595: `Driver Version: 570.133.20   CUDA Version: 12.8`; from 610: `KMD Version: 610.57.04
    CUDA UMD Version: 13.3` (fixtures/outputs/nvidia-smi-610.57.04-gtx1650.txt).
    """
    driver = re.search(r"(?:Driver|KMD) Version:\s*([0-9.]+)", text)
    cuda = re.search(r"CUDA (?:UMD )?Version:\s*([0-9.]+)", text)
    return (driver.group(1) if driver else None), (cuda.group(1) if cuda else None)


def smi_remap(params, record):
    """Read every GPU's row-remapping counters and flags with `--query-remapped-rows`."""
    res = run_recorded(
        ["nvidia-smi", "--query-remapped-rows=" + ",".join(REMAP_FIELDS), "--format=csv,noheader,nounits"],
        float(params.get("timeout", 20)),
        record,
    )
    if res["rc"] != 0:
        return {"ok": False, "error": cmd_error(res, "nvidia-smi --query-remapped-rows")}
    gpus = {}
    for line in res["stdout"].splitlines():
        if not line.strip():
            continue
        raw = dict(zip(REMAP_FIELDS, [c.strip() for c in line.split(",")]))
        row = {k: csv_cell(v) for k, v in raw.items() if k != "gpu_bus_id"}  # type: dict
        errors = {
            k: v[1:-1]
            for k, v in raw.items()
            if v.startswith("[") and v.endswith("]") and v[1:-1] not in NO_VALUE
        }
        if errors:
            row["cell_errors"] = errors
        gpus[short_bdf(raw.get("gpu_bus_id", ""))] = row
    return {"ok": True, "gpus": gpus}


def smi_fabric(timeout, record):
    """Each GPU's fabric State/Status and memory temperature limit from `nvidia-smi -q`.

    nvidia-smi -q prints, per GPU (under "GPU 00000000:1B:00.0"), a section
    "    Fabric" with "        State : Completed" and "        Status : Success" (N/A off NVSwitch).
    """
    res = run_recorded(["nvidia-smi", "-q"], timeout, record)
    if res["rc"] != 0:
        return {"ok": False, "error": cmd_error(res, "nvidia-smi -q")}
    gpus = {}  # type: dict
    mem_max = {}  # type: dict
    mem_max_tlimit = {}  # type: dict
    bdf = None
    in_fabric = False
    for line in res["stdout"].splitlines():
        m = re.match(r"^GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$", line)
        if m:
            bdf, in_fabric = short_bdf(m.group(1)), False
            continue
        indent = len(line) - len(line.lstrip())
        # Temperature section: "        Memory Max Operating Temp         : 95 C" (N/A on GDDR)
        t = re.match(r"^\s{8}Memory Max Operating Temp\s*:\s*([0-9.]+)\s*C\s*$", line)
        if bdf and t:
            mem_max[bdf] = float(t.group(1))
            continue
        # Drivers that print temperatures as T.Limit (the margin below the GPU's own limit, 0 C at
        # the limit: "GPU T.Limit Temp : 59 C" next to "GPU Max Operating T.Limit Temp : 0 C") print
        # "Memory Max Operating T.Limit Temp : 0 C" (N/A on GDDR): the reference, not the limit in
        # C; kept apart, never read as a limit (fixtures/outputs/nvidia-smi-q-550.90.12-h200-tlimit.txt)
        t = re.match(r"^\s{8}Memory Max Operating T\.Limit Temp\s*:\s*(-?[0-9.]+)\s*C\s*$", line)
        if bdf and t:
            mem_max_tlimit[bdf] = float(t.group(1))
            continue
        if bdf and line.strip() == "Fabric" and indent == 4:
            in_fabric = True
            gpus[bdf] = {"state": None, "status": None}
            continue
        if in_fabric and indent <= 4:
            in_fabric = False
        if in_fabric and indent == 8 and ":" in line:
            key, _, value = line.partition(":")
            if key.strip() in ("State", "Status"):
                gpus[bdf][key.strip().lower()] = value.strip()
    return {"ok": True, "gpus": gpus, "memory_temp_max": mem_max, "memory_temp_max_tlimit": mem_max_tlimit}


# nvidia-smi's answer for a GPU in MIG mode ("Nvlink queries are not supported for Devices in MIG
# mode"): said of the GPU it follows, or of every GPU when it comes before any GPU line.
_MIG_MODE = re.compile(r"\bMIG mode\b", re.IGNORECASE)


def smi_nvlink(params, record):
    res = run_recorded(["nvidia-smi", "nvlink", "-s"], float(params.get("timeout", 20)), record)
    mig = [x.strip() for x in res["stderr"].splitlines() if _MIG_MODE.search(x)]
    if res["rc"] != 0 and not res["stdout"].strip() and not mig:
        return {"ok": False, "error": cmd_error(res, "nvidia-smi nvlink -s")}
    gpus = {}
    current = None  # type: dict | None
    for line in res["stdout"].splitlines():
        m = re.match(r"^GPU (\d+):", line.strip())
        if m:
            current = {"links": {}}
            gpus[m.group(1)] = current
            continue
        if _MIG_MODE.search(line):
            if current is None:
                mig.append(line.strip())
            else:
                current["mig"] = line.strip()
            continue
        m = re.match(r"^Link (\d+):\s*(.*)$", line.strip())
        if m and current is not None:
            state = m.group(2).strip()
            speed = re.match(r"^([0-9.]+)\s*GB/s", state)
            gbps = float(speed.group(1)) if speed else None
            current["links"][m.group(1)] = {
                "up": gbps is not None and gbps > 0,
                "gbps": gbps,
                "text": state,
            }
    out = {"ok": True, "gpus": gpus}  # type: dict
    if mig:
        out["mig"] = mig[0]
    if any(g["links"] for g in gpus.values()):  # a host without NVLink starts no second process
        res = run_recorded(["nvidia-smi", "nvlink", "-e"], float(params.get("timeout", 20)), record)
        err = res["rc"] != 0 and {"ok": False, "error": cmd_error(res, "nvidia-smi nvlink -e")}
        out["errors"] = err or {"ok": True, "gpus": parse_nvlink_errors(res["stdout"])}
    return out


_KEEP = re.compile(r"^(?!FEC |Raw )[ -~]{0,60}(errors|events|discards)$", re.IGNORECASE)  # bounded ASCII


def parse_nvlink_errors(text):
    """`nvidia-smi nvlink -e` -> {GPU index: {"uuid", "read": N, "links": {link: {counter: value}}}}:
    the non-zero error counters, "Link 0: Rx Errors: 2" (docs/health-checks.md: formats, what is left out)."""
    gpus = {}  # type: dict
    current, link = None, None  # type: dict | None, str | None
    for raw in text.splitlines():
        line = raw.strip()
        m = re.match(r"^GPU (\d+):\s*.*?(?:\(UUID:\s*([^)]*)\))?$", line)
        if m:
            current, link = {"uuid": m.group(2), "read": 0, "links": {}}, None
            gpus[m.group(1)] = current
            continue
        m = re.match(r"^Link (\d+):\s*(.*)$", line)
        if m:
            link, line = m.group(1), m.group(2).strip()
        name, _, value = line.rpartition(":")
        name, value = name.strip(), value.strip()
        if current is not None and link is not None and _KEEP.match(name) and value.isdecimal():
            current["read"] += 1
            if int(value):  # zeros are not sent: a GPU read with no link under it had none
                current["links"].setdefault(link, {})[name] = int(value)
    return gpus


def part_p2p(params, record):
    res = run_recorded(["nvidia-smi", "topo", "-p2p", "r"], float(params.get("timeout", 20)), record)
    if res["rc"] != 0:
        return {"ok": False, "error": cmd_error(res, "nvidia-smi topo -p2p r")}
    labels = []  # type: list
    rows = []
    for line in res["stdout"].splitlines():
        cells = line.split()
        if not cells:
            if labels:
                break
            continue
        if not labels:
            if all(c.startswith("GPU") for c in cells):
                labels = cells
            continue
        if cells[0] in labels:
            rows.append(cells[1 : 1 + len(labels)])
    return {"ok": bool(labels), "labels": labels, "matrix": rows, "error": None if labels else "no matrix"}
