"""The all-reduce program sent to a target whose Python has torch: nccl-tests' output, torch.distributed.

Real inference hosts (SGLang, vLLM) seldom have nccl-tests, but the service's own Python always
has torch built with NCCL. pytest_gpuhost/modules/nccl_run.py sends this file's source on stdin to
``timeout -k 5 BOUND PYTHON -c BOOT ARGS`` (`BOOT` below), with the same arguments, environment
marker and bound as ``all_reduce_perf``. It runs on the target as ``__main__``, so it imports only
the standard library and torch, and keeps to Python 3.8 (the oldest that a torch 2 runs on).

The launcher (this process) never imports torch: it forks one process per GPU (``-g N``; CUDA
device = rank among ``CUDA_VISIBLE_DEVICES``), before any CUDA state exists, so fork is safe.
Rank 0 opens a ``TCPStore`` on a free loopback port and the launcher hands the port to the others
(no port is guessed); each rank calls ``init_process_group("nccl")`` on it. Each size of the sweep
(nccl-tests' ``-b -e -f``, 8 MiB to 128 MiB by 2 in nccl_run.ARGS) runs ``-w`` warm-up and ``-n``
timed in-place ``all_reduce`` calls of float32 sum, timed with CUDA events (wall clock on the CPU);
then, with ``-c 1``, the buffer is filled afresh with each rank's pattern, reduced once, and every
element on every rank is compared with the sum the ranks must agree on. Each rank reports its
time and its count of wrong elements through a pipe to the launcher, never through the
collective under test; the launcher prints a row once every rank has reported that size.

Output is nccl-tests' ``all_reduce_perf`` format (src/util.cu at
https://github.com/NVIDIA/nccl-tests/blob/a0b82b2260cf5152b9f8c061bbf7eaf0ba096432/src/util.cu),
so ``nccl.parse_perf`` reads it unchanged: the ``# nThread ... validation: 1`` line, ``#  Rank %2d
Group %2d Pid %6d on %10s device %2d [%04x:%02x:%02x] %s`` per rank, rows of
``%12li  %12li  %8s  %6s  %6s`` then ``  %7s  %6s  %6s  %6g`` (time in us, algbw, busbw, #wrong,
with util.cu's ``getFloatStr``), and the footer ``# Out of bounds values : N OK|FAILED`` (sizes
with a wrong element), ``# Avg bus bandwidth    : %g``, ``# Collective test concluded: ...``.
torch's ``all_reduce`` is in place only, so the out-of-place columns are left blank, as
nccl-tests' own ``writeBenchMarkLineNullBody`` leaves them ("only do in-place"): each row holds the
in-place figures. busbw = algbw * 2(n-1)/n, as nccl-tests' doc/PERFORMANCE.md derives it for
all-reduce (``AllReduceGetBw`` in src/all_reduce.cu); the time is the slowest rank's. NCCL's own
``NCCL_DEBUG=INFO`` lines (the transport of each channel) go to the same stdout.

Exit status: 0 when every result was right, 1 when an element was wrong (as nccl-tests), 2 when
a rank failed (``# error: rank R: ...``). ``--probe`` prints one JSON line about torch instead.
``--device cpu --backend gloo`` and ``--fault`` exist for the tests only (tests/p2p/test_nccl_torch.py):
they run the same launcher, store, sweep and data check with real torch processes on a machine
without a GPU; a ``--fault`` run is never correct.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait
from typing import Any

NAME = "gpuhost-allreduce (torch.distributed)"
# what the launcher runs: the program is the rest of stdin, so no file is left on the target
BOOT = "import sys;exec(compile(sys.stdin.read(),'gpuhost-allreduce','exec'))"
FAULT_WRONG = 7  # elements rank 0 corrupts per size under --fault wrong
_PATTERN = 251  # element i of rank r is (i + 3r) % 251 - 125: small integers, so float32 sums are exact
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_arg(text: str) -> int:
    """nccl-tests' size argument: ``8M`` is 8 MiB (K, M, G: powers of 1024)."""
    t = text.strip().upper()
    unit = t[-1] if t and t[-1] in "KMG" else ""
    number = t[: len(t) - len(unit)]
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8M)")
    return int(number) * _UNITS[unit]


def options(argv: list[str]) -> argparse.Namespace:
    """all_reduce_perf's options that nccl_run passes, and this program's own."""
    p = argparse.ArgumentParser(prog=NAME, description=__doc__.split("\n", 1)[0])
    p.add_argument("-b", "--minbytes", type=size_arg, default=size_arg("8M"))
    p.add_argument("-e", "--maxbytes", type=size_arg, default=size_arg("128M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-c", "--check", type=int, default=1)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-g", "--ngpus", type=int, default=1, help="ranks, one process and one GPU each")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: for tests only")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl", help="gloo: for tests only")
    p.add_argument("--fault", choices=("hang", "escape", "wrong", "exit"), help="for tests only")
    p.add_argument("--probe", action="store_true", help="print what this Python's torch has, as JSON")
    o = p.parse_args(argv)
    if o.ngpus < 1 or o.stepfactor < 2 or o.iters < 1 or o.warmup_iters < 0:
        p.error("-g, -n need at least 1, -f at least 2, -w at least 0")
    if o.minbytes < 4 or o.maxbytes < o.minbytes:
        p.error("-b must be at least 4 bytes and -e at least -b")
    return o


def sizes(o: argparse.Namespace) -> list[int]:
    """The sweep, as nccl-tests steps it by a factor (each a whole number of float32 elements)."""
    out, size = [], o.minbytes
    while size <= o.maxbytes:
        out.append(size - size % 4)
        size *= o.stepfactor
    return out


def float_str(value: float, width: int) -> str:
    """util.cu's getFloatStr: two decimals, else one, else none, else an exponent, within `width`."""
    for fmt in ("%*.2f", "%*.1f", "%*.0f"):
        s = fmt % (width, value)
        if len(s) <= width:
            return s
    return ("%*.1e" if width >= 7 else "%*.0e") % (width, value)


def bus_factor(n: int) -> float:
    """busbw / algbw for all-reduce on n ranks: 2(n-1)/n (nccl-tests doc/PERFORMANCE.md)."""
    return 2.0 * (n - 1) / n


def row(size: int, time_us: float, n: int, wrong: int | None) -> str:
    """One line of the table: preamble, blank out-of-place body, the in-place body."""
    algbw = size / 1.0e9 / (time_us / 1.0e6) if time_us > 0 else 0.0
    busbw = algbw * bus_factor(n)
    line = "%12li  %12li  %8s  %6s  %6s" % (size, size // 4, "float", "sum", "%6i" % -1)
    line += " " * 32  # writeBenchMarkLineNullBody
    body = (float_str(time_us, 7), float_str(algbw, 6), float_str(busbw, 6))
    if wrong is None:
        return line + "  %7s  %6s  %6s    N/A" % body
    return line + "  %7s  %6s  %6s  %6g" % (*body, float(wrong))


# ------------------------------------------------------------------ one rank (a forked process)


def _pattern(torch: Any, count: int, rank: int, device: Any) -> Any:
    idx = torch.arange(count, dtype=torch.int32, device=device)
    return ((idx + 3 * rank) % _PATTERN - (_PATTERN // 2)).to(torch.float32)


def _device_line(torch: Any, rank: int, o: argparse.Namespace) -> str:
    host = socket.gethostname().split(".")[0]
    if o.device == "cpu":
        return "#  Rank %2d Group  0 Pid %6d on %10s device %2d [cpu] %s" % (
            rank,
            os.getpid(),
            host,
            rank,
            "cpu",
        )
    p = torch.cuda.get_device_properties(rank)
    ids = [getattr(p, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    bus = "unknown"  # an older torch: the line names no bus, and nccl.verdict skips the GPUs' check
    if all(isinstance(i, int) for i in ids):
        bus = "%04x:%02x:%02x" % (int(ids[0] or 0), int(ids[1] or 0), int(ids[2] or 0))
    return "#  Rank %2d Group  0 Pid %6d on %10s device %2d [%s] %s" % (
        rank,
        os.getpid(),
        host,
        rank,
        bus,
        p.name,
    )


def _rank(rank: int, o: argparse.Namespace, conn: Any) -> None:
    """One rank: join the group, run the sweep, report each size to the launcher; never returns."""
    code = 0
    try:
        _sweep(rank, o, conn)
    except BaseException as exc:  # the launcher must hear why, whatever it was
        code = 2
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            conn.send(("error", rank, text.splitlines()[-1][:300] if text else type(exc).__name__))
        except OSError:
            pass
        traceback.print_exc(file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _sweep(rank: int, o: argparse.Namespace, conn: Any) -> None:
    if o.fault == "escape" and rank == o.ngpus - 1:
        os.setsid()  # out of timeout's process group: only the marker finds it (before torch: no wait)
        while True:
            time.sleep(3600)
    import datetime
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.distributed as dist

    n = o.ngpus
    cuda = o.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu")
    wait_store = datetime.timedelta(seconds=300)  # the bound on the target ends a longer wait anyway
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, n, True, timeout=wait_store, wait_for_workers=False)
        conn.send(("port", rank, store.port))
    else:
        store = dist.TCPStore("127.0.0.1", int(conn.recv()), n, False, timeout=wait_store)
    dist.init_process_group(o.backend, store=store, rank=rank, world_size=n)
    conn.send(("device", rank, _device_line(torch, rank, o)))
    if o.fault == "hang" and rank == n - 1:
        while True:  # the others wait for it in their first all_reduce
            time.sleep(3600)
    if o.fault == "exit" and rank == n - 1:
        raise RuntimeError("--fault exit: this rank gives up")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    for size in sizes(o):
        count = size // 4
        buf = _pattern(torch, count, rank, dev)
        for _ in range(o.warmup_iters):
            dist.all_reduce(buf)
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(o.iters):
                dist.all_reduce(buf)
            end.record()
            end.synchronize()
            time_us = start.elapsed_time(end) * 1000.0 / o.iters
        else:
            t0 = time.perf_counter()
            for _ in range(o.iters):
                dist.all_reduce(buf)
            time_us = (time.perf_counter() - t0) * 1.0e6 / o.iters
        wrong = None
        if o.check:
            buf.copy_(_pattern(torch, count, rank, dev))
            dist.all_reduce(buf)
            sync()
            if o.fault == "wrong" and rank == 0:
                buf[:FAULT_WRONG] += 1.0
            expected = sum(_pattern(torch, count, r, dev) for r in range(n))  # what every rank must hold
            wrong = int((buf != expected).sum().item())
            del expected
        del buf
        conn.send(("row", rank, (size, time_us, wrong)))
    sync()
    dist.destroy_process_group()
    conn.send(("done", rank, None))


# ------------------------------------------------------------------ the launcher


class RankFailed(Exception):
    """A rank sent an error or ended before reporting."""


def _gather(conns: list[Any], kind: str) -> list[Any]:
    """One message of `kind` from every rank, in rank order; whichever rank is ready is read first."""
    got: dict[int, Any] = {}
    pending = dict(enumerate(conns))
    while pending:
        ready = {id(c) for c in wait(list(pending.values()))}
        for r in [k for k, c in pending.items() if id(c) in ready]:
            try:
                what, rank, value = pending[r].recv()
            except (EOFError, OSError):
                raise RankFailed(f"rank {r} ended before it reported its {kind}") from None
            if what == "error":
                raise RankFailed(f"rank {rank}: {value}")
            if what != kind:
                raise RankFailed(f"rank {rank} sent {what!r}, expected {kind!r}")
            got[r] = value
            del pending[r]
    return [got[r] for r in range(len(conns))]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line: ranks print NCCL's lines to the same pipe
    sys.stdout.flush()


def launch(o: argparse.Namespace) -> int:
    """Fork the ranks, print the table as they report, return the exit status."""
    n = o.ngpus
    ctx = multiprocessing.get_context("fork")
    conns, procs = [], []
    for r in range(n):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_rank, args=(r, o, theirs), name=f"rank{r}")
        p.start()
        theirs.close()
        conns.append(mine)
        procs.append(p)
    _say(f"# {NAME}: {n} rank(s), backend {o.backend} on {o.device}")
    _say(
        "# nThread 1 nGpus 1 minBytes %d maxBytes %d step: %d(factor) warmup iters: %d iters: %d "
        "agg iters: 1 validation: %d graph: 0 unalign: 0"
        % (o.minbytes, o.maxbytes, o.stepfactor, o.warmup_iters, o.iters, o.check)
    )
    _say("#")
    wrong_sizes, busbws = 0, []
    try:
        (port,) = _gather(conns[:1], "port")
        for c in conns[1:]:
            c.send(port)
        _say("# Using devices")
        for line in _gather(conns, "device"):
            _say(line)
        _say("#")
        _say(
            "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          "
            % ("", "", "", "", "")
        )
        _say(
            "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s"
            % (
                "size",
                "count",
                "type",
                "redop",
                "root",
                "time",
                "algbw",
                "busbw",
                "#wrong",
                "time",
                "algbw",
                "busbw",
                "#wrong",
            )
        )
        _say(
            "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s"
            % (
                "(B)",
                "(elements)",
                "",
                "",
                "",
                "(us)",
                "(GB/s)",
                "(GB/s)",
                "",
                "(us)",
                "(GB/s)",
                "(GB/s)",
                "",
            )
        )
        for size in sizes(o):
            reports = _gather(conns, "row")
            time_us = max(t for _, t, _ in reports)
            wrongs = [w for _, _, w in reports if w is not None]
            wrong = sum(wrongs) if o.check else None
            wrong_sizes += 1 if wrong else 0
            busbws.append(size / 1.0e3 / time_us * bus_factor(n) if time_us > 0 else 0.0)
            _say(row(size, time_us, n, wrong))
        _gather(conns, "done")
    except RankFailed as exc:
        _say(f"# error: {exc}")
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        return 2
    for p in procs:
        p.join()
    _say("# %-20s : %d %s" % ("Out of bounds values", wrong_sizes, "FAILED" if wrong_sizes else "OK"))
    _say("# %-20s : %g " % ("Avg bus bandwidth", sum(busbws) / len(busbws) if busbws else 0.0))
    _say("#")
    _say(f"# Collective test concluded: {NAME}")
    return 1 if wrong_sizes else 0


def probe() -> int:
    """Print one JSON line: torch's version and whether it has torch.distributed with NCCL."""
    import warnings

    warnings.filterwarnings("ignore")
    info: dict[str, Any] = {"python": sys.executable, "python_version": sys.version.split()[0]}
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # ImportError, or a torch that fails to load its libraries
        info["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(info))
        return 0
    info["torch"] = str(torch.__version__)
    info["cuda"] = torch.version.cuda
    info["distributed"] = bool(dist.is_available())
    info["nccl"] = bool(info["distributed"] and dist.is_nccl_available())
    info["gloo"] = bool(info["distributed"] and dist.is_gloo_available())
    if info["nccl"]:
        try:
            v = torch.cuda.nccl.version()
            info["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as exc:
            info["nccl_version_error"] = str(exc)[:200]
    print(json.dumps(info))
    return 0


def main(argv: list[str]) -> int:
    o = options(argv)
    return probe() if o.probe else launch(o)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
