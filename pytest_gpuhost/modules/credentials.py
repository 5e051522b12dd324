"""Credentials left on a node: where they live, how they are recognised, what removing them means.

A rented GPU node goes back to its provider, and its disk may be the next tenant's. Besides the
data, the operator leaves the keys that fetched the model and wrote the results. This module
says where to look (for root and every user with a home), reads what the agent brought back
(`probe_credentials.py`: fd-relative, no link followed, bounded in bytes and time), recognises
secrets with the redaction engine's own detectors (`redact.detect`: one definition serves both
hiding a secret in a report and finding it on a node), and plans their removal.

Pure but for `read`/`environ`/`scrub`, which make one agent round trip each. A finding holds the
kind, the place and a short fingerprint (the first 8 hex digits of the value's SHA-256, to tell
two findings apart and to match one against a key being rotated), never the value; every value
found is also handed to `redact.remember`, so no later output can show it.

What is removed, and how (`Finding.action`):
- a credential store (a token file, `~/.aws/credentials`, `~/.netrc`, a private key, ...) and any
  file under the manifest's roots (its verified copy is in the backup): the whole file;
- any other file (shell histories): the lines that hold a secret;
- `authorized_keys`: never. The run logs in with one of its keys, and a node without them cannot
  be reached to finish; they are listed (`Scan.login`) for the provider's wipe. A private key whose
  public half is in an `authorized_keys` is kept likewise.
- a process's environment: nothing to remove; it went with the process the run stopped.

Deleting a file does not erase its blocks: on an SSD (wear levelling, TRIM at the drive's
discretion) or an overlay (the lower layer keeps the original) the bytes may stay readable by
whoever gets the disk next. Rotation is the protection; the scrub only takes the credentials out
of the next tenant's casual reach.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.redact import Found, detect, remember

__all__ = [
    "HOME_DIRS",
    "HOME_FILES",
    "ROOT_NAMES",
    "STORES",
    "Finding",
    "Scan",
    "environ",
    "environ_findings",
    "environ_request",
    "fingerprint",
    "read",
    "read_request",
    "scan_reply",
    "scrub",
    "scrub_items",
    "under",
]

#: Credential stores under a home, by the tool that writes them: removed whole.
STORES = (
    ".cache/huggingface/token",  # huggingface_hub >= 0.14 (HF_HOME/token)
    ".huggingface/token",  # huggingface_hub before 0.14
    ".aws/credentials",
    ".config/gcloud/application_default_credentials.json",
    ".netrc",  # W&B (`wandb login`), curl, git over HTTPS
    ".docker/config.json",
    ".git-credentials",  # git credential-store
    ".config/gh/hosts.yml",  # GitHub CLI
    ".kube/config",
    ".config/rclone/rclone.conf",
    ".s3cfg",  # s3cmd
    ".pypirc",
    ".npmrc",
)
#: Other files under a home that credentials are typed into: their lines that hold one are removed.
HISTORIES = (".bash_history", ".zsh_history", ".python_history", ".psql_history", ".mysql_history")
HOME_FILES = STORES + HISTORIES
#: Directories under a home whose every file is read: SSH keys, the AWS SSO and CLI caches.
HOME_DIRS = (".ssh", ".aws/sso/cache", ".aws/cli/cache")
#: Files under the manifest's roots that hold secrets: `.env` files and launch scripts.
ROOT_NAMES = (".env*", "*.env", "*.sh", "launch*")
#: SSH files that hold no secret (public keys, host lists, client settings).
_PUBLIC = ("known_hosts", "known_hosts.old", "config", "environment")
_LOGIN = ("authorized_keys", "authorized_keys2")

MAX_FILE_BYTES = 256 * 1024
MAX_BYTES = 16 * 1024 * 1024
TIMEOUT = 20.0


def fingerprint(value: str) -> str:
    """The first 8 hex digits of the value's SHA-256: enough to tell findings apart, not to guess one."""
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:8]


def fingerprinted(kind: object, fingerprint: object) -> str:
    """How a credential is named wherever it is written: `kind (sha256 0123abcd...)`, never its value."""
    return f"{kind} (sha256 {fingerprint}...)"


@dataclass(frozen=True)
class Finding:
    """One credential on the node: what it is, where, its fingerprint; never its value."""

    kind: str
    path: str
    fingerprint: str
    rotate: bool  # it outlives the node (a cloud key, a token): rotate it wherever it is valid
    action: str  # remove (the whole file), drop_lines, keep (never scrubbed), "" (nothing to remove)
    name: str = ""  # the variable, field or flag it sits under
    line: int | None = None
    why_kept: str = ""

    @property
    def what(self) -> str:
        """Its kind, with the name it was found under (`secret by its name aws_secret_access_key`)."""
        return f"{self.kind} {self.name}" if self.name else self.kind

    def describe(self) -> str:
        """One line: kind, place, fingerprint, and "rotate this" where it outlives the node."""
        where = f"{self.path}:{self.line}" if self.line else self.path
        text = fingerprinted(f"{self.what} in {where}", self.fingerprint)
        if self.why_kept:
            text += f"; kept: {self.why_kept}"
        return text + ("; rotate this" if self.rotate else "")

    def record(self) -> dict[str, Any]:
        """JSON-able, for the evidence and the run's records (no value in it)."""
        return {
            "kind": self.kind,
            "name": self.name,
            "path": self.path,
            "line": self.line,
            "fingerprint": self.fingerprint,
            "rotate": self.rotate,
            "action": self.action,
            "why_kept": self.why_kept,
        }

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Finding:
        """The finding a `record()` describes."""
        return cls(
            kind=str(rec.get("kind", "")),
            path=str(rec.get("path", "")),
            fingerprint=str(rec.get("fingerprint", "")),
            rotate=bool(rec.get("rotate", True)),
            action=str(rec.get("action", "")),
            name=str(rec.get("name", "")),
            line=rec.get("line") if isinstance(rec.get("line"), int) else None,
            why_kept=str(rec.get("why_kept", "")),
        )


@dataclass
class Scan:
    """What one look at the node found, and what removing it would take."""

    findings: list[Finding] = field(default_factory=list)
    login: list[str] = field(default_factory=list)  # "/root/.ssh/authorized_keys: 1 key" (never touched)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (path, why it was not read)
    homes: list[str] = field(default_factory=list)
    files_read: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    out_of_time: bool = False
    items: list[dict[str, Any]] = field(default_factory=list)  # what `scrub` sends (no value in it)

    @property
    def remaining(self) -> list[Finding]:
        """The findings still on the node's disk (kept ones included: they remain)."""
        return list(self.findings)

    def summary(self) -> dict[str, Any]:
        """JSON-able, for the evidence (kinds, paths, fingerprints; never a value)."""
        return {
            "found": [f.record() for f in self.findings],
            "login_never_touched": self.login,
            "not_read": [list(e) for e in self.errors[:100]],
            "homes": self.homes,
            "files_read": self.files_read,
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 3),
            "out_of_time": self.out_of_time,
        }


def read_request(roots: Iterable[str]) -> dict[str, Any]:
    """The agent request that reads every place this module looks at (one round trip)."""
    return {
        "op": "cred_read",
        "home_files": list(HOME_FILES),
        "home_dirs": list(HOME_DIRS),
        "roots": sorted(set(roots)),
        "root_names": list(ROOT_NAMES),
        "max_file_bytes": MAX_FILE_BYTES,
        "max_bytes": MAX_BYTES,
        "timeout": TIMEOUT,
    }


def environ_request() -> dict[str, Any]:
    """The agent request that reads every process's environment (in the inventory's batch)."""
    return {"op": "cred_environ", "max_file_bytes": 64 * 1024, "max_bytes": 4 * 1024 * 1024, "timeout": 10.0}


def under(path: str, roots: Iterable[str]) -> bool:
    """Whether `path` is one of `roots` or below one."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _home_rel(path: str, homes: Iterable[str]) -> str | None:
    for h in sorted(homes, key=len, reverse=True):
        if path.startswith(h.rstrip("/") + "/"):
            return path[len(h.rstrip("/")) + 1 :]
    return None


def _lines(text: str, found: list[Found]) -> dict[int, str]:
    """Line number -> SHA-256 of that line's bytes, for each line a finding starts on."""
    out: dict[int, str] = {}
    raw = text.split("\n")
    for f in found:
        n = text.count("\n", 0, f.start)
        last = text.count("\n", 0, f.end)
        for k in range(n, last + 1):
            out[k + 1] = hashlib.sha256(raw[k].encode("utf-8", "surrogateescape")).hexdigest()
    return out


def _login_keys(files: list[dict[str, Any]]) -> set[str]:
    """The key blobs of every authorized_keys read (`ssh-ed25519 AAAA...` -> `AAAA...`)."""
    blobs: set[str] = set()
    for rec in files:
        if rec["path"].rsplit("/", 1)[-1] in _LOGIN:
            for line in base64.b64decode(rec["data"]).decode("utf-8", "replace").splitlines():
                blobs.update(w for w in line.split() if w.startswith("AAAA"))
    return blobs


def scan_reply(reply: Mapping[str, Any], roots: Iterable[str], seconds: float = 0.0) -> Scan:
    """Recognise the credentials in a `cred_read` reply; plan their removal. Pure."""
    roots = list(roots)
    homes = [str(h) for h in reply.get("homes", [])]
    files = [f for f in reply.get("files", []) if isinstance(f, dict) and "data" in f]
    scan = Scan(homes=homes, seconds=seconds, out_of_time=bool(reply.get("out_of_time")))
    scan.errors = [(str(e.get("path")), str(e.get("error"))) for e in reply.get("errors", [])]
    logins = _login_keys(files)
    by_path = {f["path"]: f for f in files}
    for rec in files:
        path = str(rec["path"])
        data = base64.b64decode(rec["data"])
        scan.files_read += 1
        scan.bytes_read += len(data)
        name = path.rsplit("/", 1)[-1]
        rel = _home_rel(path, homes)
        in_ssh = rel is not None and rel.startswith(".ssh/")
        if name in _LOGIN:
            keys = sum(
                1
                for line in data.decode("utf-8", "replace").splitlines()
                if line.strip() and not line.startswith("#")
            )
            scan.login.append(f"{path}: {keys} key{'s' if keys != 1 else ''}")
            continue
        if in_ssh and (name.endswith(".pub") or name in _PUBLIC):
            continue
        text = data.decode("utf-8", "surrogateescape")
        found = detect(text)
        if not found:
            continue
        for f in found:
            remember(f.value)
        store = under(path, roots) or (
            rel is not None and (rel in STORES or in_ssh or rel.startswith(".aws/"))
        )
        action, why = ("remove" if store else "drop_lines"), ""
        if rec.get("truncated"):
            action, why = "keep", f"larger than {MAX_FILE_BYTES} bytes: only its start was read"
        if in_ssh:
            pub = by_path.get(path + ".pub")
            blob = (
                [
                    w
                    for w in base64.b64decode(pub["data"]).decode("utf-8", "replace").split()
                    if w.startswith("AAAA")
                ]
                if pub
                else []
            )
            if blob and blob[0] in logins:
                action, why = "keep", "its public half is in an authorized_keys (a login)"
        line_hashes = _lines(text, found)
        for f in found:
            line = text.count("\n", 0, f.start) + 1
            scan.findings.append(
                Finding(f.kind, path, fingerprint(f.value), f.outlives, action, f.name, line, why)
            )
        if action in ("remove", "drop_lines"):
            item: dict[str, Any] = {"path": path, "sha256": rec["sha256"], "action": action}
            if action == "drop_lines":
                item["lines"] = sorted(set(line_hashes.values()))
            scan.items.append(item)
    return scan


def environ_findings(
    reply: Any, processes: Mapping[int, tuple[int, str]]
) -> tuple[list[Finding], str | None]:
    """The credentials in the environments of `processes` (pid -> (start time, label)).

    Returns (findings, why none could be read or None). A process whose start time differs is
    another process that reused the PID, and is not looked at.
    """
    if isinstance(reply, Exception) or not isinstance(reply, Mapping):
        return (
            [],
            f"environments not read: {type(reply).__name__}: {str(reply).splitlines()[0] if str(reply) else ''}",
        )
    out: list[Finding] = []
    for proc in reply.get("processes", []):
        pid = int(proc.get("pid", -1))
        if pid not in processes or int(proc.get("starttime", -1)) != processes[pid][0]:
            continue
        label = processes[pid][1]
        for entry in proc.get("env", []):
            for f in detect(str(entry)):
                remember(f.value)
                name = f.name or str(entry).split("=", 1)[0]
                out.append(
                    Finding(
                        f.kind,
                        f"environment of PID {pid} ({label})",
                        fingerprint(f.value),
                        f.outlives,
                        "",
                        name,
                    )
                )
    return out, None


def scrub_items(scan: Scan) -> list[dict[str, Any]]:
    """What `scrub` would send: never an authorized_keys, never a finding kept. Pure."""
    return [
        i
        for i in scan.items
        if i["path"].rsplit("/", 1)[-1] not in _LOGIN
        and not any(f.path == i["path"] and f.action == "keep" for f in scan.findings)
    ]


def read(conn: Any, roots: Iterable[str]) -> Scan:
    """Read every place credentials are left on the node (one round trip) and recognise them."""
    roots = list(roots)
    started = time.monotonic()
    reply = conn.call("cred_read", **{k: v for k, v in read_request(roots).items() if k != "op"})
    return scan_reply(reply, roots, time.monotonic() - started)


def environ(conn: Any, processes: Mapping[int, tuple[int, str]]) -> tuple[list[Finding], str | None]:
    """Read the environments of `processes` now (one round trip)."""
    req = environ_request()
    try:
        reply = conn.call("cred_environ", **{k: v for k, v in req.items() if k != "op"})
    except Exception as exc:  # noqa: BLE001 - reported as a line, never a traceback
        reply = exc
    return environ_findings(reply, processes)


def scrub(
    conn: Any, items: list[dict[str, Any]], roots: Iterable[str] = (), timeout: float = 30.0
) -> list[dict[str, Any]]:
    """Remove what `items` name on the node (one round trip); return each one's result.

    `roots` are the manifest's roots, whose own ancestors are followed as the read followed them.
    """
    if not items:
        return []
    reply = conn.call("cred_scrub", items=items, roots=sorted(set(roots)), timeout=timeout)
    return list(reply.get("results", []))
