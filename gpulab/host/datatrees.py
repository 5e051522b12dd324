"""Create the file trees of a lab host's profile (``files: [{root, generator}]``), deterministically.

``b200-data`` is the ``/data`` of a rented 8-GPU node that must be backed up before hand-back:
``scripts/`` (``*.py``, ``*.sh``), ``configs/`` (``*.yaml``, ``*.json``), ``logs/`` (many
``*.log``), ``data/completions/*.jsonl``, a few large ``data/shards/*.arrow``, ``models/``,
``PROGRESS.md`` and ``sglang_notes.md`` at the root, and ``odd names/`` with names that break
careless shell code (spaces, quotes, a newline, ``$(touch /tmp/pwned)``, a leading dash, non-UTF-8
bytes) plus a symlink to ``/etc`` that a backup must not follow.

Scales: ``small`` (CI: ~2,000 small files and 3 shards of 8 MiB, ~30 MB) and ``bench``
(~5,000 small files and 4 shards of 200 MiB, ~850 MB). The same scale always gives the same
names, bytes and modification times. Large files are a per-file header followed by one 1 MiB
pseudo-random block, rotated per MiB, so they are fast to write yet not trivially deduplicated.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SCALES", "Scale", "populate"]

MiB = 1 << 20
BASE_MTIME = 1_762_000_000  # 2025-11-01, fixed so trees compare equal across runs


@dataclass(frozen=True)
class Scale:
    """How much to create."""

    scripts: int
    configs: int
    logs: int
    completions: int
    shards: int
    shard_mib: int


SCALES: dict[str, Scale] = {
    "small": Scale(scripts=60, configs=60, logs=700, completions=1160, shards=3, shard_mib=8),
    "bench": Scale(scripts=150, configs=150, logs=1700, completions=2980, shards=4, shard_mib=200),
}

HOSTILE_NAMES: list[bytes] = [
    b"file with spaces.txt",
    b"it's quoted.txt",
    b'say "hi".txt',
    b"new\nline.txt",
    b"$(touch /tmp/pwned).txt",  # a path: dirs "$(touch " and "tmp", file "pwned).txt"
    b"$(touch pwned).txt",
    b"`id`.txt",
    b"-rf",
    b"semi;colon&amp.txt",
    b"star*glob?.txt",
    b"back\\slash.txt",
    b"caf\xe9-latin1.txt",
    b"\xff\xfe-not-utf8.bin",
    b"tab\tname.txt",
    b"unicode-\xe2\x9c\x93.txt",
]


def _rng(rel: str) -> random.Random:
    return random.Random(zlib.crc32(rel.encode("utf-8", "surrogateescape")))


def _write(root: Path, rel: str, data: bytes, n: int) -> int:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    t = BASE_MTIME + n * 37
    os.utime(p, (t, t))
    return len(data)


def _script_py(r: random.Random, i: int) -> bytes:
    body = [
        "#!/usr/bin/env python3",
        f'"""Evaluation step {i}: score completions against references."""',
        "import json, sys",
        "",
        "def score(a, b):",
        "    return sum(x == y for x, y in zip(a.split(), b.split())) / max(len(b.split()), 1)",
        "",
    ]
    body += [f"THRESHOLD_{k} = {r.random():.4f}" for k in range(r.randint(5, 60))]
    body += ["", "if __name__ == '__main__':", "    print(score(sys.argv[1], sys.argv[2]))", ""]
    return "\n".join(body).encode()


def _script_sh(r: random.Random, i: int) -> bytes:
    gpu = i % 8
    lines = [
        "#!/bin/bash",
        "set -euo pipefail",
        f"export CUDA_VISIBLE_DEVICES={gpu}",
        f"python3 -m sglang.launch_server --model-path /data/models/Qwen3-235B-A22B-FP8 "
        f"--port {30000 + gpu} --base-gpu-id {gpu} --tp 1 --log-file /data/logs/sglang-dp{gpu}.log",
    ]
    lines += [f"# run {k}: seed={r.randint(0, 1 << 30)}" for k in range(r.randint(2, 40))]
    return ("\n".join(lines) + "\n").encode()


def _config_yaml(r: random.Random, i: int) -> bytes:
    lines = [f"run: eval-{i:04d}", "model: /data/models/Qwen3-235B-A22B-FP8", "sampling:"]
    lines += [
        f"  temperature: {r.random():.2f}",
        f"  top_p: {r.random():.2f}",
        f"  max_tokens: {r.randint(256, 8192)}",
    ]
    lines += ["datasets:"] + [f"  - shard-{r.randint(0, 99):03d}" for _ in range(r.randint(1, 30))]
    return ("\n".join(lines) + "\n").encode()


def _config_json(r: random.Random, i: int) -> bytes:
    d = {
        "run": f"eval-{i:04d}",
        "dp": 7,
        "tp": 1,
        "ports": [30000 + k for k in range(7)],
        "seed": r.randint(0, 1 << 31),
    }
    d["weights"] = {f"w{k}": round(r.random(), 5) for k in range(r.randint(3, 80))}
    return (json.dumps(d, indent=2) + "\n").encode()


def _log(r: random.Random, i: int) -> bytes:
    lines = []
    t = BASE_MTIME + i * 600
    for k in range(r.randint(3, 120)):
        lines.append(
            f"[2025-11-{1 + (i + k) % 28:02d} {(t + k) // 3600 % 24:02d}:{(t + k) // 60 % 60:02d}:{k % 60:02d}] "
            f"Decode batch. #running-req: {r.randint(0, 64)}, #token: {r.randint(0, 1 << 20)}, "
            f"gen throughput (token/s): {r.uniform(100, 5000):.2f}"
        )
    return ("\n".join(lines) + "\n").encode()


def _completions(r: random.Random, i: int) -> bytes:
    words = ["the", "GPU", "peer", "memory", "kernel", "token", "batch", "answer", "because", "é", "数据"]
    out = []
    for k in range(r.randint(1, 40)):
        text = " ".join(r.choice(words) for _ in range(r.randint(5, 60)))
        out.append(
            json.dumps(
                {"id": f"{i}-{k}", "prompt_tokens": r.randint(10, 4000), "completion": text},
                ensure_ascii=False,
            )
        )
    return ("\n".join(out) + "\n").encode()


def _shard(path: Path, index: int, size: int, block: bytes) -> int:
    header = b"ARROW1\x00\x00" + f"gpulab shard {index:05d} size {size}\n".encode().ljust(56, b"\x00")
    with open(path, "wb") as f:
        f.write(header)
        left = size - len(header)
        k = 0
        mv = memoryview(block)
        while left > 0:
            rot = (k * 4099 + index * 131) % len(block)
            for part in (mv[rot:], mv[:rot]):
                n = min(left, len(part))
                f.write(part[:n])
                left -= n
                if left <= 0:
                    break
            k += 1
    t = BASE_MTIME + 86400 + index
    os.utime(path, (t, t))
    return size


def populate(root: str | os.PathLike[str], spec: Any = None, scale: str = "small") -> dict[str, int]:
    """Create the ``b200-data`` tree under ``root``; return counts (files, bytes, large, links).

    ``spec`` is the profile's FileTree (only ``generator: b200-data`` exists). Existing files are
    overwritten; nothing else under ``root`` is touched.
    """
    gen = getattr(spec, "generator", "b200-data") if spec is not None else "b200-data"
    if gen == "credentials":
        from gpulab.host.credentials import plant

        return plant(root)
    if gen != "b200-data":
        raise ValueError(f"unknown file generator {gen!r}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r} (known: {', '.join(SCALES)})")
    sc = SCALES[scale]
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    files = total = 0

    def put(rel: str, maker: Any, i: int) -> None:
        nonlocal files, total
        total += _write(base, rel, maker(_rng(rel), i), files)
        files += 1

    for i in range(sc.scripts):
        if i % 3 == 2:
            put(f"scripts/launch_{i:04d}.sh", _script_sh, i)
        else:
            put(f"scripts/eval_{i:04d}.py", _script_py, i)
    for i in range(sc.configs):
        if i % 2:
            put(f"configs/run_{i:04d}.json", _config_json, i)
        else:
            put(f"configs/run_{i:04d}.yaml", _config_yaml, i)
    for i in range(sc.logs):
        put(f"logs/{'eval' if i % 4 else 'train'}/run_{i:05d}.log", _log, i)
    for i in range(sc.completions):
        put(f"data/completions/part-{i // 200:03d}/completions_{i:05d}.jsonl", _completions, i)
    put(
        "models/Qwen3-235B-A22B-FP8/config.json",
        lambda r, i: b'{"architectures": ["Qwen3MoeForCausalLM"]}\n',
        0,
    )
    put(
        "PROGRESS.md",
        lambda r, i: (
            b"# Progress\n\n- [x] dp=7 servers on GPUs 0-6 (GPU 7 spare)\n- [x] eval shards 0-3 done\n"
            b"- [ ] copy /data off before hand-back (keep checksums)\n"
        ),
        0,
    )
    put("sglang_notes.md", lambda r, i: b"# sglang notes\n\nports 30000-30006, --base-gpu-id N, --tp 1\n", 0)
    odd = base / "odd names"
    odd.mkdir(exist_ok=True)
    for k, name in enumerate(HOSTILE_NAMES):
        p = os.path.join(os.fsencode(odd), name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        data = b"hostile name " + name + b"\n"
        with open(p, "wb") as f:
            f.write(data)
        t = BASE_MTIME + 5000 + k
        os.utime(p, (t, t))
        files += 1
        total += len(data)
    link = odd / "etc-link"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to("/etc")
    shards = base / "data" / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    block = random.Random(20251101).randbytes(MiB)
    for i in range(sc.shards):
        total += _shard(shards / f"shard-{i:05d}.arrow", i, sc.shard_mib * MiB + 4096 * i, block)
        files += 1
    return {"files": files, "bytes": total, "large": sc.shards, "links": 1}
