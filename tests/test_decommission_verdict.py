"""The decommission verdict (suites/decommission/notes.py `verdict`): safe only when nothing is left."""

from __future__ import annotations

from suites.decommission.notes import STEPS, verdict

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
    ]
    missing = {k: v for k, v in ALL_PASSED.items() if k != "gpus idle"}
    assert verdict(missing, running=[], local_missing=[]) == ["step 'gpus idle': not run"]
