"""The merge at fleet scale: a page that stays usable at hundreds of hosts, the same redaction,
the same result whatever order the summaries load in. Speed is measured by
benchmarks/bench_merge.py (quoted in docs/fleet.md), not asserted here.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost import merge
from pytest_gpuhost.redact import redact_obj
from pytest_gpuhost.report.summary import NAMES_SHOWN, summary_lines

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_merge import make_nodes  # noqa: E402  (benchmarks/, a script directory)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """300 node summaries made from the real lab ones (benchmarks/merge_nodes)."""
    d = tmp_path_factory.mktemp("nodes")
    return d, make_nodes(300, d)


def test_the_merged_page_puts_hosts_not_ok_first_and_folds_the_healthy(
    fleet: tuple[Path, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, counts = fleet
    bad = 300 - counts["b200-ok.json"]
    out = tmp_path / "fleet.html"
    assert merge.main([str(nodes), "-o", str(out)]) == 1
    page = out.read_text()
    merged = json.loads(out.with_suffix(".json").read_text())
    not_ok = sorted(h for h, v in merged["hosts"].items() if v["status"] != "ok")
    assert len(not_ok) == bad and len(merged["hosts"]) == 300
    # The matrix of hosts not ok comes first, with every cell's reasons; then the healthy, folded.
    matrix, healthy = (
        page.split("<table id='matrix'>")[1].split("</table>")[0],
        page.split("<details id='healthy'>")[1],
    )
    assert re.findall(r"data-host='([^']+)'", matrix) == not_ok
    assert f"<h2>Hosts not ok: {bad}</h2>" in page
    assert f"<summary>Healthy hosts: {300 - bad} " in page  # no ' open': 300 hosts is over OPEN_HEALTHY_MAX
    assert len(re.findall(r"<tr data-host=", healthy)) == 300 - bad
    xid_host = next(h for h in not_ok if merged["hosts"][h]["checks"]["xid"]["outcome"] == "failed")
    row = re.search(rf"<tr data-host='{xid_host}'>.*?</tr>", matrix, re.S)
    assert (
        row
        and "data-check='xid' data-outcome='failed'" in row.group(0)
        and "code 79 (action: reboot)" in row.group(0)
    )
    # Healthy rows carry no per-cell tooltip for passed cells: the page stays small.
    assert "title=" not in re.sub(r"<td class='s' title='[^']*'>", "", healthy.split("</details>")[0])
    # The per-check table counts the failures of each check across the fleet.
    checks = page.split("<table id='checks'>")[1].split("</table>")[0]
    assert re.search(rf"<tr><td>xid</td><td class='f'>{counts['b200-xid.json']}</td>", checks), checks
    # One rack on another driver: the most common version is counted, the other's hosts named.
    assert (
        "driver_version: <b>NOT uniform</b>: 570.133.20 on " in page and "570.124.06 on gpu-node-0225" in page
    )
    text = capsys.readouterr().out
    (line,) = [x for x in text.splitlines() if x.startswith("driver_version:")]
    assert line.count("gpu-node-") <= 3 * NAMES_SHOWN  # not every host of the fleet in the terminal
    assert f"on {300 - 32 - counts['pcie-degraded.json']} hosts: " in text


def test_a_small_merge_shows_the_healthy_hosts_open(tmp_path: Path) -> None:
    make_nodes(5, tmp_path / "n")
    out = tmp_path / "f.html"
    merge.main([str(tmp_path / "n"), "-o", str(out)])
    assert "<details id='healthy' open>" in out.read_text()


def test_names_in_the_terminal_summary_are_bounded() -> None:
    hosts = {
        f"h{i:03d}": {"status": "failed", "checks": {"xid": {"outcome": "failed", "summary": "x"}}}
        for i in range(80)
    }
    versions = {"1.0": [f"h{i:03d}" for i in range(70)], "2.0": [f"h{i:03d}" for i in range(70, 80)]}
    lines = summary_lines(
        {
            "hosts": hosts,
            "checks": ["xid"],
            "fleet": {"driver_version": {"uniform": False, "versions": versions}},
        }
    )
    assert sum(1 for line in lines if line.endswith("xid: failed: x")) == 50
    assert "  ... and 30 more hosts not ok (every one is in the report)" in lines
    (uni,) = [line for line in lines if line.startswith("driver_version")]
    shown = ", ".join(f"h{i:03d}" for i in range(NAMES_SHOWN))
    assert (
        uni
        == f"driver_version: NOT uniform across the fleet: 1.0 on 70 hosts: {shown} and 62 more; 2.0 on 10 hosts: "
        + ", ".join(f"h{i:03d}" for i in range(70, 70 + NAMES_SHOWN))
        + " and 2 more"
    )


HOSTILE: list[Any] = [
    "password=hunter2",
    {
        "AWS_SECRET_ACCESS_KEY": "abc",
        "token": "x",
        "nested": [{"api_key": "k", "n": 3}, ("t", "--password p")],
    },
    {"summary": "curl -u admin:s3cret http://x", 5: "key", "x": None, "b": True, "f": 1.5},
    ["ghp_" + "a" * 36, "Bearer abc.def.ghi", {"secret": 7}],
]


@pytest.mark.parametrize("obj", HOSTILE)
def test_the_merge_redacts_as_redact_obj_does(obj: Any) -> None:
    assert merge.redact_merged(obj) == redact_obj(obj)


def test_redaction_of_real_summaries_is_the_same(fleet: tuple[Path, dict[str, int]]) -> None:
    nodes, _ = fleet
    summaries = merge.load_sources([str(nodes)])
    m = merge.merge(summaries)
    m["hosts"]["gpu-node-0001"]["checks"]["xid"]["reasons"] = ["password=hunter2 in a kernel line"]
    assert merge.redact_merged(m) == redact_obj(m)
    assert "hunter2" not in json.dumps(merge.redact_merged(m))


def test_summaries_load_in_the_order_named_and_a_missing_one_is_named(
    fleet: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    nodes, _ = fleet
    files = sorted(str(p) for p in nodes.glob("*.json"))
    got = merge.load_sources(list(reversed(files)))
    assert [src for src, _ in got] == list(reversed(files))
    with pytest.raises(merge.MergeError, match=r"^.*gpu-node-9999\.json: No such file or directory$"):
        merge.load_sources([*files[:10], str(nodes / "gpu-node-9999.json")])


def test_above_the_matrix_limit_healthy_hosts_are_names_only(
    fleet: tuple[Path, dict[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes, counts = fleet
    monkeypatch.setattr(merge, "HEALTHY_MATRIX_MAX", 100)
    page = merge.render_html(merge.redact_merged(merge.merge(merge.load_sources([str(nodes)]))))
    healthy = page.split("<details id='healthy'>")[1].split("</details>")[0]
    assert (
        "<table" not in healthy
        and len(re.findall(r"<span data-host='gpu-node-\d+'>", healthy)) == counts["b200-ok.json"]
    )
    assert "<table id='matrix'>" in page  # the hosts not ok keep their matrix
