"""The service's own NCCL settings, found where they are set and unset only when asked (lab, real SSH).

Container 101 of the proxmox-rtx6000 lab host runs sglang-qwen.service under its own systemd:
the EnvironmentFile=, the manager's environment, UnsetEnvironment= and /proc/PID/environ are the
real ones. The lab's SGLang stand-in logs ``via SHM`` when NCCL_P2P_DISABLE reads as 1 in its
environment, as NCCL would. One host for the module, repaired once; each scenario configures the
unit, runs the suite, and puts the unit back as the lab made it.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.p2p.test_p2p_suite import CUT_PLUGIN, run_suite

STEP = "test_p2p_collective"
CT = 101
UNIT = "sglang-qwen.service"
ENVFILE = "/etc/default/sglang-test"
SETUP = f"/etc/systemd/system/{UNIT}.d/gpuhost-test-env.conf"  # the operator's own drop-in
OURS = f"/etc/systemd/system/{UNIT}.d/gpuhost-p2p-env.conf"
OPT = "--p2p-unset-service-env"


@pytest.fixture(scope="module")
def host(lab: Any) -> Any:
    """The proxmox-rtx6000 lab host (the session's)."""
    return lab.host("proxmox-rtx6000")


def ct(host: Any, script: str, input: str | None = None) -> str:
    r = host.ssh(["sh", "-c", script], cid=CT, input=input, timeout=60)
    assert r.returncode == 0, (script, r.stdout, r.stderr)
    return str(r.stdout)


def main_pid(host: Any) -> int:
    return int(ct(host, f"systemctl show -p MainPID --value {UNIT}").strip() or 0)


def main_environ(host: Any) -> dict[str, str]:
    """The service's main process's environment, as the kernel has it."""
    pid = main_pid(host)
    assert pid, "the service is not running"
    data = ct(host, f"tr '\\0' '\\n' < /proc/{pid}/environ")
    return dict(line.split("=", 1) for line in data.splitlines() if "=" in line)


def restart(host: Any) -> None:
    """Reload and start the service again (the lab's server ignores SIGTERM: killed, not stopped)."""
    ct(
        host,
        f"systemctl daemon-reload && systemctl kill -s SIGKILL --kill-whom=all {UNIT}; "
        f"while systemctl is-active -q {UNIT}; do sleep 0.2; done; "
        f"systemctl reset-failed {UNIT} 2>/dev/null; systemctl start {UNIT}",
    )
    deadline = time.monotonic() + 30
    while not main_pid(host) and time.monotonic() < deadline:
        time.sleep(0.5)


def configure(host: Any, dropin: str, envfile: str | None = None, manager_env: str = "") -> None:
    """The operator's settings: a drop-in, an environment file, the manager's environment; restarted."""
    if envfile is not None:
        ct(host, f"mkdir -p /etc/default && cat > {ENVFILE}", input=envfile)
    ct(host, f"mkdir -p {Path(SETUP).parent} && cat > {SETUP}", input=dropin)
    if manager_env:
        ct(host, f"systemctl set-environment {shlex.quote(manager_env)}")
    restart(host)


def put_back(host: Any) -> None:
    ct(host, f"rm -f {SETUP} {OURS} {ENVFILE}; systemctl unset-environment NCCL_P2P_DISABLE")
    restart(host)


def message(run: Any, step: str = STEP) -> str:
    """The step's failure message and its notes (a passed step has only notes)."""
    notes = run.evidence(step).get("notes", [])
    return "\n".join([str(run.tests[step].get("message") or ""), *map(str, notes)])


def dropin_there(host: Any) -> bool:
    return host.ssh(["test", "-e", OURS], cid=CT).returncode == 0


@pytest.fixture(scope="module")
def repaired(host: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The host after one repair run: the collective proves P2P from here on."""
    host.reset()
    first = run_suite(host, tmp_path_factory.mktemp("env-repair"))
    assert first.rc == 0, first.output[-3000:]
    yield host
    put_back(host)


@pytest.fixture
def clean(repaired: Any) -> Iterator[Any]:
    """Each scenario starts and ends with the unit as the lab made it."""
    yield repaired
    put_back(repaired)


ENV_FILE_DROPIN = f"[Service]\nEnvironmentFile=-{ENVFILE}\n"
ENV_FILE_TEXT = "# set after the NCCL hang\nNCCL_DEBUG=INFO\nNCCL_P2P_DISABLE='1'\n"


def test_environment_file_is_reported_with_where_and_nothing_changes(clean: Any, tmp_path: Path) -> None:
    """NCCL_P2P_DISABLE=1 in an EnvironmentFile=: reported with the file and the PID; without the option, nothing changes."""
    host = clean
    configure(host, ENV_FILE_DROPIN, ENV_FILE_TEXT)
    pid = main_pid(host)
    assert main_environ(host).get("NCCL_P2P_DISABLE") == "1"
    run = run_suite(host, tmp_path)
    assert run.outcomes[STEP] == "passed", run.outcomes
    # the service really is on SHM: step 9 says so, and names the setting and the option
    assert run.outcomes["test_service_restored"] == "failed", run.outcomes
    restored = message(run, "test_service_restored")
    assert "NCCL transport is SHM/direct/direct, not P2P (NCCL_P2P_DISABLE=1 in" in restored, restored
    assert "--p2p-unset-service-env" in restored, restored
    text = message(run)
    assert f"NCCL_P2P_DISABLE=1 in EnvironmentFile={ENVFILE}" in text, text
    assert f"NCCL_P2P_DISABLE=1 in the environment of PID {pid} ({UNIT})" in text, text
    assert "after the repair it would still use SHM" in text, text
    assert not dropin_there(host)
    assert main_pid(host) == pid  # not restarted
    assert main_environ(host).get("NCCL_P2P_DISABLE") == "1"


def test_process_environment_and_custom_all_reduce_flag_are_reported(clean: Any, tmp_path: Path) -> None:
    """Set by the manager (not the unit): found in /proc/PID/environ; --disable-custom-all-reduce named as what it is."""
    host = clean
    exec_start = ct(host, f"systemctl show -p ExecStart {UNIT}")
    argv = exec_start.split("argv[]=", 1)[1].split(" ; ", 1)[0]
    dropin = f"[Service]\nExecStart=\nExecStart={argv} --disable-custom-all-reduce\n"
    configure(host, dropin, manager_env="NCCL_P2P_DISABLE=1")
    pid = main_pid(host)
    run = run_suite(host, tmp_path, "--check-only")
    text = message(run)
    assert f"NCCL_P2P_DISABLE=1 in the environment of PID {pid} ({UNIT})" in text, text
    assert "EnvironmentFile=" not in text and "in the Environment= of" not in text, text
    assert f"--disable-custom-all-reduce in the command line of PID {pid} ({UNIT})" in text, text
    assert "not NCCL P2P" in text, text
    assert run.outcomes[STEP] == "passed", run.outcomes
    assert not dropin_there(host)


def test_option_unsets_the_names_and_the_next_run_finds_nothing(clean: Any, tmp_path: Path) -> None:
    """With the option: the drop-in is written, the service restarted without the name; the next run finds nothing."""
    host = clean
    configure(host, ENV_FILE_DROPIN, ENV_FILE_TEXT)
    old = main_pid(host)
    run = run_suite(host, tmp_path, OPT)
    assert run.rc == 0, run.output[-3000:]
    assert run.outcomes[STEP] == "fixed", (run.outcomes, message(run))
    assert run.outcomes["test_service_restored"] == "fixed", run.outcomes
    text = ct(host, f"cat {OURS}")
    assert "[Service]\nUnsetEnvironment=NCCL_P2P_DISABLE\n" in text, text
    new = main_pid(host)
    assert new and new != old
    env = main_environ(host)
    assert "NCCL_P2P_DISABLE" not in env and env.get("NCCL_DEBUG") == "INFO", env
    again = run_suite(host, tmp_path, OPT)
    assert again.rc == 0, again.output[-3000:]
    assert again.outcomes[STEP] == "passed", again.outcomes
    assert "disables P2P itself" not in message(again) and "EnvironmentFile" not in message(again), message(
        again
    )
    assert main_pid(host) == new  # nothing left to do: not restarted again


def test_option_does_not_unset_when_the_collective_fails(clean: Any, tmp_path: Path) -> None:
    """A collective that hangs proves nothing: the names stay set, no drop-in, the service is not restarted."""
    host = clean
    configure(host, ENV_FILE_DROPIN, ENV_FILE_TEXT)
    pid = main_pid(host)
    ct_host = host.ssh(
        ["sh", "-c", "cat > /var/lib/gpulab/faults.json"], input=json.dumps({"nccl_hang": True})
    )
    assert ct_host.returncode == 0, ct_host.stderr
    try:
        run = run_suite(host, tmp_path, OPT, "--p2p-nccl-timeout=5")
    finally:
        host.ssh(["sh", "-c", "cat > /var/lib/gpulab/faults.json"], input="{}")
    assert run.outcomes[STEP] == "failed", run.outcomes
    assert "unset only once the collective proves P2P" in message(run), message(run)
    assert not dropin_there(host)
    assert main_pid(host) == pid
    assert main_environ(host).get("NCCL_P2P_DISABLE") == "1"


def cut_after_dropin_write(host: Any, tmp_path: Path) -> Any:
    """A run with the option whose link is cut right after it wrote the drop-in; the link healed after."""
    try:
        cut = run_suite(
            host,
            tmp_path,
            OPT,
            plugin=CUT_PLUGIN,
            env={"P2P_CUT_AT": Path(OURS).name, "P2P_CUT_HOST": host.name},
        )
    finally:
        host.heal_link()
    deadline = time.monotonic() + 20
    while host.ssh("true").returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "CUT after:" in cut.output, cut.output[-3000:]
    assert cut.rc != 0
    assert dropin_there(host)  # the undo could not run: the journal on the host says what was written
    print(f"cut run: {cut.seconds:.1f} s")
    return cut


def test_cut_after_the_dropin_is_completed_by_a_run_with_the_option(clean: Any, tmp_path: Path) -> None:
    """The next run with the option keeps the drop-in and starts the service without the name."""
    host = clean
    configure(host, ENV_FILE_DROPIN, ENV_FILE_TEXT)
    cut_after_dropin_write(host, tmp_path)
    again = run_suite(host, tmp_path, OPT, "--p2p-lock-wait=60")
    print(f"completing run: {again.seconds:.1f} s")
    assert again.rc == 0, again.output[-4000:]
    assert dropin_there(host)
    assert "NCCL_P2P_DISABLE" not in main_environ(host)


def test_cut_after_the_dropin_is_put_back_by_a_run_without_the_option(clean: Any, tmp_path: Path) -> None:
    """The next run without the option puts the unit back as it was: no drop-in, the name set again."""
    host = clean
    configure(host, ENV_FILE_DROPIN, ENV_FILE_TEXT)
    cut_after_dropin_write(host, tmp_path)
    again = run_suite(host, tmp_path, "--p2p-lock-wait=60")
    assert not dropin_there(host)
    assert "put back" in message(again, "test_plan"), message(again, "test_plan")
    assert main_environ(host).get("NCCL_P2P_DISABLE") == "1"


def test_check_only_with_the_option_plans_the_dropin_and_changes_nothing(clean: Any, tmp_path: Path) -> None:
    """--check-only with the option: "would fix", the drop-in and the restart listed; nothing written, nothing restarted."""
    host = clean
    configure(host, ENV_FILE_DROPIN, ENV_FILE_TEXT)
    pid = main_pid(host)
    run = run_suite(host, tmp_path, OPT, "--check-only")
    assert run.outcomes[STEP] == "would fix", run.outcomes
    planned = json.dumps(run.tests[STEP].get("remediations"))
    assert f"write {OURS}: [Service] UnsetEnvironment=NCCL_P2P_DISABLE" in planned, planned
    assert f"systemctl start {UNIT}" in planned, planned
    assert not dropin_there(host)
    assert main_pid(host) == pid
