"""The bulk stream's controller side: the sender's argv, the request, and framed reads.

The wire format is defined once, by the constants of pytest_gpuhost/exec/agent/probe_backup.py
(the node's side, which must stay stdlib-only); this module only uses them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pytest_gpuhost.exec.agent import probe_backup as wire
from pytest_gpuhost.exec.agent import probe_program
from pytest_gpuhost.modules.backup.listing import RemoteFile

__all__ = ["ChannelIO", "StreamReader", "request", "request_chunks", "sender_argv"]


def request_chunks(files: Sequence[RemoteFile], chunk: int = 1 << 20) -> Iterator[bytes]:
    """Yield the sender's request in pieces of about `chunk` bytes, never the whole at once: a
    million names would otherwise be held twice (the pieces and their join) while it is sent."""
    req = [wire.MAGIC]
    held = 4
    for f in files:
        req += (wire.U32.pack(len(f.path)), f.path, wire.U32.pack(f.anchor_len))
        held += len(f.path) + 8
        if held >= chunk:
            yield b"".join(req)
            req, held = [], 0
    req.append(wire.U32.pack(0))
    yield b"".join(req)


def request(files: Sequence[RemoteFile]) -> bytes:
    """Return the sender's request: which files, each with the length of its anchor."""
    return b"".join(request_chunks(files))


def sender_argv(stall_timeout: float = 120.0, python: str = "python3") -> list[str]:
    """Return the argv that runs the bulk sender on the node (python3 -c <core + probe_backup>)."""
    source = probe_program("probe_backup", "send_main()")
    return ["env", f"GPUHOST_SEND_STALL={int(stall_timeout)}", python, "-c", source]


class ChannelIO:
    """Adapt a raw channel (paramiko Channel, Popen, or file pair) to read/write/close."""

    def __init__(self, chan: Any, stall_timeout: float = 60.0) -> None:
        self.chan = chan
        if hasattr(chan, "recv") and hasattr(chan, "close_stdin"):  # pytest_gpuhost.exec.channels.RawChannel

            def recv(n: int) -> bytes:
                return bytes(chan.recv(stall_timeout))  # TimeoutError (an OSError) when stalled

            self._read = recv
            self._write = chan.send
        elif hasattr(chan, "recv") and hasattr(chan, "sendall"):
            self._read = chan.recv
            self._write = chan.sendall
        elif hasattr(chan, "stdout") and hasattr(chan, "stdin") and chan.stdout is not None:
            out = chan.stdout
            self._read = getattr(out, "read1", out.read)
            inp = chan.stdin

            def write(data: bytes) -> None:
                inp.write(data)
                inp.flush()

            self._write = write
        else:
            self._read = getattr(chan, "read1", chan.read)
            self._write = chan.write

    def read(self, n: int) -> bytes:
        return bytes(self._read(n))

    def write(self, data: bytes) -> None:
        self._write(data)

    def close(self) -> None:
        for name in ("close", "kill"):
            fn = getattr(self.chan, name, None)
            if fn is not None:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - closing a dead channel is best effort
                    pass
                return


class StreamReader:
    """Buffered exact reads from a channel, with a stall watchdog that closes a dead channel."""

    def __init__(self, io: ChannelIO, stall_timeout: float) -> None:
        self.io = io
        self.buf = bytearray()
        self.last = time.monotonic()
        self.stalled = False
        self.done = threading.Event()
        self.received = 0
        self._watch = threading.Thread(target=self._watchdog, args=(stall_timeout,), daemon=True)
        self._watch.start()

    def _watchdog(self, limit: float) -> None:
        while not self.done.wait(min(1.0, limit / 4)):
            if time.monotonic() - self.last > limit:
                self.stalled = True
                self.io.close()
                return

    def _fill(self, want: int) -> None:
        while len(self.buf) < want:
            block = self.io.read(max(1 << 20, want - len(self.buf)))
            if not block:
                raise EOFError("stalled" if self.stalled else "stream ended")
            self.last = time.monotonic()
            self.received += len(block)
            self.buf += block

    def exact(self, n: int) -> bytes:
        if len(self.buf) < n:
            self._fill(n)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def u32(self) -> int:
        return int(wire.U32.unpack(self.exact(4))[0])

    def u64(self) -> int:
        return int(wire.U64.unpack(self.exact(8))[0])

    def pipe(self, n: int, sinks: Sequence[Callable[[bytes], Any]]) -> None:
        """Pass the next n bytes to each sink in pieces, without joining or copying them twice."""
        while n:
            if self.buf:
                take = min(n, len(self.buf))
                piece = bytes(self.buf[:take])
                del self.buf[:take]
            else:
                block = self.io.read(1 << 20)
                if not block:
                    raise EOFError("stalled" if self.stalled else "stream ended")
                self.last = time.monotonic()
                self.received += len(block)
                if len(block) <= n:
                    piece, take = block, len(block)  # the common case for big files: no copy
                else:
                    piece, take = block[:n], n
                    self.buf += memoryview(block)[n:]
            for sink in sinks:
                sink(piece)
            n -= take
