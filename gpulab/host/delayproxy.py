"""Delay a lab host's SSH port in user space, for kernels without the netem qdisc.

Run by the lab inside the host's netns (``ip netns exec gl-NAME python -m gpulab.host.delayproxy
--listen 198.18.I.2:22 --to 127.0.0.1:22 --delay-ms D --pidfile FILE``) while the host's sshd
listens on loopback only. Every chunk waits ``D`` ms in each direction, in order, and a new
connection waits ``D`` ms more, as the handshake over a delayed link would: the round trip is
``2 D``, as with netem's delay on both ends of the link. Only the SSH port is delayed, and a
dead sshd shows as a closed connection rather than a refused one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

__all__ = ["main"]


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader to writer, each chunk ``delay`` seconds after it arrived, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            await asyncio.sleep(max(0.0, due - loop.time()))
            writer.write_eof()

    task = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(65536)
            queue.put_nowait((loop.time() + delay, data))
            if not data:
                break
        await task
    except (OSError, asyncio.IncompleteReadError):
        task.cancel()
    finally:
        with contextlib.suppress(OSError):
            writer.close()


async def _serve(listen: tuple[str, int], to: tuple[str, int], delay: float) -> None:
    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(delay)  # the handshake's extra one-way trip
        try:
            u_reader, u_writer = await asyncio.wait_for(asyncio.open_connection(*to), timeout=10)
        except (OSError, asyncio.TimeoutError):
            c_writer.close()
            return
        await asyncio.gather(_pump(c_reader, u_writer, delay), _pump(u_reader, c_writer, delay))

    server = await asyncio.start_server(handle, listen[0], listen[1], reuse_address=True)
    async with server:
        await server.serve_forever()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM."""
    ap = argparse.ArgumentParser(prog="python -m gpulab.host.delayproxy")
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept on")
    ap.add_argument("--to", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, required=True, help="delay each way")
    ap.add_argument("--pidfile", help="write this process's PID here")
    args = ap.parse_args(argv)
    if args.pidfile:
        with open(args.pidfile, "w") as f:
            f.write(f"{os.getpid()}\n")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(_addr(args.listen), _addr(args.to), args.delay_ms / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
