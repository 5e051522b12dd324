"""The agent's protocol loop: one JSON request per line on stdin, one reply per line on stdout.

Wire protocol (docs/INTERNALS.md section 1): request `{"id": 7, "op": "run", ...params}`; reply
`{"id": 7, "ok": true, "result": ...}` or `{"id": 7, "ok": false, "error": "one line",
"errno": 13 | null}`; streaming ops send `{"id": 7, "chunk": ...}` lines before the final reply.
Requests are handled one at a time; nothing in a handler waits without a bound, so the agent
always comes back to this loop.

Target side: stdlib only, Python 3.6 syntax (see the package docstring, which also says how the
core files and the probes are joined into the program that calls `main()`).
"""

import json
import os
import signal
import sys

from pytest_gpuhost.exec.agent.files import read_text as read_text  # for importers of the old module
from pytest_gpuhost.exec.agent.registry import ORPHANS, PROTO_FDS, dispatch, one_line, reap_orphans


def main():
    """Serve requests from fd 0 until EOF."""
    # Keep the protocol on private descriptors: fd 0 becomes /dev/null and fd 1 goes to stderr,
    # so a child that inherits them (or a probe that prints) cannot corrupt the stream.
    proto_in = os.fdopen(os.dup(0), "rb", 65536)
    proto_out = os.fdopen(os.dup(1), "wb", 0)
    PROTO_FDS[:] = [proto_in.fileno(), proto_out.fileno()]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # A command that exits without reading its stdin must cost an EPIPE in the runner, not the
    # agent: SIGPIPE stays ignored here (subprocess restores it for every child), and a broken
    # protocol pipe, which means the controller is gone, ends the agent quietly.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    def send(obj):
        try:
            proto_out.write(json.dumps(obj, separators=(",", ":")).encode("utf-8") + b"\n")
        except BrokenPipeError:
            sys.exit(0)

    while True:
        line = proto_in.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line.decode("utf-8"))
        except ValueError as exc:
            send({"id": None, "ok": False, "error": f"bad request: {one_line(exc)}", "errno": None})
            continue
        rid = req.get("id")

        def emit(chunk, rid=rid):
            send({"id": rid, "chunk": chunk})

        send(dispatch(req, emit))
        if ORPHANS:
            reap_orphans()
