"""Credentials on a node: the agent probe's reads and scrubs on files under tmp_path, the pure module.

The probe runs here as a normal module against files under tmp_path (never this machine's homes
or its processes' environments), and its scrub once through a real local agent.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from pathlib import Path

import pytest

from pytest_gpuhost.exec.agent import probe_credentials as probe
from pytest_gpuhost.modules import credentials
from suites.decommission.credentials import scrub_refusal

HF = "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"
AWS = "AKIAQ3EGRB7NPLF2XK4M"


def budget(**kw: int) -> probe._Budget:
    return probe._Budget(dict({"timeout": 10}, **kw))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def reply_for(home: Path, paths: list[Path], roots: list[str] = ()) -> dict:
    """A cred_read reply made by the probe's own reader for these files (homes: `home`)."""
    b = budget()
    recs = [probe._read(str(p), b) for p in paths]
    return {
        "homes": [str(home)],
        "files": [r for r in recs if r and "error" not in r],
        "errors": [r for r in recs if r and "error" in r],
    }


# ---------------------------------------------------------------- the probe: reads


def test_a_symbolic_link_on_the_way_is_reported_never_followed(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "credentials").write_text(f"aws_access_key_id = {AWS}\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".aws").symlink_to(real)  # a directory link on the way
    (home / ".netrc").symlink_to(real / "credentials")  # the file itself a link
    for path in (home / ".aws" / "credentials", home / ".netrc"):
        rec = probe._read(str(path), budget())
        assert rec is not None and "data" not in rec and "not followed" in rec["error"], rec


def test_reads_are_bounded_per_file_and_in_all(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    b = budget(max_file_bytes=1000, max_bytes=1500)
    first = probe._read(str(big), b)
    second = probe._read(str(big), b)
    assert first["truncated"] and len(base64.b64decode(first["data"])) == 1000
    assert len(base64.b64decode(second["data"])) == 500 and second["truncated"]
    assert probe._read(str(tmp_path / "absent"), b) is None


def test_walk_finds_env_files_and_launch_scripts_without_entering_links(tmp_path):
    real = tmp_path / "nvme" / "data"
    (real / "scripts").mkdir(parents=True)
    root = tmp_path / "data"
    root.symlink_to(real)  # the root the operator named is a link (/data -> /mnt/nvme/data): followed
    (root / ".env").write_text("X=1\n")
    (root / "scripts" / "serve.sh").write_text("#!/bin/sh\n")
    (root / "scripts" / "eval.py").write_text("print(1)\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "leak.sh").write_text("#!/bin/sh\n")
    (root / "link").symlink_to(outside)
    found: list[str] = []
    errors: list[dict] = []
    probe._walk(str(root), list(credentials.ROOT_NAMES), budget(), 8, found, errors)
    assert sorted(found) == [str(root / ".env"), str(root / "scripts" / "serve.sh")] and errors == []
    rec = probe._read(str(root / ".env"), budget(), [str(root)])  # read below the root, as walked
    assert base64.b64decode(rec["data"]) == b"X=1\n"
    assert "not followed" in probe._read(str(root / ".env"), budget())["error"]  # from / it is a link


# ---------------------------------------------------------------- the probe: scrubs


def test_scrub_never_touches_authorized_keys(tmp_path):
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    keys = ssh / "authorized_keys"
    keys.write_bytes(b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIlogin run@controller\n")
    data = keys.read_bytes()
    for action in ("remove", "drop_lines"):
        res = probe._scrub_one({"path": str(keys), "sha256": sha(data), "action": action, "lines": []}, 1e18)
        assert res["status"] == "refused", res
    assert keys.read_bytes() == data


def test_scrub_leaves_a_file_that_changed_since_it_was_read(tmp_path):
    f = tmp_path / ".git-credentials"
    f.write_text("https://bot:ghp_x@github.com\n")
    old = sha(f.read_bytes())
    f.write_text("https://bot:ghp_y@github.com\n")
    res = probe._scrub_one({"path": str(f), "sha256": old, "action": "remove"}, 1e18)
    assert res["status"] == "changed" and f.exists()


def test_scrub_drops_only_the_lines_found_and_keeps_mode_and_the_rest(tmp_path):
    hist = tmp_path / ".bash_history"
    hist.write_bytes(b"nvidia-smi\nhuggingface-cli login --token " + HF.encode() + b"\ncd /data\n")
    hist.chmod(0o600)
    scan = credentials.scan_reply(reply_for(tmp_path, [hist]), [])
    [item] = credentials.scrub_items(scan)
    assert item["action"] == "drop_lines" and len(item["lines"]) == 1
    res = probe._scrub_one(item, 1e18)
    assert res["status"] == "rewritten", res
    assert hist.read_bytes() == b"nvidia-smi\ncd /data\n"
    assert stat.S_IMODE(hist.stat().st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if "gpuhost-scrub" in p.name]


def test_scrub_through_a_local_agent_removes_a_store(tmp_path):
    from pytest_gpuhost.exec.targets import open_connection, parse_host_url

    token = tmp_path / ".cache" / "huggingface" / "token"
    token.parent.mkdir(parents=True)
    token.write_text(HF)
    scan = credentials.scan_reply(reply_for(tmp_path, [token]), [])
    conn = open_connection(parse_host_url("local://"))
    try:
        results = credentials.scrub(conn, credentials.scrub_items(scan))
    finally:
        conn.close()
    assert [r["status"] for r in results] == ["removed"] and not token.exists()


# ---------------------------------------------------------------- the module (pure)


def test_findings_carry_kind_place_fingerprint_and_never_the_value(tmp_path):
    aws = tmp_path / ".aws" / "credentials"
    aws.parent.mkdir()
    aws.write_text(f"[default]\naws_access_key_id = {AWS}\nregion = us-east-2\n")
    scan = credentials.scan_reply(reply_for(tmp_path, [aws]), [])
    [f] = scan.findings
    assert (f.kind, f.path, f.line, f.action, f.rotate) == ("AWS access key id", str(aws), 2, "remove", True)
    assert f.fingerprint == hashlib.sha256(AWS.encode()).hexdigest()[:8]
    assert AWS not in repr(scan.summary()) and AWS not in f.describe() and AWS not in repr(scan.items)
    assert "rotate this" in f.describe()


def test_scrub_items_never_name_authorized_keys():
    scan = credentials.Scan(
        items=[
            {"path": "/root/.ssh/authorized_keys", "sha256": "0" * 64, "action": "remove"},
            {"path": "/root/.netrc", "sha256": "1" * 64, "action": "remove"},
        ]
    )
    assert [i["path"] for i in credentials.scrub_items(scan)] == ["/root/.netrc"]


def test_authorized_keys_are_listed_and_the_logins_private_key_is_kept(tmp_path):
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    blob = "AAAAC3NzaC1lZDI1NTE5AAAAIJ9l0gIn8KeYb1oBq2w3E4r5T6y7U8i9O0pA1s2D3f4G"
    (ssh / "authorized_keys").write_text(f"ssh-ed25519 {blob} run@controller\n")
    (ssh / "id_ed25519").write_text(
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"
    )
    (ssh / "id_ed25519.pub").write_text(f"ssh-ed25519 {blob} me@node\n")
    files = [ssh / "authorized_keys", ssh / "id_ed25519", ssh / "id_ed25519.pub"]
    scan = credentials.scan_reply(reply_for(tmp_path, files), [])
    assert scan.login == [f"{ssh / 'authorized_keys'}: 1 key"]
    [f] = scan.findings  # the public key and authorized_keys are not credentials
    assert f.kind == "private key" and f.action == "keep" and "authorized_keys" in f.why_kept
    assert credentials.scrub_items(scan) == []


def test_a_file_under_the_manifests_roots_is_removed_whole(tmp_path):
    env = tmp_path / "data" / ".env"
    env.parent.mkdir()
    env.write_text(f"MODEL=/m\nHF_TOKEN={HF}\n")
    scan = credentials.scan_reply(reply_for(tmp_path / "home", [env]), [str(tmp_path / "data")])
    assert [i["action"] for i in credentials.scrub_items(scan)] == ["remove"]


def test_environment_findings_only_for_the_processes_to_stop_with_their_start_time():
    reply = {
        "processes": [
            {"pid": 10, "starttime": 5, "env": ["PATH=/usr/bin", f"HF_TOKEN={HF}"]},
            {"pid": 11, "starttime": 6, "env": [f"HF_TOKEN={HF}"]},  # not selected
            {"pid": 12, "starttime": 99, "env": [f"HF_TOKEN={HF}"]},  # PID reused
        ]
    }
    found, err = credentials.environ_findings(reply, {10: (5, "python3 -m sglang"), 12: (7, "x")})
    assert err is None and [(f.kind, f.path, f.action) for f in found] == [
        ("Hugging Face token", "environment of PID 10 (python3 -m sglang)", "")
    ]
    found, err = credentials.environ_findings(OSError("cut"), {10: (5, "x")})
    assert found == [] and "environments not read" in err


@pytest.mark.parametrize(
    ("outcomes", "refused"),
    [
        ({"inventory": "passed", "servers stopped": "fixed", "gpus idle": "passed",
          "artifacts backed up": "fixed", "data in s3": "skipped"}, False),
        ({"inventory": "passed", "servers stopped": "fixed", "gpus idle": "passed",
          "artifacts backed up": "failed", "data in s3": "passed"}, True),
        ({"inventory": "passed", "servers stopped": "would fix"}, True),
        ({}, True),
    ],
)  # fmt: skip
def test_scrub_waits_until_the_node_is_otherwise_safe(outcomes, refused):
    why = scrub_refusal(outcomes)
    assert (why is not None) == refused, why


def test_probe_paths_are_those_the_module_names():
    req = credentials.read_request(["/data"])
    assert ".cache/huggingface/token" in req["home_files"] and ".ssh" in req["home_dirs"]
    assert req["max_file_bytes"] <= req["max_bytes"] and req["timeout"] > 0
    assert os.path.basename("/root/.ssh/authorized_keys") in probe.PROTECTED
