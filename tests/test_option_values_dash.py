"""An option value that starts with '-' is a value or a one-line refusal, never an option of systemctl.

`--service=-Hhost` once reached `systemctl show ... -Hhost.service`, which systemctl reads as
`--host=host.service` (it would have managed another machine's units over SSH). Now the value is
refused at configure time, a unit name with a leading '-' is refused by `Service`, and every
systemctl command passes `--` before its unit names (getopt stops reading options there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.results import CommandResult
from pytest_gpuhost.modules.process import stop_processes
from pytest_gpuhost.modules.service import Service

ROOT = Path(__file__).resolve().parents[1]


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
