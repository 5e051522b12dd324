"""pytest_gpuhost.modules.nccl: nccl-tests output and NCCL's transport lines, on real captures; the verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpuhost.modules import nccl

OUT = Path(__file__).resolve().parents[2] / "fixtures" / "outputs"
GPUS = ["0000:17:00.0", "0000:18:00.0"]


def read(name: str) -> str:
    return (OUT / name).read_text()


def test_current_header_devices_and_wrong_columns() -> None:
    r = nccl.parse_perf(read("nccl-tests-all-reduce-gb10x2-2.20.0-head.txt"))
    assert r.validation == 1
    assert [(d.rank, d.cuda_dev, d.bus, d.name) for d in r.devices] == [
        (0, 0, "000f:01:00", "NVIDIA GB10"),
        (1, 0, "000f:01:00", "NVIDIA GB10"),
    ]
    assert [row.size for row in r.rows] == [8192, 16384, 32768, 65536]
    first = r.rows[0]
    assert (first.time_us, first.algbw, first.busbw, first.wrong) == (35.15, 0.23, 0.23, 0)
    assert (first.ip_time_us, first.ip_busbw, first.ip_wrong) == (30.33, 0.27, 0)
    assert r.wrong == 0
    assert not r.concluded and r.avg_busbw is None  # the capture stops before the footer


def test_footer_out_of_bounds_and_average() -> None:
    r = nccl.parse_perf(read("rccl-tests-all-reduce-footer.txt"))
    assert len(r.rows) == 4 and r.rows[0].time_us == 11186.0  # integer time cells
    assert r.rows[-1].size == 17179869184 and r.rows[-1].ip_busbw == 361.17
    assert (r.out_of_bounds, r.avg_busbw, r.concluded) == (0, 142.652, True)


def test_na_is_not_checked_and_old_device_line() -> None:
    r = nccl.parse_perf(read("nccl-tests-alltoall-rtx5090-na.txt"))
    row = r.rows[0]
    assert row.wrong == 0 and row.ip_wrong is None and row.wrong_total == 0
    assert r.devices[0].bus == "01" and r.devices[0].name == "NVIDIA GeForce RTX 5090"
    assert r.avg_busbw == 0.0


def test_hung_run_has_no_rows_and_no_footer() -> None:
    r = nccl.parse_perf(read("nccl-tests-all-reduce-rtx4090x2-hang-old.txt"))
    assert r.rows == [] and r.avg_busbw is None and not r.concluded
    assert [d.bus for d in r.devices] == ["01", "24"]


def test_channels_one_process_p2p() -> None:
    chans = nccl.parse_channels(read("nccl-info-channels-l20x8-p2p-direct-pointer.txt"))
    assert len(chans) == 11
    assert {c.transport for c in chans} == {"P2P/direct pointer"} and {c.kind for c in chans} == {"P2P"}
    assert (chans[0].channel, chans[0].src, chans[0].dst) == (1, 0, 3)


def test_channels_net_and_cumem() -> None:
    chans = nccl.parse_channels(read("nccl-info-channels-h20-net-p2p-cumem.txt"))
    kinds = [c.kind for c in chans]
    assert kinds.count("NET") == 9 and kinds.count("P2P") == 5
    assert chans[0].transport == "NET/IB/3/GDRDMA" and chans[0].direction == "receive"
    assert chans[5].direction == "send"
    assert chans[-1].transport == "P2P/CUMEM"


def test_channels_old_shm_wording() -> None:
    chans = nccl.parse_channels(read("nccl-info-channels-2.4-direct-shared-memory.txt"))
    assert [c.kind for c in chans].count("SHM") == 7
    assert chans[0].transport == "direct shared memory" and (chans[0].src, chans[0].dst) == (4, 3)


def test_ring_listing_is_not_a_channel() -> None:
    text = read("nccl-info-a6000x2-p2p-level-loc.txt")
    assert nccl.parse_channels(text) == []
    r = nccl.parse_perf(text)
    assert r.nccl_version == "2.11.4+cuda11.1" and [d.bus for d in r.devices] == ["c1", "c2"]


@pytest.mark.parametrize(
    ("line", "transport", "kind"),
    [
        # shm.cc, NCCL 2.13-2.30 and from 2.30.7; p2p.cc legacy IPC and cuMem with /read
        ("h:1:2 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct/direct", "SHM/direct/direct", "SHM"),
        ("h:1:2 [0] NCCL INFO Channel 01 : 1[1] -> 0[0] via SHM/direct", "SHM/direct", "SHM"),
        ("h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC", "P2P/IPC", "P2P"),
        ("h:1:2 [1] NCCL INFO Channel 03/1 : 1[1] -> 0[0] via P2P/CUMEM/read", "P2P/CUMEM/read", "P2P"),
        ("h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/indirect/2[2]", "P2P/indirect/2[2]", "P2P"),
    ],
)
def test_channel_forms_from_the_source(line: str, transport: str, kind: str) -> None:
    (c,) = nccl.parse_channels(line)
    assert (c.transport, c.kind) == (transport, kind)


# ------------------------------------------------------------------ the service's environment


def test_unit_environment_and_findings() -> None:
    env = nccl.parse_unit_environment('Environment=NCCL_P2P_DISABLE=1 "OPTS=a b" CUDA_VISIBLE_DEVICES=0,1\n')
    assert env == {"NCCL_P2P_DISABLE": "1", "OPTS": "a b", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert nccl.env_findings(env) == ["NCCL_P2P_DISABLE=1"]
    assert nccl.env_findings({"NCCL_P2P_DISABLE": "0"}) == []
    assert nccl.env_findings({"NCCL_P2P_DISABLE": "2"}) == []  # ncclGetLevel: only 1 disables
    assert nccl.env_findings({"NCCL_P2P_LEVEL": "LOC"}) == [
        "NCCL_P2P_LEVEL=LOC (LOC: P2P only within one GPU)"
    ]
    assert nccl.env_findings({"NCCL_P2P_LEVEL": "0"}) == ["NCCL_P2P_LEVEL=0 (LOC: P2P only within one GPU)"]
    assert nccl.env_findings({"NCCL_P2P_LEVEL": "NVL"}) == ["NCCL_P2P_LEVEL=NVL (NVL: P2P only over NVLink)"]
    assert nccl.env_findings({"NCCL_P2P_LEVEL": "SYS"}) == nccl.env_findings({"NCCL_P2P_LEVEL": "4"}) == []
    assert nccl.env_findings({"NCCL_SHM_DISABLE": "1"}) == [
        "NCCL_SHM_DISABLE=1 (no SHM either: NCCL falls back to the network)"
    ]
    assert nccl.parse_unit_environment("Environment=\n") == {}


# ------------------------------------------------------------------ the verdict


def perf(busbw: float, wrong: int = 0, concluded: bool = True) -> str:
    """An all_reduce_perf run in the tool's printf layout (util.cu), one size, two GPUs."""
    head = (
        "# nThread 1 nGpus 2 minBytes 33554432 maxBytes 33554432 step: 2(factor) warmup iters: 5 iters: 20 "
        "agg iters: 1 validation: 1 graph: 0 unalign: 0\n#\n# Using devices\n"
        "#  Rank  0 Group  0 Pid   4242 on       lab1 device  0 [0000:17:00] NVIDIA RTX 6000 Ada Generation\n"
        "#  Rank  1 Group  0 Pid   4242 on       lab1 device  1 [0000:18:00] NVIDIA RTX 6000 Ada Generation\n"
    )
    if not concluded:
        return head
    algbw = busbw / 1.0  # 2(n-1)/n = 1 for two ranks
    t = 33554432 / 1e9 / algbw * 1e6
    row = f"{33554432:12d}  {8388608:12d}  {'float':>8}  {'sum':>6}  {-1:6d}"
    row += f"  {t:7.1f}  {algbw:6.2f}  {busbw:6.2f}  {wrong:6g}" * 2
    foot = (
        f"# Out of bounds values : {2 if wrong else 0} {'FAILED' if wrong else 'OK'}\n"
        f"# Avg bus bandwidth    : {busbw:g} \n#\n# Collective test concluded: all_reduce_perf\n"
    )
    return head + row + "\n" + foot


def arm(name: str, text: str, via: str, *, rc: int = 0, hung: bool = False, seconds: float = 2.0) -> nccl.Arm:
    a = nccl.Arm(name, GPUS, ["all_reduce_perf"], {}, 60.0, seconds=seconds, rc=rc, hung=hung, tail=text)
    a.result = nccl.parse_perf(text)
    lines = [f"h:1:2 [0] NCCL INFO Channel 0{c} : 0[0] -> 1[1] via {via}" for c in range(2)] if via else []
    a.channels = nccl.parse_channels("\n".join(lines))
    return a


def control(busbw: float = 10.0) -> nccl.Arm:
    return arm(nccl.ARMS[1], perf(busbw), "SHM/direct/direct")


def test_verdict_pass() -> None:
    v = nccl.verdict(arm("P2P", perf(21.0), "P2P/direct pointer"), control(10.0))
    assert v.ok, v.summary
    assert v.summary.startswith("all_reduce on 2 GPUs via P2P/direct pointer (2): 21 GB/s vs 10 GB/s")
    assert "(2.10x), 0 wrong" in v.summary


def test_verdict_hung_names_the_gpus() -> None:
    v = nccl.verdict(arm("P2P", perf(0, concluded=False), "P2P/IPC", rc=124, hung=True), control())
    assert not v.ok
    assert v.problems == ["P2P: hung after 60 s on 0000:17:00.0, 0000:18:00.0 (ended by timeout -k 5 60)"]


def test_verdict_wrong_data() -> None:
    v = nccl.verdict(arm("P2P", perf(21.0, wrong=12), "P2P/IPC", rc=1), control())
    assert not v.ok
    assert v.problems == [
        "P2P: wrong data: 24 wrong elements (first at 33554432 B: 24) on 0000:17:00.0, 0000:18:00.0"
    ]


def test_verdict_shm_transport() -> None:
    v = nccl.verdict(arm("P2P", perf(21.0), "SHM/direct/direct"), control())
    assert not v.ok
    assert "2 of 2 channels not via P2P (SHM/direct/direct (2))" in v.summary


def test_verdict_too_slow_against_control() -> None:
    v = nccl.verdict(arm("P2P", perf(11.0), "P2P/CUMEM"), control(10.0))
    assert not v.ok
    assert v.problems == [
        "P2P bus bandwidth 11 GB/s is below 1.2x the control's 10 GB/s (needs >= 12): "
        "P2P is no faster than host memory"
    ]


def test_verdict_without_channel_lines_or_baseline() -> None:
    v = nccl.verdict(arm("P2P", perf(21.0), ""), arm(nccl.ARMS[1], "", "", rc=127))
    assert not v.ok
    assert v.problems[0] == "P2P: NCCL logged no channel (NCCL_DEBUG=INFO): transport unknown"
    assert v.problems[1].startswith("control (NCCL_P2P_DISABLE=1): failed (rc 127)")
    assert v.problems[1].endswith(": no baseline to compare with")


def test_verdict_other_gpus_than_in_scope() -> None:
    p = arm("P2P", perf(21.0).replace("[0000:18:00]", "[0000:9a:00]"), "P2P/IPC")
    v = nccl.verdict(p, control())
    assert v.problems == ["P2P: ran on 0000:9a:00, not the in-scope 0000:17:00.0, 0000:18:00.0"]
