"""Inventories: Ansible-style YAML and INI, variable precedence, groups, selection, errors."""

from __future__ import annotations

import pytest

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.inventory.load import load_inventory, select_targets

YAML = """
all:
  vars:
    ansible_user: root
    p2p_min_gbps: 20
  hosts:
    lonely: {ansible_host: 198.18.9.2}
  children:
    proxmox:
      vars: {container: "pct:101", p2p_min_gbps: 40}
      hosts:
        gpu-01:
          ansible_host: 198.18.1.2
          ansible_port: 2222
          expected_gpus: 8
        gpu-02:
          gpuhost_url: ssh://admin@198.18.2.2
          container: lxc:sglang
      children:
        b200:
          vars: {p2p_min_gbps: 300}
          hosts:
            node[01:03]: {expected_gpus: 8}
    workstations:
      hosts:
        here: {ansible_connection: local}
        gpu-01: {}
"""

INI = """
# fleet inventory
lonely ansible_host=198.18.9.2
[proxmox]
gpu-01 ansible_host=198.18.1.2 ansible_port=2222 expected_gpus=8 note="two words"
gpu-02 gpuhost_url=ssh://admin@198.18.2.2 container=lxc:sglang

[proxmox:vars]
container=pct:101
p2p_min_gbps=40
ansible_user=root

[b200]
node[01:03] expected_gpus=8

[b200:vars]
p2p_min_gbps=300

[fleet:children]
proxmox
b200

[all:vars]
p2p_min_gbps=20
"""


def test_yaml_inventory(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(YAML)
    specs = {s.name: s for s in load_inventory(path)}
    assert list(specs) == ["lonely", "gpu-01", "gpu-02", "node01", "node02", "node03", "here"]
    g1 = specs["gpu-01"]
    assert (g1.scheme, g1.user, g1.hostname, g1.port) == ("ssh", "root", "198.18.1.2", 2222)
    assert g1.vars["expected_gpus"] == 8 and g1.vars["p2p_min_gbps"] == 40
    assert g1.vars["gpu_count"] == 8  # the name the health suite reads
    assert g1.vars["groups"] == ["proxmox", "workstations"]
    assert g1.container is not None and (g1.container.kind, g1.container.name) == ("pct", "101")
    g2 = specs["gpu-02"]
    assert (g2.user, g2.hostname, g2.port) == ("admin", "198.18.2.2", 22)
    assert g2.container is not None and g2.container.prefix() == ["lxc-attach", "-n", "sglang", "--"]
    n2 = specs["node02"]
    assert n2.vars["p2p_min_gbps"] == 300 and n2.vars["groups"] == ["b200", "proxmox"]
    assert n2.hostname == "node02"
    assert specs["lonely"].vars["p2p_min_gbps"] == 20 and specs["lonely"].container is None
    assert specs["here"].scheme == "local"


def test_ini_inventory(tmp_path):
    path = tmp_path / "hosts"
    path.write_text(INI)
    specs = {s.name: s for s in load_inventory(path)}
    assert set(specs) == {"lonely", "gpu-01", "gpu-02", "node01", "node02", "node03"}
    g1 = specs["gpu-01"]
    assert (g1.user, g1.hostname, g1.port) == ("root", "198.18.1.2", 2222)
    assert g1.vars["expected_gpus"] == 8 and g1.vars["note"] == "two words" and g1.vars["p2p_min_gbps"] == 40
    assert g1.vars["groups"] == ["fleet", "proxmox"]
    assert g1.container is not None and g1.container.kind == "pct"
    assert specs["gpu-02"].container is not None and specs["gpu-02"].container.kind == "lxc"
    assert specs["node03"].vars["p2p_min_gbps"] == 300
    assert specs["lonely"].vars["groups"] == ["ungrouped"] and specs["lonely"].vars["p2p_min_gbps"] == 20


def test_select_targets(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(YAML)
    specs = load_inventory(path)
    names = lambda expr: [s.name for s in select_targets(specs, expr)]  # noqa: E731
    assert names("b200") == ["node01", "node02", "node03"]
    assert names("proxmox,!b200") == ["gpu-01", "gpu-02"]
    assert names("proxmox:&workstations") == ["gpu-01"]
    assert names("node0*") == ["node01", "node02", "node03"]
    assert names(None) == [s.name for s in specs]


def test_missing_file(tmp_path):
    with pytest.raises(TargetError, match=r"^inventory file .*nope\.yaml not found$"):
        load_inventory(tmp_path / "nope.yaml")


def test_bad_yaml_says_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("all:\n  hosts:\n    a: {x: 1\n    b: 2\n")
    with pytest.raises(TargetError) as exc:
        load_inventory(path)
    msg = str(exc.value)
    assert msg.startswith(f"bad YAML in inventory {path} line ") and "\n" not in msg


def test_bad_ini_says_file_and_line(tmp_path):
    path = tmp_path / "hosts.ini"
    path.write_text("[gpu]\ngpu-01 ansible_host=1.2.3.4\ngpu-02 oops\n")
    with pytest.raises(TargetError, match=r"bad INI in inventory .*hosts\.ini line 3: expected key=value"):
        load_inventory(path)
    path.write_text("[gpu\n")
    with pytest.raises(TargetError, match="line 1: unterminated section"):
        load_inventory(path)
    path.write_text("[fleet:children]\nmissing\n")
    with pytest.raises(TargetError, match="line 2: unknown child group 'missing'"):
        load_inventory(path)


def test_bad_structure_and_urls(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text("all:\n  hosts:\n    gpu-01: {gpuhost_url: 'ftp://x'}\n")
    with pytest.raises(TargetError, match="host 'gpu-01': unknown target scheme 'ftp'"):
        load_inventory(path)
    path.write_text("all:\n  host:\n    a: {}\n")
    with pytest.raises(TargetError, match="unknown key"):
        load_inventory(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(TargetError, match="top level must be a mapping"):
        load_inventory(path)
