"""The lab sysfs tree builds only the node asked for: every listed name resolves, nothing else does.

In process (no FUSE mount): `SysfsTree` over a `HostModel` of each profile. A device directory's
listing (`_device_names`) and its lookups (`_device_attr`) are written separately, so this checks
that they agree, for every function of every profile.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from gpulab.kernel.model import HostModel
from gpulab.profiles.load import load_profile

SysfsTree = pytest.importorskip(
    "gpulab.kernel.sysfs_tree", reason="the lab's sysfs needs libfuse", exc_type=ImportError
).SysfsTree
mfusepy = pytest.importorskip("mfusepy")  # loaded by gpulab.kernel.sysfs_tree just above

PROFILES = sorted(
    p.stem for p in (Path(__file__).resolve().parents[1] / "fixtures" / "profiles").glob("*.yaml")
)
ABSENT = (
    "nothing",
    "secondary_bus_number",
    "current_link_speed",
    "aer_dev_fatal",
    "driver",
    "drm",
    "iommu_group",
)


class _Tree(SysfsTree):
    def __init__(self, model: HostModel) -> None:
        self.model = model


@pytest.mark.parametrize("profile", PROFILES)
def test_listing_and_lookup_agree(profile: str, tmp_path: Path) -> None:
    tree = _Tree(HostModel(load_profile(profile), str(tmp_path), str(tmp_path)))
    for bdf in tree.model.functions:
        base = f"/pci/devices/{bdf}"
        listed = tree.lookup(base).children()
        assert listed == sorted(set(listed)), bdf
        for name in listed:
            node = tree.lookup(f"{base}/{name}")
            if node.read is not None:
                assert node.read().endswith("\n"), (bdf, name)
            if node.kind == "dir":  # drm/: cardN, renderD(128+N), each with dev and uevent
                for sub in node.children():
                    assert tree.lookup(f"{base}/{name}/{sub}").kind == "dir"
                    dev = tree.lookup(f"{base}/{name}/{sub}/dev").read
                    assert dev is not None
                    assert dev() == f"226:{sub.removeprefix('card').removeprefix('renderD')}\n"
        for name in ABSENT:
            if name not in listed:
                with pytest.raises(mfusepy.FuseOSError) as exc:
                    tree.lookup(f"{base}/{name}")
                assert exc.value.errno == errno.ENOENT, (bdf, name)
        with pytest.raises(mfusepy.FuseOSError):
            tree.lookup(f"{base}/vendor/x")
