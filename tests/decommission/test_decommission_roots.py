"""Every root accounted for: a root that is a link, is missing or yields no file is not a pass.

The suite runs on `local://` with a stand-in nvidia-smi (tests/decommission/test_decommission_notes.py). A
root that was a symbolic link to the data ended "safe to terminate" with zero files of it backed
up and NOTES.md silent. Now each such root is a problem of the verdict naming what answers it
(`follow_root_links: true`, `expected_empty: true`), and NOTES.md has a row per root: files found,
verified where, left out by which rule.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.backup.local import Backup, Category, Manifest
from pytest_gpuhost.modules.backup.roots import root_problems
from pytest_gpuhost.modules.process import Selection
from tests.decommission.test_decommission_notes import NVIDIA_SMI_OK, _node, _notes, _run


def _with(tmp_path: Path, **cat: object) -> tuple[Path, dict[str, str]]:
    """The node of test_decommission_notes (made once), its category changed by `cat`."""
    if not (tmp_path / "node").exists():
        _node(tmp_path, NVIDIA_SMI_OK, ())
    manifest, env = _node_again(tmp_path)
    doc = yaml.safe_load(manifest.read_text())
    doc["categories"]["stuff"] = {"roots": [str(tmp_path / "node")], "max_size": 10}
    doc["categories"]["stuff"].update(cat)
    manifest.write_text(yaml.safe_dump(doc))
    return manifest, env


def _node_again(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    return tmp_path / "m.yaml", env


def test_a_root_that_is_a_link_is_a_problem_until_followed(tmp_path: Path) -> None:
    data = tmp_path / "real-data"
    data.mkdir()
    for i in range(5):
        (data / f"shard-{i}.bin").write_bytes(b"d" * (i + 1))
    (tmp_path / "link-root").symlink_to(data)
    manifest, env = _with(tmp_path, roots=[str(tmp_path / "node"), str(tmp_path / "link-root")])
    rc, out = _run(tmp_path, manifest, env)
    assert rc == 1 and "NOT safe to terminate" in out, out[-3000:]
    assert f"root {tmp_path / 'link-root'} of category stuff is a symbolic link (to {data})" in out, out[
        -3000:
    ]
    notes = _notes(tmp_path / "backup")
    assert "## Every root" in notes and "| link to " in notes, notes
    # the operator answers: follow it; the five files are backed up and verified
    manifest, env = _with(
        tmp_path, roots=[str(tmp_path / "node"), str(tmp_path / "link-root")], follow_root_links=True
    )
    rc, out = _run(tmp_path, manifest, env)
    assert rc == 0, out[-3000:]
    notes = _notes(tmp_path / "backup")
    row = next(
        line for line in notes.splitlines() if line.startswith(f"| stuff | {tmp_path / 'link-root'} |")
    )
    assert "(followed)" in row and "| 5 | 5 in local backup |" in row, row
    for i in range(5):
        assert (tmp_path / "backup" / "stuff" / str(data).lstrip("/") / f"shard-{i}.bin").exists()


def test_an_empty_or_missing_root_is_a_problem_unless_expected(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    roots = [str(tmp_path / "node"), str(tmp_path / "empty"), str(tmp_path / "gone")]
    manifest, env = _with(tmp_path, roots=roots)
    rc, out = _run(tmp_path, manifest, env)
    assert rc == 1, out[-3000:]
    assert f"root {tmp_path / 'empty'} of category stuff yields no file" in out
    assert f"root {tmp_path / 'gone'} of category stuff does not exist" in out
    manifest, env = _with(tmp_path, roots=roots, expected_empty=True)
    rc, out = _run(tmp_path, manifest, env)
    assert rc == 0, out[-3000:]
    notes = _notes(tmp_path / "backup")
    assert f"| stuff | {tmp_path / 'empty'} | dir | 0 | none | none |" in notes, notes


def test_a_root_emptied_by_its_rules_names_the_rule(tmp_path: Path) -> None:
    """Every file of a root left out by max_size: the root yields nothing, and the rule is named."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "model.bin").write_bytes(b"z" * 100)
    manifest, env = _with(tmp_path, roots=[str(tmp_path / "node"), str(big)])
    rc, out = _run(tmp_path, manifest, env)
    assert rc == 1 and "yields no file (1 left out by the category's rules)" in out, out[-3000:]
    notes = _notes(tmp_path / "backup")
    row = next(line for line in notes.splitlines() if line.startswith(f"| stuff | {big} |"))
    assert "1 by larger than max_size" in row, row


def test_root_problems_of_a_walk(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    (tmp_path / "l").symlink_to(tmp_path / "d")
    (tmp_path / "e").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    roots = tuple(str(tmp_path / n) for n in ("d", "l", "e", "missing", "dangling"))
    m = Manifest("t", (Category("c", roots),), Selection())
    conn = open_connection(parse_host_url("local://"))
    try:
        listing = Backup(conn, m, tmp_path / "dest").walk()
        kinds = {Path(r["root"]).name: (r["kind"], r["n"]) for r in listing.roots}
        assert kinds == {
            "d": ("dir", 1), "l": ("link", 1), "e": ("dir", 0), "missing": ("missing", 0),
            "dangling": ("link", 1),
        }  # fmt: skip
        probs = root_problems(m, listing)
        assert len(probs) == 4 and not any(f"root {tmp_path / 'd'} " in p for p in probs), probs
        followed = Manifest("t", (Category("c", roots, follow_root_links=True),), Selection())
        listing = Backup(conn, followed, tmp_path / "dest").walk()
        kinds = {Path(r["root"]).name: (r["kind"], r["n"]) for r in listing.roots}
        assert kinds["l"] == ("dir", 1) and kinds["dangling"] == ("missing", 0)
    finally:
        conn.close()
