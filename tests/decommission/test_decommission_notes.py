"""NOTES.md of suites/decommission: written for a node that is not safe, one line per node string.

Each scenario runs the suite as an operator would, in a subprocess, against `local://` (this
machine) with a manifest whose root is a temporary directory and a stand-in `nvidia-smi` first on
PATH: one that answers (every step passes) or one that fails (step 3 fails and blocks 4-6).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from suites.decommission.notes import cell, md

ROOT = Path(__file__).resolve().parents[2]

NVIDIA_SMI_OK = """#!/bin/sh
case "$*" in
  *--query-gpu=*) printf '0, 00000000:18:00.0, NVIDIA B200 \\033[2J|x, GPU-1b2c, 0, 183359\\n' ;;
  *) ;;
esac
"""
NVIDIA_SMI_FAILS = """#!/bin/sh
echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
exit 9
"""

KEY_ID = "AKIAIOSFODNN7EXAMPLE"
SIGNATURE = "0123456789abcdef" * 4
PRESIGNED = (  # a presigned URL's file name, as wget saves it
    f"m.bin?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={KEY_ID}%2F20261201%2Fus-east-1%2Fs3"
    f"%2Faws4_request&X-Amz-Signature={SIGNATURE}"
)
SIGNED_ONLY = f"n.bin?X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Signature={SIGNATURE}"
FORGED = "evil\n## Where it went\n\n- local: elsewhere\n\x1b[2J\x1b]0;owned\x07\r"
SECRETS = (KEY_ID, SIGNATURE, "hunter2")


def _node(
    tmp_path: Path, nvidia_smi: str, left_out: tuple[str, ...], kept: tuple[str, ...] = ()
) -> tuple[Path, dict[str, str]]:
    """A root with small.txt, `kept` (small) and `left_out` (over max_size), a manifest, a PATH."""
    root = tmp_path / "node"
    root.mkdir()
    for name in ("small.txt", *kept):
        (root / name).write_bytes(b"x")
    for name in left_out:
        (root / name).write_bytes(b"z" * 100)  # left out by max_size: listed in NOTES.md
    doc = {
        "name": "notes-test",
        "stop": {"match": [{"name": "nothing", "argv0": "no-such-server-binary"}]},
        "categories": {"stuff": {"roots": [str(root)], "max_size": 10}},
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(doc))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(nvidia_smi)
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    return tmp_path / "m.yaml", env


def _run(tmp_path: Path, manifest: Path, env: dict[str, str]) -> tuple[int, str]:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(ROOT / "suites" / "decommission"),
            "--host=local://",
            f"--manifest={manifest}",
            f"--backup-dir={tmp_path / 'backup'}",
            "--report-dir=none",
            "-p",
            "no:cacheprovider",
            "-q",
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return r.returncode, r.stdout[-20000:] + r.stderr[-3000:]


def _notes(dest: Path) -> str:
    """NOTES.md as its bytes say (no newline translation: a raw `\\r` stays visible)."""
    return (dest / "NOTES.md").read_bytes().decode()


def _assert_one_line_each(notes: str, dest: Path) -> None:
    """No node string starts a line or carries a control byte; no secret is in the file."""
    lines = notes.split("\n")
    assert [line for line in lines if line == "## Where it went"] == ["## Where it went"], notes
    assert [line for line in lines if line.startswith("- local:")] == [f"- local: {dest.resolve()}"], notes
    assert not [c for c in notes if not c.isprintable() and c != "\n"], repr(notes)
    assert not [s for s in SECRETS if s in notes], notes


def test_notes_are_written_with_what_is_not_verified_when_a_step_failed(tmp_path: Path) -> None:
    """nvidia-smi fails: steps 4-6 are blocked, the verdict writes NOTES.md with what is missing."""
    manifest, env = _node(tmp_path, NVIDIA_SMI_FAILS, (f"creds-{KEY_ID}.json",), (f"short {FORGED}",))
    rc, out = _run(tmp_path, manifest, env)
    assert rc != 0 and "NOT safe to terminate" in out, out
    assert (tmp_path / "backup" / "NOTES.md").exists(), out
    notes = _notes(tmp_path / "backup")
    assert "## Not safe to terminate (" in notes and "- step 'gpus idle': failed" in notes, notes
    assert "## Not verified (2)" in notes, notes
    assert f"- `{tmp_path / 'node' / 'small.txt'}`: never copied" in notes, notes
    assert "short evil\\n## Where it went\\n" in notes, notes
    assert "- left out by the manifest's rules: 1 files" in notes, notes
    assert "## Timeline" in notes and "NOTES.md written by the verdict" in notes, notes
    _assert_one_line_each(notes, tmp_path / "backup")
    # nothing was copied: the steps that copy were blocked
    assert not (tmp_path / "backup" / "stuff").exists()


def test_notes_hide_the_secrets_in_left_out_file_names(tmp_path: Path) -> None:
    """Every step passes; a key id, a presigned URL's signature and a password= in left-out names
    are redacted in NOTES.md as in every other artefact."""
    left_out = (f"creds-{KEY_ID}.json", PRESIGNED, SIGNED_ONLY, "db password=hunter2.txt")
    manifest, env = _node(tmp_path, NVIDIA_SMI_OK, left_out)
    rc, out = _run(tmp_path, manifest, env)
    assert rc == 0, out
    notes = _notes(tmp_path / "backup")
    assert "- left out by the manifest's rules: 4 files" in notes, notes
    assert not [s for s in SECRETS if s in notes], notes
    assert "creds-***.json" in notes and "db password=***" in notes, notes
    assert "m.bin?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***" in notes, notes
    assert "n.bin?X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Signature=***" in notes, notes
    _assert_one_line_each(notes, tmp_path / "backup")


def test_a_name_with_a_newline_or_escape_bytes_cannot_start_a_line_of_notes(tmp_path: Path) -> None:
    """A left-out name forging "## Where it went" and a second "- local:", with ESC, BEL and CR,
    and a GPU model name with ESC and `|`: each stays inside its own line (and table cell), escaped."""
    manifest, env = _node(tmp_path, NVIDIA_SMI_OK, (f"big {FORGED}",))
    rc, out = _run(tmp_path, manifest, env)
    assert rc == 0, out
    notes = _notes(tmp_path / "backup")
    assert "big evil\\n## Where it went\\n\\n- local: elsewhere\\n\\x1b[2J\\x1b]0;owned\\x07\\r" in notes, (
        notes
    )
    gpu_rows = [line for line in notes.split("\n") if line.startswith("| 0 |")]
    assert len(gpu_rows) == 1 and gpu_rows[0].count(" | ") == 4 and "\\x1b[2J\\|x" in gpu_rows[0], notes
    _assert_one_line_each(notes, tmp_path / "backup")


# ----------------------------------------------------------------------
# The line renderer of NOTES.md and the verdict (suites/decommission/notes.py `md`, `cell`).


KEY_ID = "AKIAIOSFODNN7EXAMPLE"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("a\nb", "a\\nb"),
        ("a\r\nb", "a\\r\\nb"),
        ("\x1b[2J\x1b]0;t\x07", "\\x1b[2J\\x1b]0;t\\x07"),
        ("a\u2028b\x85c", "a\\u2028b\\x85c"),
        (f"/d/creds-{KEY_ID}", "/d/creds-***"),
        ("/d/db password=hunter2", "/d/db password=***"),
        ("plain /data/a b $(x)", "plain /data/a b $(x)"),
    ],
)
def test_md_gives_one_line_with_no_secret_and_no_control_byte(text: str, want: str) -> None:
    assert md(text) == want
    assert "\n" not in md(text) and md(text).isprintable()


def test_cell_keeps_a_pipe_in_its_column() -> None:
    assert cell("NVIDIA | B200\n") == "NVIDIA \\| B200\\n"
