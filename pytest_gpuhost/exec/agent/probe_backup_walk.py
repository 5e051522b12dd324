"""Agent probe: list a backup manifest's categories (`backup_walk`) without following a link.

Stdlib only, Python 3.6 syntax (see exec/agent/__init__.py).  The walk is fd-relative from each
category root down: every directory is opened with O_NOFOLLOW from the fd of the one above it,
checked to be the directory that was listed, and listed through its fd, so a path longer than
PATH_MAX is listed like any other and a directory swapped for a symlink is never entered.  Every
path in scope that cannot be listed is returned as an error (path and reason), never dropped.

Each file or link listed is one line of text ("packed": a list of blocks of up to BLOCK lines
joined by newlines; a dict per entry would cost a million files some 600 MB on each side):
`t s m o b c i a L N`, space-separated: t (f file, l link), s size, m mtime_ns, o mode bits,
b bytes allocated, c ctime_ns, i inode, a the length of the anchor (the root the operator named,
or the parent of a root that is a file), L a link's target as "=" + base64 ("-" for a file),
and last N the path: as is when it is valid UTF-8, starts with "/" and holds no newline, else
"=" + base64.  Left out entries ("skipped") are dicts: the name ({"p": str} when valid UTF-8,
else {"pb": base64}), "t" (x other), and the same fields by their letters.  The reading side
(probe_backup.py) opens each file below its anchor the same way.

Each category also reports its roots ("roots": one record per root named): what the root is
("dir", "file", "link" with "to" its target, "missing", "error"), "n" the entries it gave, "k"
those max_size or their type left out (listed), "x" the files and "xd" the directories the
include/exclude globs left out (counted), so that a root that is a link, is gone or yields nothing is never
a silent pass.  A root that is a symbolic link is listed as the link itself unless the category
says `follow_root_links`: then it is resolved once (os.path.realpath) and its target is walked
as the root ("real" the resolved path); below the root nothing is followed either way.

Globs (include, exclude) are matched segment by segment over a set of states, compiled once per
category: linear in the number of path segments whatever the number of `**`.
"""

import base64
import errno
import os
import re
import stat
import time

from pytest_gpuhost.exec.agent.core import op

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _name(raw):
    """Return the wire form of a path given as bytes."""
    try:
        return {"p": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"pb": base64.b64encode(raw).decode("ascii")}


# ---------------------------------------------------------------- globs


def glob_compile(pattern):
    """Compile a glob into per-segment matchers: None for a `**` segment, else a regex or a str.

    Matching runs segment by segment over a set of states (glob_step), so its cost is linear in
    the number of path segments whatever the number of `**` (a regex with many `(?:.*/)?` is not).
    """
    segs = []  # type: list
    for seg in pattern.split("/"):
        if seg == "**":
            if not segs or segs[-1] is not None:  # "**/**" is one "**"
                segs.append(None)
            continue
        if not any(c in seg for c in "*?["):
            segs.append(seg)
            continue
        out = []
        i = 0
        while i < len(seg):
            c = seg[i]
            if c == "*":
                while i + 1 < len(seg) and seg[i + 1] == "*":
                    i += 1
                out.append(".*")
            elif c == "?":
                out.append(".")
            elif c == "[":
                j = seg.find("]", i + 2 if seg.startswith("[!", i) or seg.startswith("[]", i) else i + 1)
                if j < 0:
                    out.append(re.escape(c))
                else:
                    body = seg[i + 1 : j]
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    out.append("[" + body.replace("\\", "\\\\") + "]")
                    i = j
            else:
                out.append(re.escape(c))
            i += 1
        segs.append(re.compile("(?s)" + "".join(out) + r"\Z"))
    return segs


def _close(segs, state):
    """Add the states reachable without consuming a segment (a `**` may match none)."""
    for j, seg in enumerate(segs):
        if seg is None and state >> j & 1:
            state |= 1 << (j + 1)
    return state


def glob_start(globs):
    """Return the initial states of compiled globs (a tuple of bitsets, one per glob)."""
    return tuple(_close(segs, 1) for segs in globs)


def glob_step(globs, states, name):
    """Return the states after one more path segment `name`."""
    out = []
    for segs, state in zip(globs, states):
        new = 0
        j = 0
        while state >> j:
            if state >> j & 1 and j < len(segs):
                seg = segs[j]
                if seg is None:
                    new |= 1 << j
                elif seg == name if isinstance(seg, str) else seg.match(name):
                    new |= 1 << (j + 1)
            j += 1
        out.append(_close(segs, new) if new else 0)
    return tuple(out)


def glob_accepts(globs, states):
    """Return True when any glob matched the whole path so far."""
    for segs, state in zip(globs, states):
        if state >> len(segs) & 1:
            return True
    return False


def glob_match(globs, rel):
    """Return True when any glob matches the relative path `rel` (str, '/'-separated)."""
    states = glob_start(globs)
    for name in rel.split("/"):
        states = glob_step(globs, states, name)
    return glob_accepts(globs, states)


# ---------------------------------------------------------------- listing


def _entry(path, st, kind, anchor):
    entry = _name(path)
    entry["t"] = kind
    entry["s"] = st.st_size
    entry["m"] = st.st_mtime_ns
    entry["o"] = stat.S_IMODE(st.st_mode)
    entry["b"] = st.st_blocks * 512
    entry["c"] = st.st_ctime_ns  # moves with every change of the contents; no tool sets it back
    entry["i"] = st.st_ino
    entry["a"] = len(anchor)
    return entry


BLOCK = 4096  # lines per block of "packed": the reader frees each block once it has read it


def _b64(raw):
    return "=" + base64.b64encode(raw).decode("ascii")


def _packed(path, st, kind, anchor, link=None):
    """One listed file or link as a line of `packed` (see the module's docstring)."""
    try:
        name = path.decode("utf-8")
    except UnicodeDecodeError:
        name = None
    if name is None or "\n" in name or not name.startswith("/"):
        name = _b64(path)
    target = "-" if link is None else _b64(link)
    return (
        f"{kind} {st.st_size} {st.st_mtime_ns} {stat.S_IMODE(st.st_mode)} {st.st_blocks * 512} "
        f"{st.st_ctime_ns} {st.st_ino} {len(anchor)} {target} {name}"
    )


def _error(path, exc, doing):
    return dict(_name(path), errno=exc.errno, error=f"{doing}: {exc.strerror}")


class _Walk:
    """List one category: fd-relative from each root down, never following a link."""

    def __init__(self, cat):
        self.inc = [glob_compile(p) for p in cat.get("include") or ["**"]]
        self.exc = [glob_compile(p) for p in cat.get("exclude") or []]
        self.max_size = cat.get("max_size")
        self.follow = bool(cat.get("follow_root_links"))
        self.entries = []
        self.skipped = []
        self.errors = []
        self.roots = []
        self.excluded = 0  # files and links the include/exclude globs left out (counted, not listed)
        self.pruned = 0  # directories an exclude glob left out whole (not entered)

    def root(self, root):
        rootb = os.fsencode(os.path.normpath(root))
        info = _name(rootb)
        counts = (len(self.entries), len(self.skipped), len(self.errors), self.excluded, self.pruned)
        self.roots.append(info)
        try:
            info["kind"] = self._root(rootb, info)
        finally:
            info["n"] = len(self.entries) - counts[0]
            info["k"] = len(self.skipped) - counts[1]
            info["e"] = len(self.errors) - counts[2]
            info["x"] = self.excluded - counts[3]
            info["xd"] = self.pruned - counts[4]

    def _root(self, rootb, info):
        try:
            rst = os.lstat(rootb)
        except OSError as exc:
            self.errors.append(_error(rootb, exc, "cannot list"))
            return "missing" if exc.errno == errno.ENOENT else "error"
        kind = "dir" if stat.S_ISDIR(rst.st_mode) else "file"
        if stat.S_ISLNK(rst.st_mode):
            try:
                target = os.readlink(rootb)
            except OSError:
                target = b"?"
            info["to"] = _name(target).get("p", repr(target))
            if not self.follow:
                kind = "link"
            else:
                real = os.path.realpath(rootb)
                info["real"] = _name(real).get("p", repr(real))
                try:
                    rst = os.lstat(real)
                except OSError as exc:
                    self.errors.append(_error(rootb, exc, "the link's target cannot be listed"))
                    return "missing"
                rootb = real
                kind = "dir" if stat.S_ISDIR(rst.st_mode) else "file"
        if kind != "dir":  # a single file (or link) named as a root
            name = os.fsdecode(os.path.basename(rootb))
            states = (
                glob_step(self.inc, glob_start(self.inc), name),
                glob_step(self.exc, glob_start(self.exc), name),
            )
            self.item(rootb, os.path.dirname(rootb), rst, None, None, states)
            return kind
        try:
            fd = os.open(rootb, _DIR)
        except OSError as exc:
            self.errors.append(_error(rootb, exc, "cannot open the directory"))
            return "error"
        self.tree(fd, rootb)
        return kind

    def tree(self, fd, rootb):
        # frames: (fd, path, include states, exclude states, subdirectories still to enter)
        start = (glob_start(self.inc), glob_start(self.exc))
        stack = [(fd, rootb, start[0], start[1], iter(self.listdir(fd, rootb, rootb, start)))]
        while stack:
            dfd, dpath, _inc, _exc, subdirs = stack[-1]
            sub = next(subdirs, None)
            if sub is None:
                os.close(dfd)
                stack.pop()
                continue
            name, st, s_inc, s_exc = sub
            path = dpath.rstrip(b"/") + b"/" + os.fsencode(name)
            try:
                cfd = os.open(name, _DIR, dir_fd=dfd)
            except OSError as exc:
                why = (
                    "changed type while listed"
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR)
                    else "cannot open the directory"
                )
                self.errors.append(_error(path, exc, why))
                continue
            cst = os.fstat(cfd)
            if (cst.st_dev, cst.st_ino) != (st.st_dev, st.st_ino):
                os.close(cfd)
                self.errors.append(
                    dict(_name(path), errno=None, error="changed while listed (another directory now)")
                )
                continue
            stack.append((cfd, path, s_inc, s_exc, iter(self.listdir(cfd, path, rootb, (s_inc, s_exc)))))

    def listdir(self, fd, dpath, rootb, states):
        """List one directory: files and links are recorded now; return the subdirectories to enter."""
        try:
            names = sorted(os.listdir(fd))
        except OSError as exc:
            self.errors.append(_error(dpath, exc, "cannot list the directory"))
            return []
        subdirs = []
        for name in names:
            path = dpath.rstrip(b"/") + b"/" + os.fsencode(name)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError as exc:
                self.errors.append(
                    _error(path, exc, "vanished while listed" if exc.errno == errno.ENOENT else "cannot stat")
                )
                continue
            s_inc = glob_step(self.inc, states[0], name)
            s_exc = glob_step(self.exc, states[1], name)
            if stat.S_ISDIR(st.st_mode):
                # prune an excluded directory ("cache" or "cache/**"): it is never entered
                if glob_accepts(self.exc, s_exc) or glob_accepts(self.exc, glob_step(self.exc, s_exc, "")):
                    self.pruned += 1
                    continue
                subdirs.append((name, st, s_inc, s_exc))
            else:
                self.item(path, rootb, st, fd, name, (s_inc, s_exc))
        return subdirs

    def item(self, path, anchor, st, dfd, name, states):
        if glob_accepts(self.exc, states[1]) or not glob_accepts(self.inc, states[0]):
            self.excluded += 1
            return
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(name, dir_fd=dfd) if dfd is not None else os.readlink(path)
            except OSError as exc:
                self.errors.append(_error(path, exc, "cannot read the link"))
                return
            self.entries.append(_packed(path, st, "l", anchor, os.fsencode(target)))
        elif stat.S_ISREG(st.st_mode):
            if self.max_size is not None and st.st_size > self.max_size:
                self.skipped.append(dict(_entry(path, st, "f", anchor), why="larger than max_size"))
                return
            self.entries.append(_packed(path, st, "f", anchor))
        else:
            self.skipped.append(dict(_entry(path, st, "x", anchor), why="not a regular file or link"))


@op("backup_walk")
def backup_walk(params):
    """List the files of each manifest category: size, mtime, mode, link targets; never follow links."""
    started = time.time()
    result = {}
    for cat in params["categories"]:
        walk = _Walk(cat)
        for root in cat["roots"]:
            walk.root(root)
        result[cat["name"]] = {
            "packed": ["\n".join(walk.entries[i : i + BLOCK]) for i in range(0, len(walk.entries), BLOCK)],
            "skipped": walk.skipped,
            "errors": walk.errors,
            "roots": walk.roots,
        }
    return {"categories": result, "duration": time.time() - started}
