"""Inventories read through Ansible itself (`ansible-inventory --list`), and Ansible as the judge.

ansible-core is a test dependency (pyproject's `dev`), so `ansible-inventory` is real here: the
readers of this project must give what Ansible gives for the same files, plugin configs are read
by Ansible, and a source is executed only when the operator said `--inventory-reader=ansible`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.inventory import ansible
from pytest_gpuhost.exec.inventory.load import read_inventory
from pytest_gpuhost.exec.targets import TargetSpec

REPO = Path(__file__).resolve().parents[2]
INVENTORIES = REPO / "fixtures" / "inventories"

pytestmark = pytest.mark.skipif(
    ansible.ansible_inventory() is None, reason="ansible-inventory not installed (pip install ansible-core)"
)


@pytest.fixture(autouse=True)
def _ansible_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ansible's own state (~/.ansible/tmp) in a temporary directory, not this machine's home."""
    home = tmp_path_factory.mktemp("ansible-home")
    monkeypatch.setenv("ANSIBLE_HOME", str(home))
    monkeypatch.setenv("ANSIBLE_LOCAL_TEMP", str(home / "tmp"))


def _specs(path: Path, reader: str = "auto") -> dict[str, TargetSpec]:
    return {s.name: s for s in read_inventory(path, reader=reader).specs}


@pytest.mark.parametrize("name", ["fleet.yaml", "fleet.ini", "ansible/hosts.ini"])
def test_our_readers_give_what_ansible_gives(name: str) -> None:
    """Every inventory file the project ships, read by its readers and by ansible-inventory: the same
    hosts, in the same order, with the same URL, connection options and variables (vars directories
    too). Not ansible-list.json: Ansible reads `--list` JSON only from an executable script, and
    refuses the file ("Completely failed to parse inventory source")."""
    ours = _specs(INVENTORIES / name, "builtin")
    theirs = _specs(INVENTORIES / name, "ansible")
    assert list(ours) == list(theirs)
    for host, spec in ours.items():
        other = theirs[host]
        assert (spec.url, spec.query, spec.vars) == (other.url, other.query, other.vars), host


def test_a_directory_is_read_by_ansible_only_when_asked(tmp_path: Path) -> None:
    inv = tmp_path / "inventory"
    shutil.copytree(INVENTORIES / "ansible", inv)
    assert list(_specs(inv, "ansible")) == ["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]
    assert _specs(inv, "ansible")["gpu-node-04"].vars["gpu_count"] == 2  # host_vars/ inside the directory
    with pytest.raises(TargetError, match=r"is a directory, not a file \(--inventory-reader=ansible reads"):
        read_inventory(inv)


GENERATOR = """\
# ansible.builtin.generator: hosts from the product of its layers (ansible-doc -t inventory generator)
plugin: ansible.builtin.generator
hosts:
  name: "{{ rack }}-gpu-{{ slot }}"
  parents:
    - name: "{{ rack }}"
layers:
  rack: [r1, r2]
  slot: ["01", "02"]
"""


def test_a_plugin_config_is_read_by_ansible_and_refused_by_builtin(tmp_path: Path) -> None:
    cfg = tmp_path / "fleet.generator.yml"
    cfg.write_text(GENERATOR)
    specs = _specs(cfg)
    assert sorted(specs) == ["r1-gpu-01", "r1-gpu-02", "r2-gpu-01", "r2-gpu-02"]
    assert specs["r2-gpu-01"].vars["groups"] == ["r2"] and specs["r2-gpu-01"].hostname == "r2-gpu-01"
    with pytest.raises(
        TargetError, match=r"an Ansible inventory plugin config \(plugin: ansible.builtin.generator\)"
    ):
        read_inventory(cfg, reader="builtin")


SCRIPT = """#!/bin/sh
touch "{marker}"
echo '{{"gpu": {{"hosts": ["gpu-01"], "vars": {{"ansible_host": "198.18.7.2"}}}}, "_meta": {{"hostvars": {{}}}}}}'
"""


def test_a_script_is_run_only_under_reader_ansible(tmp_path: Path) -> None:
    """An executable inventory is a program: never run unless the operator asked Ansible to read it."""
    marker = tmp_path / "ran"
    script = tmp_path / "inventory.sh"
    script.write_text(SCRIPT.format(marker=marker))
    script.chmod(0o755)
    with pytest.raises(TargetError):
        read_inventory(script)  # read as text (INI), and its shell lines are no hosts
    assert not marker.exists()
    (spec,) = read_inventory(script, reader="ansible").specs
    assert marker.exists() and (spec.name, spec.hostname) == ("gpu-01", "198.18.7.2")


def test_hostile_names_from_ansible_are_refused_like_any(tmp_path: Path) -> None:
    script = tmp_path / "inventory.py"
    script.write_text(
        '#!/bin/sh\necho \'{"all": {"hosts": ["<img src=x onerror=alert(1)>"]}, "_meta": {"hostvars": {}}}\'\n'
    )
    script.chmod(0o755)
    with pytest.raises(TargetError, match=r"host name '<img src=x onerror=alert\(1\)>' is not a host name"):
        read_inventory(script, reader="ansible")


def test_what_ansible_cannot_parse_is_its_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yml"
    bad.write_text("plugin: no.such.plugin\n")
    with pytest.raises(TargetError) as e:
        read_inventory(bad)
    msg = str(e.value)
    assert msg.startswith(f"inventory {bad}: ansible-inventory --list exited ") and "\n" not in msg
    assert "no.such.plugin" in msg or "parse" in msg, msg


def test_without_ansible_the_error_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "fleet.generator.yml"
    cfg.write_text(GENERATOR)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))
    with pytest.raises(
        TargetError, match=r"needs Ansible's ansible-inventory, which is not installed \(pip install"
    ):
        read_inventory(cfg)


def test_the_option_reads_a_plugin_config_in_a_run(pytester: pytest.Pytester) -> None:
    pytester.makefile(".generator.yml", fleet=GENERATOR.replace("{{ rack }}-gpu", "local-{{ rack }}-gpu"))
    pytester.makepyfile("def test_t(target):\n    pass\n")
    r = pytester.runpytest(
        "--inventory=fleet.generator.yml", "--collect-only", "-q", "-p", "no:cacheprovider"
    )
    r.stdout.fnmatch_lines(["*test_t?local-r1-gpu-01?*", "*test_t?local-r2-gpu-02?*"])
    r = pytester.runpytest(
        "--inventory=fleet.generator.yml",
        "--inventory-reader=builtin",
        "--collect-only",
        "-p",
        "no:cacheprovider",
    )
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(
        ["ERROR: gpuhost: --inventory='fleet.generator.yml': bad inventory: *plugin config*"]
    )
