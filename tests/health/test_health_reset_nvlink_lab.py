"""`suites/health --fix=reset` where a GPU cannot be reset alone: its NVLink peer goes with it.

nvidia-smi(1), `-r`: the NVLink peers of a GPU before Ampere must be reset in the same command,
and then no compute application may run on any other GPU. The lab host has four Quadro GV100
(Volta) bridged in pairs (gpulab/profiles/nvlink_variants.py); GPU 0000:14:00.0 owes a reset while the
SGLang server (tp=4) and nvidia-persistenced hold all four. The lab's `nvidia-smi -r` refuses the
GPU alone, naming its peer, as the real tool does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpulab.profiles.nvlink_variants import gv100_bridged_pairs
from tests.health.test_health_lab_gpus import inject
from tests.health.test_health_reset_lab import _main_pid, _suite

BUS, PEER = "0000:14:00.0", "0000:13:00.0"  # one NVLink-bridged pair
PEER_MINOR, OTHER_MINOR = 0, 3  # /dev/nvidia0: the peer; /dev/nvidia3: 0000:24:00.0, of the other pair


def _reset_required(h: Any, bus: str) -> str:
    r = h.ssh(["nvidia-smi", "-i", bus, "--query-gpu=reset_status.reset_required", "--format=csv,noheader"])
    return r.stdout.strip()


def _resets(h: Any) -> list[str]:
    """The GPUs the lab's nvidia-smi -r reset so far, from the host's record."""
    text = h.ssh(["cat", "/var/lib/gpulab/record.jsonl"]).stdout
    return [d["bdf"] for d in map(json.loads, text.splitlines()) if d.get("op") == "gpu_reset"]


def test_a_volta_gpu_is_reset_with_its_nvlink_peer_and_no_compute_on_any_other(
    lab: Any, tmp_path: Path
) -> None:
    h = lab.host(gv100_bridged_pairs(), name=f"hv{os.getpid() % 100000}")
    inject(h, {"gpus": {BUS: {"reset_required": True}}})
    try:
        # the lab, as nvidia-smi(1) says: this GPU alone is refused, naming the peer to add
        r = h.ssh(["nvidia-smi", "-r", "-i", BUS])
        assert r.returncode == 255 and "GPU 00000000:13:00.0" in r.stdout, r.stdout

        proc, cells = _suite(h, tmp_path, "plan", "--check-only")
        assert cells["reset"]["outcome"] == "would fix", (cells["reset"], proc.stdout[-3000:])
        assert (
            f"{BUS} owes a reset (reset_status.reset_required is Yes); its NVLink peers {PEER} go in the "
            "same command (nvidia-smi(1) -r: Quadro GV100 is Volta, before Ampere)"
        ) in cells["reset"]["summary"], cells["reset"]
        assert f"nvidia-smi -r -i {BUS},{PEER}" in proc.stdout, proc.stdout[-3000:]
        before = _main_pid(h, "sglang-qwen.service")

        # a process outside the inventory's units on the peer, then on a GPU of the other pair:
        # no reset, nothing stopped, the holder named (the other GPU's with the rule that forbids it)
        for minor, said in ((PEER_MINOR, "holds /dev/nvidia0"), (OTHER_MINOR, "(another GPU: nvidia-smi(1)")):
            holder = h.ssh(
                f"setsid python3 -c 'import time; f = open(\"/dev/nvidia{minor}\"); time.sleep(600)' "
                ">/dev/null 2>&1 < /dev/null & echo $!"
            ).stdout.strip()
            try:
                proc, cells = _suite(h, tmp_path, f"refused{minor}")
                assert cells["reset"]["outcome"] == "failed", cells["reset"]
                assert f"PID {holder}" in proc.stdout and said in proc.stdout, proc.stdout[-3000:]
                assert _reset_required(h, BUS) == "Yes" and _main_pid(h, "sglang-qwen.service") == before
            finally:
                h.ssh(["kill", "-9", holder])

        proc, cells = _suite(h, tmp_path, "fix")
        assert cells["reset"]["outcome"] == "fixed", (cells["reset"], proc.stdout[-4000:])
        assert _reset_required(h, BUS) == "No"
        assert sorted(_resets(h)) == [PEER, BUS]  # the pair, in one command; the other pair untouched
        assert "ActiveState=active" in _main_pid(h, "sglang-qwen.service")
        assert "ActiveState=active" in _main_pid(h, "nvidia-persistenced.service")
        report = (tmp_path / "fix.html").read_text()
        assert "1 GPU(s) reset (with 1 NVLink peer(s) in the same command)" in report
        assert f"compute check passed on {BUS}, {PEER}" in report
    finally:
        inject(h, {})
