"""Drain and resume in a real Slurm (gpulab/slurm/cluster.py): gpuhost-nodecheck --slurm-drain and --fix=drain.

Three lab hosts are the nodes of a real slurmctld/slurmd (Debian 12's Slurm 22.05): gpu-node-01
gets Xid 79 (NVIDIA's catalogue: reboot), gpu-node-02 a GPU whose cells read [GPU requires reset],
gpu-node-03 is healthy but drained by a person (reason "maintenance"). The node program runs
inside each node as slurmd would run it (SLURM_CONF set, the host name is the node name); the
suite runs from this machine over SSH with --fix=drain, scontrol running on each node. Both must
drain exactly the failed nodes with gpuhost reasons, resume them once healed (a reboot for the
Xid, the fault cleared for the other) and never touch the hand-drained node.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.health.test_health_lab_gpus import inject

REPO = Path(__file__).resolve().parents[2]
PY = str(REPO / ".venv" / "bin" / "python")
XID = "NVRM: Xid (PCI:0000:13:00): 79, pid=2231, name=python3, GPU has fallen off the bus."


def link_conf(c: Any) -> None:
    """Put the cluster's slurm.conf at Debian's default path inside every node.

    scontrol over SSH (and under slurmd's HealthCheckProgram) reads /etc/slurm/slurm.conf; the link
    lives in each host's own overlay root: this machine's /etc is not touched.
    """
    for h in c.nodes.values():
        r = h.exec(["sh", "-c", f"mkdir -p /etc/slurm && ln -sf {c.conf} /etc/slurm/slurm.conf"])
        assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def cluster(slurm: Any) -> Any:
    c = slurm.cluster(["health-ok", "health-ok", "health-ok"], tag="nck")
    link_conf(c)
    return c


def nodecheck(c: Any, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return c.node_exec(c.nodes[name], [PY, "-m", "pytest_gpuhost.nodecheck", *args], timeout=60)


def add_xid(h: Any) -> None:
    after_boot = max(k.t for k in h.profile.kernel_log) + 1.0
    r = h.ssh(
        ["sh", "-c", "cat >> /var/lib/gpulab/kmsg"], input=json.dumps({"t": after_boot, "msg": XID}) + "\n"
    )
    assert r.returncode == 0, r.stderr


def reboot(c: Any, h: Any) -> None:
    """Reboot the node (the kernel log starts over, the lab draws a new boot id) and start its slurmd."""
    assert h.ssh(["rm", "-f", "/var/lib/gpulab/kmsg"]).returncode == 0
    h.reboot()
    r = h.exec(["sh", "-c", f"mkdir -p /etc/slurm && ln -sf {c.conf} /etc/slurm/slurm.conf"])
    assert r.returncode == 0, r.stderr
    c.restart_node(h)


def hand_drain(c: Any, name: str) -> None:
    r = c.run(["scontrol", "update", f"nodename={name}", "state=drain", "reason=maintenance"])
    assert r.returncode == 0, r.stderr


def wait_states(c: Any, want: dict[str, str], timeout: float = 20) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        states = c.node_states()
        if all(states.get(n) == s for n, s in want.items()) or time.monotonic() > deadline:
            return states
        time.sleep(0.3)


def test_nodecheck_drains_failed_nodes_resumes_them_healed_and_leaves_a_hand_drain(cluster: Any) -> None:
    c = cluster
    n1, n2, n3 = "gpu-node-01", "gpu-node-02", "gpu-node-03"
    add_xid(c.nodes[n1])
    inject(c.nodes[n2], {"gpus": {"0000:23:00.0": {"nvml_error": "GPU requires reset"}}})
    hand_drain(c, n3)
    try:
        r1, r2, r3 = (nodecheck(c, n, "--slurm-drain") for n in (n1, n2, n3))
        assert r1.returncode == 1 and r1.stdout.startswith("xid: Xid 79 on 0000:13:00: "), (
            r1.stdout + r1.stderr
        )
        assert f"slurm: drain {n1}: 'gpuhost: xid: Xid 79 on 0000:13:00:" in r1.stdout, r1.stdout
        assert r2.returncode == 1 and r2.stdout.startswith("gpu_count: GPU 2 (0000:23:00.0): "), r2.stdout
        assert r3.returncode == 0, r3.stdout + r3.stderr
        assert (
            f"slurm: nothing to do: {n3} is healthy but drained by someone else ('maintenance')" in r3.stdout
        )
        for r in (r1, r2, r3):
            assert "checks judged in" in r.stdout.splitlines()[-1] and r.stderr == "", r.stdout + r.stderr
        states = wait_states(c, {n1: "drained", n2: "drained", n3: "drained"})
        reasons = c.node_reasons()
        assert states == {n1: "drained", n2: "drained", n3: "drained"}, (states, reasons)
        assert reasons[n1].startswith("gpuhost: xid: Xid 79 on 0000:13:00"), reasons
        assert reasons[n2].startswith("gpuhost: gpu_count: GPU 2 (0000:23:00.0)"), reasons
        assert reasons[n3] == "maintenance", reasons

        # Still failing (the Xid is owed until a reboot): the drain and its reason stay as they are.
        again = nodecheck(c, n1, "--slurm-drain")
        assert again.returncode == 1 and "still needs a reboot" in again.stdout, again.stdout
        assert f"{n1}: " in again.stdout and "slurm: drain again with the new reason" in again.stdout

        # Healed: GPU 2 answers again; gpu-node-01 rebooted. Both are resumed, gpu-node-03 is not.
        inject(c.nodes[n2], {})
        reboot(c, c.nodes[n1])
        r1, r2, r3 = (nodecheck(c, n, "--slurm-drain") for n in (n1, n2, n3))
        assert r1.returncode == 0 and f"slurm: resume {n1}: healthy again" in r1.stdout, r1.stdout + r1.stderr
        assert r2.returncode == 0 and f"slurm: resume {n2}: healthy again" in r2.stdout, r2.stdout + r2.stderr
        assert r3.returncode == 0 and "drained by someone else ('maintenance')" in r3.stdout
        states = wait_states(c, {n1: "idle", n2: "idle"})
        assert states == {n1: "idle", n2: "idle", n3: "drained"}, (states, c.node_reasons())
        assert c.node_reasons() == {n3: "maintenance"}
    finally:
        inject(c.nodes[n2], {})
        c.run(["scontrol", "update", f"nodename={n3}", "state=resume"])


def run_suite(c: Any, tmp: Path, *extra: str, name: str = "night", more_vars: str = "") -> dict[str, Any]:
    known = tmp / "known_hosts"
    known.write_text("".join(Path(h.known_hosts).read_text() for h in c.nodes.values()))
    inv = tmp / "fleet.yaml"
    inv.write_text(
        f"all:\n  vars: {{ansible_user: root{more_vars}}}\n  hosts:\n"
        + "".join(f"    {n}: {{ansible_host: {h.address}}}\n" for n, h in c.nodes.items())
    )
    argv = [
        sys.executable, "-m", "pytest", "suites/health", "-p", "no:cacheprovider", f"--inventory={inv}",
        "--ssh-identity=/run/gpulab/id_ed25519", f"--known-hosts={known}", "--connect-timeout=5",
        f"--report-dir={tmp}", f"--report-name={name}", f"--fleet-json={tmp}/{name}.json", "-o", "addopts=",
        *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "GPUHOST_NODE_NAME"}
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, check=False, env=env)
    path = tmp / f"{name}.json"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads(path.read_text())
    return summary


def test_fix_drain_from_the_controller(cluster: Any, tmp_path: Path) -> None:
    c = cluster
    n1, n2, n3 = "gpu-node-01", "gpu-node-02", "gpu-node-03"
    inject(c.nodes[n2], {"gpus": {"0000:23:00.0": {"nvml_error": "GPU requires reset"}}})
    hand_drain(c, n3)
    try:
        # check-only: "would fix" with the exact scontrol command, nothing changed
        s0 = run_suite(c, tmp_path, "--fix=drain", "--check-only", name="n0")
        d0 = s0["hosts"][n2]["checks"]["drain"]
        assert d0["outcome"] == "would fix" and d0["summary"].startswith(
            f"drain {n2}: 'gpuhost: gpu_count: "
        ), d0
        assert d0["reasons"][0].startswith(
            "gpu_count: GPU 2 (0000:23:00.0): nvidia-smi prints [GPU requires reset]"
        )
        assert d0["state"]["node"] == f"{n2}: IDLE", d0
        assert c.node_states()[n2] == "idle"
        assert s0["hosts"][n1]["checks"]["drain"]["outcome"] == "passed"

        s1 = run_suite(c, tmp_path, "--fix=drain", name="n1")
        cells = {n: s1["hosts"][n]["checks"]["drain"] for n in (n1, n2, n3)}
        assert cells[n1]["outcome"] == "passed", cells
        assert cells[n2]["outcome"] == "fixed", cells
        assert cells[n3]["outcome"] == "passed", cells  # a person's drain: nothing to do
        assert (
            cells[n3]["summary"]
            == f"{n3} is healthy but drained by someone else ('maintenance'): left drained"
        )
        states = wait_states(c, {n2: "drained"})
        reasons = c.node_reasons()
        assert states == {n1: "idle", n2: "drained", n3: "drained"}, (states, reasons)
        assert reasons[n2].startswith("gpuhost: gpu_count: GPU 2 (0000:23:00.0)"), reasons
        assert reasons[n3] == "maintenance"

        inject(c.nodes[n2], {})
        s2 = run_suite(c, tmp_path, "--fix=drain", name="n2")
        assert s2["hosts"][n2]["checks"]["drain"]["outcome"] == "fixed", s2["hosts"][n2]["checks"]["drain"]
        states = wait_states(c, {n2: "idle"})
        assert states == {n1: "idle", n2: "idle", n3: "drained"}, (states, c.node_reasons())
        assert c.node_reasons() == {n3: "maintenance"}
        # without --fix=drain there is no drain step at all
        s3 = run_suite(c, tmp_path, name="n3")
        assert "drain" not in s3["hosts"][n1]["checks"]
    finally:
        inject(c.nodes[n2], {})
        c.run(["scontrol", "update", f"nodename={n3}", "state=resume"])


def test_fix_reset_drains_resets_and_resumes_only_the_drain_it_made(cluster: Any, tmp_path: Path) -> None:
    """--fix=drain --fix=reset: drained, reset, confirmed, resumed in one run; others left drained."""
    c = cluster
    n1, n2, n3 = "gpu-node-01", "gpu-node-02", "gpu-node-03"
    bus = "0000:14:00.0"
    asks = {"nvml_error": "GPU requires reset"}  # fails gpu_count; a reset clears it
    inject(c.nodes[n1], {"gpus": {bus: asks}})
    inject(c.nodes[n2], {"gpus": {bus: {**asks, "reset_sticks": True}}})
    inject(c.nodes[n3], {"gpus": {bus: asks}})
    hand_drain(c, n3)
    try:
        s = run_suite(
            c, tmp_path, "--fix=drain", "--fix=reset", "-o", "health_reset_verify_timeout=3",
            name="reset", more_vars=", service: sglang-qwen, service_port: 30000",
        )  # fmt: skip
        cells = {n: s["hosts"][n]["checks"] for n in (n1, n2, n3)}
        report = html.unescape(html.unescape((tmp_path / "reset.html").read_text()))  # JSON in HTML
        # n1: drained by this run, reset, confirmed, resumed by this run
        assert cells[n1]["drain"]["outcome"] == "fixed", cells[n1]["drain"]
        assert cells[n1]["reset"]["outcome"] == "fixed", cells[n1]["reset"]
        assert f"node resumed (this run drained it): now {n1}: IDLE" in report
        # n2: the reset did not clear: left drained, with the reason, in the step's one line
        assert cells[n2]["reset"]["outcome"] == "failed", cells[n2]["reset"]
        assert (
            f"reset did not clear GPU {bus} (NVML says [GPU requires reset]); reboot not allowed "
            "(--fix=reset,reboot allows it); node left drained ('gpuhost: "
        ) in report
        # n3: a person's drain: reset, and left drained
        assert cells[n3]["drain"]["outcome"] == "passed", cells[n3]["drain"]
        assert cells[n3]["reset"]["outcome"] == "fixed", cells[n3]["reset"]
        assert "node drained by someone else ('maintenance'): left drained" in report
        states = wait_states(c, {n1: "idle", n2: "drained", n3: "drained"})
        assert states == {n1: "idle", n2: "drained", n3: "drained"}, (states, c.node_reasons())
        reasons = c.node_reasons()
        assert reasons[n2].startswith("gpuhost: "), reasons
        assert reasons[n3] == "maintenance", reasons

        # The next run: n2's GPU now resets; its drain is an earlier run's, so it is left for the
        # drain step of the run after, which resumes gpuhost's own drains once healthy.
        inject(c.nodes[n2], {"gpus": {bus: asks}})
        s = run_suite(
            c, tmp_path, "--fix=drain", "--fix=reset", "-o", "health_reset_verify_timeout=3",
            name="again", more_vars=", service: sglang-qwen, service_port: 30000",
        )  # fmt: skip
        again = s["hosts"][n2]["checks"]
        assert again["drain"]["outcome"] == "passed", again["drain"]  # already drained for this
        assert again["reset"]["outcome"] == "fixed", again["reset"]
        report = html.unescape(html.unescape((tmp_path / "again.html").read_text()))
        assert "an earlier run drained it; the next run resumes it once healthy" in report
        assert wait_states(c, {n2: "drained"})[n2] == "drained"
    finally:
        for n in (n1, n2, n3):
            inject(c.nodes[n], {})
        for n in (n2, n3):
            c.run(["scontrol", "update", f"nodename={n}", "state=resume"])


def test_xid_79_drains_reboots_and_resumes_only_the_drain_it_made(cluster: Any, tmp_path: Path) -> None:
    """--fix=drain --fix=reset,reboot with Xid 79 (a reboot's to pay) on a node this run drains and on
    one a person drained: both rebooted and confirmed, the first resumed, the second left drained.

    The nodes' munged and slurmd are enabled units (gpulab/slurm.py), so a rebooted node rejoins
    the cluster by itself and the run resumes it with scontrol on the node, after the boot.
    """
    c = cluster
    n1, n2, n3 = "gpu-node-01", "gpu-node-02", "gpu-node-03"
    for n in (n1, n3):
        add_xid(c.nodes[n])
    hand_drain(c, n3)
    boots = {n: _boot_id(h) for n, h in c.nodes.items()}
    try:
        s = run_suite(
            c, tmp_path, "--fix=drain", "--fix=reset,reboot", "-o", "health_reboot_timeout=60",
            "-o", "health_reset_verify_timeout=3", name="xid79",
            more_vars=", service: sglang-qwen, service_port: 30000",
        )  # fmt: skip
        cells = {n: s["hosts"][n]["checks"] for n in (n1, n2, n3)}
        report = html.unescape(html.unescape((tmp_path / "xid79.html").read_text()))
        # n1: drained with gpuhost's reason, rebooted, confirmed, resumed because this run drained it
        assert cells[n1]["drain"]["outcome"] == "fixed", cells[n1]["drain"]
        assert cells[n1]["drain"]["summary"].startswith(f"drain {n1}: 'gpuhost: xid: Xid 79 on 0000:13:00"), (
            cells[n1]["drain"]
        )
        assert cells[n1]["reset"]["outcome"] == "fixed", cells[n1]["reset"]
        assert f"node resumed (this run drained it): now {n1}: IDLE" in report
        # n3: a person's drain: rebooted and confirmed all the same, and left drained
        assert cells[n3]["drain"]["outcome"] == "passed", cells[n3]["drain"]
        assert cells[n3]["reset"]["outcome"] == "fixed", cells[n3]["reset"]
        assert "node drained by someone else ('maintenance'): left drained" in report
        # n2: nothing owed, nothing done
        assert cells[n2]["reset"]["outcome"] == "passed", cells[n2]["reset"]
        after = {n: _boot_id(h) for n, h in c.nodes.items()}
        assert after[n1] != boots[n1] and after[n3] != boots[n3] and after[n2] == boots[n2]
        states = wait_states(c, {n1: "idle", n2: "idle", n3: "drained"})
        assert states == {n1: "idle", n2: "idle", n3: "drained"}, (states, c.node_reasons())
        assert c.node_reasons() == {n3: "maintenance"}
    finally:
        c.run(["scontrol", "update", f"nodename={n3}", "state=resume"])


def _boot_id(h: Any) -> str:
    return h.ssh(["cat", "/proc/sys/kernel/random/boot_id"]).stdout.strip()


HEALTHCHECK = "/usr/local/sbin/gpuhost-healthcheck"


def wait_for(c: Any, done: Any, timeout: float = 60) -> tuple[dict[str, str], dict[str, str]]:
    deadline = time.monotonic() + timeout
    while True:
        states, reasons = c.node_status()  # one sinfo: states and reasons of the same moment
        if done(states, reasons) or time.monotonic() > deadline:
            return states, reasons
        time.sleep(0.5)


def test_slurmd_runs_it_as_health_check_program_configured_by_file(slurm: Any) -> None:
    """slurm.conf HealthCheckProgram: slurmd runs it with no arguments; the file turns drain on."""
    c = slurm.cluster(
        ["health-ok", "health-ok"],
        tag="nhc",
        extra_conf=[f"HealthCheckProgram={HEALTHCHECK}", "HealthCheckInterval=5", "HealthCheckNodeState=ANY"],
    )
    # slurmd gives the program SLURMD_NODENAME and nothing else (no PATH, no SLURM_CONF): scontrol
    # reads the default /etc/slurm/slurm.conf, as on a real node
    link_conf(c)
    n1, n2 = "gpu-node-01", "gpu-node-02"
    for h in c.nodes.values():
        # docs/nodecheck.md's set-up: the program, no arguments, its options in /etc/gpuhost/nodecheck.yaml
        # (written inside each node's own overlay root)
        script = (
            f"mkdir -p /etc/gpuhost /usr/local/sbin && printf 'slurm_drain: true\\nbudget: 10\\n' > /etc/gpuhost/nodecheck.yaml"
            f" && printf '#!/bin/sh\\nexec {PY} -m pytest_gpuhost.nodecheck\\n' > {HEALTHCHECK} && chmod 755 {HEALTHCHECK}"
        )
        r = h.exec(["sh", "-c", script])
        assert r.returncode == 0, r.stderr
    hand_drain(c, n2)
    inject(c.nodes[n1], {"gpus": {"0000:23:00.0": {"nvml_error": "GPU requires reset"}}})
    try:
        states, reasons = wait_for(c, lambda s, r: r.get(n1, "").startswith("gpuhost:"))
        assert reasons.get(n1, "").startswith("gpuhost: gpu_count: GPU 2 (0000:23:00.0)"), (states, reasons)
        assert states[n1] in ("drained", "draining") and reasons[n2] == "maintenance", (states, reasons)
        inject(c.nodes[n1], {})
        states, reasons = wait_for(c, lambda s, r: s.get(n1) == "idle")
        assert states == {n1: "idle", n2: "drained"} and reasons == {n2: "maintenance"}, (states, reasons)
    finally:
        inject(c.nodes[n1], {})
        c.run(["scontrol", "update", f"nodename={n2}", "state=resume"])


PROLOG = "/usr/local/sbin/gpuhost-prolog"


def test_as_prolog_a_failed_node_runs_no_job_and_only_gpuhost_s_drain_is_resumed(slurm: Any) -> None:
    """slurm.conf Prolog: exit 1 drains the node and requeues the job held (slurm.conf(5)).

    gpu-node-01's prolog runs the program alone: Slurm drains with its own reason ("Prolog error"),
    which gpuhost then never resumes. gpu-node-02's adds --slurm-drain: the gpuhost reason comes
    first and Slurm keeps it, so the node is resumed once healthy.
    """
    c = slurm.cluster(["health-ok", "health-ok"], tag="npl", extra_conf=[f"Prolog={PROLOG}"])
    link_conf(c)
    n1, n2 = "gpu-node-01", "gpu-node-02"
    # the budget bounds a hang, which this test has none of: 20 s keeps the lab's nvidia-smi reads
    # inside it on a machine loaded by another test worker (5 s did not, under -n 2)
    for name, extra in ((n1, ""), (n2, " --slurm-drain")):
        body = f"#!/bin/sh\\nexec {PY} -m pytest_gpuhost.nodecheck --budget=20{extra}\\n"
        r = c.nodes[name].exec(
            ["sh", "-c", f"mkdir -p /usr/local/sbin && printf '{body}' > {PROLOG} && chmod 755 {PROLOG}"]
        )
        assert r.returncode == 0, r.stderr
        inject(c.nodes[name], {"gpus": {"0000:23:00.0": {"nvml_error": "GPU requires reset"}}})
    jobs = []
    try:
        for name in (n1, n2):
            r = c.run(
                ["sbatch", "--parsable", "-w", name, "-o", "/dev/null", "--wrap", "hostname"], timeout=30
            )
            assert r.returncode == 0, r.stderr
            jobs.append(r.stdout.strip().split(";")[0])
        # a node whose prolog failed is "completing" until the job's step is cleaned up, then
        # "drained": wait for the settled state, not only for the reasons
        states, reasons = wait_for(
            c, lambda s, r: n1 in r and n2 in r and s.get(n1) == s.get(n2) == "drained"
        )
        assert states == {n1: "drained", n2: "drained"}, (states, reasons)
        assert reasons[n1] == "Prolog error", reasons
        assert reasons[n2].startswith("gpuhost: gpu_count: GPU 2 (0000:23:00.0)"), reasons
        queue = c.run(["squeue", "-h", "-o", "%i %T %r"]).stdout
        for job in jobs:  # no job ran on a failed node: requeued, held
            assert f"{job} PENDING launch failed requeued held" in queue, queue

        for name in (n1, n2):
            inject(c.nodes[name], {})
        r1, r2 = (nodecheck(c, n, "--slurm-drain") for n in (n1, n2))
        assert r1.returncode == 0 and "drained by someone else ('Prolog error')" in r1.stdout, r1.stdout
        assert r2.returncode == 0 and f"slurm: resume {n2}: healthy again" in r2.stdout, r2.stdout
        states, reasons = wait_for(c, lambda s, r: s.get(n2) != "drained")
        assert states[n1] == "drained" and reasons == {n1: "Prolog error"}, (states, reasons)
    finally:
        for name in (n1, n2):
            inject(c.nodes[name], {})
        if jobs:
            c.run(["scancel", *jobs])
        c.run(["scontrol", "update", f"nodename={n1},{n2}", "state=resume"])
