"""Agent probe: read the places credentials are left on a node, the processes' environments, and scrub.

Stdlib only, Python 3.6 syntax (see exec/agent/__init__.py).  What is a secret is decided on the
controller (pytest_gpuhost/modules/credentials.py, with the redaction engine's detectors); this
probe only reads and, when asked, removes.

- `cred_read`: the given files under every home (root's, each /etc/passwd user's with a home, each
  directory in /home), the files of the given home directories (`~/.ssh`, the AWS SSO cache), and
  the `.env` files and launch scripts under the given roots.  Every path is opened fd-relative
  from `/` (below a root: from the root, whose own ancestors the operator named), each directory
  with O_NOFOLLOW|O_DIRECTORY and the file with O_NOFOLLOW: a symbolic link on the way is
  reported, never followed.  Only regular files are read; each is cut
  at `max_file_bytes`, all together at `max_bytes`, and the whole read stops at `deadline`.
- `cred_environ`: the environment of every process but this agent's own tree, bounded likewise.
- `cred_scrub`: remove a file, or drop the lines whose SHA-256 is given, only when the file's
  SHA-256 is still the one the scan read (nothing that changed since is touched), never a file
  named authorized_keys; a rewritten file keeps its mode and owner (temp name, fsync, rename).
"""

import base64
import errno
import hashlib
import os
import stat
import time

from pytest_gpuhost.exec.agent.core import OpError, op

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
#: Never scrubbed, whatever a caller asks: the run's own login (and every other) lives there.
PROTECTED = ("authorized_keys", "authorized_keys2")


class _Budget:
    def __init__(self, params):
        self.deadline = time.time() + float(params.get("timeout", 20))
        self.left = int(params.get("max_bytes", 8 << 20))
        self.per_file = int(params.get("max_file_bytes", 256 << 10))
        self.out_of_time = False

    def expired(self):
        if time.time() >= self.deadline:
            self.out_of_time = True
        return self.out_of_time


def _open_dir(path, anchors=()):
    """Open directory `path` one component at a time, never through a link; return its fd.

    From `/`, or from the longest of `anchors` (the manifest's roots) that holds `path`: a root's
    own ancestors are the operator's, named by them, and followed, as the backup's walk does.
    """
    start, rest = "/", path
    for a in sorted(anchors, key=len, reverse=True):
        a = a.rstrip("/") or "/"
        if path == a or path.startswith(a + "/"):
            start, rest = a, path[len(a) :]
            break
    fd = os.open(start, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in [p for p in rest.split("/") if p]:
            nfd = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except OSError:
        os.close(fd)
        raise
    return fd


def _why(exc):
    if exc.errno in (errno.ELOOP, errno.ENOTDIR) or exc.errno == getattr(errno, "EMLINK", -1):
        return "a symbolic link on the way (not followed)"
    return exc.strerror or str(exc)


def _read(path, budget, anchors=()):
    """Read one regular file (fd-relative, no link followed); return its record, or None when absent."""
    head, name = os.path.split(path)
    try:
        dfd = _open_dir(head, anchors)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return None
        return {"path": path, "error": _why(exc)}
    try:
        try:
            fd = os.open(name, _FILE, dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return None
            return {"path": path, "error": _why(exc)}
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return {"path": path, "error": "not a regular file"}
            want = min(budget.per_file, max(budget.left, 0))
            chunks, got = [], 0
            while got < want:
                data = os.read(fd, min(want - got, 1 << 16))
                if not data:
                    break
                chunks.append(data)
                got += len(data)
            data = b"".join(chunks)
            budget.left -= len(data)
            return {
                "path": path,
                "size": st.st_size,
                "uid": st.st_uid,
                "mode": stat.S_IMODE(st.st_mode),
                "sha256": hashlib.sha256(data).hexdigest(),
                "truncated": len(data) < st.st_size,
                "data": base64.b64encode(data).decode("ascii"),
            }
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def _list(path, anchors=(), errors=None):
    """Names of the regular entries and of the directories in directory `path` (no link followed).

    A directory that cannot be opened lists nothing; with `errors`, it is appended there.
    """
    try:
        fd = _open_dir(path, anchors)
    except OSError as exc:
        if errors is not None and exc.errno != errno.ENOENT:
            errors.append({"path": path, "error": _why(exc)})
        return [], []
    try:
        files, dirs = [], []
        for name in os.listdir(fd):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files.append(name)
            elif stat.S_ISDIR(st.st_mode):
                dirs.append(name)
        return sorted(files), sorted(dirs)
    finally:
        os.close(fd)


def homes():
    """Root's home, each /etc/passwd user's home (uid 0 or >= 1000), and each directory in /home."""
    out = ["/root"]
    try:
        with open("/etc/passwd", "rb") as f:
            for line in f.read(1 << 20).decode("utf-8", "replace").splitlines():
                parts = line.split(":")
                if len(parts) >= 6 and parts[2].isdigit() and (parts[2] == "0" or int(parts[2]) >= 1000):
                    if parts[5].startswith("/") and parts[5] not in ("/", "/nonexistent"):
                        out.append(parts[5].rstrip("/"))
    except OSError:
        pass
    out += ["/home/" + d for d in _list("/home")[1]]
    seen = []
    for h in out:
        if h not in seen and not h.startswith("/proc"):
            seen.append(h)
    return seen


def _wanted(name, patterns):
    for pat in patterns:
        if pat.startswith("*") and name.endswith(pat[1:]):
            return True
        if pat.endswith("*") and name.startswith(pat[:-1]):
            return True
        if name == pat:
            return True
    return False


def _walk(root, patterns, budget, max_depth, found, errors=None):
    """Append to `found` the files under `root` whose name matches, depth-first, no link entered below it."""
    stack = [(root.rstrip("/") or "/", 0)]
    while stack and not budget.expired() and len(found) < 10000:
        path, depth = stack.pop()
        files, dirs = _list(path, [root], errors)
        found += [path + "/" + n for n in files if _wanted(n, patterns)]
        if depth < max_depth:
            stack += [(path + "/" + d, depth + 1) for d in reversed(dirs)]


@op("cred_read")
def cred_read(params):
    """Read where credentials are left: files under each home, home dirs' files, and files under roots."""
    budget = _Budget(params)
    hs = homes()
    paths = []
    for h in hs:
        paths += [h + "/" + rel for rel in params.get("home_files", [])]
        for rel in params.get("home_dirs", []):
            files = _list(h + "/" + rel)[0]
            paths += [h + "/" + rel + "/" + n for n in files]
    under = []  # type: list
    errors = []  # type: list
    roots = params.get("roots", [])
    for root in roots:
        _walk(root, params.get("root_names", []), budget, int(params.get("max_depth", 8)), under, errors)
    paths += under
    files, seen = [], set()
    for p in paths:
        if p in seen:
            continue
        seen.add(p)
        if budget.expired():
            errors.append({"path": p, "error": "not read: the scan's time bound ran out"})
            continue
        rec = _read(p, budget, roots)
        if rec is None:
            continue
        (errors if "error" in rec else files).append(rec)
    return {"homes": hs, "files": files, "errors": errors, "out_of_time": budget.out_of_time}


def _own_tree():
    own, tree = os.getpid(), set()
    pid = own
    for _ in range(64):
        tree.add(pid)
        try:
            with open("/proc/" + str(pid) + "/stat", "rb") as f:
                data = f.read()
            pid = int(data[data.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError):
            break
        if pid <= 1:
            break
    return tree


@op("cred_environ")
def cred_environ(params):
    """The environment of every process but this agent's own tree: pid, start time, NAME=VALUE entries."""
    budget = _Budget(params)
    mine = _own_tree()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in mine:
            continue
        if budget.expired() or budget.left <= 0:
            break
        try:
            with open("/proc/" + name + "/stat", "rb") as f:
                st = f.read()
            with open("/proc/" + name + "/environ", "rb") as f:
                raw = f.read(min(budget.per_file, budget.left))
        except (OSError, ValueError):
            continue
        budget.left -= len(raw)
        start = int(st[st.rindex(b")") + 2 :].split()[19])
        env = [e.decode("utf-8", "replace") for e in raw.split(b"\0") if b"=" in e]
        out.append({"pid": int(name), "starttime": start, "env": env})
    return {"processes": out, "out_of_time": budget.out_of_time}


def _rewrite(dfd, name, st, data, drop):
    keep = [line for line in data.split(b"\n") if hashlib.sha256(line).hexdigest() not in drop]
    tmp = "." + name + ".gpuhost-scrub"
    try:
        os.unlink(tmp, dir_fd=dfd)
    except OSError:
        pass
    wfd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, stat.S_IMODE(st.st_mode), dir_fd=dfd
    )
    try:
        os.fchmod(wfd, stat.S_IMODE(st.st_mode))
        try:
            os.fchown(wfd, st.st_uid, st.st_gid)
        except OSError:
            pass
        body = b"\n".join(keep)
        while body:
            n = os.write(wfd, body)
            body = body[n:]
        os.fsync(wfd)
    finally:
        os.close(wfd)
    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    os.fsync(dfd)


def _scrub_one(item, deadline, anchors=()):
    path = item["path"]
    head, name = os.path.split(path)
    if name in PROTECTED:
        return {"path": path, "status": "refused", "why": "authorized_keys is never touched"}
    if time.time() >= deadline:
        return {"path": path, "status": "error", "why": "not done: the scrub's time bound ran out"}
    try:
        dfd = _open_dir(head, anchors)
    except OSError as exc:
        return {"path": path, "status": "gone" if exc.errno == errno.ENOENT else "error", "why": _why(exc)}
    try:
        try:
            fd = os.open(name, _FILE, dir_fd=dfd)
        except OSError as exc:
            return {
                "path": path,
                "status": "gone" if exc.errno == errno.ENOENT else "error",
                "why": _why(exc),
            }
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > int(item.get("max_bytes", 1 << 20)):
                return {"path": path, "status": "changed", "why": "no longer the small regular file scanned"}
            chunks = []
            while True:
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                chunks.append(data)
            data = b"".join(chunks)
            if hashlib.sha256(data).hexdigest() != item["sha256"]:
                return {"path": path, "status": "changed", "why": "changed since it was read; left alone"}
            if item["action"] == "remove":
                os.unlink(name, dir_fd=dfd)
                os.fsync(dfd)
                return {"path": path, "status": "removed"}
            _rewrite(dfd, name, st, data, set(item["lines"]))
            return {"path": path, "status": "rewritten", "dropped": len(item["lines"])}
        finally:
            os.close(fd)
    except OSError as exc:
        return {"path": path, "status": "error", "why": exc.strerror or str(exc)}
    finally:
        os.close(dfd)


@op("cred_scrub")
def cred_scrub(params):
    """Remove files, or drop lines by their SHA-256, where the file is still what the scan read."""
    deadline = time.time() + float(params.get("timeout", 30))
    items = params.get("items", [])
    if any(i.get("action") not in ("remove", "drop_lines") for i in items):
        raise OpError("cred_scrub: each item's action is remove or drop_lines")
    roots = params.get("roots", [])
    return {"results": [_scrub_one(i, deadline, roots) for i in items]}
