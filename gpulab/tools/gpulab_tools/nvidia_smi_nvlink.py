"""The lab's ``nvidia-smi nvlink -e`` (``--errorcounters``): each GPU's NVLink error counters, per link.

The real tool prints the GPU's line as ``nvlink -s`` does (``GPU 0: NAME (UUID: ...)``), then one
line per link and counter, ``Link N: COUNTER: VALUE``. Two counter sets (docs/health-checks.md,
"NVLink error counters", gives the sources):

- NVLink 2-4 (V100 .. H100/H200): ``Replay Errors``, ``Recovery Errors``, ``CRC Errors``, a blank
  line between links (stas00/ml-engineering compute/accelerator/nvidia/debug.md, an H100 capture;
  github.com/NVIDIA/srt-slurm/pull/307 shows the same lines).
- NVLink 5 (Blackwell): the packet and link errors, link-recovery events, BER and the FEC
  histogram (the field set DCGM exposes as ``DCGM_FI_DEV_NVLINK_COUNT_*`` on GB200,
  github.com/NVIDIA/dcgm-exporter/issues/581; the names as nvidia-smi prints them in captures from B300
  nodes on driver 595.91.07). ``Total link recovery events`` is the sum of the successful and
  failed ones; BER ``15e-255`` is the floor (no error).

Counters are 0 unless the runtime fault ``gpus: {BDF: {nvlink_errors: {LINK: {COUNTER: N}}}}``
in ``/var/lib/gpulab/faults.json`` says more (a test raises them between runs, as counters grow
on a real link). Every run is appended to the host's record (``{"op": "nvidia-smi", "argv":
["nvlink", "-e"]}``), so a test can tell which hosts ran it.
"""

from __future__ import annotations

import sys

from gpulab_tools import GpuView, Host, record

NVLINK4 = ("Replay Errors", "Recovery Errors", "CRC Errors")
NVLINK5 = (
    "Malformed packet Errors",
    "Buffer overrun Errors",
    "Rx Errors",
    "Rx remote Errors",
    "Rx General Errors",
    "Local link integrity Errors",
    "Tx discards",
    "Link recovery successful events",
    "Link recovery failed events",
    "Total link recovery events",
    "Effective Errors",
    "Effective BER",
    "Symbol Errors",
    "Symbol BER",
    *(f"FEC Errors - {i}" for i in range(16)),
)
# Blackwell GPUs carry NVLink 5 (NVIDIA B200/B300/GB200 datasheets: fifth-generation NVLink).
BLACKWELL = ("B200", "B300", "GB200", "GB300")


def counter_names(g: GpuView) -> tuple[str, ...]:
    """The counters `nvlink -e` prints for each of the GPU's links: NVLink 5's on Blackwell."""
    return NVLINK5 if any(m in g.name for m in BLACKWELL) else NVLINK4


def counter_faults(host: Host, g: GpuView) -> dict[str, object]:
    got = ((host.faults.get("gpus") or {}).get(g.bdf) or {}).get("nvlink_errors")
    return got if isinstance(got, dict) else {}


def value(faults: dict[str, object], link: int, name: str) -> str:
    got = faults.get(str(link))
    vals = got if isinstance(got, dict) else {}
    if name.endswith("BER"):
        return str(vals.get(name, "15e-255"))
    if name == "Total link recovery events" and name not in vals:
        ok = int(vals.get("Link recovery successful events", 0))
        return str(ok + int(vals.get("Link recovery failed events", 0)))
    return str(int(vals.get(name, 0)))


def nvlink_errors(host: Host, gpus: list[GpuView], argv: list[str]) -> None:
    """Print ``nvlink -e`` for `gpus`: only links the profile gives the GPU (as ``nvlink -s``)."""
    record({"op": "nvidia-smi", "argv": argv})
    out = []
    for g in gpus:
        out.append(f"GPU {g.index}: {g.name} (UUID: {g.spec['uuid']})")
        faults, names = counter_faults(host, g), counter_names(g)
        for i, _ in enumerate(g.health.get("nvlinks") or []):
            out.extend(f"\t Link {i}: {n}: {value(faults, i, n)}" for n in names)
            if names is NVLINK4:
                out.append("")
    sys.stdout.write("".join(line + "\n" for line in out))
