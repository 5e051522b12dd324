"""Every gpuhost option: help, ini twin, validation errors naming the value and its source, report paths.

Every usage error reads `gpuhost: SOURCE=VALUE: WHY` (SOURCE the flag, or `ini NAME`; see run/options.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.results import CommandResult
from pytest_gpuhost.modules.process import stop_processes
from pytest_gpuhost.modules.service import Service

OPTIONS = (
    "--host=URL",
    "--container=SPEC",
    "--inventory=PATH",
    "--inventory-reader=auto|ansible|builtin",
    "--check-only",
    "--command-timeout=S",
    "--connect-timeout=S",
    "--ssh-identity=FILE",
    "--known-hosts=FILE",
    "--host-key-policy=*",
    "--sudo",
    "--report-dir=DIR",
    "--report-name=NAME",
)


def test_help_lists_the_gpuhost_group(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["gpuhost: verify and repair GPU hosts:"])
    for opt in OPTIONS:
        result.stdout.fnmatch_lines([f"*{opt}*"])
    for ini in (
        "gpuhost_hosts",
        "gpuhost_check_only",
        "gpuhost_command_timeout",
        "gpuhost_host_key_policy",
        "gpuhost_sudo",
    ):
        result.stdout.fnmatch_lines([f"*{ini} *"])


def test_sudo_exists_without_testinfra(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_sudo(request):\n    assert request.config.option.sudo is True\n")
    pytester.runpytest("-p", "no:testinfra", "--sudo", "--report-dir=none").assert_outcomes(passed=1)
    pytester.runpytest("--sudo", "--report-dir=none").assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--command-timeout=abc"],
            "ERROR: gpuhost: --command-timeout='abc': expected a number of seconds, e.g. 60",
        ),
        (
            ["--connect-timeout=0"],
            "ERROR: gpuhost: --connect-timeout='0': expected a number of seconds greater than 0 *",
        ),
        (
            ["--host-key-policy=yolo"],
            "ERROR: gpuhost: --host-key-policy='yolo': choose one of strict, accept-new",
        ),
        (
            ["--ssh-identity=/nonexistent/id"],
            "ERROR: gpuhost: --ssh-identity='/nonexistent/id': no such file",
        ),
        (
            ["--known-hosts=/nonexistent/kh"],
            "ERROR: gpuhost: --known-hosts='/nonexistent/kh': no such file (*accept-new it is created)",
        ),
        (
            ["--known-hosts=/nonexistent/kh", "--host-key-policy=accept-new"],
            "ERROR: gpuhost: --known-hosts='/nonexistent/kh': directory /nonexistent does not exist",
        ),
        (
            ["--inventory=/nonexistent/fleet.yaml"],
            "ERROR: gpuhost: --inventory='/nonexistent/fleet.yaml': no such file or directory",
        ),
        (["--report-name=a/b"], "ERROR: gpuhost: --report-name='a/b': *(no directories)"),
        (["--host=ftp://x"], "ERROR: gpuhost: --host='ftp://x': *unknown target scheme 'ftp'*"),
        (["--host=ssh://root@host:99999"], "ERROR: gpuhost: --host='ssh://root@host:99999': *port*"),
        (["--host=local://", "--container=pct:abc"], "ERROR: gpuhost: --container='pct:abc': *"),
        (["--host=local://", "--host=local://"], "ERROR: gpuhost: target 'local' is given twice*"),
    ],
)
def test_bad_values_are_usage_errors(pytester: pytest.Pytester, args: list[str], message: str) -> None:
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_ini_twins_are_read_and_named_in_errors(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpuhost_check_only = maybe\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: gpuhost: ini gpuhost_check_only='maybe': expected true or false (from *tox.ini)"]
    )

    pytester.makeini("[pytest]\ngpuhost_sudo = perhaps\n")
    result = pytester.runpytest()
    result.stderr.fnmatch_lines(
        ["ERROR: gpuhost: ini gpuhost_sudo='perhaps': expected true or false (from *)"]
    )

    pytester.makeini(
        "[pytest]\ngpuhost_check_only = true\ngpuhost_command_timeout = 5\ngpuhost_report_dir = none\n"
    )
    pytester.makepyfile(
        """
        from pytest_gpuhost.run.settings import settings_key
        def test_values(check_only, pytestconfig):
            s = pytestconfig.stash[settings_key]
            assert check_only is True and s.command_timeout == 5.0 and s.report_dir is None
            # Resolved values are published on config.option (and so reach xdist workers).
            assert pytestconfig.getoption("gpuhost_check_only") is True
            assert pytestconfig.getoption("gpuhost_command_timeout") == 5.0
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)
    # The command line wins over the ini file.
    result = pytester.runpytest("--command-timeout=x")
    result.stderr.fnmatch_lines(["ERROR: gpuhost: --command-timeout='x': *"])


NO_TARGET = "ERROR: gpuhost: * test(s) need one (first: *); pass --host=URL *or --inventory=PATH"


@pytest.mark.parametrize(
    ("args", "first"),
    [
        ([], "ERROR: gpuhost: no target, and 2 test(s) need one *"),
        (["--inventory=empty.yaml"], "ERROR: gpuhost: --inventory='empty.yaml' lists no host, *"),
        (["--inventory=empty.ini"], "ERROR: gpuhost: --inventory='empty.ini' lists no host, *"),
        (
            ["--host=local://", "--limit=nothing"],
            "ERROR: --limit='nothing': 'nothing' matches no host or group of the 1 targets",
        ),
        (["-n", "2"], "ERROR: gpuhost: no target, and 2 test(s) need one *"),
    ],
)
def test_a_run_without_target_is_a_usage_error(
    pytester: pytest.Pytester, args: list[str], first: str
) -> None:
    pytester.makefile(".yaml", empty="all:\n  hosts: {}\n")
    pytester.makefile(".ini", empty="[gpus]\n")
    pytester.makepyfile(
        """
        def test_needs_host(host): pass
        def test_needs_target(target): pass
        def test_plain(check_only): assert check_only is False
        """
    )
    result = pytester.runpytest_subprocess("--report-dir=none", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([first])
    assert [line for line in result.stderr.lines if line.strip()] == [result.stderr.lines[0]], "one line"
    result.stdout.no_fnmatch_line("*passed*")
    result.stdout.no_fnmatch_line("*skipped*")


def test_without_target_collect_only_and_unrelated_runs_pass(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_gpu="def test_needs_host(host): pass\n", test_other="def test_x(): pass\n")
    result = pytester.runpytest("--report-dir=none", "--co", "-q")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["test_gpu.py::test_needs_host[no-target]", "test_other.py::test_x"])
    pytester.runpytest("--report-dir=none", "test_other.py").assert_outcomes(passed=1)
    # -k deselected every test that needs a target: nothing is refused.
    pytester.runpytest("--report-dir=none", "-k", "test_x").assert_outcomes(passed=1)


def test_testinfra_options_are_aliases(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", fleet="all:\n  hosts:\n    n1: {gpuhost_url: 'local://'}\n")
    pytester.makepyfile(
        """
        def test_t(target, pytestconfig):
            print("URL", target.spec.url, pytestconfig.getoption("gpuhost_ssh_identity"))
        """
    )
    key = pytester.makefile("", id_test="not a key")
    result = pytester.runpytest("-s", "-v", "--report-dir=none", "--hosts=local://,docker://box", "--co")
    result.stdout.fnmatch_lines(["*test_t[[]local[]]*", "*test_t[[]box[]]*"])
    result = pytester.runpytest("-s", "--report-dir=none", "--hosts=local://", f"--ssh-identity-file={key}")
    result.stdout.fnmatch_lines([f"*URL local:// {key}"])
    result.assert_outcomes(passed=1)
    # testinfra's --connection names the scheme of --hosts entries without one.
    result = pytester.runpytest(
        "-v", "--report-dir=none", "--hosts=box1,ssh://u@h2", "--connection=docker", "--co"
    )
    result.stdout.fnmatch_lines(["*test_t[[]box1[]]*", "*test_t[[]h2[]]*"])
    result = pytester.runpytest("-s", "--report-dir=none", "--ansible-inventory=fleet.yaml")
    result.assert_outcomes(passed=1)
    # --ssh-config is one flag shared with testinfra (ssh -F); it reaches the connection options.
    pytester.makefile("", ssh_config_test="Host gpu1\n  HostName 127.0.0.1\n")
    pytester.makepyfile(
        test_cfg="""
        from pytest_gpuhost.run.targets_stash import get_pool
        def test_cfg(target, pytestconfig):
            print("CFG", get_pool(pytestconfig).options.ssh_config, pytestconfig.option.ssh_config)
        """
    )
    result = pytester.runpytest(
        "-s", "--report-dir=none", "--host=local://", "--ssh-config=ssh_config_test", "test_cfg.py"
    )
    result.stdout.fnmatch_lines(["*CFG ssh_config_test ssh_config_test"])
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ssh-config=/nonexistent/ssh_config"], "--ssh-config='/nonexistent/ssh_config': no such file"),
        (["--ssh-extra-args=-v"], "*testinfra's --ssh-extra-args='-v' is not supported: *"),
        (["--sudo-user=bob"], "*testinfra's --sudo-user='bob' is not supported: *--sudo*"),
        (["--force-ansible"], "*testinfra's --force-ansible is not supported: *"),
        (["--nagios"], "*testinfra's --nagios is not supported: *--fleet-json*"),
        (["--connection=ssh"], "*testinfra's --connection='ssh' needs --hosts; *--host=ssh://HOST"),
        (["--host=local://", "--hosts=ssh://other"], "*both --host and testinfra's --hosts='ssh://other'*"),
        (
            ["--ssh-identity-file=/nonexistent"],
            "*testinfra's --ssh-identity-file='/nonexistent': no such file",
        ),
        (
            ["--ansible-inventory=/nonexistent"],
            "*testinfra's --ansible-inventory='/nonexistent': no such file",
        ),
    ],
)
def test_testinfra_options_we_cannot_honour_are_refused(
    pytester: pytest.Pytester, args: list[str], message: str
) -> None:
    pytester.makepyfile("def test_x(): pass\n")
    result = pytester.runpytest("--report-dir=none", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: gpuhost: " + message.lstrip("*")])


def test_targets_hook_filters_and_extends(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        from pytest_gpuhost.exec.targets import parse_host_url
        def pytest_gpuhost_targets(config, targets):
            targets[:] = [t for t in targets if t.name != "drop"]
            targets.append(parse_host_url("local://", name="added"))
        """
    )
    pytester.makepyfile("def test_t(target): assert target.name in ('keep', 'added')\n")
    result = pytester.runpytest("-v", "--report-dir=none", "--host=ssh://keep", "--host=ssh://drop")
    result.stdout.fnmatch_lines(["*test_t?keep? PASSED*", "*test_t?added? PASSED*"])
    result.assert_outcomes(passed=2)


def test_reports_default_names_and_user_paths_win(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mysuite="def test_a(target): pass\n")
    pytester.runpytest("test_mysuite.py", "--host=local://").assert_outcomes(passed=1)
    files = sorted(p.name for p in (pytester.path / "reports").iterdir() if p.name != "fleet-summary.json")
    assert len(files) == 3, files
    stem = files[0].rsplit(".", 1)[0]
    assert stem.startswith("mysuite-") and stem.endswith("Z")
    assert {f.rsplit(".", 1)[1] for f in files} == {"html", "json", "xml"}
    assert json.loads((pytester.path / "reports" / f"{stem}.json").read_text())["summary"] == {"passed": 1}

    result = pytester.runpytest(
        "--host=local://", "--report-dir=out", "--report-name=nightly", "--html=mine.html"
    )
    assert (pytester.path / "mine.html").is_file()
    assert sorted(p.name for p in (pytester.path / "out").iterdir()) == [
        "fleet-summary.json",
        "nightly.json",
        "nightly.xml",
    ]
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([], id="unrelated run"),
        pytest.param(["--host=local://", "test_other.py"], id="target given, not used"),
        pytest.param(["--host=local://", "--co"], id="collect only"),
        pytest.param(["--host=local://", "-p", "xdist", "-n", "2", "test_other.py"], id="xdist, not used"),
        pytest.param(["--host=local://", "nonexistent.py"], id="file not found"),
        pytest.param(["--host=local://", "-k", "nothing"], id="all deselected"),
    ],
)
def test_runs_that_check_no_target_write_no_report(pytester: pytest.Pytester, args: list[str]) -> None:
    pytester.makepyfile(test_gpu="def test_a(target): pass\n", test_other="def test_b(): pass\n")
    result = pytester.runpytest_subprocess(*args)
    assert not (pytester.path / "reports").exists(), result.stdout.str()
    result.stdout.no_fnmatch_line("*gpuhost evidence:*")
    result.stdout.no_fnmatch_line("*Generated html report*")


def test_inventory_targets_and_bad_inventory(pytester: pytest.Pytester) -> None:
    pytester.makefile(
        ".yaml",
        fleet="""
        all:
          children:
            lab:
              vars: {gpuhost_url: "local://", gpu_count: 8}
              hosts:
                node[01:02]: {}
        """,
    )
    pytester.makepyfile("def test_t(target):\n    assert target.vars['gpu_count'] == 8\n")
    result = pytester.runpytest("-v", "--inventory=fleet.yaml", "--report-dir=none")
    result.stdout.fnmatch_lines(["*test_t?node01? PASSED*", "*test_t?node02? PASSED*"])
    pytester.makefile(".yaml", broken="all: [unclosed\n")
    result = pytester.runpytest("--inventory=broken.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: gpuhost: --inventory='broken.yaml': bad inventory: *"])


# ----------------------------------------------------------------------
# An option value that starts with '-' is a value or a one-line refusal, never an option of systemctl.
#
# `--service=-Hhost` once reached `systemctl show ... -Hhost.service`, which systemctl reads as
# `--host=host.service` (it would have managed another machine's units over SSH). Now the value is
# refused at configure time, a unit name with a leading '-' is refused by `Service`, and every
# systemctl command passes `--` before its unit names (getopt stops reading options there).


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", ["-Hhost", "--host=elsewhere", "-H"])
def test_service_value_with_a_dash_is_refused_in_one_line(pytester: pytest.Pytester, value: str) -> None:
    r = pytester.runpytest_subprocess(
        str(ROOT / "suites" / "p2p"),
        "--host=local://",
        f"--service={value}",
        "--co",
        "-p",
        "no:cacheprovider",
    )
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    lines = [ln for ln in r.errlines if ln.strip()]
    assert len(lines) == 1, r.errlines
    assert "--service" in lines[0] and value in lines[0] and "does not start with '-'" in lines[0]
    assert "Traceback" not in "\n".join(r.outlines + r.errlines)


def test_service_flag_followed_by_an_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    """`--service -H host`: argparse does not take '-H' as the value; the run stops before any command."""
    r = pytester.runpytest_subprocess(
        str(ROOT / "suites" / "p2p"),
        "--host=local://",
        "--service",
        "-H",
        "host",
        "--co",
        "-p",
        "no:cacheprovider",
    )
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "--service: expected one argument" in "\n".join(r.errlines)


class _Recorder:
    """A connection that records argv; its unit runs until SIGKILL (so stop goes through every step)."""

    name = "rec"

    def __init__(self) -> None:
        self.argvs: list[list[str]] = []
        self.active = True

    def run(self, argv: Any, **kw: Any) -> CommandResult:
        argv = list(argv)
        self.argvs.append(argv)
        if "SIGKILL" in argv:
            self.active = False
        out = ""
        if "show" in argv:
            state = (
                "ActiveState=active\nSubState=running\nMainPID=5"
                if self.active
                else ("ActiveState=inactive\nSubState=dead\nMainPID=0")
            )
            out = f"LoadState=loaded\n{state}\n"
        return CommandResult("rec", " ".join(argv), 0, out, "", 0.0, 0.0)


def test_service_commands_put_double_dash_before_the_unit() -> None:
    with pytest.raises(ValueError, match="not a systemd unit name: '-Hhost'"):
        Service(_Recorder(), "-Hhost")
    conn = _Recorder()
    svc = Service(conn, "sglang-qwen")
    svc.state()
    svc.stop(stop_timeout=0.3, term_grace=0.3, kill_wait=1)
    svc.start(timeout=5)
    ran = [a for a in conn.argvs if a[0] == "systemctl"]
    verbs = [a[1] for a in ran]
    assert {"show", "stop", "kill", "start"} <= set(verbs), ran
    for argv in ran:
        assert argv[-2:] == ["--", "sglang-qwen.service"], argv
    units: list[list[str]] = []
    stop_processes(conn, [], units=["a.service"], run=units.append)  # type: ignore[arg-type]
    assert units == [["systemctl", "stop", "--no-block", "--", "a.service"]]
