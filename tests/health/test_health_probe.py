"""The `health` agent fact against stand-in tools on PATH, through a real local:// agent.

The stand-ins print what the real tools print (nvidia-smi's CSV, `nvlink -s`, `topo -p2p r`,
`dmesg --time-format iso`); the agent runs them as it would on a GPU host. This covers the probe's
parsing and its kernel-log cursor without the lab; tests/health/test_health_lab.py covers the lab.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_health_ib, probe_health_mounts, probe_health_pci
from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.health import facts as health_facts

CSV = """\
0, 00000000:17:00.0, NVIDIA RTX PRO 6000 Blackwell Server Edition, GPU-aaaa, 570.133.07, Enabled, 41, 0, 0, [N/A], 0, 0x0000000000000000, 5, 5, 16, 16
1, 00000000:18:00.0, NVIDIA RTX PRO 6000 Blackwell Server Edition, GPU-bbbb, 570.133.07, Disabled, 44, 0, 3, [N/A], 0, 0x0000000000000001, 5, 5, 8, 16
"""
HEADER = "| NVIDIA-SMI 570.133.07             Driver Version: 570.133.07     CUDA Version: 12.8     |\n"
NVLINK = "GPU 0: NVIDIA B200 (UUID: GPU-aaaa)\n\t Link 0: 50 GB/s\n\t Link 1: <inactive>\nGPU 1: NVIDIA B200 (UUID: GPU-bbbb)\n\t Link 0: 50 GB/s\n"
TOPO = " \tGPU0\tGPU1\t\n GPU0\tX\tNS\t\n GPU1\tNS\tX\t\n\nLegend:\n\n  X    = Self\n  NS   = Not supported\n"

NVIDIA_SMI = """#!/bin/sh
# stand-in: the CSV only for the full field list of this test; an unknown field as the real tool says it
case "$1" in
  --query-gpu=*clocks_event_reasons_counters.*)
    if [ -n "$NO_COUNTERS" ]; then echo 'Field "clocks_event_reasons_counters.hw_thermal_slowdown" is not a valid field to query.'; exit 2; fi ;;
esac
case "$1" in
  --query-gpu=*clocks_throttle_reasons.active*)
    if [ -n "$NO_THROTTLE_FIELD" ]; then echo 'Field "clocks_throttle_reasons.active" is not a valid field to query.'; exit 2; fi
    cat "$FAKE/csv" ;;
  --query-gpu=*clocks_event_reasons.active*)
    if [ -n "$NO_EVENT_FIELD" ]; then echo 'Field "clocks_event_reasons.active" is not a valid field to query.'; exit 2; fi
    cat "$FAKE/csv" ;;
  --query-gpu=*) sed 's/, 0x0000000000000001//; s/, 0x0000000000000000//' "$FAKE/csv" ;;
  nvlink) cat "$FAKE/nvlink" ;;
  topo) cat "$FAKE/topo" ;;
  "") cat "$FAKE/header" ;;
  *) echo "unknown $*" >&2; exit 2 ;;
esac
"""
DMESG = """#!/bin/sh
[ "$1" = "--time-format" ] || exit 1
cat "$FAKE/kmsg"
"""


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _exe(bin_dir / "nvidia-smi", NVIDIA_SMI)
    _exe(bin_dir / "dmesg", DMESG)
    (tmp_path / "csv").write_text(CSV)
    (tmp_path / "header").write_text(HEADER)
    (tmp_path / "nvlink").write_text(NVLINK)
    (tmp_path / "topo").write_text(TOPO)
    (tmp_path / "kmsg").write_text(
        "2026-11-30T10:00:00,000000+00:00 NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.133.07\n"
        "2026-11-30T10:00:05,500000+00:00 NVRM: Xid (PCI:0000:17:00): 79, pid=0, GPU has fallen off the bus.\n"
    )
    # The agent inherits this environment: it runs the stand-ins as it would run the real tools.
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE", str(tmp_path))
    return tmp_path


def _facts(conn, tmp: Path, **extra):
    """Read the health facts as suites/health does: the facts that hold the parts, one request."""
    params = {
        "state_path": str(tmp / "state" / "health-state.json"),
        "data_paths": [str(tmp), str(tmp / "nope")],
    }
    params.update(extra)
    names = health_facts.fact_names(extra.get("parts"))
    return health_facts.merge(conn.call("facts", names=names, params=params))


def test_probe_parses_the_tools_and_keeps_a_kernel_log_cursor(fake_host: Path) -> None:
    conn = open_connection(parse_host_url("local://"))
    try:
        before = conn.round_trips
        f = _facts(conn, fake_host)
        assert conn.round_trips - before == 1
        g0, g1 = f["gpus"]["gpus"]
        assert (g0["bdf"], g0["persistence_mode"], g0["temperature.gpu"]) == ("0000:17:00.0", 1, 41)
        assert (
            g1["persistence_mode"],
            g1["pcie.link.width.current"],
            g1["clocks_throttle_reasons.active"],
        ) == (0, 8, 1)
        assert g1["retired_pages.pending"] is None and g1["ecc.errors.corrected.volatile.total"] == 3
        assert "cell_errors" not in g1  # [N/A]: no value, not an error
        assert f["smi"]["cuda_version"] == "12.8" and f["smi"]["driver_version"] == "570.133.07"
        assert f["nvlink"]["gpus"]["0"]["links"]["1"] == {"up": False, "gbps": None, "text": "<inactive>"}
        assert f["p2p"]["labels"] == ["GPU0", "GPU1"] and f["p2p"]["matrix"] == [["X", "NS"], ["NS", "X"]]
        assert f["disk"]["paths"][str(fake_host)]["total"] > 0
        assert f["disk"]["paths"][str(fake_host / "nope")]["errno"] == 2
        assert any(c["argv"][:2] == ["dmesg", "--time-format"] for c in f["commands"])

        kl = f["kernel_log"]
        assert (
            kl["first_run"] and [x["code"] for x in kl["xid"]] == [79] and kl["xid"][0]["bdf"] == "0000:17:00"
        )
        # Not committed: the next run sees the same Xid again.
        assert [x["code"] for x in _facts(conn, fake_host)["kernel_log"]["xid"]] == [79]
        conn.call(
            "health_commit", state=health_facts.commit_state(f), state_path=kl["state_path"], timeout=10
        )
        saved = json.loads(Path(kl["state_path"]).read_text())
        assert saved["last_ts"] == kl["cursor"]["last_ts"]
        again = _facts(conn, fake_host)["kernel_log"]
        assert not again["first_run"] and again["xid"] == [] and again["lines_new"] == 0
        with (fake_host / "kmsg").open("a") as f_:
            f_.write(
                "2026-11-30T11:00:00,000000+00:00 NVRM: Xid (PCI:0000:18:00): 48, An uncorrectable double bit error\n"
            )
            f_.write(
                "2026-11-30T11:00:01,000000+00:00 nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32\n"
            )
        new = _facts(conn, fake_host)["kernel_log"]
        assert [x["code"] for x in new["xid"]] == [48] and [x["code"] for x in new["sxid"]] == [12028]

        # The host rebooted since the committed run (another boot id), and this boot's first line
        # carries a time before the cursor (a clock set back): every line of the new boot counts.
        conn.call(
            "health_commit",
            state=dict(health_facts.commit_state(_facts(conn, fake_host)) or {}, boot_id="an-earlier-boot"),
            state_path=kl["state_path"],
            timeout=10,
        )
        (fake_host / "kmsg").write_text(
            "2026-11-30T09:00:00,000000+00:00 NVRM: Xid (PCI:0000:18:00): 48, An uncorrectable double bit error\n"
        )
        rebooted = _facts(conn, fake_host)["kernel_log"]
        assert rebooted["new_boot"] and [x["code"] for x in rebooted["xid"]] == [48], rebooted
    finally:
        conn.close()


def test_probe_drops_a_field_the_driver_does_not_know_in_the_same_request(
    fake_host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NO_THROTTLE_FIELD", "1")
    conn = open_connection(parse_host_url("local://"))
    try:
        before = conn.round_trips
        f = _facts(conn, fake_host, parts=["gpus"])
        assert conn.round_trips - before == 1
        # A newer driver: the field's new name is asked for in its place, and read.
        assert f["gpus"]["dropped"] == []
        assert f["gpus"]["renamed"] == {"clocks_throttle_reasons.active": "clocks_event_reasons.active"}
        assert f["gpus"]["gpus"][1]["clocks_throttle_reasons.active"] == 1
        assert f["gpus"]["gpus"][1]["pcie.link.width.current"] == 8
        assert set(f) >= {"gpus", "commands", "time"} and "kernel_log" not in f
    finally:
        conn.close()
    # A driver that knows neither name: dropped, both, still in one request.
    monkeypatch.setenv("NO_EVENT_FIELD", "1")  # the agent started after this sees it
    conn = open_connection(parse_host_url("local://"))
    try:
        before = conn.round_trips
        f = _facts(conn, fake_host, parts=["gpus"])
        assert conn.round_trips - before == 1
        assert f["gpus"]["dropped"] == ["clocks_event_reasons.active", "clocks_throttle_reasons.active"]
        assert f["gpus"]["renamed"] == {}
        assert f["gpus"]["gpus"][1]["pcie.link.width.current"] == 8
        assert "clocks_throttle_reasons.active" not in f["gpus"]["gpus"][0]
    finally:
        conn.close()


def test_a_driver_without_the_clock_event_counters_drops_all_four_in_one_retry(
    fake_host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NO_COUNTERS", "1")
    conn = open_connection(parse_host_url("local://"))
    try:
        f = _facts(conn, fake_host, parts=["gpus"])
    finally:
        conn.close()
    assert [x for x in f["gpus"]["dropped"] if "counters" in x] == [
        "clocks_event_reasons_counters.hw_thermal_slowdown",
        "clocks_event_reasons_counters.hw_power_brake_slowdown",
        "clocks_event_reasons_counters.sw_thermal_slowdown",
        "clocks_event_reasons_counters.sw_power_cap",
    ]
    queries = [c for c in f["commands"] if c["argv"][1].startswith("--query-gpu=")]
    assert len(queries) == 2, [c["argv"] for c in queries]  # one refused, one answered
    assert f["gpus"]["gpus"][1]["pcie.link.width.current"] == 8


def test_probe_keeps_the_nvml_error_a_cell_prints(fake_host: Path) -> None:
    """A GPU that needs a reset: nvidia-smi prints the NVML error string in brackets in its cells."""
    reset = "[GPU requires reset]"
    row = (
        f"2, 00000000:3a:00.0, NVIDIA RTX PRO 6000 Blackwell Server Edition, GPU-cccc, 570.133.07, Enabled, "
        f"{reset}, {reset}, {reset}, [N/A], {reset}, {reset}, 5, 5, 16, 16\n"
    )
    (fake_host / "csv").write_text(CSV + row)
    conn = open_connection(parse_host_url("local://"))
    try:
        g = _facts(conn, fake_host, parts=["gpus"])["gpus"]["gpus"][2]
    finally:
        conn.close()
    assert g["temperature.gpu"] is None
    assert g["cell_errors"] == {
        f: "GPU requires reset"
        for f in (
            "temperature.gpu",
            "ecc.errors.uncorrected.volatile.total",
            "ecc.errors.corrected.volatile.total",
            "remapped_rows.failure",
            "clocks_throttle_reasons.active",
        )
    }


def test_probe_samples_a_part_several_times_in_one_request(fake_host: Path) -> None:
    conn = open_connection(parse_host_url("local://"))
    try:
        before = conn.round_trips
        f = _facts(conn, fake_host, parts=["gpus"], samples=3, interval=0.05)
        assert conn.round_trips - before == 1
        assert len(f["samples"]) == 3 and all(s["gpus"]["ok"] for s in f["samples"])
    finally:
        conn.close()


def test_cuda_version_is_cached_per_driver_version(fake_host: Path) -> None:
    """The CUDA version comes from the header once; later runs with the same driver skip that nvidia-smi."""
    conn = open_connection(parse_host_url("local://"))

    def header_runs(f) -> int:
        return sum(1 for c in f["commands"] if c["argv"] == ["nvidia-smi"])

    try:
        first = _facts(conn, fake_host)
        assert header_runs(first) == 1 and "cached" not in first["smi"]
        cursor = health_facts.commit_state(first)
        assert cursor is not None
        assert cursor["cuda"]["driver_version"] == "570.133.07" and cursor["cuda"]["cuda_version"] == "12.8"
        # nothing committed yet: the header is read again
        assert header_runs(_facts(conn, fake_host)) == 1
        conn.call("health_commit", state=cursor, state_path=first["kernel_log"]["state_path"], timeout=10)
        second = _facts(conn, fake_host)
        assert header_runs(second) == 0
        assert (
            second["smi"]["cuda_version"] == "12.8"
            and second["smi"]["cached"]["driver_version"] == "570.133.07"
        )
        carried = health_facts.commit_state(second)
        assert carried is not None and carried["cuda"] == cursor["cuda"]  # carried into the next commit
        # a new driver: the header is read again and reports the new CUDA version
        (fake_host / "csv").write_text(CSV.replace("570.133.07", "575.51.03"))
        (fake_host / "header").write_text(
            HEADER.replace("570.133.07", "575.51.03").replace("CUDA Version: 12.8", "CUDA Version: 12.9")
        )
        third = _facts(conn, fake_host)
        assert header_runs(third) == 1 and "cached" not in third["smi"]
        assert third["smi"]["cuda_version"] == "12.9"
        committed = health_facts.commit_state(third)
        assert committed is not None and committed["cuda"]["driver_version"] == "575.51.03"
    finally:
        conn.close()


def test_health_url_get_over_a_plain_socket() -> None:
    """The probe's loopback GET: status, body, HTTP errors, refused ports, non-local URLs."""
    import http.server
    import socket
    import threading

    from pytest_gpuhost.exec.agent.probe_health_services import http_get

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            code = 200 if self.path == "/health" else 503
            body = b"ok" if code == 200 else b"loading model"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        ok = http_get(f"http://127.0.0.1:{port}/health", 5)
        assert (ok["status"], ok["body"], ok["error"]) == (200, "ok", None)
        bad = http_get(f"http://localhost:{port}/v1/models", 5)
        assert bad["status"] == 503 and bad["error"] == "HTTP 503 Service Unavailable"
        assert bad["body"] == "loading model"
    finally:
        srv.shutdown()
        srv.server_close()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    free = s.getsockname()[1]
    s.close()
    refused = http_get(f"http://127.0.0.1:{free}/health", 5)
    assert refused["status"] is None and refused["error"].startswith("ConnectionRefusedError:")
    assert "Connection refused" in refused["error"]
    far = http_get("http://10.0.0.1:30000/health", 5)
    assert far["error"] == "refusing a non-local health URL"


def test_upstream_bridges_from_the_sysfs_link_or_bus_ranges(tmp_path: Path) -> None:
    """One readlink gives the bridges above a GPU; a flat sysfs reads each bridge's bus range once.

    `pci_upstream` is the agent core's one bridge walk, used by the health probe and `pci_paths`.
    """
    from pytest_gpuhost.exec.agent.core import pci_upstream

    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "0000:03:00.0").symlink_to(
        "../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0"
    )
    assert pci_upstream(str(linked), "0000:03:00.0", set(), {}) == [
        "0000:02:00.0",
        "0000:01:00.0",
        "0000:00:01.0",
    ]

    flat = tmp_path / "flat"
    for bdf, lo, hi in (
        ("0000:10:01.0", 0x11, 0x14),
        ("0000:11:00.0", 0x12, 0x14),
        ("0000:12:00.0", 0x13, 0x13),
    ):
        (flat / bdf).mkdir(parents=True)
        (flat / bdf / "secondary_bus_number").write_text(f"{lo}\n")
        (flat / bdf / "subordinate_bus_number").write_text(f"{hi}\n")
    (flat / "0000:13:00.0").mkdir()
    ranges: dict[str, Any] = {}
    bridges = {"0000:10:01.0", "0000:11:00.0", "0000:12:00.0"}
    assert pci_upstream(str(flat), "0000:13:00.0", bridges, ranges) == [
        "0000:12:00.0",
        "0000:11:00.0",
        "0000:10:01.0",
    ]
    assert ranges == {
        "0000:10:01.0": (0x11, 0x14),
        "0000:11:00.0": (0x12, 0x14),
        "0000:12:00.0": (0x13, 0x13),
    }
    # the bridge set may come from a function: it is listed only for a flat sysfs
    assert pci_upstream(str(flat), "0000:13:00.0", lambda: bridges, {})[0] == "0000:12:00.0"
    assert pci_upstream(str(linked), "0000:03:00.0", lambda: pytest.fail("listed"), {})[0] == "0000:02:00.0"
    (flat / "0000:12:00.0" / "secondary_bus_number").unlink()  # read once: the cache answers now
    assert pci_upstream(str(flat), "0000:13:00.0", bridges, ranges)[0] == "0000:12:00.0"


def test_pci_ids_from_uevent_or_the_single_files(tmp_path: Path) -> None:
    dev = tmp_path / "0000:13:00.0"
    dev.mkdir()
    (dev / "uevent").write_text(
        "DRIVER=nvidia\nPCI_CLASS=30200\nPCI_ID=10DE:2BB5\nPCI_SLOT_NAME=0000:13:00.0\n"
    )
    assert probe_health_pci.pci_ids(str(dev)) == ("0x030200", "0x10de", "nvidia")
    (dev / "uevent").write_text("PCI_CLASS=60400\nPCI_ID=8086:352A\n")
    assert probe_health_pci.pci_ids(str(dev)) == ("0x060400", "0x8086", None)
    (dev / "uevent").unlink()
    (dev / "class").write_text("0x030000\n")
    (dev / "vendor").write_text("0x10de\n")
    (dev / "driver").symlink_to("../../../bus/pci/drivers/vfio-pci")
    assert probe_health_pci.pci_ids(str(dev)) == ("0x030000", "0x10de", "vfio-pci")


def test_scan_bus_lists_nvidia_gpus_whatever_their_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole bus, one uevent each: bridges, NVIDIA VGA/3D functions bound or not, NVSwitches."""
    for bdf, text in (
        ("0000:12:00.0", "DRIVER=pcieport\nPCI_CLASS=60400\nPCI_ID=1000:C030\n"),
        ("0000:13:00.0", "DRIVER=nvidia\nPCI_CLASS=30200\nPCI_ID=10DE:2BB5\n"),
        ("0000:24:00.0", "PCI_CLASS=30200\nPCI_ID=10DE:2BB5\n"),  # its nvidia probe failed
        ("0000:25:00.0", "DRIVER=vfio-pci\nPCI_CLASS=30000\nPCI_ID=10DE:2BB5\n"),
        ("0000:25:00.1", "DRIVER=vfio-pci\nPCI_CLASS=40300\nPCI_ID=10DE:22E8\n"),  # HDMI audio
        ("0000:05:00.0", "DRIVER=nvidia\nPCI_CLASS=68000\nPCI_ID=10DE:22A3\n"),  # NVSwitch
    ):
        (tmp_path / bdf).mkdir()
        (tmp_path / bdf / "uevent").write_text(text)
    monkeypatch.setattr(probe_health_pci, "SYS_PCI", str(tmp_path))
    bridges, gpus, switches = probe_health_pci.scan_bus()
    assert bridges == {"0000:12:00.0"} and switches == ["0000:05:00.0"]
    assert gpus == {
        "0000:13:00.0": {"class": "0x030200", "driver": "nvidia"},
        "0000:24:00.0": {"class": "0x030200", "driver": None},
        "0000:25:00.0": {"class": "0x030000", "driver": "vfio-pci"},
    }


def test_mountinfo_says_which_mount_holds_each_path_and_whether_it_is_read_only(tmp_path: Path) -> None:
    """Lines as /proc/self/mountinfo prints them (proc(5)); a space in a mount point is \\040."""
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro\n"
        "30 22 0:40 / /models ro,relatime shared:5 - nfs4 nas:/models rw,vers=4.2\n"
        "31 22 0:41 / /data\\040set rw,relatime - xfs /dev/sdb rw\n"
        "40 22 259:3 / /scratch rw,relatime - ext4 /dev/sdc ro,errors=remount-ro\n"
    )
    got = probe_health_mounts.fact_health_mounts(
        {
            "mountinfo": str(info),
            "data_paths": ["/", "/data set/x", "/scratch"],
            "mounts": ["/models", "/missing"],
        }
    )
    paths = got["paths"]
    assert paths["/"] == {"mount_point": "/", "fstype": "ext4", "source": "/dev/nvme0n1p2", "ro": False}
    assert paths["/models"]["ro"] is True  # per-mount ro (mount -o remount,ro)
    assert paths["/data set/x"]["mount_point"] == "/data set"
    assert paths["/scratch"]["ro"] is True  # super block ro: the kernel remounted it after errors
    assert paths["/missing"]["mount_point"] == "/"
    assert probe_health_mounts.fact_health_mounts({"mountinfo": str(tmp_path / "none")})["ok"] is False


def test_infiniband_ports_read_as_the_kernel_prints_them(tmp_path: Path) -> None:
    """drivers/infiniband/core/sysfs.c: "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)", counters."""
    port = tmp_path / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    for name, text in (
        ("state", "4: ACTIVE"),
        ("phys_state", "5: LinkUp"),
        ("rate", "400 Gb/sec (4X NDR)"),
        ("link_layer", "InfiniBand"),
    ):
        (port / name).write_text(text + "\n")
    (port / "counters" / "link_downed").write_text("3\n")
    got = probe_health_ib.fact_health_ib({"ib_root": str(tmp_path), "peermem_path": str(tmp_path / "none")})
    assert got["peermem"] is False
    p = got["ports"]["mlx5_0/1"]
    assert (p["state_num"], p["state"], p["phys_num"], p["rate_gbps"], p["link_layer"]) == (
        4,
        "ACTIVE",
        5,
        400.0,
        "InfiniBand",
    )
    assert p["counters"] == {"link_downed": 3}
    assert probe_health_ib.fact_health_ib({"ib_root": str(tmp_path / "absent")})["ports"] == {}


def test_header_versions_read_both_spellings() -> None:
    from pytest_gpuhost.exec.agent.probe_health_smi import header_versions

    root = Path(__file__).resolve().parents[2]
    text = (root / "fixtures" / "outputs" / "nvidia-smi-610.57.04-gtx1650.txt").read_text()
    assert header_versions(text) == ("610.57.04", "13.3")
    old = "| NVIDIA-SMI 570.133.20   Driver Version: 570.133.20   CUDA Version: 12.8     |"
    assert header_versions(old) == ("570.133.20", "12.8")
    assert header_versions("NVIDIA-SMI has failed") == (None, None)
