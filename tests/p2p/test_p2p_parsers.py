"""Parsers of nvbandwidth, p2pBandwidthLatencyTest and nvidia-smi topo against real outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpuhost.modules import parsers

OUT = Path(__file__).resolve().parents[2] / "fixtures" / "outputs"


def read(name: str) -> str:
    return (OUT / name).read_text()


def test_nvbandwidth_text_d2d_matrix() -> None:
    result = parsers.parse_nvbandwidth(read("nvbandwidth-a6000x6-d2d-read-ce.txt"))
    m = result["device_to_device_memcpy_read_ce"]
    assert m.rows == m.columns == ["0", "1", "2", "3", "4", "5"]
    assert m.get(0, 1) == 26.34
    assert m.get(3, 0) == 21.82
    assert m.get(5, 5) is None
    assert m.total == 715.53
    assert m.unit == "GB/s"
    assert len(m.pairs()) == 30
    # the tool sums unrounded values; the printed cells are rounded to two decimals
    assert sum(v for v in m.pairs().values() if v) == pytest.approx(715.53, abs=0.1)


def test_nvbandwidth_text_several_blocks() -> None:
    result = parsers.parse_nvbandwidth(read("nvbandwidth-rtx4090x8-v0.2-host.txt"))
    assert set(result) == {"host_to_device_memcpy_ce", "device_to_host_memcpy_ce"}
    h2d = result["host_to_device_memcpy_ce"]
    assert h2d.rows == ["0"] and len(h2d.columns) == 8
    assert h2d.get(0, 7) == 26.31
    assert result["device_to_host_memcpy_ce"].total == 214.28


@pytest.mark.parametrize(
    "name", ["nvbandwidth-rtx2080ti-x2-waived.txt", "nvbandwidth-a100x8-v0.7-assert.txt"]
)
def test_nvbandwidth_waived_or_aborted_gives_no_matrix(name: str) -> None:
    assert parsers.parse_nvbandwidth(read(name)) == {}


def test_nvbandwidth_json() -> None:
    result = parsers.parse_nvbandwidth(read("nvbandwidth-8gpu-d2d-read-ce.json"))
    m = result["device_to_device_memcpy_read_ce"]
    assert m.get(0, 0) is None
    assert m.get(0, 3) == 374.39
    assert m.get(1, 3) == 370.90
    assert m.total == 20841.13


def test_nvbandwidth_bad_cell_is_an_error() -> None:
    text = read("nvbandwidth-a6000x6-d2d-read-ce.txt").replace("26.34", "garbage", 1)
    with pytest.raises(parsers.ParseError, match="garbage"):
        parsers.parse_nvbandwidth(text)


def test_p2p_bandwidth_latency_two_gpus() -> None:
    result = parsers.parse_p2p_bandwidth_latency(read("p2pBandwidthLatencyTest-rtx4090x2.txt"))
    assert "P2P Connectivity Matrix" in result
    assert result["P2P Connectivity Matrix"].get(0, 1) == 1
    enabled = result["Unidirectional P2P=Enabled Bandwidth (P2P Writes) Matrix"]
    disabled = result["Unidirectional P2P=Disabled Bandwidth Matrix"]
    assert enabled.get(0, 1) == 6.60 and disabled.get(0, 1) == 6.34
    assert result["Bidirectional P2P=Disabled Bandwidth Matrix"].get(1, 0) == 8.67


def test_p2p_bandwidth_latency_iommu_symptom() -> None:
    result = parsers.parse_p2p_bandwidth_latency(read("p2pBandwidthLatencyTest-6gpu-iommu-slow.txt"))
    p2p = result["Unidirectional P2P=Enabled Bandwidth (P2P Reads) Matrix"]
    staged = result["Unidirectional P2P=Disabled Bandwidth Matrix"]
    # the symptom the suite exists for: peer copies slower than copies staged through the host
    pairs = [(p2p.get(i, j), staged.get(i, j)) for i in range(6) for j in range(6) if i != j]
    assert all(a is not None and b is not None and a < b for a, b in pairs)


def test_p2p_bandwidth_latency_tab_separated_connectivity() -> None:
    result = parsers.parse_p2p_bandwidth_latency(read("p2pBandwidthLatencyTest-h100x8-sxm.txt"))
    assert result["P2P Connectivity Matrix"].rows == [str(i) for i in range(8)]
    assert result["Unidirectional P2P=Disabled Bandwidth Matrix"].get(7, 7) == 2503.38


def test_p2p_bandwidth_latency_latency_blocks() -> None:
    text = (
        "P2P=Enabled Latency (P2P Writes) Matrix (us)\n"
        "   GPU     0      1\n     0   2.59   2.31\n     1   2.26   2.10\n\n"
        "   CPU     0      1\n     0   2.71   1.91\n     1   2.11   2.77\n"
    )
    result = parsers.parse_p2p_bandwidth_latency(text)
    assert result["P2P=Enabled Latency (P2P Writes) Matrix"].unit == "us"
    assert result["P2P=Enabled Latency (P2P Writes) Matrix CPU"].get(1, 1) == 2.77


def test_topo_matrix_tabs_with_nics() -> None:
    topo = parsers.parse_topo_matrix(read("nvidia-smi-topo-m-rtx4090x8.txt"))
    assert topo.gpus() == [f"GPU{i}" for i in range(8)]
    assert "NIC1" in topo.devices
    assert topo.get(0, 0) == "X"
    assert topo.get(0, 7) == "SYS"
    assert topo.get("GPU6", "NIC0") == "PHB"
    assert topo.cpu_affinity["GPU4"] == "56-111,168-223"
    assert topo.numa_affinity["GPU4"] == "1"


def test_topo_matrix_with_legend() -> None:
    topo = parsers.parse_topo_matrix(read("nvidia-smi-topo-m-rtx5090x2.txt"))
    assert topo.devices == ["GPU0", "GPU1"]
    assert topo.get(1, 0) == "PHB"
    assert topo.numa_affinity == {"GPU0": "0", "GPU1": "0"}


@pytest.mark.parametrize(
    "name", ["nvidia-smi-topo-p2p-rw-rtx5090x2.txt", "nvidia-smi-topo-p2p-rw-rtx5090x2-spaces.txt"]
)
def test_topo_p2p(name: str) -> None:
    topo = parsers.parse_topo_p2p(read(name))
    assert topo.devices == ["GPU0", "GPU1"]
    assert topo.get(0, 1) == "GNS"
    assert topo.get(1, 1) == "X"


def test_topo_p2p_unknown_code_is_an_error() -> None:
    text = read("nvidia-smi-topo-p2p-rw-rtx5090x2.txt").replace("GNS", "WAT", 1)
    with pytest.raises(parsers.ParseError, match="WAT"):
        parsers.parse_topo_p2p(text)


def _with_escapes(text: str) -> str:
    """The capture as the driver printed it: ESC[4m ... ESC[0m (the paste kept only "[4m")."""
    return text.replace("[4m", "\x1b[4m").replace("[0m", "\x1b[0m")


@pytest.mark.parametrize("escaped", [False, True], ids=["as-pasted", "with-esc"])
def test_topo_matrix_underlined_header_and_nic_rows_without_affinity(escaped: bool) -> None:
    """Driver 590 underlines the header even when piped (sgl-project/sglang#26039); NIC rows end in
    empty affinity cells. Before, the header was not found and the first GPU row became the header."""
    text = read("nvidia-smi-topo-m-b300x8-nic-underline.txt")
    m = parsers.parse_topo_matrix(_with_escapes(text) if escaped else text)
    assert m.devices == [f"GPU{i}" for i in range(8)] + [f"NIC{i}" for i in range(9)]
    assert m.links[("GPU0", "GPU7")] == "NV18" and m.links[("GPU3", "NIC3")] == "PXB"
    assert m.links[("NIC8", "NIC8")] == "X" and m.links[("NIC0", "GPU0")] == "PXB"
    assert m.cpu_affinity["GPU4"] == "64-127,192-255" and m.numa_affinity["GPU4"] == "1"
    assert "NIC0" not in m.cpu_affinity  # a NIC row has no affinity


def test_topo_p2p_with_escapes() -> None:
    text = read("nvidia-smi-topo-p2p-rw-rtx5090x2.txt")
    lines = text.splitlines()
    k = next(i for i, ln in enumerate(lines) if "GPU0" in ln)
    lines[k] = lines[k].replace("GPU0", "\x1b[4mGPU0", 1) + "\x1b[0m"
    assert parsers.parse_topo_p2p("\n".join(lines)).links == parsers.parse_topo_p2p(text).links


def test_topo_matrix_without_header_is_an_error_not_a_shifted_matrix() -> None:
    with pytest.raises(parsers.ParseError, match="no column header"):
        parsers.parse_topo_matrix("GPU0\t X \tNV4\t0-31\t0\nGPU1\tNV4\t X \t0-31\t0\n")
