"""The `nvlink` part of the `health` fact through a real local:// agent, against a stand-in
nvidia-smi that prints what the real one prints and logs every start: `nvlink -e` runs in the
same request only where `nvlink -s` printed links."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.health import facts as health_facts

NVIDIA_SMI = """#!/bin/sh
echo "$*" >> "$FAKE/starts"
case "$1 $2" in
  "nvlink -s") cat "$FAKE/status" ;;
  "nvlink -e") [ -f "$FAKE/errors" ] || { echo "Invalid combination of input arguments." ; exit 2 ; }
               cat "$FAKE/errors" ;;
  *) echo "unknown $*" >&2; exit 2 ;;
esac
"""
STATUS = "GPU 0: NVIDIA B200 (UUID: GPU-a)\n\t Link 0: 53.125 GB/s\n\t Link 1: <inactive>\n"
ERRORS = (
    "GPU 0: NVIDIA B200 (UUID: GPU-a)\n"
    "\t Link 0: Rx Errors: 0\n\t Link 0: Link recovery failed events: 2\n\t Link 0: FEC Errors - 0: 99\n"
    "\t Link 1: Rx Errors: 5\n\t Link 1: Effective BER: 15e-255\n"
)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text(NVIDIA_SMI)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE", str(tmp_path))
    return tmp_path


def _nvlink(fake: Path) -> dict:
    conn = open_connection(parse_host_url("local://"))
    try:
        before = conn.round_trips
        reply = conn.call("facts", names=health_facts.fact_names(["nvlink"]), params={"parts": ["nvlink"]})
        assert conn.round_trips - before == 1
        return dict(health_facts.merge(reply)["nvlink"])
    finally:
        conn.close()


def test_error_counters_read_in_the_same_request_where_links_are_listed(fake: Path) -> None:
    (fake / "status").write_text(STATUS)
    (fake / "errors").write_text(ERRORS)
    part = _nvlink(fake)
    assert (fake / "starts").read_text().splitlines() == ["nvlink -s", "nvlink -e"]
    assert part["errors"] == {
        "ok": True,
        "gpus": {
            "0": {
                "uuid": "GPU-a",
                "read": 3,  # zeros are counted, not sent
                "links": {"0": {"Link recovery failed events": 2}, "1": {"Rx Errors": 5}},
            }
        },
    }


def test_a_host_without_nvlink_starts_no_second_process(fake: Path) -> None:
    # PCIe GPUs: the driver prints each GPU's line and no link lines
    (fake / "status").write_text("GPU 0: NVIDIA RTX PRO 6000 Blackwell Server Edition (UUID: GPU-a)\n")
    (fake / "errors").write_text(ERRORS)
    part = _nvlink(fake)
    assert (fake / "starts").read_text().splitlines() == ["nvlink -s"]
    assert "errors" not in part and part["gpus"] == {"0": {"links": {}}}


def test_a_failing_nvlink_e_is_reported_not_dropped(fake: Path) -> None:
    (fake / "status").write_text(STATUS)
    part = _nvlink(fake)
    assert part["errors"] == {
        "ok": False,
        "error": "nvidia-smi nvlink -e exited 2: Invalid combination of input arguments.",
    }
