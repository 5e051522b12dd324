"""A virtualenv outside the checkout with pytest-gpuhost installed from its wheel, as an operator has it.

`installed_venv(base)` builds the project's wheel from a copy of the checkout's files (tracked and
untracked-but-not-ignored, so a build never writes `build/` or an `.egg-info` into the shared
checkout), makes a fresh virtualenv (no system site-packages) and installs the wheel into it with
`pip install --no-index --find-links WHEELHOUSE`: nothing is fetched from any index.

The wheelhouse holds the wheel's dependencies, repacked from the distributions installed in the
checkout's `.venv` (the same versions the tests run with): a wheel is a zip of the files its
RECORD lists plus its `.dist-info` (PEP 427), and an installed distribution keeps both, the
`WHEEL` file with the original tag included. Files the installer wrote outside site-packages
(console scripts under bin/) are left out; pip writes them again from `entry_points.txt`.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
import io
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "pytest-gpuhost"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(root: str = PROJECT) -> list[md.Distribution]:
    """Return the installed distributions `root` needs (its base requirements, transitively)."""
    found: dict[str, md.Distribution] = {}
    done: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset())]
    while todo:
        name, extras = todo.pop()
        if (_norm(name), extras) in done:
            continue
        done.add((_norm(name), extras))
        dist = md.distribution(name)
        found[_norm(dist.metadata["Name"])] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
                todo.append((req.name, frozenset(req.extras)))
    found.pop(_norm(root), None)
    return list(found.values())


def repack(dist: md.Distribution, out: Path) -> Path:
    """Write `dist` (installed) as a wheel into `out`; return its path."""
    info = Path(str(dist._path))  # type: ignore[attr-defined]
    site = info.parent
    wheel_meta = (info / "WHEEL").read_text()
    tags = [ln.split(":", 1)[1].strip() for ln in wheel_meta.splitlines() if ln.startswith("Tag:")]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    version = dist.version
    # Several Tag lines (py2-none-any, py3-none-any) make one compressed tag (py2.py3-none-any).
    parts = [list(dict.fromkeys(t.split("-")[i] for t in tags)) for i in range(3)] if tags else []
    tag = "-".join(".".join(p) for p in parts) or "py3-none-any"
    path = out / f"{name}-{version}-{tag}.whl"
    record_name = f"{info.name}/RECORD"
    rows: list[list[str]] = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel in sorted({str(f) for f in (dist.files or [])}):
            if rel.startswith("..") or rel == record_name or "__pycache__" in rel:
                continue
            src = site / rel
            if not src.is_file():
                continue
            data = src.read_bytes()
            zf.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append([rel, f"sha256={digest}", str(len(data))])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([*rows, [record_name, "", ""]])
        zf.writestr(record_name, buf.getvalue())
    return path


def copy_checkout(dest: Path) -> Path:
    """Copy the checkout's tracked and untracked-but-not-ignored files to `dest`."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listing.split("\0")):
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the work tree, not yet committed
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copy2(src, dest / rel)
        except FileNotFoundError:
            continue  # deleted while we copied (the checkout is shared)
    return dest


def build_wheel(base: Path) -> Path:
    """Build the project's wheel (`pip wheel . --no-deps`) from a copy of the checkout."""
    src = copy_checkout(base / "src")
    out = base / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = out.glob("pytest_gpuhost-*.whl")
    return wheel


def installed_venv(base: Path) -> tuple[Path, Path]:
    """Return (venv, wheel): a fresh virtualenv under `base` with the project's wheel installed."""
    wheel = build_wheel(base)
    house = base / "wheelhouse"
    house.mkdir()
    for dist in dependency_closure():
        repack(dist, house)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(house),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return venv, wheel


@dataclass
class Installed:
    venv: Path
    wheel: Path
    work: Path  # a directory outside the checkout, the runs' working directory

    def env(self) -> dict[str, str]:
        env = {
            k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS")
        }
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env

    def run(
        self, *argv: str, timeout: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        exe = self.venv / "bin" / argv[0]  # the venv's pytest/python; other programs from PATH
        return subprocess.run(
            [str(exe) if exe.exists() else argv[0], *argv[1:]], cwd=self.work, env={**self.env(), **(env or {})},
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip


@pytest.fixture(scope="session", name="installed")
def installed_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    base = tmp_path_factory.mktemp("installed")
    assert ROOT not in base.parents
    venv, wheel = installed_venv(base)
    work = base / "ops"
    work.mkdir()
    yield Installed(venv, wheel, work)
