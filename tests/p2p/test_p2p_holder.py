"""suites/p2p/holder.py: which unit a P2P run stops when none is named (gpu_holders fact rows)."""

from __future__ import annotations

from suites.p2p.holder import service_of, unit_of


def _h(pid: int, comm: str, cgroup: str, *files: str) -> dict[str, object]:
    return {"pid": pid, "comm": comm, "cmdline": comm, "files": list(files), "cgroup": cgroup}


SGLANG = _h(2231, "python3", "0::/system.slice/sglang-dp0.service", "/dev/nvidiactl", "/dev/nvidia0")
PERSISTENCED = _h(
    900, "nvidia-persistenced", "0::/system.slice/nvidia-persistenced.service", "/dev/nvidia0", "/dev/nvidia1"
)


def test_cgroup_lines_name_units_only() -> None:
    assert unit_of("0::/system.slice/sglang-qwen.service") == "sglang-qwen.service"
    assert unit_of("0::/lxc.payload.101/system.slice/sglang-qwen.service/") == "sglang-qwen.service"
    assert unit_of("0::/user.slice/user-0.slice/session-3.scope") is None
    assert unit_of("0::/") is None and unit_of("") is None


def test_the_one_unit_holding_an_in_scope_gpu_is_the_service() -> None:
    found = service_of([PERSISTENCED, SGLANG], [0, 1], None)
    assert found.unit == "sglang-dp0.service"
    assert found.why == "sglang-dp0.service, the unit whose processes hold the in-scope GPUs (pid 2231)"


def test_a_gpu_out_of_scope_or_the_control_device_names_no_service() -> None:
    found = service_of([SGLANG, PERSISTENCED], [1], None)  # SGLang holds GPU 0 only
    assert found.unit == ""
    assert "no unit holds the in-scope GPUs and none was given" in found.why


def test_two_units_stop_neither() -> None:
    other = _h(3000, "python3", "0::/system.slice/vllm.service", "/dev/nvidia1")
    found = service_of([SGLANG, other], [0, 1], None)
    assert found.unit == ""
    assert "several units hold the in-scope GPUs (sglang-dp0.service, vllm.service)" in found.why


def test_processes_started_by_hand_are_named_not_stopped() -> None:
    by_hand = _h(4242, "python3", "0::/", "/dev/nvidia0")
    found = service_of([by_hand], [0], None)
    assert found.unit == ""
    assert found.why.endswith("; held outside any unit by pid 4242 ('python3')")


def test_an_interrupted_runs_journal_names_the_unit_it_stopped() -> None:
    journal = {"service_stopped": True, "service": {"unit": "sglang-qwen.service", "where": "h/101"}}
    found = service_of([], [0], journal)  # stopped: nothing holds the GPUs now
    assert found.unit == "sglang-qwen.service" and "interrupted run" in found.why
    assert service_of([], [0], {**journal, "service_stopped": False}).unit == ""
