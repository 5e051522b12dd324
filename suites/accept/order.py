"""The order: what the provider promised for a rented node, read from a small YAML or JSON file.

    gpus: {model: NVIDIA B200, count: 8, memory_gib: 179}
    driver: {version: ">=570", cuda: ">=12.8"}
    disk: {path: /data, free_gib: 500, write_mb_s: 1000}
    s3: {bucket: training-data, prefix: run-42/, endpoint: "https://s3.example.com"}   # optional

A version is exact ("570.133.20") or a minimum (">=570"); `memory_gib` is a minimum per GPU
(what nvidia-smi reports as memory.total, in GiB); `free_gib` and `write_mb_s` are minimums on
the data volume. Every problem is one line naming the file and the field:
`order.yaml: gpus.count: expected an integer, got 'eight'` (docs/accept.md, "The order file").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Order", "OrderError", "Version", "load_order"]

_VERSION = re.compile(r"^(>=)?\s*(\d+(?:\.\d+)*)$")


class OrderError(Exception):
    """The order file cannot be used; `problems` are its lines, one per bad field."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Version:
    """A promised version: exact, or a minimum (`>=`)."""

    text: str
    minimum: bool

    def parts(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.text.split("."))

    def holds(self, found: str | None) -> bool:
        """Tell whether a found version ("570.133.20") keeps the promise."""
        if not found or not re.match(r"^\d+(\.\d+)*$", found.strip()):
            return False
        got = tuple(int(p) for p in found.strip().split("."))
        want = self.parts()
        if self.minimum:
            return got >= want
        return got[: len(want)] == want

    def __str__(self) -> str:
        return (">=" if self.minimum else "") + self.text


@dataclass(frozen=True)
class Order:
    """What was promised (every field validated; None where the order says nothing)."""

    gpu_model: str
    gpu_count: int
    memory_gib: float | None
    driver: Version | None
    cuda: Version | None
    disk_path: str
    free_gib: float | None
    write_mb_s: float | None
    s3_bucket: str | None = None
    s3_prefix: str = ""
    s3_endpoint: str | None = None

    @property
    def s3_url(self) -> str | None:
        return f"s3://{self.s3_bucket}/{self.s3_prefix}" if self.s3_bucket else None


#: section -> field -> (kind, required)
SCHEMA: dict[str, dict[str, tuple[str, bool]]] = {
    "gpus": {"model": ("text", True), "count": ("int", True), "memory_gib": ("number", False)},
    "driver": {"version": ("version", False), "cuda": ("version", False)},
    "disk": {"path": ("path", True), "free_gib": ("number", False), "write_mb_s": ("number", False)},
    "s3": {"bucket": ("text", True), "prefix": ("text", False), "endpoint": ("url", False)},
}
_REQUIRED_SECTIONS = ("gpus", "disk")
_EXPECTED = {
    "text": "a string",
    "int": "an integer",
    "number": "a number",
    "version": "a version such as 570.133.20 or >=570",
    "path": "an absolute path",
    "url": "an http(s):// URL",
}


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse(kind: str, value: Any) -> Any:
    """Return the field's value, or raise ValueError (the caller says what was expected)."""
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError
        return value
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError
        return float(value)
    if kind == "version":
        m = _VERSION.match(str(value).strip()) if isinstance(value, str | int | float) else None
        if m is None or isinstance(value, bool):
            raise ValueError
        return Version(m.group(2), bool(m.group(1)))
    if not isinstance(value, str) or not value.strip() or any(ord(c) < 32 for c in value):
        raise ValueError
    if kind == "path" and (not value.startswith("/") or "/../" in value + "/"):
        raise ValueError
    if kind == "url" and not re.match(r"^https?://[^/\s]+", value):
        raise ValueError
    return value.strip() if kind == "text" else value


def validate(data: Any, name: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Check `data` against SCHEMA; return the parsed sections and one line per problem."""
    if not isinstance(data, dict):
        return {}, [f"{name}: expected a mapping with {', '.join(SCHEMA)}, got {type(data).__name__}"]
    problems = [
        f"{name}: {k}: unknown section; expected one of {', '.join(SCHEMA)}" for k in data if k not in SCHEMA
    ]
    out: dict[str, dict[str, Any]] = {}
    for section, fields in SCHEMA.items():
        raw = data.get(section)
        if raw is None:
            if section in _REQUIRED_SECTIONS:
                problems.append(f"{name}: {section}: missing; expected {', '.join(fields)}")
            continue
        if not isinstance(raw, dict):
            problems.append(f"{name}: {section}: expected a mapping, got {_shown(raw)}")
            continue
        problems += [
            f"{name}: {section}.{k}: unknown field; expected one of {', '.join(fields)}"
            for k in raw
            if k not in fields
        ]
        out[section] = {}
        for field, (kind, required) in fields.items():
            if raw.get(field) is None:
                if required:
                    problems.append(f"{name}: {section}.{field}: missing; expected {_EXPECTED[kind]}")
                continue
            try:
                out[section][field] = _parse(kind, raw[field])
            except ValueError:
                problems.append(
                    f"{name}: {section}.{field}: expected {_EXPECTED[kind]}, got {_shown(raw[field])}"
                )
    return out, problems


def load_order(path: str | Path) -> Order:
    """Read and validate an order file; raise OrderError with one line per problem."""
    p = Path(path)
    name = p.name
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise OrderError([f"{name}: cannot be read: {getattr(exc, 'strerror', None) or exc}"]) from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OrderError(
            [f"{name}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {first}"]
        ) from None
    s, problems = validate(data, name)
    if problems:
        raise OrderError(problems)
    gpus, driver, disk, s3 = s["gpus"], s.get("driver", {}), s["disk"], s.get("s3", {})
    return Order(
        gpu_model=gpus["model"],
        gpu_count=gpus["count"],
        memory_gib=gpus.get("memory_gib"),
        driver=driver.get("version"),
        cuda=driver.get("cuda"),
        disk_path=disk["path"],
        free_gib=disk.get("free_gib"),
        write_mb_s=disk.get("write_mb_s"),
        s3_bucket=s3.get("bucket"),
        s3_prefix=s3.get("prefix", ""),
        s3_endpoint=s3.get("endpoint"),
    )
