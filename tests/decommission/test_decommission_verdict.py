"""The decommission verdict (suites/decommission/notes.py `verdict`): safe only when nothing is left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from suites.decommission.notes import STEPS, verdict

ROOT = Path(__file__).resolve().parents[2]
ALL_PASSED = dict.fromkeys(STEPS, "passed")


def test_safe_only_with_every_step_done_and_every_path_verified() -> None:
    assert verdict(ALL_PASSED, running=[], local_missing=[], s3_categories=["data"]) == []
    assert verdict({**ALL_PASSED, "data in s3": "skipped"}, running=[], local_missing=[]) == []
    assert verdict({**ALL_PASSED, "gpus idle": "fixed"}, running=[], local_missing=[]) == []


def test_each_thing_left_is_one_problem() -> None:
    problems = verdict(
        {**ALL_PASSED, "artifacts backed up": "failed", "notes saved": "would fix"} | {"inventory": ""},
        running=["PID 7 python3 -m sglang.launch_server"],
        local_missing=[("/data/a b", "permission denied"), ("/data/$(x)", "vanished")],
        s3_categories=["data"],
        s3_configured=False,
        s3_missing=[("/data/c", "sha256 differs")],
        open_uploads=["node/data/big.bin"],
        in_place_missing=[("/data/data/s.arrow", "cannot be verified: encrypted with aws:kms")],
    )
    assert problems == [
        "step 'inventory': not run",
        "step 'artifacts backed up': failed",
        "step 'notes saved': would fix",
        "still running: PID 7 python3 -m sglang.launch_server",
        "not in the local backup: /data/a b (permission denied)",
        "not in the local backup: /data/$(x) (vanished)",
        "categories data marked s3 but no --backup-to",
        "not in S3: /data/c (sha256 differs)",
        "open multipart upload: node/data/big.bin",
        "not proved where it already is in S3: /data/data/s.arrow (cannot be verified: encrypted with aws:kms)",
    ]
    missing = {k: v for k, v in ALL_PASSED.items() if k != "gpus idle"}
    assert verdict(missing, running=[], local_missing=[]) == ["step 'gpus idle': not run"]


def test_two_nodes_sharing_one_backup_dir_are_refused_before_anything_stops(tmp_path: Path) -> None:
    """--backup-dir without {host} and two targets: one-line usage error, nothing runs."""
    (tmp_path / "fleet.yaml").write_text(
        "all:\n  vars: {ansible_connection: local}\n  hosts:\n    node-a: {}\n    node-b: {}\n"
    )
    manifest = ROOT / "fixtures" / "manifests" / "b200-node-backup.yaml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(ROOT / "suites" / "decommission"),
            f"--inventory={tmp_path / 'fleet.yaml'}",
            f"--manifest={manifest}",
            f"--backup-dir={tmp_path / 'backup'}",
            "--report-dir=none",
            "-p",
            "no:cacheprovider",
            "-q",
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-3000:]  # a usage error: nothing ran
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "has no {host} but the run has 2 targets" in err[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "backup").exists()
