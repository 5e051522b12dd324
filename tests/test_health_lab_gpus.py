"""suites/health against one lab host per failure mode, over real SSH (issue 15).

Each host boots a profile (fixtures/profiles/health-*.yaml) that emulates one real failure with
what the driver prints; the suite runs with an inventory that says no more than an operator's
would, and the test reads the fleet JSON: the check's outcome and its reasons.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def boot(lab: Any, profile: str) -> Any:
    """Boot one lab host of `profile`, named for this test process."""
    return lab.host(profile, name=f"hg{os.getpid() % 100000}-{profile[7:15]}")


def inject(h: Any, faults: dict[str, Any]) -> None:
    """Write the lab host's runtime faults (gpulab_tools.load_faults reads them)."""
    r = h.ssh(["sh", "-c", "cat > /var/lib/gpulab/faults.json"], input=json.dumps(faults))
    assert r.returncode == 0, r.stderr


def run_health(h: Any, tmp: Path, *extra: str, host_vars: str = "") -> dict[str, Any]:
    """Run suites/health --check-only against lab host `h`, return its fleet JSON cells."""
    known = tmp / "known_hosts"
    known.write_text(Path(h.known_hosts).read_text())
    inv = tmp / "fleet.yaml"
    inv.write_text(
        "all:\n"
        f"  vars: {{ansible_user: root{host_vars}}}\n"
        f"  hosts:\n    {h.name}: {{ansible_host: {h.address}}}\n"
    )
    argv = [
        sys.executable, "-m", "pytest", "suites/health", "-p", "no:cacheprovider",
        f"--inventory={inv}", "--ssh-identity=/run/gpulab/id_ed25519", f"--known-hosts={known}",
        "--connect-timeout=5", f"--report-dir={tmp}", "--report-name=night", f"--fleet-json={tmp}/night.json",
        "--check-only", "-o", "addopts=", *extra,
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150, check=False)
    summary = json.loads((tmp / "night.json").read_text())
    assert h.name in summary["hosts"], proc.stdout + proc.stderr
    host = summary["hosts"][h.name]
    assert host["round_trips"] <= 2, host
    return dict(host["checks"])


def test_gpu_missing_from_nvidia_smi_fails_without_an_inventory_count(lab: Any, tmp_path: Path) -> None:
    """The probe failed on one of 4 GPUs: nvidia-smi lists 3, the PCI bus says 4; no gpu_count."""
    cells = run_health(boot(lab, "health-gpu-missing"), tmp_path)
    c = cells["gpu_count"]
    assert c["outcome"] == "failed", c
    assert c["reasons"] == [
        "nvidia-smi sees 3 GPUs, the PCI bus has 4 NVIDIA display controllers not on vfio-pci",
        "0000:24:00.0 is an NVIDIA GPU on the PCI bus, driver none, but nvidia-smi does not list it",
    ]


def test_gpu_that_requires_reset_fails_and_a_renamed_field_is_read_by_its_new_name(
    lab: Any, tmp_path: Path
) -> None:
    """nvidia-smi prints [GPU requires reset] in GPU 2's cells, and knows only clocks_event_reasons."""
    h = boot(lab, "health-ok")
    inject(
        h,
        {
            "unknown_fields": ["clocks_throttle_reasons.active"],
            "gpus": {"0000:23:00.0": {"nvml_error": "GPU requires reset"}},
        },
    )
    try:
        cells = run_health(h, tmp_path)
        c = cells["gpu_count"]
        assert c["outcome"] == "failed", c
        assert c["reasons"][0].startswith(
            "GPU 2 (0000:23:00.0): nvidia-smi prints [GPU requires reset] for "
        ), c
        th = cells["throttle"]
        assert th["outcome"] == "failed", th
        assert th["reasons"] == ["GPU 2 (0000:23:00.0): throttle reasons [GPU requires reset]"]
        assert th["state"]["field"] == "clocks_event_reasons.active"
        assert cells["temperature"]["reasons"] == ["GPU 2 (0000:23:00.0): temperature [GPU requires reset]"]
        # A driver that knows neither name: the check says so instead of passing.
        inject(h, {"unknown_fields": ["clocks_throttle_reasons.active", "clocks_event_reasons.active"]})
        th = run_health(h, tmp_path)["throttle"]
        assert th["outcome"] == "skipped", th
        assert "does not know the field clocks_throttle_reasons.active" in th["summary"], th
    finally:
        inject(h, {})
