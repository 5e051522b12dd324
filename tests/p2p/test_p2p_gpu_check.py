"""scripts/gpu-check.sh on a machine without a usable NVIDIA GPU: one line naming why, exit 2, nothing saved.

This machine has no GPU. The script is run as an operator would, with PATH holding only the basic
tools (no nvidia-smi), then with an nvidia-smi that answers as it does where the driver is
installed but cannot reach a GPU (its real messages: exit 9 "NVIDIA-SMI has failed because it
couldn't communicate with the NVIDIA driver", exit 6 "No devices were found").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
TOOLS = ("sh", "dirname", "head", "grep", "mkdir", "printf", "cat")


def _bin(tmp_path: Path, smi: str | None) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            (d / tool).symlink_to(found)
    if smi is not None:
        (d / "nvidia-smi").write_text(smi)
        (d / "nvidia-smi").chmod(0o755)
    return d


def _run(tmp_path: Path, smi: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(_bin(tmp_path, smi)), "HOME": str(tmp_path), "LANG": "C"}
    return subprocess.run(
        ["/bin/sh", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=30
    )


NO_DRIVER = (
    "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    'Make sure that the latest NVIDIA driver is installed and running."\nexit 9\n'
)
NO_DEVICE = '#!/bin/sh\necho "No devices were found"\nexit 6\n'


@pytest.mark.parametrize(
    ("smi", "said"),
    [
        (None, "no nvidia-smi on PATH"),
        (NO_DRIVER, "couldn't communicate with the NVIDIA driver"),
        (NO_DEVICE, "No devices were found"),
    ],
    ids=["no-driver-tools", "driver-without-gpu", "no-device"],
)
def test_fails_with_one_line_without_a_gpu(tmp_path: Path, smi: str | None, said: str) -> None:
    out = tmp_path / "captures"
    r = _run(tmp_path, smi, str(out))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: ") and said in lines[0], r.stderr
    assert not out.exists()  # nothing saved from a machine that has nothing to show


def test_usage_is_one_line(tmp_path: Path) -> None:
    r = _run(tmp_path, None)
    assert r.returncode == 2 and r.stderr.strip() == (
        "gpu-check: usage: scripts/gpu-check.sh DIR (a folder for the captures)"
    )


def test_script_is_executable_and_parses() -> None:
    assert os.access(SCRIPT, os.X_OK)
    assert subprocess.run(["sh", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_runs_through_on_a_lab_host(lab: object, tmp_path: Path) -> None:
    """The success path, on the lab's proxmox-rtx6000 (its emulated nvidia-smi and nvbandwidth, the
    lab host's root is an overlay over this machine's, so the checkout is there): every capture
    saved with its exit code, every parser agrees with the agent, the P2P matrix kept."""
    host = lab.host("proxmox-rtx6000")  # type: ignore[attr-defined]
    r = host.ssh(f"cd {ROOT} && scripts/gpu-check.sh /tmp/gpu-check; echo rc=$?", timeout=240)
    assert "rc=0" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    manifest = host.ssh("cat /tmp/gpu-check/MANIFEST.txt").stdout
    for f in (
        "nvidia-smi-L.txt",
        "nvidia-smi-topo-m.txt",
        "nvidia-smi-topo-p2p-r.txt",
        "health.txt",
        "p2p-check-only.txt",
    ):
        assert f"{f}\trc " in manifest, manifest
    compare = json.loads(host.ssh("cat /tmp/gpu-check/compare.json").stdout)
    assert compare and all(c["ok"] for c in compare), compare
    assert any(c["check"].startswith("P2P measurement") for c in compare)
    matrix = json.loads(host.ssh("cat /tmp/gpu-check/p2p-matrix.json").stdout)
    assert matrix["bdfs"] == ["0000:17:00.0", "0000:18:00.0", "0000:3a:00.0", "0000:3b:00.0"]
    assert matrix["where"] and "from GPU a to GPU b" in matrix["direction"]
