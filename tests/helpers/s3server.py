"""Session fixture `s3_endpoint`: moto's S3 server on loopback, a real HTTP endpoint for boto3 and aws."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class S3Endpoint:
    """A running S3 endpoint: its URL, fake credentials, and a maker of fresh buckets."""

    url: str
    pid: int
    env: dict[str, str] = field(default_factory=lambda: dict(FAKE_ENV))
    make_bucket: Callable[[str], str] = field(default=lambda prefix="t": prefix)

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_DEFAULT_REGION"],
        )


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_moto(
    log: Path | None = None, timeout: float = 30.0, host: str = "127.0.0.1"
) -> tuple[subprocess.Popen[bytes], str]:
    """Start `moto_server -H HOST -p PORT` (HOST: loopback, or a lab address); return it and its URL once it answers."""
    port = _free_port(host)
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    argv = [exe] if os.path.exists(exe) else [sys.executable, "-m", "moto.server"]
    argv += ["-H", host, "-p", str(port)]
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **FAKE_ENV})
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=2).close()
            return proc, url
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    stop_moto(proc)
    raise RuntimeError(f"moto_server did not answer on {url} within {timeout:.0f} s")


def stop_moto(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server we started, by its PID: SIGTERM, a bounded wait, then SIGKILL."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """Yield a moto S3 server on loopback (url, env with fake credentials, make_bucket)."""
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    proc, url = start_moto(log)
    ep = S3Endpoint(url=url, pid=proc.pid)

    def make_bucket(prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        ep.client().create_bucket(Bucket=name)
        return name

    ep.make_bucket = make_bucket
    try:
        yield ep
    finally:
        stop_moto(proc)
