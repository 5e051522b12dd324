"""suites/p2p without --service: the unit holding the GPUs is the service, else there is none.

No unit name is a default: on the proxmox-rtx6000 lab host the unit is found from the processes
holding the in-scope GPUs (sglang-qwen.service in container 101, seen from the host); on the
small inference node with its server stopped nothing holds the GPUs, and the run names no
service, stops nothing and says why. Over real SSH, the suite run as an operator runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _run(h: Any, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    argv = [
        sys.executable, "-m", "pytest", "suites/p2p", *h.pytest_args(), "--check-only", "-p", "no:cacheprovider",
        f"--report-dir={tmp_path}", "--report-name=p2p", "-o", "addopts=", "--stop-timeout=3", "-rA", *extra,
    ]  # fmt: skip
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    doc = json.loads((tmp_path / "p2p.json").read_text())
    return r, {t["nodeid"].split("::")[-1].split("[")[0]: t for t in doc["tests"]}


def _notes(test: dict[str, Any]) -> list[str]:
    return list(((test.get("evidence") or {}).get("call") or {}).get("notes") or [])


def test_the_unit_holding_the_gpus_is_the_service(lab: Any, tmp_path: Path) -> None:
    h = lab.host("proxmox-rtx6000")
    h.reset()
    r, tests = _run(h, tmp_path)
    out = r.stdout + r.stderr
    found = [n for n in _notes(tests["test_plan"]) if n.startswith("service: ")]
    assert len(found) == 1 and found[0].startswith(
        "service: sglang-qwen.service, the unit whose processes hold the in-scope GPUs (pid "
    ), _notes(tests["test_plan"])
    # the broken host needs a repair: step 2 would stop that unit, step 9 start it
    assert "systemctl stop --no-block sglang-qwen.service" in out, out[-3000:]
    assert "start sglang-qwen.service" in out


def test_no_unit_holds_the_gpus_no_service_is_stopped(lab: Any, tmp_path: Path) -> None:
    h = lab.host("health-ok", name=f"svc{os.getpid() % 100000}-none")
    r = h.ssh("systemctl stop sglang-qwen.service; systemctl is-active sglang-qwen.service")
    assert r.stdout.strip() == "inactive", r.stdout + r.stderr
    r, tests = _run(h, tmp_path)
    out = r.stdout + r.stderr
    assert "sglang-qwen" not in out, out[-3000:]  # no lab name as a default
    why = "no unit holds the in-scope GPUs and none was given"
    assert any(why in n for n in _notes(tests["test_plan"])), _notes(tests["test_plan"])
    for step in ("test_service_stopped", "test_service_restored"):
        assert tests[step]["outcome"] == "skipped", tests[step]
        assert why in tests[step]["message"], tests[step]
    assert "Traceback" not in out
