"""Lab stand-in for ``python3 -m sglang.launch_server``: holds its GPUs and serves /health.

So that ``ps`` shows exactly the real command line, the lab passes its settings in the
environment: ``GPULAB_SERVICE`` (name, for the log path and the record), ``GPULAB_IGNORE_SIGTERM``
(``0``: exit on SIGTERM; ``N``: exit N seconds after it; ``forever``: ignore it) and
``GPULAB_GPUS`` (BDFs). Without ``GPULAB_GPUS`` the GPUs are ``--base-gpu-id`` .. +``--tp``x``--dp``-1
among those visible (on nvidia, with a device file). ``--ignore-sigterm`` overrides the environment.
``--gpulab-workers`` (or ``GPULAB_WORKERS``; default ``off``) starts SGLang's worker children,
renamed with setproctitle and holding their GPUs, some surviving the server (``sglang/workers.py``).

It opens ``/dev/nvidiactl``, ``/dev/nvidia-uvm`` and ``/dev/nvidiaN`` of each GPU and keeps them
open; exits 1 with CUDA's error when a GPU is missing. It writes a log (``--log-file`` or
``/var/log/sglang/<service>.log``) with NCCL's transport line (``via P2P/CUMEM`` when every GPU's
IOMMU group is identity or they are NVLink-connected, else ``via SHM/direct/direct``; SHM too when
``NCCL_P2P_DISABLE`` reads as 1 in its environment, as NCCL reads it), answers
``GET /health`` 503 while "loading" (``--gpulab-load-seconds``, default 1.0) and 200 after, and
records every signal it receives in ``/var/lib/gpulab/record.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

from gpulab_tools import Host, driver_of, load_profile, path, read, record

from sglang import workers

state: dict[str, Any] = {"ready": False, "stopping_at": None}
LOG = None


def log(msg: str) -> None:
    line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}\n"
    sys.stdout.write(line)
    sys.stdout.flush()
    if LOG is not None:
        LOG.write(line)
        LOG.flush()


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launch_server", add_help=True)
    ap.add_argument("--model-path", "--model", dest="model_path", default="")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp", type=int, default=1)
    ap.add_argument("--dp", "--dp-size", dest="dp", type=int, default=1)
    ap.add_argument("--base-gpu-id", type=int, default=0)
    ap.add_argument("--mem-fraction-static", type=float, default=0.88)
    ap.add_argument("--log-file", default=None)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--ignore-sigterm", default=None, help="gpulab: 0 | seconds | forever")
    ap.add_argument("--gpulab-workers", default=None, help="gpulab: " + " | ".join(workers.MODES))
    ap.add_argument(
        "--gpulab-load-seconds", type=float, default=float(os.environ.get("GPULAB_LOAD_SECONDS", "1.0"))
    )
    args, _unknown = ap.parse_known_args(argv)
    return args


def pick_gpus(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Return (bdf, minor) of the GPUs this server uses; exit like CUDA when one is missing."""
    prof = load_profile()
    funcs = {f["bdf"]: f for f in prof.get("pci", [])}
    env = [b for b in os.environ.get("GPULAB_GPUS", "").split(",") if b]
    if env:
        out = []
        for bdf in env:
            spec = next((g for g in prof.get("gpus", []) if g["bdf"] == bdf), None)
            if spec is None or driver_of(bdf, funcs.get(bdf, {}).get("driver")) != "nvidia":
                cuda_fail()
            m = read(path("var/lib/gpulab/ctl/minor", bdf))
            out.append((bdf, int(m) if m and m.isdigit() else int(spec["minor"])))
        return out
    visible = Host().gpus
    want = list(range(args.base_gpu_id, args.base_gpu_id + max(args.tp, 1) * max(args.dp, 1)))
    if not visible or want[-1] >= len(visible):
        cuda_fail()
    return [(visible[i].bdf, visible[i].minor) for i in want]


def cuda_fail() -> NoReturn:
    log("RuntimeError: CUDA error: no CUDA-capable device is detected")
    raise SystemExit(1)


def p2p_disabled() -> bool:
    """``NCCL_P2P_DISABLE`` in this process's environment reads as 1, as NCCL's ncclGetLevel reads it.

    src/graph/paths.cc (https://github.com/NVIDIA/nccl/blob/5067397c2676d5aed50042fc39e5c8ee96eb0027/src/graph/paths.cc):
    ``strtol(disableEnv, NULL, 0) == 1`` turns P2P off whatever the topology: the ranks go via SHM.
    """
    m = re.match(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", os.environ.get("NCCL_P2P_DISABLE", ""))
    if not m:
        return False
    digits = m[2]
    base = 16 if digits[:2].lower() == "0x" else 8 if digits.startswith("0") else 10
    return int(m[1] + (digits[2:] if base == 16 else digits), base) == 1


def transport(gpus: list[tuple[str, int]]) -> str:
    if p2p_disabled():
        return "SHM/direct/direct"
    host = Host()
    by_bdf = {g.bdf: g for g in host.gpus}
    views = [by_bdf[b] for b, _ in gpus if b in by_bdf]
    ok = len(views) == len(gpus) and all(host.p2p_ok(a, b) for a in views for b in views if a is not b)
    return "P2P/CUMEM" if ok else "SHM/direct/direct"


def on_signal(signum: int, _frame: object) -> None:
    name = signal.Signals(signum).name
    record(
        {
            "t": round(time.time(), 6),
            "kind": "signal",
            "pid": os.getpid(),
            "signal": name,
            "service": os.environ.get("GPULAB_SERVICE", ""),
        }
    )
    ign = state.get("ignore", "0")
    if signum == signal.SIGTERM and ign == "forever":
        log("Received sigterm, ignoring it (shutdown is not implemented for this model runner)")
        return
    if signum == signal.SIGTERM and ign not in ("0", "", None):
        if state["stopping_at"] is None:
            state["stopping_at"] = time.monotonic() + float(str(ign))
            log(f"Received sigterm, draining requests for {ign} s")
        return
    log(f"Received {name}, shutting down")
    state["stopping_at"] = time.monotonic()


class Handler(BaseHTTPRequestHandler):
    server_version = "uvicorn"
    sys_version = ""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def _send(self, code: int, body: object) -> None:
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if self.path in ("/health", "/health_generate"):
            if state["ready"]:
                self._send(200, b"")
            else:
                self._send(503, {"detail": "Server is not ready"})
        elif self.path in ("/get_model_info", "/v1/models"):
            mp = state.get("model", "")
            if self.path == "/v1/models":
                self._send(
                    200, {"object": "list", "data": [{"id": mp, "object": "model", "owned_by": "sglang"}]}
                )
            else:
                self._send(200, {"model_path": mp, "tokenizer_path": mp, "is_generation": True})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        """Answer /generate and /v1/chat/completions with a canned reply once loaded."""
        try:
            n = int(self.headers.get("content-length") or 0)
            req = json.loads(self.rfile.read(min(n, 1 << 20)) or b"{}")
        except ValueError:
            self._send(400, {"detail": "invalid JSON"})
            return
        if not state["ready"]:
            self._send(503, {"detail": "Server is not ready"})
            return
        text = "OK (gpulab stand-in)"
        if self.path == "/generate":
            self._send(
                200, {"text": text, "meta_info": {"id": "gpulab", "prompt_tokens": 1, "completion_tokens": 4}}
            )
        elif self.path == "/v1/chat/completions":
            self._send(
                200,
                {
                    "id": "chatcmpl-gpulab",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": req.get("model") or state.get("model", ""),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5},
                },
            )
        else:
            self._send(404, {"detail": "Not Found"})


def _reap() -> None:
    """Collect workers that exited, so none lingers as a zombie while the server runs."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def main(argv: list[str] | None = None) -> int:
    global LOG
    args = parse(sys.argv[1:] if argv is None else argv)
    name = os.environ.get("GPULAB_SERVICE") or "sglang"
    state["ignore"] = (
        args.ignore_sigterm
        if args.ignore_sigterm is not None
        else os.environ.get("GPULAB_IGNORE_SIGTERM", "0")
    )
    state["model"] = args.served_model_name or args.model_path
    log_path = args.log_file or f"/var/log/sglang/{name}.log"
    try:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        LOG = open(log_path, "a")  # noqa: SIM115
    except OSError:
        LOG = None
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(s, on_signal)
    log(
        f"server_args=ServerArgs(model_path='{args.model_path}', host='{args.host}', port={args.port}, "
        f"tp_size={args.tp}, dp_size={args.dp}, base_gpu_id={args.base_gpu_id}, "
        f"mem_fraction_static={args.mem_fraction_static})"
    )
    gpus = pick_gpus(args)
    fds = []
    # two /dev/nvidia-uvm descriptors, as CUDA from driver 535.43.02 holds them (UVM_MM_INITIALIZE)
    for dev in ("nvidiactl", "nvidia-uvm", "nvidia-uvm"):
        try:
            fds.append(os.open(path("dev", dev), os.O_RDONLY))
        except OSError:
            pass
    for _bdf, minor in gpus:
        try:
            fds.append(os.open(path("dev", f"nvidia{minor}"), os.O_RDONLY))
        except OSError:
            cuda_fail()
    for rank, (bdf, minor) in enumerate(gpus):
        log(f"[TP{rank}] Init torch distributed begin. device=cuda:{rank} (bus {bdf}, /dev/nvidia{minor})")
    hostname = socket.gethostname()
    if len(gpus) > 1:
        via = transport(gpus)
        n = len(gpus)
        # NCCL's own forms: p2p.cc prints "Channel %02d/%01d : ..." (with the connection index),
        # shm.cc "Channel %02d : ..." (none): github.com/NVIDIA/nccl/blob/master/src/transport/
        channel = "Channel 00/0" if via.startswith("P2P/") else "Channel 00"
        for r in range(n):
            nxt = (r + 1) % n
            log(
                f"{hostname}:{os.getpid()}:{os.getpid() + 100 + r} [{r}] NCCL INFO {channel} : {r}[{r}] -> {nxt}[{nxt}] via {via}"
            )
        log(f"{hostname}:{os.getpid()}:{os.getpid() + 100} [0] NCCL INFO Connected all rings")
    # Workers fork before any thread starts (the HTTP server below), as SGLang's do before uvicorn.
    mode = workers.mode(args.gpulab_workers)
    for plan in workers.plans(mode, [m for _, m in gpus], args.tp, args.dp):
        pid = workers.spawn(plan, lambda name: path("dev", name), record)
        log(f"started {plan.title} (pid {pid}, gpulab workers {mode})")
    try:
        srv = ThreadingHTTPServer((args.host, args.port), Handler)
    except OSError as e:
        log(
            f"ERROR: [Errno {e.errno}] error while attempting to bind on address ('{args.host}', {args.port}): {e.strerror}"
        )
        return 1
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="http", daemon=True).start()
    log(f"Load weight begin. avail mem={args.mem_fraction_static:.2f}")
    t_ready = time.monotonic() + args.gpulab_load_seconds
    while True:
        now = time.monotonic()
        if not state["ready"] and now >= t_ready:
            state["ready"] = True
            log(f"Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)")
            log("The server is fired up and ready to roll!")
        stop_at = state["stopping_at"]
        if stop_at is not None and now >= stop_at:
            break
        _reap()
        time.sleep(0.05)
    srv.shutdown()
    killed = workers.kill_tree(mode)  # launch_server.py's finally: kill_process_tree(os.getpid(), ...)
    if killed:
        log(f"killed workers {killed}")
    for fd in fds:
        os.close(fd)
    log("Shutdown complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
