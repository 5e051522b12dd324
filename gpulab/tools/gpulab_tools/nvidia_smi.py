"""The lab's nvidia-smi (the program; gpulab/tools/nvidia-smi starts it): the real tool's output formats over the lab host's sysfs, /proc and profile.

Supports: the default table, ``-L``, ``--query-gpu=...``/``--query-compute-apps=...``/``--query-remapped-rows=...`` with
``--format=csv[,noheader][,nounits]``, ``-i``, ``-pm 0|1``, ``-r`` (nvidia_smi_reset.py), ``-q``, ``topo -m``,
``topo -p2p r|w|n|a|p``, ``nvlink -s`` and ``nvlink -e`` (nvidia_smi_nvlink.py). A GPU that is not bound to nvidia (or whose /dev/nvidiaN is absent, as in a
container without it) is invisible; with none visible it prints "No devices were found" (exit 6).
"""

from __future__ import annotations

import sys

from gpulab_tools import GpuView, Host, now_stamp, path, speed_gen

W = 91
LINE = "+" + "-" * (W - 2) + "+"
SPLIT = "|" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
SPLIT_END = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
DOUBLE = "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|"


def die(msg: str, code: int) -> None:
    sys.stdout.write(msg)
    sys.stdout.flush()
    raise SystemExit(code)


def no_devices() -> None:
    die("No devices were found\n", 6)


def select(host: Host, ids: str | None) -> list[GpuView]:
    if not host.gpus:
        no_devices()
    if ids is None:
        return host.gpus
    out = []
    for ident in ids.split(","):
        ident = ident.strip()
        hit = [
            g
            for g in host.gpus
            if ident == str(g.index)
            or ident.upper() in (g.bus_id, g.bus_id[4:], g.bdf.upper())
            or ident == g.spec["uuid"]
            or ident == str(g.spec["serial"])
        ]
        if not hit:
            die("No devices were found\n", 6)
        out.extend(hit)
    return out


# ------------------------------------------------------------------ queries


def _yesno(v: object) -> str:
    return "No" if not v else "Yes"


_FIELDS: dict[int, dict[str, tuple[str, str]]] = {}


# Fields a GPU in an NVML error state still answers (from the PCI and the driver, not the GPU).
_IDENTITY = {
    "timestamp", "driver_version", "count", "index", "name", "gpu_name", "serial", "gpu_serial", "uuid",
    "gpu_uuid", "pci.bus_id", "gpu_bus_id", "pci.domain", "pci.bus", "pci.device", "pci.device_id",
    "pci.sub_device_id", "persistence_mode", "minor_number", "vbios_version",
}  # fmt: skip


def gpu_field(host: Host, g: GpuView, name: str) -> tuple[str, str] | None:
    """Return (value, unit) for a --query-gpu field, None when unknown."""
    if name in host.faults.get("unknown_fields", ()):
        return None
    # One table per GPU and run, as the driver answers one sample: a query of 16 fields on 4 GPUs
    # built it 80 times (half of this tool's own CPU time).
    fields = _FIELDS.get(id(g))
    if fields is None:
        fields = _FIELDS[id(g)] = _gpu_fields(host, g)
    got = fields.get(name)
    err = (host.faults.get("gpus") or {}).get(g.bdf, {}).get("nvml_error")
    if got is not None and err and name not in _IDENTITY:
        # nvidia-smi prints the NVML error string in brackets where the GPU could not answer
        # (nvmlErrorString(NVML_ERROR_RESET_REQUIRED) is "GPU requires reset"; nvml.h)
        return f"[{err}]", got[1]
    return got


def _fault(host: Host, g: GpuView, key: str) -> object:
    """Return a runtime fault of one GPU (faults.json ``gpus: {BDF: {key: ...}}``), or None."""
    return ((host.faults.get("gpus") or {}).get(g.bdf) or {}).get(key)


def _counter_us(host: Host, g: GpuView, reason: str) -> int:
    """Return the fault clock_event_us[reason] of one GPU, 0 when none."""
    got = _fault(host, g, "clock_event_us")
    return int(got.get(reason, 0)) if isinstance(got, dict) else 0


def _ecc_count(mode: str, count: object) -> str:
    return str(count) if mode == "Enabled" else "[N/A]"


def _hbm(g: GpuView) -> bool:
    """Say whether the board's memory is HBM (B200, H100, H200): it reports a memory temperature;
    GDDR boards (RTX PRO 6000) print N/A for it (nvidia-smi -q "Memory Current Temp : N/A")."""
    return any(k in g.name for k in ("B200", "H100", "H200"))


def fabric(host: Host, g: GpuView) -> tuple[str, str]:
    """A GPU's fabric State and Status as -q prints them; the lab's NVML answers the same."""
    fault = (host.faults.get("gpus") or {}).get(g.bdf, {})
    on_fabric = bool(g.health.get("nvlinks"))
    return (
        str(fault.get("fabric_state", "Completed" if on_fabric else "N/A")),
        str(fault.get("fabric_status", "Success" if on_fabric else "N/A")),
    )


def nvlinks(host: Host, g: GpuView) -> list[float | None]:
    """A GPU's links' speeds in GB/s, None for a link down (fault ``nvlinks_down``, a list or "all")."""
    down = (host.faults.get("gpus") or {}).get(g.bdf, {}).get("nvlinks_down") or []
    return [
        None if down == "all" or i in down else float(bw)
        for i, bw in enumerate(g.health.get("nvlinks") or [])
    ]


def _memory_temp(g: GpuView, host: Host) -> object:
    """Fault temperature_memory, else the profile's health.temperature_memory, else GPU + 5 C on HBM."""
    v = _fault(host, g, "temperature_memory") or g.health.get("temperature_memory")
    if v is None:
        v = int(g.health.get("temperature", 35)) + 5 if _hbm(g) else "N/A"
    return v


def _memory_temp_max(g: GpuView, host: Host) -> str:
    """-q's "Memory Max Operating Temp": 95 C on HBM boards (as H100 boards print), N/A on GDDR."""
    v = _fault(host, g, "memory_temp_max")
    return f"{v} C" if v is not None else ("95 C" if _hbm(g) else "N/A")


# Models with MIG (NVIDIA MIG User Guide, "Supported GPUs": A100, A30, H100, H200, H20, B200,
# B300, GB200, RTX PRO 6000 Blackwell Server Edition); others print [N/A] for both MIG fields
_MIG_MODELS = ("A100", "A30", "H100", "H200", "H20", "B200", "B300", "GB200", "RTX PRO 6000")


def mig_modes(host: Host, g: GpuView) -> tuple[str, str]:
    """A GPU's MIG mode, current and pending (the mode the next GPU reset applies), as --query-gpu
    prints them: "Enabled, Enabled" on a GPU an operator partitioned, "Disabled, Enabled" after
    `nvidia-smi -i N -mig 1` before the reset, "[N/A], [N/A]" on a model without MIG. Faults
    ``mig_mode`` and ``mig_mode_pending`` (default: the current mode) set them."""
    if not any(m in g.name for m in _MIG_MODELS):
        return "[N/A]", "[N/A]"
    current = str(_fault(host, g, "mig_mode") or "Disabled")
    return current, str(_fault(host, g, "mig_mode_pending") or current)


def _gpu_fields(host: Host, g: GpuView) -> dict[str, tuple[str, str]]:
    h = g.health
    ecc = str(_fault(host, g, "ecc_mode") or "Enabled")
    lk = g.link
    pstate = "P0" if g.at_work else "P8"
    mig, mig_pending = mig_modes(host, g)
    fields: dict[str, tuple[str, str]] = {
        "timestamp": (__import__("time").strftime("%Y/%m/%d %H:%M:%S.000"), ""),
        "driver_version": (host.driver_version, ""),
        "count": (str(len(host.gpus)), ""),
        "index": (str(g.index), ""),
        "name": (g.name, ""),
        "gpu_name": (g.name, ""),
        "serial": (str(g.spec["serial"]), ""),
        "gpu_serial": (str(g.spec["serial"]), ""),
        "uuid": (str(g.spec["uuid"]), ""),
        "gpu_uuid": (str(g.spec["uuid"]), ""),
        "pci.bus_id": (g.bus_id, ""),
        "gpu_bus_id": (g.bus_id, ""),
        "pci.domain": ("0x" + g.bdf.split(":")[0].upper(), ""),
        "pci.bus": ("0x" + g.bdf.split(":")[1].upper(), ""),
        "pci.device": ("0x" + g.bdf.split(":")[2].split(".")[0].upper(), ""),
        "pci.device_id": (
            "0x" + g.func.get("device", "0x0000")[2:].upper() + g.func.get("vendor", "0x10de")[2:].upper(),
            "",
        ),
        "pci.sub_device_id": (
            "0x"
            + g.func.get("subsystem_device", "0x0000")[2:].upper()
            + g.func.get("subsystem_vendor", "0x10de")[2:].upper(),
            "",
        ),
        "memory.total": (str(g.memory_total), "MiB"),
        "memory.used": (str(g.memory_used), "MiB"),
        "memory.free": (str(g.memory_total - g.memory_used), "MiB"),
        "persistence_mode": ("Enabled" if g.persistence else "Disabled", ""),
        "temperature.gpu": (str(h.get("temperature", 35)), ""),
        "temperature.memory": (str(_memory_temp(g, host)), ""),
        # ECC off (fault ecc_mode "Disabled"): its error counters print [N/A], as on a real board
        "ecc.mode.current": (ecc, ""),
        "ecc.mode.pending": (ecc, ""),
        "ecc.errors.corrected.volatile.total": (_ecc_count(ecc, h.get("ecc_corrected", 0)), ""),
        "ecc.errors.uncorrected.volatile.total": (_ecc_count(ecc, h.get("ecc_uncorrected", 0)), ""),
        "ecc.errors.corrected.aggregate.total": (_ecc_count(ecc, h.get("ecc_corrected", 0)), ""),
        "ecc.errors.uncorrected.aggregate.total": (_ecc_count(ecc, h.get("ecc_uncorrected", 0)), ""),
        "retired_pages.pending": (_yesno(h.get("retired_pages_pending", 0)), ""),
        "remapped_rows.failure": (_yesno(h.get("remapped_rows_failure", 0)), ""),
        "remapped_rows.pending": ("No", ""),
        # reset_status.* (nvidia-smi --help-query-gpu: "Checks if a GPU reset is required" / "a GPU
        # drain and reset is recommended"): the scratch bits the driver reads (open-gpu-kernel-modules
        # gpu.c gpuIsDeviceMarkedForReset / ...DrainAndReset); faults reset_required, drain_and_reset;
        # a reset clears them (nvidia_smi_reset.py)
        "reset_status.reset_required": (_yesno(_fault(host, g, "reset_required")), ""),
        "reset_status.drain_and_reset_recommended": (_yesno(_fault(host, g, "drain_and_reset")), ""),
        "gpu_recovery_action": (_recovery_action(host, g), ""),
        "clocks_throttle_reasons.active": (str(h.get("throttle_reasons", "0x0000000000000000")), ""),
        "clocks_event_reasons.active": (str(h.get("throttle_reasons", "0x0000000000000000")), ""),
        # clocks_event_reasons_counters.* (R550+): microseconds since the driver loaded that each
        # reason held the clocks down ("[us]" in the header; nvidia-smi --help-query-gpu). The lab
        # GPU's are 0 unless the runtime fault clock_event_us {reason: us} says more (a test raises
        # it between runs, as a day of load would)
        **{
            f"clocks_event_reasons_counters.{r}": (
                str(_counter_us(host, g, r)),
                "us",
            )
            for r in (
                "sw_power_cap",
                "sync_boost",
                "sw_thermal_slowdown",
                "hw_thermal_slowdown",
                "hw_power_brake_slowdown",
            )
        },
        "pcie.link.gen.current": (str(speed_gen(lk.get("speed", ""))), ""),
        "pcie.link.gen.max": (str(speed_gen(lk.get("max_speed", lk.get("speed", "")))), ""),
        "pcie.link.gen.gpucurrent": (str(speed_gen(lk.get("speed", ""))), ""),
        "pcie.link.width.current": (str(lk.get("width", 16)), ""),
        "pcie.link.width.max": (str(lk.get("max_width", lk.get("width", 16))), ""),
        "power.draw": (f"{float(h.get('power_draw', 60.0)) + (40.0 if g.holders else 0.0):.2f}", "W"),
        "power.limit": (f"{float(g.spec.get('power_limit', 600.0)):.2f}", "W"),
        "enforced.power.limit": (f"{float(g.spec.get('power_limit', 600.0)):.2f}", "W"),
        "utilization.gpu": ("0", "%"),
        "utilization.memory": ("0", "%"),
        "compute_mode": ("Default", ""),
        "pstate": (pstate, ""),
        "fan.speed": ("[N/A]", "%"),
        "mig.mode.current": (mig, ""),
        "mig.mode.pending": (mig_pending, ""),
        "display_mode": ("Disabled", ""),
        "vbios_version": ("98.02.2E.00.04", ""),
        "minor_number": (str(g.minor), ""),
    }
    for name in _absent_fields(host):
        fields.pop(name, None)
    return fields


def _driver_major(host: Host) -> int:
    try:
        return int(str(host.driver_version).split(".")[0])
    except ValueError:
        return 0


def _absent_fields(host: Host) -> tuple[str, ...]:
    """The --query-gpu fields the modelled driver does not have.

    `nvidia-smi --help-query-gpu` of 590.48.01, 595.71.05 and 610.57.04 lists no
    reset_status.reset_required but gpu_recovery_action; 570 lists the first, not the second.
    """
    if _driver_major(host) >= 590:
        return ("reset_status.reset_required",)
    return ("gpu_recovery_action",)


def _recovery_action(host: Host, g: GpuView) -> str:
    """The GPU's recovery action as nvidia-smi prints it (-q `GPU Recovery Action : Reset` on a GPU
    the driver marked for reset; NVML's nvmlDeviceGpuRecoveryAction_t: None, Reset, Reboot, Drain
    P2P, Drain and Reset): fault recovery_action, else from the faults reset_required and
    drain_and_reset (the scratch bits a reset clears), else None."""
    got = _fault(host, g, "recovery_action")
    if got:
        return str(got)
    if _fault(host, g, "reset_required"):
        return "Reset"
    if _fault(host, g, "drain_and_reset"):
        return "Drain and Reset"
    return "None"


def parse_format(fmt: str | None) -> tuple[bool, bool]:
    opts = [o.strip() for o in (fmt or "").split(",") if o.strip()]
    if "csv" not in opts or any(o not in ("csv", "noheader", "nounits") for o in opts):
        usage_error()
    return "noheader" in opts, "nounits" in opts


def query_gpu(host: Host, fields: str, fmt: str | None, ids: str | None) -> None:
    names = [f.strip() for f in fields.split(",") if f.strip()]
    noheader, nounits = parse_format(fmt)
    gpus = select(host, ids)
    probe = gpus[0]
    for n in names:
        if gpu_field(host, probe, n) is None:
            die(f'Field "{n}" is not a valid field to query.\n\n', 2)
    out = []
    if not noheader:
        hdr = []
        for n in names:
            _, unit = gpu_field(host, probe, n) or ("", "")
            # the header keeps its units with nounits; only the values lose them
            hdr.append(f"{n} [{unit}]" if unit else n)
        out.append(", ".join(hdr))
    for g in gpus:
        row = []
        for n in names:
            v, unit = gpu_field(host, g, n) or ("", "")
            row.append(v if nounits or not unit or v.startswith("[") else f"{v} {unit}")
        out.append(", ".join(row))
    sys.stdout.write("\n".join(out) + "\n")


def _remap_fields(host: Host, g: GpuView) -> dict[str, str]:
    h = g.health
    fault = (host.faults.get("gpus") or {}).get(g.bdf, {})
    return {
        "timestamp": __import__("time").strftime("%Y/%m/%d %H:%M:%S.000"),
        "gpu_bus_id": g.bus_id,
        "gpu_uuid": str(g.spec["uuid"]),
        "gpu_serial": str(g.spec["serial"]),
        "gpu_name": g.name,
        "remapped_rows.correctable": str(fault.get("remapped_rows_correctable", 0)),
        "remapped_rows.uncorrectable": str(fault.get("remapped_rows_uncorrectable", 0)),
        "remapped_rows.pending": str(int(bool(fault.get("remapped_rows_pending", 0)))),
        "remapped_rows.failure": str(int(bool(h.get("remapped_rows_failure", 0)))),
    }


def query_remapped_rows(host: Host, fields: str, fmt: str | None, ids: str | None) -> None:
    """``--query-remapped-rows``: one line per GPU; pending/failure print 0 or 1 (a count, a flag)."""
    names = [f.strip() for f in fields.split(",") if f.strip()]
    noheader, _ = parse_format(fmt)
    gpus = select(host, ids)
    known = _remap_fields(host, gpus[0])
    for n in names:
        if n not in known:
            die(f'Field "{n}" is not a valid field to query.\n\n', 2)
    out = [", ".join(names)] if not noheader else []
    for g in gpus:
        vals = _remap_fields(host, g)
        out.append(", ".join(vals[n] for n in names))
    sys.stdout.write("\n".join(out) + "\n")


APP_FIELDS = {
    "pid": ("pid", ""),
    "process_name": ("process_name", ""),
    "name": ("process_name", ""),
    "used_memory": ("used_gpu_memory", "MiB"),
    "used_gpu_memory": ("used_gpu_memory", "MiB"),
    "gpu_bus_id": ("gpu_bus_id", ""),
    "gpu_uuid": ("gpu_uuid", ""),
    "gpu_serial": ("gpu_serial", ""),
    "gpu_name": ("gpu_name", ""),
    "timestamp": ("timestamp", ""),
}


def query_apps(host: Host, fields: str, fmt: str | None, ids: str | None) -> None:
    names = [f.strip() for f in fields.split(",") if f.strip()]
    for n in names:
        if n not in APP_FIELDS:
            die(f'Field "{n}" is not a valid field to query.\n\n', 2)
    noheader, nounits = parse_format(fmt)
    gpus = select(host, ids)
    out = []
    if not noheader:
        out.append(
            ", ".join(
                f"{APP_FIELDS[n][0]} [{APP_FIELDS[n][1]}]" if APP_FIELDS[n][1] else APP_FIELDS[n][0]
                for n in names
            )
        )
    for g in gpus:
        for h in g.holders:
            if h.kind != "C":
                continue
            vals = {
                "pid": str(h.pid),
                "process_name": h.name,
                "name": h.name,
                "used_memory": str(h.mem_mib) if nounits else f"{h.mem_mib} MiB",
                "used_gpu_memory": str(h.mem_mib) if nounits else f"{h.mem_mib} MiB",
                "gpu_bus_id": g.bus_id,
                "gpu_uuid": str(g.spec["uuid"]),
                "gpu_serial": str(g.spec["serial"]),
                "gpu_name": g.name,
                "timestamp": __import__("time").strftime("%Y/%m/%d %H:%M:%S.000"),
            }
            out.append(", ".join(vals[n] for n in names))
    if out:
        sys.stdout.write("\n".join(out) + "\n")


# ------------------------------------------------------------------ table


def short_name(name: str) -> str:
    return name if len(name) <= 28 else name[:24] + "..."


def table(host: Host, ids: str | None) -> None:
    gpus = select(host, ids)
    o = [now_stamp() + "       ", LINE]
    o.append(
        f"| NVIDIA-SMI {host.driver_version:<23}Driver Version: {host.driver_version:<15}CUDA Version: {host.cuda_version:<9}|"
    )
    o.append(SPLIT)
    o.append("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |")
    o.append("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |")
    o.append("|                                         |                        |               MIG M. |")
    o.append(DOUBLE)
    for g in gpus:
        h = g.health
        pm = "On" if g.persistence else "Off"
        ecc = str(h.get("ecc_uncorrected", 0))
        o.append(f"|{g.index:>4}  {short_name(g.name):<31}{pm:<3} |{g.bus_id:>19} {'Off':>3} |{ecc:>21} |")
        pw, _ = gpu_field(host, g, "power.draw") or ("0", "")
        perf = "P0" if g.at_work else "P8"
        cap = int(float(g.spec.get("power_limit", 600.0)))
        # a value NVML could not read ([GPU requires reset], ...) shows as ERR! in nvidia-smi's
        # summary table; the lab's table used to end in a ValueError there instead
        usage = f"{int(float(pw))}W" if pw.replace(".", "", 1).isdigit() else "ERR!"
        o.append(
            f"|{'N/A':>4}{h.get('temperature', 35):>5}C{perf:>6}{usage:>16} / {cap:>4}W "
            f"|{g.memory_used:>8}MiB / {g.memory_total:>6}MiB |{0:>7}%{'Default':>13} |"
        )
        o.append(f"|{'':41}|{'':24}|{mig_modes(host, g)[0].strip('[]'):>21} |")
        o.append(SPLIT_END)
    o.append(" " * 89)
    o.append(LINE)
    o.append("| Processes:" + " " * 78 + "|")
    o.append("|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |")
    o.append("|        ID   ID                                                               Usage      |")
    o.append("|" + "=" * 89 + "|")
    rows = 0
    for g in gpus:
        for h in g.holders:
            if h.kind != "C":
                continue
            name = h.name if len(h.name) <= 36 else "..." + h.name[-33:]
            o.append(
                f"|{g.index:>5}{'N/A':>6}{'N/A':>5}{h.pid:>16}{h.kind:>7}   {name:<36}{str(h.mem_mib) + 'MiB':>10} |"
            )
            rows += 1
    if not rows:
        o.append("|  No running processes found" + " " * 61 + "|")
    o.append(LINE)
    sys.stdout.write("\n".join(o) + "\n")


def list_gpus(host: Host, ids: str | None) -> None:
    for g in select(host, ids):
        sys.stdout.write(f"GPU {g.index}: {g.name} (UUID: {g.spec['uuid']})\n")


def query_all(host: Host, ids: str | None) -> None:
    gpus = select(host, ids)
    o = ["", "==============NVSMI LOG==============", ""]
    o.append(f"{'Timestamp':<36}: {now_stamp()}")
    o.append(f"{'Driver Version':<36}: {host.driver_version}")
    o.append(f"{'CUDA Version':<36}: {host.cuda_version}")
    o.append("")
    o.append(f"{'Attached GPUs':<36}: {len(host.gpus)}")
    for g in gpus:
        h = g.health
        lk = g.link

        def kv(k: str, v: object, ind: int = 4) -> None:
            o.append(f"{' ' * ind}{k:<{36 - ind}}: {v}")

        o.append(f"GPU {g.bus_id}")
        kv("Product Name", g.name)
        kv("Persistence Mode", "Enabled" if g.persistence else "Disabled")
        kv("Serial Number", g.spec["serial"])
        kv("GPU UUID", g.spec["uuid"])
        kv("Minor Number", g.minor)
        o.append("    PCI")
        kv("Bus", "0x" + g.bdf.split(":")[1].upper(), 8)
        kv("Device", "0x" + g.bdf.split(":")[2].split(".")[0].upper(), 8)
        kv("Domain", "0x" + g.bdf.split(":")[0].upper(), 8)
        kv("Bus Id", g.bus_id, 8)
        o.append("        GPU Link Info")
        o.append("            PCIe Generation")
        kv("Max", speed_gen(lk.get("max_speed", "")), 16)
        kv("Current", speed_gen(lk.get("speed", "")), 16)
        o.append("            Link Width")
        kv("Max", f"{lk.get('max_width', 16)}x", 16)
        kv("Current", f"{lk.get('width', 16)}x", 16)
        o.append("    FB Memory Usage")
        kv("Total", f"{g.memory_total} MiB", 8)
        kv("Used", f"{g.memory_used} MiB", 8)
        kv("Free", f"{g.memory_total - g.memory_used} MiB", 8)
        # BAR1: as the lab's sysfs `resource` region 1 (profile bar1_mib; default the power of two
        # at or above the memory, Resizable BAR on); nvidia-smi(1) "BAR1 Memory Usage"
        bar1 = int(
            (host.profile.get("bar1_mib") or {}).get(g.bdf) or 1 << max(g.memory_total - 1, 1).bit_length()
        )
        o.append("    BAR1 Memory Usage")
        kv("Total", f"{bar1} MiB", 8)
        kv("Used", "1 MiB", 8)
        kv("Free", f"{bar1 - 1} MiB", 8)
        o.append("    ECC Errors")
        o.append("        Volatile")
        kv("DRAM Correctable", h.get("ecc_corrected", 0), 12)
        kv("DRAM Uncorrectable", h.get("ecc_uncorrected", 0), 12)
        o.append("    Remapped Rows")
        kv("Remapping Failure Occurred", "Yes" if h.get("remapped_rows_failure") else "No", 8)
        # Fabric, as nvidia-smi -q prints it (R535+): State Not Started / In Progress / Completed
        # and Status Success or the error, N/A for both on a GPU without NVSwitches (NVIDIA's
        # nvidia-smi documentation, "Fabric"; HGX driver output). Faults fabric_state/fabric_status.
        state, status = fabric(host, g)
        o.append("    Fabric")
        kv("State", state, 8)
        kv("Status", status, 8)
        o.append("    Temperature")
        kv("GPU Current Temp", f"{h.get('temperature', 35)} C", 8)
        mem = _memory_temp(g, host)
        kv("Memory Current Temp", f"{mem} C" if mem != "N/A" else "N/A", 8)
        kv("Memory Max Operating Temp", _memory_temp_max(g, host), 8)
        if _driver_major(host) >= 590:
            kv("GPU Recovery Action", _recovery_action(host, g))
        o.append("    Processes")
        for p in g.holders:
            if p.kind != "C":
                continue
            kv("Process ID", p.pid, 8)
            kv("Type", "C", 12)
            kv("Name", p.name, 12)
            kv("Used GPU Memory", f"{p.mem_mib} MiB", 12)
        o.append("")
    sys.stdout.write("\n".join(o) + "\n")


def set_persistence(host: Host, value: str, ids: str | None) -> None:
    if value not in ("0", "1", "ENABLED", "DISABLED"):
        die("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n", 2)
    on = value in ("1", "ENABLED")
    for g in select(host, ids):
        try:
            with open(path("var/lib/gpulab/ctl/persistence", g.bdf), "w") as f:
                f.write("1" if on else "0")
        except OSError:
            die(
                f"Unable to set persistence mode for GPU {g.bus_id}: Insufficient Permissions\nTerminating early due to previous errors.\n",
                4,
            )
        word = "Enabled" if on else "Disabled"
        sys.stdout.write(f"{word} persistence mode for GPU {g.bus_id}.\n")
    sys.stdout.write("All done.\n")


# ------------------------------------------------------------------ topo

TOPO_LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

P2P_LEGEND = """
Legend:

  X    = Self
  OK   = Status Ok
  CNS  = Chipset not supported
  GNS  = GPU not supported
  TNS  = Topology not supported
  NS   = Not supported
  DR   = Disabled by regkey
  U    = Unknown
"""


def cpu_affinity(node: int) -> str:
    if node < 0:
        return "N/A"
    return f"{node * 32}-{node * 32 + 31},{64 + node * 32}-{64 + node * 32 + 31}"


def topo_cell(host: Host, a: GpuView, b: GpuView) -> str:
    if a is b:
        return " X "
    lk = host.link(a.bdf, b.bdf) or {}
    t = lk.get("type")
    if t == "nvlink":
        n = len(a.health.get("nvlinks") or []) or 18
        return f"NV{n}"
    return {"pcie-switch": "PIX", "host-bridge": "NODE", "numa": "SYS"}.get(str(t), "SYS")


def topo_m(host: Host) -> None:
    gpus = select(host, None)
    o = ["\t" + "\t".join(f"GPU{g.index}" for g in gpus) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for a in gpus:
        node = int(a.func.get("numa_node", -1))
        cells = [topo_cell(host, a, b) for b in gpus]
        o.append(f"GPU{a.index}\t" + "\t".join(cells) + f"\t{cpu_affinity(node)}\t{max(node, 0)}\t\tN/A")
    sys.stdout.write("\n".join(o) + "\n" + TOPO_LEGEND + "\n")


def topo_p2p(host: Host, mode: str) -> None:
    if mode not in ("r", "w", "n", "a", "p"):
        die("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n", 2)
    gpus = select(host, None)
    o = [" \t" + "".join(f"GPU{g.index}\t" for g in gpus)]
    for a in gpus:
        cells = []
        for b in gpus:
            if a is b:
                cells.append("X")
                continue
            lk = host.link(a.bdf, b.bdf) or {}
            if mode == "n":
                cells.append("OK" if lk.get("type") == "nvlink" else "NS")
            elif host.p2p_ok(a, b):
                cells.append("OK")
            else:
                cells.append("NS")
        o.append(f" GPU{a.index}\t" + "".join(c + "\t" for c in cells))
    sys.stdout.write("\n".join(o) + "\n" + P2P_LEGEND + "\n")


def nvlink_status(host: Host, ids: str | None) -> None:
    """``nvlink -s``: each GPU's line, then one line per link (``<inactive>`` for a link down).

    Fault ``nvlinks_down``: a list of link numbers (printed ``<inactive>``), or ``"all"``: the GPU's
    line with no link lines under it, as drivers print for a GPU whose NVLinks are all down
    (some drivers print no link lines at all for such a GPU).
    """
    for g in select(host, ids):
        sys.stdout.write(f"GPU {g.index}: {g.name} (UUID: {g.spec['uuid']})\n")
        if (host.faults.get("gpus") or {}).get(g.bdf, {}).get("nvlinks_down") == "all":
            continue
        for i, bw in enumerate(nvlinks(host, g)):
            sys.stdout.write(f"\t Link {i}: <inactive>\n" if bw is None else f"\t Link {i}: {bw:g} GB/s\n")


# ------------------------------------------------------------------ main


def usage_error() -> None:
    die("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n\n", 2)


def main(argv: list[str]) -> int:
    ids = None
    fmt = None
    qgpu = qapps = qremap = pm = None
    reset = False
    mode = "table"
    sub: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if a in ("topo", "nvlink") and i == 0:
            mode, sub = a, argv[1:]
            break
        if a in ("-L", "--list-gpus"):
            mode = "list"
        elif a in ("-q", "--query"):
            mode = "query"
        elif a in ("-d", "--display") and nxt:  # -q -d MEMORY: the lab prints the whole -q (a superset)
            i += 1
        elif a.startswith("--query-gpu="):
            qgpu = a.split("=", 1)[1]
        elif a == "--query-gpu" and nxt:
            qgpu, i = nxt, i + 1
        elif a.startswith("--query-remapped-rows="):
            qremap = a.split("=", 1)[1]
        elif a.startswith("--query-compute-apps="):
            qapps = a.split("=", 1)[1]
        elif a == "--query-compute-apps" and nxt:
            qapps, i = nxt, i + 1
        elif a.startswith("--format="):
            fmt = a.split("=", 1)[1]
        elif a == "--format" and nxt:
            fmt, i = nxt, i + 1
        elif a.startswith("--id="):
            ids = a.split("=", 1)[1]
        elif a in ("-i", "--id") and nxt:
            ids, i = nxt, i + 1
        elif a.startswith("--persistence-mode="):
            pm = a.split("=", 1)[1]
        elif a in ("-pm", "--persistence-mode") and nxt:
            pm, i = nxt, i + 1
        elif a in ("-r", "--gpu-reset"):
            reset = True
        elif a in ("-h", "--help"):
            sys.stdout.write("NVIDIA System Management Interface -- v" + Host().driver_version + "\n")
            return 0
        else:
            usage_error()
        i += 1
    host = Host()
    if mode == "topo":
        if "-m" in sub or "--matrix" in sub:
            topo_m(host)
        elif "-p2p" in sub and sub.index("-p2p") + 1 < len(sub):
            topo_p2p(host, sub[sub.index("-p2p") + 1])
        else:
            usage_error()
        return 0
    if mode == "nvlink":
        nid = sub[sub.index("-i") + 1] if "-i" in sub and sub.index("-i") + 1 < len(sub) else None
        if "-s" in sub or "--status" in sub:
            nvlink_status(host, nid)
            return 0
        if "-e" in sub or "--errorcounters" in sub:
            from gpulab_tools.nvidia_smi_nvlink import nvlink_errors

            nvlink_errors(host, select(host, nid), ["nvlink", *sub])
            return 0
        usage_error()
    if qgpu is not None:
        query_gpu(host, qgpu, fmt, ids)
    elif qapps is not None:
        query_apps(host, qapps, fmt, ids)
    elif qremap is not None:
        query_remapped_rows(host, qremap, fmt, ids)
    elif pm is not None:
        set_persistence(host, pm, ids)
    elif reset:
        from gpulab_tools.nvidia_smi_reset import gpu_reset

        return gpu_reset(host, select(host, ids))
    elif mode == "list":
        list_gpus(host, ids)
    elif mode == "query":
        query_all(host, ids)
    else:
        table(host, ids)
    return 0
