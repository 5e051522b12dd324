# Agent probe: backup listing, hashing where files lie, and the bulk file sender.
#
# Concatenated into the agent (no imports from pytest_gpuhost, no __future__ imports, stdlib only,
# Python 3.6 syntax).  The same source also runs on its own as the bulk sender on a second raw
# channel: `python3 -u -c <this file + "_bk_send_main()">` (see pytest_gpuhost.modules.backup).
#
# File names travel as {"p": str} when they are valid UTF-8 and as {"pb": base64 of the bytes}
# otherwise, so a name with newlines, quotes or non-UTF-8 bytes arrives unchanged.
#
# Bulk wire format (all integers big-endian):
#   controller -> node: b"GHB1", then per file u32 len + absolute path bytes, then u32 0.
#   node -> controller: b"GHB1", then per file: u32 index, chunks of (u32 len > 0, bytes),
#   u32 0, trailer (i32 errno, u64 size, i64 mtime_ns, u32 mode, u8 changed, 32 bytes sha256);
#   finally u32 0xFFFFFFFF and u32 count of files sent.
import base64
import hashlib
import os
import re
import stat
import struct
import sys
import threading
import time

if "op" not in globals():  # running alone as the bulk sender: no agent core, no registry

    def op(name):
        def register(func):
            return func

        return register


_BK_CHUNK = 1 << 20
_BK_TRAILER = struct.Struct(">iQqIB32s")
_BK_END = 0xFFFFFFFF


def _bk_name(raw):
    """Return the wire form of a path given as bytes."""
    try:
        return {"p": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"pb": base64.b64encode(raw).decode("ascii")}


def _bk_unname(item):
    """Return the path bytes of a wire name."""
    if "pb" in item:
        return base64.b64decode(item["pb"])
    return item["p"].encode("utf-8")


def _bk_glob_regex(pattern):
    """Translate a glob with ** into a regex over '/'-separated relative paths."""
    out = []
    i = 0
    n = len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("(?s)" + "".join(out) + r"\Z")


def _bk_matcher(patterns):
    regexes = [_bk_glob_regex(p) for p in patterns or []]

    def match(rel):
        for rx in regexes:
            if rx.match(rel):
                return True
        return False

    return match


def _bk_onerror(errors):
    def onerror(exc):
        errors.append(dict(_bk_name(os.fsencode(exc.filename or "")), errno=exc.errno, error=exc.strerror))

    return onerror


def _bk_entry(path, st, kind):
    entry = _bk_name(os.fsencode(path))
    entry["t"] = kind
    entry["s"] = st.st_size
    entry["m"] = st.st_mtime_ns
    entry["o"] = stat.S_IMODE(st.st_mode)
    return entry


@op("backup_walk")
def backup_walk(params):
    """List the files of each manifest category: size, mtime, mode, link targets; never follow links."""
    started = time.time()
    result = {}
    for cat in params["categories"]:
        include = _bk_matcher(cat.get("include") or ["**"])
        exclude = _bk_matcher(cat.get("exclude") or [])
        max_size = cat.get("max_size")
        entries = []
        skipped = []
        errors = []
        for root in cat["roots"]:
            root = os.path.normpath(root)
            try:
                rst = os.lstat(root)
            except OSError as exc:
                errors.append(dict(_bk_name(os.fsencode(root)), errno=exc.errno, error=exc.strerror))
                continue
            if not stat.S_ISDIR(rst.st_mode):
                walker = [(os.path.dirname(root), [], [os.path.basename(root)])]
            else:
                walker = os.walk(
                    root,
                    followlinks=False,
                    onerror=_bk_onerror(errors),
                )
            for dirpath, dirnames, filenames in walker:
                dirnames.sort()
                names = sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
                # prune excluded directories early (a rule like "**/cache/**" or "cache")
                keep = []
                for d in dirnames:
                    full = os.path.join(dirpath, d)
                    rel = os.path.relpath(full, root)
                    if os.path.islink(full) or exclude(rel) or exclude(rel + "/"):
                        continue
                    keep.append(d)
                dirnames[:] = keep
                for name in names:
                    full = os.path.join(dirpath, name)
                    rel = os.path.relpath(full, root) if full != root else name
                    if exclude(rel) or not include(rel):
                        continue
                    try:
                        st = os.lstat(full)
                    except OSError as exc:
                        errors.append(dict(_bk_name(os.fsencode(full)), errno=exc.errno, error=exc.strerror))
                        continue
                    if stat.S_ISLNK(st.st_mode):
                        entry = _bk_entry(full, st, "l")
                        try:
                            target = os.fsencode(os.readlink(full))
                        except OSError as exc:
                            errors.append(
                                dict(_bk_name(os.fsencode(full)), errno=exc.errno, error=exc.strerror)
                            )
                            continue
                        tgt = _bk_name(target)
                        entry["l" if "p" in tgt else "lb"] = tgt.get("p", tgt.get("pb"))
                        entries.append(entry)
                    elif stat.S_ISREG(st.st_mode):
                        if max_size is not None and st.st_size > max_size:
                            skipped.append(dict(_bk_entry(full, st, "f"), why="larger than max_size"))
                            continue
                        entries.append(_bk_entry(full, st, "f"))
                    elif not stat.S_ISDIR(st.st_mode):
                        skipped.append(dict(_bk_entry(full, st, "x"), why="not a regular file or link"))
        result[cat["name"]] = {"entries": entries, "skipped": skipped, "errors": errors}
    return {"categories": result, "duration": time.time() - started}


def _bk_hash_path(path):
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        while True:
            block = os.read(fd, _BK_CHUNK)
            if not block:
                break
            digest.update(block)
    finally:
        os.close(fd)
    return {"sha256": digest.hexdigest(), "s": st.st_size, "m": st.st_mtime_ns}


@op("backup_hash")
def backup_hash(params):
    """Hash files where they lie (SHA-256, streamed); one result per path, errors as errno."""
    out = []
    for item in params["paths"]:
        path = _bk_unname(item)
        try:
            out.append(_bk_hash_path(path))
        except OSError as exc:
            out.append({"errno": exc.errno, "error": exc.strerror})
    return out


def _bk_read_exact(stream, n):
    buf = b""
    while len(buf) < n:
        block = stream.read(n - len(buf))
        if not block:
            raise EOFError("input ended")
        buf += block
    return buf


def _bk_reader(paths, queue_put):
    """Read and hash each file; hand ready-framed bytes to the writer (runs in a thread).

    Small files are batched into blocks of about 1 MiB so that the writer makes few large
    writes; big reads travel as their own items without being copied again.
    """
    zero = b"\0" * 32
    u32 = struct.Struct(">I").pack
    buf = bytearray()
    for index, path in enumerate(paths):
        buf += u32(index)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            buf += u32(0) + _BK_TRAILER.pack(exc.errno or 5, 0, 0, 0, 0, zero)
            continue
        try:
            st = os.fstat(fd)
            digest = hashlib.sha256()
            size = 0
            err = 0
            if not stat.S_ISREG(st.st_mode):
                err = 21  # EISDIR-like: only regular files travel
            else:
                while True:
                    try:
                        block = os.read(fd, _BK_CHUNK)
                    except OSError as exc:
                        err = exc.errno or 5
                        break
                    if not block:
                        break
                    digest.update(block)
                    size += len(block)
                    if len(block) >= 65536:
                        buf += u32(len(block))
                        queue_put(bytes(buf))
                        buf = bytearray()
                        queue_put(block)
                    else:
                        buf += u32(len(block))
                        buf += block
            after = os.fstat(fd)
            changed = int(after.st_mtime_ns != st.st_mtime_ns or after.st_size != size)
            buf += u32(0)
            buf += _BK_TRAILER.pack(
                err,
                size,
                st.st_mtime_ns,
                stat.S_IMODE(st.st_mode),
                changed,
                digest.digest() if not err else zero,
            )
        finally:
            os.close(fd)
        if len(buf) >= _BK_CHUNK:
            queue_put(bytes(buf))
            buf = bytearray()
    buf += u32(_BK_END) + u32(len(paths))
    queue_put(bytes(buf))
    queue_put(None)


def _bk_send_main():
    """Bulk sender: read a framed path list on stdin, write a framed stream of contents on stdout."""
    import queue

    stdin = sys.stdin.buffer
    out = sys.stdout.buffer
    if _bk_read_exact(stdin, 4) != b"GHB1":
        sys.stderr.write("backup sender: bad magic\n")
        sys.exit(2)
    paths = []
    while True:
        (n,) = struct.unpack(">I", _bk_read_exact(stdin, 4))
        if n == 0:
            break
        paths.append(_bk_read_exact(stdin, n))
    q = queue.Queue(maxsize=64)
    last_write = [time.time()]

    def watchdog():
        # a peer that stopped reading (cut link, killed controller) must not keep us forever
        while True:
            time.sleep(5)
            if time.time() - last_write[0] > float(os.environ.get("GPUHOST_SEND_STALL", "120")):
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    reader = threading.Thread(target=_bk_reader, args=(paths, q.put), daemon=True)
    reader.start()
    out.write(b"GHB1")
    while True:
        item = q.get()
        if item is None:
            out.flush()
            return
        out.write(item)
        last_write[0] = time.time()
