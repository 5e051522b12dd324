"""A TCP proxy that delays every chunk each way: netem's effect in user space, for bench_health.py."""

from __future__ import annotations

import asyncio
import threading


class DelayProxy:
    """A TCP proxy that delays every chunk by `delay` seconds each way: netem's effect, in user space.

    Used when the kernel has no netem. Each direction keeps its order; a connection's first
    bytes also wait one round trip, as a TCP handshake over the delayed link would.
    """

    def __init__(self, delay_s: float) -> None:
        self.delay = delay_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[asyncio.base_events.Server] = []
        self.writers: set[asyncio.StreamWriter] = set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def pump() -> None:
            while True:
                data = await reader.read(65536)
                queue.put_nowait((self.loop.time() + self.delay, data))
                if not data:
                    return

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - self.loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        try:
            await asyncio.gather(pump(), deliver())
        except (ConnectionError, OSError):
            pass

    async def _handle(
        self, target: tuple[str, int], cr: asyncio.StreamReader, cw: asyncio.StreamWriter
    ) -> None:
        self.writers.add(cw)
        await asyncio.sleep(2 * self.delay)  # the handshake's round trip
        try:
            sr, sw = await asyncio.wait_for(asyncio.open_connection(*target), 10)
        except (OSError, asyncio.TimeoutError):
            cw.close()
            return
        self.writers.add(sw)
        try:
            await asyncio.gather(self._pipe(cr, sw), self._pipe(sr, cw))
        except asyncio.CancelledError:
            pass  # shutting down: end quietly (asyncio logs a cancelled connection callback)
        for w in (sw, cw):
            w.close()
            self.writers.discard(w)

    def add(self, host: str, port: int) -> int:
        """Listen on 127.0.0.1:<free port> for host:port; return the port."""

        async def start() -> int:
            srv = await asyncio.start_server(lambda r, w: self._handle((host, port), r, w), "127.0.0.1", 0)
            self.servers.append(srv)
            return int(srv.sockets[0].getsockname()[1])

        return asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def close(self) -> None:
        """Stop listening, cancel the open connections, stop the loop's thread."""

        async def shutdown() -> None:
            for srv in self.servers:
                srv.close()
            for w in list(self.writers):
                w.close()  # the other side reads EOF: every pipe ends on its own
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=1)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
