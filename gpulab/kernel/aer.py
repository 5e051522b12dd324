"""PCIe AER counters of the lab's GPUs, as the kernel prints them in sysfs.

The kernel keeps, per device with the AER capability, counts of each correctable, fatal and
non-fatal error since boot and shows them in ``aer_dev_correctable``, ``aer_dev_fatal`` and
``aer_dev_nonfatal`` (Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats;
drivers/pci/pcie/aer.c, ``aer_stats_dev_attr``): one ``NAME count`` line per error bit that has
a name in ``aer_correctable_error_string`` / ``aer_uncorrectable_error_string`` (Linux 6.8), then
``TOTAL_ERR_COR`` / ``TOTAL_ERR_FATAL`` / ``TOTAL_ERR_NONFATAL``. The lab's counts are 0 unless
the runtime fault ``gpus: {BDF: {aer: {correctable: N, fatal: N, nonfatal: N}}}`` in the host's
``/var/lib/gpulab/faults.json`` says more (a test raises them between runs): the correctable ones
are counted as receiver errors (RxErr), the uncorrectable ones as completion timeouts (CmpltTO).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["FILES", "aer_text"]

COR = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF")
UNCOR = (
    "Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP",
    "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked", "TLPBlockedErr",
    "PoisonTLPBlocked",
)  # fmt: skip
#: file -> (fault key, the named errors, total's name, the error the fault's count goes to)
FILES = {
    "aer_dev_correctable": ("correctable", COR, "ERR_COR", "RxErr"),
    "aer_dev_fatal": ("fatal", UNCOR, "ERR_FATAL", "CmpltTO"),
    "aer_dev_nonfatal": ("nonfatal", UNCOR, "ERR_NONFATAL", "CmpltTO"),
}


_CACHE: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}


def _faults(state_dir: Path) -> dict[str, Any]:
    """The host's faults.json, parsed once per change (the daemon serves 12 AER reads a run per host)."""
    p = state_dir / "faults.json"
    try:
        st = p.stat()
    except OSError:
        return {}
    key = (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(str(p))
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        data = {}
    data = data if isinstance(data, dict) else {}
    _CACHE[str(p)] = (key, data)
    return data


def _count(state_dir: Path | None, bdf: str, key: str) -> int:
    if state_dir is None:
        return 0
    try:
        return int(((_faults(state_dir).get("gpus") or {}).get(bdf) or {}).get("aer", {}).get(key, 0))
    except (AttributeError, TypeError, ValueError):
        return 0


def aer_text(state_dir: Path | None, bdf: str, name: str) -> str:
    """Return what ``/sys/bus/pci/devices/BDF/NAME`` reads for one of the three AER files.

    ``surprise_down: N`` in the device's fault counts N fatal Surprise Down errors (SDES, bit 5 of
    the uncorrectable status: ``aer_uncor_status: 0x00000020``; fatal by the default severity).
    """
    key, names, total, where = FILES[name]
    n = _count(state_dir, bdf, key)
    sd = _count(state_dir, bdf, "surprise_down") if name == "aer_dev_fatal" else 0
    counts = {e: (n if e == where else 0) + (sd if e == "SDES" else 0) for e in names}
    lines = [f"{e} {c}" for e, c in counts.items()]
    return "\n".join(lines) + f"\nTOTAL_{total} {n + sd}\n"
