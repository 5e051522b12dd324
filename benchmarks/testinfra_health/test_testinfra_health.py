"""The same health checks written the straightforward testinfra way: one `host.run` per check.

The baseline benchmarks/bench_health.py compares suites/health with. Run by the benchmark as

    pytest benchmarks/testinfra_health -p no:gpuhost --hosts=paramiko://root@A,paramiko://root@B \
        --ssh-identity-file=KEY -n N

testinfra parametrizes `host` per --hosts entry; its paramiko backend opens one SSH connection
per host and worker and a new channel for every command. Each `host.run` is logged to
$TESTINFRA_CMD_LOG (one line per command) so the benchmark can count commands per host.
"""

from __future__ import annotations

import json
import os
import re

import pytest

Q = "nvidia-smi --format=csv,noheader,nounits --query-gpu="
EXPECT_GPUS = 4


def run(host, cmd: str) -> str:
    out = host.run(cmd)
    log = os.environ.get("TESTINFRA_CMD_LOG")
    if log:
        with open(log, "a") as f:
            spec = host.backend.host
            f.write(json.dumps({"host": f"{spec.name}:{spec.port or 22}", "cmd": cmd}) + "\n")
    return out.stdout


def column(host, field: str) -> list[str]:
    return [x.strip() for x in run(host, Q + field).splitlines() if x.strip()]


def test_gpu_count(host):
    assert len(column(host, "name")) == EXPECT_GPUS


def test_driver_version(host):
    assert len(set(column(host, "driver_version"))) == 1


def test_cuda_version(host):
    assert re.search(r"CUDA Version:\s*[0-9.]+", run(host, "nvidia-smi"))


def test_persistence_mode(host):
    assert set(column(host, "persistence_mode")) == {"Enabled"}


def test_ecc(host):
    assert all(v in ("0", "[N/A]") for v in column(host, "ecc.errors.uncorrected.volatile.total"))


def test_retired_pages(host):
    assert all(v in ("No", "[N/A]") for v in column(host, "retired_pages.pending"))


def test_remapped_rows(host):
    assert all(v in ("0", "No", "[N/A]") for v in column(host, "remapped_rows.failure"))


def test_xid(host):
    assert " Xid " not in run(host, "dmesg")


def test_sxid(host):
    assert "SXid" not in run(host, "dmesg")


def test_pcie_link(host):
    for row in column(
        host, "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
    ):
        gen, gen_max, width, width_max = (int(x) for x in row.split(","))
        assert gen == gen_max and width == width_max


def test_nvlink(host):
    out = run(host, "nvidia-smi nvlink -s")
    if "Link" not in out:
        pytest.skip("no NVLink")
    assert "inactive" not in out


def test_iommu_group_type(host):
    out = run(host, "for d in /sys/bus/pci/drivers/nvidia/0000:*; do cat $d/iommu_group/type; done")
    assert set(out.split()) <= {"identity"}


def test_acs(host):
    out = run(host, "lspci -vvv 2>/dev/null | grep ACSCtl || true")
    assert "ReqRedir+" not in out


def test_p2p(host):
    out = run(host, "nvidia-smi topo -p2p r")
    cells = [line.split() for line in out.splitlines()]
    rows = [t[1:] for t in cells if len(t) > 1 and t[0].startswith("GPU") and not t[1].startswith("GPU")]
    assert all(c in ("X", "OK") for r in rows for c in r)


def test_throttle(host):
    assert all(int(v, 16) & 0xE8 == 0 for v in column(host, "clocks_throttle_reasons.active"))


def test_temperature(host):
    assert max(int(v) for v in column(host, "temperature.gpu")) <= 85


def test_disk_free(host):
    line = run(host, "df -P /").splitlines()[-1].split()
    assert 100 - int(line[4].rstrip("%")) >= 10


def test_service(host):
    assert run(host, "systemctl is-active sglang-qwen.service").strip() == "active"


def test_service_health(host):
    assert run(host, "curl -sf -m 3 http://127.0.0.1:30000/health; echo rc=$?").strip().endswith("rc=0")
