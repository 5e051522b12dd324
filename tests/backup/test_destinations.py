"""Per-target backup destinations: refused when shared, one safe component per host, no collisions."""

from __future__ import annotations

import random
import unicodedata

import pytest

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules.backup.destination import DestinationError, host_component, per_target

HOSTILE = [
    "..",
    ".",
    "",
    "a/b",
    "a_b",
    "../etc",
    "/",
    "A",
    "a",
    "gpu-01",
    "GPU-01",
    "ｇｐｕ-01",  # full-width: NFKC gives "gpu-01"
    "gpu\u201001",  # U+2010 HYPHEN, looks like "-"
    "gpu-0\u0131",  # dotless i
    "caf\u00e9",  # NFC é
    "cafe\u0301",  # NFD e + combining acute: same text, other bytes
    "x\x00y",
    "x\ny",
    "x\x7fy",
    "-rf",
    ".hidden",
    "a" * 64,
    "a" * 65,
    "a" * 10_000,
    "\u00df",  # ß, casefolds to "ss"
    "ss",
    "host~0123456789abcdef",  # what an escaped name looks like
    "admin@198.18.2.2",
    "[::1]:2222",
    "ssh://root@gpu-01",
    "\udcff",  # a lone surrogate (surrogateescape of byte 0xff)
]


def _safe(component: str) -> None:
    assert component and component not in (".", "..")
    assert "/" not in component and "\\" not in component
    assert all(32 < ord(c) < 127 for c in component), component
    assert not component.startswith(("-", "."))
    assert len(component.encode()) <= 64
    # case folding and Unicode normalisation leave it as it is: nothing left to merge on
    assert component == component.casefold() == unicodedata.normalize("NFKC", component)


@pytest.mark.parametrize("name", HOSTILE)
def test_every_hostile_name_gives_one_safe_component(name: str) -> None:
    _safe(host_component(name))
    assert host_component(name) == host_component(name)  # stable across runs and workers


def test_plain_names_are_kept_and_the_rest_escaped_readably() -> None:
    assert host_component("gpu-01") == "gpu-01"
    assert host_component("node7.dc1") == "node7.dc1"
    assert host_component("GPU-01").startswith("gpu-01~")
    assert host_component("..").startswith("host~")
    assert host_component("a/b").startswith("a_b~")
    assert host_component("a" * 10_000).startswith("a" * 40 + "~")


def test_no_two_hostile_names_share_a_folder_even_case_folded() -> None:
    comps = [host_component(n) for n in HOSTILE]
    assert len({c.casefold() for c in comps}) == len(HOSTILE)
    pairs = [("A", "a"), ("..", "."), ("a/b", "a_b"), ("gpu-01", "ｇｐｕ-01"), ("caf\u00e9", "cafe\u0301")]
    for x, y in pairs:
        assert host_component(x) != host_component(y), (x, y)


def test_random_names_never_collide() -> None:
    """2,000 seeded random names from a small alphabet that invites collisions: all distinct."""
    rng = random.Random(11)
    alphabet = ["a", "A", ".", "/", "-", "_", "~", "\x00", "\u0301", "é", "ｇ", "ß", "s", "0", " "]
    names = {"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(4000)}
    names = set(list(sorted(names))[:2000])
    comps = {host_component(n).casefold() for n in names}
    assert len(comps) == len(names)
    for c in comps:
        _safe(c)


def test_several_targets_need_host_in_the_template() -> None:
    with pytest.raises(DestinationError) as exc:
        per_target("/backups/run1", ["gpu-01", "gpu-02"], option="--backup-dir")
    msg = str(exc.value)
    assert "\n" not in msg and "--backup-dir" in msg and "--backup-dir=/backups/run1/{host}" in msg
    assert isinstance(exc.value, GpuhostError)
    with pytest.raises(DestinationError, match=r"--backup-to=s3://b/p/\{host\}"):
        per_target("s3://b/p/", ["gpu-01", "gpu-02"], option="--backup-to")
    # one target: a fixed place is fine
    assert per_target("/backups/run1", ["gpu-01"], option="--backup-dir") == {"gpu-01": "/backups/run1"}


def test_each_target_gets_its_own_place() -> None:
    names = ["..", "A", "a", "gpu-01", "ｇｐｕ-01", "a/b"]
    dirs = per_target("/backups/{host}", names, option="--backup-dir")
    assert len({d.casefold() for d in dirs.values()}) == len(names)
    assert all(d.startswith("/backups/") and d.count("/") == 2 for d in dirs.values())
    assert dirs["a"] == "/backups/a" and dirs[".."] != "/backups/.."
    urls = per_target("s3://bucket/decom/{host}/files", names, option="--backup-to")
    assert urls["gpu-01"] == "s3://bucket/decom/gpu-01/files"
    assert len(set(urls.values())) == len(names)


def test_refusals_name_the_option_and_the_fix() -> None:
    cases = [
        ("/b/{host}", ["gpu-01", "gpu-01"], "listed twice"),
        ("", ["gpu-01"], "is empty"),
        ("/b/\n/{host}", ["gpu-01"], "control character"),
        ("s3://{host}-bucket/x", ["gpu-01"], "in the prefix"),
        ("/b/" + "x" * 250 + "{host}", ["a" * 60], "longer than 255 bytes"),
    ]
    for template, names, why in cases:
        with pytest.raises(DestinationError, match=why) as exc:
            per_target(template, names, option="--backup-dir")
        assert "\n" not in str(exc.value) and "--backup-dir" in str(exc.value)


@pytest.mark.parametrize("template", ["b/{host}/..", "b/{host}/./x", "b/x{host}y/../z"])
def test_dot_components_after_host_are_refused(template: str) -> None:
    with pytest.raises(DestinationError, match=r"'\.' or '\.\.' component after \{host\}"):
        per_target(template, ["gpu-01", "gpu-02"], option="--backup-dir")


def test_dot_components_before_host_are_fine() -> None:
    got = per_target("../b/./{host}", ["gpu-01", "gpu-02"], option="--backup-dir")
    assert got == {"gpu-01": "../b/./gpu-01", "gpu-02": "../b/./gpu-02"}
