"""Backup manifests (fixtures/manifests/README.md): load, validate as data, then build.

Validation runs before anything touches a node and reports every problem at once, one line each
naming the file, the key, what was found and what is expected: a manifest is never half-applied.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.exec.agent.probe_backup_walk import glob_compile
from pytest_gpuhost.exec.s3io import S3UrlError, parse_s3_url
from pytest_gpuhost.modules.process import Selection, parse_selection

__all__ = ["Category", "Manifest", "ManifestError", "load_manifest", "parse_size"]

META = ".gpuhost"  # the backup directory's own folder: never a category name
# What the backup and the decommission suite write at the top of the backup directory: a category
# of the same name would be a directory where a file must go (IsADirectoryError after the stop).
RESERVED = frozenset({META, "NOTES.md", "SHA256SUMS", ".SHA256SUMS.tmp", ".", ".."})
MAX_TIMEOUT = 7 * 24 * 3600.0  # seconds; anything longer is a typo, not a plan
_TOP_KEYS = {"name", "description", "version", "stop", "categories", "gpu_idle_mib", "gpu_idle_timeout"}
_CATEGORY_KEYS = {
    "roots",
    "include",
    "exclude",
    "max_size",
    "s3",
    "in_s3",
    "description",
    "follow_root_links",
    "expected_empty",
}
_STOP_KEYS = {"units", "match", "gpu_holders", "term_timeout", "kill_timeout"}
_MATCH_KEYS = {"argv0", "module", "args", "name"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


class BackupError(GpuhostError):
    """A backup could not be planned, transferred or verified."""


class ManifestError(BackupError):
    """A manifest is not valid; `problems` has one line per problem, each naming the file and key."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = [f"{path}: {p}" for p in problems]
        super().__init__(f"manifest {path}: {len(problems)} problem(s):\n  " + "\n  ".join(self.problems))


@dataclass(frozen=True)
class Category:
    """One manifest category: where its files are and which of them count."""

    name: str
    roots: tuple[str, ...]
    include: tuple[str, ...] = ("**",)
    exclude: tuple[str, ...] = ()
    max_size: int | None = None
    s3: bool = False
    # (root, s3://BUCKET/PREFIX): where the node's own pipeline already put a root's files, as
    # `aws s3 sync ROOT s3://BUCKET/PREFIX` lays them out; they are verified there, not copied
    in_s3: tuple[tuple[str, str], ...] = ()
    # a root that is a symbolic link is walked where it points (else it is a problem of the verdict)
    follow_root_links: bool = False
    # a root that yields no file is what the operator expects (else it is a problem of the verdict)
    expected_empty: bool = False

    def in_s3_url(self, root: str) -> str | None:
        """Return the s3:// URL a root's files are already in, or None."""
        return dict(self.in_s3).get(root)

    def wire(self) -> dict[str, Any]:
        """Return the category as the node's backup_walk takes it."""
        return {
            "name": self.name,
            "roots": list(self.roots),
            "include": list(self.include),
            "exclude": list(self.exclude),
            "max_size": self.max_size,
            "follow_root_links": self.follow_root_links,
        }


@dataclass(frozen=True)
class Manifest:
    """A backup manifest: what to stop and which categories of files to keep (fixtures/manifests)."""

    name: str
    categories: tuple[Category, ...]
    stop: Selection
    path: str = ""
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # gpu_idle_mib, gpu_idle_timeout


def parse_size(value: int | str | None) -> int | None:
    """Parse 1048576, "10M", "1.5 GiB" (powers of 1024) into bytes; None stays None."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"not a size: {value!r} (use bytes or a number with K, M, G, T)")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * 1024**power)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _Checker:
    """Collect one line per problem: '<key>: <found> (expected <what>)'."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def bad(self, key: str, found: Any, expected: str) -> None:
        self.problems.append(f"{key}: {found!r} (expected {expected})")

    def text(self, key: str, v: Any, *, path: bool = False) -> bool:
        if not isinstance(v, str):
            self.bad(key, v, "a string")
            return False
        if "\0" in v:
            self.bad(key, v, "no NUL byte" + (" in a path" if path else ""))
            return False
        return True

    def texts(self, key: str, v: Any, what: str, *, allow_one: bool = False) -> list[str]:
        if allow_one and isinstance(v, str):
            v = [v]
        if not isinstance(v, list):
            self.bad(key, v, f"a list of {what}")
            return []
        return [s for i, s in enumerate(v) if self.text(f"{key}[{i}]", s, path=True)]

    def timeout(self, key: str, v: Any) -> None:
        if not _is_number(v) or not math.isfinite(v) or not 0 <= v <= MAX_TIMEOUT:
            self.bad(key, v, f"a number of seconds from 0 to {MAX_TIMEOUT:.0f}")

    def globs(self, key: str, v: Any) -> None:
        for i, pattern in enumerate(self.texts(key, v, "glob strings")):
            if not pattern:
                self.bad(f"{key}[{i}]", pattern, "a non-empty glob")
                continue
            if pattern.startswith("/"):
                self.bad(f"{key}[{i}]", pattern, "a glob relative to each root (no leading /)")
                continue
            try:
                glob_compile(pattern)
            except re.error as exc:
                self.bad(f"{key}[{i}]", pattern, f"a valid glob ({exc})")


def _check_stop(c: _Checker, stop: Any) -> None:
    if not isinstance(stop, dict):
        c.bad("stop", stop, "a mapping with units, match, gpu_holders, term_timeout, kill_timeout")
        return
    for k in sorted(set(stop) - _STOP_KEYS, key=str):
        c.bad(f"stop.{k}", stop[k], f"only the keys {sorted(_STOP_KEYS)}")
    if "units" in stop:
        c.texts("stop.units", stop["units"], "unit globs", allow_one=True)
    if "gpu_holders" in stop and not isinstance(stop["gpu_holders"], bool):
        c.bad("stop.gpu_holders", stop["gpu_holders"], "true or false")
    for k in ("term_timeout", "kill_timeout"):
        if k in stop:
            c.timeout(f"stop.{k}", stop[k])
    match = stop.get("match", [])
    if not isinstance(match, list):
        c.bad("stop.match", match, "a list of matchers")
        return
    for i, m in enumerate(match):
        key = f"stop.match[{i}]"
        if not isinstance(m, dict) or not ({"argv0", "module", "args"} & set(m)):
            c.bad(key, m, "a mapping with argv0 (regex), module and/or args (list)")
            continue
        for k in sorted(set(m) - _MATCH_KEYS, key=str):
            c.bad(f"{key}.{k}", m[k], f"only the keys {sorted(_MATCH_KEYS)}")
        for k in ("argv0", "module", "name"):
            if k in m:
                c.text(f"{key}.{k}", m[k])
        if isinstance(m.get("argv0"), str):
            try:
                re.compile(m["argv0"])
            except re.error as exc:
                c.bad(f"{key}.argv0", m["argv0"], f"a regular expression ({exc})")
        if "args" in m:
            c.texts(f"{key}.args", m["args"], "exact argv strings, e.g. ['--port', '30000']")


def _check_category(c: _Checker, name: Any, spec: Any) -> None:
    key = f"categories.{name}"
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        c.bad(key, name, "a plain folder name (letters, digits, _ . -)")
    elif name.casefold() in {r.casefold() for r in RESERVED}:
        c.bad(
            key,
            name,
            f"a folder name other than {', '.join(sorted(RESERVED - {'.', '..'}))} (the backup writes those)",
        )
    if not isinstance(spec, dict):
        c.bad(key, spec, "a mapping with roots (absolute paths)")
        return
    for k in sorted(set(spec) - _CATEGORY_KEYS, key=str):
        c.bad(f"{key}.{k}", spec[k], f"only the keys {sorted(_CATEGORY_KEYS)}")
    if "roots" not in spec:
        c.bad(f"{key}.roots", None, "one absolute path or a list of them")
    else:
        roots = c.texts(f"{key}.roots", spec["roots"], "absolute paths", allow_one=True)
        if spec["roots"] in ([], ""):
            c.bad(f"{key}.roots", spec["roots"], "at least one absolute path")
        for r in roots:
            if not r.startswith("/"):
                c.bad(f"{key}.roots", r, "an absolute path")
    for k in ("include", "exclude"):
        if k in spec:
            c.globs(f"{key}.{k}", spec[k])
    if "max_size" in spec:
        v = spec["max_size"]
        try:
            size = parse_size(v) if not isinstance(v, bool) else None
        except ValueError:
            size = None
        if size is None or size < 0:
            c.bad(f"{key}.max_size", v, "a size of 0 or more: bytes, or a number with K, M, G, T")
    for k in ("s3", "follow_root_links", "expected_empty"):
        if k in spec and not isinstance(spec[k], bool):
            c.bad(f"{key}.{k}", spec[k], "true or false (unquoted)")
    if "in_s3" in spec:
        _check_in_s3(c, key, spec)
    if "description" in spec:
        c.text(f"{key}.description", spec["description"])


def _check_in_s3(c: _Checker, key: str, spec: dict[str, Any]) -> None:
    """`in_s3: s3://B/P` (a category of one root) or `in_s3: {ROOT: s3://B/P, ...}`."""
    v = spec["in_s3"]
    roots = spec.get("roots")
    roots = [roots] if isinstance(roots, str) else roots if isinstance(roots, list) else []
    norm = {os.path.normpath(r) for r in roots if isinstance(r, str)}
    if isinstance(v, str):
        if len(norm) != 1:
            c.bad(
                f"{key}.in_s3", v, "a mapping {root: s3://BUCKET/PREFIX} when the category has several roots"
            )
        pairs = [(next(iter(norm), ""), v)]
    elif isinstance(v, dict) and v:
        pairs = list(v.items())
    else:
        c.bad(f"{key}.in_s3", v, "s3://BUCKET/PREFIX, or a mapping {root: s3://BUCKET/PREFIX}")
        return
    for root, url in pairs:
        if not isinstance(root, str) or os.path.normpath(root) not in norm:
            c.bad(f"{key}.in_s3", root, "one of the category's roots")
        try:
            if not isinstance(url, str):
                raise S3UrlError("not text")
            parse_s3_url(url)
        except S3UrlError:
            c.bad(f"{key}.in_s3.{root}", url, "an s3://BUCKET/PREFIX URL")
    if spec.get("s3") is True:
        c.bad(f"{key}.s3", True, "false or absent with in_s3 (the files are verified where they already are)")


def _in_s3_pairs(spec: dict[str, Any], roots: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    v = spec.get("in_s3")
    if v is None:
        return ()
    if isinstance(v, str):
        return ((roots[0], v),)
    return tuple((os.path.normpath(r), u) for r, u in v.items())


def validate_manifest(doc: Any) -> list[str]:
    """Return one line per problem of a parsed manifest (empty when it is valid)."""
    c = _Checker()
    if not isinstance(doc, dict):
        c.bad("(top level)", type(doc).__name__, "a mapping with categories: {name: {roots: [...]}}")
        return c.problems
    for k in sorted(set(doc) - _TOP_KEYS, key=str):
        c.bad(k, doc[k], f"only the top-level keys {sorted(_TOP_KEYS)}")
    for k in ("name", "description"):
        if k in doc:
            c.text(k, doc[k])
    if "version" in doc and (not isinstance(doc["version"], int) or isinstance(doc["version"], bool)):
        c.bad("version", doc["version"], "an integer")
    if "gpu_idle_mib" in doc:
        v = doc["gpu_idle_mib"]
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 1 << 30:
            c.bad("gpu_idle_mib", v, "a whole number of MiB, 0 or more")
    if "gpu_idle_timeout" in doc:
        c.timeout("gpu_idle_timeout", doc["gpu_idle_timeout"])
    if "stop" in doc and doc["stop"] is not None:
        _check_stop(c, doc["stop"])
    cats = doc.get("categories")
    if not isinstance(cats, dict) or not cats:
        c.bad("categories", cats, "a mapping 'categories: {name: {roots: [...]}}' with at least one category")
    else:
        for name, spec in cats.items():
            _check_category(c, name, spec)
    return c.problems


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Load and validate a backup manifest; raise ManifestError listing every problem."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ManifestError(str(p), [f"cannot read the file: {exc.strerror}"]) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(str(p), [f"not UTF-8 text (byte {exc.start})"]) from exc
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError(str(p), [f"not valid YAML: {' '.join(str(exc).split())}"]) from exc
    problems = validate_manifest(doc)
    if problems:
        raise ManifestError(str(p), problems)
    try:
        selection = parse_selection(doc.get("stop") or {})
    except ValueError as exc:
        raise ManifestError(str(p), [f"stop: {exc}"]) from exc
    cats = []
    for name, spec in doc["categories"].items():
        roots = [spec["roots"]] if isinstance(spec["roots"], str) else spec["roots"]
        norm = tuple(os.path.normpath(r) for r in roots)
        cats.append(
            Category(
                name=name,
                roots=norm,
                in_s3=_in_s3_pairs(spec, norm),
                include=tuple(spec.get("include") or ("**",)),
                exclude=tuple(spec.get("exclude") or ()),
                max_size=parse_size(spec.get("max_size")),
                s3=spec.get("s3", False),
                follow_root_links=spec.get("follow_root_links", False),
                expected_empty=spec.get("expected_empty", False),
            )
        )
    return Manifest(
        options={k: doc[k] for k in ("gpu_idle_mib", "gpu_idle_timeout") if k in doc},
        name=str(doc.get("name", p.stem)),
        categories=tuple(cats),
        stop=selection,
        path=str(p),
        description=str(doc.get("description", "")),
    )
