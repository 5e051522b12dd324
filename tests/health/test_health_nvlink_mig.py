"""A GPU in MIG mode answers no NVLink query: not checked, never "0 of N NVLinks active".

nvidia-smi prints `Nvlink queries are not supported for Devices in MIG mode` for such a GPU. No
published capture of it was found, so the text here is *synthesised*: that line (where it stands
is not known, so each place is tried: under a GPU's line, once before any GPU, on stderr) around
the GPU lines and links of the real B300 capture (fixtures/outputs/nvidia-smi-610.57.04-b300x7-
query-name-nvlink-s.txt, 18 links per GPU). Before this check knew MIG mode, each of these failed
the node with "0 of 18 NVLinks active (no link lines)" or with the command's error.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_health, probe_health_smi
from tests.health.test_health_models import b300_capture, with_names
from tests.health.test_health_verdicts import judge

MIG = "Nvlink queries are not supported for Devices in MIG mode"
NOT_CHECKED = "not checked: MIG mode (NVLink queries unsupported)"


def gpu_blocks() -> list[str]:
    """Return the real capture's `nvlink -s` text of GPU 0 and GPU 1, one block each."""
    _, status = b300_capture()
    text = status.split("...")[0]
    return ["GPU " + b for b in text.split("GPU ") if b]


def probe(monkeypatch: pytest.MonkeyPatch, stdout: str, stderr: str = "", rc: int = 0) -> dict[str, Any]:
    """Run the probe's `nvlink` part on a given `nvidia-smi nvlink -s`; record what it starts."""
    starts: list[list[str]] = []

    def run(argv: list[str], timeout: float, record: list[Any]) -> dict[str, Any]:
        starts.append(argv[1:])
        if argv[-1] == "-s":
            return {"rc": rc, "stdout": stdout, "stderr": stderr, "timed_out": False}
        return {"rc": 0, "stdout": "", "stderr": "", "timed_out": False}

    for module in (probe_health, probe_health_smi):  # the readers, and the fabric part's systemctl
        monkeypatch.setattr(module, "run_recorded", run)
    part = probe_health.part_nvlink({}, [])
    part["starts"] = starts
    return part


def mig_gpu(i: int) -> str:
    return f"GPU {i}: NVIDIA B300 SXM6 AC (UUID: GPU-{i})\n\t {MIG}\n"


def b300_facts(part: dict[str, Any]) -> dict[str, Any]:
    names, _ = b300_capture()
    facts = with_names(*names)
    part.pop("starts", None)
    part.pop("errors", None)  # counters are judged elsewhere (tests/health/test_health_nvlink.py)
    facts["nvlink"] = part
    return facts


def test_every_gpu_in_mig_mode_is_not_checked_rather_than_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    part = probe(monkeypatch, "".join(mig_gpu(i) for i in range(4)))
    assert part["starts"] == [["nvlink", "-s"]]  # no links, so no `nvlink -e`
    assert part["gpus"]["0"] == {"links": {}, "mig": MIG}
    v = judge("nvlink", b300_facts(part))
    assert v.ok and v.skip == f"GPU 0, 1, 2, 3: {NOT_CHECKED}", v
    assert v.state["mig"] == ["0", "1", "2", "3"]
    # nvlink_required asks for NVLink where it can be read; MIG mode is not a missing NVLink
    v = judge(
        "nvlink", b300_facts(probe(monkeypatch, "".join(mig_gpu(i) for i in range(4)))), nvlink_required=True
    )
    assert v.ok and v.skip, v


@pytest.mark.parametrize(
    ("stdout", "stderr", "rc"),
    [(f"{MIG}\n", "", 0), ("", f"{MIG}\n", 0), ("", f"{MIG}\n", 3)],
    ids=["stdout-once", "stderr", "stderr-exit-3"],
)
def test_mig_mode_said_once_for_the_host(
    monkeypatch: pytest.MonkeyPatch, stdout: str, stderr: str, rc: int
) -> None:
    part = probe(monkeypatch, stdout, stderr, rc)
    assert part["ok"] and part["mig"] == MIG and part["gpus"] == {}
    v = judge("nvlink", b300_facts(part))
    assert v.ok and v.skip == f"GPU 0, 1, 2, 3: {NOT_CHECKED}", v


def test_gpus_out_of_mig_mode_are_still_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUs 0 and 1 in MIG mode, 2 and 3 with the capture's 18 links each: those are judged."""
    blocks = gpu_blocks()
    links = [b.replace("GPU 0:", "GPU 2:").replace("GPU 1:", "GPU 3:") for b in blocks]
    part = probe(monkeypatch, mig_gpu(0) + mig_gpu(1) + "".join(links))
    assert part["starts"] == [["nvlink", "-s"], ["nvlink", "-e"]]
    v = judge("nvlink", b300_facts(part))
    assert v.ok and not v.skip and v.summary == f"all 36 NVLinks up; GPU 0, 1: {NOT_CHECKED}", v
    # a link down on a judged GPU still fails, and the summary still names the GPUs not checked
    part = probe(
        monkeypatch, mig_gpu(0) + mig_gpu(1) + "".join(links).replace("53.125 GB/s", "<inactive>", 1)
    )
    v = judge("nvlink", b300_facts(part))
    assert not v.ok and v.reasons == ["GPU 2 (0000:3a:00.0): 17 of 18 NVLinks active (18 link lines)"], v
    assert v.summary.endswith(f"GPU 0, 1: {NOT_CHECKED}")
