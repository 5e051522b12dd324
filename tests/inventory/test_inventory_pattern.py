"""--limit patterns: Ansible's syntax (checked against ansible-core), and/or/not, errors naming the term."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpuhost.exec.inventory.load import (
    PatternError,
    compile_pattern,
    read_inventory,
    select_targets,
)
from pytest_gpuhost.exec.targets import TargetSpec

REPO = Path(__file__).resolve().parents[2]
# rack1: gpu-node-01, 02; rack2: gpu-node-03, 04; gpu: rack1 + rack2
SPECS = read_inventory(REPO / "fixtures" / "inventories" / "ansible" / "hosts.ini").specs


def names(expr: str, specs: list[TargetSpec] = SPECS) -> list[str]:
    return [s.name.removeprefix("gpu-node-") for s in select_targets(specs, expr)]


# What `ansible -i fixtures/inventories/ansible/hosts.ini PATTERN --list-hosts` printed
# (ansible-core 2.19.14), in inventory order (Ansible lists a union in the order of its terms;
# a run's targets keep the inventory's order so that every xdist worker sees the same list).
ANSIBLE_SAID = {
    "rack1:rack2": ["01", "02", "03", "04"],
    "rack2,rack1": ["01", "02", "03", "04"],
    "gpu:&rack1": ["01", "02"],
    "gpu:!rack1": ["03", "04"],
    "all": ["01", "02", "03", "04"],
    "*": ["01", "02", "03", "04"],
    "gpu-node-0*": ["01", "02", "03", "04"],
    "~gpu-node-0[13]": ["01", "03"],
    "rack1:gpu-node-04": ["01", "02", "04"],
    "!rack1": ["03", "04"],
    "&rack2": ["03", "04"],
    "rack2[0]": ["03"],
    "rack2[-1]": ["04"],
    "gpu[1:2]": ["02", "03"],
    "gpu[2:]": ["03", "04"],
    "rack2:!gpu-node-03:rack1": ["01", "02", "04"],
    "rack*:&~.*0[24]": ["02", "04"],
}


@pytest.mark.parametrize(("expr", "expected"), ANSIBLE_SAID.items())
def test_ansible_patterns_select_what_ansible_selects(expr: str, expected: list[str]) -> None:
    assert names(expr) == expected


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("rack1 and not gpu-node-02", ["01"]),
        ("(rack1 or rack2) and ~gpu-node-0[13]", ["01", "03"]),
        ("not rack1", ["03", "04"]),
        ("rack1 or gpu:&rack2", ["01", "02", "03", "04"]),
        ("not (rack1 or gpu-node-04)", ["03"]),
        ("(~gpu-node-0(1|4))", ["01", "04"]),  # a regex keeps its own parentheses
        ("gpu-node-0[12]", ["01", "02"]),  # no host or group 'gpu-node-0': the subscript is a glob
    ],
)
def test_boolean_expressions_and_our_extensions(expr: str, expected: list[str]) -> None:
    assert names(expr) == expected


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("gpu:!rack9", r"^'rack9' matches no host or group of the 4 targets \(did you mean 'rack[12]'\?\)$"),
        ("rak1 or ~nod", r"^'rak1', '~nod' match no host or group of the 4 targets"),
        ("rack1:&rack2", r"^'rack1:&rack2' selects none of the 4 targets$"),
        ("rack2[5]", r"^term 'rack2\[5\]': index 5 is outside the 2 hosts it names$"),
        ("rack1 and", r"^expression ends early: 'rack1 and'$"),
        ("(rack1", r"^missing '\)' in '\(rack1'$"),
        ("rack1 rack2", r"terms are joined by ',' or ':' \(or by and/or/not\), not by spaces"),
        ("rack1,,rack2", r"has an empty term"),
        ("rack1:!", r"has an empty term"),
        ("~gpu[", r"^term '~gpu\[': bad regular expression"),
        ("", r"^empty pattern$"),
    ],
)
def test_errors_name_the_term(expr: str, message: str) -> None:
    with pytest.raises(PatternError, match=message) as exc:
        select_targets(SPECS, expr or " ")
    assert "\n" not in str(exc.value)


def test_a_host_list_file(tmp_path: Path) -> None:
    (tmp_path / "retry").write_text("# failed last night\ngpu-node-02\n\nrack2\n")
    assert names(f"@{tmp_path / 'retry'}") == ["02", "03", "04"]
    with pytest.raises(PatternError, match="cannot read the host list"):
        names(f"@{tmp_path / 'missing'}")


def test_one_host_match_by_name_and_groups() -> None:
    # run/limit.py and the merge call match(name, groups) -> bool for one host
    m = compile_pattern("gpu:!rack1")
    assert m("gpu-node-03", ["gpu", "rack2"]) and not m("gpu-node-01", ["gpu", "rack1"])
    m = compile_pattern("rack1 and not gpu-node-02")
    assert m("gpu-node-01", ["rack1"]) and not m("gpu-node-02", ["rack1"])
    with pytest.raises(PatternError, match="a subscript needs the whole host list"):
        compile_pattern("rack1[0]")("gpu-node-01", ["rack1"])


def test_select_is_linear_enough(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("all:\n  children:\n    rack:\n      hosts:\n        node[00000:19999]: {}\n")
    specs = read_inventory(path).specs
    assert len(select_targets(specs, "rack:!~node0[0-8]:&node1*")) == 10000


def test_boolean_expressions_and_their_errors() -> None:
    m = compile_pattern("rack1 and not gpu-02 or gpu-1*")
    assert (
        m("gpu-01", ["rack1"])
        and not m("gpu-02", ["rack1"])
        and m("gpu-10", [])
        and not m("gpu-03", ["rack2"])
    )
    m = compile_pattern("not (rack1 or rack2)")
    assert m("x", []) and not m("gpu-03", ["rack2"])
    for bad in ("", "rack1 and", "(rack1", "rack1 rack2", "and"):
        with pytest.raises(PatternError):
            compile_pattern(bad)
