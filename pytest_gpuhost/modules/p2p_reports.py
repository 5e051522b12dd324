"""What the tools report about P2P, read from their output: BAR1, latency, NCCL's own diagnostics (pure).

- `nvidia-smi -q`: the "FB Memory Usage" and "BAR1 Memory Usage" sections' Total.
- P2P latency per device pair: p2pBandwidthLatencyTest ("P2P=Enabled Latency (P2P Writes) Matrix
  (us)") and nvbandwidth's `device_to_device_latency_sm` (ns), the clearest P2P on/off signal.
- NCCL 2.31+'s active diagnostics (`NCCL_RUN_DIAGNOSTICS=1`): the `NCCL DIAG` report lines and
  the GPU pairs a failing check names.

Every string from a node is escaped for one table cell or line (`show`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pytest_gpuhost.modules import parsers
from pytest_gpuhost.redact import printable

__all__ = [
    "LATENCY_OFF_US",
    "LATENCY_ON_US",
    "NcclDiag",
    "latency_us",
    "latency_verdict",
    "norm_bus",
    "parse_nccl_diag",
    "parse_smi_bar1",
    "show",
]

UNKNOWN = "unknown"
#: P2P latency is the clearest on/off signal: 0.36-0.45 us with P2P on, about 14 us with it off
#: (voipmonitor/rtx6kpro); p2pBandwidthLatencyTest shows 11-20 us disabled (NVIDIA/nccl#1127,
#: NVIDIA/cuda-samples#230) and 1.8-3.4 us enabled over NVLink (cuda-samples#230).
LATENCY_ON_US = 4.0
LATENCY_OFF_US = 8.0


def show(text: str) -> str:
    """A string from the node for one table cell: escape sequences shown, not obeyed, on one line."""
    return printable(str(text)).replace("\n", "\\n").replace("\r", "\\r")


def parse_smi_bar1(text: str) -> dict[str, dict[str, int]]:
    """`nvidia-smi -q` -> {bus id: {"fb_mib", "bar1_mib"}} from its FB and BAR1 "Total" lines.

    Sections cut out by grep, without their "GPU 00000000:17:00.0" line, are keyed "#0", "#1", ...
    """
    out: dict[str, dict[str, int]] = {}
    gpu = ""
    section = ""
    unnamed = 0
    for line in text.splitlines():
        m = re.match(r"^GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$", line.strip())
        if m:
            gpu = norm_bus(m.group(1))
            out.setdefault(gpu, {})
            continue
        s = line.strip()
        if s in ("FB Memory Usage", "BAR1 Memory Usage"):
            section = "fb_mib" if s.startswith("FB") else "bar1_mib"
            if not gpu or section in out.get(gpu, {}) and gpu.startswith("#"):
                # a `grep -A3 BAR1` cut without the GPU lines: number the sections in order
                gpu = f"#{unnamed}"
                unnamed += 1
                out.setdefault(gpu, {})
            continue
        m = re.match(r"^Total\s*:\s*(\d+)\s*MiB$", s)
        if m and section and gpu:
            out[gpu][section] = int(m.group(1))
            section = ""
        elif s and ":" not in s:
            section = ""
    return out


def norm_bus(bus_id: str) -> str:
    """nvidia-smi's 00000000:17:00.0 -> 0000:17:00.0 (other text lower-cased)."""
    m = re.match(r"^([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$", bus_id.strip())
    if not m:
        return bus_id.strip().lower()
    return f"{int(m.group(1), 16) & 0xFFFF:04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


def latency_verdict(us: float | None) -> str:
    """P2P on / off / unclear from one pair's latency (us)."""
    if us is None:
        return UNKNOWN
    if us <= LATENCY_ON_US:
        return "on"
    if us >= LATENCY_OFF_US:
        return "off"
    return UNKNOWN


def latency_us(text: str) -> dict[tuple[int, int], float]:
    """GPU-to-GPU latency (us) per device pair, from p2pBandwidthLatencyTest or nvbandwidth output.

    p2pBandwidthLatencyTest: the GPU block of "P2P=Enabled Latency (P2P Writes) Matrix (us)"
    (cuda-samples p2pBandwidthLatencyTest.cu outputLatencyMatrix), else of "P2P=Disabled
    Latency Matrix". nvbandwidth: `device_to_device_latency_sm`, "Device to Device Latency SM
    GPU(row) <-> GPU(column) (ns)" (testcases_sm.cpp), converted to us. Cell (row, col) -> (row, col).
    """
    if "Running device_to_device_latency_sm" in text:
        found = parsers.parse_nvbandwidth_text(text).get("device_to_device_latency_sm")
        scale = 1e-3
    else:
        mats = parsers.parse_p2p_bandwidth_latency(text)
        found = mats.get("P2P=Enabled Latency (P2P Writes) Matrix") or mats.get("P2P=Disabled Latency Matrix")
        scale = 1.0
    out: dict[tuple[int, int], float] = {}
    if found is None:
        return out
    for i, row in enumerate(found.rows):
        for j, col in enumerate(found.columns):
            v = found.values[i][j]
            if v is not None and row != col and str(row).isdigit() and str(col).isdigit():
                out[(int(row), int(col))] = round(v * scale, 3)
    return out


@dataclass
class NcclDiag:
    """NCCL's own active diagnostics report (NCCL >= 2.31, NCCL_RUN_DIAGNOSTICS=1)."""

    present: bool
    ok: bool
    lines: list[str]
    failing: list[str]  # report lines naming a failure, escaped
    pairs: list[tuple[str, str]]  # GPU pairs named in them (bus ids or "rank N")
    summary: str = ""

    def describe(self) -> str:
        """One line for the evidence."""
        if not self.present:
            return "no NCCL DIAG report (NCCL older than 2.31, or the run ended before communicator init)"
        if self.ok:
            return "NCCL diagnostics: " + (self.summary or "no issue reported")
        pairs = ", ".join(f"{a} <-> {b}" for a, b in self.pairs) or "pairs not named"
        return f"NCCL diagnostics report failing P2P: {pairs}: " + "; ".join(self.failing[:6])


_DIAG = re.compile(r"NCCL DIAG (.*)$")
_BUS = re.compile(r"\b(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]\b")
_NUM = re.compile(r"\b(GPU|gpu|dev|device|cudaDev|rank)\s*#?(\d+)\b")


def _line_pair(line: str) -> tuple[str, str] | None:
    """The two GPUs a report line names: bus ids first, else "GPU n" / "rank n" mentions."""
    bus = list(dict.fromkeys(norm_bus(m.group(0)) for m in _BUS.finditer(line)))
    if len(bus) >= 2:
        return bus[0], bus[1]
    nums = list(
        dict.fromkeys(
            f"{'rank' if m.group(1) == 'rank' else 'GPU'} {m.group(2)}" for m in _NUM.finditer(line)
        )
    )
    if len(nums) >= 2:
        return nums[0], nums[1]
    return None


def parse_nccl_diag(text: str) -> NcclDiag:
    """Read the `NCCL DIAG` lines of a run's output (NCCL user guide, Troubleshooting: Diagnostics).

    Lines carry a "host:pid " prefix, then `NCCL DIAG`, a `[OK]` or `[INFO]` tag and the check
    ("p2p: ..."). A p2p `[INFO]` line is a failed or incomplete check ("only 52/56 GPU-to-GPU
    peer accesses passed verification", "p2p: write mismatch ..."); the pairs it names are read
    from bus ids, "GPU a -> GPU b" or "rank a -> rank b". No public capture of a failing report
    exists yet: the parser follows the documented format and RCCL's test of it (the failure
    markers "p2p: write mismatch", "p2p: read mismatch", ... that ROCm/rccl's unit test of the
    inherited feature looks for).
    """
    lines = [show(m.group(1).strip())[:300] for raw in text.splitlines() if (m := _DIAG.search(raw))]
    failing = [
        s
        for s in lines
        if s.startswith("[INFO]")
        and re.search(r"\bp2p\b", s)
        or re.search(r"\bp2p: (write|read) mismatch", s)
    ]
    pairs: list[tuple[str, str]] = []
    for s in failing:
        pair = _line_pair(s)
        if pair is not None and pair not in pairs:
            pairs.append(pair)
    summary = next((s[len("[OK]") :].strip() for s in lines if s.startswith("[OK]") and "p2p" in s), "")
    return NcclDiag(bool(lines), bool(lines) and not failing, lines, failing, pairs, summary)
