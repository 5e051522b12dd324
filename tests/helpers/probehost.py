"""A target that runs the agent's probe ops in this process and bulk channels as local subprocesses.

For testing the backup and process modules before (or beside) the real agent: the ops are the
real probe code (`pytest_gpuhost/agent/probe_*.py`), parameters and results go through a JSON
round trip as on the wire, and `open_channel` starts a real process with pipes.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

AGENT_DIR = Path(__file__).resolve().parents[2] / "pytest_gpuhost" / "agent"


class ProbeHost:
    """Run probe ops locally, the way the agent would on a node."""

    def __init__(self, probes: Sequence[str] = ("probe_backup.py", "probe_process.py")) -> None:
        self.ops: dict[str, Any] = {}
        self.round_trips = 0
        self.channels: list[subprocess.Popen[bytes]] = []

        def op(name: str) -> Any:
            def register(func: Any) -> Any:
                self.ops[name] = func
                return func

            return register

        for probe in probes:
            ns: dict[str, Any] = {"op": op, "__name__": "agent_probe"}
            path = AGENT_DIR / probe
            exec(compile(path.read_text(), str(path), "exec"), ns)  # noqa: S102 - our own probe source

    def call(self, op: str, **params: Any) -> Any:
        self.round_trips += 1
        result = self.ops[op](json.loads(json.dumps(params)))
        return json.loads(json.dumps(result))

    def open_channel(self, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.channels.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.channels:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
