"""The wheel as an operator installs it: the plugin and the suites, run from outside the checkout.

One module-scoped virtualenv (tests/helpers/installed.py): the wheel built with
`pip wheel . --no-deps` from a copy of the checkout, installed with `pip install --no-index` into
a fresh venv in a temporary directory (no system site-packages, nothing from the checkout on
sys.path). Every command runs with that venv's `pytest` from a working directory that is not the
checkout, as `pytest --pyargs gpuhost_suites.NAME ...` (the README's "Using it" commands).
"""

from __future__ import annotations

import ast
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.installed import ROOT, Installed, installed_fixture  # noqa: F401  (fixture `installed`)


def _counts(out: str) -> dict[str, int]:
    tail = [
        ln for ln in out.strip().splitlines() if re.search(r"\d+ (passed|failed|would fix|skipped|fixed)", ln)
    ]
    found = re.findall(r"(\d+) (passed|fixed|failed|skipped|would fix|error)", tail[-1] if tail else "")
    return {k: int(n) for n, k in found}


# ---- the wheel ------------------------------------------------------------------------------


def test_wheel_holds_plugin_suites_and_manifests(installed: Installed) -> None:
    """Every module of the plugin and of the suites is in the wheel, the suites as gpuhost_suites."""
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    src = (
        installed.wheel.parent.parent / "src"
    )  # the copy the wheel was built from (others edit the checkout)
    want = {str(p.relative_to(src)) for p in (src / "pytest_gpuhost").rglob("*.py")}
    want |= {"gpuhost_suites/" + str(p.relative_to(src / "suites")) for p in (src / "suites").rglob("*.py")}
    want |= {"gpuhost_suites/manifests/" + p.name for p in (src / "fixtures" / "manifests").glob("*.yaml")}
    want |= {"pytest_gpuhost/py.typed", "gpuhost_suites/manifests/README.md", "gpuhost_suites/p2p/README.md"}
    want = {w for w in want if "__pycache__" not in w}
    assert sorted(want - names) == []
    assert not any(n.startswith(("suites/", "tests/", "gpulab/", "fixtures/")) for n in names)
    (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(installed.wheel).read(ep).decode()
    assert "gpuhost = pytest_gpuhost.plugin" in text and "gpuhost_suites = gpuhost_suites.pyargs" in text


def test_suites_import_each_other_relatively() -> None:
    """Installed, suites/ is gpuhost_suites: an absolute `suites.x` import works only in a checkout."""
    bad = []
    for path in sorted((ROOT / "suites").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "suites"]
    assert bad == [], "write `from .x import ...` (see docs/INTERNALS.md, Suites)"


def test_imports_come_from_the_venv_not_the_checkout(installed: Installed) -> None:
    r = installed.run(
        "python", "-c",
        "import sys, pytest_gpuhost, gpuhost_suites.health.conftest as h; "
        "print(pytest_gpuhost.__file__); print(h.__file__); print(sys.prefix != sys.base_prefix)",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    plugin, suite, in_venv = r.stdout.split()
    for path in (plugin, suite):
        assert Path(path).is_relative_to(installed.venv) and not Path(path).is_relative_to(ROOT), path
    assert in_venv == "True"
    r = installed.run("python", "-c", "import suites")
    assert r.returncode != 0 and "No module named 'suites'" in r.stderr


def test_pyargs_registers_the_suites_options(installed: Installed) -> None:
    """`--pyargs gpuhost_suites.NAME` knows the suites' options and ini values, and checks them."""
    for suite, option in (
        ("health", "--fix"),
        ("p2p", "--gpus"),
        ("decommission", "--manifest"),
        ("accept", "--order"),
    ):
        r = installed.run("pytest", "--pyargs", f"gpuhost_suites.{suite}", "--help")
        assert r.returncode == 0 and option in r.stdout, (suite, r.stdout[-2000:], r.stderr)
    r = installed.run("pytest", "--pyargs", "gpuhost_suites.health", "--host=local://", "--fix=bogus", "--co")
    assert r.returncode == 4, r.stdout + r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "--fix" in line and "bogus" in line and "Traceback" not in r.stderr
    r = installed.run(
        "pytest",
        "--pyargs",
        "gpuhost_suites.health",
        "--host=local://",
        "-o",
        "health_fix=service",
        "--co",
        "-q",
    )
    assert r.returncode == 0 and "unknown configuration value" not in r.stderr, r.stdout + r.stderr
    assert "test_health.py::test_service[" in r.stdout


def test_module_lists_the_suites_and_the_example_manifest(installed: Installed) -> None:
    r = installed.run("python", "-m", "gpuhost_suites")
    assert r.returncode == 0, r.stderr
    for suite in ("health", "p2p", "decommission", "accept"):
        assert f"pytest --pyargs gpuhost_suites.{suite} " in r.stdout
    r = installed.run("python", "-m", "gpuhost_suites", "manifest", "b200-node-backup")
    assert r.returncode == 0 and Path(r.stdout.strip()).is_relative_to(installed.venv), r.stdout + r.stderr
    r = installed.run("python", "-m", "gpuhost_suites", "manifest", "nope")
    assert r.returncode == 2 and "b200-node-backup" in r.stderr


# ---- each suite against the lab, from the installed venv ------------------------------------


@pytest.fixture(scope="module")
def b200(lab: Any) -> Any:
    return lab.host("b200-nvl8", name=f"pkg-b200-{os.getpid()}", data_scale="small")


@pytest.mark.lab
def test_installed_health_suite_checks_a_lab_host(installed: Installed, b200: Any) -> None:
    r = installed.run(
        "pytest", "--pyargs", "gpuhost_suites.health", *b200.pytest_args(), "--check-only",
        "--report-name=health", "-p", "no:cacheprovider", "-q",
    )  # fmt: skip
    counts = _counts(r.stdout)
    assert sum(counts.values()) >= 19 and "error" not in counts, r.stdout[-3000:] + r.stderr[-2000:]
    assert counts.get("passed", 0) >= 10, r.stdout[-3000:]
    report = json.loads((installed.work / "reports" / "health.json").read_text())
    assert report and (installed.work / "reports" / "health.html").is_file()
    assert (installed.work / "reports" / "fleet-summary.json").is_file()


@pytest.mark.lab
def test_installed_p2p_suite_plans_then_repairs_a_lab_host(installed: Installed, lab: Any) -> None:
    host = lab.host("proxmox-rtx6000", name=f"pkg-p2p-{os.getpid()}")
    n = len(host.record())
    argv = ("pytest", "--pyargs", "gpuhost_suites.p2p", *host.pytest_args(), "-p", "no:cacheprovider", "-q")
    r = installed.run(*argv, "--check-only", "--report-name=p2p-plan")
    counts = _counts(r.stdout)
    assert r.returncode == 1 and counts.get("would fix") == 9, r.stdout[-3000:] + r.stderr[-2000:]
    assert "echo identity > /sys/kernel/iommu_groups/30/type" in r.stdout
    assert host.record()[n:] == []  # check-only wrote nothing on the host
    r = installed.run(*argv, "--report-name=p2p")
    counts = _counts(r.stdout)
    assert r.returncode == 0 and counts.get("fixed", 0) >= 5, r.stdout[-3000:] + r.stderr[-2000:]
    groups = host.ssh("cat /sys/kernel/iommu_groups/30/type").stdout.strip()
    assert groups == "identity", groups


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("\n## Using it\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+#.*$", "", ln).strip() for ln in lines if ln.strip()]


def test_readme_commands_are_the_installed_suites(installed: Installed) -> None:
    """README "Using it": one `pytest --pyargs gpuhost_suites.NAME` per suite, each option one it knows."""
    commands = _readme_commands()
    assert commands[0].startswith("pip install ")
    suites: dict[str, str] = {}
    for line in commands:
        m = re.match(r"pytest --pyargs gpuhost_suites\.(\w+) ", line)
        if not m:
            continue
        suite = m.group(1)
        if suite not in suites:
            r = installed.run("pytest", "--pyargs", f"gpuhost_suites.{suite}", "--help")
            assert r.returncode == 0, r.stderr
            suites[suite] = r.stdout
        for flag in re.findall(r"(?<!\S)(--[a-z][\w-]*)", line):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}\b", suites[suite]), (suite, flag)
    assert set(suites) == {"p2p", "decommission", "health", "accept"}
    (cp,) = [ln for ln in commands if ln.startswith("cp ")]
    r = installed.run("bash", "-c", f"{cp} && python -c 'from pytest_gpuhost.modules.backup.manifest import load_manifest as m; "
                      "print(m(\"node.yaml\").name)'")  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "b200-node-backup", r.stdout + r.stderr


@pytest.mark.lab
def test_installed_decommission_suite_empties_a_lab_host(
    installed: Installed, b200: Any, s3_endpoint: Any
) -> None:
    manifest = installed.run("python", "-m", "gpuhost_suites", "manifest", "b200-node-backup").stdout.strip()
    bucket = s3_endpoint.make_bucket("pkg")
    r = installed.run(
        "pytest", "--pyargs", "gpuhost_suites.decommission", *b200.pytest_args(), f"--manifest={manifest}",
        "--backup-dir=backups/{host}", f"--backup-to=s3://{bucket}/node", f"--s3-endpoint={s3_endpoint.url}",
        "--report-name=decommission", "-p", "no:cacheprovider", "-q",
        env=s3_endpoint.env,
    )  # fmt: skip
    counts = _counts(r.stdout)
    assert r.returncode == 0 and counts.get("fixed", 0) >= 3, r.stdout[-3000:] + r.stderr[-2000:]
    backups = list((installed.work / "backups").iterdir())
    assert len(backups) == 1 and (backups[0] / "NOTES.md").is_file()
    procs = b200.ssh(["ps", "-eo", "args="]).stdout.splitlines()
    assert not any("sglang.launch_server" in p and p.startswith("python3") for p in procs)


@pytest.mark.lab
def test_installed_suites_on_a_rented_container(installed: Installed, lab: Any, s3_endpoint: Any) -> None:
    """From the wheel: a rented container (tini as PID 1, no systemd, dmesg denied) is judged, then emptied."""
    from gpulab.profiles import shape_variants

    node = lab.host(
        shape_variants.rented_container(init="tini"), name=f"pkg-ct-{os.getpid()}", data_scale="small"
    )
    r = installed.run(
        "pytest", "--pyargs", "gpuhost_suites.health", *node.pytest_args(), "--check-only",
        "--report-name=ct-health", "-p", "no:cacheprovider", "-q",
    )  # fmt: skip
    fleet = json.loads((installed.work / "reports" / "fleet-summary.json").read_text())
    ((_, host),) = fleet["hosts"].items()
    cells = host["checks"]
    blind = {c for c, cell in cells.items() if cell["outcome"] == "cannot see"}
    assert blind == {"xid", "sxid", "fabric"}, r.stdout[-3000:] + r.stderr[-2000:]
    assert not any(cell["outcome"] == "error" for cell in cells.values()), cells
    assert "sglang-qwen" not in r.stdout  # no lab name from the checkout's defaults
    manifest = installed.run("python", "-m", "gpuhost_suites", "manifest", "b200-node-backup").stdout.strip()
    bucket = s3_endpoint.make_bucket("pkgct")
    r = installed.run(
        "pytest", "--pyargs", "gpuhost_suites.decommission", *node.pytest_args(), f"--manifest={manifest}",
        "--backup-dir=ct-backups/{host}", f"--backup-to=s3://{bucket}/node", f"--s3-endpoint={s3_endpoint.url}",
        "--report-name=ct-decommission", "-p", "no:cacheprovider", "-q",
        env=s3_endpoint.env,
    )  # fmt: skip
    counts = _counts(r.stdout)
    assert r.returncode == 0 and counts.get("fixed", 0) >= 3, r.stdout[-3000:] + r.stderr[-2000:]
    procs = node.ssh(["ps", "-eo", "args="]).stdout.splitlines()
    assert not any("sglang.launch_server" in p and p.startswith("python3") for p in procs), procs
    assert not any("<defunct>" in p for p in procs), procs  # tini reaped the stopped servers
