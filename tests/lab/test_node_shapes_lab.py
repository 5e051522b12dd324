"""Each suite's verdict on the node shapes of gpulab/profiles/shape_variants.py, over real SSH.

A rented container (PID 1 `sleep infinity`, tini or supervisord, no systemd, dmesg EPERM, read-only /sys, 4 of the
host's 8 GPUs), a node whose idle GPUs train their links down, and a host without the NVIDIA
driver: the decommission is safe and byte-exact on the container, health says what it cannot
see instead of failing the node, idle links pass while a degraded one fails, and a host without
the driver is one line (health) or a refusal at the plan (p2p).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpulab.host import pythons as labpy
from gpulab.profiles import python_variants, shape_variants
from tests.decommission.test_decommission_lab import (
    check_local,
    check_s3,
    node_hashes,
    processes,
    run_suite,
    suite_argv,
)
from tests.health.test_health_lab_gpus import run_suite as run_health_suite
from tests.helpers.snapshot import diff, host_snapshot, settled_snapshot

REPO = Path(__file__).resolve().parents[2]

#: checks whose input a rented container does not give (the kernel log, systemd)
BLIND_ON_A_CONTAINER = {"xid", "sxid", "fabric"}


def _name(what: str) -> str:
    return f"ns{os.getpid() % 100000}-{what}"


def _state_dir(h: Any) -> str:
    """The plugin's state on the node (journals, health-state.json): absent means nothing written."""
    r = h.ssh(["sh", "-c", "ls -A /var/lib/gpuhost 2>/dev/null; true"])
    return r.stdout.strip()


def test_rented_container_shape_is_what_a_rented_node_shows(lab: Any) -> None:
    """PID 1 sleep, /.dockerenv, no systemctl, dmesg EPERM, read-only /sys, 4 of 8 GPUs."""
    h = lab.host(shape_variants.rented_container(), name=_name("ct"), data_scale="small")
    r = h.ssh(
        "cat /proc/1/comm; test -e /.dockerenv && echo dockerenv; command -v systemctl journalctl; "
        "dmesg; echo dmesg=$?; ls /sys/bus/pci/devices | wc -l; "
        "nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | wc -l; "
        "echo 1 > /sys/bus/pci/rescan || echo sys-ro"
    )
    out = r.stdout.split()
    assert out[:2] == ["sleep", "dockerenv"], r.stdout
    assert "systemctl" not in r.stdout and "journalctl" not in r.stdout
    assert "read kernel buffer failed: Operation not permitted" in r.stderr and "dmesg=1" in out
    assert "sys-ro" in out and "Read-only file system" in r.stderr
    nvidia_functions = h.ssh(["sh", "-c", "grep -l 0x10de /sys/bus/pci/devices/*/vendor | wc -l"]).stdout
    assert int(nvidia_functions) >= 8  # sysfs: every NVIDIA function of the host
    assert out[-2] == "4", r.stdout  # nvidia-smi: the GPUs this container was given
    assert sum("-m sglang.launch_server" in p and p.startswith("python3") for p in processes(h)) == 4


#: PID 1 of a rented container: `sleep infinity`, tini (Docker's --init, a tini ENTRYPOINT), supervisord
INITS = ("sleep", "tini", "supervisord")


@pytest.mark.parametrize("init", INITS[1:])
def test_rented_container_under_tini_or_supervisord(lab: Any, init: str) -> None:
    """PID 1 is tini (its one child `sleep infinity`) or supervisord (sshd its program); no systemd."""
    h = lab.host(
        shape_variants.rented_container(init=init), name=_name(f"pid1{init[:3]}"), data_scale="small"
    )
    r = h.ssh(
        "cat /proc/1/comm; tr '\\0' ' ' </proc/1/cmdline; echo; command -v systemctl; ps -o args= --ppid 1"
    )
    comm, cmdline, *children = r.stdout.splitlines()
    assert comm == init, r.stdout
    if init == "tini":
        assert cmdline.endswith("/usr/bin/tini -- sleep infinity "), cmdline
        assert "sleep infinity" in children
    else:
        assert cmdline.endswith("/usr/bin/supervisord -n -c /etc/supervisor/supervisord.conf "), cmdline
        assert any(c.startswith("sshd: /usr/sbin/sshd -D -f /etc/ssh/sshd_config") for c in children), (
            children
        )
    assert not any("systemctl" in c for c in children)
    # the servers started by hand with nohup were reparented to PID 1
    assert sum("-m sglang.launch_server" in c and c.startswith("python3") for c in children) == 4, children


@pytest.mark.parametrize("init", INITS)
def test_rented_container_health_has_no_failure_of_its_own_blindness(
    lab: Any, tmp_path: Path, init: str
) -> None:
    h = lab.host(shape_variants.rented_container(init=init), name=_name(f"cth{init[:3]}"), data_scale="small")
    assert _state_dir(h) == ""
    summary = run_health_suite(h, tmp_path)
    cells = summary["hosts"][h.name]["checks"]
    blind = {c for c, cell in cells.items() if cell["outcome"] == "cannot see"}
    assert blind == BLIND_ON_A_CONTAINER, cells
    failed = {c: cell["summary"] for c, cell in cells.items() if cell["outcome"] in ("failed", "would fix")}
    assert not set(failed) & BLIND_ON_A_CONTAINER, failed
    assert "kernel log" not in " ".join(failed.values()) and "systemctl" not in " ".join(failed.values())
    # its GPUs are the four it was given; the host's other four are not this node's
    gc = cells["gpu_count"]
    assert gc["outcome"] == "passed" and "not this node's" in gc["summary"], gc
    assert "fallen off the bus" not in str(gc)
    # persistence is the host's: a failure there offers no fix that cannot work in a container
    pm = cells["persistence_mode"]
    if pm["outcome"] != "passed":
        assert pm["outcome"] == "failed" and "set persistence mode on its host" in str(pm["reasons"]), pm
    assert summary["hosts"][h.name]["cannot_see"] == len(BLIND_ON_A_CONTAINER)
    assert _state_dir(h) == ""  # --check-only wrote nothing on the node


@pytest.mark.parametrize("init", INITS)
def test_rented_container_decommission_is_safe_and_byte_exact(
    lab: Any, s3_endpoint: Any, tmp_path: Path, init: str
) -> None:
    h = lab.host(shape_variants.rented_container(init=init), name=_name(f"ctd{init[:3]}"), data_scale="small")
    bucket = s3_endpoint.make_bucket("ctdecom")
    dest = tmp_path / "backup"
    env = {**os.environ, **s3_endpoint.env}
    argv = suite_argv(h, dest, bucket, "ct", s3_endpoint.url, tmp_path / "reports")
    rc, out, counts = run_suite(argv, env)
    assert rc == 0 and counts.get("failed", 0) == 0, out
    after = processes(h)
    assert not any("sglang.launch_server" in p and p.startswith("python3") for p in after), after
    assert "sleep infinity" in after or init == "supervisord"  # PID 1 (or tini's child): never the run's
    if init != "sleep":  # PID 1 reaps what it was given: the stopped servers are gone, not zombies
        assert h.ssh("cat /proc/1/comm").stdout.strip() == init
        assert not any("<defunct>" in p for p in after), after
    if init == "supervisord":  # its program is left running
        assert any(p.startswith("sshd: /usr/sbin/sshd -D -f /etc/ssh/sshd_config") for p in after), after
    assert "vim /data/sglang_notes.md" in after
    hashes = node_hashes(h)
    check_local(dest, hashes, complete=True)
    check_s3(s3_endpoint.client(), bucket, "ct", dest, hashes)
    assert "Not safe to terminate" not in (dest / "NOTES.md").read_text()


def test_idle_gpus_pass_pcie_link_and_switch_to_full_speed_under_load(lab: Any, tmp_path: Path) -> None:
    h = lab.host(shape_variants.idle_gpus(), name=_name("idle"))
    query = "nvidia-smi --query-gpu=pstate,pcie.link.gen.current --format=csv,noheader"
    assert h.ssh(query).stdout.split("\n")[:4] == ["P0, 5", "P0, 5", "P8, 1", "P8, 1"]
    assert h.ssh(["cat", "/sys/bus/pci/devices/0000:24:00.0/current_link_speed"]).stdout.strip() == (
        shape_variants.IDLE_SPEED
    )
    cells = run_health_suite(h, tmp_path)["hosts"][h.name]["checks"]
    link = cells["pcie_link"]
    assert link["outcome"] == "passed" and "generation not judged on 2 idle GPU(s)" in link["summary"], link
    # work starts on GPU 3: nvidia-smi and sysfs both say P0 at the link's full generation
    holder = subprocess.Popen(
        [*h.ssh_argv(), "exec 3</dev/nvidia3; echo held; sleep 30"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert h.ssh(query).stdout.split("\n")[3] == "P0, 5"
        assert h.ssh(["cat", "/sys/bus/pci/devices/0000:24:00.0/current_link_speed"]).stdout.strip() == (
            "32.0 GT/s PCIe"
        )
    finally:
        holder.kill()
        holder.wait()


def test_a_host_without_the_driver_is_one_line_and_p2p_refuses_at_its_plan(lab: Any, tmp_path: Path) -> None:
    h = lab.host(shape_variants.no_driver(), name=_name("nodrv"))
    summary = run_health_suite(h, tmp_path)
    cells = summary["hosts"][h.name]["checks"]
    failed = {
        c: cell["summary"]
        for c, cell in cells.items()
        if cell["outcome"] != "passed" and cell["outcome"] != "skipped"
    }
    assert list(failed) == ["gpu_count"] and failed["gpu_count"].startswith("no NVIDIA driver on this host")
    # the other GPU checks stand aside with the same words, not "nvidia-smi: command not found"
    others = [cell for c, cell in cells.items() if c != "gpu_count"]
    assert not any("nvidia-smi" in str(cell.get("summary")) for cell in others)
    # suites/p2p: refused at step 1, every later step blocked, nothing stopped or written
    before, state = processes(h), _state_dir(h)
    argv = [
        sys.executable, "-m", "pytest", "suites/p2p", *h.pytest_args(), "--check-only", "-p", "no:cacheprovider",
        f"--report-dir={tmp_path / 'p2p'}", "-o", "addopts=", "-rA",
    ]  # fmt: skip
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150, check=False)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "refusing to act: no NVIDIA driver on this host" in r.stdout
    assert "PASSED" not in r.stdout and "1 failed, 8 skipped" in r.stdout, r.stdout[-3000:]
    assert "sglang-qwen" not in r.stdout
    assert processes(h) == before or set(processes(h)) - set(before) <= {"ps -eo args="}
    assert _state_dir(h) == state  # no lock, no journal


@pytest.mark.parametrize(
    ("shape", "suites"),
    [
        ("rented_container", ("health", "p2p", "decommission")),
        ("rented_container:tini", ("health", "p2p", "decommission")),
        ("rented_container:supervisord", ("health", "p2p", "decommission")),
        ("idle_gpus", ("health", "p2p")),
        ("no_driver", ("health", "p2p")),
        *[(f"node_python:{py}", ("health", "p2p")) for py in python_variants.SHAPES if py != "system"],
    ],
)
def test_check_only_writes_nothing_on_any_shape(
    lab: Any, s3_endpoint: Any, tmp_path: Path, shape: str, suites: tuple[str, ...]
) -> None:
    """Every suite's --check-only leaves each shape's node as it was (tests/helpers/snapshot.py)."""
    make, _, arg = shape.partition(":")
    if make == "node_python":  # the node's Python: the agent's, or the channel-per-command fallback
        why = labpy.missing(arg)
        if why:
            pytest.skip(why)
        profile = python_variants.node_python_profile(arg)
    else:
        profile = getattr(shape_variants, make)(**({"init": arg} if arg else {}))
    short = "".join(c for c in arg if c.isalnum())[:5]
    h = lab.host(profile, name=_name("co" + make.replace("_", "")[:5] + short), data_scale="small")
    env = {**os.environ, **s3_endpoint.env, "GPUHOST_CONTROLLER_STATE_DIR": str(tmp_path / "state")}
    bucket = s3_endpoint.make_bucket("coshape")
    extra = {
        "health": [],
        "p2p": ["--stop-timeout=3"],
        "decommission": [
            f"--manifest={REPO / 'fixtures' / 'manifests' / 'b200-node-backup.yaml'}",
            f"--backup-dir={tmp_path / 'backup'}",
            f"--backup-to=s3://{bucket}/node",
            f"--s3-endpoint={s3_endpoint.url}",
        ],
    }
    before = settled_snapshot(h)
    for suite in suites:
        argv = [
            sys.executable, "-m", "pytest", str(REPO / "suites" / suite), *h.pytest_args(), "--check-only",
            f"--report-dir={tmp_path / suite}", "-p", "no:cacheprovider", "-q", *extra[suite],
        ]  # fmt: skip
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert "Traceback" not in r.stdout + r.stderr, (suite, (r.stdout + r.stderr)[-3000:])
        changed = diff(before, host_snapshot(h))
        assert changed == [], (suite, "\n".join(changed[:60]), r.stdout[-2000:])
    assert not (tmp_path / "backup").exists() or not any((tmp_path / "backup").rglob("*.jsonl"))
