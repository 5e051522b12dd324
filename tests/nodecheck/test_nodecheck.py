"""gpuhost-nodecheck without Slurm: the drain rules (scontrol output parsed), options, the budget.

The scontrol text is what Slurm 22.05's `scontrol show node` printed for a lab node (captured from
the lab's real slurmctld, 2026-12-01; src/api/node_info.c, slurm_sprint_node_table), with the
state and reason put in; tests/nodecheck/test_nodecheck_slurm_lab.py runs the real thing. The budget tests run the real program on this machine with stand-in tools
first on PATH that are slow for real: an nvidia-smi that sleeps, a python3 that never starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_gpuhost import nodecheck as cli
from pytest_gpuhost.modules import slurm
from pytest_gpuhost.modules.health import fast as nc

REPO = Path(__file__).resolve().parents[2]

SHOW = """NodeName={name} Arch=x86_64 CoresPerSocket=1 
   CPUAlloc=0 CPUEfctv=1 CPUTot=1 CPULoad=20.40
   AvailableFeatures=(null)
   ActiveFeatures=(null)
   Gres=(null)
   NodeAddr=198.18.48.2 NodeHostName={name} Version=22.05.8
   OS=Linux 6.18.44-fc-v857 #1 SMP PREEMPT_DYNAMIC @0 
   RealMemory=100 AllocMem=0 FreeMem=16712 Sockets=1 Boards=1
   State={state} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=gpu 
   BootTime=2026-12-01T12:18:32 SlurmdStartTime=2026-12-01T12:50:01
   LastBusyTime=2026-12-01T12:50:01
   CfgTRES=cpu=1,mem=100M,billing=1
   AllocTRES=
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
{reason}
"""  # noqa: W291 - scontrol's own trailing spaces


def show(state: str, reason: str | None = None, name: str = "gpu-node-01") -> str:
    line = f"   Reason={reason} [root@2026-12-01T12:50:02]" if reason is not None else ""
    return SHOW.format(name=name, state=state, reason=line)


# ---- scontrol show node --------------------------------------------------------------------------


def test_parse_state_flags_and_reason_without_its_stamp() -> None:
    n = slurm.parse_show_node(show("MIXED+DRAIN", "gpuhost: xid: Xid 79 on 0000:13:00 [x]"), "gpu-node-01")
    assert (n.base, n.flags, n.drained, n.ours) == ("MIXED", {"DRAIN"}, True, True)
    assert n.reason == "gpuhost: xid: Xid 79 on 0000:13:00 [x]" and n.stamp == "root@2026-12-01T12:50:02"
    idle = slurm.parse_show_node(show("IDLE"), "gpu-node-01")
    assert (idle.drained, idle.ours, idle.reason) == (False, False, "")
    down = slurm.parse_show_node(show("DOWN+DRAIN+NOT_RESPONDING", "maintenance"), "gpu-node-01")
    assert down.drained and not down.ours and down.flags == {"DRAIN", "NOT_RESPONDING"}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Node gpu-node-01 not found\n",
        show("IDLE", name="gpu-node-02"),
        "NodeName=gpu-node-01 Arch=x86_64\n",
    ],
)
def test_anything_but_the_nodes_record_is_an_error(text: str) -> None:
    with pytest.raises(
        slurm.SlurmError, match=r"^scontrol show node gpu-node-01: expected NodeName=gpu-node-01"
    ):
        slurm.parse_show_node(text, "gpu-node-01")


# ---- the rules -----------------------------------------------------------------------------------

FAIL = "xid: Xid 79 on 0000:13:00: NVRM: Xid (PCI:0000:13:00): 79, GPU has fallen off the bus."


def node(state: str, reason: str | None = None) -> slurm.NodeState:
    return slurm.parse_show_node(show(state, reason), "gpu-node-01")


def test_unhealthy_and_not_drained_is_drained_with_the_gpuhost_reason() -> None:
    p = slurm.plan(node("IDLE"), FAIL)
    assert p.action == "drain" and p.argv == (
        "scontrol",
        "update",
        "NodeName=gpu-node-01",
        "State=DRAIN",
        "Reason=gpuhost: " + FAIL,
    )


def test_a_person_s_drain_is_never_touched() -> None:
    for state in ("IDLE+DRAIN", "MIXED+DRAIN", "DOWN+DRAIN"):
        assert slurm.plan(node(state, "maintenance"), FAIL).argv == ()  # no new reason
        assert slurm.plan(node(state, "maintenance"), None).argv == ()  # no resume
        assert slurm.plan(node(state, "gpuhost maintenance"), None).argv == ()  # the prefix has its colon
    assert slurm.plan(node("IDLE+FAIL", "bad dimm"), FAIL).action == "keep"


def test_gpuhost_drains_are_resumed_when_healthy_and_updated_when_the_failure_changes() -> None:
    ours = "gpuhost: " + FAIL
    p = slurm.plan(node("IDLE+DRAIN", ours), None)
    assert p.action == "resume" and p.argv == ("scontrol", "update", "NodeName=gpu-node-01", "State=RESUME")
    assert slurm.plan(node("IDLE+DRAIN", ours), FAIL).action == "keep"  # same reason: nothing to do
    changed = slurm.plan(node("IDLE+DRAIN", ours), "pcie_link: GPU 2 x8 (max x16)")
    assert changed.action == "drain" and changed.argv[-1] == "Reason=gpuhost: pcie_link: GPU 2 x8 (max x16)"
    assert slurm.plan(node("IDLE"), None).action == "keep"


def test_reasons_are_one_printable_line_bounded_and_redacted() -> None:
    r = slurm.reason_for("xid: a\nb\x1b[2J\tc password=hunter2 " + "x" * 500)
    assert r.startswith("gpuhost: xid: a b [2J c ") and len(r) == slurm.MAX_REASON and r.endswith("...")
    assert "hunter2" not in r and all(" " <= ch <= "~" for ch in r)


@pytest.mark.parametrize("bad", ["a,b", "node[1-3]", "a b", "", "-x", "n=1", "x" * 80])
def test_node_names_that_would_name_other_nodes_are_refused(bad: str) -> None:
    with pytest.raises(slurm.SlurmError, match="is not one plain node name"):
        slurm.plan(slurm.NodeState(bad, "IDLE"), FAIL)


# ---- options -------------------------------------------------------------------------------------


def config(argv: list[str], env: dict[str, str] | None = None) -> cli.Config:
    ap = cli._parser()
    return cli.load_config(ap.parse_args(argv), env or {})


def test_flags_win_over_environment_over_file(tmp_path: Path) -> None:
    f = tmp_path / "nodecheck.yaml"
    f.write_text(
        "budget: 7\nslurm_drain: yes\nchecks: [xid, sxid]\nnode_name: from-file\nvars: {gpu_count: 8}\n"
    )
    c = config(["--config", str(f)])
    assert (c.budget, c.slurm_drain, c.checks, c.node_name, c.vars) == (
        7,
        True,
        ["xid", "sxid"],
        "from-file",
        {"gpu_count": 8},
    )
    env = {"GPUHOST_NODECHECK_BUDGET": "5", "GPUHOST_NODECHECK_CHECKS": "ecc", "SLURMD_NODENAME": "gpu-09"}
    c = config(["--config", str(f)], env)
    assert (c.budget, c.checks, c.node_name, c.node_name_from) == (5, ["ecc"], "gpu-09", "$SLURMD_NODENAME")
    c = config(["--config", str(f), "--budget=3", "--checks=temperature", "--node-name=gpu-10"], env)
    assert (c.budget, c.checks, c.node_name) == (3, ["temperature"], "gpu-10")
    env = {"GPUHOST_NODECHECK_CONFIG": str(f), "GPUHOST_NODECHECK_SLURM_DRAIN": "0"}
    assert config([], env).slurm_drain is False and config([], env).budget == 7


def test_defaults_leave_the_nightly_only_checks_out() -> None:
    c = config([], {"GPUHOST_NODECHECK_CONFIG": "", "SLURMD_NODENAME": "n1"})
    assert c.budget == 10 and not c.slurm_drain and c.node_name == "n1"
    assert "xid" in c.checks and "pcie_link" in c.checks and not set(c.checks) & nc.NIGHTLY_ONLY


@pytest.mark.parametrize(
    ("argv", "env", "file", "message"),
    [
        (["--budget=abc"], {}, None, "--budget='abc' is not a number of seconds; give e.g. 10"),
        (["--budget=0.1"], {}, None, "--budget='0.1': give at least 1 second (the default is 10)"),
        (["--budget=nan"], {}, None, "--budget='nan': give at least 1 second (the default is 10)"),
        (
            ["--checks=xid,reboot"],
            {},
            None,
            "--checks='xid,reboot': unknown check 'reboot'; choose from gpu_count",
        ),
        (
            [],
            {"GPUHOST_NODECHECK_SLURM_DRAIN": "maybe"},
            None,
            "$GPUHOST_NODECHECK_SLURM_DRAIN='maybe': give 1 or 0",
        ),
        ([], {"SLURMD_NODENAME": "a,b"}, None, "$SLURMD_NODENAME='a,b' is not a host name"),
        (["--node-name=<b>"], {}, None, "--node-name='<b>' is not a host name"),
        ([], {}, "budget: 5\nbogus: 1\n", "unknown key 'bogus'; known: budget, slurm_drain"),
        ([], {}, "- a\n- b\n", "expected a mapping of budget"),
        ([], {}, "budget: [\n", "configuration file"),
        ([], {}, "vars: {gpu_count: many}\n", "vars: inventory variable gpu_count='many': expected int"),
    ],
)
def test_bad_input_is_one_line_naming_the_value(
    tmp_path: Path, argv: list[str], env: dict[str, str], file: str | None, message: str
) -> None:
    if file is not None:
        (tmp_path / "c.yaml").write_text(file)
        argv = [*argv, f"--config={tmp_path / 'c.yaml'}"]
    with pytest.raises(cli.UsageError) as exc:
        config(argv, env)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_missing_explicit_file_is_an_error_the_default_one_is_optional(tmp_path: Path) -> None:
    with pytest.raises(cli.UsageError, match=r"configuration file /nonexistent.yaml: no such file"):
        config(["--config=/nonexistent.yaml"])
    assert config([], {}).source in ("", cli.DEFAULT_CONFIG)


# ---- the real program, with slow tools -----------------------------------------------------------


def tool(bindir: Path, name: str, body: str) -> None:
    p = bindir / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(0o755)


def run(
    tmp: Path, bindir: Path, *args: str, timeout: float = 60, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the real program here, `bindir` first on PATH; no configuration file (the default is ignored)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUHOST_NODECHECK", "SLURMD_"))}
    env.update(PATH=f"{bindir}:{os.environ['PATH']}", PYTHONPATH=str(REPO), GPUHOST_NODE_NAME="nc-test")
    (tmp / "empty.yaml").write_text("")
    env["GPUHOST_NODECHECK_CONFIG"] = str(tmp / "empty.yaml")  # never this machine's /etc/gpuhost
    env.update(extra_env or {})
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pytest_gpuhost.nodecheck", *args],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    return r, time.monotonic() - t0


def test_usage_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    r, _ = run(tmp_path, tmp_path, "--budget=x")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "gpuhost-nodecheck: --budget='x' is not a number of seconds; give e.g. 10"
    ]
    r, _ = run(tmp_path, tmp_path, "--bogus")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "gpuhost-nodecheck: unrecognized arguments: --bogus"
    ]


def test_a_hanging_nvidia_smi_is_cut_and_named_within_the_budget(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool(bindir, "nvidia-smi", "exec sleep 60\n")  # never answers, as on a GPU that fell off the bus
    r, took = run(tmp_path, bindir, "--budget=6", "--checks=gpu_count,persistence_mode,disk_free")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "gpu_count: nvidia-smi --query-gpu timed out", r.stdout
    assert lines[1] == "persistence_mode: nvidia-smi --query-gpu timed out", r.stdout
    assert lines[-1].startswith(
        "gpuhost-nodecheck: nc-test unhealthy (2 failure(s)): 3 of 3 checks judged in "
    )
    # The budget counts from the program's start and the program leaves at once after it; the
    # margin is this machine's load (several sessions' tests share 2 cores, load averages of 40).
    assert took < 7, took


def test_a_probe_that_never_answers_is_cut_at_the_budget_and_the_overrun_fails(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool(bindir, "python3", "exec sleep 60\n")  # the agent never starts: no fact comes back
    r, took = run(tmp_path, bindir, "--budget=2", "--checks=xid,disk_free")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("xid: did not finish within the 2 s budget (health_kernel_log: "), lines
    assert lines[1].startswith("disk_free: did not finish within the 2 s budget (health: "), lines
    assert lines[2] == "budget: xid, disk_free did not finish within 2 s", lines
    assert lines[-1].startswith(
        "gpuhost-nodecheck: nc-test unhealthy (3 failure(s)): 0 of 2 checks judged in "
    )
    assert took < 3, took


def test_slurm_drain_without_a_reachable_slurm_says_so_and_keeps_the_budget(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool(bindir, "nvidia-smi", "exit 9\n")
    tool(bindir, "scontrol", "exec sleep 60\n")  # slurmctld does not answer
    r, took = run(tmp_path, bindir, "--budget=8", "--checks=gpu_count", "--slurm-drain")
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0] == "gpu_count: nvidia-smi --query-gpu exited 9", lines
    assert lines[1].startswith("slurm: scontrol show node timed out after "), lines
    assert took < 9, took


def test_started_at_counts_the_interpreter_start() -> None:
    """The budget's origin is the process start: time spent before main() counts."""
    code = (
        "import time; time.sleep(1.5); from pytest_gpuhost.nodecheck import started_at; "
        "print(time.monotonic() - started_at())"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert 1.5 <= float(r.stdout) < 30, r.stdout


def test_the_console_script_is_the_program() -> None:
    """pyproject.toml's [project.scripts] entry resolves to the function that runs the program."""
    import importlib
    import re

    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    m = re.search(r'^gpuhost-nodecheck = "([\w.]+):(\w+)"$', section, re.M)
    assert m is not None, section
    module, func = m.groups()
    assert getattr(importlib.import_module(module), func) is cli.run


def test_the_kernel_log_is_read_and_its_cursor_moved_only_when_xid_is_judged(tmp_path: Path) -> None:
    assert "kernel_log" not in nc.parts_for(["ecc", "disk_free"])
    assert "kernel_log" in nc.parts_for(["sxid"]) and "kernel_log" in nc.parts_for(nc.default_checks())
    state = tmp_path / "state"
    env_state = {"GPUHOST_STATE_DIR": str(state)}
    r, _ = run(tmp_path, tmp_path, "--checks=disk_free", extra_env=env_state)
    assert r.returncode == 0 and not (state / nc.STATE_FILE).exists(), r.stdout + r.stderr
    r, _ = run(tmp_path, tmp_path, "--checks=xid", extra_env=env_state)
    if "kernel log unreadable" in r.stdout:
        pytest.skip(f"dmesg cannot read this machine's kernel log: {r.stdout.splitlines()[0]}")
    assert r.returncode == 0 and (state / nc.STATE_FILE).is_file(), r.stdout + r.stderr
    assert not (state / "health-state.json").exists()  # the nightly run's cursor is not touched
