"""Which GPUs one `nvidia-smi -r` must take together (modules/health/reset_set.py), case by case.

The cases are nvidia-smi(1)'s, `-r`: before Ampere a GPU's NVLink peers go with it; from Ampere
on, alone on direct NVLink, alone on NVSwitches while Fabric Manager runs, with its peers when it
does not (the table; its Hopper sentence reads alone, and the set is what both readings accept).
"""

from __future__ import annotations

from pytest_gpuhost.modules import parsers
from pytest_gpuhost.modules.health.reset_set import Node, nvlink_peers, plan_sets, together_why

# nvidia-smi topo -m of four GPUs bridged in pairs (0-1, 2-3), PCIe between the pairs
TOPO = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV4\tNODE\tNODE\t0-31\t0\t\tN/A\n"
    "GPU1\tNV4\t X \tNODE\tNODE\t0-31\t0\t\tN/A\n"
    "GPU2\tNODE\tNODE\t X \tNV4\t0-31\t0\t\tN/A\n"
    "GPU3\tNODE\tNODE\tNV4\t X \t0-31\t0\t\tN/A\n"
    "\nLegend:\n\n  X    = Self\n"
)
BUSES = {"0": "0000:13:00.0", "1": "0000:14:00.0", "2": "0000:23:00.0", "3": "0000:24:00.0"}
DIRECT, SWITCHED = Node(nvswitch=False, fabric_manager=False), Node(nvswitch=True, fabric_manager=False)


def _peers() -> dict[str, set[str]]:
    return nvlink_peers(parsers.parse_topo_matrix(TOPO).links, BUSES)


def test_nvlink_peers_are_the_nv_cells_of_topo_m() -> None:
    assert _peers() == {
        "0000:13:00.0": {"0000:14:00.0"},
        "0000:14:00.0": {"0000:13:00.0"},
        "0000:23:00.0": {"0000:24:00.0"},
        "0000:24:00.0": {"0000:23:00.0"},
    }


def test_the_cases_of_nvidia_smi_1() -> None:
    fm = Node(nvswitch=True, fabric_manager=True)
    assert together_why("Tesla V100-SXM2-32GB", DIRECT) == "Tesla V100-SXM2-32GB is Volta, before Ampere"
    assert together_why("Tesla V100-SXM2-32GB", fm) is not None  # pre-Ampere: FM or not
    assert together_why("NVIDIA A100-SXM4-80GB", DIRECT) is None  # Ampere on direct NVLink: alone
    assert together_why("NVIDIA A100-SXM4-80GB", fm) is None  # on NVSwitches, FM running: alone
    assert together_why("NVIDIA A100-SXM4-80GB", SWITCHED) == (
        "Ampere on NVSwitches, Fabric Manager not running (nvidia-fabricmanager.service)"
    )
    # Hopper on NVSwitches without FM: the table's reading, the one nvidia-smi accepts either way
    assert together_why("NVIDIA H100 80GB HBM3", SWITCHED) is not None
    assert together_why("NVIDIA B200", Node(nvswitch=None, fabric_manager=False)) == (
        "Blackwell maybe on NVSwitches (not known), Fabric Manager not running (nvidia-fabricmanager.service)"
    )
    assert together_why("NVIDIA GeForce RTX 2080 Ti", DIRECT) == (
        "the architecture of NVIDIA GeForce RTX 2080 Ti is not known, so it may be before Ampere"
    )


def test_a_set_is_the_gpu_and_its_peers_and_two_owed_gpus_of_one_set_are_one_reset() -> None:
    names = dict.fromkeys(BUSES.values(), "Quadro GV100")
    sets = plan_sets(["0000:14:00.0"], names, _peers(), DIRECT)
    assert [(s.gpus, s.owed) for s in sets] == [(["0000:13:00.0", "0000:14:00.0"], ["0000:14:00.0"])]
    assert sets[0].why == "Quadro GV100 is Volta, before Ampere"
    both = plan_sets(["0000:13:00.0", "0000:14:00.0", "0000:24:00.0"], names, _peers(), DIRECT)
    assert [(s.gpus, s.owed) for s in both] == [
        (["0000:13:00.0", "0000:14:00.0"], ["0000:13:00.0", "0000:14:00.0"]),
        (["0000:23:00.0", "0000:24:00.0"], ["0000:24:00.0"]),
    ]


def test_gpus_that_may_be_reset_alone_are_sets_of_one() -> None:
    names = dict.fromkeys(BUSES.values(), "NVIDIA A100-SXM4-80GB")
    sets = plan_sets(["0000:14:00.0", "0000:23:00.0"], names, _peers(), DIRECT)
    assert [(s.gpus, s.why) for s in sets] == [(["0000:14:00.0"], ""), (["0000:23:00.0"], "")]
    no_links = plan_sets(["0000:14:00.0"], names, {}, SWITCHED)  # no NVLink peer: alone whatever the node
    assert [s.gpus for s in no_links] == [["0000:14:00.0"]]


def test_the_set_is_closed_over_peers_of_peers() -> None:
    """A chain 0-1-2 (a peer reset in the command brings its own peers)."""
    names = dict.fromkeys(BUSES.values(), "NVIDIA A100-SXM4-80GB")
    chain = {"a": {"b"}, "b": {"a", "c"}, "c": {"b"}, "d": set()}
    sets = plan_sets(["a"], dict.fromkeys(chain, names["0000:13:00.0"]), chain, SWITCHED)
    assert [s.gpus for s in sets] == [["a", "b", "c"]]
