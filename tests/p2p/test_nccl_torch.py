"""The torch all-reduce program (modules/nccl_torch.py), run for real, and how nccl_run finds and bounds it.

The runs go through `nccl_run.run_arm` and a real local:// agent, as on a target: the source on
stdin, `timeout -k 5 BOUND`, the marker, the leftover kill. This machine has no GPU, so the
program runs in its test-only mode (`--device cpu --backend gloo`): real torch processes, the
same launcher, TCPStore, sweep, data check and output, but gloo on the CPU instead of NCCL on
GPUs. What that does not prove: that NCCL initialises on real GPUs, the CUDA-event timing, the
device lines' PCI ids, and NCCL's transport lines (scripts/gpu-check.sh runs the NCCL path where
a GPU is lent). A stand-in nvidia-smi on PATH lists two GPUs, for the CUDA ordinals run_arm gives.
"""

from __future__ import annotations

import ast
import os
import signal
import stat
import sys
from collections.abc import Iterator
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules import nccl, nccl_run, nccl_torch, service_env

GPUS = ["0000:17:00.0", "0000:18:00.0"]
NVIDIA_SMI = "#!/bin/sh\nprintf '00000000:17:00.0\\n00000000:18:00.0\\n'\n"
# the test-only mode, and a short sweep: 1 KiB to 4 KiB by 4 (two sizes), 1 warm-up, 2 timed
CPU = ("--device", "cpu", "--backend", "gloo", "-b", "1K", "-e", "4K", "-f", "4", "-w", "1", "-n", "2")
SIZES = 2


def torch_or_skip() -> str:
    """torch's version, found without importing it here (the runs import it in their own processes)."""
    if find_spec("torch") is None:
        pytest.skip(f"torch is not importable by {sys.executable}: scripts/setup.sh installs its CPU build")
    return version("torch")


@pytest.fixture(scope="module")
def conn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local:// agent whose PATH has the stand-in nvidia-smi first."""
    bin_dir = tmp_path_factory.mktemp("bin")
    smi = bin_dir / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        c = open_connection(parse_host_url("local://"))  # the agent keeps the PATH it started with
    try:
        yield c
    finally:
        c.close()


def tool(conn: Any, *extra: str) -> nccl_run.Tool:
    return nccl_run.Tool(
        conn, nccl_run.TORCH, sys.executable, "torch (CPU build)", "the test's Python", (*CPU, *extra)
    )


def ours_alive(marker: str) -> list[int]:
    """Pids on this machine whose environment holds the arm's marker."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker.encode() in env:
                found.append(int(d.name))
    return found


# ------------------------------------------------------------------ the program's own pieces


def test_sizes_and_float_cells_follow_nccl_tests() -> None:
    o = nccl_torch.options(list(nccl_run.ARGS))
    assert nccl_torch.sizes(o) == [8 << 20, 16 << 20, 32 << 20, 64 << 20, 128 << 20]
    assert (o.check, o.warmup_iters, o.iters) == (1, 5, 20)
    # util.cu's getFloatStr: two decimals while they fit, then fewer, then an exponent
    assert [nccl_torch.float_str(v, 6) for v in (21.5, 123.456, 12345.6, 1234567.0)] == [
        " 21.50",
        "123.46",
        " 12346",
        " 1e+06",
    ]
    assert nccl_torch.bus_factor(2) == 1.0 and nccl_torch.bus_factor(8) == 1.75


def test_a_row_is_read_by_parse_perf() -> None:
    text = "\n".join(
        [
            nccl_torch.row(8 << 20, 400.0, 4, 0),
            nccl_torch.row(16 << 20, 800.0, 4, 3),
            "# Out of bounds values : 1 FAILED",
            "# Avg bus bandwidth    : 31.4573 ",
            "# Collective test concluded: x",
        ]
    )
    r = nccl.parse_perf(text)
    first, second = r.rows
    assert (first.size, first.count, first.dtype, first.redop) == (8 << 20, 2 << 20, "float", "sum")
    # 8 MiB in 400 us: algbw 20.97 GB/s, busbw x 2(4-1)/4 = 1.5
    assert (first.time_us, first.algbw, first.busbw, first.wrong) == (400.0, 20.97, 31.46, 0)
    assert second.wrong_total == 3 and r.wrong == 3 and r.out_of_bounds == 1 and r.concluded
    assert nccl_torch.row(8 << 20, 400.0, 4, None).endswith("   N/A")  # -c 0: not checked


def test_the_program_imports_only_the_standard_library_and_torch() -> None:
    """It runs on the target as __main__ from stdin: nothing of this package is there."""
    tree = ast.parse(nccl_run.program())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    assert names - {"__future__", "torch"} <= set(sys.stdlib_module_names), names


def test_the_command_sends_the_program_on_stdin(conn: Any) -> None:
    argv, stdin = tool(conn).command(60.0, 2)
    assert argv[:7] == ["timeout", "-k", "5", "60", sys.executable, "-c", nccl_torch.BOOT]
    assert argv[7 : 7 + len(nccl_run.ARGS)] == list(nccl_run.ARGS) and argv[19:21] == ["-g", "2"]
    assert stdin == Path(nccl_torch.__file__).read_text()


# ------------------------------------------------------------------ real torch processes


def test_a_run_completes_with_no_wrong_element_and_parses(conn: Any) -> None:
    torch_or_skip()
    arm = nccl_run.run_arm(tool(conn), "P2P", GPUS, {}, 120.0)
    assert arm.rc == 0 and not arm.hung, arm.tail
    assert arm.failure() == "", arm.tail
    r = arm.result
    assert [row.size for row in r.rows] == [1024, 4096] and r.wrong == 0 and r.out_of_bounds == 0
    assert r.concluded and r.validation == 1 and r.avg_busbw is not None and r.avg_busbw > 0
    assert r.devices == []  # "[cpu]" is no PCI address: no GPU check against the in-scope ones
    assert arm.tool.startswith("torch.distributed (torch (CPU build)) with ") and arm.leftover == []
    assert ours_alive(arm.marker) == []


def test_wrong_data_is_counted_on_every_size(conn: Any) -> None:
    torch_or_skip()
    arm = nccl_run.run_arm(tool(conn, "--fault", "wrong"), "P2P", GPUS, {}, 120.0)
    assert arm.rc == 1, arm.tail
    assert arm.result.wrong == nccl_torch.FAULT_WRONG * SIZES and arm.result.out_of_bounds == SIZES
    assert arm.failure() == ""  # it completed: the verdict, not the run, fails it
    v = nccl.verdict(arm, nccl.Arm(nccl.ARMS[1], GPUS, [], {}, 120.0))
    assert v.problems[0] == (
        f"P2P: wrong data: {nccl_torch.FAULT_WRONG * SIZES} wrong elements "
        f"(first at 1024 B: {nccl_torch.FAULT_WRONG}) on {', '.join(GPUS)}"
    )


def test_a_rank_that_fails_is_named(conn: Any) -> None:
    torch_or_skip()
    arm = nccl_run.run_arm(tool(conn, "--fault", "exit"), "P2P", GPUS, {}, 120.0)
    assert arm.rc == 2 and not arm.hung, arm.tail
    assert arm.failure().startswith(f"failed (rc 2) on {', '.join(GPUS)}: rank 1: RuntimeError: --fault exit")
    assert ours_alive(arm.marker) == []


def test_a_rank_that_hangs_is_ended_by_the_bound(conn: Any) -> None:
    """The last rank never enters the all_reduce; timeout ends the launcher and every rank."""
    torch_or_skip()
    arm = nccl_run.run_arm(tool(conn, "--fault", "hang"), "P2P", GPUS, {}, 8.0)
    assert arm.hung and arm.rc in (124, 137), (arm.rc, arm.tail)
    assert 8.0 <= arm.seconds < 8.0 + nccl_run.KILL_AFTER + 10
    assert arm.failure() == f"hung after 8 s on {', '.join(GPUS)} (ended by timeout -k 5 8)"
    assert arm.leftover == [] and ours_alive(arm.marker) == []


def test_a_rank_that_left_the_process_group_is_found_by_its_marker(conn: Any) -> None:
    """A rank in a session of its own outlives timeout's kill; the marker finds it, SIGKILL ends it."""
    torch_or_skip()
    arm = nccl_run.run_arm(tool(conn, "--fault", "escape"), "P2P", GPUS, {}, 3.0)
    left = ours_alive(arm.marker)
    for pid in left:  # should the kill be gone, the test still leaves nothing behind
        os.kill(pid, signal.SIGKILL)
    assert arm.hung, arm.tail
    assert len(arm.leftover) == 1, arm.leftover
    assert "outlived it (killed with SIGKILL)" in arm.failure()
    assert left == []


def test_find_tool_refuses_a_torch_without_nccl(conn: Any) -> None:
    """No all_reduce_perf here; this machine's torch is a CPU build: nothing to run, and why."""
    torch_version = torch_or_skip()
    found, looked = nccl_run.find_tool([conn], [(conn, sys.executable, "the test's Python")])
    assert found is None
    assert f"{conn.name}: no all_reduce_perf" in looked
    assert f"{sys.executable} on {conn.name}: torch {torch_version} has no NCCL" in looked


def test_find_tool_says_why_a_python_has_no_torch(conn: Any, tmp_path: Path) -> None:
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError' >&2\nexit 1\n")
    fake.chmod(0o755)
    found, why = nccl_run.torch_tool(conn, str(fake))
    assert found is None and why.startswith("did not answer (rc 1: ModuleNotFoundError")


# ------------------------------------------------------------------ the service's interpreters


def test_service_interpreters_best_first() -> None:
    where = "process 7 of sglang.service"
    venv = service_env.interpreters(
        ("/opt/sglang/.venv/bin/python3", "-m", "sglang.launch_server"), "/usr/bin/python3.11", {}, where
    )
    assert venv == [("/opt/sglang/.venv/bin/python3", where), ("/usr/bin/python3.11", where)]
    conda = service_env.interpreters(
        ("python", "-m", "vllm"), "/opt/conda/bin/python3.11", {"CONDA_PREFIX": "/opt/conda"}, where
    )
    assert conda == [("/opt/conda/bin/python", where), ("/opt/conda/bin/python3.11", where)]
    assert (
        service_env.interpreters(("/usr/bin/bash", "run.sh"), "/usr/bin/bash", {"VIRTUAL_ENV": "/v"}, where)
        == []
    )
