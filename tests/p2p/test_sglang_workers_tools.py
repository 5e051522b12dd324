"""The SGLang stand-in's worker children against a standalone FUSE sysfs: titles, tree, GPUs held,
who dies with the server in each mode; with the real setproctitle module and without it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulab.kernel.model import find_holders
from gpulab.profiles.load import load_profile

StandaloneMount = pytest.importorskip(
    "gpulab.kernel.sysfs", reason="the lab's sysfs needs mfusepy and libfuse", exc_type=ImportError
).StandaloneMount

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)

TOOLS = Path(__file__).resolve().parents[2] / "gpulab" / "tools"
GPUS = ["0000:17:00.0", "0000:18:00.0", "0000:3a:00.0", "0000:3b:00.0"]
DEBIAN_PY = "/usr/bin/python3"  # what lab hosts run; python3-setproctitle gives it the real module


def _has_setproctitle(python: str) -> bool:
    return subprocess.run([python, "-c", "import setproctitle"], capture_output=True).returncode == 0


PYTHONS = [
    pytest.param(
        DEBIAN_PY,
        marks=pytest.mark.skipif(
            not os.path.exists(DEBIAN_PY) or not _has_setproctitle(DEBIAN_PY),
            reason="no python3-setproctitle (scripts/setup.sh installs it)",
        ),
        id="setproctitle",
    ),
    pytest.param(sys.executable, id="exec-fallback"),
]


class Root:
    def __init__(self, m: StandaloneMount, root: Path) -> None:
        self.m, self.mnt = m, Path(m.mnt)
        for d in ("sys/bus", "sys/kernel", "var/lib/gpulab"):
            (root / d).mkdir(parents=True)
        (root / "sys/bus/pci").symlink_to(self.mnt / "pci")
        (root / "sys/kernel/iommu_groups").symlink_to(self.mnt / "iommu_groups")
        (root / "var/lib/gpulab/ctl").symlink_to(self.mnt / "ctl")
        (root / "var/lib/gpulab/record.jsonl").symlink_to(Path(m.state) / "record.jsonl")
        (root / "dev").symlink_to(m.dev)
        (root / "var/lib/gpulab/profile.json").write_text(load_profile("proxmox-rtx6000").to_json())
        self.devs = lambda: [Path(m.dev) / f"nvidia{i}" for i in range(4)]
        self.env = {
            **os.environ,
            "GPULAB_ROOT": str(root),
            "PYTHONPATH": str(TOOLS),
            "GPULAB_GPUS": ",".join(GPUS),
        }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Root]:
    work = tmp_path_factory.mktemp("workers")
    with StandaloneMount("proxmox-rtx6000", work / "m") as m:
        yield Root(m, work / "root")


def tree(pid: int) -> dict[int, tuple[int, list[str]]]:
    """Return {pid: (ppid, argv without NUL padding)} of every live process below ``pid``."""
    table: dict[int, tuple[int, list[str]]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_bytes().rsplit(b")", 1)[1].split()
                argv = [a.decode() for a in (d / "cmdline").read_bytes().split(b"\0")]
            except (OSError, IndexError):
                continue
            while len(argv) > 1 and argv[-1] == "":
                argv.pop()
            if stat[0] != b"Z":
                table[int(d.name)] = (int(stat[1]), argv)
    out, frontier = {}, {pid}
    while frontier:
        frontier = {p for p, (pp, _) in table.items() if pp in frontier and p not in out}
        out.update({p: table[p] for p in frontier})
    return out


def start(
    root: Root, python: str, mode: str, port: int
) -> tuple[subprocess.Popen[bytes], dict[int, tuple[int, list[str]]]]:
    argv = [python, "-m", "sglang.launch_server", "--tp", "2", "--dp", "2", "--port", str(port),
            "--host", "127.0.0.1", "--gpulab-workers", mode, "--log-file", os.devnull]  # fmt: skip
    p = subprocess.Popen(argv, env=root.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = tree(p.pid)
        titled = len(kids) == 6 and all(a[0].startswith("sglang::") for _, a in kids.values())
        # ready once each scheduler opened its GPU too (the server and it hold the device)
        if titled and all(len(v) == 2 for v in find_holders(root.devs()).values()):
            return p, kids
        time.sleep(0.05)
    p.kill()
    raise AssertionError(f"workers never came up: {tree(p.pid)}")


def live(pids: dict[int, tuple[int, list[str]]]) -> list[int]:
    """Return those of ``pids`` still running (not gone, not a zombie)."""
    out = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
                out.append(pid)
        except OSError:
            pass
    return out


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("python", PYTHONS)
def test_dp_tree_titles_and_gpus_and_pdeathsig(root: Root, python: str) -> None:
    p, kids = start(root, python, "on", 31100)
    try:
        by_title = {a[0]: (pid, ppid, a) for pid, (ppid, a) in kids.items()}
        assert sorted(by_title) == [
            "sglang::data_parallel_controller", "sglang::detokenizer", "sglang::scheduler_DP0_TP0",
            "sglang::scheduler_DP0_TP1", "sglang::scheduler_DP1_TP0", "sglang::scheduler_DP1_TP1",
        ]  # fmt: skip
        ctl = by_title["sglang::data_parallel_controller"][0]
        assert by_title["sglang::detokenizer"][1] == p.pid
        assert all(v[1] == ctl for t, v in by_title.items() if "scheduler" in t)
        if python == DEBIAN_PY:  # the real module: argv is the title alone, as ps shows SGLang's
            assert all(a == [t] for t, (_, _, a) in by_title.items())
        devs = [Path(root.m.dev) / f"nvidia{i}" for i in range(4)]
        held = find_holders(devs)
        for i, d in enumerate(devs):
            want = by_title[f"sglang::scheduler_DP{i // 2}_TP{i % 2}"][0]
            assert sorted(held[str(d)]) == sorted([p.pid, want]), (d, held)
        p.kill()  # kill -9 of the server: every armed worker dies with it (PR_SET_PDEATHSIG)
        p.wait(5)
        deadline = time.monotonic() + 5
        while live(kids):
            assert time.monotonic() < deadline, live(kids)
            time.sleep(0.05)
    finally:
        kill_all([p.pid, *kids])
        p.wait(5)


@pytest.mark.parametrize(("mode", "left"), [("on", set()), ("orphans", {"scheduler"})])
def test_sigterm_to_the_server_leaves_only_the_orphans(root: Root, mode: str, left: set[str]) -> None:
    python = DEBIAN_PY if _has_setproctitle(DEBIAN_PY) else sys.executable
    p, kids = start(root, python, mode, 31200)
    try:
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
        time.sleep(0.3)
        alive = {pid: kids[pid][1][0] for pid in live(kids)}
        assert {t.split("_DP")[0] for t in alive.values()} == {f"sglang::{r}" for r in left}
        if left:  # four schedulers, reparented, each still holding its GPU
            assert len(alive) == 4
            held = find_holders([Path(root.m.dev) / f"nvidia{i}" for i in range(4)])
            assert sorted(pid for pids in held.values() for pid in pids) == sorted(alive)
    finally:
        kill_all([p.pid, *kids])
