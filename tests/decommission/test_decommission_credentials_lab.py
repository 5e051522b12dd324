"""suites/decommission's credentials step on the b200-nvl8 lab host, which carries a realistic set.

The node holds what an operator leaves (gpulab/host/credentials.py: a Hugging Face token, AWS
keys and an SSO cache, a W&B key in ~/.netrc, a registry login, git and gh tokens, a kube token,
rclone and s3cmd keys, an SSH private key, a .env and a launch script with --api-key under /data,
a shell history) and an SGLang server started with HF_TOKEN in its environment. Each is required
to be found, by kind, place and fingerprint; no value may reach any artefact (the HTML and JSON
reports, JUnit XML, NOTES.md, the run's own records, the terminal); `--fix=scrub` removes them
only once the node is otherwise safe, and never the run's own login.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from gpulab.host import credentials as planted
from tests.decommission.test_decommission_lab import MANIFEST, ROOT, run_suite

API_KEY_IN_PROFILE = "Rk8Lq2Zm4Xp7Wn3VtQ9xY"  # sglang-dp6's --api-key (fixtures/profiles/b200-nvl8.yaml)
VALUES = sorted({p.value for p in (*planted.PLANTED, *planted.ENVIRON)} | {API_KEY_IN_PROFILE})


@pytest.fixture(scope="module")
def b200(lab):
    return lab.host("b200-nvl8", data_scale="small")


def fp(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:8]


def argv(h: Any, dest: Path, reports: Path, *extra: str, s3: Any = None) -> list[str]:
    """The suite's command line against the node; with `s3` (bucket, endpoint), its uploads too."""
    where = [f"--backup-to=s3://{s3[0]}/b200", f"--s3-endpoint={s3[1]}"] if s3 else []
    return [
        sys.executable, "-m", "pytest", str(ROOT / "suites" / "decommission"), *h.pytest_args(),
        f"--manifest={MANIFEST}", f"--backup-dir={dest}", *where, f"--report-dir={reports}",
        f"--junitxml={reports / 'junit.xml'}", "-p", "no:cacheprovider", "-q",
        "-o", "decommission_stall_timeout=10", "-o", "decommission_s3_part_mib=5", *extra,
    ]  # fmt: skip


def artefacts(dest: Path, reports: Path, terminal: str) -> dict[str, str]:
    """Every artefact a run leaves, by name: reports, JUnit, NOTES.md, the run's records, the terminal."""
    out = {"terminal": terminal}
    for p in [*reports.rglob("*"), dest / "NOTES.md", *(dest / ".gpuhost").glob("*.json*")]:
        if p.is_file():
            out[str(p)] = p.read_text(errors="replace")
    return out


def leaked(texts: dict[str, str]) -> list[tuple[str, str]]:
    return [(name, v[:6] + "...") for name, t in texts.items() for v in VALUES if v in t]


def found_in(reports: Path) -> tuple[set[tuple[str, str]], set[str]]:
    """(path, fingerprint) of every credential the step's evidence lists, and the environ fingerprints."""
    files: set[tuple[str, str]] = set()
    env: set[str] = set()
    for rec in _records([json.loads(p.read_text()) for p in reports.glob("decommission-*.json")]):
        if isinstance(rec, dict) and "fingerprint" in rec and "path" in rec:
            if str(rec["path"]).startswith("environment of PID"):
                env.add(rec["fingerprint"])
            else:
                files.add((rec["path"], rec["fingerprint"]))
    return files, env


def _records(docs: list[Any]) -> list[Any]:
    """Every JSON object inside `docs`, at any depth."""
    out: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            out.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(docs)
    return out


def node_file(h: Any, path: str) -> str | None:
    r = h.ssh(["cat", path])
    return r.stdout if r.returncode == 0 else None


def login_state(h: Any) -> str:
    r = h.ssh(["sha256sum", "/root/.ssh/authorized_keys"])
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def test_scrub_waits_for_a_safe_node(b200, s3_endpoint, tmp_path):
    """--fix=scrub with the data steps not run removes nothing; --credentials-left=unsafe fails the node."""
    h = b200
    h.reset()
    dest, reports = tmp_path / "backup", tmp_path / "reports"
    s3 = (s3_endpoint.make_bucket("wait"), s3_endpoint.url)
    rc, out, counts = run_suite(
        argv(
            h,
            dest,
            reports,
            "--fix=scrub",
            "--credentials-left=unsafe",
            "-k",
            "credentials_left or safe",
            s3=s3,
        ),
        {**os.environ, **s3_endpoint.env},
    )
    assert rc != 0 and counts.get("failed", 0) >= 2, out
    assert "not otherwise safe to terminate" in out, out
    assert "credentials remain on the node" in out, out
    for p in planted.PLANTED:
        assert p.value in (node_file(h, p.path) or ""), f"{p.path} was touched before the node was safe"
    assert not leaked(artefacts(dest, reports, out))


def test_every_credential_found_none_shown_scrub_removes(b200, s3_endpoint, tmp_path):
    """Found by kind, place and fingerprint; no value in any artefact; scrubbed; rerun finds none."""
    h = b200
    h.reset()
    login = login_state(h)
    dest, reports = tmp_path / "backup", tmp_path / "reports"
    env = {**os.environ, **s3_endpoint.env}
    s3 = (s3_endpoint.make_bucket("creds"), s3_endpoint.url)

    rc, out, counts = run_suite(argv(h, dest, reports, s3=s3), env)
    assert rc == 0, out  # default --credentials-left=report: listed, the node still safe
    files, environ = found_in(reports)
    missing = [(p.path, p.kind) for p in planted.PLANTED if (p.path, fp(p.value)) not in files]
    assert missing == [], (missing, sorted(files))
    assert {fp(p.value) for p in planted.ENVIRON} <= environ, environ
    notes = (dest / "NOTES.md").read_text()
    assert "## Credentials left on the node (" in notes and "rotate this" in notes
    assert "## Credentials in the environments of the processes stopped" in notes
    assert "/root/.ssh/authorized_keys: 1 key" in notes  # reported, never touched
    assert "credentials remain on the node" in out  # the verdict counts them
    assert leaked(artefacts(dest, reports, out)) == []

    rc, out, counts = run_suite(argv(h, dest, tmp_path / "reports2", "--fix=scrub", s3=s3), env)
    assert rc == 0 and counts.get("fixed", 0) >= 1, out
    for p in planted.PLANTED:
        text = node_file(h, p.path)
        assert text is None or p.value not in text, f"{p.path} still holds its {p.kind}"
    assert node_file(h, "/home/ubuntu/.ssh/id_ed25519.pub") is not None  # a public key is no secret
    history = node_file(h, "/root/.bash_history") or ""
    assert "nvidia-smi" in history and "tail -f /data/logs/sglang-dp0.log" in history  # only its lines
    assert login_state(h) == login
    journal = (dest / ".gpuhost" / "scrubbed.jsonl").read_text()
    assert "/root/.aws/credentials" in journal and "authorized_keys" not in journal
    assert leaked(artefacts(dest, tmp_path / "reports2", out)) == []
    notes_scrubbed = (dest / "NOTES.md").read_text().split("\n## Timeline\n")[0]

    rc, out, counts = run_suite(argv(h, dest, tmp_path / "reports3", s3=s3), env)
    notes_now = (dest / "NOTES.md").read_text().split("\n## Timeline\n")[0]
    changed = set(notes_now.splitlines()) ^ set(notes_scrubbed.splitlines())
    assert rc == 0 and counts.get("passed") == 8, (out, changed)
    files, _ = found_in(tmp_path / "reports3")
    assert files == set(), files
    assert "no credential left on the node" in out, out
    assert login_state(h) == login
    assert h.ssh(["true"]).returncode == 0  # the run's own login still works
    assert leaked(artefacts(dest, tmp_path / "reports3", out)) == []
