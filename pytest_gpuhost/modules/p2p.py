"""GPU peer-to-peer: capability and bandwidth matrices, what each pair should reach, thresholds.

Over 400 lines because measuring, its direction convention and judging a pair are one contract
(the thresholds read the matrices exactly as this module stores them).

Measurement prefers the agent's cupy probe (peer copies timed with CUDA events, devices
addressed by PCI bus id); without cupy it runs `nvbandwidth -t device_to_device_memcpy_read_ce`
(JSON, else text), then `p2pBandwidthLatencyTest`. Capability comes from pynvml (through the
probe) or `nvidia-smi topo -p2p r`. Every matrix is keyed by PCI address, never by an ordinal,
because CUDA, nvidia-smi and /dev/nvidiaN may number the same GPU differently.

One direction convention for every tool: ``values[(a, b)]`` is data moved from GPU ``a`` to GPU
``b``. The cupy probe's key "a>b" is that already. nvbandwidth's
``device_to_device_memcpy_read_ce`` cell (row, col) is data col -> row, copied in the row GPU's
context (testcases_ce.cpp DeviceToDeviceReadCE::run: ``value(src, peer) = doMemcpy(peerBuffer,
srcBuffer)`` with PREFER_DST_CONTEXT, whatever its "GPU(row) -> GPU(column)" title says), so it
is stored at ``(col, row)``. p2pBandwidthLatencyTest's "P2P Writes" cell (i, j) is a copy from
device i to device j on device i's stream (cuda-samples p2pBandwidthLatencyTest.cu
testBandwidthMatrix, P2P_WRITE: ``performP2PCopy(buffers[j], j, buffers[i], i, ...)``, whose
arguments are dest, destDevice, src, srcDevice), stored at ``(i, j)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from pytest_gpuhost.errors import Unreachable
from pytest_gpuhost.modules import parsers

__all__ = [
    "DEFAULT_FRACTION",
    "NVBANDWIDTH_TEST",
    "DIRECTION",
    "P2PMatrix",
    "directed_values",
    "expected_gbps",
    "link_max_gbps",
    "measure",
    "measure_anywhere",
    "pcie_gbps",
    "capability",
    "topology",
]

NVBANDWIDTH_TEST = "device_to_device_memcpy_read_ce"
DIRECTION = "values[row a][column b] = data from GPU a to GPU b (one direction)"
DEFAULT_FRACTION = 0.5
# GT/s per lane -> payload efficiency of the line code (8b/10b up to Gen2, 128b/130b from Gen3)
_PCIE_GEN = {2.5: 0.8, 5.0: 0.8, 8.0: 128 / 130, 16.0: 128 / 130, 32.0: 128 / 130, 64.0: 242 / 256}
_NVLINK_PER_LINK = 25.0  # GB/s one direction per link, NVLink 3 and 4 (A100, H100)
_NVLINK5_PER_LINK = 50.0  # NVLink 5 (B200, GB200)


class _Conn(Protocol):
    name: str

    def run(self, command: Any, *, timeout: float | None = None, **kw: Any) -> Any: ...

    def call(self, op: str, **params: Any) -> Any: ...


def _speed(text: str | None) -> float | None:
    m = re.match(r"^\s*([0-9.]+)\s*GT/s", text or "")
    return float(m.group(1)) if m else None


def pcie_gbps(speed: str | None, width: int | None) -> float | None:
    """Return the theoretical one-direction GB/s of a PCIe link ("32.0 GT/s PCIe", 16 -> 63.0)."""
    return _gbps(_speed(speed), width)


def _gbps(gts: float | None, width: int | None) -> float | None:
    if gts is None or not width:
        return None
    eff = _PCIE_GEN.get(gts, 128 / 130)
    return round(gts * width * eff / 8, 1)


def link_max_gbps(link: dict[str, Any]) -> float | None:
    """Return what a GPU's PCIe link carries under load: its maximum speed and width, not the current.

    An idle GPU drops its link to 2.5 GT/s (Gen1) and retrains on load (open-gpu-kernel-modules
    #731; Syllo/nvtop#6; open-mpi/hwloc#653), so the current speed says
    nothing about what a copy will reach. A device's maximum can exceed its slot's (hwloc#653: a
    Gen4 card in a Gen3 port), so the link counts at the lower of the GPU's and its upstream
    port's maximum (`port_max_*`, the parent device in sysfs) when both are known. Falls back to
    the current speed and width when no maximum is known.
    """
    speeds = [_speed(link.get(k)) for k in ("max_speed", "port_max_speed")]
    widths = [link.get(k) for k in ("max_width", "port_max_width")]
    gts = min((s for s in speeds if s), default=None) or _speed(link.get("speed"))
    width = min((w for w in widths if isinstance(w, int) and w > 0), default=None) or link.get("width")
    return _gbps(gts, width if isinstance(width, int) else None)


def expected_gbps(
    link_a: dict[str, Any], link_b: dict[str, Any], topo: str | None = None, model: str = ""
) -> float | None:
    """Return what a GPU pair should reach one way: NVLink from `topo` (NV#), else the slower PCIe link.

    PCIe: each GPU's link at its maximum (`link_max_gbps`), never the current speed an idle GPU
    has dropped to; a link trained narrower than its maximum is a finding for the health suite.
    """
    if topo and (m := re.match(r"^NV(\d+)$", topo)):
        per_link = (
            _NVLINK5_PER_LINK
            if re.search(r"B[12]00|GB[23]00|Blackwell", model) and "RTX" not in model
            else _NVLINK_PER_LINK
        )
        return int(m.group(1)) * per_link
    values = [v for v in (link_max_gbps(link_a), link_max_gbps(link_b)) if v is not None]
    return min(values) if values else None


@dataclass
class P2PMatrix:
    """Bandwidth (GB/s, one direction) between GPUs keyed by PCI address; None = not measured."""

    bdfs: list[str]
    values: dict[tuple[str, str], float | None]
    source: str
    capability: dict[tuple[str, str], str] = field(default_factory=dict)
    note: str = ""
    errors: dict[tuple[str, str], str] = field(default_factory=dict)  # a pair whose measurement failed
    where: str = ""  # the connection it was measured on (host, or the service's container)
    no_tool: bool = False  # no measuring tool was installed where it looked

    def rows(self) -> list[list[float | None]]:
        """Return the matrix as rows (self cells None), in `bdfs` order."""
        return [[None if a == b else self.values.get((a, b)) for b in self.bdfs] for a in self.bdfs]

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able form for evidence."""
        return {
            "bdfs": self.bdfs,
            "source": self.source,
            "values": self.rows(),
            "capability": {f"{a}>{b}": v for (a, b), v in self.capability.items()},
            "errors": {f"{a}>{b}": v for (a, b), v in self.errors.items()},
            "direction": DIRECTION,
            "where": self.where,
            "note": self.note,
        }


def _smi_index_map(conn: _Conn) -> dict[int, str]:
    r = conn.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"], timeout=30)
    out: dict[int, str] = {}
    if r.rc != 0:
        return out
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 2 and cells[0].isdigit():
            out[int(cells[0])] = norm_bdf(cells[1])
    return out


def norm_bdf(bus_id: str) -> str:
    """Turn nvidia-smi's 00000000:17:00.0 (or nvbandwidth's 00000000:17:00) into 0000:17:00.0."""
    bus_id = bus_id.strip().lower()
    m = re.match(r"^([0-9a-f]+):([0-9a-f]{2}):([0-9a-f]{2})(?:\.([0-7]))?$", bus_id)
    if not m:
        return bus_id
    return f"{int(m.group(1), 16) & 0xFFFF:04x}:{m.group(2)}:{m.group(3)}.{m.group(4) or '0'}"


def capability(
    conn: _Conn, bdfs: list[str], probe: dict[str, Any] | None = None, index: dict[int, str] | None = None
) -> tuple[dict[tuple[str, str], str], str]:
    """Return P2P read capability per pair ("OK", "CNS", ...) and where it came from."""
    if (
        probe
        and probe.get("available")
        and isinstance(probe.get("capability"), dict)
        and "error" not in probe["capability"]
    ):
        caps = {}
        for key, status in probe["capability"].items():
            a, b = key.split(">")
            caps[(a, b)] = "OK" if status == 0 else f"NVML {status}"
        return caps, "pynvml"
    r = conn.run(["nvidia-smi", "topo", "-p2p", "r"], timeout=30)
    if r.rc != 0:
        return {}, f"nvidia-smi topo -p2p r failed: rc {r.rc}"
    topo = parsers.parse_topo_p2p(r.stdout)
    index = index or _smi_index_map(conn)
    caps = {}
    for (ra, rb), status in topo.links.items():
        a, b = index.get(int(ra[3:])), index.get(int(rb[3:]))
        if a in bdfs and b in bdfs and a != b:
            caps[(a, b)] = status
    return caps, "nvidia-smi topo -p2p r"


def topology(conn: _Conn, bdfs: list[str], index: dict[int, str] | None = None) -> dict[tuple[str, str], str]:
    """Return `nvidia-smi topo -m` links (NV18, PIX, PHB, SYS, ...) between the GPUs, keyed by PCI address.

    Empty when nvidia-smi cannot tell; the expected bandwidth then falls back to the PCIe links.
    """
    r = conn.run(["nvidia-smi", "topo", "-m"], timeout=30)
    if r.rc != 0:
        return {}
    try:
        topo = parsers.parse_topo_matrix(r.stdout)
    except parsers.ParseError:
        return {}
    index = index or _smi_index_map(conn)
    out = {}
    for (ra, rb), link in topo.links.items():
        if not (ra.startswith("GPU") and rb.startswith("GPU")):
            continue
        a, b = index.get(int(ra[3:])), index.get(int(rb[3:]))
        if a in bdfs and b in bdfs and a != b:
            out[(a, b)] = link
    return out


def _nvbandwidth_devices(text: str) -> dict[int, str]:
    found = {}
    for m in re.finditer(
        r"^Device (\d+): .*\(([0-9a-fA-F]+:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.\d)?)\)\s*$", text, re.M
    ):
        found[int(m.group(1))] = norm_bdf(m.group(2))
    return found


def measure(
    conn: _Conn,
    bdfs: list[str],
    *,
    timeout: float = 300.0,
    use_probe: bool = True,
    index: dict[int, str] | None = None,
) -> P2PMatrix:
    """Measure one-way P2P bandwidth between every ordered pair of `bdfs` (GPUs on nvidia).

    `index` maps nvidia-smi's GPU index to PCI address when the caller already knows it.
    """
    bdfs = sorted(bdfs)
    probe: dict[str, Any] | None = None
    if use_probe:
        try:
            probe = conn.call("p2p_probe", bdfs=bdfs, timeout=timeout)
        except Unreachable:
            raise
        except Exception as exc:  # no agent (a fallback connection), an old agent without the op
            probe = {"available": False, "reason": str(exc)}
    if probe and probe.get("available"):
        values: dict[tuple[str, str], float | None] = {}
        for key, v in (probe.get("bandwidth") or {}).items():
            a, b = key.split(">")
            values[(a, b)] = v
        errors = {}
        for key, why in (probe.get("errors") or {}).items():
            a, b = key.split(">")
            errors[(a, b)] = str(why)
        caps, _ = capability(conn, bdfs, probe, index)
        size = int(probe.get("size") or 0) >> 20
        runs = max((len(v) for v in (probe.get("samples") or {}).values()), default=0)
        return P2PMatrix(
            bdfs, values, f"cupy memcpyPeerAsync ({size} MiB, median of {runs})", caps, errors=errors
        )
    index = index or _smi_index_map(conn)
    caps, cap_source = capability(conn, bdfs, None, index)
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    note = f"capability from {cap_source}"
    r = conn.run(["nvbandwidth", "-t", NVBANDWIDTH_TEST, "-j"], timeout=timeout, env=env)
    matrices: dict[str, parsers.BandwidthMatrix] = {}
    text = r.stdout
    if r.rc == 0 and text.lstrip().startswith("{"):
        matrices = parsers.parse_nvbandwidth_json(text)
        source = "nvbandwidth -j"
    if not matrices:
        r = conn.run(["nvbandwidth", "-t", NVBANDWIDTH_TEST], timeout=timeout, env=env)
        text = r.stdout
        source = "nvbandwidth"
        if r.rc == 0:
            matrices = parsers.parse_nvbandwidth_text(text)
    matrix = matrices.get(NVBANDWIDTH_TEST)
    if matrix is None:
        r2 = conn.run(["p2pBandwidthLatencyTest"], timeout=timeout, env=env)
        if r2.rc == 0:
            found = parsers.parse_p2p_bandwidth_latency(r2.stdout)
            matrix = found.get("Unidirectional P2P=Enabled Bandwidth (P2P Writes) Matrix")
            source, text = "p2pBandwidthLatencyTest", r2.stdout
        if matrix is None:
            why = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"rc {r.rc}"]
            cupy = str((probe or {}).get("reason") or "not tried")[:120]
            if _missing(r) and _missing(r2):  # no tool here at all: maybe elsewhere (measure_anywhere)
                return P2PMatrix(
                    bdfs, {}, "none", caps, f"{cupy}; nvbandwidth and p2pBandwidthLatencyTest not installed",
                    no_tool=True,
                )  # fmt: skip
            return P2PMatrix(bdfs, {}, "none", caps, f"no bandwidth tool worked: nvbandwidth: {why[0][:200]}")
    index = _nvbandwidth_devices(text)
    if not index:
        # with CUDA_DEVICE_ORDER=PCI_BUS_ID, CUDA ordinals follow PCI order like nvidia-smi's
        index = {i: b for i, b in enumerate(sorted(index.values()))} if index else dict(enumerate(bdfs))
    return P2PMatrix(bdfs, directed_values(matrix, index, bdfs, source), source, caps, note)


def _missing(r: Any) -> bool:
    """True when a command could not run because it is not installed (exec: ENOENT/EACCES)."""
    err = (getattr(r, "stderr", "") or "").lower()
    return r.rc in (126, 127) and ("no such file" in err or "not found" in err or not err)


def measure_anywhere(
    conns: list[_Conn], bdfs: list[str], *, index: dict[int, str] | None = None, timeout: float = 300.0
) -> P2PMatrix:
    """Measure on the first of ``conns`` (the host, then the service's container) that has a tool.

    A stock Proxmox host has neither cupy nor nvbandwidth; the CUDA stack lives in the container,
    which sees the same GPUs. The matrix says where it was measured (``where``). With no tool
    anywhere: a matrix with ``no_tool`` and a note naming what was looked for where and what to
    install, never advice about the platform (nothing was measured). ``index`` is the host's
    nvidia-smi index map; a container's own nvidia-smi numbers its GPUs for itself.
    """
    looked: list[str] = []
    for i, conn in enumerate(conns):
        try:
            m = measure(conn, bdfs, index=index if i == 0 else None, timeout=timeout)
        except Unreachable as exc:
            looked.append(f"{conn.name}: unreachable ({str(exc)[:120]})")
            continue
        m.where = conn.name
        if not m.no_tool:
            if looked:
                m.note = "; ".join([f"no tool on {x}" for x in looked] + ([m.note] if m.note else []))
            return m
        looked.append(f"{conn.name}: {m.note}")
    caps: dict[tuple[str, str], str] = {}
    try:
        caps, _ = capability(conns[0], sorted(bdfs), None, index)
    except Unreachable:
        pass
    note = (
        "no P2P bandwidth tool on " + "; nor on ".join(looked) + ": install nvbandwidth (NVIDIA/nvbandwidth) "
        "or cupy with pynvml on the host or in the container, then run again; nothing was measured"
    )
    return P2PMatrix(sorted(bdfs), {}, "none", caps, note, no_tool=True)


def directed_values(
    matrix: parsers.BandwidthMatrix, index: dict[int, str], bdfs: list[str], source: str
) -> dict[tuple[str, str], float | None]:
    """Return a tool's matrix as ``{(from, to): GB/s}`` (the module's one direction convention).

    nvbandwidth's read test: cell (row, col) is data col -> row (module docstring), so it lands at
    (col, row); p2pBandwidthLatencyTest's writes: cell (i, j) is i -> j.
    """
    reverse = source.startswith("nvbandwidth")
    values: dict[tuple[str, str], float | None] = {}
    for row in matrix.rows:
        for col in matrix.columns:
            a, b = index.get(int(row)), index.get(int(col))
            if a in bdfs and b in bdfs and a != b:
                values[(b, a) if reverse else (a, b)] = matrix.get(row, col)
    return values


@dataclass
class PairVerdict:
    """One ordered GPU pair against its threshold."""

    a: str
    b: str
    gbps: float | None
    expected: float | None
    threshold: float | None
    capability: str | None
    error: str | None = None

    @property
    def capable(self) -> bool:
        """True when NVML / `nvidia-smi topo -p2p r` reports P2P reads OK for the pair.

        Bandwidth alone proves nothing: with P2P off, host-staged copies reach ~37 GB/s on Gen5
        (NVIDIA/nccl#1264), above a PCIe threshold. Unknown capability is not proof either.
        """
        return self.capability == "OK"

    @property
    def ok(self) -> bool:
        """True when the pair is P2P capable and was measured at or above its threshold."""
        return (
            self.capable
            and not self.error
            and self.gbps is not None
            and self.threshold is not None
            and self.gbps >= self.threshold
        )

    def describe(self) -> str:
        """Return "0000:17:00.0 -> 0000:18:00.0: 12.1 GB/s < 37.8 (expected 63.0, OK)"."""
        got = "not measured" if self.gbps is None else f"{self.gbps:g} GB/s"
        above = self.gbps is not None and self.threshold is not None and self.gbps >= self.threshold
        rel = ">=" if above else "<"
        exp = f"expected {self.expected:g}" if self.expected else "expected unknown"
        thr = "?" if self.threshold is None else f"{self.threshold:g}"
        cap = f", capability {self.capability}" if self.capability else ""
        line = f"{self.a} -> {self.b}: {got} {rel} {thr} ({exp}{cap})"
        if self.error:
            line += f": measurement failed: {self.error}"
        if not self.capable:
            line += (
                f": no P2P (capability {self.capability or 'unknown'}): copies go through host memory, "
                "bandwidth is no proof"
            )
        return line


def judge(
    matrix: P2PMatrix,
    links: dict[str, dict[str, Any]],
    *,
    min_gbps: float | None = None,
    fraction: float = DEFAULT_FRACTION,
    topo: dict[tuple[str, str], str] | None = None,
    model: str = "",
    placed: dict[frozenset[str], float] | None = None,
) -> list[PairVerdict]:
    """Judge every ordered pair: threshold = min_gbps, else fraction x expected for that pair.

    `placed`: what a PCIe pair should reach from where it sits (modules/p2p_causes.py
    `expectation`: same switch, same NUMA node, across NUMA nodes), which replaces the link's raw
    rate as the expectation; NVLink pairs keep theirs.
    """
    out = []
    for a in matrix.bdfs:
        for b in matrix.bdfs:
            if a == b:
                continue
            link = (topo or {}).get((a, b))
            expected = expected_gbps(links.get(a, {}), links.get(b, {}), link, model)
            by_place = (placed or {}).get(frozenset((a, b)))
            if by_place and not (link and link.startswith("NV")):
                expected = by_place
            threshold = (
                min_gbps if min_gbps is not None else (round(expected * fraction, 1) if expected else None)
            )
            out.append(
                PairVerdict(
                    a,
                    b,
                    matrix.values.get((a, b)),
                    expected,
                    threshold,
                    matrix.capability.get((a, b)),
                    matrix.errors.get((a, b)),
                )
            )
    return out
