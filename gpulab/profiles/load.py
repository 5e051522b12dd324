"""Load and validate lab host profiles (``fixtures/profiles/NAME.yaml``).

A profile describes one emulated machine: its kernel, PCI functions, GPUs, the link model between
GPU pairs, its kernel log, containers, services and file trees. The schema is documented in
``fixtures/profiles/README.md``; every validation error is one line that names the file and the
field, e.g. ``proxmox-rtx6000.yaml: pci[3].bdf: '17:00.0' is not a PCI address like 0000:17:00.0``.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from gpulab.kernel import acs
from gpulab.profiles.types import (
    ACS_BITS,
    KERNEL_RE,
    Container,
    FileTree,
    Gpu,
    GpuHealth,
    GpuLink,
    IommuInfo,
    KernelHolder,
    KernelLogLine,
    LinkState,
    PciFunction,
    Profile,
    Service,
)

__all__ = [
    "ACS_BITS",
    "PROFILE_DIR",
    "Container",
    "FileTree",
    "Gpu",
    "GpuHealth",
    "GpuLink",
    "IommuInfo",
    "KernelHolder",
    "KernelLogLine",
    "LinkState",
    "PciFunction",
    "Profile",
    "ProfileError",
    "Service",
    "default_domain_for",
    "load_profile",
    "profile_names",
]

PROFILE_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "profiles"

BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
HEX16_RE = re.compile(r"^0x[0-9a-f]{4}$")
CLASS_RE = re.compile(r"^0x[0-9a-f]{6}$")
DOMAIN_TYPES = ("DMA", "DMA-FQ", "identity", "blocked", "unmanaged")
LINK_TYPES = ("nvlink", "pcie-switch", "host-bridge", "numa")
SERVICE_KINDS = ("sglang", "persistenced", "decoy")
MANAGERS = ("systemd", "none")
CONTAINER_KINDS = ("pct", "lxc")
GENERATORS = ("b200-data",)
IOMMU_VENDORS = ("intel", "amd")
SNP_IDENTITY = ("ENODEV", "ENOMEM", "EINVAL", "accept", "fallback")  # Profile.snp_identity
# Modules that take a GPU's usage count without any open file (open-gpu-kernel-modules
# kernel-open/nvidia/nv.c nv_open_device() callers other than the char device: nvidia-uvm retains
# GPUs it registered, nvidia-modeset/nvidia-drm keep a GPU open for KMS and fbdev; github.com/NVIDIA/open-gpu-kernel-modules/issues/1119 and /1374).
KERNEL_HOLDER_MODULES = ("nvidia_uvm", "nvidia_modeset", "nvidia_drm")


class ProfileError(ValueError):
    """A profile is missing, malformed or inconsistent; the message is one line."""


def default_domain_for(cmdline: str, fallback: str) -> str:
    """Return the IOMMU default domain type a kernel command line selects (``iommu=pt`` -> identity).

    Mirrors drivers/iommu/iommu.c: ``iommu=pt``/``iommu.passthrough=1`` give identity,
    ``iommu=nopt``/``iommu.passthrough=0`` translation, ``iommu.strict=1`` DMA and
    ``iommu.strict=0`` DMA-FQ; the last occurrence wins. Without any of these: ``fallback``.
    """
    passthrough: bool | None = None
    strict: bool | None = None
    for tok in cmdline.split():
        key, _, val = tok.partition("=")
        if key == "iommu" and val in ("pt", "nopt"):
            passthrough = val == "pt"
        elif key == "iommu.passthrough" and val in ("0", "1", "y", "n", "on", "off"):
            passthrough = val in ("1", "y", "on")
        elif key == "iommu.strict" and val in ("0", "1", "y", "n", "on", "off"):
            strict = val in ("1", "y", "on")
    if passthrough:
        return "identity"
    if strict is True:
        return "DMA"
    if strict is False or passthrough is False:
        return "DMA-FQ"
    return fallback


def profile_names() -> list[str]:
    """Return the names of the profiles shipped in ``fixtures/profiles``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def _resolve(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml", ".json") or p.exists():
        if not p.exists():
            raise ProfileError(f"{p}: no such profile file")
        return p
    cand = PROFILE_DIR / f"{name_or_path}.yaml"
    if not cand.exists():
        raise ProfileError(f"no profile named {name_or_path!r} (known: {', '.join(profile_names())})")
    return cand


def load_profile(name_or_path: str | Path, overrides: Mapping[str, Any] | None = None) -> Profile:
    """Load a profile by name (``fixtures/profiles/NAME.yaml``) or path, and validate it.

    ``overrides`` replaces top-level keys before validation (tests use ``{"kernel": "6.1.0"}``
    to get the pre-6.4 era). Raises ProfileError with a one-line message.
    """
    path = _resolve(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ProfileError(f"{path.name}: cannot parse: {first}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path.name}: top level must be a mapping")
    data = copy.deepcopy(data)
    if overrides:
        was = str(data.get("kernel", ""))
        data.update(copy.deepcopy(dict(overrides)))
        now = str(data.get("kernel", ""))
        if was and now != was:
            _retag_kernel(data, was, now, cmdline_given="cmdline" in overrides)
    return parse_profile(data, source=path.name)


def _retag_kernel(data: dict[str, Any], was: str, now: str, cmdline_given: bool) -> None:
    """Make the boot log and command line name the overriding kernel release (uname -r, dmesg
    and /proc/cmdline of one boot agree on a real host)."""
    if not cmdline_given and isinstance(data.get("cmdline"), str):
        data["cmdline"] = data["cmdline"].replace(was, now)
    for line in data.get("kernel_log") or []:
        if isinstance(line, dict) and isinstance(line.get("msg"), str):
            line["msg"] = line["msg"].replace(was, now)


def _param(val: Any) -> str:
    """Return a module parameter as /sys/module/M/parameters/P prints it (bools as Y/N)."""
    if isinstance(val, bool):
        return "Y" if val else "N"
    return str(val)


def _iommu(v: _V, data: Mapping[str, Any]) -> IommuInfo:
    d = v.get(data, "iommu", "", dict, {})
    vendor = v.get(d, "vendor", "iommu.", str, "intel")
    if vendor not in IOMMU_VENDORS:
        raise v.fail("iommu.vendor", f"{vendor!r} is not one of {', '.join(IOMMU_VENDORS)}")
    snp = v.get(d, "snp", "iommu.", bool, False)
    if snp and vendor != "amd":
        raise v.fail("iommu.snp", "SEV-SNP needs the AMD IOMMU (vendor: amd)")
    backport = v.get(d, "snp_backport", "iommu.", bool, False)
    if backport and not snp:
        raise v.fail("iommu.snp_backport", "a backport of SNP host support needs snp: true")
    return IommuInfo(vendor, snp, backport)


# What only a kernel with SNP host support prints (drivers/iommu/amd/init.c iommu_snp_enable(),
# arch/x86/virt/svm/sev.c snp_rmptable_init(), drivers/crypto/ccp/sev-dev.c, arch/x86/kvm/svm/sev.c).
SNP_LOG_WORD = "SNP"


def _without_snp_lines(data: Mapping[str, Any]) -> dict[str, Any]:
    """The profile data with every SNP line of its boot log dropped (a kernel without SNP host support
    prints none: mainline before 6.9 never sets amd_iommu_snp_en)."""
    out = dict(data)
    out["kernel_log"] = [
        line
        for line in data.get("kernel_log") or []
        if not (isinstance(line, dict) and SNP_LOG_WORD in str(line.get("msg", "")))
    ]
    return out


class _V:
    """Field accessors that raise one-line ProfileErrors naming the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, msg: str) -> ProfileError:
        return ProfileError(f"{self.source}: {where}: {msg}")

    def get(
        self, d: Mapping[str, Any], key: str, where: str, typ: type | tuple[type, ...], default: Any = ...
    ) -> Any:
        if key not in d or d[key] is None:
            if default is ...:
                raise self.fail(f"{where}{key}", "missing")
            return default
        v = d[key]
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if isinstance(v, bool) and typ is not bool and (typ is int or typ is float):
            raise self.fail(f"{where}{key}", f"expected {getattr(typ, '__name__', typ)}, got {v!r}")
        if not isinstance(v, typ):
            names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
            raise self.fail(f"{where}{key}", f"expected {names}, got {type(v).__name__} {v!r}")
        return v

    def bdf(self, v: Any, where: str) -> str:
        if not isinstance(v, str) or not BDF_RE.match(v):
            raise self.fail(where, f"{v!r} is not a PCI address like 0000:17:00.0")
        return v


def _acs(v: _V, f: Mapping[str, Any], w: str, key: str = "acs") -> tuple[str, ...] | None:
    if f.get(key) is None:
        return None
    bits = v.get(f, key, w, list, [])
    for b in bits:
        if b not in ACS_BITS:
            raise v.fail(f"{w}{key}", f"{b!r} is not one of {', '.join(ACS_BITS)}")
    if bits and not str(f.get("class", "")).lower().startswith("0x0604"):
        raise v.fail(f"{w}{key}", "only bridges (class 0x0604xx) have ACS control")
    return tuple(bits)


def _seq(v: _V, data: Mapping[str, Any], key: str) -> list[Any]:
    seq = v.get(data, key, "", list, [])
    for i, item in enumerate(seq):
        if not isinstance(item, dict):
            raise v.fail(f"{key}[{i}]", f"expected a mapping, got {item!r}")
    return list(seq)


def parse_profile(data: Mapping[str, Any], source: str = "<profile>") -> Profile:
    """Validate a profile dict and build the dataclasses; errors name ``source`` and the field."""
    v = _V(source)
    name = v.get(data, "name", "", str)
    hostname = v.get(data, "hostname", "", str)
    kernel = str(v.get(data, "kernel", "", (str, int, float)))
    if not KERNEL_RE.match(kernel):
        raise v.fail("kernel", f"{kernel!r} is not a kernel release like 6.8.12-4-pve")
    cmdline = v.get(data, "cmdline", "", str, "")
    default_domain = v.get(data, "default_domain", "", str, "DMA-FQ")
    if default_domain not in DOMAIN_TYPES:
        raise v.fail("default_domain", f"{default_domain!r} is not one of {', '.join(DOMAIN_TYPES)}")
    driver_version = str(v.get(data, "driver_version", "", (str, float, int), "570.133.07"))
    cuda_version = str(v.get(data, "cuda_version", "", (str, float, int), "12.8"))
    iommu = _iommu(v, data)
    m = KERNEL_RE.match(kernel)
    assert m is not None
    if iommu.snp and (int(m.group(1)), int(m.group(2))) < (6, 9) and not iommu.snp_backport:
        data = _without_snp_lines(data)  # Profile.snp_kernel: no SNP host support, no SNP line

    pci: list[PciFunction] = []
    seen: set[str] = set()
    for i, f in enumerate(_seq(v, data, "pci")):
        w = f"pci[{i}]."
        bdf = v.bdf(f.get("bdf"), f"{w}bdf")
        if bdf in seen:
            raise v.fail(f"{w}bdf", f"{bdf} listed twice")
        seen.add(bdf)
        vendor = v.get(f, "vendor", w, str).lower()
        device = v.get(f, "device", w, str).lower()
        for key, val in (("vendor", vendor), ("device", device)):
            if not HEX16_RE.match(val):
                raise v.fail(f"{w}{key}", f"{val!r} is not like 0x10de")
        klass = v.get(f, "class", w, str).lower()
        if not CLASS_RE.match(klass):
            raise v.fail(f"{w}class", f"{klass!r} is not like 0x030000")
        link = None
        if f.get("link") is not None:
            lk = v.get(f, "link", w, dict)
            lw = f"{w}link."
            speed = v.get(lk, "speed", lw, str)
            width = v.get(lk, "width", lw, int)
            link = LinkState(
                speed, width, v.get(lk, "max_speed", lw, str, speed), v.get(lk, "max_width", lw, int, width)
            )
        parent = f.get("parent")
        if parent is not None:
            v.bdf(parent, f"{w}parent")
        group = v.get(f, "iommu_group", w, int, None)
        pci.append(
            PciFunction(
                bdf=bdf,
                vendor=vendor,
                device=device,
                klass=klass,
                driver=v.get(f, "driver", w, str, None),
                iommu_group=group,
                numa_node=v.get(f, "numa_node", w, int, -1),
                parent=parent,
                link=link,
                subsystem_vendor=v.get(f, "subsystem_vendor", w, str, vendor).lower(),
                subsystem_device=v.get(f, "subsystem_device", w, str, "0x0000").lower(),
                acs=_acs(v, f, w),
                acs_cap=_acs(v, f, w, "acs_cap"),
            )
        )
    for i, f in enumerate(pci):
        if f.parent is not None and f.parent not in seen:
            raise v.fail(f"pci[{i}].parent", f"{f.parent} is not in pci")

    gpus: list[Gpu] = []
    minors: set[int] = set()
    for i, g in enumerate(_seq(v, data, "gpus")):
        w = f"gpus[{i}]."
        bdf = v.bdf(g.get("bdf"), f"{w}bdf")
        if bdf not in seen:
            raise v.fail(f"{w}bdf", f"{bdf} is not in pci")
        minor = v.get(g, "minor", w, int)
        if minor in minors:
            raise v.fail(f"{w}minor", f"minor {minor} used twice")
        minors.add(minor)
        h = v.get(g, "health", w, dict, {})
        hw = f"{w}health."
        health = GpuHealth(
            temperature=v.get(h, "temperature", hw, int, 35),
            ecc_uncorrected=v.get(h, "ecc_uncorrected", hw, int, 0),
            ecc_corrected=v.get(h, "ecc_corrected", hw, int, 0),
            retired_pages_pending=v.get(h, "retired_pages_pending", hw, int, 0),
            remapped_rows_failure=v.get(h, "remapped_rows_failure", hw, int, 0),
            throttle_reasons=v.get(h, "throttle_reasons", hw, str, "0x0000000000000000"),
            power_draw=v.get(h, "power_draw", hw, float, 60.0),
            nvlinks=tuple(float(x) for x in v.get(h, "nvlinks", hw, list, [])),
        )
        uuid = v.get(g, "uuid", w, str)
        if not re.match(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", uuid):
            raise v.fail(f"{w}uuid", f"{uuid!r} is not like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")
        gpus.append(
            Gpu(
                bdf=bdf,
                minor=minor,
                model=v.get(g, "model", w, str),
                memory_mib=v.get(g, "memory_mib", w, int),
                uuid=uuid,
                serial=str(v.get(g, "serial", w, (str, int))),
                power_limit=v.get(g, "power_limit", w, float, 600.0),
                health=health,
            )
        )

    gpu_bdfs = {g.bdf for g in gpus}
    links: list[GpuLink] = []
    for i, lk in enumerate(_seq(v, data, "links")):
        w = f"links[{i}]."
        a = v.bdf(lk.get("a"), f"{w}a")
        b = v.bdf(lk.get("b"), f"{w}b")
        for key, bdf in (("a", a), ("b", b)):
            if bdf not in gpu_bdfs:
                raise v.fail(f"{w}{key}", f"{bdf} is not a GPU")
        typ = v.get(lk, "type", w, str)
        if typ not in LINK_TYPES:
            raise v.fail(f"{w}type", f"{typ!r} is not one of {', '.join(LINK_TYPES)}")
        links.append(GpuLink(a, b, typ, v.get(lk, "gbps", w, float)))
    link_default = None
    if data.get("link_default") is not None:
        ld = v.get(data, "link_default", "", dict)
        typ = v.get(ld, "type", "link_default.", str)
        if typ not in LINK_TYPES:
            raise v.fail("link_default.type", f"{typ!r} is not one of {', '.join(LINK_TYPES)}")
        link_default = GpuLink("", "", typ, v.get(ld, "gbps", "link_default.", float))

    kernel_log = tuple(
        KernelLogLine(
            float(v.get(k, "t", f"kernel_log[{i}].", float)), v.get(k, "msg", f"kernel_log[{i}].", str)
        )
        for i, k in enumerate(_seq(v, data, "kernel_log"))
    )

    containers: list[Container] = []
    for i, c in enumerate(_seq(v, data, "containers")):
        w = f"containers[{i}]."
        kind = v.get(c, "kind", w, str, "pct")
        if kind not in CONTAINER_KINDS:
            raise v.fail(f"{w}kind", f"{kind!r} is not one of {', '.join(CONTAINER_KINDS)}")
        cname = v.get(c, "name", w, str)
        containers.append(Container(v.get(c, "id", w, int), kind, cname, v.get(c, "hostname", w, str, cname)))
    cids = {c.id for c in containers}

    services: list[Service] = []
    for i, s in enumerate(_seq(v, data, "services")):
        w = f"services[{i}]."
        where = v.get(s, "where", w, str, "host")
        if where != "host":
            m = re.match(r"^container:(\d+)$", where)
            if not m:
                raise v.fail(f"{w}where", f"{where!r} is not host or container:ID")
            if int(m.group(1)) not in cids:
                raise v.fail(f"{w}where", f"container {m.group(1)} is not in containers")
        kind = v.get(s, "kind", w, str)
        if kind not in SERVICE_KINDS:
            raise v.fail(f"{w}kind", f"{kind!r} is not one of {', '.join(SERVICE_KINDS)}")
        manager = v.get(s, "manager", w, str, "systemd")
        if manager not in MANAGERS:
            raise v.fail(f"{w}manager", f"{manager!r} is not one of {', '.join(MANAGERS)}")
        argv = v.get(s, "argv", w, list, [])
        if not all(isinstance(a, str) for a in argv):
            raise v.fail(f"{w}argv", "every argument must be a string")
        sg = v.get(s, "gpus", w, list, [])
        for j, b in enumerate(sg):
            v.bdf(b, f"{w}gpus[{j}]")
            if b not in gpu_bdfs:
                raise v.fail(f"{w}gpus[{j}]", f"{b} is not a GPU")
        ign = str(v.get(s, "ignore_sigterm", w, (str, int), "0"))
        if ign != "forever" and not ign.isdigit():
            raise v.fail(f"{w}ignore_sigterm", f"{ign!r} is not 0, seconds or forever")
        if kind == "sglang" and not sg:
            raise v.fail(f"{w}gpus", "an sglang service needs its GPUs")
        services.append(
            Service(
                name=v.get(s, "name", w, str),
                where=where,
                kind=kind,
                manager=manager,
                argv=tuple(argv),
                gpus=tuple(sg),
                port=v.get(s, "port", w, int, None),
                ignore_sigterm=ign,
                unit=dict(v.get(s, "unit", w, dict, {})),
                enabled=v.get(s, "enabled", w, bool, manager == "systemd"),
                log_file=v.get(s, "log_file", w, str, None),
            )
        )

    files: list[FileTree] = []
    for i, t in enumerate(_seq(v, data, "files")):
        gen = v.get(t, "generator", f"files[{i}].", str)
        if gen not in GENERATORS:
            raise v.fail(f"files[{i}].generator", f"{gen!r} is not one of {', '.join(GENERATORS)}")
        files.append(FileTree(v.get(t, "root", f"files[{i}].", str), gen))

    holders: list[KernelHolder] = []
    for i, kh in enumerate(_seq(v, data, "kernel_holders")):
        w = f"kernel_holders[{i}]."
        bdf = v.bdf(kh.get("bdf"), f"{w}bdf")
        if bdf not in gpu_bdfs:
            raise v.fail(f"{w}bdf", f"{bdf} is not a GPU")
        mod = v.get(kh, "module", w, str)
        if mod not in KERNEL_HOLDER_MODULES:
            raise v.fail(f"{w}module", f"{mod!r} is not one of {', '.join(KERNEL_HOLDER_MODULES)}")
        holders.append(KernelHolder(bdf, mod))
    params: dict[str, dict[str, str]] = {}
    for mod, kv in v.get(data, "module_params", "", dict, {}).items():
        if not isinstance(kv, dict):
            raise v.fail(f"module_params.{mod}", f"expected a mapping, got {kv!r}")
        params[str(mod)] = {str(k): _param(val) for k, val in kv.items()}
    snp_identity = v.get(data, "snp_identity", "", str, "")
    if snp_identity and snp_identity not in SNP_IDENTITY:
        raise v.fail("snp_identity", f"{snp_identity!r} is not one of {', '.join(SNP_IDENTITY)}")
    gsp = v.get(data, "gsp_boot_s", "", float, 0.0)
    if gsp < 0:
        raise v.fail("gsp_boot_s", f"{gsp!r} is negative")

    prof = Profile(
        iommu=iommu,
        kernel_enables_acs=v.get(data, "kernel_enables_acs", "", bool, False),
        rc_routes_redirected_p2p=v.get(data, "rc_routes_redirected_p2p", "", bool, False),
        vfio_claimed=v.get(data, "vfio_claimed", "", bool, True),
        kernel_holders=tuple(holders),
        module_params=params,
        gsp_boot_s=gsp,
        name=name,
        hostname=hostname,
        kernel=kernel,
        cmdline=cmdline,
        default_domain=default_domain,
        driver_version=driver_version,
        cuda_version=cuda_version,
        pci=tuple(pci),
        gpus=tuple(gpus),
        links=tuple(links),
        link_default=link_default,
        kernel_log=kernel_log,
        containers=tuple(containers),
        services=tuple(services),
        files=tuple(files),
        raw=json.loads(json.dumps(dict(data), default=str)),
    )
    if prof.kernel_enables_acs:
        # groups follow ACS (drivers/iommu/iommu.c pci_device_group()); a profile must not claim
        # an isolation its ports cannot give
        why = acs.check_groups(prof)
        if why:
            raise v.fail("pci", why)
    return prof
