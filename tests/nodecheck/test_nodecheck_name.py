"""`local://` is named after the node: its host name made safe, or --node-name.

The host name is set for real: each run goes into a UTS namespace of its own (`unshare --uts`,
root only) whose host name the test chooses, a hostile one included, and the plugin reads it with
gethostname() as on any node. tests/conftest.py pins GPUHOST_NODE_NAME=local for the other tests;
here it is removed.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.inventory.names import valid_host_name
from pytest_gpuhost.exec.nodename import ENV, check_node_name, local_node_name, safe_host_name
from pytest_gpuhost.exec.targets import parse_host_url

REPO = Path(__file__).resolve().parents[2]


def _uts_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = str(REPO)
    return env


def in_uts(hostname: str, argv: list[str], cwd: Path | str = REPO) -> subprocess.CompletedProcess[str]:
    """Run argv in a new UTS namespace whose host name is `hostname` (no GPUHOST_NODE_NAME)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give a process a host name of its own")
    # sethostname(2) takes any bytes up to 64 (hostname(1) would refuse the hostile ones)
    script = "import os, socket, sys; socket.sethostname(sys.argv[1]); os.execvp(sys.argv[2], sys.argv[2:])"
    return subprocess.run(
        ["unshare", "--uts", sys.executable, "-c", script, hostname, *argv],
        cwd=cwd,
        env=_uts_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# ---- the name, pure ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpu-node-07", "node7.dc1", "n_1", "10.0.0.7"])
def test_plain_host_names_are_used_as_they_are(name: str) -> None:
    assert safe_host_name(name) == name


@pytest.mark.parametrize(
    "raw",
    [
        "<img src=x onerror=alert(1)>",
        'node"} 1\ngpuhost_check_ok{host="x',
        "-rf",
        "a b",
        "ünïcode-node",
        "x" * 70,
        "../../etc",
        "",
        "...",
        "host.",
    ],
)
def test_hostile_host_names_become_valid_distinct_names(raw: str) -> None:
    safe = safe_host_name(raw)
    assert valid_host_name(safe) and not safe.endswith("."), safe
    assert safe != raw and re.search(r"-[0-9a-f]{8}$", safe), safe
    assert safe_host_name(raw + " ") != safe  # two raw names, two target names


def test_explicit_names_are_checked_with_one_line() -> None:
    assert check_node_name(" gpu-01 ") == "gpu-01"
    for bad in ("a b", "<b>", "", "x/y", "-rf"):
        with pytest.raises(TargetError, match=r"^--node-name=.* is not a host name: use letters"):
            check_node_name(bad)


def test_flag_then_environment_then_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.delenv(ENV, raising=False)
    assert parse_host_url("local://").name == safe_host_name(socket.gethostname())
    assert parse_host_url("local://", node_name="gpu-03").name == "gpu-03"
    monkeypatch.setenv(ENV, "from-env")
    assert local_node_name() == "from-env" and parse_host_url("local://?sudo=1").name == "from-env"
    assert parse_host_url("local://", node_name="gpu-03").name == "gpu-03"
    assert parse_host_url("local://", name="inventory-name").name == "inventory-name"
    monkeypatch.setenv(ENV, "a<b")
    with pytest.raises(TargetError, match=r"^\$GPUHOST_NODE_NAME='a<b' is not a host name"):
        parse_host_url("local://")


# ---- the host name a process really has -------------------------------------------------------


def test_the_name_is_the_host_name_gethostname_gives() -> None:
    code = "from pytest_gpuhost.exec.targets import parse_host_url; print(parse_host_url('local://').name)"
    for hostname in ("gpu-node-07", "<b>bold</b>"):
        r = in_uts(hostname, [sys.executable, "-c", code])
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == safe_host_name(hostname)
    assert in_uts("<b>bold</b>", [sys.executable, "-c", code]).stdout.strip().startswith("b-bold-b-")


SUITE = """
def test_ok(target):
    assert target.name == target.conn.name

def test_bad(target):
    assert False, "it broke"
"""


def run_suite(tmp: Path, hostname: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp / "test_named.py").write_text(SUITE)
    (tmp / "conftest.py").write_text("")
    prom = tmp / "gpuhost.prom"
    argv = [
        sys.executable, "-m", "pytest", "test_named.py", "-p", "no:cacheprovider", "--host=local://",
        "--report-name=named", f"--prometheus-textfile={prom}", "-o", "addopts=", *args,
    ]  # fmt: skip
    return in_uts(hostname, argv, cwd=tmp)


@pytest.mark.parametrize(
    ("hostname", "flag", "expected"),
    [
        ("gpu-node-07", None, "gpu-node-07"),
        ("gpu-node-07", "--node-name=n-12.rack3", "n-12.rack3"),
        ('x"}<svg/onload=alert(7)>', None, safe_host_name('x"}<svg/onload=alert(7)>')),
    ],
)
def test_every_output_names_the_node(tmp_path: Path, hostname: str, flag: str | None, expected: str) -> None:
    r = run_suite(tmp_path, hostname, *([flag] if flag else []))
    assert r.returncode == 1, r.stdout + r.stderr  # one test fails on purpose
    reports = tmp_path / "reports"
    fleet = json.loads((reports / "fleet-summary.json").read_text())
    assert list(fleet["hosts"]) == [expected]
    assert fleet["hosts"][expected]["checks"]["bad"]["outcome"] == "failed"
    data = json.loads((reports / "named.json").read_text())
    assert {t["target"] for t in data["tests"]} == {expected}
    page = (reports / "named.html").read_text()
    matrix = html.unescape(page[page.index('id="gpuhost-matrix"') :].split("</table>", 1)[0])
    assert f"<th>{expected}</th>" in matrix or f">{expected}<" in matrix, matrix[:2000]
    if "<" in hostname:
        assert "<svg" not in page and "alert(7)" not in page and "alert(7)" not in r.stdout
    prom = (tmp_path / "gpuhost.prom").read_text()
    assert f'gpuhost_check_ok{{host="{expected}",check="ok"}} 1' in prom, prom
    assert f'gpuhost_check_ok{{host="{expected}",check="bad"}} 0' in prom, prom
    assert f"[{expected}]" in r.stdout  # the test ids, in the terminal


def test_a_bad_node_name_is_a_usage_error(tmp_path: Path) -> None:
    r = run_suite(tmp_path, "gpu-node-07", "--node-name=a b")
    assert r.returncode == 4, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [
        "ERROR: gpuhost: --node-name='a b': not a host name: use letters, digits, '_', '-' and dots (e.g. gpu-07)"
    ], r.stderr
