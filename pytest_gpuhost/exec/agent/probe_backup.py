"""Agent probe: read backed-up files where they lie: hashing (`backup_hash`) and the bulk sender.

Stdlib only, Python 3.6 syntax (see exec/agent/__init__.py).  The same probe also runs alone as
the bulk sender on a second raw channel (`probe_program("probe_backup", "send_main()")`, see
pytest_gpuhost.modules.backup.stream), and the controller imports it for the wire constants
below: the wire format is defined here, once.  The listing is probe_backup_walk.py, the digests
for objects already in S3 (`backup_digests`) probe_backup_digests.py.

File names travel as {"p": str} when they are valid UTF-8 and as {"pb": base64 of the bytes}
otherwise, so a name with newlines, quotes or non-UTF-8 bytes arrives unchanged.  A listed path
also carries "a": the length of its anchor, the directory the operator named (a category root,
or the parent of a root that is a file).  The anchor is opened following its own ancestors;
every component below it is opened with O_NOFOLLOW from the directory fd above it, so a
directory swapped for a symlink during the backup makes that file fail, never read elsewhere.

Bulk wire format (all integers big-endian):
  controller -> node: MAGIC, then per file u32 len + absolute path bytes + u32 anchor len,
  then u32 0.
  node -> controller: MAGIC, then per file: u32 index, frames, u32 0, trailer; finally
  u32 END and u32 count of files sent.  A frame is (u32 len, len bytes) for data, or
  (u32 HOLE, u64 len) for a hole (that many zero bytes, not sent).  Trailer: TRAILER =
  (i32 code, u64 apparent size, i64 mtime seconds, u32 mtime nanoseconds, u32 mode, u8 changed,
  32 bytes sha256); code 0 is success, > 0 an errno, NOT_REGULAR a path that is no longer a
  regular file.  The mtime travels as seconds and nanoseconds (`pack_trailer`/`unpack_trailer`),
  not as one i64 of nanoseconds: that covers only 1677-2262, and ext4, XFS (bigtime) and btrfs
  hold mtimes far outside it (a clock or a tool gone wrong); one such file made the sender's
  struct.pack raise, its thread die and the whole category stall on every run.  A file the
  sender cannot describe for any other reason gets an error trailer (BAD_META) of its own: no
  file stops the others.
"""

import base64
import errno
import hashlib
import os
import stat
import struct
import sys
import threading
import time

from pytest_gpuhost.exec.agent.core import op

MAGIC = b"GHB3"
CHUNK = 1 << 20
TRAILER = struct.Struct(">iQqIIB32s")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
END = 0xFFFFFFFF
HOLE = 0x80000000  # a frame length with this bit is a hole; data frames are at most CHUNK
NOT_REGULAR = -1  # trailer code: the path is no longer a regular file (changed type)
CHANGED = -2  # backup_digests: size, mtime or ctime moved while the file was read
BAD_META = -3  # trailer code: the file's size, mtime or mode cannot be carried by the wire format

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: a FIFO or device that replaced a file never blocks the open or a read
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
ZERO = memoryview(bytes(CHUNK))  # slices of a memoryview are not copies


def pack_trailer(code, size, mtime_ns, mode, changed, sha):
    """Return the trailer bytes of one file; the mtime as (seconds, nanoseconds), any i64 seconds."""
    sec, nsec = divmod(mtime_ns, 1000000000)
    return TRAILER.pack(code, size, sec, nsec, mode, changed, sha)


def unpack_trailer(data):
    """Return (code, size, mtime_ns, mode, changed, sha256) of a trailer's bytes."""
    code, size, sec, nsec, mode, changed, sha = TRAILER.unpack(data)
    return code, size, sec * 1000000000 + nsec, mode, changed, sha


def unname(item):
    """Return the path bytes of a wire name."""
    if "pb" in item:
        return base64.b64decode(item["pb"])
    return item["p"].encode("utf-8")


# ---------------------------------------------------------------- opening and reading


class Opener:
    """Open listed files below their anchors with O_NOFOLLOW per component, reusing directory fds."""

    def __init__(self):
        self.anchor = None
        self.anchor_fd = None
        self.chain = []  # [(component, fd)] below the anchor, for the last file's directory

    def _drop(self, keep):
        while len(self.chain) > keep:
            os.close(self.chain.pop()[1])

    def close(self):
        self._drop(0)
        if self.anchor_fd is not None:
            os.close(self.anchor_fd)
        self.anchor = self.anchor_fd = None

    def open(self, path, anchor_len):
        """Return (fd, fstat) of a regular file; raise OSError, or OSError(NOT_REGULAR)."""
        anchor = path[:anchor_len] or b"/"
        parts = [p for p in path[anchor_len:].split(b"/") if p]
        if not parts:
            raise OSError(errno.EINVAL, "no file name below the anchor")
        if anchor != self.anchor:
            self.close()
            # the anchor is the operator's; only its own last component is not followed
            self.anchor_fd = os.open(anchor, _DIR)
            self.anchor = anchor
        dirs = parts[:-1]
        keep = 0
        while keep < len(self.chain) and keep < len(dirs) and self.chain[keep][0] == dirs[keep]:
            keep += 1
        self._drop(keep)
        for d in dirs[keep:]:
            parent = self.chain[-1][1] if self.chain else self.anchor_fd
            self.chain.append((d, os.open(d, _DIR, dir_fd=parent)))
        parent = self.chain[-1][1] if self.chain else self.anchor_fd
        # a stat first: a device that replaced the file is never opened (an open can rewind a tape)
        st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, "now a symlink")
        if not stat.S_ISREG(st.st_mode):
            raise OSError(NOT_REGULAR, "no longer a regular file")
        fd = os.open(parts[-1], _FILE, dir_fd=parent)
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            raise OSError(NOT_REGULAR, "replaced while opened")
        return fd, fst


def extents(fd, st):
    """Yield (is_data, offset, length) for a file; holes only where the file is sparse."""
    size = st.st_size
    seek_data = getattr(os, "SEEK_DATA", None)
    if seek_data is None or st.st_blocks * 512 >= size or size == 0:
        yield True, 0, None  # dense: read to the end, whatever the size is by then
        return
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fd, pos, seek_data)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                yield True, pos, None  # no hole support after all: read the rest
                return
            data = size  # only a hole is left
        if data > pos:
            yield False, pos, min(data, size) - pos
            pos = min(data, size)
        if pos >= size:
            return
        end = min(os.lseek(fd, pos, os.SEEK_HOLE), size)
        yield True, pos, end - pos
        pos = end


class _NoDigest:
    def update(self, data):
        pass

    def digest(self):
        return b""


def read_file(fd, st, data_out, hole_out, sha256=True):
    """Read a file's data extents into data_out(bytes) and holes into hole_out(n); return (size, sha256).

    Without sha256 the digest returned is b"" (a caller that needs other digests only).
    """
    digest = hashlib.sha256() if sha256 else _NoDigest()
    size = 0
    for is_data, offset, length in extents(fd, st):
        if not is_data:
            hole_out(length)
            left = length
            while left:
                digest.update(ZERO[: min(left, CHUNK)])
                left -= min(left, CHUNK)
            size += length
            continue
        if offset or length is not None:  # a fresh fd read whole starts at 0 already
            os.lseek(fd, offset, os.SEEK_SET)
        left = length
        while left is None or left > 0:
            block = os.read(fd, CHUNK if left is None else min(left, CHUNK))
            if not block:
                break
            digest.update(block)
            data_out(block)
            size += len(block)
            if left is not None:
                left -= len(block)
    return size, digest.digest()


@op("backup_hash")
def backup_hash(params):
    """Hash files where they lie (SHA-256, streamed); one result per path, errors as errno."""
    out = []
    opener = Opener()
    try:
        for item in params["paths"]:
            path = unname(item)
            try:
                fd, st = opener.open(path, int(item.get("a", 0)))
            except OSError as exc:
                out.append({"errno": exc.errno, "error": exc.strerror})
                continue
            try:
                size, digest = read_file(fd, st, lambda b: None, lambda n: None)
                after = os.fstat(fd)
                if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
                    size,
                    st.st_mtime_ns,
                    st.st_ctime_ns,
                ):
                    out.append({"errno": CHANGED, "error": "changed while it was read"})
                    continue
                out.append(
                    {
                        "sha256": digest.hex(),
                        "s": size,
                        "m": st.st_mtime_ns,
                        "c": st.st_ctime_ns,
                        "i": st.st_ino,
                    }
                )
            except OSError as exc:
                out.append({"errno": exc.errno, "error": exc.strerror})
            finally:
                os.close(fd)
    finally:
        opener.close()
    return out


# ---------------------------------------------------------------- the bulk sender


def _read_exact(stream, n):
    buf = b""
    while len(buf) < n:
        block = stream.read(n - len(buf))
        if not block:
            raise EOFError("input ended")
        buf += block
    return buf


def reader_thread(files, queue_put):
    """Read and hash each (path, anchor length); hand framed bytes to the writer (runs in a thread).

    Small files are batched into blocks of about 1 MiB so that the writer makes few large
    writes; big reads travel as their own items without being copied again.
    """
    zero = b"\0" * 32
    u32 = U32.pack
    buf = bytearray()
    opener = Opener()

    def data(block):
        if len(block) >= 65536:
            buf.extend(u32(len(block)))
            queue_put(bytes(buf))
            del buf[:]
            queue_put(block)
        else:
            buf.extend(u32(len(block)))
            buf.extend(block)

    def hole(n):
        buf.extend(u32(HOLE))
        buf.extend(U64.pack(n))

    for index, (path, anchor_len) in enumerate(files):
        buf += u32(index)
        try:
            fd, st = opener.open(path, anchor_len)
        except OSError as exc:
            buf += u32(0) + pack_trailer(exc.errno or errno.EIO, 0, 0, 0, 0, zero)
            continue
        err = 0
        size, digest = 0, zero
        try:
            size, digest = read_file(fd, st, data, hole)
        except OSError as exc:
            err = exc.errno or errno.EIO
        after = os.fstat(fd)
        os.close(fd)
        # ctime too: a rewrite in place with its mtime put back (touch -r, cp -p) still moves it
        changed = int(
            after.st_mtime_ns != st.st_mtime_ns
            or after.st_size != size
            or after.st_ctime_ns != st.st_ctime_ns
        )
        buf += u32(0)
        try:
            buf += pack_trailer(
                err, size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), changed, digest if not err else zero
            )
        except (struct.error, OverflowError, ValueError):  # beyond even i64 seconds: name it, go on
            buf += pack_trailer(BAD_META, 0, 0, 0, 0, zero)
        if len(buf) >= CHUNK:
            queue_put(bytes(buf))
            del buf[:]
    opener.close()
    buf += u32(END) + u32(len(files))
    queue_put(bytes(buf))
    queue_put(None)


def send_main():
    """Bulk sender: read a framed path list on stdin, write a framed stream of contents on stdout."""
    import queue

    stdin = sys.stdin.buffer
    out = sys.stdout.buffer
    if _read_exact(stdin, 4) != MAGIC:
        sys.stderr.write("backup sender: bad magic\n")
        sys.exit(2)
    files = []
    while True:
        (n,) = U32.unpack(_read_exact(stdin, 4))
        if n == 0:
            break
        path = _read_exact(stdin, n)
        (anchor_len,) = U32.unpack(_read_exact(stdin, 4))
        files.append((path, anchor_len))
    q = queue.Queue(maxsize=64)  # type: queue.Queue
    last_write = [time.time()]

    def watchdog():
        # a peer that stopped reading (cut link, killed controller) must not keep us forever
        while True:
            time.sleep(5)
            if time.time() - last_write[0] > float(os.environ.get("GPUHOST_SEND_STALL", "120")):
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    reader = threading.Thread(target=reader_thread, args=(files, q.put), daemon=True)
    reader.start()
    out.write(MAGIC)
    while True:
        item = q.get()
        if item is None:
            out.flush()
            return
        out.write(item)
        last_write[0] = time.time()
