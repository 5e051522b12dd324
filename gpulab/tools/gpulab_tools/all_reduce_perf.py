#!/usr/bin/python3
"""The lab's nccl-tests ``all_reduce_perf`` (one process, ``-g N`` GPUs) over the lab host's state.

Installed as ``/usr/bin/all_reduce_perf`` in every lab machine (gpulab/host/lab.py TOOL_PATHS). The
output is nccl-tests' own layout (src/util.cu ``writeDeviceReport``, ``writeResultHeader``,
``writeBenchmarkLine*``, ``writeResultFooter`` at NVIDIA/nccl-tests a0b82b2260cf; exit 1 when a
result was wrong, common.cu) and, with ``NCCL_DEBUG=INFO``, NCCL's channel lines (src/transport/
p2p.cc and shm.cc at NVIDIA/nccl 5067397c2676). GPUs are the CUDA devices: the lab host's GPUs on
nvidia, in PCI order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``), narrowed by ``CUDA_VISIBLE_DEVICES``.

How it behaves, and the reports each behaviour stands for:

- Each ring hop goes ``via P2P/direct pointer`` (both GPUs in this one process: p2p.cc
  ``P2P_SAME_PID``) when peer access works as the lab's nvbandwidth sees it (``Host.p2p_ok``:
  NVLink, or both IOMMU groups identity with no ACS redirect between them), and NCCL's settings
  allow it (``NCCL_P2P_DISABLE=1``, or ``NCCL_P2P_LEVEL`` below PIX, turn it off: paths.cc
  ``ncclGetLevel``). Bus bandwidth is then 85% of the pair's link model.
- Otherwise the hop goes ``via SHM/direct/direct`` (shm.cc, NCCL 2.13-2.30), through host memory,
  at 45% of the link: a hop staged in host memory crosses PCIe twice (the IOMMU-slowed
  copies of NVIDIA/nccl#814 and the SHM-vs-P2P runs of NVIDIA/nccl#1817 show both sides). With
  ``NCCL_SHM_DISABLE=1`` as well, ``[send] via NET/Socket/0`` at 10%.
- A P2P hop through a bridge with ACS redirect on, on a host whose root complex routes the
  redirected requests back down (profile ``rc_routes_redirected_p2p``, gpulab/profiles/p2p_variants.py):
  the copies pass (``Host.p2p_ok``) but the run hangs as below, the case of
  noonghunna/club-3090 PR #902 (`topo -p2p` OK, p2pBandwidthLatencyTest passing, every NCCL
  collective deadlocked) and vllm-project/vllm#51513 (AMD host, root ports ``ReqRedir+
  CmpltRedir+``, NCCL hangs at TP=2).
- Fault ``nccl_hang`` (``/var/lib/gpulab/faults.json``: true, or a list of PCI addresses): a run
  whose ring has a P2P hop among those GPUs prints its header and never finishes, as the runs
  where the driver advertises peer access but the fabric drops the writes (translated IOMMU,
  ACS): NVIDIA/nccl#257 (fixed by ``intel_iommu=off``), NVIDIA/nccl-tests#117 (output stops after
  the column header), NVIDIA/nccl#1999, vllm-project/vllm#51513.
- Profile ``hmm_hangs_p2p``: a run with a P2P hop hangs as above while nvidia_uvm runs with HMM
  (``/sys/module/nvidia_uvm/parameters/uvm_disable_hmm`` not Y): "without this, NCCL P2P
  operations lock up" (voipmonitor/rtx6kpro ``hardware/pcie-bandwidth.md``, RTX PRO 6000 hosts).
- Fault ``nccl_wrong`` (a number of elements, default 1024 when true): a run with a P2P hop
  completes but every line from 1 MiB up has that many wrong elements out of place, ``Out of
  bounds values`` counts them FAILED and the tool exits 1 (NVIDIA/nccl-tests#131, 2 GPUs behind a
  host bridge; NVIDIA/nccl-tests#7).
- Fault ``compute_fails`` on a GPU (``{"gpus": {BDF: {"compute_fails": true}}}``, or a CUDA error
  string): CUDA cannot use that GPU, as after an uncorrectable ECC error. The run prints its device
  lines, then nccl-tests' ``CUDACHECK`` line (src/common.h: ``HOST: Test CUDA failure FILE:LINE
  'ERROR'``) and ``TESTCHECK``'s `` .. HOST pid PID: Test failure FILE:LINE``, and exits 2
  (``testCudaError``). The fault outlives a GPU reset (it is not one of the reset-class faults of
  nvidia_smi_reset.py), so it stands for a GPU whose own signals clear while it still cannot
  compute: what the short compute check after a reset is for.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))

from gpulab_tools import GpuView, Host, path, read  # noqa: E402

TESTS_VERSION = "2.19.6"
NCCL_CODE = 22809  # NCCL 2.28.9: SHM lines are still "SHM/direct/direct" (changed in 2.30.7)
NCCL_VERSION = "2.28.9+cuda12.9"
LEVELS = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS", "NET", "DIS")
OLD_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS", "SYS")
CHANNELS = 2
P2P_SHARE, SHM_SHARE, NET_SHARE = 0.85, 0.45, 0.10


def parse_size(text: str) -> int:
    """nccl-tests' parsesize: a number with an optional K, M or G (powers of 1024)."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def p2p_allowed(env: dict[str, str]) -> bool:
    """Whether NCCL's settings leave PCIe P2P on (ncclGetLevel: DISABLE=1, else a LEVEL below PIX)."""
    d = env.get("NCCL_P2P_DISABLE", "").strip()
    if d:
        try:
            if int(d, 0) == 1:
                return False
        except ValueError:
            pass
    lv = env.get("NCCL_P2P_LEVEL", "").strip()
    if not lv:
        return True
    if lv in LEVELS:
        return LEVELS.index(lv) >= LEVELS.index("PIX")
    digits = ""
    for c in lv:
        if not c.isdigit():
            break
        digits += c
    if digits:
        return OLD_LEVELS[min(int(digits), len(OLD_LEVELS) - 1)] != "LOC"
    return True


def cuda_devices(host: Host, env: dict[str, str]) -> list[GpuView]:
    """CUDA's devices in PCI order, narrowed by CUDA_VISIBLE_DEVICES (ordinals; the list stops at a bad one)."""
    gpus = sorted(host.gpus, key=lambda g: g.bdf)
    vis = env.get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return gpus
    out: list[GpuView] = []
    for tok in vis.split(","):
        tok = tok.strip()
        if not tok.isdigit() or int(tok) >= len(gpus):
            break  # CUDA ignores the rest of the list from the first invalid entry
        out.append(gpus[int(tok)])
    return out


def fault_gpus(value: object, gpus: list[GpuView]) -> bool:
    """Whether a fault (true, or a list of PCI addresses) touches these GPUs."""
    if isinstance(value, list):
        return any(g.bdf in value for g in gpus)
    return bool(value)


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    opts = {"b": "32M", "e": "32M", "f": "2", "g": "1", "c": "1", "n": "20", "w": "1", "t": "1"}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("-") and len(a) == 2 and i + 1 < len(argv):
            opts[a[1]] = argv[i + 1]
            i += 2
            continue
        if a in ("-h", "--help"):
            sys.stdout.write(
                "USAGE: all_reduce_perf \n\t[-t,--nthreads <num threads>] \n\t[-g,--ngpus <gpus per thread>] \n"
            )
            return 0
        sys.stdout.write(f"invalid option '{a}'\n")
        return 1
    min_b, max_b = parse_size(opts["b"]), parse_size(opts["e"])
    factor, ngpus, check = int(opts["f"]), int(opts["g"]), int(opts["c"])
    iters, warmup = int(opts["n"]), int(opts["w"])
    host = Host()
    devs = cuda_devices(host, env)
    hostname = socket.gethostname()
    pid = os.getpid()
    out = sys.stdout
    out.write(f"# nccl-tests version {TESTS_VERSION} nccl-headers={NCCL_CODE} nccl-library={NCCL_CODE}\n")
    out.write("# Collective test starting: all_reduce_perf\n")
    out.write(
        f"# nThread 1 nGpus {ngpus} minBytes {min_b} maxBytes {max_b} step: {factor}(factor) "
        f"warmup iters: {warmup} iters: {iters} agg iters: 1 validation: {check} graph: 0 unalign: 0\n#\n"
    )
    out.write("# Using devices\n")
    if ngpus > len(devs):
        out.flush()
        sys.stderr.write(
            f"Invalid number of GPUs: {ngpus} requested but only {len(devs)} were found.\n"
            "Please check the number of processes and GPUs per process.\n"
        )
        return 1
    ranks = devs[:ngpus]
    for r, g in enumerate(ranks):
        dom, bus, rest = g.bdf.split(":")
        out.write(
            f"#  Rank {r:2d} Group  0 Pid {pid:6d} on {hostname:>10} device {r:2d} "
            f"[{int(dom, 16):04x}:{bus}:{rest.split('.')[0]}] {g.name}\n"
        )
    per_gpu = host.faults.get("gpus") or {}
    for g in ranks:
        broken = (per_gpu.get(g.bdf) or {}).get("compute_fails")
        if broken:
            err = broken if isinstance(broken, str) else "uncorrectable ECC error encountered"
            out.write(f"{hostname}: Test CUDA failure common.cu:1084 '{err}'\n")
            out.write(f" .. {hostname} pid {pid}: Test failure common.cu:1187\n")
            out.flush()
            return 2
    info = env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE")
    if info:
        out.write(f"NCCL version {NCCL_VERSION}\n")
    p2p_on = p2p_allowed(env)
    shm_on = env.get("NCCL_SHM_DISABLE", "").strip() in ("", "0")
    rng = random.Random()
    hops = []  # (rank, next rank, transport, GB/s of the hop)
    redirected = False  # a P2P hop through a bridge whose ACS redirects it (routed by the root complex)
    for r, a in enumerate(ranks):
        nxt = (r + 1) % len(ranks)
        b = ranks[nxt]
        if len(ranks) < 2:
            break
        link = host.link(a.bdf, b.bdf) or {"gbps": 20.0}
        gbps = float(link.get("gbps", 20.0))
        if p2p_on and host.p2p_ok(a, b):
            hops.append((r, nxt, "P2P/direct pointer", gbps * P2P_SHARE))
            redirected = redirected or host.redirected(a, b)
        elif shm_on:
            hops.append((r, nxt, "SHM/direct/direct", gbps * SHM_SHARE))
        else:
            hops.append((r, nxt, "NET/Socket/0", gbps * NET_SHARE))
    if info:
        tid = pid + 1
        for c in range(CHANNELS):
            for r, nxt, how, _ in hops:
                src, dst = ranks[r].index, ranks[nxt].index  # [%d] after a rank: its NVML device
                if how.startswith("SHM"):
                    line = f"Channel {c:02d} : {r}[{src}] -> {nxt}[{dst}] via {how}"
                elif how.startswith("NET"):
                    line = f"Channel {c:02d}/0 : {r}[{src}] -> {nxt}[{dst}] [send] via {how}"
                else:
                    line = f"Channel {c:02d}/0 : {r}[{src}] -> {nxt}[{dst}] via {how}"
                out.write(f"{hostname}:{pid}:{tid + r} [{r}] NCCL INFO {line}\n")
    out.write("#\n")
    out.write(
        "#                                                              out-of-place                       in-place          \n"
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       \n"
    )
    out.flush()
    faults = host.faults
    via_p2p = any(h[2].startswith("P2P") for h in hops)
    if via_p2p and (redirected or fault_gpus(faults.get("nccl_hang"), ranks) or hmm_hangs(host)):
        while True:  # the kernels wait for peer writes that never arrive
            time.sleep(3600)
    wrong_fault = faults.get("nccl_wrong") if via_p2p else None
    n_wrong = 0
    if wrong_fault:
        n_wrong = 1024 if wrong_fault is True else int(wrong_fault)
    peak = min((h[3] for h in hops), default=0.0)
    bus_factor = 2 * (len(ranks) - 1) / len(ranks)
    total, count, errors = 0.0, 0, 0
    size = min_b
    while size <= max_b:
        elems = size // 4
        cells: list[str] = []
        for _ in ("out-of-place", "in-place"):
            if peak > 0:
                t_us = 8.0 + size * bus_factor / (peak * 1e9) * 1e6 * (1.0 + rng.uniform(-0.02, 0.02))
            else:
                t_us = 0.2
            algbw = size / 1e9 / (t_us / 1e6)
            busbw = algbw * bus_factor
            wrong = n_wrong if (cells == [] and size >= 1 << 20) else 0
            errors += 1 if wrong else 0
            total += busbw
            count += 1
            w = f"{wrong:6g}" if check else "   N/A"
            cells.append(f"  {fmt(t_us, 7)}  {fmt(algbw, 6)}  {fmt(busbw, 6)}  {w}")
        out.write(f"{size:12d}  {elems:12d}  {'float':>8}  {'sum':>6}  {-1:6d}" + "".join(cells) + "\n")
        size = size * factor if factor > 1 else size + max(1, max_b)
    time.sleep(0.2)
    avg = total / count if count else 0.0
    out.write(f"# {'Out of bounds values':<20} : {errors} {'FAILED' if errors else 'OK'}\n")
    out.write(f"# {'Avg bus bandwidth':<20} : {avg:g} \n#\n")
    out.write("# Collective test concluded: all_reduce_perf\n#\n")
    out.flush()
    return 1 if errors else 0


def hmm_hangs(host: Host) -> bool:
    """HMM in nvidia_uvm locks up NCCL P2P on multi-GPU RTX PRO 6000 hosts (voipmonitor/rtx6kpro
    hardware/pcie-bandwidth.md: ``uvm_disable_hmm=1`` "required on virtually all RTX PRO 6000
    multi-GPU setups"): profile ``hmm_hangs_p2p``, while the loaded module's parameter is not Y."""
    if not host.profile.get("hmm_hangs_p2p"):
        return False
    value = (read(path("sys/module/nvidia_uvm/parameters/uvm_disable_hmm")) or "").strip()
    return value not in ("Y", "1")


def fmt(value: float, width: int) -> str:
    """nccl-tests' getFloatStr: two decimals, then fewer, then an exponent, to fit the width."""
    for f in (f"{value:{width}.2f}", f"{value:{width}.1f}", f"{value:{width}.0f}"):
        if len(f) <= width:
            return f
    return f"{value:{width}.1e}" if width >= 7 else f"{value:{width}.0e}"


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:
        sys.exit(0)
