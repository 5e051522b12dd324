"""NCCL collectives as proof of P2P: nccl-tests output, the transport NCCL chose, and the verdict.

Pure: text in, facts out; suites/p2p/collective.py runs the tool on the target. A copy-bandwidth
pass is not proof that collectives work: NCCL can hang (NVIDIA/nccl#257, an IOMMU in translated
mode; NVIDIA/nccl-tests#117; NVIDIA/nccl#1999) or return wrong data while peer copies pass
(vllm-project/vllm#51513). So the check runs ``all_reduce_perf`` twice on the in-scope GPUs, once
as is (the P2P arm) and once with ``NCCL_P2P_DISABLE=1`` (the control arm, through host memory),
both with ``-c 1`` (check every result) and ``NCCL_DEBUG=INFO`` (which transport each channel took).
Where nccl-tests is missing, the torch program of nccl_torch.py prints the same format.

The output format is nccl-tests' own (src/util.cu at
https://github.com/NVIDIA/nccl-tests/blob/a0b82b2260cf5152b9f8c061bbf7eaf0ba096432/src/util.cu):
``writeDeviceReport`` prints ``#  Rank %2d Group %2d Pid %6d on %10s device %2d [%04x:%02x:%02x] %s``
(older releases: ``#   Rank %2d Pid %6d on %10s device %2d [0x%02x] %s``, bus number only);
``writeBenchmarkLinePreamble`` ``%12li  %12li  %8s  %6s  %6s`` (size, count, type, redop, root);
``writeBenchmarkLineBody`` ``  %7s  %6s  %6s  %6g`` (time, algbw, busbw, #wrong) once out of place
and once in place, ``N/A`` for #wrong without ``-c``; ``writeResultFooter``
``# Out of bounds values : %d OK|FAILED`` (the count of lines with a wrong element) and
``# Avg bus bandwidth    : %g``. Releases before 2.10 name the column ``error`` and print no
``root`` for all_reduce (NVIDIA/nccl-tests#117, NVIDIA/nccl#583).

Transport lines are NCCL's INFO lines (``host:pid:tid [dev] NCCL INFO ...``, src/debug.cc), from
https://github.com/NVIDIA/nccl/blob/5067397c2676d5aed50042fc39e5c8ee96eb0027/src/transport/:
p2p.cc ``Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/direct pointer%s`` (both GPUs in one
process), ``via P2P/CUMEM%s%s`` (or ``P2P/MNNVL``), ``via P2P/IPC%s%s`` (``/read``, ``/CE``) and
``via P2P/indirect/%d[%d]%s``; shm.cc ``Channel %02d : %d[%d] -> %d[%d] via SHM/%s/%s`` (no
``/conn``; ``SHM/direct/direct``, 2.13 to 2.30) and ``via SHM/direct`` (from 2.30.7); net.cc
``Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s%s``; NCCL 2.4-2.6 wrote
``via direct shared memory`` (NVIDIA/nccl#644). ``NCCL_P2P_DISABLE=1`` and ``NCCL_P2P_LEVEL``
are read by ``ncclGetLevel`` (src/graph/paths.cc): DISABLE equal to 1, or a LEVEL naming a path
type (topo.cc ``topoPathTypeStr``: LOC NVL NVB C2C PIX PXB P2C PXN PHB SYS) or an old number
(0 LOC, 1 PIX, 2 PXB, 3 PHB, 4-5 SYS), caps the path P2P may take; PCIe GPUs are never closer
than PIX, so a level below PIX leaves them without P2P.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ARMS",
    "CONTROL_ENV",
    "P2P_OVER_CONTROL",
    "Arm",
    "Channel",
    "Device",
    "PerfResult",
    "PerfRow",
    "Verdict",
    "env_findings",
    "parse_channels",
    "parse_perf",
    "parse_unit_environment",
    "verdict",
]

# A healthy PCIe P2P ring moves each hop once over the switch or root port; NCCL's SHM transport
# (the control arm) stages every hop through host memory, crossing PCIe twice and the memory bus
# once, and measures about half: 9.9 vs 22 GB/s copies on the IOMMU-slowed host of NVIDIA/nccl#814
# show the other side, P2P slower than staged. 1.2x leaves room for run-to-run noise and for hosts
# whose memory path is strong, while a "P2P" that goes no faster than host memory (translation by
# the IOMMU, ACS redirect to the root complex, NVIDIA/nccl#1817) fails.
P2P_OVER_CONTROL = 1.2
CONTROL_ENV = {"NCCL_P2P_DISABLE": "1"}
ARMS = ("P2P", "control (NCCL_P2P_DISABLE=1)")

# path types in ncclGetLevel's order; a level below PIX gives PCIe GPUs no P2P
_LEVELS = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS", "NET", "DIS")
_OLD_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS", "SYS")

_DEVICE = re.compile(
    r"^#\s+Rank\s+(\d+)(?:\s+Group\s+\d+)?\s+Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(\d+)\s+"
    r"\[(?:0x)?([0-9a-fA-F]{1,4}(?::[0-9a-fA-F]{2}){0,2})\]\s*(.*)$"
)
_CHANNEL = re.compile(
    r"NCCL INFO Channel (\d+)(?:/(\d+))? : (\d+)\[(\w+)\] -> (\d+)\[(\w+)\]"
    r"(?: \[(send|receive)\])? via (\S.*?)\s*$"
)


@dataclass
class PerfRow:
    """One size of an all_reduce_perf run: out-of-place and in-place figures (#wrong None: not checked)."""

    size: int
    count: int
    dtype: str
    redop: str
    time_us: float | None
    algbw: float | None
    busbw: float | None
    wrong: int | None
    ip_time_us: float | None
    ip_algbw: float | None
    ip_busbw: float | None
    ip_wrong: int | None

    @property
    def wrong_total(self) -> int | None:
        """Wrong elements out of place plus in place (None when the run did not check data)."""
        vals = [v for v in (self.wrong, self.ip_wrong) if v is not None]
        return sum(vals) if vals else None


@dataclass
class Device:
    """A rank as nccl-tests names it: CUDA device and PCI address (``0000:17:00``, or ``17`` before 2.10)."""

    rank: int
    pid: int
    host: str
    cuda_dev: int
    bus: str
    name: str


@dataclass
class PerfResult:
    """What an all_reduce_perf run printed."""

    rows: list[PerfRow] = field(default_factory=list)
    devices: list[Device] = field(default_factory=list)
    out_of_bounds: int | None = None
    avg_busbw: float | None = None
    concluded: bool = False
    validation: int | None = None
    nccl_version: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def wrong(self) -> int | None:
        """Wrong elements over every line (None when no line was checked)."""
        vals = [r.wrong_total for r in self.rows if r.wrong_total is not None]
        return sum(vals) if vals else None

    def first_wrong(self) -> PerfRow | None:
        """The first size whose #wrong is not 0."""
        return next((r for r in self.rows if r.wrong_total), None)


@dataclass
class Channel:
    """One ``Channel NN/C : a[da] -> b[db] via X`` line; ``kind`` is P2P, SHM, NET, COLLNET or the first word."""

    channel: int
    src: int
    dst: int
    transport: str
    direction: str = ""

    @property
    def kind(self) -> str:
        t = self.transport
        if t == "direct shared memory":
            return "SHM"
        return t.split("/", 1)[0]


def _num(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def _wrong(cell: str) -> int | None:
    if cell == "N/A":
        return None
    v = _num(cell)
    return int(v) if v is not None else None


def parse_perf(text: str) -> PerfResult:
    """Read an nccl-tests ``*_perf`` run's stdout (NCCL INFO lines may be interleaved)."""
    res = PerfResult()
    for line in text.splitlines():
        s = line.rstrip()
        if "NCCL INFO" in s or "NCCL WARN" in s:
            if "NCCL WARN" in s:
                res.errors.append(s.split("NCCL WARN", 1)[1].strip())
            continue
        if s.startswith("NCCL version "):
            res.nccl_version = s.split()[2]
            continue
        if s.startswith("#"):
            m = _DEVICE.match(s)
            if m:
                res.devices.append(Device(int(m[1]), int(m[2]), m[3], int(m[4]), m[5].lower(), m[6].strip()))
            elif "validation:" in s:
                v = re.search(r"validation: (\d+)", s)
                res.validation = int(v[1]) if v else None
            elif s.startswith("# Out of bounds values"):
                v = re.search(r":\s*(-?\d+)", s)
                res.out_of_bounds = int(v[1]) if v else None
            elif s.startswith("# Avg bus bandwidth"):
                v = re.search(r":\s*(\S+)", s)
                res.avg_busbw = _num(v[1]) if v else None
            elif s.startswith("# Collective test concluded"):
                res.concluded = True
            elif s.startswith("# error:"):
                res.errors.append(s[len("# error:") :].strip())
            continue
        for what in ("Test CUDA failure", "Test NCCL failure"):  # CUDACHECK, NCCLCHECK (src/common.h)
            if what in s:
                res.errors.append(s[s.index(what) :].strip())
        words = s.split()
        # size count type redop [root] then time algbw busbw #wrong, out of place and in place;
        # before 2.10 all_reduce printed no root (NVIDIA/nccl#583)
        if len(words) not in (8, 9, 12, 13) or not (words[0].isdigit() and words[1].isdigit()):
            continue
        cells = words[5:] if len(words) in (9, 13) else words[4:]
        oop = cells[:4]
        ip = cells[4:] if len(cells) == 8 else ["", "", "", "N/A"]
        res.rows.append(
            PerfRow(
                int(words[0]),
                int(words[1]),
                words[2],
                words[3],
                _num(oop[0]),
                _num(oop[1]),
                _num(oop[2]),
                _wrong(oop[3]),
                _num(ip[0]),
                _num(ip[1]),
                _num(ip[2]),
                _wrong(ip[3]),
            )
        )
    return res


def parse_channels(text: str) -> list[Channel]:
    """Every ``NCCL INFO Channel ... via X`` line of a log, in order (ring listings are skipped)."""
    out = []
    for line in text.splitlines():
        m = _CHANNEL.search(line)
        if m:
            out.append(Channel(int(m[1]), int(m[3]), int(m[5]), m[8], m[7] or ""))
    return out


# ------------------------------------------------------------------ the service's own settings


def parse_unit_environment(text: str) -> dict[str, str]:
    """Read ``systemctl show -p Environment UNIT`` (``Environment=A=1 "B=x y"``) into a dict."""
    env: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("Environment="):
            continue
        try:
            words = shlex.split(line[len("Environment=") :])
        except ValueError:
            words = line[len("Environment=") :].split()
        for w in words:
            k, sep, v = w.partition("=")
            if sep:
                env[k] = v
    return env


def _level(value: str) -> str | None:
    """The path type a ``NCCL_P2P_LEVEL`` value names, as ncclGetLevel reads it (None: not understood)."""
    v = value.strip()
    if v in _LEVELS:
        return v
    m = re.match(r"^(0[xX][0-9a-fA-F]+|\d+)", v)
    if m:
        n = int(m[1], 0)
        return _OLD_LEVELS[min(n, len(_OLD_LEVELS) - 1)]
    return None


def env_findings(env: dict[str, str]) -> list[str]:
    """What in a service's environment keeps NCCL off P2P (or off SHM), one sentence each."""
    out = []
    disable = env.get("NCCL_P2P_DISABLE")
    if disable is not None:
        m = re.match(r"^\s*(0[xX][0-9a-fA-F]+|-?\d+)", disable)
        if m and int(m[1], 0) == 1:  # strtol(str) == 1, exactly as ncclGetLevel tests it
            out.append(f"NCCL_P2P_DISABLE={disable}")
    level = env.get("NCCL_P2P_LEVEL")
    if level is not None and not out:  # DISABLE=1 wins over LEVEL in ncclGetLevel
        named = _level(level)
        if named is not None and _LEVELS.index(named) < _LEVELS.index("PIX"):
            out.append(
                f"NCCL_P2P_LEVEL={level} ({named}: P2P only {'within one GPU' if named == 'LOC' else 'over NVLink'})"
            )
    shm = env.get("NCCL_SHM_DISABLE")
    if shm is not None and shm.strip() not in ("", "0"):
        out.append(f"NCCL_SHM_DISABLE={shm} (no SHM either: NCCL falls back to the network)")
    return out


# ------------------------------------------------------------------ the verdict


@dataclass
class Arm:
    """One run of the collective on the target: what ran, how it ended, what it printed."""

    name: str
    gpus: list[str]
    argv: list[str]
    env: dict[str, str]
    bound: float
    seconds: float = 0.0
    rc: int | None = None
    hung: bool = False
    leftover: list[int] = field(default_factory=list)  # pids of ours still there after the run
    result: PerfResult = field(default_factory=PerfResult)
    channels: list[Channel] = field(default_factory=list)
    where: str = ""
    tail: str = ""
    tool: str = ""  # what ran: all_reduce_perf, or torch.distributed and its interpreter (nccl_run.Tool)
    marker: str = ""  # GPUHOST_NCCL_RUN=TOKEN in the environment of this arm's processes
    diag: list[str] = field(default_factory=list)  # NCCL's own "NCCL DIAG" report lines (NCCL >= 2.31)

    @property
    def transports(self) -> dict[str, int]:
        """Transport -> number of channel lines naming it."""
        out: dict[str, int] = {}
        for c in self.channels:
            out[c.transport] = out.get(c.transport, 0) + 1
        return out

    def transport_text(self) -> str:
        """ "P2P/direct pointer (4)" or "SHM/direct/direct (2), P2P/IPC (2)"; "none logged" when unknown."""
        t = self.transports
        return ", ".join(f"{k} ({n})" for k, n in t.items()) or "none logged"

    def failure(self) -> str:
        """Why the run gave no figures ("" when it completed)."""
        gpus = ", ".join(self.gpus)
        left = (
            f"; pids {', '.join(map(str, self.leftover))} of this run outlived it (killed with SIGKILL)"
            if self.leftover
            else ""
        )
        if self.hung:
            return f"hung after {self.bound:g} s on {gpus} (ended by timeout -k 5 {self.bound:g}){left}"
        if self.leftover:
            return f"left processes behind on {gpus}{left}"
        wrong = bool(self.result.wrong or self.result.out_of_bounds)
        if not self.result.concluded or (self.rc != 0 and not wrong):  # wrong data exits 1 (common.cu)
            last = next((ln for ln in reversed(self.tail.splitlines()) if ln.strip()), "")
            err = "; ".join(self.result.errors[-2:]) or last[:200]
            return f"failed (rc {self.rc}) on {gpus}" + (f": {err}" if err else "")
        if self.result.wrong is None and self.result.out_of_bounds is None:
            return "printed no data check (#wrong N/A: run without -c 1?)"
        return ""

    def to_dict(self) -> dict[str, Any]:
        """The arm as evidence: transport, busbw, wrong, time."""
        r = self.result
        return {
            "arm": self.name,
            "tool": self.tool,
            "where": self.where,
            "gpus": self.gpus,
            "env": self.env,
            "command": " ".join(shlex.quote(a) for a in self.argv),
            "bound_s": self.bound,
            "seconds": round(self.seconds, 2),
            "rc": self.rc,
            "hung": self.hung,
            "transport": self.transport_text(),
            "avg_busbw": r.avg_busbw,
            "wrong": r.wrong,
            "out_of_bounds": r.out_of_bounds,
            "devices": [f"rank {d.rank}: device {d.cuda_dev} [{d.bus}] {d.name}" for d in r.devices],
            "rows": [
                {
                    "size": x.size,
                    "busbw": x.busbw,
                    "ip_busbw": x.ip_busbw,
                    "wrong": x.wrong_total,
                    "time_us": x.time_us,
                }
                for x in r.rows
            ],
            "failure": self.failure(),
        }


@dataclass
class Verdict:
    """Whether the collective proves P2P: ``ok``, a one-line summary, and each problem found."""

    ok: bool
    summary: str
    problems: list[str] = field(default_factory=list)


def _bus_matches(dev: Device, bdf: str) -> bool:
    """A rank's printed bus id (``0000:17:00`` or, before 2.10, ``17``) against a PCI address."""
    dom, bus, rest = bdf.split(":")
    if ":" in dev.bus:
        return dev.bus == f"{dom}:{bus}:{rest.split('.')[0]}"
    return int(dev.bus, 16) == int(bus, 16)


def _wrong_text(arm: Arm) -> str:
    row = arm.result.first_wrong()
    where = f" (first at {row.size} B: {row.wrong_total})" if row else ""
    n = arm.result.wrong or arm.result.out_of_bounds
    return f"{arm.name}: wrong data: {n} wrong elements{where} on {', '.join(arm.gpus)}"


def verdict(p2p: Arm, control: Arm, margin: float = P2P_OVER_CONTROL) -> Verdict:
    """P2P proven: the P2P arm completed in bound, 0 wrong, every channel via P2P, busbw >= margin x control."""
    problems: list[str] = []
    why = p2p.failure()
    if why:
        problems.append(f"{p2p.name}: {why}")
    else:
        if p2p.result.wrong or p2p.result.out_of_bounds:
            problems.append(_wrong_text(p2p))
        if not p2p.channels:
            problems.append(f"{p2p.name}: NCCL logged no channel (NCCL_DEBUG=INFO): transport unknown")
        else:
            other = [c for c in p2p.channels if c.kind != "P2P"]
            if other:
                problems.append(
                    f"{p2p.name}: {len(other)} of {len(p2p.channels)} channels not via P2P "
                    f"({p2p.transport_text()}): NCCL found no peer path"
                )
        strangers = [
            d for d in p2p.result.devices if p2p.gpus and not any(_bus_matches(d, b) for b in p2p.gpus)
        ]
        if strangers:
            problems.append(
                f"{p2p.name}: ran on {', '.join(d.bus for d in strangers)}, not the in-scope {', '.join(p2p.gpus)}"
            )
    cwhy = control.failure()
    if cwhy:
        problems.append(f"{control.name}: {cwhy}: no baseline to compare with")
    elif control.result.wrong or control.result.out_of_bounds:
        problems.append(_wrong_text(control) + " (without P2P: not the IOMMU)")
    pb, cb = p2p.result.avg_busbw, control.result.avg_busbw
    if not why and not cwhy and pb is not None and cb is not None and pb < margin * cb:
        problems.append(
            f"{p2p.name} bus bandwidth {pb:g} GB/s is below {margin:g}x the control's {cb:g} GB/s "
            f"(needs >= {margin * cb:.3g}): P2P is no faster than host memory"
        )
    if problems:
        return Verdict(False, "; ".join(problems), problems)
    ratio = f" ({pb / cb:.2f}x)" if pb and cb else ""
    return Verdict(
        True,
        f"all_reduce on {len(p2p.gpus)} GPUs via {p2p.transport_text()}: {pb:g} GB/s vs {cb:g} GB/s "
        f"with NCCL_P2P_DISABLE=1{ratio}, 0 wrong, {p2p.seconds:.1f} s",
    )
