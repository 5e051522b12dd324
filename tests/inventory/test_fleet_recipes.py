"""docs/fleet.md's "Recipes" block, run line by line as written, from a pip-installed virtualenv.

The virtualenv (tests/helpers/installed.py) is outside the checkout and holds the wheel only; the
recipes run in a working directory of their own with that venv's bin/ first on PATH. The names
in the recipes (`fleet.yaml`, `gpu-node-01`, `gpu-node-07`, group `rack1`) are lab hosts: the
inventory is written here, and an ssh_config (given as `--ssh-config` in PYTEST_ADDOPTS, as an
operator's ~/.ssh/config) maps the names to the hosts' addresses, key and known_hosts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpulab.host.lab import CLIENT_KEY
from tests.helpers.installed import ROOT, Installed, installed_fixture  # noqa: F401  (fixture `installed`)

DOC = ROOT / "docs" / "fleet.md"


def recipes() -> list[str]:
    """Return the command lines of the Recipes section's code block (comments dropped)."""
    text = DOC.read_text()
    section = text.split("\n## Recipes\n", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"\n((?:    \S.*\n)+)", section)
    assert len(block) == 1, "docs/fleet.md: the Recipes section has one code block"
    lines = [ln[4:] for ln in block[0].splitlines()]
    return [re.sub(r"\s+#.*$", "", ln).strip() for ln in lines]


def test_recipes_are_the_documented_commands() -> None:
    lines = recipes()
    assert lines[0] == "pip install pytest-gpuhost"
    assert all(
        ln.startswith(("pytest --pyargs gpuhost_suites.", "python -m pytest_gpuhost.")) for ln in lines[1:]
    )


@pytest.fixture(scope="module")
def fleet(lab: Any, installed: Installed) -> dict[str, Any]:
    """Two lab hosts behind the names gpu-node-01 (healthy) and gpu-node-07 (persistence off)."""
    hosts = {
        "gpu-node-01": lab.host("health-ok", name=f"rcp01-{os.getpid()}"),
        "gpu-node-07": lab.host("health-no-persistence", name=f"rcp07-{os.getpid()}"),
    }
    work = installed.work / "fleet"
    work.mkdir()
    known = work / "known_hosts"
    known.write_text("".join(Path(h.known_hosts).read_text() for h in hosts.values()))
    blocks = [f"Host {name}\n  HostName {h.address}\n" for name, h in hosts.items()]
    common = (
        f"Host gpu-node-*\n  User root\n  IdentityFile {CLIENT_KEY}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {known}\n  StrictHostKeyChecking yes\n"
    )
    (work / "ssh_config").write_text("".join(blocks) + common)
    (work / "fleet.yaml").write_text(
        "all:\n  children:\n    rack1:\n      hosts:\n        gpu-node-01: {}\n        gpu-node-07: {}\n"
    )
    return {"work": work, "hosts": hosts}


def _run(installed: Installed, work: Path, line: str) -> subprocess.CompletedProcess[str]:
    env = installed.env()
    env["PYTEST_ADDOPTS"] = f"--ssh-config={work / 'ssh_config'} -p no:cacheprovider"
    return subprocess.run(
        ["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def _summary(work: Path) -> dict[str, Any]:
    return json.loads((work / "reports" / "fleet-summary.json").read_text())


@pytest.mark.lab
def test_fleet_recipes_run_as_written(installed: Installed, fleet: dict[str, Any]) -> None:
    work: Path = fleet["work"]
    install, nightly, limited, fix, merge = recipes()
    # `pip install pytest-gpuhost` is what the `installed` venv did, from the wheel (offline)
    assert shlex.split(install)[:2] == ["pip", "install"]
    r = _run(installed, work, "pip show pytest-gpuhost && python -c 'import gpuhost_suites.health'")
    assert r.returncode == 0, r.stderr

    r = _run(installed, work, nightly)
    out = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 1, out
    hosts = _summary(work)["hosts"]
    assert set(hosts) == {"gpu-node-01", "gpu-node-07"}, out
    assert hosts["gpu-node-01"]["status"] == "ok", hosts["gpu-node-01"]
    assert hosts["gpu-node-07"]["checks"]["persistence_mode"]["outcome"] == "failed", out
    bad = [c for c, v in hosts["gpu-node-07"]["checks"].items() if v["outcome"] == "failed"]
    assert bad == ["persistence_mode"], bad

    r = _run(installed, work, limited)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert set(_summary(work)["hosts"]) == {"gpu-node-01"}

    r = _run(installed, work, fix)
    out = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, out
    seven = _summary(work)["hosts"]["gpu-node-07"]
    assert seven["checks"]["persistence_mode"]["outcome"] == "fixed", seven["checks"]["persistence_mode"]

    r = _run(installed, work, merge)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    page = (work / "fleet.html").read_text()
    assert "gpu-node-07" in page
