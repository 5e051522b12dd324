"""Fleet outputs: --limit, the controller's summary, Prometheus textfile, comparison, merge (S3 too)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost import merge
from pytest_gpuhost.report import fleet
from pytest_gpuhost.report.files import object_name

REPO = Path(__file__).resolve().parents[2]

INVENTORY = """\
all:
  vars: {ansible_connection: local}
  children:
    rack1:
      hosts:
        gpu-01: {}
        gpu-02: {}
    rack2:
      hosts:
        gpu-03: {}
        gpu-04: {}
"""

# A conftest like suites/conftest.py: the health suite's options (--previous, --prometheus-textfile).
CONFTEST = """\
from suites.health import options

def pytest_addoption(parser):
    options.addoption(parser)

def pytest_configure(config):
    options.validate(config)
"""

CHECKS = """\
import os

def _bad(target, check):
    return f"{target.name}:{check}" in os.environ.get("BAD", "").split(",")

def test_alpha(target):
    assert not _bad(target, "alpha"), "alpha broke"

def test_beta(target, request):
    request.node.user_properties.append(("gpuhost_verdict", {"summary": "beta summary", "reasons": ["r1"], "state": {"driver_version": "570." + ("1" if target.name == "gpu-04" else "0")}}))
    request.node.user_properties.append(("gpuhost_check", "driver_version"))
    assert not _bad(target, "beta"), "beta broke"
"""


@pytest.fixture
def fleet_dir(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makefile(".yaml", fleet=INVENTORY)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_checks=CHECKS)
    return pytester


def test_limit_selects_hosts_by_name_and_group(fleet_dir: pytest.Pytester) -> None:
    r = fleet_dir.runpytest("--inventory=fleet.yaml", "--limit", "rack2 or gpu-01", "--report-dir=none", "-v")
    r.assert_outcomes(passed=6)
    r.stdout.fnmatch_lines(["*test_alpha?gpu-01?*", "*test_alpha?gpu-03?*"])
    r.stdout.no_fnmatch_line("*gpu-02*")
    r = fleet_dir.runpytest("--inventory=fleet.yaml", "--limit", "rack1 and", "--report-dir=none")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--limit='rack1 and': expression ends early*"])
    r = fleet_dir.runpytest("--inventory=fleet.yaml", "--limit", "rack9", "--report-dir=none")
    r.stderr.fnmatch_lines(["*--limit='rack9': 'rack9' matches no host or group of the 4 targets*"])
    r = fleet_dir.runpytest(
        "--inventory=fleet.yaml", "--limit", "rack1:!gpu-02,gpu-03", "--report-dir=none", "-v"
    )
    r.assert_outcomes(passed=4)
    r.stdout.no_fnmatch_line("*gpu-02*")


def test_summary_prometheus_and_comparison_with_the_previous_run(
    fleet_dir: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = fleet_dir.path
    monkeypatch.setenv("BAD", "gpu-02:alpha")
    r = fleet_dir.runpytest_subprocess(
        "--inventory=fleet.yaml",
        "-n",
        "2",
        "--report-dir=none",
        f"--fleet-json={out / 'night1.json'}",
        "-p",
        "no:cacheprovider",
    )
    r.assert_outcomes(passed=7, failed=1)
    night1 = json.loads((out / "night1.json").read_text())
    assert night1["format"] == fleet.FORMAT and night1["checks"] == ["alpha", "driver_version"]
    assert night1["hosts"]["gpu-02"]["status"] == "failed"
    assert night1["hosts"]["gpu-02"]["checks"]["alpha"]["summary"].startswith("AssertionError: alpha broke")
    assert night1["hosts"]["gpu-01"]["checks"]["driver_version"]["reasons"] == ["r1"]
    assert night1["fleet"]["driver_version"] == {
        "uniform": False,
        "versions": {"570.0": ["gpu-01", "gpu-02", "gpu-03"], "570.1": ["gpu-04"]},
    }
    r.stdout.fnmatch_lines(
        [
            "*gpuhost fleet*",
            "4 hosts x 2 checks = 8 results: * failed*; hosts: 3 ok, 1 failed",
            "  gpu-02 alpha: failed: *alpha broke*",
            "driver_version: NOT uniform across the fleet: 570.0 on gpu-01, gpu-02, gpu-03; 570.1 on gpu-04",
        ]
    )

    monkeypatch.setenv("BAD", "gpu-03:beta")
    prom = out / "textfile" / "gpuhost.prom"
    prom.parent.mkdir()
    r = fleet_dir.runpytest_subprocess(
        "--inventory=fleet.yaml",
        "-n",
        "2",
        "--report-dir=none",
        f"--fleet-json={out / 'night2.json'}",
        f"--previous={out / 'night1.json'}",
        f"--prometheus-textfile={prom}",
        "-p",
        "no:cacheprovider",
    )
    r.assert_outcomes(passed=7, failed=1)
    r.stdout.fnmatch_lines(
        [
            "since */night1.json: 1 newly failed, 1 recovered",
            "  newly failed: gpu-03 driver_version (was passed): *",
            "  recovered: gpu-02 alpha (was failed)",
        ]
    )
    night2 = json.loads((out / "night2.json").read_text())
    assert [(c["host"], c["check"]) for c in night2["comparison"]["newly_failed"]] == [
        ("gpu-03", "driver_version")
    ]
    text = prom.read_text()
    assert 'gpuhost_check_ok{host="gpu-03",check="driver_version"} 0' in text
    assert 'gpuhost_check_ok{host="gpu-02",check="alpha"} 1' in text
    assert 'gpuhost_host_ok{host="gpu-03"} 0' in text
    assert re.search(r"^gpuhost_last_run_timestamp_seconds \d+\.\d{3}$", text, re.M)
    assert_prometheus_format(text)
    assert not list(prom.parent.glob(".gpuhost-*")), "no temp file left behind"


def test_bad_health_options_are_usage_errors(fleet_dir: pytest.Pytester) -> None:
    r = fleet_dir.runpytest("--fix=reboot", "--report-dir=none")
    r.stderr.fnmatch_lines(["*--fix='reboot': unknown fix; choose from persistence, service*"])
    r = fleet_dir.runpytest("--prometheus-textfile=/tmp/x.txt", "--report-dir=none")
    r.stderr.fnmatch_lines(["*node_exporter reads only *.prom files*"])
    r = fleet_dir.runpytest("--previous=/nonexistent.json", "--report-dir=none")
    r.stderr.fnmatch_lines(["*--previous='/nonexistent.json': no such file*"])


_SAMPLE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})? -?[0-9.eE+]+$'
)


def assert_prometheus_format(text: str) -> None:
    """Check the text exposition format line by line, as node_exporter's parser would."""
    assert text.endswith("\n")
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind == "gauge" and name not in typed
            typed.add(name)
        elif line.startswith("# HELP "):
            continue
        else:
            assert _SAMPLE.match(line), line
            assert line.split("{")[0].split(" ")[0] in typed, f"sample before its TYPE: {line}"


def test_prometheus_escapes_labels() -> None:
    summary = {
        "hosts": {
            'we"ird\\host': {
                "status": "ok",
                "checks": {"c": {"outcome": "passed"}, "s": {"outcome": "skipped"}},
            }
        },
        "run": {"finished": 1.0},
    }
    text = fleet.prometheus_text(summary)
    assert 'gpuhost_check_ok{host="we\\"ird\\\\host",check="c"} 1' in text
    assert 'check="s"' not in text  # skipped: no sample
    assert_prometheus_format(text)


def _summary(node: str, finished: float, hosts: dict[str, dict[str, str]]) -> dict[str, Any]:
    return {
        "format": fleet.FORMAT,
        "run": {"node": node, "finished": finished, "started": finished - 5},
        "checks": ["xid", "pcie_link"],
        "hosts": {
            h: {
                "status": fleet.host_status({c: {"outcome": o} for c, o in cells.items()}),
                "checks": {
                    c: {"outcome": o, "summary": f"{c} {o}", "reasons": [f"why {c}"]}
                    for c, o in cells.items()
                },
            }
            for h, cells in hosts.items()
        },
    }


def test_merge_two_node_summaries_into_one_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = tmp_path / "node1.json"
    b = tmp_path / "node2.json"
    a.write_text(json.dumps(_summary("node1", 100.0, {"node1": {"xid": "passed", "pcie_link": "passed"}})))
    b.write_text(json.dumps(_summary("node2", 101.0, {"node2": {"xid": "failed", "pcie_link": "passed"}})))
    out = tmp_path / "fleet.html"
    assert merge.main([str(a), str(b), "-o", str(out)]) == 1  # node2 failed: CI can gate on it
    html = out.read_text()
    assert "<table id='matrix'>" in html and "data-host='node1'" in html and "data-host='node2'" in html
    assert "data-check='xid' data-outcome='failed'" in html and "why xid" in html
    merged = json.loads((tmp_path / "fleet.json").read_text())
    assert list(merged["hosts"]) == ["node1", "node2"] and [
        s["node"] for s in merged["run"]["merged_from"]
    ] == ["node1", "node2"]
    assert "merged 2 summaries" in capsys.readouterr().out
    (tmp_path / "junk.json").write_text("{}")
    assert merge.main([str(tmp_path / "junk.json"), "-o", str(out)]) == 2
    assert "not a pytest-gpuhost fleet summary" in capsys.readouterr().err


def test_nodes_write_to_s3_and_merge_reads_the_prefix(
    s3_endpoint: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    bucket = s3_endpoint.make_bucket("fleet")
    prefix = f"s3://{bucket}/nightly/2026-11-30/"
    fleet.write_summary(
        _summary("node1", 100.0, {"node1": {"xid": "passed", "pcie_link": "passed"}}), prefix + "node1.json"
    )
    fleet.write_summary(
        _summary("node2", 101.0, {"node2": {"xid": "passed", "pcie_link": "passed"}}), prefix + "node2.json"
    )
    out = tmp_path / "fleet.html"
    assert merge.main([prefix, "-o", str(out), "--endpoint-url", s3_endpoint.url]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["hosts"].keys() == {"node1", "node2"}


def test_example_inventories_agree_and_their_thresholds_load() -> None:
    from pytest_gpuhost.exec.inventory.load import load_inventory
    from pytest_gpuhost.modules.health.checks import Thresholds

    yaml_hosts = load_inventory(str(REPO / "fixtures/inventories/fleet.yaml"))
    ini_hosts = load_inventory(str(REPO / "fixtures/inventories/fleet.ini"))
    assert (
        [h.name for h in yaml_hosts] == [h.name for h in ini_hosts] == [f"gpu-node-0{i}" for i in range(1, 5)]
    )
    for y, i in zip(yaml_hosts, ini_hosts, strict=True):
        assert (y.url, y.vars["groups"]) == (i.url, i.vars["groups"])
        assert Thresholds.from_vars(y.vars).values == Thresholds.from_vars(i.vars).values
    t = Thresholds.from_vars(yaml_hosts[3].vars).values
    assert (t["pcie_width_min"], t["temperature_max"], t["gpu_model"]) == (8, 85, "RTX PRO 6000")
    assert Thresholds.from_vars(yaml_hosts[0].vars)["temperature_max"] == 83


def test_docs_list_every_threshold_with_its_default() -> None:
    from pytest_gpuhost.modules.health.checks import CHECKS, THRESHOLDS

    doc = (REPO / "docs/fleet.md").read_text()
    for t in THRESHOLDS:
        assert f"| `{t.name}` |" in doc, t.name
    for c in CHECKS:
        assert f"`{c}`" in doc, c


def test_prometheus_carries_the_xid_action_each_host_owes() -> None:
    """Xid 48 this run and an owed reboot (Xid 79) on gpu-01; nothing on gpu-02; no xid cell on gpu-03."""
    xid = {
        "outcome": "failed",
        "state": {
            "action": "reboot",
            "events": [{"code": 48, "action": "reset_gpu"}, {"code": 94, "action": "restart_app"}],
            "owed": [{"code": 79, "action": "reboot"}],
        },
    }
    summary = {
        "hosts": {
            "gpu-01": {"status": "failed", "checks": {"xid": xid}},
            "gpu-02": {"status": "ok", "checks": {"xid": {"outcome": "passed", "state": {"action": "none"}}}},
            "gpu-03": {"status": "ok", "checks": {"gpu_count": {"outcome": "passed"}}},
        },
        "run": {"finished": 1.0},
    }
    text = fleet.prometheus_text(summary)
    assert_prometheus_format(text)
    for action, n in (("reset_gpu", 1), ("reboot", 1), ("restart_app", 1), ("none", 0), ("check_fabric", 0)):
        assert f'gpuhost_xid_action{{host="gpu-01",action="{action}"}} {n}\n' in text
    assert 'gpuhost_xid_action{host="gpu-02",action="reboot"} 0\n' in text
    assert 'gpuhost_xid_action_owed{host="gpu-01",action="reboot"} 1\n' in text
    assert 'gpuhost_xid_action_owed{host="gpu-02",action="none"} 1\n' in text
    assert not [ln for ln in text.splitlines() if ln.startswith("gpuhost_xid") and 'host="gpu-03"' in ln]


# ----------------------------------------------------------------------
# The object a per-node run writes under a shared s3:// prefix is named after its node, safely.


def test_one_host_run_is_named_after_that_host() -> None:
    assert object_name({"hosts": {"gpu-07": {}}}) == "gpu-07"


@pytest.mark.parametrize("raw", ["../etc", "a/b", "<img src=x>", "..", "x" * 300, "n\u00e9ud"])
def test_hostile_names_become_one_safe_component(raw: str) -> None:
    name = object_name({"hosts": {raw: {}}})
    assert "/" not in name and name not in (".", "..") and "<" not in name and len(name) < 256
    assert object_name({"hosts": {raw + "!": {}}}) != name  # two different names never share a key


def test_fleet_run_uses_this_machines_node_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUHOST_NODE_NAME", "ctl-1")
    assert object_name({"hosts": {"a": {}, "b": {}}}) == "ctl-1"
    assert object_name({"hosts": {}}) == "ctl-1"
