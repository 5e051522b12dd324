"""Two lab nodes, one after the other, with the same --backup-dir: the second is refused.

Node A's backup is made and called safe; node B's run (the same paths, other bytes) names A as
the owner of the place before anything is stopped, and A's backup keeps A's bytes. Real SSH to
two lab hosts; the owner is told by the agent's machine-id and hostname.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_a_second_node_with_the_first_nodes_backup_dir_is_refused(lab, tmp_path):
    a, b = (lab.host("health-ok", name=f"two{n}-{os.getpid() % 100000}") for n in "ab")
    for h in (a, b):
        r = h.ssh(["sh", "-c", "mkdir -p /srv/two && hostname > /srv/two/who"], timeout=30)
        assert r.returncode == 0, r.stderr
    doc = {
        "name": "two-nodes",
        "stop": {"units": ["sglang-*.service"], "term_timeout": 5},  # this test's own two hosts
        "categories": {"who": {"roots": ["/srv/two"]}},
    }
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    dest = tmp_path / "backup"

    def run(h):
        argv = [
            sys.executable, "-m", "pytest", str(ROOT / "suites" / "decommission"), *h.pytest_args(),
            f"--manifest={manifest}", f"--backup-dir={dest}", "--report-dir=none", "-p", "no:cacheprovider", "-q",
        ]  # fmt: skip
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)

    r = run(a)
    assert r.returncode == 0, r.stdout[-3000:]
    a_bytes = (dest / "who" / "srv" / "two" / "who").read_bytes()
    assert a_bytes == a.ssh(["cat", "/srv/two/who"], timeout=30).stdout.encode()
    r = run(b)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and f"--backup-dir {dest} holds the backup of " in out, out[-3000:]
    assert "Traceback" not in out
    assert (dest / "who" / "srv" / "two" / "who").read_bytes() == a_bytes  # A's backup is A's
    for h in (a, b):
        h.ssh(["rm", "-rf", "/srv/two"], timeout=30)
