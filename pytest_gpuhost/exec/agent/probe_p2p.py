"""The P2P probe: peer copies between CUDA devices with cupy, capability with pynvml.

Direction: the result's key "A>B" is data moved from GPU A to GPU B (A's buffer is the source,
B's the destination; the copy is issued in B's context, as nvbandwidth's read test issues it in
the reading GPU's context). Every tool's matrix is stored this way (modules/p2p.py, P2PMatrix).

How it measures, as nvbandwidth does (NVIDIA/nvbandwidth README "Measurement Details": the
timed copy is repeated and the median is reported): one untimed warm-up copy, then ``samples``
timed copies of ``size`` bytes (at least 512 MiB, so the copy is long against launch latency),
each timed with CUDA events on one stream; the pair's figure is the median sample. The copied
bytes are checked at both ends of the buffer.

A pair fails (``errors``), rather than reading as a slow pair, when enabling peer access fails
for any reason but cudaErrorPeerAccessAlreadyEnabled (704, CUDA runtime API error codes), when
a copy or allocation fails, or when the copied bytes differ. A pair CUDA says cannot access its
peer (cudaDeviceCanAccessPeer 0) is not measured: its value is None and its error says so.
"""

import statistics

from pytest_gpuhost.exec.agent.core import op

P2P_MIN_SIZE = 512 << 20
P2P_SAMPLES = 5
_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled


def _norm_bdf(bus_id):
    # cudaDeviceGetPCIBusId gives 0000:17:00.0 (or 00000000:17:00.0); sysfs uses 0000:17:00.0
    parts = bus_id.strip().lower().split(":")
    if len(parts) != 3:
        return bus_id.strip().lower()
    return f"{int(parts[0], 16) & 0xFFFF:04x}:{parts[1]}:{parts[2]}"


def _cuda_error(exc):
    """One line naming the CUDA error: 'cudaErrorXxx (code): message' where cupy says it."""
    status = getattr(exc, "status", None)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if status is None or str(status) in text else f"{text} (status {status})"


def enable_peer(cupy, dst_dev, src_dev):
    """Let ``dst_dev`` access ``src_dev``'s memory; return None, or the error that is a failure."""
    with cupy.cuda.Device(dst_dev):
        try:
            cupy.cuda.runtime.deviceEnablePeerAccess(src_dev)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            if getattr(exc, "status", None) == _PEER_ACCESS_ALREADY_ENABLED:
                return None
            return f"cudaDeviceEnablePeerAccess({src_dev}) on device {dst_dev}: {_cuda_error(exc)}"
    return None


def measure_pair(cupy, src_dev, dst_dev, size, samples):
    """Copy ``size`` bytes src -> dst ``samples`` times; return {"gbps", "samples"} or {"error"}."""
    runtime = cupy.cuda.runtime
    if not runtime.deviceCanAccessPeer(dst_dev, src_dev):
        return {"error": f"cudaDeviceCanAccessPeer({dst_dev}, {src_dev}) = 0: no peer access"}
    err = enable_peer(cupy, dst_dev, src_dev)
    if err:
        return {"error": err}
    src = dst = None
    try:
        with cupy.cuda.Device(src_dev):
            src = cupy.full(size, 0x5A, dtype=cupy.uint8)
        with cupy.cuda.Device(dst_dev):
            dst = cupy.zeros(size, dtype=cupy.uint8)
            stream = cupy.cuda.Stream(non_blocking=True)
            runtime.memcpyPeerAsync(dst.data.ptr, dst_dev, src.data.ptr, src_dev, size, stream.ptr)
            stream.synchronize()
            values = []
            for _ in range(samples):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                runtime.memcpyPeerAsync(dst.data.ptr, dst_dev, src.data.ptr, src_dev, size, stream.ptr)
                end.record(stream)
                end.synchronize()
                ms = cupy.cuda.get_elapsed_time(start, end)
                if ms <= 0:
                    return {"error": f"a copy timed at {ms} ms"}
                values.append(round(size / (ms / 1000.0) / 1e9, 2))
            head, tail = dst[:4096], dst[size - 4096 :]
            if not (bool((head == 0x5A).all()) and bool((tail == 0x5A).all())):
                return {"error": "the copied bytes differ from the source"}
    except Exception as exc:  # CUDARuntimeError, OutOfMemoryError: the pair failed, say why
        return {"error": f"copy {src_dev} -> {dst_dev}: {_cuda_error(exc)}"}
    finally:
        del src, dst
        try:
            cupy.get_default_memory_pool().free_all_blocks()
        except Exception:
            pass
    return {"gbps": statistics.median(values), "samples": values}


def _capability(bdfs):
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handles = {b: pynvml.nvmlDeviceGetHandleByPciBusId(b.encode()) for b in bdfs}
            out = {}
            for a in bdfs:
                for b in bdfs:
                    if a != b:
                        # the read capability index is the literal 0 (the module's constant is a tuple)
                        out[a + ">" + b] = int(pynvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], 0))
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        return {"error": str(exc)}


@op("p2p_probe")
def p2p_probe(params):
    """Measure peer copies between CUDA devices with cupy; capabilities with pynvml.

    Returns {"available": False, "reason": ...} where cupy is missing, so the caller falls back to
    nvbandwidth. Devices are addressed by PCI bus id, never by CUDA ordinal.
    """
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return {"available": False, "reason": f"cupy: {exc}"}
    size = max(int(params.get("size") or P2P_MIN_SIZE), P2P_MIN_SIZE)
    samples = max(int(params.get("samples") or P2P_SAMPLES), 3)
    want = [b.lower() for b in params.get("bdfs") or []]
    runtime = cupy.cuda.runtime
    try:
        ordinals = {_norm_bdf(runtime.deviceGetPCIBusId(i)): i for i in range(runtime.getDeviceCount())}
    except Exception as exc:  # no device, driver/runtime mismatch: not a measurement
        return {"available": False, "reason": f"cupy: {_cuda_error(exc)}"}
    bdfs = [b for b in (want or sorted(ordinals)) if b in ordinals]
    bandwidth, samples_out, errors = {}, {}, {}
    for a in bdfs:
        for b in bdfs:
            if a == b:
                continue
            r = measure_pair(cupy, ordinals[a], ordinals[b], size, samples)
            key = a + ">" + b
            bandwidth[key] = r.get("gbps")
            if "samples" in r:
                samples_out[key] = r["samples"]
            if "error" in r:
                errors[key] = r["error"]
    return {
        "available": True,
        "bdfs": bdfs,
        "capability": _capability(bdfs),
        "bandwidth": bandwidth,
        "samples": samples_out,
        "errors": errors,
        "size": size,
        "direction": "A>B = data from A to B",
        "missing": [b for b in want if b not in ordinals],
    }
