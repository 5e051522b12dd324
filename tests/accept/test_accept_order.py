"""suites/accept's order file: its schema, one line per problem, and the run refused with exit 4."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from suites.accept.order import OrderError, Version, load_order

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "fixtures" / "orders" / "b200-order.yaml"


def _problems(tmp_path: Path, text: str, name: str = "order.yaml") -> list[str]:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(OrderError) as exc:
        load_order(p)
    return exc.value.problems


def test_the_example_order_loads() -> None:
    o = load_order(EXAMPLE)
    assert (o.gpu_model, o.gpu_count, o.memory_gib, o.disk_path) == ("NVIDIA B200", 8, 179.0, "/data")
    assert o.driver == Version("570", minimum=True) and o.cuda == Version("12.8", minimum=True)
    assert o.s3_url is None


def test_each_bad_field_is_one_line_naming_file_field_and_value(tmp_path: Path) -> None:
    text = (
        "gpus: {model: NVIDIA B200, count: eight, memory_gib: -1}\n"
        "driver: {version: 'latest', cuda: 12.8}\n"
        "disk: {path: data, speed: 3}\n"
        "s3: {endpoint: 'ftp://x'}\n"
        "extra: 1\n"
    )
    assert _problems(tmp_path, text) == [
        "order.yaml: extra: unknown section; expected one of gpus, driver, disk, s3",
        "order.yaml: gpus.count: expected an integer, got 'eight'",
        "order.yaml: gpus.memory_gib: expected a number, got -1",
        "order.yaml: driver.version: expected a version such as 570.133.20 or >=570, got 'latest'",
        "order.yaml: disk.speed: unknown field; expected one of path, free_gib, write_mb_s",
        "order.yaml: disk.path: expected an absolute path, got 'data'",
        "order.yaml: s3.bucket: missing; expected a string",
        "order.yaml: s3.endpoint: expected an http(s):// URL, got 'ftp://x'",
    ]


def test_missing_sections_and_bad_syntax(tmp_path: Path) -> None:
    assert _problems(tmp_path, "driver: {version: '570'}\n") == [
        "order.yaml: gpus: missing; expected model, count, memory_gib",
        "order.yaml: disk: missing; expected path, free_gib, write_mb_s",
    ]
    (line,) = _problems(tmp_path, '{"gpus": ', name="order.json")
    assert line.startswith("order.json: not valid JSON: "), line
    assert _problems(tmp_path, "- a\n- b\n") == [
        "order.yaml: expected a mapping with gpus, driver, disk, s3, got list"
    ]


@pytest.mark.parametrize(
    ("promised", "found", "holds"),
    [
        (Version("570", True), "570.133.20", True),
        (Version("570", True), "565.57.01", False),
        (Version("570.133.20", False), "570.133.20", True),
        (Version("570.133", False), "570.133.20", True),
        (Version("570.133.20", False), "570.133.21", False),
        (Version("12.8", True), "13.0", True),
        (Version("12.8", True), "N/A", False),
    ],
)
def test_versions_exact_or_minimum(promised: Version, found: str, holds: bool) -> None:
    assert promised.holds(found) is holds


def test_a_bad_order_refuses_the_run_with_exit_4_before_any_node(tmp_path: Path) -> None:
    bad = tmp_path / "order.yaml"
    bad.write_text("gpus: {model: NVIDIA B200, count: eight}\ndisk: {path: /data}\n")
    argv = [sys.executable, "-m", "pytest", str(ROOT / "suites" / "accept"), "--host=ssh://root@192.0.2.1",
            f"--order={bad}", "-p", "no:cacheprovider", "-q"]  # fmt: skip
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 4, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["ERROR: gpuhost: order.yaml: gpus.count: expected an integer, got 'eight'"], r.stderr
    r = subprocess.run(
        argv[:5] + argv[6:], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 4 and "gpuhost: no order: pass --order=PATH" in r.stderr, r.stderr


def test_the_verdict_names_every_broken_promise_and_every_step_that_proved_nothing() -> None:
    from types import SimpleNamespace

    from suites.accept.options import AcceptOptions
    from suites.accept.procedure import AcceptProcedure
    from suites.accept.verdict import verdict_line

    node = SimpleNamespace(name="n1", conn=None, vars={})
    proc = AcceptProcedure(node, load_order(EXAMPLE), AcceptOptions(), check_only=False)
    proc.promise("gpus", "GPU count", 8, 8, True)
    proc.outcomes.update(gpus="passed", s3="skipped")
    assert verdict_line(proc) == "ACCEPT"
    proc.promise("data_volume", "write throughput", ">= 50 MB/s", "4 MB/s", False)
    proc.outcomes.update(data_volume="failed", interconnect="cannot see", health="failed")
    proc.summaries.update(interconnect="no P2P bandwidth tool", health="Unreachable: n1: connection refused")
    assert verdict_line(proc) == (
        "REJECT: write throughput: promised >= 50 MB/s, found 4 MB/s; "
        "interconnect: cannot see: no P2P bandwidth tool; health: failed: Unreachable: n1: connection refused"
    )


def test_another_suites_run_is_not_refused_for_want_of_an_order(tmp_path: Path) -> None:
    """Every suite's preconditions are checked in every run: accept's order only in accept's run."""
    argv = [sys.executable, "-m", "pytest", str(ROOT / "suites" / "p2p"), "--host=ssh://root@192.0.2.1",
            "--connect-timeout=1", "-p", "no:cacheprovider", "-q"]  # fmt: skip
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode not in (0, 4) and "no order" not in r.stdout + r.stderr, r.stdout + r.stderr
