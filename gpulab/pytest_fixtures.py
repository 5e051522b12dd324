"""pytest fixtures that bring lab hosts up once per test session and tear them down at its end.

Loaded by ``tests/conftest.py`` (``pytest_plugins = [..., "gpulab.pytest_fixtures"]``). Use::

    def test_unbind(lab):
        h = lab.host("proxmox-rtx6000")     # booted on first use, shared by the whole session
        h.reset()                           # pristine host (overlay and sysfs) between scenarios
        h = lab.host("proxmox-rtx6000", pristine=True)   # the same, without a reset after a fresh boot
        assert h.ssh("cat /sys/kernel/iommu_groups/30/type").stdout == "DMA-FQ\\n"
        result = pytester.runpytest(*h.pytest_args(), "suites/p2p")

``lab.host(profile, name=None, **kw)`` takes what ``gpulab.Lab().up`` takes (``delay_ms``,
``loss_pct``, ``data_scale``) and returns a ``gpulab.LabHost``; the same (profile, name, kw) gives
the same host for the rest of the session. Without a name the host is called
``PROFILE-<pid>`` so parallel sessions (xdist workers, other runs) never collide. Every host is
torn down when the session ends, on Ctrl-C, and at interpreter exit as a safety net; hosts of a
session that was killed outright are swept by the next session that uses ``lab``. Tests that
use ``lab`` are skipped, with the reason, when the machine cannot run the lab (not root, no
/dev/fuse, no systemd), and carry the ``lab`` marker: ``pytest -m "not lab"`` leaves them out,
``pytest -m lab`` runs only them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulab.host.lab import RUN, Lab, LabError, LabHost
from gpulab.profiles.types import Profile

__all__ = ["LabSession", "lab"]


class LabSession:
    """Hosts booted for one test session, keyed by (profile, name, options)."""

    def __init__(self) -> None:
        self.lab = Lab()
        self._hosts: dict[tuple[str, str | None, tuple[tuple[str, Any], ...]], LabHost] = {}
        self._closed = False

    def host(
        self, profile: str | Path | Profile, name: str | None = None, pristine: bool = False, **kw: Any
    ) -> LabHost:
        """Return the session's host for this profile (and name, options), booting it on first use.

        ``pristine=True`` resets a host that earlier tests used (a host booted just now already is).
        """
        pname = profile.name if isinstance(profile, Profile) else Path(str(profile)).stem
        key = (pname, name, tuple(sorted(kw.items())))
        h = self._hosts.get(key)
        if h is not None:
            if pristine:
                h.reset()
            elif not h.is_running():  # its systemd died (a test killed it): bring it back
                h.reboot(start_by_hand=True)
            return h
        hname = name or f"{pname[:24]}-{os.getpid()}"
        if hname in self.lab.names():
            self.lab.down(hname)  # a leftover of a crashed session with the same name
        h = self.lab.up(profile, name=hname, **kw)
        h.meta["session_pid"] = os.getpid()  # lets a later session sweep it if this one is killed
        (h.dir / "meta.json").write_text(json.dumps(h.meta, indent=1))
        self._hosts[key] = h
        return h

    def sweep(self) -> list[str]:
        """Tear down hosts left by test sessions that died without teardown (SIGKILL); return names."""
        swept = []
        for name in self.lab.names():
            try:
                meta = json.loads((RUN / name / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            pid = meta.get("session_pid")
            if isinstance(pid, int) and pid != os.getpid() and not Path(f"/proc/{pid}").exists():
                with contextlib.suppress(LabError):
                    self.lab.down(name)
                    swept.append(name)
        return swept

    def hosts(self) -> list[LabHost]:
        """Return the hosts this session booted."""
        return list(self._hosts.values())

    def close(self) -> None:
        """Tear down every host this session booted (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for h in self._hosts.values():
            with contextlib.suppress(Exception):
                h.down()
        self._hosts.clear()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "lab: the test boots or uses lab hosts (set on every test that uses the `lab` fixture)"
    )
    config.addinivalue_line("markers", "realkernel: boots Debian kernels under QEMU (gpulab.vm)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses ``lab`` (directly or through a fixture) so ``-m "not lab"`` works."""
    for item in items:
        if "lab" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.lab)


def lab_unavailable() -> str | None:
    """Return why this machine cannot run lab hosts, or None when it can."""
    try:
        Lab().check()
    except LabError as e:
        return str(e)
    return None


@pytest.fixture(scope="session")
def lab() -> Iterator[LabSession]:
    """Hand out lab hosts booted once per session; tear them all down at the end."""
    why = lab_unavailable()
    if why:
        pytest.skip(f"lab unavailable: {why}")
    session = LabSession()
    session.sweep()
    atexit.register(session.close)
    try:
        yield session
    finally:
        session.close()
