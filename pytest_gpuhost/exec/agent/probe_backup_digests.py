"""Agent probe: the `backup_digests` op, every digest a backed-up file needs from one read of it.

Stdlib only, Python 3.6 syntax (see exec/agent/__init__.py).  SHA-256, SHA-1 and MD5 come from
hashlib, CRC32 from zlib, CRC32C and CRC64NVME (the S3 checksums) from the pure-Python CRC below
where nothing faster exists, and the multipart ETag's part MD5s from `_Parts`.  Files are opened
and read as the bulk sender reads them (probe_backup.py: `Opener`, `read_file`, the wire names).
"""

import hashlib
import os
import threading
import zlib

from pytest_gpuhost.exec.agent.core import OpError, op
from pytest_gpuhost.exec.agent.probe_backup import CHANGED, CHUNK, ZERO, Opener, read_file, unname


def _crc_table(poly, width):
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table, (1 << width) - 1


class _Crc:
    """A reflected CRC (CRC32C, CRC64NVME) in pure Python: only where no faster proof exists.

    CRC32C: Castagnoli polynomial 0x1EDC6F41, reflected 0x82F63B78 (RFC 3720 B.4); CRC64NVME:
    polynomial 0xAD93D23594C93659, reflected 0x9A6C9329AC4BC9B5 (NVM Express NVM Command Set 1.0,
    5.2.1.3.4). Both start from all ones and end inverted, as the S3 checksums are.
    """

    TABLES = {}  # type: dict

    def __init__(self, name):
        if name not in self.TABLES:
            poly, width = {"crc32c": (0x82F63B78, 32), "crc64nvme": (0x9A6C9329AC4BC9B5, 64)}[name]
            self.TABLES[name] = _crc_table(poly, width)
        self.table, self.mask = self.TABLES[name]
        self.width = self.mask.bit_length()
        self.crc = self.mask

    def update(self, data):
        crc, table = self.crc, self.table
        for b in bytes(data):
            crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
        self.crc = crc

    def digest(self):
        return (self.crc ^ self.mask).to_bytes(self.width // 8, "big")


class _Crc32:
    """zlib's CRC-32 (the S3 CRC32 checksum), which releases the GIL on large buffers."""

    def __init__(self):

        self.zlib = zlib
        self.crc = 0

    def update(self, data):
        self.crc = self.zlib.crc32(data, self.crc)

    def digest(self):
        return (self.crc & 0xFFFFFFFF).to_bytes(4, "big")


def _digest(name):
    if name in ("sha256", "sha1", "md5"):
        return hashlib.new(name)
    if name == "crc32":
        return _Crc32()
    if name in ("crc32c", "crc64nvme"):
        return _Crc(name)
    raise OpError(f"backup_digests: no digest named {name!r}")


class _Parts:
    """MD5 of each part, for parts of the given sizes (a multipart ETag is the MD5 of these)."""

    def __init__(self, sizes):
        self.sizes = list(sizes)
        self.done = []
        self.cur = hashlib.md5()  # noqa: S324 - S3 part ETags are MD5
        self.left = self.sizes[0] if self.sizes else 0

    def update(self, data):
        view = memoryview(data)
        while len(view):
            if not self.left:  # more bytes than the parts hold: the sizes are wrong
                self.done.append(None)
                return
            n = min(self.left, len(view))
            self.cur.update(view[:n])
            view = view[n:]
            self.left -= n
            if not self.left:
                self.done.append(self.cur.hexdigest())
                self.cur = hashlib.md5()  # noqa: S324
                if len(self.done) < len(self.sizes):
                    self.left = self.sizes[len(self.done)]

    def result(self):
        if len(self.done) != len(self.sizes) or None in self.done:
            return None
        return self.done


def _digest_one(opener, item):
    path = unname(item)
    try:
        fd, st = opener.open(path, int(item.get("a", 0)))
    except OSError as exc:
        return {"errno": exc.errno, "error": exc.strerror}
    try:
        sums = [(n, _digest(n)) for n in item.get("want", []) if n != "sha256"]
        parts = _Parts(item["parts"]) if item.get("parts") else None
        sinks = [d for _, d in sums] + ([parts] if parts is not None else [])

        def data(block):
            for d in sinks:
                d.update(block)

        def hole(n):
            while n:
                block = ZERO[: min(n, CHUNK)]
                data(block)
                n -= len(block)

        want = item.get("want", [])
        size, sha = read_file(fd, st, data, hole, sha256="sha256" in want)
        after = os.fstat(fd)
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
            st.st_size,
            st.st_mtime_ns,
            st.st_ctime_ns,
        ):
            return {"errno": CHANGED, "error": "changed while it was read"}
        out = {"s": size, "m": st.st_mtime_ns, "c": st.st_ctime_ns, "i": st.st_ino}
        out["d"] = {n: d.digest().hex() for n, d in sums}
        if sha:
            out["d"]["sha256"] = sha.hex()
        if parts is not None:
            out["pm"] = parts.result()
        return out
    except OSError as exc:
        return {"errno": exc.errno, "error": exc.strerror}
    finally:
        os.close(fd)


@op("backup_digests")
def backup_digests(params):
    """Every digest each file needs, from one read of it, files spread over the node's cores.

    params: files [{p|pb, a, want: [sha256|sha1|md5|crc32|crc32c|crc64nvme], parts: [sizes]}],
    workers (default: the node's CPUs). One result per file, in order: s, m, c (ctime ns), i
    (inode), d {name: hex}, pm (part MD5s, None when the sizes do not fit the file), or
    errno/error. hashlib and zlib release the GIL on large buffers, so threads use the cores.
    """
    files = params["files"]
    workers = max(1, min(int(params.get("workers") or os.cpu_count() or 1), 256, len(files) or 1))
    out = [None] * len(files)  # type: list
    lock = threading.Lock()
    queue = list(range(len(files)))[::-1]

    def worker():
        opener = Opener()
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop()
                out[i] = _digest_one(opener, files[i])
        finally:
            opener.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
