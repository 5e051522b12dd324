"""The lab's nvidia-smi, nvbandwidth, dmesg, nvidia-persistenced and SGLang stand-in, run against a
standalone FUSE sysfs, compared with the real tools' formats; and the b200 /data generator."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulab.host.datatrees import populate
from gpulab.kernel.model import find_holders
from gpulab.profiles.load import load_profile

StandaloneMount = pytest.importorskip(
    "gpulab.kernel.sysfs", reason="the lab's sysfs needs mfusepy and libfuse", exc_type=ImportError
).StandaloneMount

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "gpulab" / "tools"
OUTPUTS = REPO / "fixtures" / "outputs"
GPUS = ["0000:17:00.0", "0000:18:00.0", "0000:3a:00.0", "0000:3b:00.0"]


class Lab:
    """A standalone mount plus a root tree laid out like a lab host, for the tools."""

    def __init__(self, m: StandaloneMount, root: Path, profile: str) -> None:
        self.m, self.root, self.profile = m, root, profile
        self.mnt = Path(m.mnt)
        (root / "sys/bus").mkdir(parents=True)
        (root / "sys/kernel").mkdir(parents=True)
        (root / "var/lib/gpulab").mkdir(parents=True)
        (root / "sys/bus/pci").symlink_to(self.mnt / "pci")
        (root / "sys/kernel/iommu_groups").symlink_to(self.mnt / "iommu_groups")
        (root / "var/lib/gpulab/ctl").symlink_to(self.mnt / "ctl")
        (root / "var/lib/gpulab/record.jsonl").symlink_to(Path(m.state) / "record.jsonl")
        (root / "dev").symlink_to(m.dev)
        (root / "var/lib/gpulab/profile.json").write_text(load_profile(profile).to_json())
        self.env = {**os.environ, "GPULAB_ROOT": str(root), "PYTHONPATH": str(TOOLS)}

    def run(self, tool: str, *args: str, rc: int = 0) -> str:
        p = subprocess.run([sys.executable, str(TOOLS / tool), *args], env=self.env, capture_output=True,
                           text=True, timeout=30)  # fmt: skip
        assert p.returncode == rc, (tool, args, p.returncode, p.stdout, p.stderr)
        return p.stdout

    def w(self, rel: str, value: str) -> None:
        fd = os.open(self.mnt / rel, os.O_WRONLY)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def make_identity(self, gpus: list[str]) -> None:
        """Unbind GPUs and their audio, set their groups to identity, rebind in order."""
        for b in gpus:
            self.w("pci/drivers/nvidia/unbind", b)
            self.w("pci/drivers/snd_hda_intel/unbind", b[:-1] + "1")
            grp = os.path.basename(os.readlink(self.mnt / f"pci/devices/{b}/iommu_group"))
            self.w(f"iommu_groups/{grp}/type", "identity")
        for b in gpus:
            self.w("pci/drivers/nvidia/bind", b)
            self.w("pci/drivers/snd_hda_intel/bind", b[:-1] + "1")

    def reset(self) -> None:
        self.w("ctl/reset", "1")


@pytest.fixture(scope="module")
def pve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    work = tmp_path_factory.mktemp("tools-pve")
    with StandaloneMount("proxmox-rtx6000", work / "m") as m:
        yield Lab(m, work / "root", "proxmox-rtx6000")


@pytest.fixture
def lab(pve: Lab) -> Iterator[Lab]:
    pve.reset()
    yield pve
    pve.reset()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ nvidia-smi


def test_nvidia_smi_sees_only_gpus_on_nvidia(lab: Lab) -> None:
    prof = load_profile("proxmox-rtx6000")
    lines = lab.run("nvidia-smi", "-L").splitlines()
    assert lines == [f"GPU {i}: {prof.gpu(b).model} (UUID: {prof.gpu(b).uuid})" for i, b in enumerate(GPUS)]
    lab.w("pci/drivers/nvidia/unbind", GPUS[0])
    assert lab.run("nvidia-smi", "-L").splitlines()[0].startswith(f"GPU 0: {prof.gpu(GPUS[1]).model}")
    for b in GPUS[1:]:
        lab.w("pci/drivers/nvidia/unbind", b)
    assert lab.run("nvidia-smi", "-L", rc=6) == "No devices were found\n"
    assert lab.run("nvidia-smi", rc=6) == "No devices were found\n"
    assert lab.run("nvbandwidth", rc=1).startswith("nvbandwidth Version: v0.8\n")


def test_query_gpu_csv_formats_and_errors(lab: Lab) -> None:
    out = lab.run("nvidia-smi", "--query-gpu=index,pci.bus_id,memory.total,persistence_mode,pcie.link.gen.current,"
                  "pcie.link.width.max,retired_pages.pending,clocks_event_reasons.active", "--format=csv")  # fmt: skip
    rows = out.splitlines()
    assert rows[0] == ("index, pci.bus_id, memory.total [MiB], persistence_mode, pcie.link.gen.current, "
                       "pcie.link.width.max, retired_pages.pending, clocks_event_reasons.active")  # fmt: skip
    assert rows[1] == "0, 00000000:17:00.0, 97887 MiB, Disabled, 5, 16, No, 0x0000000000000000"
    assert len(rows) == 5
    bare = lab.run(
        "nvidia-smi", "--query-gpu=index,memory.total,power.draw", "--format=csv,noheader,nounits", "-i", "2"
    )
    assert re.fullmatch(r"2, 97887, \d+\.\d\d\n", bare)
    assert lab.run("nvidia-smi", "--query-gpu=index,bogus.field", "--format=csv", rc=2) == (
        'Field "bogus.field" is not a valid field to query.\n\n'
    )
    lab.run("nvidia-smi", "--query-gpu=index", rc=2)  # --format is required


def test_table_has_the_real_layout_and_counts_holders(lab: Lab) -> None:
    held = open(Path(lab.m.dev) / "nvidia1", "rb")  # noqa: SIM115
    try:
        holder = subprocess.Popen(["sleep", "30"], stdin=held)
        try:
            table = lab.run("nvidia-smi").splitlines()
            apps = lab.run("nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_bus_id",
                           "--format=csv,noheader")  # fmt: skip
        finally:
            holder.kill()
            holder.wait()
    finally:
        held.close()
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}", table[0])
    assert all(len(line) == 91 for line in table[1:] if line.strip()), [ln for ln in table if len(ln) != 91]
    assert (
        table[2]
        == "| NVIDIA-SMI 570.133.07             Driver Version: 570.133.07     CUDA Version: 12.8     |"
    )
    assert (
        table[4]
        == "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |"
    )
    assert (
        table[8]
        == "|   0  NVIDIA RTX PRO 6000 Blac...    Off |   00000000:17:00.0 Off |                    0 |"
    )
    assert (
        table[-4]
        == "|=========================================================================================|"
    )
    # the test process and the sleep hold /dev/nvidia1: both are GPU users
    assert f"{holder.pid}, sleep, 512 MiB, 00000000:18:00.0" in apps.splitlines()
    assert any(re.fullmatch(rf"\|    1   N/A  N/A +{holder.pid} +C   sleep +512MiB \|", ln) for ln in table)


def test_persistence_mode_switch_is_legacy_persistence(lab: Lab) -> None:
    out = lab.run("nvidia-smi", "-pm", "1", "-i", "0")
    assert out == "Enabled persistence mode for GPU 00000000:17:00.0.\nAll done.\n"
    assert (lab.mnt / f"ctl/persistence/{GPUS[0]}").read_text().strip() == "1"
    assert (
        lab.run("nvidia-smi", "--query-gpu=persistence_mode", "--format=csv,noheader").splitlines()[0]
        == "Enabled"
    )
    lab.run("nvidia-smi", "-pm", "0")
    assert (lab.mnt / f"ctl/persistence/{GPUS[0]}").read_text().strip() == "0"


def test_topo_matrix_and_p2p_follow_iommu_type(lab: Lab) -> None:
    topo = lab.run("nvidia-smi", "topo", "-m").splitlines()
    assert topo[0] == "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"
    assert topo[1] == "GPU0\t X \tPIX\tNODE\tNODE\t0-31,64-95\t0\t\tN/A"
    real = (OUTPUTS / "nvidia-smi-topo-m-rtx5090x2.txt").read_text().splitlines()
    assert (
        "\n".join(topo[topo.index("Legend:") :]).rstrip() == "\n".join(real[real.index("Legend:") :]).rstrip()
    )
    p2p = lab.run("nvidia-smi", "topo", "-p2p", "r").splitlines()
    assert p2p[:2] == [" \tGPU0\tGPU1\tGPU2\tGPU3\t", " GPU0\tX\tNS\tNS\tNS\t"]
    real = (OUTPUTS / "nvidia-smi-topo-p2p-rw-rtx5090x2.txt").read_text().splitlines()
    assert (
        "\n".join(p2p[p2p.index("Legend:") :]).rstrip() == "\n".join(real[real.index("Legend:") :]).rstrip()
    )
    lab.make_identity(GPUS[:2])
    p2p = lab.run("nvidia-smi", "topo", "-p2p", "r").splitlines()
    assert p2p[1:3] == [" GPU0\tX\tOK\tNS\tNS\t", " GPU1\tOK\tX\tNS\tNS\t"]
    # ACS request redirect on GPU 0's switch port sends peer traffic to the root complex
    fd = os.open(lab.mnt / "pci/devices/0000:16:00.0/config", os.O_WRONLY)
    try:
        os.pwrite(fd, (0b0101).to_bytes(2, "little"), 0x106)
    finally:
        os.close(fd)
    assert lab.run("nvidia-smi", "topo", "-p2p", "r").splitlines()[1] == " GPU0\tX\tNS\tNS\tNS\t"


# ------------------------------------------------------------------ nvbandwidth


CELL = r"(?: {7}N/A| *\d+\.\d\d)"


def parse_nvbandwidth(text: str) -> dict[str, tuple[list[list[float | None]], float]]:
    """Parse matrices the way a client would; used on the lab's output and a real one alike."""
    out: dict[str, tuple[list[list[float | None]], float]] = {}
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if not re.match(r"memcpy CE GPU\(row\) (->|<-) GPU\(column\) bandwidth \(GB/s\)$", ln):
            continue
        n = len(lines[i + 1].split())
        assert lines[i + 1] == "  " + "".join(f"{c:>10}" for c in range(n))  # setw(10) column ids
        rows = []
        for r in range(n):
            row = lines[i + 2 + r]
            assert re.fullmatch(rf"[ \d]\d{CELL}{{{n}}}", row), row
            rows.append([None if v == "N/A" else float(v) for v in row.split()[1:]])
        assert lines[i + 2 + n] == ""
        m = re.fullmatch(r"SUM (\w+) (\d+\.\d\d)", lines[i + 3 + n])
        assert m, lines[i + 3 + n]
        out[m.group(1)] = (rows, float(m.group(2)))
    return out


def test_real_nvbandwidth_output_parses_with_the_same_rules() -> None:
    real = parse_nvbandwidth((OUTPUTS / "nvbandwidth-a6000x6-d2d-read-ce.txt").read_text())
    rows, total = real["device_to_device_memcpy_read_ce"]
    assert (
        rows[0][0] is None and rows[0][1] == 26.34 and abs(sum(v or 0 for r in rows for v in r) - total) < 0.1
    )


def test_nvbandwidth_na_until_identity_then_link_model(lab: Lab) -> None:
    text = lab.run("nvbandwidth", "-t", "device_to_device_memcpy_read_ce")
    assert text.startswith(
        "nvbandwidth Version: v0.8\nBuilt from Git version: v0.8\n\nCUDA Runtime Version: 12080\n"
    )
    assert "Device 0: NVIDIA RTX PRO 6000 Blackwell Server Edition (00000000:17:00)\n" in text
    rows, total = parse_nvbandwidth(text)["device_to_device_memcpy_read_ce"]
    assert all(v is None for r in rows for v in r) and total == 0.0
    lab.make_identity(GPUS)
    res = parse_nvbandwidth(
        lab.run("nvbandwidth", "-t", "device_to_device_memcpy_read_ce", "device_to_device_memcpy_write_ce")
    )
    rows, total = res["device_to_device_memcpy_write_ce"]
    same_switch, cross_switch = rows[0][1], rows[0][2]
    assert same_switch is not None and cross_switch is not None and rows[1][1] is None
    assert 50.9 <= same_switch <= 53.1 and 39.1 <= cross_switch <= 40.9
    shown = [v for r in rows for v in r if v is not None]
    assert abs(sum(shown) - total) <= 0.005 * len(shown) + 0.01  # SUM is of the unrounded values
    doc = json.loads(lab.run("nvbandwidth", "-j", "-t", "4"))["nvbandwidth"]
    case = doc["testcases"][0]
    assert case["name"] == "device_to_device_memcpy_read_ce" and case["status"] == "Passed"
    assert case["bandwidth_matrix"][0][0] == "N/A" and 50.9 <= float(case["bandwidth_matrix"][0][1]) <= 53.1
    assert isinstance(case["sum"], float) and doc["version"] == "v0.8" and len(doc["GPU Device list"]) == 4
    h2d = lab.run("nvbandwidth", "-t", "host_to_device_memcpy_ce").splitlines()
    i = h2d.index("memcpy CE CPU(row) -> GPU(column) bandwidth (GB/s)")
    assert h2d[i + 1] == "  " + "".join(f"{c:>10}" for c in range(4))
    cells = h2d[i + 2].split()
    assert cells[0] == "0" and all(54.0 <= float(v) <= 56.5 for v in cells[1:]), h2d[i + 2]  # Gen5 x16
    m = re.fullmatch(r"SUM host_to_device_memcpy_ce (\d+\.\d\d)", h2d[i + 4])
    assert m and abs(float(m.group(1)) - sum(float(v) for v in cells[1:])) < 0.03  # sum of unrounded values
    listing = lab.run("nvbandwidth", "-l")
    assert "4, device_to_device_memcpy_read_ce:\n\tMeasures bandwidth of cuMemcpyAsync" in listing


def test_b200_nvlink_all_to_all(tmp_path: Path) -> None:
    with StandaloneMount("b200-nvl8", tmp_path / "m") as m:
        b = Lab(m, tmp_path / "root", "b200-nvl8")
        rows, _ = parse_nvbandwidth(b.run("nvbandwidth"))["device_to_device_memcpy_read_ce"]
        off_diagonal = [v for i, r in enumerate(rows) for j, v in enumerate(r) if i != j]
        assert len(rows) == 8 and all(v is not None and 734 <= v <= 766 for v in off_diagonal)
        assert b.run("nvidia-smi", "topo", "-m").splitlines()[1].startswith("GPU0\t X \tNV18\tNV18\t")
        assert " GPU0\tX\tOK\tOK\tOK\tOK\tOK\tOK\tOK\t" in b.run("nvidia-smi", "topo", "-p2p", "r")
        assert (
            b.run("nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader").splitlines()[0]
            == "183359 MiB"
        )
        status = b.run("nvidia-smi", "nvlink", "-s").splitlines()
        assert status[1] == "\t Link 0: 53.125 GB/s" and len(status) == 8 * 19


def test_gpu_reset_takes_the_nvlink_peers_nvidia_smi_1_requires(tmp_path: Path) -> None:
    """-r on one GPU: a Blackwell GPU alone; an A100 on NVSwitches without Fabric Manager is refused,
    naming its seven NVLink peers, and reset with them in one command (nvidia_smi_reset.py)."""
    from gpulab.profiles.nvlink_variants import a100_nvswitch

    with StandaloneMount("b200-nvl8", tmp_path / "m") as m:
        b = Lab(m, tmp_path / "root", "b200-nvl8")
        assert (
            b.run("nvidia-smi", "-r", "-i", "0000:61:00.0")
            == "GPU 00000000:61:00.0 was successfully reset.\n"
        )
        (b.root / "var/lib/gpulab/profile.json").write_text(a100_nvswitch().to_json())
        out = b.run("nvidia-smi", "-r", "-i", "0000:61:00.0", rc=255)
        named = [ln.strip() for ln in out.splitlines() if ln.startswith("  GPU ")]
        assert len(named) == 7 and "GPU 00000000:61:00.0" not in named, out
        everyone = ",".join(["0000:61:00.0", *(n.removeprefix("GPU ") for n in named)])
        assert b.run("nvidia-smi", "-r", "-i", everyone).count("was successfully reset") == 8


# ------------------------------------------------------------------ dmesg


def test_dmesg_formats_and_runtime_lines(lab: Lab) -> None:
    kmsg = lab.root / "var/lib/gpulab/kmsg"
    kmsg.write_text(
        json.dumps({"t": 4242.5, "msg": "NVRM: Xid (PCI:0000:17:00): 79, GPU has fallen off the bus."}) + "\n"
    )
    try:
        out = lab.run("dmesg").splitlines()
        assert out[0].startswith("[    0.000000] Linux version 6.8.12-4-pve ")
        assert all(re.match(r"\[ *\d+\.\d{6}\] ", ln) for ln in out)
        assert out[-1] == "[ 4242.500000] NVRM: Xid (PCI:0000:17:00): 79, GPU has fallen off the bus."
        iso = lab.run("dmesg", "--time-format", "iso").splitlines()
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{6}[+-]\d\d:\d\d NVRM: Xid .*", iso[-1])
        assert re.fullmatch(
            r"\[\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\] DMAR: IOMMU enabled",
            lab.run("dmesg", "-T").splitlines()[2],
        )
    finally:
        kmsg.unlink()


# ------------------------------------------------------------------ services


def records(lab: Lab) -> list[dict[str, object]]:
    p = Path(lab.m.state) / "record.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_persistenced_holds_every_gpu_and_blocks_unbind(lab: Lab) -> None:
    p = subprocess.Popen([sys.executable, str(TOOLS / "nvidia-persistenced"), "--verbose"], env=lab.env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        devs = [str(Path(lab.m.dev) / f"nvidia{i}") for i in range(4)]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(p.pid in v for v in find_holders(devs).values()):
            time.sleep(0.05)
        assert all(p.pid in v for v in find_holders(devs).values())
        q = lab.run("nvidia-smi", "--query-gpu=persistence_mode,memory.used", "--format=csv,noheader")
        assert q.splitlines() == ["Enabled, 0 MiB"] * 4
        fd = os.open(lab.mnt / "pci/drivers/nvidia/unbind", os.O_WRONLY)
        os.write(fd, GPUS[0].encode())
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        os.close(fd)  # the unbind completes on close once the daemon let go
        assert 0 < time.monotonic() - t0 < 5
        assert p.wait(5) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = p.stdout.read() if p.stdout else ""
    assert "device 0000:17:00.0 - registered" in out
    sig = [r for r in records(lab) if r.get("kind") == "signal"][-1]
    assert {"signal": "SIGTERM", "service": "nvidia-persistenced", "pid": p.pid}.items() <= sig.items()
    unbinds = [r for r in records(lab) if r.get("path") == "/sys/bus/pci/drivers/nvidia/unbind"]
    assert unbinds[-1]["result"] == "ok" and unbinds[-1]["value"] == GPUS[0]


def _sglang(lab: Lab, port: int, ignore: str, *extra: str, load_s: float = 0.3) -> subprocess.Popen[str]:
    env = {**lab.env, "GPULAB_SERVICE": "sglang-qwen", "GPULAB_IGNORE_SIGTERM": ignore, "GPULAB_GPUS": ",".join(GPUS),
           "GPULAB_LOAD_SECONDS": str(load_s)}  # fmt: skip
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/Qwen3-32B", "--tp", "4",
            "--port", str(port), "--host", "127.0.0.1", *extra]  # fmt: skip
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def _wait_health(port: int, want: int, within: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if _health(port) == want:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"/health never answered {want}")


def test_sglang_standin_health_holders_nccl_and_stuck_sigterm(lab: Lab, tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "qwen.log"
    p = _sglang(lab, port, "forever", "--log-file", str(log), load_s=2.0)  # a wide 503 window
    try:
        _wait_health(port, 503, 5)
        _wait_health(port, 200, 5)
        held = find_holders([Path(lab.m.dev) / f"nvidia{i}" for i in range(4)])
        assert all(v == [p.pid] for v in held.values())
        used = lab.run("nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits").split()
        assert used == [str(int(97887 * 0.9))] * 4  # --mem-fraction-static default of the stand-in
        assert "0[0] -> 1[1] via SHM/direct/direct" in log.read_text()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps({"model": "q", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.loads(r.read())["choices"][0]["message"]["role"] == "assistant"
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert p.poll() is None and _health(port) == 200
        sig = [r for r in records(lab) if r.get("kind") == "signal"][-1]
        assert sig["signal"] == "SIGTERM" and sig["pid"] == p.pid and sig["service"] == "sglang-qwen"
    finally:
        p.kill()
        p.wait(5)
    # P2P once every group of its GPUs is identity; SIGTERM honoured after N seconds
    lab.make_identity(GPUS)
    port, log = free_port(), tmp_path / "qwen2.log"
    p = _sglang(lab, port, "1", "--log-file", str(log))
    try:
        _wait_health(port, 200, 5)
        assert "0[0] -> 1[1] via P2P/CUMEM" in log.read_text()
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(5) == 0 and 0.9 <= time.monotonic() - t0 < 3
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ------------------------------------------------------------------ files


def test_b200_data_tree_small_is_deterministic_and_hostile(tmp_path: Path) -> None:
    a = populate(tmp_path / "a", None, "small")
    assert 1950 <= a["files"] <= 2100 and a["large"] == 3
    root = tmp_path / "a"
    assert (root / "PROGRESS.md").read_text().startswith("# Progress")
    shards = sorted((root / "data/shards").iterdir())
    assert len(shards) == 3 and all(s.stat().st_size >= 8 << 20 for s in shards)
    assert shards[0].read_bytes()[:6] == b"ARROW1"
    assert len(list((root / "logs").rglob("*.log"))) >= 500
    assert list((root / "data/completions").rglob("*.jsonl")) and list((root / "scripts").glob("*.sh"))
    odd = os.fsencode(root / "odd names")
    names = set(os.listdir(odd))
    assert {
        b"new\nline.txt",
        b"it's quoted.txt",
        b"caf\xe9-latin1.txt",
        b"-rf",
        b"$(touch pwned).txt",
    } <= names
    assert os.path.isfile(os.path.join(odd, b"$(touch /tmp/pwned).txt"))
    assert os.readlink(root / "odd names" / "etc-link") == "/etc"
    assert not os.path.exists("/tmp/pwned") or os.path.getmtime("/tmp/pwned") < time.time() - 3600

    def digest(base: Path) -> str:
        h = hashlib.sha256()
        for p in sorted(base.rglob("*")):
            if p.is_file() and not p.is_symlink():
                h.update(os.fsencode(p.relative_to(base)))
                h.update(p.read_bytes()[:4096])
                h.update(str(p.stat().st_mtime).encode())
        return h.hexdigest()

    populate(tmp_path / "b", None, "small")
    assert digest(root) == digest(tmp_path / "b")
