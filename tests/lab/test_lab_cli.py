"""The lab's command line: up, list, ssh, pytest-args, record, faults, down, and its errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpulab.pytest_fixtures import lab_unavailable

REPO = Path(__file__).resolve().parents[2]
NAME = f"cli-{os.getpid()}"

pytestmark = pytest.mark.skipif(bool(lab_unavailable()), reason=f"lab unavailable: {lab_unavailable()}")


def gl(*args: str, timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpulab", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        input=input,
    )


@pytest.fixture(scope="module")
def cli_host():
    p = gl("up", "proxmox-rtx6000", "--name", NAME)
    assert p.returncode == 0, p.stderr
    yield NAME
    gl("down", NAME)


def test_up_prints_address_and_pytest_args(cli_host):
    p = gl("pytest-args", cli_host)
    assert p.returncode == 0
    assert p.stdout.startswith("--host=ssh://root@198.18.")
    assert "--container=pct:101" in p.stdout


def test_list_shows_the_host(cli_host):
    p = gl("list")
    line = next(x for x in p.stdout.splitlines() if x.startswith(cli_host + " "))
    assert "proxmox-rtx6000" in line and line.split()[-1] in ("running", "degraded")


def test_ssh_prints_output_and_returns_exit_code(cli_host):
    p = gl("ssh", cli_host, "--", "hostname; echo err >&2; exit 3")
    assert (p.returncode, p.stdout, p.stderr) == (3, "pve-gpu01\n", "err\n")
    p = gl("ssh", cli_host, "--container", "101", "--", "hostname")
    assert (p.returncode, p.stdout) == (0, "sglang-ct\n")


def test_record_prints_json_lines_of_sysfs_writes(cli_host):
    p = gl("ssh", cli_host, "--", "echo 0000:17:00.1 > /sys/bus/pci/drivers/snd_hda_intel/unbind")
    assert p.returncode == 0, p.stderr
    p = gl("record", cli_host)
    entries = [json.loads(line) for line in p.stdout.splitlines()]
    assert any(
        e.get("path", "").endswith("snd_hda_intel/unbind") and e.get("value", "").strip() == "0000:17:00.1"
        for e in entries
    )


def test_fault_commands(cli_host):
    assert gl("cut-link", cli_host).returncode == 0
    try:
        assert gl("ssh", cli_host, "--timeout", "3", "--", "true").returncode != 0
    finally:
        assert gl("heal-link", cli_host).returncode == 0
    assert gl("ssh", cli_host, "--", "true").returncode == 0


def test_errors_are_one_line(cli_host):
    p = gl("up", "no-such-profile")
    assert p.returncode == 1 and p.stderr.startswith("gpulab: no profile named 'no-such-profile'")
    assert len(p.stderr.splitlines()) == 1
    p = gl("up", "proxmox-rtx6000", "--name", cli_host)
    assert p.returncode == 1 and "is taken" in p.stderr and len(p.stderr.splitlines()) == 1
    p = gl("ssh", "no-such-host", "--", "true")
    assert p.returncode == 1 and "no lab host named" in p.stderr


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop root")
def test_not_root_is_refused():
    p = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "gpulab", "up", "x"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert p.returncode == 1
    assert p.stderr.strip() == "gpulab: the lab needs root (namespaces, mounts, FUSE); run it as root"


def test_down_removes_the_host():
    name = f"{NAME}-d"
    p = gl("up", "proxmox-rtx6000", "--name", name)
    assert p.returncode == 0, p.stderr
    p = gl("down", name)
    assert p.returncode == 0, p.stderr
    assert name not in gl("list").stdout
    assert f"gl-{name}" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
