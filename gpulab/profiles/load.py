"""Load and validate lab host profiles (``fixtures/profiles/NAME.yaml``).

A profile describes one emulated machine: its kernel, PCI functions, GPUs, the link model between
GPU pairs, its kernel log, containers, services and file trees. The schema is documented in
``fixtures/profiles/README.md``; every validation error is one line that names the file and the
field, e.g. ``proxmox-rtx6000.yaml: pci[3].bdf: '17:00.0' is not a PCI address like 0000:17:00.0``.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from gpulab.kernel import acs
from gpulab.profiles.types import (
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
    NodeShape,
    PciFunction,
    Profile,
    Service,
)

__all__ = [
    "KERNEL_HOLDER_MODULES",
    "PROFILE_DIR",
    "ProfileError",
    "default_domain_for",
    "load_profile",
    "parse_profile",
    "profile_names",
]

PROFILE_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "profiles"

SCHEMA_PATH = Path(__file__).with_name("schema.yaml")
SCHEMA: dict[str, Any] = yaml.safe_load(SCHEMA_PATH.read_text())
# Modules that hold a GPU's usage count without an open file (the schema's kernel_holders.module,
# where the sources are cited).
KERNEL_HOLDER_MODULES: tuple[str, ...] = tuple(
    SCHEMA["properties"]["kernel_holders"]["items"]["properties"]["module"]["enum"]
)


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


@functools.cache
def _validator() -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    return jsonschema.Draft202012Validator(SCHEMA)


def _where(path: Iterable[Any]) -> str:
    """A JSON path as the profile's fields read: ``pci[3].bdf``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(err: jsonschema.ValidationError) -> str:
    """One line for the error jsonschema found: the field, then what is wrong with it."""
    if err.validator == "required":
        missing = str(err.message).split("'")[1]
        return f"{_where([*err.absolute_path, missing])}: missing"
    where = _where(err.absolute_path) or "(top level)"
    if err.validator == "additionalProperties":
        return f"{where}: {err.message} (gpulab/profiles/schema.yaml lists every key)"
    why = err.schema.get("x-error") if isinstance(err.schema, dict) else None
    if err.validator == "oneOf":  # a nullable BDF: say what the non-null branch says
        why = next((e.schema.get("x-error") for e in err.context or () if "x-error" in e.schema), None)
    return f"{where}: {err.instance!r} {why}" if why else f"{where}: {err.message}"


def _with_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """``value`` with every missing property that the schema gives a ``default`` filled in, at every depth."""
    if "$ref" in schema:
        schema = SCHEMA["$defs"][schema["$ref"].rsplit("/", 1)[-1]] | {
            k: v for k, v in schema.items() if k != "$ref"
        }
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out = dict(value)
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = _with_defaults(sub, out[key])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_with_defaults(schema["items"], x) for x in value]
    return value


def _fail(source: str, where: str, msg: str) -> ProfileError:
    return ProfileError(f"{source}: {where}: {msg}")


def parse_profile(data: Mapping[str, Any], source: str = "<profile>") -> Profile:
    """Validate a profile dict and build the dataclasses; errors name ``source`` and the field.

    The schema (gpulab/profiles/schema.yaml, checked by jsonschema) says what each key may hold
    and its default; what follows checks what no single key can: references between lists, unique
    numbers, and what the kernel and the IOMMU allow together.
    """
    err = jsonschema.exceptions.best_match(_validator().iter_errors(data))
    if err is not None:
        raise ProfileError(f"{source}: {_message(err)}")
    kernel = str(data["kernel"])
    m = KERNEL_RE.match(kernel)
    if not m:
        raise _fail(source, "kernel", f"{kernel!r} is not a kernel release like 6.8.12-4-pve")
    d = _with_defaults(SCHEMA, dict(data))
    io = d["iommu"]
    if io["snp"] and io["vendor"] != "amd":
        raise _fail(source, "iommu.snp", "SEV-SNP needs the AMD IOMMU (vendor: amd)")
    if io["snp_backport"] and not io["snp"]:
        raise _fail(source, "iommu.snp_backport", "a backport of SNP host support needs snp: true")
    iommu = IommuInfo(io["vendor"], io["snp"], io["snp_backport"])
    if iommu.snp and (int(m.group(1)), int(m.group(2))) < (6, 9) and not iommu.snp_backport:
        data = _without_snp_lines(data)  # Profile.snp_kernel: no SNP host support, no SNP line
        d["kernel_log"] = _without_snp_lines(d)["kernel_log"]

    pci: list[PciFunction] = []
    seen: set[str] = set()
    for i, f in enumerate(d["pci"]):
        if f["bdf"] in seen:
            raise _fail(source, f"pci[{i}].bdf", f"{f['bdf']} listed twice")
        seen.add(f["bdf"])
        for key in ("acs", "acs_cap"):
            if f.get(key) and not f["class"].lower().startswith("0x0604"):
                raise _fail(source, f"pci[{i}].{key}", "only bridges (class 0x0604xx) have ACS control")
        lk = f.get("link")
        vendor = f["vendor"].lower()
        pci.append(
            PciFunction(
                bdf=f["bdf"],
                vendor=vendor,
                device=f["device"].lower(),
                klass=f["class"].lower(),
                driver=f["driver"],
                iommu_group=f["iommu_group"],
                numa_node=f["numa_node"],
                parent=f["parent"],
                link=LinkState(
                    lk["speed"],
                    lk["width"],
                    lk.get("max_speed", lk["speed"]),
                    lk.get("max_width", lk["width"]),
                    lk.get("idle_speed"),
                )
                if lk
                else None,
                subsystem_vendor=f.get("subsystem_vendor", vendor).lower(),
                subsystem_device=f["subsystem_device"].lower(),
                acs=tuple(f["acs"]) if f.get("acs") is not None else None,
                acs_cap=tuple(f["acs_cap"]) if f.get("acs_cap") is not None else None,
            )
        )
    for i, pf in enumerate(pci):
        if pf.parent is not None and pf.parent not in seen:
            raise _fail(source, f"pci[{i}].parent", f"{pf.parent} is not in pci")

    gpus: list[Gpu] = []
    minors: set[int] = set()
    for i, g in enumerate(d["gpus"]):
        if g["bdf"] not in seen:
            raise _fail(source, f"gpus[{i}].bdf", f"{g['bdf']} is not in pci")
        if g["minor"] in minors:
            raise _fail(source, f"gpus[{i}].minor", f"minor {g['minor']} used twice")
        minors.add(g["minor"])
        h = g["health"]
        health = GpuHealth(
            **{k: h[k] for k in h if k != "nvlinks"}, nvlinks=tuple(float(x) for x in h["nvlinks"])
        )
        gpus.append(
            Gpu(
                bdf=g["bdf"],
                minor=g["minor"],
                model=g["model"],
                memory_mib=g["memory_mib"],
                uuid=g["uuid"],
                serial=str(g["serial"]),
                power_limit=float(g["power_limit"]),
                health=health,
            )
        )

    gpu_bdfs = {g.bdf for g in gpus}

    def gpu_ref(where: str, bdf: str) -> str:
        if bdf not in gpu_bdfs:
            raise _fail(source, where, f"{bdf} is not a GPU")
        return bdf

    links = [
        GpuLink(
            gpu_ref(f"links[{i}].a", lk["a"]),
            gpu_ref(f"links[{i}].b", lk["b"]),
            lk["type"],
            float(lk["gbps"]),
        )
        for i, lk in enumerate(d["links"])
    ]
    ld = d["link_default"]
    link_default = GpuLink("", "", ld["type"], float(ld["gbps"])) if ld else None
    kernel_log = tuple(KernelLogLine(float(k["t"]), k["msg"]) for k in d["kernel_log"])
    containers = [
        Container(c["id"], c["kind"], c["name"], c.get("hostname", c["name"])) for c in d["containers"]
    ]
    cids = {c.id for c in containers}

    services: list[Service] = []
    for i, s in enumerate(d["services"]):
        w = f"services[{i}]."
        if s["where"] != "host" and int(s["where"].split(":")[1]) not in cids:
            raise _fail(source, f"{w}where", f"container {s['where'].split(':')[1]} is not in containers")
        for j, b in enumerate(s["gpus"]):
            gpu_ref(f"{w}gpus[{j}]", b)
        if s["kind"] == "sglang" and not s["gpus"]:
            raise _fail(source, f"{w}gpus", "an sglang service needs its GPUs")
        services.append(
            Service(
                name=s["name"],
                where=s["where"],
                kind=s["kind"],
                manager=s["manager"],
                argv=tuple(s["argv"]),
                gpus=tuple(s["gpus"]),
                port=s["port"],
                ignore_sigterm=str(s["ignore_sigterm"]),
                unit=dict(s["unit"]),
                enabled=s.get("enabled", s["manager"] == "systemd"),
                log_file=s["log_file"],
                env={str(k): str(v) for k, v in s["env"].items()},
            )
        )
    files = [FileTree(t["root"], t["generator"]) for t in d["files"]]
    nd = d.get("node") or {}
    visible = nd.get("visible_gpus")
    node = NodeShape(
        init=str(nd.get("init", "systemd")),
        container=nd.get("container"),
        kernel_log=str(nd.get("kernel_log", "readable")),
        visible_gpus=None
        if visible is None
        else tuple(gpu_ref(f"node.visible_gpus[{i}]", b) for i, b in enumerate(visible)),
        nvidia_driver=bool(nd.get("nvidia_driver", True)),
    )
    if not node.systemd and any(s.manager == "systemd" for s in services):
        raise _fail(source, "node.init", "a node without systemd runs its services by hand (manager: none)")
    holders = [
        KernelHolder(gpu_ref(f"kernel_holders[{i}].bdf", kh["bdf"]), kh["module"])
        for i, kh in enumerate(d["kernel_holders"])
    ]
    params = {
        str(mod): {str(k): _param(val) for k, val in kv.items()} for mod, kv in d["module_params"].items()
    }

    prof = Profile(
        iommu=iommu,
        kernel_enables_acs=d["kernel_enables_acs"],
        rc_routes_redirected_p2p=d["rc_routes_redirected_p2p"],
        vfio_claimed=d["vfio_claimed"],
        kernel_holders=tuple(holders),
        module_params=params,
        gsp_boot_s=float(d["gsp_boot_s"]),
        node_python=str(d["node_python"]),
        node=node,
        name=d["name"],
        hostname=d["hostname"],
        kernel=kernel,
        cmdline=d["cmdline"],
        default_domain=d["default_domain"],
        driver_version=str(d["driver_version"]),
        cuda_version=str(d["cuda_version"]),
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
            raise _fail(source, "pci", why)
    return prof
