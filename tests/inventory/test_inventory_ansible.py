"""Ansible conventions in inventories: ssh_*/become variables, vars directories, --list JSON, typos, names."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from pytest_gpuhost.errors import GpuhostError, TargetError
from pytest_gpuhost.exec.inventory.load import InventoryWarning, load_inventory, read_inventory
from pytest_gpuhost.exec.targets import TargetSpec

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "fixtures" / "inventories" / "ansible"


def _specs(path: Path) -> dict[str, TargetSpec]:
    return {s.name: s for s in read_inventory(path).specs}


def _one(tmp_path: Path, text: str, name: str = "inv.yaml") -> TargetSpec:
    path = tmp_path / name
    path.write_text(text)
    (spec,) = read_inventory(path).specs
    return spec


def test_ssh_variables_map_onto_the_url(tmp_path: Path) -> None:
    spec = _one(
        tmp_path,
        "all:\n  hosts:\n    gpu-01:\n      ansible_ssh_host: 198.18.1.2\n      ansible_ssh_port: 2222\n"
        "      ansible_ssh_user: ops\n      ansible_ssh_private_key_file: ~/.ssh/fleet\n",
    )
    assert (spec.scheme, spec.user, spec.hostname, spec.port) == ("ssh", "ops", "198.18.1.2", 2222)
    assert spec.query["identity"] == str(Path("~/.ssh/fleet").expanduser())
    assert "sudo" not in spec.query


def test_ssh_names_win_over_short_names_as_in_ansible(tmp_path: Path) -> None:
    # Ansible's ssh plugin reads ansible_host then ansible_ssh_host and keeps the last one set.
    spec = _one(
        tmp_path,
        "[g]\nh ansible_host=10.0.0.1 ansible_ssh_host=10.0.0.2 ansible_user=a ansible_ssh_user=b\n",
        "hosts",
    )
    assert (spec.hostname, spec.user) == ("10.0.0.2", "b")


def test_become_is_sudo(tmp_path: Path) -> None:
    spec = _one(
        tmp_path, "[g]\nh ansible_become=yes ansible_become_method=sudo ansible_become_user=root\n", "hosts"
    )
    assert spec.query["sudo"] == "1" and spec.url.endswith("?sudo=1")
    spec = _one(tmp_path, "all:\n  hosts:\n    h: {ansible_become: false, ansible_become_method: su}\n")
    assert "sudo" not in spec.query  # not used, so not refused
    spec = _one(tmp_path, "all:\n  hosts:\n    h: {ansible_connection: local, ansible_become: true}\n")
    assert (spec.scheme, spec.query["sudo"]) == ("local", "1")
    spec = _one(tmp_path, "all:\n  hosts:\n    h: {gpuhost_url: 'ssh://x@h:2200', ansible_become: true}\n")
    assert (spec.user, spec.port, spec.query["sudo"]) == ("x", 2200, "1")


@pytest.mark.parametrize(
    ("hostvars", "message"),
    [
        (
            "ansible_become: true, ansible_become_method: su",
            "ansible_become_method='su' is not supported: only sudo",
        ),
        (
            "ansible_become: true, ansible_become_user: postgres",
            "ansible_become_user='postgres' is not supported: only root",
        ),
        ("ansible_become: maybe", "ansible_become='maybe': expected true or false"),
        ("ansible_ssh_port: abc", "ansible_port='abc': expected a port number from 1 to 65535"),
        ("ansible_port: 70000", "ansible_port=70000: expected a port number"),
        ("ansible_connection: winrm", "ansible_connection='winrm' is not supported"),
        ("ansible_host: '{{ inventory_hostname }}.lan'", "Jinja templates are not expanded"),
    ],
)
def test_connection_variables_refused_with_one_line(tmp_path: Path, hostvars: str, message: str) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(f"all:\n  hosts:\n    gpu-01: {{{hostvars}}}\n")
    with pytest.raises(TargetError) as exc:
        read_inventory(path)
    text = str(exc.value)
    assert message in text and "\n" not in text
    assert text.startswith(f"inventory {path}: host 'gpu-01': ")


def test_other_connections(tmp_path: Path) -> None:
    spec = _one(
        tmp_path, "all:\n  hosts:\n    c1: {ansible_connection: community.docker.docker, ansible_user: app}\n"
    )
    assert (spec.scheme, spec.hostname, spec.user) == ("docker", "c1", "app")
    spec = _one(
        tmp_path,
        "all:\n  hosts:\n    p: {ansible_connection: kubectl, ansible_kubectl_namespace: gpu, ansible_python_interpreter: auto_silent}\n",
    )
    # Ansible's auto*: the interpreter is discovered (exec/pythons.py), so none is named
    assert (spec.scheme, spec.query["namespace"], spec.query.get("python")) == ("kubectl", "gpu", None)


def test_vars_directories_follow_ansible_precedence() -> None:
    specs = _specs(ANSIBLE / "hosts.ini")
    n1, n2, n3, n4 = (specs[f"gpu-node-0{i}"] for i in range(1, 5))
    # [gpu:vars] says 85, group_vars/all.yml 84 (all of group_vars beats the inventory file's
    # group vars), group_vars/rack1/thermal.yml 83 (a directory of files)
    assert [s.vars["temperature_max"] for s in (n1, n2, n3, n4)] == [83, 83, 84, 84]
    assert n4.vars["gpu_count"] == 2 and n3.vars["gpu_count"] == 4  # host_vars/gpu-node-04.yml
    assert (n3.hostname, n4.hostname) == ("198.18.3.2", "198.18.4.2")  # host_vars/NAME without suffix
    assert n3.vars["pcie_width_min"] == 8 and "pcie_width_min" not in n1.vars  # group_vars/rack2.yaml
    assert n1.query == {"identity": "/run/gpulab/id_ed25519", "sudo": "1"}  # group_vars/rack1/ssh.yaml
    assert (n2.user, n2.port) == ("ops", 2222) and n3.vars["groups"] == ["gpu", "rack2"]


def test_ansible_inventory_list_json_gives_what_ansible_gave() -> None:
    # ansible-list.json is `ansible-inventory -i ansible/hosts.ini --list` (ansible-core 2.19.14),
    # so the directory layout read here and Ansible's own reading of it must agree.
    ours = _specs(ANSIBLE / "hosts.ini")
    theirs = _specs(REPO / "fixtures" / "inventories" / "ansible-list.json")
    assert list(ours) == list(theirs)
    for name, spec in ours.items():
        assert (spec.url, spec.vars) == (theirs[name].url, theirs[name].vars), name


def test_script_json_forms(tmp_path: Path) -> None:
    path = tmp_path / "dyn.json"
    path.write_text(
        json.dumps(
            {
                "rack1": ["gpu-01", "gpu-02"],  # a bare list, as inventory scripts print
                "lab": {"hosts": ["gpu-03"], "vars": {"gpu_count": 2}, "children": ["rack1"]},
                "_meta": {"hostvars": {"gpu-01": {"ansible_host": "198.18.1.2"}, "lonely": {}}},
            }
        )
    )
    specs = _specs(path)
    assert list(specs) == ["gpu-01", "gpu-02", "gpu-03", "lonely"]
    assert specs["gpu-01"].hostname == "198.18.1.2" and specs["gpu-01"].vars["gpu_count"] == 2
    assert specs["gpu-01"].vars["groups"] == ["lab", "rack1"] and specs["lonely"].vars["groups"] == [
        "ungrouped"
    ]
    path.write_text('{"_meta": {"hostvars": {}},\n "g": {"hosts": "gpu-01"}}')
    with pytest.raises(TargetError, match=r"dyn\.json: g\.hosts: expected a list of names"):
        read_inventory(path)
    path.write_text('{"_meta": {},\n "g": [1,]}')
    with pytest.raises(TargetError, match=r"^bad JSON in inventory .*dyn\.json line 2: "):
        read_inventory(path)


def test_misspelled_keys_warn_once_with_host_and_file(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text(
        "[g]\ngpu-01 ansibel_host=10.0.0.1\ngpu-02 ansibel_host=10.0.0.2 gpuhost_gpus_expected=8\n"
    )
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "g.yml").write_text("gpu_cuont: 8\ntemprature_max: 80\nmy_own_note: fine\n")
    inv = read_inventory(path, known_vars=["temperature_max"])
    assert inv.warnings == [
        f"inventory {path} line 2: host 'gpu-01' sets unknown variable 'ansibel_host' (and 1 more place):"
        " did you mean 'ansible_host'? It is kept as is.",
        f"inventory {path} line 3: host 'gpu-02' sets unknown variable 'gpuhost_gpus_expected':"
        " gpuhost_ variables are gpuhost_container, gpuhost_url. It is kept as is.",
        f"{tmp_path / 'group_vars' / 'g.yml'}: group 'g' sets unknown variable 'gpu_cuont': did you mean 'gpu_count'? It is kept as is.",
        f"{tmp_path / 'group_vars' / 'g.yml'}: group 'g' sets unknown variable 'temprature_max': did you mean 'temperature_max'? It is kept as is.",
    ]
    assert inv.specs[0].vars["ansibel_host"] == "10.0.0.1" and inv.specs[0].hostname == "gpu-01"
    with pytest.warns(InventoryWarning) as issued:
        load_inventory(path, known_vars=["temperature_max"])
    assert [str(w.message) for w in issued] == inv.warnings


def test_vars_directory_files_that_name_nothing_are_reported(tmp_path: Path) -> None:
    shutil.copytree(ANSIBLE, tmp_path / "inv")
    (tmp_path / "inv" / "group_vars" / "rak1.yml").write_text("x: 1\n")
    (tmp_path / "inv" / "host_vars" / "gpu-node-04.json").write_text('{"gpu_count": 9}')
    (tmp_path / "inv" / "host_vars" / "README.md").write_text("not vars\n")
    inv = read_inventory(tmp_path / "inv" / "hosts.ini")
    assert inv.warnings == [
        f"{tmp_path / 'inv' / 'group_vars' / 'rak1.yml'}: no group 'rak1' in the inventory (did you mean 'rack1'?); ignored",
        f"{tmp_path / 'inv' / 'host_vars' / 'gpu-node-04.json'}: gpu-node-04.yml is read for host 'gpu-node-04',"
        " not this file (Ansible reads only the first); ignored",
    ]
    assert {s.name: s.vars["gpu_count"] for s in inv.specs}["gpu-node-04"] == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("- a\n", r"group_vars/all\.yml: expected a mapping of variable names to values, got list"),
        (
            "x: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n  6162\n",
            r"group_vars/all\.yml line 1: an ansible-vault value",
        ),
        (
            "$ANSIBLE_VAULT;1.1;AES256\n6162\n",
            r"group_vars/all\.yml: the file is encrypted with ansible-vault",
        ),
        ("a: [1\n", r"bad YAML in inventory .*group_vars/all\.yml line 2"),
        ("1bad: x\n", r"group_vars/all\.yml: group 'all' has variable '1bad': a variable name is letters"),
    ],
)
def test_bad_vars_files(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "hosts").write_text("gpu-01\n")
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "all.yml").write_text(content)
    with pytest.raises(GpuhostError, match=message) as exc:
        read_inventory(tmp_path / "hosts")
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "name",
    [
        "<img src=x onerror=alert(1)>",
        "gpu\x1b[31m01",
        "gpu-01\n",
        "-oProxyCommand=x",
        "a b",
        "fe80::1%<b>",
        "gpu-01;rm",
    ],
)
def test_hostile_host_names_are_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / "inv.json"
    path.write_text(json.dumps({"_meta": {"hostvars": {}}, "g": {"hosts": [name]}}))
    with pytest.raises(TargetError) as exc:
        read_inventory(path)
    text = str(exc.value)
    assert "is not a host name or an IP address" in text and "\n" not in text and "\x1b" not in text
    path = tmp_path / "inv.yaml"
    path.write_text(f"all:\n  hosts:\n    {json.dumps(name)}: {{ansible_host: 10.0.0.1}}\n")
    with pytest.raises(TargetError, match="is not a host name or an IP address"):
        read_inventory(path)


def test_hostile_group_and_variable_names_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text('all:\n  children:\n    "<script>": {hosts: {gpu-01: {}}}\n')
    with pytest.raises(
        TargetError, match=r"all\.children\.<script>: group name '<script>' is not a group name"
    ):
        read_inventory(path)
    path.write_text('all:\n  hosts:\n    gpu-01: {"x<y": 1}\n')
    with pytest.raises(TargetError, match=r"host 'gpu-01' has variable 'x<y'"):
        read_inventory(path)
    path.write_text('all:\n  hosts:\n    gpu-01: {note: "<b>kept</b>\\u001b"}\n')
    (spec,) = read_inventory(path).specs  # values are data: kept, and escaped where shown
    assert spec.vars["note"] == "<b>kept</b>\x1b"


def test_host_port_keys_and_ipv6(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("[g]\ngpu-01:2222\n[fe80::1]:2200\n2001:db8::7\nnode[1:2]:2300\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specs = {s.name: s for s in load_inventory(path)}
    assert [(s.hostname, s.port) for s in specs.values()] == [
        ("gpu-01", 2222), ("fe80::1", 2200), ("2001:db8::7", 22), ("node1", 2300), ("node2", 2300)
    ]  # fmt: skip


def test_markup_host_name_stops_the_run_with_one_line(pytester: pytest.Pytester) -> None:
    # this name once became live HTML in the report's test-id column; now it never gets there
    pytester.makefile(
        ".yaml", fleet='all:\n  hosts:\n    "<img src=x onerror=alert(1)>": {gpuhost_url: "local://"}\n'
    )
    pytester.makepyfile("def test_t(target):\n    pass\n")
    result = pytester.runpytest("--inventory=fleet.yaml", "--report-dir=none", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: gpuhost: --inventory='fleet.yaml': bad inventory: *host name '<img src=x onerror=alert(1)>' is not a host name*"
        ]
    )
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


def test_files_without_a_telling_suffix(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("# plain list of hosts, Ansible INI\ngpu-01\ngpu-02:2222\n")
    assert [(s.name, s.port) for s in read_inventory(tmp_path / "a").specs] == [
        ("gpu-01", 22),
        ("gpu-02", 2222),
    ]
    (tmp_path / "b").write_text("---\nall:\n  hosts:\n    gpu-01:\n")
    assert [s.name for s in read_inventory(tmp_path / "b").specs] == ["gpu-01"]
    (tmp_path / "c").write_text('{"_meta": {"hostvars": {"gpu-01": {}}}}')
    assert [s.name for s in read_inventory(tmp_path / "c").specs] == ["gpu-01"]


def test_group_cycles_and_deep_nesting_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("[a]\nh1\n[b]\nh2\n[a:children]\nb\n[b:children]\na\n")
    with pytest.raises(TargetError, match=r"^inventory .*hosts: group '[ab]' is its own ancestor"):
        read_inventory(path)
    path = tmp_path / "deep.json"
    groups = {f"g{i}": {"children": [f"g{i + 1}"]} for i in range(5000)}
    path.write_text(json.dumps({"_meta": {"hostvars": {}}, **groups, "g5000": ["h"]}))
    with pytest.raises(TargetError, match=r"^inventory .*deep\.json: .*nested too deeply$"):
        read_inventory(path)
