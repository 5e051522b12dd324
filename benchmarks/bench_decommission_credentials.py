"""What the credentials step adds to a decommission of the lab's B200 node (suites/decommission).

Boots `b200-nvl8` (small data tree, the planted credentials of gpulab/host/credentials.py, seven
SGLang servers, one with HF_TOKEN in its environment) and, per round, from a pristine host:

* the whole decommission, `pytest suites/decommission` as an operator types it (the manifest's
  categories kept locally: the S3 steps skip, so moto is not needed), credentials step included;
* the step's own duration from the run's JSON report (`test_credentials_left`: one `cred_read`
  round trip, the recognition, the terminal lines);
* the inventory's read of every process's environment (`cred_environ`), timed on its own over a
  connection of our own to the node, as the inventory sends it (one op more in its batch).

Printed: each figure per round, their medians, and the step's share of the whole run. On
2026-12-07 (2 cores shared with other test runs, load 9 to 15): the step 0.091 s of a 7.62 s
decommission (medians of 3, 1.2%), the environment read 2.9 ms (median of 10).

    python benchmarks/bench_decommission_credentials.py            # 3 rounds
    python benchmarks/bench_decommission_credentials.py --smoke    # CI: one round
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpulab.host.lab import CLIENT_KEY, Lab, LabHost  # noqa: E402
from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url  # noqa: E402
from pytest_gpuhost.modules import credentials  # noqa: E402

MANIFEST = ROOT / "fixtures" / "manifests" / "b200-node-backup.yaml"
STEP = "test_credentials_left"


def local_manifest(tmp: Path) -> Path:
    """The B200 manifest with every category kept locally (no S3 in the benchmark)."""
    text = re.sub(r"\n\s*s3: true[^\n]*", "", MANIFEST.read_text())
    path = tmp / "b200-local.yaml"
    path.write_text(text)
    return path


def one_run(h: LabHost, tmp: Path, manifest: Path, n: int) -> tuple[float, float]:
    """A decommission from a pristine host: (whole run, credentials step) in seconds."""
    h.reset()
    reports = tmp / f"reports-{n}"
    argv = [
        sys.executable, "-m", "pytest", str(ROOT / "suites" / "decommission"), *h.pytest_args(),
        f"--manifest={manifest}", f"--backup-dir={tmp / f'backup-{n}'}", f"--report-dir={reports}",
        "--report-name=run", "-p", "no:cacheprovider", "-q",
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    whole = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the decommission failed (rc {proc.returncode}): {proc.stdout[-3000:]}")
    doc = json.loads((reports / "run.json").read_text())
    step = sum(
        float(t.get("duration") or 0.0)
        for t in doc.get("tests", [])
        if t["nodeid"].split("::")[-1].startswith(STEP)
    )
    return whole, step


def environ_reads(h: LabHost, times: int) -> list[float]:
    """Seconds of the inventory's `cred_environ` op, each its own round trip, on the running node."""
    h.reset()
    conn = open_connection(
        parse_host_url(f"ssh://root@{h.address}"),
        TargetOptions(identity=str(CLIENT_KEY), known_hosts=str(h.known_hosts), connect_timeout=10),
    )
    try:
        out = []
        for _ in range(times):
            t0 = time.monotonic()
            conn.call("cred_environ", **{k: v for k, v in credentials.environ_request().items() if k != "op"})
            out.append(time.monotonic() - t0)
        return out
    finally:
        conn.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="one round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rounds = 1 if args.smoke else args.rounds
    lab = Lab()
    lab.check()
    h = lab.up("b200-nvl8", name=f"bench-creds-{os.getpid()}", data_scale="small")
    try:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            manifest = local_manifest(tmp)
            rows = []
            for n in range(rounds):
                whole, step = one_run(h, tmp, manifest, n)
                rows.append((whole, step))
                print(f"round {n + 1}: decommission {whole:.2f} s, credentials step {step:.3f} s")
            env = environ_reads(h, 3 if args.smoke else 10)
    finally:
        lab.down(h.name)
    whole = statistics.median(r[0] for r in rows)
    step = statistics.median(r[1] for r in rows)
    env_s = statistics.median(env)
    print(f"environment read (cred_environ, its own round trip): median {env_s * 1000:.1f} ms of {len(env)}")
    print(
        f"credentials step measured: median {step:.3f} s of a {whole:.2f} s decommission "
        f"({100 * step / whole:.1f}%), plus at most {env_s * 1000:.0f} ms in the inventory's batch "
        f"({rounds} round{'s' if rounds != 1 else ''})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
