"""Host ranges as Ansible writes them, the 100,000-host bound, and loading in linear time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.inventory import model as inventory_model
from pytest_gpuhost.exec.inventory.load import read_inventory


def _names(tmp_path: Path, key: str) -> list[str]:
    path = tmp_path / "hosts"
    path.write_text(f"[g]\n{key}\n")
    return [s.name for s in read_inventory(path).specs]


@pytest.mark.parametrize(
    ("key", "first", "last", "count"),
    [
        ("node[0:99]", "node0", "node99", 100),
        ("node[01:99:2]", "node01", "node99", 50),
        ("node[:3]", "node0", "node3", 4),
        ("rack[a:f]", "racka", "rackf", 6),
        ("rack[a:z:5]", "racka", "rackz", 6),
        ("r[1:2]-n[08:10].lan", "r1-n08.lan", "r2-n10.lan", 6),
        ("node[001:100]", "node001", "node100", 100),
    ],
)
def test_ranges(tmp_path: Path, key: str, first: str, last: str, count: int) -> None:
    names = _names(tmp_path, key)
    assert (names[0], names[-1], len(names), len(set(names))) == (first, last, count, count)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("node[01:9]", "a zero-padded begin needs an end of the same width"),
        ("node[5:1]", "the begin 5 is greater than the end 1"),
        ("node[f:a]", "the begin 'f' comes after the end 'a'"),
        ("node[0:5:0]", "the step must be a positive number"),
        ("node[a:5]", "expected numbers of at most 12 digits or single letters"),
        ("node[0:1:2:3]", "write [begin:end] or [begin:end:step]"),
        ("node[0:99999999]", "gives 100,000,000 hosts, over the limit of 100,000 hosts"),
        ("n[0:999]-[0:999]", "gives 1,000,000 hosts, over the limit of 100,000 hosts"),
        ("node[0:9999999999999999999999]", "expected numbers of at most 12 digits"),
        ("node[1:3]<b>", "host name 'node1<b>' is not a host name or an IP address"),
    ],
)
def test_bad_ranges_are_refused_with_one_line(tmp_path: Path, key: str, message: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(TargetError) as exc:
        _names(tmp_path, key)
    assert time.monotonic() - t0 < 5  # refused before anything is made
    text = str(exc.value)
    assert message in text and "\n" not in text
    assert text.startswith(f"inventory {tmp_path / 'hosts'} line 2: ")


def test_the_bound_counts_the_whole_inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("all:\n  hosts:\n    a[00000:59999]: {}\n    b[00000:59999]: {}\n")
    with pytest.raises(
        TargetError, match=r"host key 'b\[00000:59999\]' brings the inventory over 100,000 hosts"
    ):
        read_inventory(path)
    monkeypatch.setattr(inventory_model, "MAX_HOSTS", 10)  # the same rule at a size a test can fill
    path.write_text(
        "all:\n  hosts:\n    a[0:9]: {}\n    a[0:4]: {x: 1}\n"
    )  # the same names again: no new host
    assert [s.vars.get("x") for s in read_inventory(path).specs] == [1] * 5 + [None] * 5
    path.write_text("all:\n  hosts:\n    a[0:9]: {}\n    b: {}\n")
    with pytest.raises(TargetError, match=r"all\.hosts: host key 'b' brings the inventory over 10 hosts"):
        read_inventory(path)


def _cpu_seconds(path: Path) -> tuple[float, int]:
    t0 = time.process_time()  # CPU time: the machine running the tests may be shared
    n = len(read_inventory(path).specs)
    return time.process_time() - t0, n


def test_50000_hosts_load_in_linear_time(tmp_path: Path) -> None:
    def ini(n: int) -> Path:
        path = tmp_path / f"fleet{n}.ini"
        lines = []
        for rack in range(50):
            lines.append(f"[rack{rack}]")
            lines += [
                f"gpu-{i:05d} ansible_host=10.{i // 65536}.{i // 256 % 256}.{i % 256} gpu_count=8"
                for i in range(rack * n // 50, (rack + 1) * n // 50)
            ]
        lines += ["[fleet:children]", *(f"rack{r}" for r in range(50)), "[fleet:vars]", "ansible_user=root"]
        path.write_text("\n".join(lines) + "\n")
        return path

    small, n_small = _cpu_seconds(ini(5000))
    big, n_big = _cpu_seconds(ini(50000))
    ranged = tmp_path / "range.yaml"
    ranged.write_text(
        "all:\n  vars: {ansible_user: root}\n  children:\n    rack:\n      hosts:\n        node[00000:49999]: {}\n"
    )
    by_range, n_range = _cpu_seconds(ranged)
    assert (n_small, n_big, n_range) == (5000, 50000, 50000)
    print(
        f"INI 5,000 hosts {small:.2f} s, INI 50,000 hosts {big:.2f} s, one range of 50,000 {by_range:.2f} s (CPU)"
    )
    assert big < 30 * max(small, 0.05)  # linear: 10x the hosts, about 10x the time (quadratic: 100x)
    assert big < 15 and by_range < 15  # a hang guard; about 1 s each on an idle core
