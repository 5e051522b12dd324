"""NVLink error counters since the last run: the parser on real `nvidia-smi nvlink -e`
text, the comparison with the last run's counters, and what the health state keeps."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.agent.probe_health_smi import parse_nvlink_errors
from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import facts as health_facts
from pytest_gpuhost.modules.health.nvlink import nvlink_state

# NVLink 4 (H100), as stas00/ml-engineering compute/accelerator/nvidia/debug.md shows it: the GPU
# line, three lines per link, a blank line between links (tabs then a space before "Link").
H100 = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-abcdefab-cdef-abdc-abcd-abababababab)
\t Link 0: Replay Errors: 0
\t Link 0: Recovery Errors: 0
\t Link 0: CRC Errors: 0

\t Link 1: Replay Errors: 7
\t Link 1: Recovery Errors: 1
\t Link 1: CRC Errors: 12

GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)
\t Link 0: Replay Errors: 0
\t Link 0: Recovery Errors: 0
\t Link 0: CRC Errors: 0
"""
# NVLink 5 (Blackwell): one line per counter, with BER and the FEC histogram (corrected
# codewords: bucket 0 in the billions on a healthy link) and raw per-lane counts, which are not
# error counters and must not be kept.
B200 = """GPU 0: NVIDIA B200 (UUID: GPU-4fe6)
\t Link 0: Malformed packet Errors: 0
\t Link 0: Buffer overrun Errors: 0
\t Link 0: Rx Errors: 0
\t Link 0: Rx remote Errors: 0
\t Link 0: Rx General Errors: 0
\t Link 0: Local link integrity Errors: 0
\t Link 0: Tx discards: 0
\t Link 0: Link recovery successful events: 2
\t Link 0: Link recovery failed events: 1
\t Link 0: Total link recovery events: 3
\t Link 0: Effective Errors: 0
\t Link 0: Effective BER: 15e-255
\t Link 0: Symbol Errors: 4
\t Link 0: Symbol BER: 15e-255
\t Link 0: FEC Errors - 0: 36140749276
\t Link 0: FEC Errors - 1: 17
\t Link 0: Raw Errors Lane 0: 82
"""


def test_parser_reads_both_counter_sets_and_keeps_only_error_counters() -> None:
    got = parse_nvlink_errors(H100)
    assert got["0"]["uuid"] == "GPU-abcdefab-cdef-abdc-abcd-abababababab"
    assert got["0"]["links"] == {"1": {"Replay Errors": 7, "Recovery Errors": 1, "CRC Errors": 12}}
    assert got["0"]["read"] == 6 and got["1"] == {
        "uuid": "GPU-bbbb",
        "read": 3,
        "links": {},
    }  # zeros not sent
    b = parse_nvlink_errors(B200)["0"]["links"]["0"]
    assert b == {
        "Link recovery successful events": 2,
        "Link recovery failed events": 1,
        "Total link recovery events": 3,
        "Symbol Errors": 4,
    }  # no FEC histogram, BER or raw lane counts
    assert parse_nvlink_errors(B200)["0"]["read"] == 12
    # the counters under a "Link N:" line of their own; a GPU line without a UUID (srt-slurm PR 307)
    nested = parse_nvlink_errors(
        "GPU 3: NVIDIA GB300\n\t Link 5:\n\t\t Rx Errors: 9\n\t\t Effective BER: 1e-12\n"
    )
    assert nested == {"3": {"uuid": None, "read": 1, "links": {"5": {"Rx Errors": 9}}}}
    # hostile or odd names and values are not counters
    odd = "GPU 0: X\n\t Link 0: <b>\u202e Errors: 1\n\t Link 0: " + "x" * 200 + " Errors: 1\n"
    assert parse_nvlink_errors(odd)["0"] == {"uuid": None, "read": 0, "links": {}}
    assert (
        parse_nvlink_errors("GPU 0: X\n\t Link 0: CRC Errors: -1\n\t Link 0: Rx Errors: ²\n")["0"]["links"]
        == {}
    )


BDF = ["0000:1b:00.0", "0000:43:00.0"]


def b200_facts(counters: dict[int, dict[str, dict[str, int]]], previous: Any = None) -> dict[str, Any]:
    """Facts of a 2-GPU B200 host: all 18 links up, `counters` as `nvlink -e` gave them."""
    gpus = [
        {"index": i, "bdf": BDF[i], "name": "NVIDIA B200", "uuid": f"GPU-{i}", "driver_version": "570.133.20"}
        for i in range(2)
    ]
    up = {str(k): {"up": True, "gbps": 53.125, "text": "53.125 GB/s"} for k in range(18)}
    # what the probe makes of the text nvidia-smi prints for these counters (B200: one line each)
    text = "".join(
        f"GPU {i}: NVIDIA B200 (UUID: GPU-{i})\n"
        + "".join(
            f"\t Link {k}: {n}: {v}\n" for k, vals in counters.get(i, {}).items() for n, v in vals.items()
        )
        for i in range(2)
    )
    links = parse_nvlink_errors(text)
    return {
        "gpus": {"ok": True, "gpus": gpus},
        "nvlink": {
            "ok": True,
            "gpus": {str(i): {"links": dict(up)} for i in range(2)},
            "errors": {"ok": True, "gpus": links},
        },
        "kernel_log": {
            "ok": True,
            "xid": [],
            "sxid": [],
            "pending": [],
            "previous_counters": previous,
            "cursor": {"version": 1, "last_ts": 1.0, "seen_at_last": [], "boot_id": "b1"},
        },
    }


def judge(facts: dict[str, Any], **host_vars: Any) -> hm.Verdict:
    return hm.evaluate("nvlink", facts, hm.Thresholds.from_vars(host_vars))


def zero(n: int = 18) -> dict[str, dict[str, int]]:
    return {
        str(k): {"Link recovery successful events": 0, "Rx Errors": 0, "Total link recovery events": 0}
        for k in range(n)
    }


def night(counters: dict[int, dict[str, dict[str, int]]], state: Any) -> tuple[hm.Verdict, Any]:
    """Judge one run against the last run's kept state; return the verdict and the state kept now."""
    facts = b200_facts(counters, previous=state)
    kept = health_facts.commit_state(facts)
    assert kept is not None
    return judge(facts), kept["counters"]


def test_first_run_is_a_baseline_then_growth_fails_naming_gpu_link_and_counter() -> None:
    high = {0: zero(), 1: zero()}
    high[1]["7"] = {"Link recovery successful events": 500, "Rx Errors": 3, "Total link recovery events": 500}
    v, state = night(high, None)  # lifetime counts on the first run: a baseline, not judged
    assert v.ok and "recorded as the baseline (first run)" in v.summary, v.summary
    assert state["nvlink"] == {
        BDF[0]: {},
        BDF[1]: {
            "7": {"Link recovery successful events": 500, "Rx Errors": 3, "Total link recovery events": 500}
        },
    }
    v, state = night(high, state)  # nothing grew
    assert (
        v.ok
        and "no NVLink error counter past its limit since the last run (108 counters, 2 GPUs)" in v.summary
    )
    grown = copy.deepcopy(high)
    grown[1]["7"]["Link recovery successful events"] = 503
    grown[1]["7"]["Total link recovery events"] = 503
    grown[0]["2"]["Rx Errors"] = 1
    v, state = night(grown, state)
    assert not v.ok
    assert v.reasons == [
        "GPU 0 (0000:1b:00.0) link 2: Rx Errors +1 since the last run (now 1; limit 0, link_errors)",
        "GPU 1 (0000:43:00.0) link 7: Link recovery successful events +3 since the last run "
        "(now 503; limit 0, recovery)",
    ]  # the Total (their sum) is kept, not judged twice
    assert v.summary == "2 NVLink error counter(s) past the limit since the last run"
    assert v.state["errors"]["grown"][BDF[1]]["7"]["Total link recovery events"] == 3
    # the inventory raises a class's limit: 3 recoveries pass at 3, 1 Rx error at 1
    assert judge(
        b200_facts(grown, previous=night(high, None)[1]), nvlink_recovery_max=3, nvlink_link_errors_max=1
    ).ok
    # the next night judges from the grown values: nothing new, passes
    v, _ = night(grown, state)
    assert v.ok, v.reasons


def test_a_counter_that_went_backwards_is_a_new_baseline_and_a_new_gpu_too() -> None:
    before = {0: zero(), 1: zero()}
    before[0]["3"]["Rx Errors"] = 40
    _, state = night(before, None)
    after = {0: zero(), 1: zero()}
    after[0]["3"]["Rx Errors"] = 2  # reset (reboot, GPU reset, nvidia-smi nvlink -r): new baseline
    v, state2 = night(after, state)
    assert v.ok and "1 counter(s) reset (new baseline)" in v.summary, v.summary
    assert v.state["errors"]["reset"] == ["GPU 0 (0000:1b:00.0) link 3 Rx Errors"]
    assert state2["nvlink"][BDF[0]] == {"3": {"Rx Errors": 2}}
    after[0]["3"]["Rx Errors"] = 3  # grows from the new baseline
    assert not night(after, state2)[0].ok
    # a GPU the last run did not read (state from before this check): a baseline for it
    old = dict(state)
    old["nvlink"] = {BDF[0]: {}}
    after[1]["0"]["Rx Errors"] = 9
    v, _ = night(after, old)
    assert not v.ok and [r for r in v.reasons if "GPU 1" in r] == [], v.reasons
    assert v.state["errors"]["baseline"] == [BDF[1]]


def test_unreadable_counters_fail_and_the_last_runs_state_is_carried_forward() -> None:
    _, state = night({0: zero(), 1: zero()}, None)
    facts = b200_facts({}, previous=state)
    facts["nvlink"]["errors"] = {"ok": False, "error": "nvidia-smi nvlink -e timed out"}
    v = judge(facts)
    assert not v.ok and v.reasons == ["NVLink error counters unreadable: nvidia-smi nvlink -e timed out"]
    assert v.summary == v.reasons[0]
    assert nvlink_state(facts) == state["nvlink"]  # the next run still compares with a real reading
    facts["nvlink"]["errors"] = {"ok": True, "gpus": {"0": {"uuid": None, "links": {}}}}
    assert "printed no error counters" in judge(facts).reasons[0]
    # a host whose nvlink -s printed no links never read them: nothing kept, nothing judged
    pcie = b200_facts({})
    del pcie["nvlink"]["errors"]
    assert nvlink_state(pcie) is None


def test_model_table_and_h100_counter_names() -> None:
    """H100 SXM: Replay/Recovery/CRC Errors per link; the model's limits (0) apply."""
    facts = b200_facts({0: {"1": {"Replay Errors": 0, "Recovery Errors": 0, "CRC Errors": 5}}})
    for g in facts["gpus"]["gpus"]:
        g["name"] = "NVIDIA H100 80GB HBM3"
    kept = health_facts.commit_state(facts)
    assert kept is not None
    facts2 = copy.deepcopy(facts)
    facts2["kernel_log"]["previous_counters"] = kept["counters"]
    facts2["nvlink"]["errors"]["gpus"]["0"]["links"]["1"]["CRC Errors"] = 9
    v = judge(facts2)
    assert v.reasons == [
        "GPU 0 (0000:1b:00.0) link 1: CRC Errors +4 since the last run (now 9; limit 0, crc)"
    ]
    assert judge(facts2, nvlink_crc_max=4).ok


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")
def test_the_labs_nvlink_e_prints_what_the_probe_reads(tmp_path: Path) -> None:
    """The lab's nvidia-smi nvlink -e on the B200 profile: NVLink 5 lines per link, -i, the fault."""
    from gpulab.kernel.sysfs import StandaloneMount
    from tests.lab.test_lab_tools import Lab

    with StandaloneMount("b200-nvl8", tmp_path / "m") as m:
        b = Lab(m, tmp_path / "root", "b200-nvl8")
        out = b.run("nvidia-smi", "nvlink", "-e").splitlines()
        assert out[0] == "GPU 0: NVIDIA B200 (UUID: GPU-4fe656c6-3035-7d82-9c8d-0da4eb4f1b57)"
        assert out[1:3] == ["\t Link 0: Malformed packet Errors: 0", "\t Link 0: Buffer overrun Errors: 0"]
        assert "\t Link 17: Effective BER: 15e-255" in out and len(out) == 8 * (1 + 18 * 30)
        got = parse_nvlink_errors("\n".join(out))
        assert len(got) == 8 and all(g["read"] == 18 * 12 and g["links"] == {} for g in got.values())
        faults = {"gpus": {"0000:43:00.0": {"nvlink_errors": {"7": {"Link recovery failed events": 2}}}}}
        (tmp_path / "root/var/lib/gpulab/faults.json").write_text(json.dumps(faults))
        one = parse_nvlink_errors(b.run("nvidia-smi", "nvlink", "-e", "-i", "1"))
        assert one == {
            "1": {
                "uuid": "GPU-61446c06-e82e-2fe2-6288-a052bc523272",
                "read": 18 * 12,
                "links": {"7": {"Link recovery failed events": 2, "Total link recovery events": 2}},
            }
        }
        runs = [json.loads(x) for x in (Path(m.state) / "record.jsonl").read_text().splitlines()]
        assert [r["argv"] for r in runs if r.get("op") == "nvidia-smi"] == [
            ["nvlink", "-e"],
            ["nvlink", "-e", "-i", "1"],
        ]
