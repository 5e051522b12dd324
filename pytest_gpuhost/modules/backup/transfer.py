"""One bulk stream of file contents from the node into the local writer.

A file's failure (unreadable on the node, changed type, local path too long, disk full) is
recorded for that file and the stream goes on; only a broken stream ends the run, and a rerun
resumes from what was verified.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pytest_gpuhost.exec.agent import probe_backup as wire
from pytest_gpuhost.modules.backup.listing import RemoteFile
from pytest_gpuhost.modules.backup.manifest import BackupError
from pytest_gpuhost.modules.backup.state import Progress, TransferResult
from pytest_gpuhost.modules.backup.stream import ChannelIO, StreamReader, request_chunks, sender_argv
from pytest_gpuhost.modules.backup.writer import LocalWriter, Piece, hash_zeros, write_all

__all__ = ["SMALL", "transfer"]

SMALL = 4 << 20  # files up to this size are assembled in memory and written by a writer thread


def transfer(
    conn: Any,
    writer: LocalWriter,
    files: list[RemoteFile],
    result: TransferResult,
    *,
    stall_timeout: float,
    writers: int,
    progress: Callable[[Progress], None] | None,
    progress_interval: float,
    failed: Callable[[RemoteFile, str], None],
) -> None:
    """Stream the files' contents over one channel; small files are written by writer threads."""
    total_bytes = sum(f.size for f in files)
    # the interpreter the agent found on the node (exec/pythons.py), not whatever `python3` is
    python = str(
        getattr(conn, "python", "") or getattr(getattr(conn, "opts", None), "python", "") or "python3"
    )
    chan = ChannelIO(conn.open_channel(sender_argv(max(stall_timeout * 2, 30), python)), stall_timeout)
    reader = StreamReader(chan, stall_timeout)
    started = time.monotonic()
    last_report = started
    done = [0, 0]  # files, bytes placed
    lock = threading.Lock()
    tmp_path: Path | None = None
    # Writer threads (4 by default) create the small files, off the stream.  Creating a file costs
    # this machine's ext4 about 0.5 ms of kernel time, and creates in one directory serialise on its
    # lock, so each writer makes its temporary files in a directory of its own (measured, 5,000
    # files: one writer 600 us a file, two writers in separate directories 190, in one directory 520).
    pool = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="backup-write")
    local = threading.local()

    def writer_dir() -> Path:
        d: Path | None = getattr(local, "dir", None)
        if d is None:
            d = local.dir = writer.tmp / f"w{threading.get_ident()}"
            d.mkdir(exist_ok=True)
        return d

    inflight = threading.BoundedSemaphore(64)  # at most 64 small files (<= 256 MiB) in memory

    def placed(f: RemoteFile, why: str | None) -> None:
        with lock:
            if why is None:
                done[0] += 1
                done[1] += f.size
            else:
                result.failed.append((f.display, why))
                failed(f, why)

    def small_job(f: RemoteFile, index: int, pieces: list[Piece], trailer: tuple[Any, ...]) -> None:
        try:
            why = writer.write_small(f, writer_dir() / f"{index}.part", pieces, trailer)
        except OSError as exc:  # the writer's own directory could not be made
            why = f"writing the copy: {exc.strerror}"
        finally:
            inflight.release()
        placed(f, why)

    def report() -> None:
        if progress is not None:
            with lock:
                files_done, bytes_done = done
            progress(Progress(files_done, len(files), bytes_done, total_bytes, time.monotonic() - started))

    try:
        # the request goes from a thread: a long list must not deadlock against a full pipe
        threading.Thread(target=_send_request, args=(chan, files), daemon=True).start()
        if reader.exact(4) != wire.MAGIC:
            raise BackupError(f"bulk sender did not start under {python} on the node")
        while True:
            index = reader.u32()
            if index == wire.END:
                reader.u32()
                break
            if index >= len(files):
                raise BackupError(f"bulk stream out of step (file index {index})")
            f = files[index]
            if f.size <= SMALL:
                pieces: list[Piece] = []
                while n := reader.u32():
                    if n == wire.HOLE:
                        pieces.append(reader.u64())
                    else:
                        reader.pipe(n, (pieces.append,))
                trailer = wire.unpack_trailer(reader.exact(wire.TRAILER.size))
                if not inflight.acquire(timeout=stall_timeout):
                    raise BackupError(f"local writes stalled for {stall_timeout:.0f} s")
                pool.submit(small_job, f, index, pieces, trailer)
            else:
                tmp_path = writer.tmp / f"{index}.part"
                why = _receive_big(reader, writer, f, tmp_path)
                tmp_path = None
                placed(f, why)
            now = time.monotonic()
            if now - last_report >= progress_interval:
                last_report = now
                report()
    except (EOFError, OSError, struct.error) as exc:
        why = f"no data for {stall_timeout:.0f} s" if reader.stalled else str(exc) or type(exc).__name__
        result.error = f"transfer interrupted after {done[0]}/{len(files)} files: {why}"
    finally:
        reader.done.set()
        chan.close()
        # files that arrived whole are still written and verified; then nothing is in flight
        pool.shutdown(wait=True)
        if tmp_path is not None:
            tmp_path.unlink(missing_ok=True)
        for d in writer.tmp.glob("w*"):
            try:
                d.rmdir()  # empty once every write finished or was cleaned up
            except OSError:
                pass
        result.copied_files += done[0]
        result.copied_bytes += done[1]
        if result.error is None:
            report()


def _send_request(chan: ChannelIO, files: list[RemoteFile]) -> None:
    """Send the request piece by piece; a channel closed under it ends the stream, not this thread."""
    try:
        for piece in request_chunks(files):
            chan.write(piece)
    except OSError:
        pass  # the reader sees the stream end and says why


class _Sink:
    """Where a big file's frames go: the temporary file, or nowhere once a local write failed."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        self.digest = hashlib.sha256()
        self.error: OSError | None = None

    def data(self, piece: bytes) -> None:
        self.digest.update(piece)
        if self.fd is not None and self.error is None:
            try:
                write_all(self.fd, piece)
            except OSError as exc:
                self.error = exc

    def hole(self, n: int) -> None:
        hash_zeros(self.digest, n)
        if self.fd is not None and self.error is None:
            try:
                os.lseek(self.fd, n, os.SEEK_CUR)
            except OSError as exc:
                self.error = exc


def _receive_big(reader: StreamReader, writer: LocalWriter, f: RemoteFile, tmp: Path) -> str | None:
    """Receive one big file straight into its temporary file; return why it failed, or None.

    A local failure (disk full, ...) still reads the file's frames, so the stream stays in step.
    """
    fd: int | None = None
    open_error: OSError | None = None
    try:
        fd = writer.open_part(tmp)
    except OSError as exc:
        open_error = exc
    sink = _Sink(fd)
    try:
        while n := reader.u32():
            if n == wire.HOLE:
                sink.hole(reader.u64())
            else:
                reader.pipe(n, (sink.data,))
        trailer = wire.unpack_trailer(reader.exact(wire.TRAILER.size))
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    error = open_error or sink.error
    if fd is None or error is not None:
        if fd is not None:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        return f"writing the copy: {error.strerror if error else 'failed'}"
    return writer.store(f, tmp, trailer, sink.digest.digest(), fd)
