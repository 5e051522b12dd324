"""Variants of the lab's AMD EPYC SEV-SNP machine (`proxmox-epyc-snp`) on kernels older than 6.9.

Mainline enables SNP on the AMD IOMMU from 6.9 only (the SNP host setup of tag
x86_sev_for_v6.9_rc1; ``Profile.snp_kernel``): the seed's profile moved to a mainline 6.8 kernel
with ``{"kernel": ...}`` has no SNP on its IOMMU and prints no SNP line. A distribution kernel
older than 6.9 can carry the SNP host support as a backport; ``epyc_snp_backport(kernel)`` is the
seed's machine on such a kernel, labelled as one (``iommu.snp_backport``, the name, the build
string of its first log line), and printing what iommu_snp_enable() prints on it: "AMD-Vi: IOMMU
SNP support enabled.". Which Proxmox or Ubuntu builds carry that backport is NOT verified; the
variant is the case the suite must decide from the host's own kernel log, not from its release.

``snp_log=False`` drops the SNP lines from its log (rotated away, or never read): the suite then
cannot see SNP and writes, and the kernel's answer is all it gets (on 5.11 to 6.4 a silent
fallback to ``DMA``, ``Profile.snp_identity``).
"""

from __future__ import annotations

from typing import Any

import yaml

from gpulab.profiles.load import PROFILE_DIR, SNP_LOG_WORD, load_profile
from gpulab.profiles.types import Profile

__all__ = ["BACKPORT_LABEL", "SNP_LINE", "epyc_snp_backport"]

BASE = "proxmox-epyc-snp"
SNP_LINE = "AMD-Vi: IOMMU SNP support enabled."  # drivers/iommu/amd/init.c iommu_snp_enable()
BACKPORT_LABEL = "backport: 6.9 SEV host support"  # no "SNP" in it: only SNP lines say SNP


def epyc_snp_backport(kernel: str = "6.8.12-4-pve", *, snp_log: bool = True, **overrides: Any) -> Profile:
    """The AMD SEV-SNP machine on a distribution kernel older than 6.9 that carries SNP host support.

    ``kernel``: its release (6.8.12-4-pve: a Proxmox VE 8 release; 6.2.16-20-pve: 5.11-6.4, where a
    refused identity domain falls back to DMA). ``snp_log``: keep the SNP lines in its boot log.
    ``overrides``: further top-level profile keys (``driver_version``, ``module_params``, ...).
    """
    data = yaml.safe_load((PROFILE_DIR / f"{BASE}.yaml").read_text())
    was = str(data["kernel"])
    log = []
    for line in data["kernel_log"]:
        msg = str(line["msg"])
        if not snp_log and SNP_LOG_WORD in msg:
            continue
        if msg.startswith("Linux version "):
            # the build string says what the kernel is: a distribution build with the backport
            msg = msg.replace(was, kernel).replace(" #1 SMP", f" #1 SMP ({BACKPORT_LABEL})")
            msg = msg.replace(f"PMX {was.removesuffix('-pve')}", f"PMX {kernel.removesuffix('-pve')}")
        log.append({"t": line["t"], "msg": msg})
    changes: dict[str, Any] = {
        "name": f"epyc-snp-backport-{kernel.split('-', 1)[0]}",
        "kernel": kernel,
        "cmdline": str(data["cmdline"]).replace(was, kernel),
        "iommu": {"vendor": "amd", "snp": True, "snp_backport": True},
        "kernel_log": log,
    }
    changes.update(overrides)
    return load_profile(BASE, changes)
