"""What the lab's emulated NVIDIA tools see of a lab host (stdlib only; runs inside lab hosts).

Everything is read from the host as a real driver would find it: driver bindings from
``/sys/bus/pci/devices/BDF/driver``, IOMMU domain types from ``/sys/kernel/iommu_groups/N/type``,
GPU users from ``/proc/*/fd`` (who holds ``/dev/nvidiaN``), legacy persistence and current minor
numbers from ``/var/lib/gpulab/ctl``, and the rest (model, UUID, link model, health) from the
profile in ``/var/lib/gpulab/profile.json`` (or ``/etc/gpulab/profile.json``).

``GPULAB_ROOT`` (default ``/``) prefixes every path but ``/proc``, so tests can point the tools at
a prepared tree around a standalone FUSE mount.
"""

from __future__ import annotations

import os
import time

# Every lab tool run starts a Python process (the fleet benchmark runs four per host per night):
# the imports here are what each start pays. dataclasses (it imports inspect), typing and random
# cost about 15 ms of CPU per start on the lab machine, so the classes below are written out and
# the names used only in annotations are imported for the type checkers alone. json and re are
# not imported either: json imports re, and re imports enum, functools and collections, 6-7 ms of
# CPU per start (python3 -S: 5.6 ms bare, 11.5-12.5 with `import json`; mean of 40 starts), a third
# of an nvidia-smi run. JSON is read with `loads` below; `record` imports json when it writes.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import random
    from typing import Any

ROOT = os.environ.get("GPULAB_ROOT", "/")
PROC = "/proc"


def path(*parts: str) -> str:
    """Return a path under GPULAB_ROOT."""
    return os.path.join(ROOT, *[p.lstrip("/") for p in parts])


def read(p: str, default: str | None = None) -> str | None:
    """Return a file's text stripped, or ``default`` when it cannot be read."""
    try:
        with open(p) as f:
            return f.read().strip()
    except OSError:
        return default


class _JsonContext:
    """What json.decoder.JSONDecoder() hands its C scanner: json.loads's defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


_scanner: list[Any] = []
_WS = " \t\n\r"  # json.decoder.WHITESPACE


def loads(text: str) -> Any:
    """Return what ``json.loads(text)`` returns, without importing json (and re); ValueError if not JSON.

    json.loads is JSONDecoder().decode: skip whitespace, one value by the C scanner
    (``_json.make_scanner``, with the context above), whitespace, the end. The same scanner runs
    here; where CPython has no ``_json`` this is json.loads itself. A syntax error inside the
    value raises json's own JSONDecodeError (the scanner imports json.decoder for it).
    """
    if not _scanner:
        try:
            from _json import make_scanner
        except ImportError:
            import json

            return json.loads(text)
        _scanner.append(make_scanner(_JsonContext))  # type: ignore[arg-type]  # reads the six attributes
    if text.startswith("\ufeff"):
        raise ValueError("Unexpected UTF-8 BOM (decode using utf-8-sig)")
    begin = len(text) - len(text.lstrip(_WS))
    try:
        value, end = _scanner[0](text, begin)
    except StopIteration as err:
        raise ValueError(f"Expecting value: char {err.value}") from None
    if text[end:].strip(_WS):
        raise ValueError(f"Extra data: char {end}")
    return value


def load_profile() -> dict[str, Any]:
    """Return the host profile (raises SystemExit with the driver's message when absent)."""
    for p in (path("var/lib/gpulab/profile.json"), path("etc/gpulab/profile.json")):
        try:
            with open(p) as f:
                data: dict[str, Any] = loads(f.read())
                return data
        except (OSError, ValueError):
            continue
    raise SystemExit(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n"
    )


def record(line: dict[str, Any]) -> None:
    """Append a line to the host's record (``/var/lib/gpulab/record.jsonl``); best effort."""
    import json

    p = path("var/lib/gpulab/record.jsonl")
    try:
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def driver_of(bdf: str, boot: str | None) -> str | None:
    """Return the driver bound to a function, from sysfs (profile boot state if sysfs lacks it)."""
    dev = path("sys/bus/pci/devices", bdf)
    if not os.path.isdir(dev):
        return boot
    try:
        return os.path.basename(os.readlink(os.path.join(dev, "driver")))
    except OSError:
        return None


def group_type(group: int | None, default: str) -> str:
    """Return the IOMMU group's domain type from sysfs (the profile default if unreadable)."""
    if group is None:
        return default
    return read(path("sys/kernel/iommu_groups", str(group), "type"), default) or default


def speed_gen(speed: str) -> int:
    """Return the PCIe generation for a sysfs link speed (``32.0 GT/s PCIe`` -> 5)."""
    lead = speed or ""
    for i, c in enumerate(lead):  # the leading run of [\d.]: isdecimal() is what \d matches
        if not (c.isdecimal() or c == "."):
            lead = lead[:i]
            break
    gts = float(lead) if lead else 0.0
    for gen, v in ((6, 64.0), (5, 32.0), (4, 16.0), (3, 8.0), (2, 5.0), (1, 2.5)):
        if gts >= v:
            return gen
    return 1


class Holder:
    """A process with a GPU's device file open."""

    __slots__ = ("argv", "kind", "mem_mib", "pid")

    def __init__(self, pid: int, argv: list[str], mem_mib: int = 0, kind: str = "C") -> None:
        self.pid = pid
        self.argv = argv
        self.mem_mib = mem_mib
        self.kind = kind  # C compute, or "" for daemons nvidia-smi does not list

    def __repr__(self) -> str:
        return f"Holder(pid={self.pid!r}, argv={self.argv!r}, mem_mib={self.mem_mib!r}, kind={self.kind!r})"

    @property
    def name(self) -> str:
        return self.argv[0] if self.argv else "?"


class GpuView:
    """One GPU as the driver presents it now."""

    def __init__(
        self,
        index: int,
        bdf: str,
        minor: int,
        spec: dict[str, Any],
        func: dict[str, Any],
        group: int | None,
        gtype: str,
        persistence: bool,
        holders: list[Holder] | None = None,
    ) -> None:
        self.index = index
        self.bdf = bdf
        self.minor = minor
        self.spec = spec
        self.func = func
        self.group = group
        self.gtype = gtype
        self.persistence = persistence
        self.holders: list[Holder] = holders if holders is not None else []

    def __repr__(self) -> str:
        return f"GpuView(index={self.index!r}, bdf={self.bdf!r}, minor={self.minor!r})"

    @property
    def bus_id(self) -> str:
        """Return the NVML bus id, ``00000000:17:00.0``."""
        dom, rest = self.bdf.split(":", 1)
        return f"{int(dom, 16):08X}:{rest.upper()}"

    @property
    def name(self) -> str:
        return str(self.spec["model"])

    @property
    def memory_total(self) -> int:
        return int(self.spec["memory_mib"])

    @property
    def memory_used(self) -> int:
        return min(self.memory_total, sum(h.mem_mib for h in self.holders))

    @property
    def health(self) -> dict[str, Any]:
        h: dict[str, Any] = self.spec.get("health") or {}
        return h

    @property
    def at_work(self) -> bool:
        """Say whether a compute context holds the GPU (P0); the persistence daemon alone does not."""
        return any(h.kind for h in self.holders)

    @property
    def link(self) -> dict[str, Any]:
        """The PCIe link as sysfs shows it now: an idle GPU's at its `idle_speed` (LAB-SOURCES.md)."""
        lk: dict[str, Any] = dict(self.func.get("link") or {})
        if lk.get("idle_speed") and not self.at_work:
            lk["max_speed"] = lk.get("max_speed", lk.get("speed"))
            lk["speed"] = lk["idle_speed"]
        return lk


def load_faults() -> dict[str, Any]:
    """Return the faults a test injected into this host (``/var/lib/gpulab/faults.json``), or {}.

    Keys: ``unknown_fields`` (``--query-gpu`` fields this driver's nvidia-smi does not know, as a
    driver that renamed them: R535 renamed ``clocks_throttle_reasons.*`` to ``clocks_event_reasons.*``)
    and ``gpus: {BDF: {"nvml_error": "GPU requires reset"}}`` (the GPU's state cells print that NVML
    error in brackets, as nvidia-smi prints nvmlErrorString for a GPU in an error state;
    ``remapped_rows_pending``/``_correctable``/``_uncorrectable``: what ``--query-remapped-rows``
    prints for it; ``nvlinks_down``: ``"all"`` or link numbers, for ``nvlink -s``; ``fabric_state``,
    ``fabric_status``: the Fabric section of ``-q``; docs/health-checks.md lists them), and
    ``nccl_hang`` (true or PCI addresses) and ``nccl_wrong`` (wrong elements per line) for
    ``all_reduce_perf`` runs that go via P2P (gpulab_tools/all_reduce_perf.py). Written by
    tests over SSH; a runtime fault, not part of the profile.
    """
    try:
        with open(path("var/lib/gpulab/faults.json")) as f:
            data = loads(f.read())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class Host:
    """The lab host as nvidia-smi and nvbandwidth find it."""

    def __init__(self) -> None:
        self.profile = load_profile()
        self.faults = load_faults()
        self.funcs = {f["bdf"]: f for f in self.profile.get("pci", [])}
        self.default_domain = str(self.profile.get("default_domain", "DMA-FQ"))
        self.driver_version = str(self.profile.get("driver_version", "570.133.07"))
        self.cuda_version = str(self.profile.get("cuda_version", "12.8"))
        self._acs: dict[str, bool] = {}
        self.gpus = self._visible()

    def _minor(self, bdf: str, boot: int) -> int:
        v = read(path("var/lib/gpulab/ctl/minor", bdf))
        if v is not None and v.isdigit():
            return int(v)
        return boot

    def _visible(self) -> list[GpuView]:
        out: list[GpuView] = []
        for spec in sorted(self.profile.get("gpus", []), key=lambda g: g["bdf"]):
            bdf = spec["bdf"]
            func = self.funcs.get(bdf, {})
            if driver_of(bdf, func.get("driver")) != "nvidia":
                continue
            minor = self._minor(bdf, int(spec["minor"]))
            # Inside a container only the GPUs whose device files were passed in are visible.
            if not os.path.exists(path("dev", f"nvidia{minor}")):
                continue
            group = func.get("iommu_group")
            pers = read(path("var/lib/gpulab/ctl/persistence", bdf), "0") == "1"
            out.append(
                GpuView(
                    index=len(out),
                    bdf=bdf,
                    minor=minor,
                    spec=spec,
                    func=func,
                    group=group,
                    gtype=group_type(group, self.default_domain),
                    persistence=pers,
                )
            )
        self._attach_holders(out)
        return out

    def _attach_holders(self, gpus: list[GpuView]) -> None:
        keys: dict[tuple[int, int], GpuView] = {}
        for g in gpus:
            try:
                st = os.stat(path("dev", f"nvidia{g.minor}"))
            except OSError:
                continue
            keys[(st.st_dev, st.st_ino)] = g
        if not keys:
            return
        me = os.getpid()
        for d in os.listdir(PROC):
            if not d.isdigit() or int(d) == me:
                continue
            fd_dir = f"{PROC}/{d}/fd"
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            seen: set[str] = set()
            for fd in fds:
                try:
                    st = os.stat(f"{fd_dir}/{fd}")
                except OSError:
                    continue
                hit = keys.get((st.st_dev, st.st_ino))
                if hit is None or hit.bdf in seen:
                    continue
                seen.add(hit.bdf)
                argv = _cmdline(int(d))
                hit.holders.append(_holder(int(d), argv, hit.memory_total))
        for g in gpus:
            g.holders.sort(key=lambda h: h.pid)
            if any(h.kind == "" for h in g.holders):
                g.persistence = True

    def p2p_ok(self, a: GpuView, b: GpuView) -> bool:
        """Say whether peer copies work: NVLink; or PCIe with both groups in identity
        (passthrough) and no ACS request/completion redirect on the bridges between them, or
        one that the root complex routes back down (profile ``rc_routes_redirected_p2p``)."""
        lk = self.link(a.bdf, b.bdf)
        if lk and lk.get("type") == "nvlink":
            return True
        if a.gtype != "identity" or b.gtype != "identity":
            return False
        return not self.redirected(a, b) or bool(self.profile.get("rc_routes_redirected_p2p"))

    def redirected(self, a: GpuView, b: GpuView) -> bool:
        """Say whether a bridge between two GPUs (not shared by both) redirects their peer traffic (ACS)."""
        up_a, up_b = self._ancestors(a.bdf), self._ancestors(b.bdf)
        between = [x for x in up_a if x not in up_b] + [x for x in up_b if x not in up_a]
        return any(self.acs_redirect(x) for x in between)

    def _ancestors(self, bdf: str) -> list[str]:
        out: list[str] = []
        cur = self.funcs.get(bdf, {}).get("parent")
        while cur and cur not in out:
            out.append(cur)
            cur = self.funcs.get(cur, {}).get("parent")
        return out

    def acs_redirect(self, bdf: str) -> bool:
        """Say whether a bridge redirects peer requests or completions (ACS ReqRedir/CmpltRedir)."""
        if bdf not in self._acs:
            try:
                with open(path("sys/bus/pci/devices", bdf, "config"), "rb") as f:
                    c = f.read(0x108)
            except OSError:
                c = b""
            on = False
            if len(c) >= 0x108 and c[0x100:0x102] == b"\x0d\x00":
                on = bool(int.from_bytes(c[0x106:0x108], "little") & 0b1100)
            elif not c:
                on = any(x in ("ReqRedir", "CmpltRedir") for x in self.funcs.get(bdf, {}).get("acs", []))
            self._acs[bdf] = on
        return self._acs[bdf]

    def link(self, a: str, b: str) -> dict[str, Any] | None:
        """Return the profile's link model entry for a GPU pair (either order), or the default."""
        for lk in self.profile.get("links", []) or []:
            if {lk["a"], lk["b"]} == {a, b}:
                return dict(lk)
        d = self.profile.get("link_default")
        return dict(d) if d else None

    def bandwidth(self, a: GpuView, b: GpuView, rng: random.Random) -> float | None:
        """Return one-direction GB/s between two GPUs with ~2% noise, or None (no P2P)."""
        if not self.p2p_ok(a, b):
            return None
        lk = self.link(a.bdf, b.bdf)
        if not lk:
            return None
        return float(lk["gbps"]) * (1.0 + rng.uniform(-0.02, 0.02))


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _holder(pid: int, argv: list[str], total_mib: int) -> Holder:
    joined = " ".join(argv)
    if "nvidia-persistenced" in joined:
        return Holder(pid, argv, 0, "")
    if "sglang.launch_server" in joined:
        frac = 0.9
        for i, a in enumerate(argv):
            if a == "--mem-fraction-static" and i + 1 < len(argv):
                try:
                    frac = float(argv[i + 1])
                except ValueError:
                    pass
            elif a.startswith("--mem-fraction-static="):
                try:
                    frac = float(a.split("=", 1)[1])
                except ValueError:
                    pass
        return Holder(pid, argv, int(total_mib * frac), "C")
    # Anything else that opens the device gets a CUDA context's worth of memory.
    return Holder(pid, argv, 512, "C")


def now_stamp() -> str:
    """Return the timestamp nvidia-smi prints: ``Tue Jun 24 01:54:13 2025``."""
    return time.strftime("%a %b %e %H:%M:%S %Y")
