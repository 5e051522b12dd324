"""Every cause of slow or hanging GPU peer-to-peer on a PCIe host, each judged from facts (pure: no I/O).

suites/p2p reads the facts in step 1's one round trip (the agent's `p2p_causes` fact,
exec/agent/probe_p2p_causes.py, beside `gpus`, `pci_paths` and `nvidia-smi topo -p2p`) and
shows the diagnosis as a table in the check-only plan and in the evidence: one row per cause
and place, with its verdict, the fact read and what fixes it. The causes and why each matters
(voipmonitor/rtx6kpro `hardware/pcie-bandwidth.md`, measured on 4- and 8-GPU RTX PRO 6000
Blackwell hosts, unless another source is named):

- IOMMU mode per group: a translated (DMA) domain makes peer writes fault or crawl
  (modules/iommu.py; the suite's own repair).
- ACS redirect: peer requests sent up to the root complex (modules/acs.py).
- BAR1 smaller than the card's memory: with Resizable BAR off BAR1 is 256 MiB, which
  "cripples P2P performance"; a BIOS setting.
- HMM in nvidia_uvm: without `options nvidia_uvm uvm_disable_hmm=1` "NCCL P2P operations lock
  up" on RTX PRO 6000 multi-GPU hosts; read as loaded and as configured for the next load.
- PCIe port power management and ASPM: without `pcie_port_pm=off` (and `pcie_aspm=off`) a
  root port can suspend while a GPU retrains its link: "Surprise Link Down" AER errors
  (`aer_uncor_status: 0x00000020`, bit 5, SDES in drivers/pci/pcie/aer.c) and host lockups.
- AER Surprise Down history per port and GPU (aer_dev_fatal / aer_dev_nonfatal).
- The driver's own P2P capability per pair (`nvidia-smi topo -p2p r` and `w`).
- The link each GPU trained to under load against its maximum.
- The NUMA placement of each pair, and what the pair should then reach (`EXPECTATIONS`).

What a pair should reach (placement, `EXPECTATIONS`) is modules/p2p_expect.py. The tools' own reports it reads (nvidia-smi -q BAR1, latency matrices, NCCL's diagnostics) are
modules/p2p_reports.py.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.modules import parsers
from pytest_gpuhost.modules.p2p_expect import EXPECTATIONS, PairExpectation, expectation, placement
from pytest_gpuhost.modules.p2p_reports import show

__all__ = [
    "EXPECTATIONS",
    "UVM_CONF",
    "UVM_CONF_TEXT",
    "Cause",
    "Diagnosis",
    "PairExpectation",
    "READS",
    "diagnose",
    "expectation",
    "modprobe_uvm_value",
    "outputs",
    "p2p_rw",
    "placement",
]

OK, FOUND, UNKNOWN = "ok", "found", "unknown"
# who acts on a finding
# BOOT: the kernel command line, which this suite never edits (the operator's boot configuration)
THIS_RUN, BOOT, OPERATOR, BIOS = "this run", "operator (boot configuration, reboot)", "operator", "BIOS"

UVM_CONF = "/etc/modprobe.d/gpuhost-nvidia-uvm.conf"
UVM_CONF_TEXT = (
    "# written by pytest-gpuhost suites/p2p: HMM in nvidia_uvm locks up NCCL P2P on multi-GPU PCIe hosts\n"
    "options nvidia_uvm uvm_disable_hmm=1\n"
)
BAR1_SMALL = 256 << 20  # what BAR1 is with Resizable BAR off

#: the diagnosis's command reads, sent in step 1's batch beside the facts (agent `run` requests)
READS: tuple[dict[str, Any], ...] = (
    {"op": "run", "argv": ["nvidia-smi", "topo", "-p2p", "r"], "timeout": 30},
    {"op": "run", "argv": ["nvidia-smi", "topo", "-p2p", "w"], "timeout": 30},
    {"op": "run", "argv": ["nvidia-smi", "-q", "-d", "MEMORY"], "timeout": 30, "max_output": 1 << 20},
)
READ_NAMES = ("topo_r", "topo_w", "smi_q")  # -q -d MEMORY: FB (the memory) and BAR1 per GPU


def outputs(replies: list[Any]) -> dict[str, str]:
    """The READS' outputs by name ("" for a command that failed or did not answer)."""
    out = {}
    for name, reply in zip(READ_NAMES, list(replies) + [None] * len(READ_NAMES), strict=False):
        ok = isinstance(reply, dict) and reply.get("rc") == 0
        out[name] = str(reply.get("stdout") or "") if ok and isinstance(reply, dict) else ""
    return out


def p2p_rw(outs: dict[str, str], index: dict[int, str]) -> dict[tuple[str, str], dict[str, str]]:
    """`nvidia-smi topo -p2p r` and `w` per GPU pair (PCI addresses, lower first; a pair counts as its
    worse direction), given nvidia-smi's index -> PCI address."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for mode in ("r", "w"):
        text = outs.get(f"topo_{mode}") or ""
        if not text:
            continue
        try:
            topo = parsers.parse_topo_p2p(text)
        except parsers.ParseError:
            continue
        for (ra, rb), status in topo.links.items():
            if not (ra.startswith("GPU") and rb.startswith("GPU") and ra[3:].isdigit() and rb[3:].isdigit()):
                continue
            a, b = index.get(int(ra[3:])), index.get(int(rb[3:]))
            if a and b and a != b:
                cell = out.setdefault((a, b) if a < b else (b, a), {})
                if cell.get(mode) in (None, "OK"):
                    cell[mode] = status
    return out


@dataclass
class Cause:
    """One cause at one place: verdict, the fact read, the fix, and who applies it."""

    cause: str
    where: str
    verdict: str  # ok | found | unknown
    fact: str
    fix: str = ""
    who: str = ""

    def row(self) -> list[str]:
        """The table row (every string from the node already escaped)."""
        return [self.cause, self.where, self.verdict, self.fact, self.fix, self.who]


@dataclass
class Diagnosis:
    """Every cause checked on one host."""

    causes: list[Cause] = field(default_factory=list)
    pairs: list[PairExpectation] = field(default_factory=list)
    uvm_fix: bool = False  # this run writes UVM_CONF
    cmdline_add: list[str] = field(default_factory=list)  # boot parameters a consenting run adds

    COLUMNS = ("cause", "where", "verdict", "fact read", "fix", "by")

    @property
    def found(self) -> list[Cause]:
        """The causes present."""
        return [c for c in self.causes if c.verdict == FOUND]

    def table(self) -> dict[str, Any]:
        """The evidence table: columns and rows."""
        return {"columns": list(self.COLUMNS), "rows": [c.row() for c in self.causes]}

    def text(self) -> str:
        """The table as text for the plan (one line per cause)."""
        return "\n".join(
            f"  [{c.verdict}] {c.cause} ({c.where}): {c.fact}" + (f" -> {c.fix} [{c.who}]" if c.fix else "")
            for c in self.causes
        )

    def summary(self) -> str:
        """One line: every cause checked, and those found."""
        names = list(dict.fromkeys(c.cause for c in self.found))
        checked = list(dict.fromkeys(c.cause for c in self.causes if c.cause != "scope"))
        return f"P2P diagnosis: {len(checked)} causes checked ({', '.join(checked)}); " + (
            "found: " + ", ".join(names) if names else "none found"
        )


def _mib(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n >> 30} GiB" if n >= 1 << 30 and n % (1 << 30) == 0 else f"{n >> 20} MiB"


def modprobe_uvm_value(confs: dict[str, str]) -> tuple[str | None, str]:
    """uvm_disable_hmm as modprobe.d configures it for the next load: (value, file), last option wins.

    modprobe.d(5): files are read in name order across the directories (a name in /etc hides the
    same name further down); options for one module accumulate, a later value of a parameter
    replacing an earlier one on the module's command line.
    """
    by_name: dict[str, str] = {}
    for path in confs:
        by_name.setdefault(path.rsplit("/", 1)[-1], path)
    value: str | None = None
    where = ""
    for name in sorted(by_name):
        path = by_name[name]
        for raw in str(confs[path]).splitlines():
            line = raw.split("#", 1)[0].strip()
            try:
                words = shlex.split(line)
            except ValueError:
                words = line.split()
            if len(words) < 3 or words[0] != "options" or words[1].replace("-", "_") != "nvidia_uvm":
                continue
            for w in words[2:]:
                k, _, v = w.partition("=")
                if k.replace("-", "_") == "uvm_disable_hmm":
                    value, where = v, path
    return value, where


def _truthy(v: str | None) -> bool | None:
    if v is None:
        return None
    s = str(v).strip().lower()
    if s in ("1", "y", "yes", "true", "on"):
        return True
    if s in ("0", "n", "no", "false", "off"):
        return False
    return None


def _surprise(counts: Any) -> int:
    if not isinstance(counts, dict):
        return 0
    return sum(int(v) for k, v in counts.items() if k == "SDES" or str(k).lower().startswith("surprisedown"))


def _has_param(cmdline: str, name: str, value: str) -> bool | None:
    for tok in cmdline.split():
        k, _, v = tok.partition("=")
        if k == name:
            return v == value
    return None


def diagnose(
    fact: dict[str, Any] | None,
    in_scope: list[str],
    *,
    group_types: dict[str, str | None] | None = None,
    redirects: list[Any] | None = None,
    p2p_rw: dict[tuple[str, str], dict[str, str]] | None = None,
    smi_bar1: dict[str, dict[str, int]] | None = None,
    memory_mib: dict[str, int] | None = None,
    loaded_links: dict[str, dict[str, Any]] | None = None,
    overrides: dict[str, float] | None = None,
    excluded: dict[str, str] | None = None,
) -> Diagnosis:
    """Judge every cause for the in-scope GPUs (VM GPUs are listed as excluded and never judged)."""
    d = Diagnosis()
    fact = fact if isinstance(fact, dict) else {}
    gpus: dict[str, Any] = fact.get("gpus") if isinstance(fact.get("gpus"), dict) else {}  # type: ignore[assignment]
    ports: dict[str, Any] = fact.get("ports") if isinstance(fact.get("ports"), dict) else {}  # type: ignore[assignment]
    add = d.causes.append
    for bdf, why in (excluded or {}).items():
        add(Cause("scope", bdf, OK, f"not judged: {show(why)[:160]}"))

    # IOMMU mode per group (the suite's own repair)
    for bdf in in_scope:
        t = (group_types or {}).get(bdf)
        if t is None:
            add(Cause("IOMMU mode", bdf, UNKNOWN, "no IOMMU group type"))
        elif t == "identity":
            add(Cause("IOMMU mode", bdf, OK, "group type identity"))
        else:
            add(
                Cause(
                    "IOMMU mode",
                    bdf,
                    FOUND,
                    f"group type {show(t)}",
                    "unbind, write identity, rebind (steps 2-5), boot unit (step 8)",
                    THIS_RUN,
                )
            )

    # ACS redirect
    if redirects:
        for r in redirects:
            add(
                Cause(
                    "ACS redirect",
                    f"{r.a} <-> {r.b}",
                    FOUND,
                    f"ReqRedir/CmpltRedir on {', '.join(r.ports)}",
                    f"boot with pci=disable_acs_redir={';'.join(r.ports)} (only where no VM's device sits below)",
                    OPERATOR,
                )
            )
    else:
        add(Cause("ACS redirect", "in-scope pairs", OK, "no redirect between in-scope GPUs"))

    # BAR1 against the card's memory
    for bdf in in_scope:
        g = gpus.get(bdf) or {}
        bar1 = g.get("bar1") if isinstance(g.get("bar1"), int) else None
        smi = (smi_bar1 or {}).get(bdf) or {}
        if bar1 is None and "bar1_mib" in smi:
            bar1 = int(smi["bar1_mib"]) << 20
        mem = (memory_mib or {}).get(bdf) or smi.get("fb_mib")
        src = "sysfs resource region 1" if isinstance(g.get("bar1"), int) else "nvidia-smi -q BAR1 Total"
        if bar1 is None:
            add(Cause("BAR1 size", bdf, UNKNOWN, "BAR1 size not readable"))
            continue
        fact_text = f"BAR1 {_mib(bar1)} ({src})" + (f", memory {_mib(int(mem) << 20)}" if mem else "")
        small = bar1 <= BAR1_SMALL or (mem is not None and bar1 < (int(mem) << 20))
        add(
            Cause(
                "BAR1 size",
                bdf,
                FOUND if small else OK,
                fact_text,
                "BIOS: enable 'Above 4G Decoding' and 'Re-Size BAR Support' (Resizable BAR), then cold boot"
                if small
                else "",
                BIOS if small else "",
            )
        )

    # HMM in nvidia_uvm: as loaded and as configured
    loaded = _truthy(fact.get("uvm_disable_hmm"))
    confs = fact.get("modprobe") if isinstance(fact.get("modprobe"), dict) else {}
    conf_value, conf_file = modprobe_uvm_value(confs or {})
    configured = _truthy(conf_value)
    if not fact.get("uvm_loaded") and loaded is None:
        loaded_text = "nvidia_uvm not loaded"
    elif loaded is None:
        loaded_text = "uvm_disable_hmm not readable (driver without the parameter?)"
    else:
        loaded_text = f"loaded uvm_disable_hmm={'1' if loaded else '0'}"
    conf_text = (
        f"configured uvm_disable_hmm={show(conf_value or '')[:20]} in {show(conf_file)[:120]}"
        if conf_value is not None
        else "not configured in modprobe.d (the driver's default: HMM on where the kernel supports it)"
    )
    # found only on a fact: the loaded module runs with HMM, or a file configures it on; a host
    # whose nvidia_uvm shows no parameter (an older driver, or not loaded) is unknown, not broken
    if configured is True and loaded is True:
        verdict = OK
    elif loaded is False or configured is False or (loaded is True and configured is None):
        verdict = FOUND  # HMM on now, or back on at the next load (nothing configures it off)
    else:
        verdict = UNKNOWN
    d.uvm_fix = verdict == FOUND and configured is not True
    fix = ""
    if verdict == FOUND:
        fix = (f"write {UVM_CONF} (options nvidia_uvm uvm_disable_hmm=1); " if d.uvm_fix else "") + (
            "applies when nvidia_uvm is next loaded (the next boot, or modprobe -r nvidia_uvm && modprobe "
            "nvidia_uvm once nothing uses the GPUs)"
        )
    elif verdict == UNKNOWN and configured is not True:
        fix = f"where the driver has the parameter: options nvidia_uvm uvm_disable_hmm=1 in {UVM_CONF}"
    add(
        Cause(
            "HMM in nvidia_uvm",
            "host",
            verdict,
            f"{loaded_text}; {conf_text}",
            fix,
            THIS_RUN if verdict == FOUND else (OPERATOR if fix else ""),
        )
    )

    # PCIe port power management and ASPM
    cmdline = str(fact.get("cmdline") or "")
    pm_off = _has_param(cmdline, "pcie_port_pm", "off")
    aspm_off = _has_param(cmdline, "pcie_aspm", "off")
    missing = [p for p, on in (("pcie_port_pm=off", pm_off), ("pcie_aspm=off", aspm_off)) if not on]
    d.cmdline_add = missing
    add(
        Cause(
            "PCIe port PM / ASPM",
            "cmdline",
            FOUND if missing else OK,
            "cmdline has "
            + (", ".join(p for p in ("pcie_port_pm=off", "pcie_aspm=off") if p not in missing) or "neither")
            + (f"; missing {', '.join(missing)}" if missing else ""),
            f"add {' '.join(missing)} to the kernel command line, then reboot" if missing else "",
            BOOT if missing else "",
        )
    )
    seen: set[str] = set()
    for bdf in in_scope:
        for p in (gpus.get(bdf) or {}).get("ports") or []:
            if p in seen:
                continue
            seen.add(p)
            info = ports.get(p) or {}
            ctl = info.get("power_control")
            if ctl is None:
                add(Cause("port runtime PM", p, UNKNOWN, "power/control not readable"))
                continue
            st = info.get("runtime_status")
            fact_text = f"power/control={show(str(ctl))[:10]}" + (
                f", runtime_status={show(str(st))[:16]}" if st else ""
            )
            auto = str(ctl).strip() == "auto"
            add(
                Cause(
                    "port runtime PM",
                    p,
                    FOUND if auto else OK,
                    fact_text,
                    "pcie_port_pm=off on the kernel command line (or echo on > power/control until the next boot)"
                    if auto
                    else "",
                    BOOT if auto else "",
                )
            )

    # AER Surprise Down history per port and GPU
    places = [(b, (gpus.get(b) or {}).get("aer")) for b in in_scope]
    places += [(p, (ports.get(p) or {}).get("aer")) for p in sorted(seen)]
    for where, aer in places:
        if not isinstance(aer, dict) or all(v is None for v in aer.values()):
            continue
        n = sum(_surprise(aer.get(k)) for k in ("aer_dev_fatal", "aer_dev_nonfatal"))
        add(
            Cause(
                "AER Surprise Down",
                where,
                FOUND if n else OK,
                f"{n} Surprise Down error(s) since boot (aer_dev_fatal/aer_dev_nonfatal SDES)",
                "the link dropped while the port was suspended or the GPU retrained: pcie_port_pm=off "
                "pcie_aspm=off; reseat or replace the riser/cable if it recurs with them"
                if n
                else "",
                BOOT if n else "",
            )
        )

    # the link each GPU trained to under load
    for bdf in in_scope:
        link = (loaded_links or {}).get(bdf) or (gpus.get(bdf) or {}).get("link") or {}
        cur, mx = link.get("current_link_speed"), link.get("max_link_speed")
        cw, mw = link.get("current_link_width"), link.get("max_link_width")
        if not cur or not mx:
            add(Cause("link under load", bdf, UNKNOWN, "link speed not readable"))
            continue
        under = loaded_links is not None and bdf in (loaded_links or {})
        text = f"{show(str(cur))} x{show(str(cw))} of {show(str(mx))} x{show(str(mw))}"
        text += " (read under load)" if under else " (read idle: a GPU drops its link when idle)"
        degraded = under and (str(cur) != str(mx) or str(cw) != str(mw))
        add(
            Cause(
                "link under load",
                bdf,
                FOUND if degraded else (OK if under else UNKNOWN),
                text,
                "reseat the card, check the riser/slot's generation in the BIOS" if degraded else "",
                OPERATOR if degraded else "",
            )
        )

    # the driver's own P2P capability, NUMA placement and expectation per pair
    for i, a in enumerate(in_scope):
        for b in in_scope[i + 1 :]:
            rw = (p2p_rw or {}).get((a, b)) or {}
            r, w = rw.get("r"), rw.get("w")
            if r is None and w is None:
                add(Cause("driver P2P capability", f"{a} <-> {b}", UNKNOWN, "nvidia-smi topo -p2p not read"))
            else:
                bad = [f"{k} {v}" for k, v in (("read", r), ("write", w)) if v is not None and v != "OK"]
                add(
                    Cause(
                        "driver P2P capability",
                        f"{a} <-> {b}",
                        FOUND if bad else OK,
                        f"topo -p2p r={show(str(r))} w={show(str(w))}",
                        "the driver does not offer P2P for this pair: the causes above (IOMMU, ACS, BAR1) "
                        "or a GPU model without PCIe P2P"
                        if bad
                        else "",
                        OPERATOR if bad else "",
                    )
                )
            e = expectation(a, b, gpus, ports, overrides=overrides, links=loaded_links)
            d.pairs.append(e)
            exp = f"expect >= {e.gbps:g} GB/s one way" if e.gbps else "expectation unknown (no link rate)"
            add(
                Cause(
                    "NUMA placement",
                    f"{a} <-> {b}",
                    OK,
                    f"{e.placement}; {exp} ({e.fraction:g} x {e.link_gbps or '?'} GB/s: {e.source})",
                )
            )
    return d
