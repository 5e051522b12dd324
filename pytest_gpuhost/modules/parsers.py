"""Parse the text the GPU tools print: nvbandwidth, p2pBandwidthLatencyTest, nvidia-smi topo.

Each parser takes the tool's whole stdout and returns plain data; none of them runs anything.
Cells a tool prints as `N/A` (or that it omits) become None. Parsers raise `ParseError` with the
offending line when the text is not what the tool prints, so a changed format fails loudly
instead of turning into an empty matrix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

__all__ = [
    "BandwidthMatrix",
    "ParseError",
    "TopoMatrix",
    "P2P_STATUS_LEGEND",
    "parse_nvbandwidth",
    "parse_nvbandwidth_json",
    "parse_nvbandwidth_text",
    "parse_p2p_bandwidth_latency",
    "parse_topo_matrix",
    "parse_topo_p2p",
    "strip_ansi",
]

#: `nvidia-smi topo -p2p r` legend (Facts in DESIGN.md; DR appears on newer drivers).
P2P_STATUS_LEGEND = {
    "X": "self",
    "OK": "status ok",
    "CNS": "chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "topology not supported",
    "NS": "not supported",
    "DR": "disabled by regkey",
    "U": "unknown",
}


class ParseError(ValueError):
    """A tool's output does not have the expected shape; the message quotes the line."""


@dataclass
class BandwidthMatrix:
    """One matrix a tool printed: rows x columns of GB/s (or us), None where not measured."""

    name: str
    title: str
    rows: list[str]
    columns: list[str]
    values: list[list[float | None]]
    unit: str = "GB/s"
    total: float | None = None

    def get(self, row: str | int, column: str | int) -> float | None:
        """Return the cell for GPU labels (or indices) row -> column."""
        return self.values[self.rows.index(str(row))][self.columns.index(str(column))]

    def pairs(self) -> dict[tuple[str, str], float | None]:
        """Return every off-diagonal cell keyed by (row, column)."""
        return {
            (r, c): self.values[i][j]
            for i, r in enumerate(self.rows)
            for j, c in enumerate(self.columns)
            if r != c
        }


def _cell(text: str, line: str) -> float | None:
    if text.upper() in ("N/A", "NA", "-"):
        return None
    try:
        return float(text)
    except ValueError:
        raise ParseError(f"not a number {text!r} in line {line.strip()!r}") from None


_NVB_RUNNING = re.compile(r"^Running (\S+?)\.?\s*$")
_NVB_SUM = re.compile(r"^SUM (\S+) ([0-9.]+)\s*$")
_NVB_WAIVED = re.compile(r"^Waiving (\S+?)\.?\s*$")


def parse_nvbandwidth_text(text: str) -> dict[str, BandwidthMatrix]:
    """Parse nvbandwidth's text output into one matrix per test case.

    A test case starts at `Running NAME.` (or, when the run had one test and the header was cut,
    at the matrix title) and ends at `SUM NAME VALUE`. Waived and aborted tests yield no matrix;
    callers ask for the test they ran and treat its absence as "not measured".
    """
    result: dict[str, BandwidthMatrix] = {}
    current_name: str | None = None
    matrix: BandwidthMatrix | None = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        stripped = line.strip()
        if m := _NVB_RUNNING.match(stripped):
            current_name = m.group(1)
            matrix = None
        elif _NVB_WAIVED.match(stripped):
            current_name, matrix = None, None
        elif (
            stripped.startswith(("memcpy ", "memory latency", "Device to Device Latency")) and "(" in stripped
        ):
            # v0.8+ latency titles: "Device to Device Latency SM GPU(row) <-> GPU(column) (ns)"
            unit = (
                "ns"
                if "(ns)" in stripped
                else "us"
                if "(us)" in stripped or "latency" in stripped
                else "GB/s"
            )
            header = lines[i + 1].split() if i + 1 < len(lines) else []
            if not header or not all(h.isdigit() for h in header):
                raise ParseError(f"matrix header expected after {stripped!r}")
            matrix = BandwidthMatrix(
                name=current_name or "", title=stripped, rows=[], columns=header, values=[], unit=unit
            )
            i += 2
            while i < len(lines) and lines[i].strip():
                cells = lines[i].split()
                if not cells[0].isdigit():
                    break
                if len(cells) - 1 != len(header):
                    raise ParseError(f"{len(cells) - 1} cells for {len(header)} columns: {lines[i]!r}")
                matrix.rows.append(cells[0])
                matrix.values.append([_cell(c, lines[i]) for c in cells[1:]])
                i += 1
            if current_name:
                result[current_name] = matrix
            continue
        elif m := _NVB_SUM.match(stripped):
            name = m.group(1)
            if name not in result and matrix is not None:
                matrix.name = name
                result[name] = matrix
            if name in result:
                result[name].total = float(m.group(2))
            current_name, matrix = None, None
        i += 1
    return result


def parse_nvbandwidth_json(text: str) -> dict[str, BandwidthMatrix]:
    """Parse `nvbandwidth -j` output (json_output.cpp): cells are strings, `N/A` where absent.

    Only test cases whose status is Passed (any case) carry a matrix.
    """
    try:
        doc = json.loads(text[text.index("{") :])
    except (ValueError, json.JSONDecodeError) as exc:
        raise ParseError(f"nvbandwidth JSON does not parse: {exc}") from None
    root = doc.get("nvbandwidth", doc)
    result: dict[str, BandwidthMatrix] = {}
    for case in root.get("testcases", []):
        name = case.get("name", "")
        if str(case.get("status", "")).lower() != "passed" or "bandwidth_matrix" not in case:
            continue
        rows = case["bandwidth_matrix"]
        values = [[_cell(str(c), str(row)) for c in row] for row in rows]
        width = max((len(r) for r in values), default=0)
        title = case.get("bandwidth_description", "")
        result[name] = BandwidthMatrix(
            name=name,
            title=title,
            rows=[str(i) for i in range(len(values))],
            columns=[str(j) for j in range(width)],
            values=values,
            unit="us" if "latency" in title else "GB/s",
            total=float(case["sum"]) if "sum" in case else None,
        )
    return result


def parse_nvbandwidth(text: str) -> dict[str, BandwidthMatrix]:
    """Parse nvbandwidth output in either format (JSON when the text starts with `{`)."""
    return parse_nvbandwidth_json(text) if text.lstrip().startswith("{") else parse_nvbandwidth_text(text)


_P2PBLT_TITLE = re.compile(r"^(.*?(?:Matrix|Connectivity Matrix).*?)(?:\s*\((GB/s|us)\))?\s*$")


def parse_p2p_bandwidth_latency(text: str) -> dict[str, BandwidthMatrix]:
    """Parse cuda-samples p2pBandwidthLatencyTest output into its matrices, keyed by title.

    Titles are the tool's own, e.g. "Unidirectional P2P=Enabled Bandwidth (P2P Writes) Matrix".
    Latency sections print a GPU block and a CPU block; the CPU block is kept as "<title> CPU".
    """
    result: dict[str, BandwidthMatrix] = {}
    lines = text.splitlines()
    i = 0
    title: str | None = None
    unit = "GB/s"
    while i < len(lines):
        stripped = lines[i].strip()
        if "Matrix" in stripped and not stripped.startswith(("D\\D", "GPU", "CPU")):
            m = _P2PBLT_TITLE.match(stripped)
            title = (m.group(1) if m else stripped).strip()
            unit = (m.group(2) if m and m.group(2) else "") or ("" if "Connectivity" in title else "GB/s")
            i += 1
            continue
        head = stripped.split()
        if title and head and head[0] in ("D\\D", "GPU", "CPU") and all(h.isdigit() for h in head[1:]):
            columns = head[1:]
            key = title if head[0] != "CPU" else f"{title} CPU"
            matrix = BandwidthMatrix(name=key, title=key, rows=[], columns=columns, values=[], unit=unit)
            i += 1
            while i < len(lines):
                cells = lines[i].split()
                if not cells or not cells[0].isdigit() or len(cells) - 1 != len(columns):
                    break
                matrix.rows.append(cells[0])
                matrix.values.append([_cell(c, lines[i]) for c in cells[1:]])
                i += 1
            if not matrix.rows:
                raise ParseError(f"matrix {key!r} has no rows")
            result[key] = matrix
            continue
        i += 1
    return result


@dataclass
class TopoMatrix:
    """`nvidia-smi topo -m` or `-p2p r`: link or status per pair of devices, plus affinities."""

    devices: list[str]
    links: dict[tuple[str, str], str]
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    numa_affinity: dict[str, str] = field(default_factory=dict)

    def get(self, a: str | int, b: str | int) -> str:
        """Return the cell for two devices, by name ("GPU0") or GPU index."""
        a = a if isinstance(a, str) else f"GPU{a}"
        b = b if isinstance(b, str) else f"GPU{b}"
        return self.links[(a, b)]

    def gpus(self) -> list[str]:
        """Return the GPU rows only (NIC rows left out)."""
        return [d for d in self.devices if d.startswith("GPU")]


_AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")


# Recent drivers underline the header of `nvidia-smi topo -m`/`-p2p` with ESC[4m ... ESC[0m even
# when the output is piped (sgl-project/sglang#26039, driver 590.44.01; the ESC byte itself is lost
# in that paste, leaving "[4m"); every CSI sequence and such a bare SGR remnant goes before parsing.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    """Remove terminal escape sequences (and ``[4m``-style remnants whose ESC was lost)."""
    return _ANSI.sub("", text)


def _topo_table(text: str) -> tuple[list[str], list[list[str]]]:
    """Split the matrix part of nvidia-smi topo output into header cells and row cells."""
    lines = strip_ansi(text).splitlines()
    start = next((k for k, ln in enumerate(lines) if re.search(r"\bGPU0\b", ln)), None)
    if start is None:
        raise ParseError("no GPU0 column header in nvidia-smi topo output")
    header_line = lines[start]
    first = header_line.split()
    if len(first) > 1 and first[0] == "GPU0" and first[1] == "X":  # a row, not the header: format changed
        raise ParseError(f"nvidia-smi topo output: no column header before row {header_line.strip()[:60]!r}")
    tabbed = "\t" in header_line
    if tabbed:
        header = [h.strip() for h in header_line.split("\t") if h.strip()]
    else:
        header = re.split(r"\s{2,}", header_line.strip())
        # "CPU Affinity" etc. contain one space; the split on 2+ spaces keeps them whole.
    rows: list[list[str]] = []
    for ln in lines[start + 1 :]:
        if not ln.strip() or ln.strip().startswith("Legend"):
            break
        if tabbed:
            cells = [c.strip() for c in ln.split("\t")]
            cells = [c for k, c in enumerate(cells) if c or (0 < k)]  # keep empty affinity cells
        else:
            cells = ln.split()
        while cells and cells[0] == "":
            cells.pop(0)
        rows.append(cells)
    return header, rows


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse `nvidia-smi topo -m` (tab or space separated), NIC rows and affinity columns included."""
    header, rows = _topo_table(text)
    devices = [h for h in header if h not in _AFFINITY_COLUMNS]
    links: dict[tuple[str, str], str] = {}
    cpu: dict[str, str] = {}
    numa: dict[str, str] = {}
    for cells in rows:
        name = cells[0]
        values = cells[1:]
        if len(values) < len(devices):
            raise ParseError(f"row {name!r} has {len(values)} cells for {len(devices)} devices")
        for dev, val in zip(devices, values, strict=False):
            links[(name, dev)] = val
        extra = [v for v in values[len(devices) :] if v]
        if extra:
            cpu[name] = extra[0]
        if len(extra) > 1:
            numa[name] = extra[1]
    if not links:
        raise ParseError("nvidia-smi topo output has no rows")
    return TopoMatrix(devices=devices, links=links, cpu_affinity=cpu, numa_affinity=numa)


def parse_topo_p2p(text: str) -> TopoMatrix:
    """Parse `nvidia-smi topo -p2p r` (or `rw`, `w`, ...): status codes per GPU pair.

    Unknown codes are an error: a code outside the legend means the format changed.
    """
    header, rows = _topo_table(text)
    links: dict[tuple[str, str], str] = {}
    for cells in rows:
        cells = [c for c in cells if c]
        name, values = cells[0], cells[1:]
        if len(values) != len(header):
            raise ParseError(f"row {name!r} has {len(values)} cells for {len(header)} GPUs")
        for dev, val in zip(header, values, strict=True):
            if val not in P2P_STATUS_LEGEND:
                raise ParseError(f"unknown P2P status {val!r} for {name} -> {dev}")
            links[(name, dev)] = val
    return TopoMatrix(devices=header, links=links)
