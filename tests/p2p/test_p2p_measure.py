"""suites/p2p measurement: expected bandwidth from the link's maximum, the cupy
probe's error handling, size and median, and one direction convention for every tool's matrix.

The cupy probe runs against a stand-in ``cupy`` module put in ``sys.modules``: it answers the CUDA
runtime calls the probe makes (peer access, copies, events) the way the real one does, including
``CUDARuntimeError.status``. There is no GPU here; scripts/gpu-check.sh runs the real probe.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_p2p
from pytest_gpuhost.modules import p2p

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "outputs"
GEN5 = "32.0 GT/s PCIe"


# ---------------------------------------------------------------- expected bandwidth


def test_expected_bandwidth_comes_from_the_links_maximum_not_an_idle_gen1() -> None:
    idle = {"speed": "2.5 GT/s PCIe", "width": 16, "max_speed": GEN5, "max_width": 16}
    assert p2p.expected_gbps(idle, idle) == 63.0  # the current speed gave 4.0: every pair "passed" at 2 GB/s
    busy = {"speed": GEN5, "width": 16, "max_speed": GEN5, "max_width": 16}
    assert p2p.expected_gbps(idle, busy) == 63.0
    # a Gen5 GPU in a Gen4 slot: the upstream port's maximum bounds the link (hwloc#653)
    slot = dict(idle, port_max_speed="16.0 GT/s PCIe", port_max_width=16)
    assert p2p.expected_gbps(slot, busy) == 31.5
    # a root bus has no port attributes (None): the GPU's maximum alone
    assert p2p.link_max_gbps(dict(idle, port_max_speed=None, port_max_width=None)) == 63.0
    # no maximum known (an old kernel): the current speed and width
    assert (
        p2p.expected_gbps({"speed": "16.0 GT/s PCIe", "width": 16}, {"speed": "16.0 GT/s PCIe", "width": 8})
        == 15.8
    )
    ok = {("a", "b"): "OK", ("b", "a"): "OK"}
    m = p2p.P2PMatrix(["a", "b"], {("a", "b"): 20.0, ("b", "a"): 40.0}, "test", ok)
    verdicts = p2p.judge(m, {"a": idle, "b": idle})
    assert [v.threshold for v in verdicts] == [31.5, 31.5]
    assert [v.ok for v in verdicts] == [False, True]


# ---------------------------------------------------------------- a stand-in cupy


class CUDARuntimeError(Exception):
    def __init__(self, status: int, name: str) -> None:
        super().__init__(f"{name}: {name.replace('cudaError', '')}")
        self.status = status


class _Array:
    def __init__(self, cupy: FakeCupy, n: int, value: int, dev: int) -> None:
        self.cupy, self.n, self.value, self.dev = cupy, n, value, dev
        self.ptr = id(self)
        self.data = types.SimpleNamespace(ptr=self.ptr)
        cupy.arrays[self.ptr] = self

    def __getitem__(self, s: slice) -> _Array:
        return self

    def __eq__(self, other: object) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(all=lambda: self.value == other)


class FakeCupy(types.ModuleType):
    """What the probe calls: cuda.runtime, cuda.Device, cuda.Stream, cuda.Event, full/zeros."""

    uint8 = "uint8"

    def __init__(self, bus_ids: list[str], elapsed_ms: list[float], enable_error: int | None = None) -> None:
        super().__init__("cupy")
        self.bus_ids, self.elapsed = bus_ids, list(elapsed_ms)
        self.enable_error = enable_error
        self.arrays: dict[int, _Array] = {}
        self.copies: list[tuple[int, int, int]] = []  # (src device, dst device, bytes)
        self.current = 0
        self.enabled: set[tuple[int, int]] = set()
        fake = self

        class Device:
            def __init__(self, n: int) -> None:
                self.n = n

            def __enter__(self) -> None:
                self.prev, fake.current = fake.current, self.n

            def __exit__(self, *a: object) -> None:
                fake.current = self.prev

        class Stream:
            ptr = 7

            def __init__(self, non_blocking: bool = False) -> None:
                pass

            def synchronize(self) -> None:
                pass

        class Event:
            def record(self, stream: object) -> None:
                pass

            def synchronize(self) -> None:
                pass

        def enable(peer: int) -> None:
            if fake.enable_error is not None:
                names = {704: "cudaErrorPeerAccessAlreadyEnabled", 217: "cudaErrorPeerAccessUnsupported"}
                raise CUDARuntimeError(fake.enable_error, names.get(fake.enable_error, "cudaErrorUnknown"))
            fake.enabled.add((fake.current, peer))

        def copy(dst: int, dst_dev: int, src: int, src_dev: int, size: int, stream: int) -> None:
            fake.arrays[dst].value = fake.arrays[src].value
            fake.copies.append((src_dev, dst_dev, size))

        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: len(bus_ids),
            deviceGetPCIBusId=lambda i: bus_ids[i],
            deviceCanAccessPeer=lambda a, b: True,
            deviceEnablePeerAccess=enable,
            memcpyPeerAsync=copy,
            CUDARuntimeError=CUDARuntimeError,
        )
        self.cuda = types.SimpleNamespace(
            runtime=runtime,
            Device=Device,
            Stream=Stream,
            Event=Event,
            get_elapsed_time=lambda s, e: fake.elapsed.pop(0),
        )

    def full(self, n: int, value: int, dtype: str) -> _Array:
        return _Array(self, n, value, self.current)

    def zeros(self, n: int, dtype: str) -> _Array:
        return _Array(self, n, 0, self.current)

    def get_default_memory_pool(self) -> Any:
        return types.SimpleNamespace(free_all_blocks=lambda: None)


def _probe(monkeypatch: pytest.MonkeyPatch, cupy: FakeCupy, **params: Any) -> dict[str, Any]:
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML here: capability says why
    return probe_p2p.p2p_probe({"bdfs": ["0000:17:00.0", "0000:18:00.0"], **params})  # type: ignore[no-any-return]


BUS = ["00000000:17:00.0", "00000000:18:00.0"]


def test_probe_copies_512_mib_several_times_and_keeps_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    size = 512 << 20
    # per pair: 5 timed samples; one outlier each way must not move the figure
    times = [10.0, 10.5, 1000.0, 9.5, 10.2] + [20.0, 21.0, 19.0, 0.5, 20.5]
    cupy = FakeCupy(BUS, times)
    out = _probe(monkeypatch, cupy, size=1 << 20)  # a smaller size asked for is raised to 512 MiB
    assert out["available"] and out["size"] == size and out["errors"] == {}
    assert {s for _, _, s in cupy.copies} == {size}
    assert len(cupy.copies) == 2 * (1 + 5)  # one untimed warm-up and five timed copies per pair
    assert [(a, b) for a, b, _ in cupy.copies[:6]] == [(0, 1)] * 6  # "A>B": data from A to B
    fwd = out["bandwidth"]["0000:17:00.0>0000:18:00.0"]
    assert fwd == round(size / 0.0102 / 1e9, 2)  # the median sample (10.2 ms), not the mean
    assert out["samples"]["0000:17:00.0>0000:18:00.0"][2] == round(size / 1.0 / 1e9, 2)
    assert out["bandwidth"]["0000:18:00.0>0000:17:00.0"] == round(size / 0.020 / 1e9, 2)
    assert "error" in out["capability"]


def test_probe_treats_already_enabled_peer_access_as_success(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _probe(monkeypatch, FakeCupy(BUS, [10.0] * 10, enable_error=704))
    assert out["errors"] == {} and all(v for v in out["bandwidth"].values())


def test_probe_fails_a_pair_on_any_other_peer_access_error(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = FakeCupy(BUS, [10.0] * 10, enable_error=217)
    out = _probe(monkeypatch, cupy)
    assert out["bandwidth"] == {"0000:17:00.0>0000:18:00.0": None, "0000:18:00.0>0000:17:00.0": None}
    why = out["errors"]["0000:17:00.0>0000:18:00.0"]
    assert "cudaErrorPeerAccessUnsupported" in why and "217" in why, why
    assert cupy.copies == []  # before: the error was swallowed and a host-staged copy was timed
    # the suite's verdict: the pair fails with the reason, capability OK or not
    caps = {("0000:17:00.0", "0000:18:00.0"): "OK", ("0000:18:00.0", "0000:17:00.0"): "OK"}
    errors = {tuple(k.split(">")): v for k, v in out["errors"].items()}
    m = p2p.P2PMatrix(["0000:17:00.0", "0000:18:00.0"], {k: 50.0 for k in caps}, "cupy", caps, errors=errors)  # type: ignore[misc]
    link = {"max_speed": GEN5, "max_width": 16}
    verdicts = p2p.judge(m, {b: link for b in m.bdfs})
    assert not any(v.ok for v in verdicts)
    assert "measurement failed: cudaDeviceEnablePeerAccess" in verdicts[0].describe()


# ---------------------------------------------------------------- one direction for every tool


class _Result:
    def __init__(self, rc: int, stdout: str) -> None:
        self.rc, self.stdout, self.stderr, self.ok = rc, stdout, "", rc == 0


class _Conn:
    """Answers measure()'s commands with fixed outputs (nvidia-smi index map, capability, tools)."""

    name = "host"

    def __init__(self, outputs: dict[str, tuple[int, str]]) -> None:
        self.outputs = outputs

    def call(self, op: str, **params: Any) -> Any:
        return {"available": False, "reason": "cupy: No module named 'cupy'"}

    def run(self, argv: list[str], *, timeout: float | None = None, **kw: Any) -> _Result:
        key = " ".join(argv)
        for prefix, (rc, out) in self.outputs.items():
            if key.startswith(prefix):
                return _Result(rc, out)
        return _Result(127, "")


SMI = (0, "0, 00000000:17:00.0\n1, 00000000:18:00.0\n")
P2P_OK = (
    0,
    "        GPU0    GPU1\n GPU0   X       OK\n GPU1   OK      X\n\nLegend:\n\n  X    = Self\n  OK   = Status Ok\n",
)
NVB_READ = """nvbandwidth Version: v0.8
Built from Git version: v0.8

CUDA Runtime Version: 12080
CUDA Driver Version: 12080
Driver Version: 570.124.06

Device 0: NVIDIA RTX 6000 Ada Generation (00000000:17:00)
Device 1: NVIDIA RTX 6000 Ada Generation (00000000:18:00)

Running device_to_device_memcpy_read_ce.
memcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)
           0         1
 0       N/A     10.00
 1     20.00       N/A

SUM device_to_device_memcpy_read_ce 30.00
"""


def test_nvbandwidth_read_cell_row_col_is_data_from_col_to_row() -> None:
    conn = _Conn(
        {
            "nvidia-smi --query-gpu": SMI,
            "nvidia-smi topo -p2p r": P2P_OK,
            "nvbandwidth -t device_to_device_memcpy_read_ce -j": (1, "unknown option -j"),
            "nvbandwidth -t": (0, NVB_READ),
        }
    )
    m = p2p.measure(conn, ["0000:17:00.0", "0000:18:00.0"])
    assert m.source == "nvbandwidth"
    # cell (0, 1) = 10: GPU 0 read from GPU 1, the data went 1 -> 0
    assert m.values[("0000:18:00.0", "0000:17:00.0")] == 10.0
    assert m.values[("0000:17:00.0", "0000:18:00.0")] == 20.0
    assert m.rows() == [[None, 20.0], [10.0, None]] and "from GPU a to GPU b" in m.to_dict()["direction"]


def test_p2p_bandwidth_latency_test_write_cell_row_col_is_data_from_row_to_col() -> None:
    text = (FIX / "p2pBandwidthLatencyTest-rtx4090x2.txt").read_text()
    conn = _Conn(
        {
            "nvidia-smi --query-gpu": SMI,
            "nvidia-smi topo -p2p r": P2P_OK,
            "nvbandwidth": (127, ""),
            "p2pBandwidthLatencyTest": (0, text),
        }
    )
    m = p2p.measure(conn, ["0000:17:00.0", "0000:18:00.0"])
    assert m.source == "p2pBandwidthLatencyTest"
    from pytest_gpuhost.modules import parsers

    cells = parsers.parse_p2p_bandwidth_latency(text)[
        "Unidirectional P2P=Enabled Bandwidth (P2P Writes) Matrix"
    ]
    assert m.values[("0000:17:00.0", "0000:18:00.0")] == cells.get("0", "1")
    assert m.values[("0000:18:00.0", "0000:17:00.0")] == cells.get("1", "0")
