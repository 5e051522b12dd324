"""Running the NCCL collective check on a target: both arms, each bounded there, with either tool.

Used by suites/p2p (step 7, the in-scope GPUs) and suites/health (`--health-nccl`, every GPU; the
compute check after a reset, one GPU). The parsing and the verdict are
pytest_gpuhost/modules/nccl.py; this module finds a tool and runs it. Two tools, in this order:

- nccl-tests' ``all_reduce_perf`` on PATH (NVIDIA's own; one process drives every GPU);
- else a Python whose torch has NCCL: pytest_gpuhost/modules/nccl_torch.py, sent on stdin, one
  process per GPU through ``torch.distributed``, printing ``all_reduce_perf``'s format. The
  interpreters are tried as the caller lists them (suites/p2p: the service's own, in its
  container), then ``python3`` on each target's PATH; each is asked first (``--probe``, bounded)
  whether its torch was built with NCCL.

Each arm runs as ``timeout -k 5 BOUND TOOL ...`` on the target, so a hung collective is ended
there (SIGTERM to timeout's process group at the bound, SIGKILL 5 s later) even when the link to
it is lost; the arm carries a marker in its environment (``GPUHOST_NCCL_RUN``), and afterwards
every process of the tool (``all_reduce_perf`` by name; the interpreter by its executable, which
its forked ranks share) whose environment holds the marker is listed and killed: nothing of ours
stays on the GPUs, not even a rank that left the process group. The GPUs are given as CUDA
ordinals in PCI order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``), counted among the GPUs that machine's
nvidia-smi lists (a container numbers only the GPUs passed to it).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from pytest_gpuhost.errors import Unreachable
from pytest_gpuhost.modules import nccl, nccl_torch, p2p

__all__ = [
    "ARGS",
    "NO_TOOL",
    "TOOL",
    "TORCH",
    "Tool",
    "cuda_order",
    "find_tool",
    "run_arm",
    "run_both",
    "side",
    "torch_tool",
]

TOOL = "all_reduce_perf"
TORCH = "torch.distributed"
# one process, every in-scope GPU (-g N); 8 MiB to 128 MiB, where a PCIe ring reaches its bus
# bandwidth; -c 1 checks every result (the #wrong column); 5 warm-up and 20 timed iterations.
# The torch program takes the same arguments (one process per GPU).
ARGS = ("-b", "8M", "-e", "128M", "-f", "2", "-c", "1", "-w", "5", "-n", "20")
NO_TOOL = f"nccl-tests' {TOOL} on PATH, or a Python whose torch has NCCL"  # what to install
KILL_AFTER = 5  # seconds between timeout's SIGTERM and its SIGKILL
MARK = "GPUHOST_NCCL_RUN"
PROBE_TIMEOUT = 60.0  # seconds for `PYTHON --probe`: a CUDA build of torch takes seconds to import
# the pids of all_reduce_perf processes whose environment holds MARK=$1 (an argument, never spliced)
_OURS = (
    'for p in $(pgrep -x all_reduce_perf); do tr "\\0" "\\n" < /proc/$p/environ 2>/dev/null'
    ' | grep -qxF "GPUHOST_NCCL_RUN=$1" && echo "$p"; done; true'
)
# the same for processes whose executable is the file $2 (`test -ef`: same device and inode, so a
# venv's symlink matches the binary that /proc/PID/exe names); the test is a shell builtin
_OURS_EXE = (
    'for d in /proc/[0-9]*; do [ "$d/exe" -ef "$2" ] || continue; p=${d#/proc/};'
    ' tr "\\0" "\\n" < "$d/environ" 2>/dev/null | grep -qxF "GPUHOST_NCCL_RUN=$1" && echo "$p"; done; true'
)


@dataclass
class Tool:
    """A program that runs the all-reduce on one connection, and where it came from."""

    conn: Any
    kind: str  # TOOL or TORCH
    path: str  # all_reduce_perf's path, or the Python interpreter
    detail: str = ""  # "torch 2.6.0+cu124, NCCL 2.21.5"
    origin: str = ""  # "the service's process 1234", "python3 on PATH"
    extra: tuple[str, ...] = ()  # arguments after ARGS; tests pass the program's --device cpu ...

    def describe(self) -> str:
        """What ran and where, for the evidence: the tool, its interpreter and where that came from."""
        if self.kind == TOOL:
            return f"{TOOL} ({self.path}) on {self.conn.name}"
        how = f", {self.origin}" if self.origin else ""
        detail = f" ({self.detail})" if self.detail else ""
        return f"{TORCH}{detail} with {self.path}{how} on {self.conn.name}"

    def label(self) -> str:
        """The short name in one-line summaries: ``all_reduce_perf`` or ``torch.distributed``."""
        return self.kind

    def command(self, bound: float, ngpus: int) -> tuple[list[str], str | None]:
        """(argv, stdin) of one arm: the tool under ``timeout -k 5 BOUND``."""
        head = ["timeout", "-k", str(KILL_AFTER), f"{bound:g}"]
        if self.kind == TOOL:
            return [*head, self.path, *ARGS, "-g", str(ngpus), *self.extra], None
        argv = [*head, self.path, "-c", nccl_torch.BOOT, *ARGS, "-g", str(ngpus), *self.extra]
        return argv, program()


def program() -> str:
    """The torch program's source, as sent to the target on stdin."""
    return resources.files("pytest_gpuhost.modules").joinpath("nccl_torch.py").read_text(encoding="utf-8")


def _has_nccl_tests(conn: Any) -> str | None:
    r = conn.run(["sh", "-c", 'command -v "$1"', "sh", TOOL], timeout=15)
    path = r.stdout.strip()
    return path if r.rc == 0 and path else None


def torch_tool(conn: Any, python: str, origin: str = "") -> tuple[Tool | None, str]:
    """(the torch tool on `python`, "") when its torch has NCCL; else (None, why not)."""
    r = conn.run([python, "-c", nccl_torch.BOOT, "--probe"], stdin=program(), timeout=PROBE_TIMEOUT)
    info: dict[str, Any] = {}
    for line in reversed(r.stdout.splitlines()):
        try:
            info = json.loads(line)
            break
        except ValueError:
            continue
    if not isinstance(info, dict) or not info:
        err = (r.stderr or r.stdout).strip().splitlines()
        return None, f"did not answer (rc {r.rc}{': ' + err[-1][:120] if err else ''})"
    if info.get("error"):
        return None, str(info["error"])[:160]
    version = str(info.get("torch"))
    if not info.get("nccl"):
        return None, f"torch {version} has no NCCL"
    nccl_version = str(info.get("nccl_version") or "")
    detail = f"torch {version}" + (f", NCCL {nccl_version}" if nccl_version else "")
    path = str(info.get("python") or python)
    return Tool(conn, TORCH, path, detail, origin), ""


def find_tool(
    conns: Sequence[Any], pythons: Sequence[tuple[Any, str, str]] = ()
) -> tuple[Tool | None, list[str]]:
    """The first tool that can run the collective, and where each was looked for.

    nccl-tests' all_reduce_perf on any of `conns` first; then each of `pythons` ((conn,
    interpreter, where it came from), in the caller's order), then ``python3`` on each of `conns`
    and the interpreter each one's agent runs on; its torch must have NCCL.
    """
    looked: list[str] = []
    reachable = []
    for conn in conns:
        try:
            path = _has_nccl_tests(conn)
        except Unreachable as exc:
            looked.append(f"{conn.name} (unreachable: {str(exc)[:80]})")
            continue
        if path:
            return Tool(conn, TOOL, path), looked
        reachable.append(conn)
    tried: set[tuple[str, str]] = set()
    candidates = [*pythons, *((c, "python3", "python3 on PATH") for c in reachable)]
    # the interpreter the agent found (exec/pythons.py), where PATH's python3 is another or none
    candidates += [(c, str(c.python), "the agent's Python") for c in reachable if getattr(c, "python", "")]
    for conn, python, origin in candidates:
        if (conn.name, python) in tried:
            continue
        tried.add((conn.name, python))
        try:
            tool, why = torch_tool(conn, python, origin)
        except Unreachable as exc:
            looked.append(f"{conn.name} (unreachable: {str(exc)[:80]})")
            continue
        if tool is not None:
            return tool, looked
        looked.append(f"{python} on {conn.name}: {why}")
    return None, [*(f"{c.name}: no {TOOL}" for c in reachable), *looked]


def cuda_order(conn: Any) -> list[str]:
    """PCI addresses of the GPUs this machine's nvidia-smi lists, in PCI order (CUDA's with PCI_BUS_ID)."""
    r = conn.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], timeout=30)
    if r.rc != 0:
        return []
    return sorted(p2p.norm_bdf(line) for line in r.stdout.splitlines() if line.strip())


def leftovers(tool: Tool, token: str) -> list[int]:
    """Pids of this arm's processes (the tool's, with its marker) still on the target."""
    if tool.kind == TOOL:
        r = tool.conn.run(["sh", "-c", _OURS, "sh", token], timeout=15)
    else:
        r = tool.conn.run(["sh", "-c", _OURS_EXE, "sh", token, tool.path], timeout=15)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def run_arm(tool: Tool, name: str, gpus: list[str], extra_env: dict[str, str], bound: float) -> nccl.Arm:
    """Run one arm with `tool` on ``gpus`` (PCI addresses) within ``bound`` seconds on its target."""
    conn = tool.conn
    gpus = sorted(gpus)
    order = cuda_order(conn)
    argv, stdin = tool.command(bound, len(gpus))
    arm = nccl.Arm(name, gpus, argv, dict(extra_env), bound, where=conn.name, tool=tool.describe())
    missing = [b for b in gpus if b not in order]
    if missing:
        arm.tail = f"{', '.join(missing)} not listed by nvidia-smi on {conn.name}"
        return arm
    token = uuid.uuid4().hex
    arm.marker = f"{MARK}={token}"
    env = {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(order.index(b)) for b in gpus),
        "NCCL_DEBUG": "INFO",
        MARK: token,
        **extra_env,
    }
    t0 = time.monotonic()
    r = conn.run(argv, timeout=bound + KILL_AFTER + 15, env=env, stdin=stdin)
    arm.seconds = time.monotonic() - t0
    arm.rc = r.rc
    # timeout(1): 124 when it sent SIGTERM, 137 when the command needed the SIGKILL
    arm.hung = r.rc in (124, 137) or bool(getattr(r, "timed_out", False))
    arm.tail = (r.stdout + "\n" + r.stderr).strip()[-4000:]
    arm.result = nccl.parse_perf(r.stdout)
    arm.channels = nccl.parse_channels(r.stdout + "\n" + r.stderr)
    # NCCL_RUN_DIAGNOSTICS=1 (NCCL 2.31+): the report is on rank 0's stdout, prefixed "NCCL DIAG"
    arm.diag = [line for line in (r.stdout + "\n" + r.stderr).splitlines() if "NCCL DIAG" in line][:64]
    left = leftovers(tool, token)
    if left:
        conn.run(["kill", "-9", *map(str, left)], timeout=15)
        time.sleep(0.5)
        arm.leftover = left
    return arm


def run_both(tool: Tool, gpus: list[str], bound: float) -> tuple[nccl.Arm, nccl.Arm]:
    """The P2P arm (NCCL as it chooses), then the control arm (NCCL_P2P_DISABLE=1), on ``gpus``."""
    # NCCL 2.31+ checks every P2P path it will use at communicator init and names a failing pair
    # (NCCL user guide, Troubleshooting: Diagnostics); older releases ignore the variable
    first = run_arm(tool, nccl.ARMS[0], gpus, {"NCCL_P2P_DISABLE": "0", "NCCL_RUN_DIAGNOSTICS": "1"}, bound)
    control = run_arm(tool, nccl.ARMS[1], gpus, dict(nccl.CONTROL_ENV), bound)
    return first, control


def side(arm: nccl.Arm) -> dict[str, Any]:
    """One arm as a column of the evidence: transport, bus bandwidth, wrong elements, time."""
    r = arm.result
    return {
        "tool": arm.tool,
        "transport": arm.transport_text(),
        "avg busbw (GB/s)": r.avg_busbw,
        "#wrong": r.wrong,
        "seconds": round(arm.seconds, 2),
        "rc": arm.rc,
        "result": arm.failure() or "completed",
        "where": arm.where,
        "env": arm.env,
    }
