"""The steps of an acceptance: each a check (an `Observation`, run/suite.py), none with a fix.

Every step reads the node and compares what it found with what the order promised; none
changes anything (the data volume's scratch file is the one thing written, and removed, and
not even that under --check-only). They are declared, in order, in suites/accept/suite.py
(`STEPS`); the verdict (suites/accept/verdict.py) is the last.
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.exec.s3io import location_problem
from pytest_gpuhost.modules import nccl, p2p
from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health.verdict import facts_gpus, facts_part
from pytest_gpuhost.modules.nccl_run import NO_TOOL, cuda_order, find_tool, run_both, side
from pytest_gpuhost.redact import printable, redact
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.remediation import Check, Remediation
from pytest_gpuhost.run.suite import Observation

from .disk import read_volume
from .procedure import AcceptProcedure

__all__ = ["step_data_volume", "step_gpus", "step_health", "step_interconnect", "step_s3"]

GIB = 1024**3


def _check(proc: AcceptProcedure, name: str, items: list[Any], skip: str | None = None) -> Check:
    """The step's Check from the items it compared: failed items first, in one line each."""
    bad = [i for i in items if not i.ok]
    if skip:
        line = skip
    elif bad:
        line = "; ".join(f"{i.item}: promised {i.promised}, found {i.found}" for i in bad)
    else:
        line = "; ".join(f"{i.item} {i.found}" for i in items) or "nothing to compare"
    proc.summaries[name] = line
    return Check(not bad, line, {"items": [vars(i) for i in items]}, skip=skip)


def _memory_mib(proc: AcceptProcedure) -> dict[str, int]:
    """memory.total per GPU (MiB, nvidia-smi), which the health facts do not carry."""
    r = proc.conn.run(
        ["nvidia-smi", "--query-gpu=pci.bus_id,memory.total", "--format=csv,noheader,nounits"], timeout=60
    )
    out: dict[str, int] = {}
    for line in (r.stdout or "").splitlines() if r.rc == 0 else []:
        bus, _, mib = line.partition(",")
        if mib.strip().isdigit():
            out[p2p.norm_bdf(bus)] = int(mib.strip())
    return out


def step_gpus(proc: AcceptProcedure) -> Remediation:
    """The GPUs and driver the order promised: model, count, memory per GPU, driver and CUDA."""
    o = proc.order

    def check() -> Check:
        facts = proc.health_facts()
        gpus, err = facts_gpus(facts)
        p = proc.promise
        names = sorted({str(g.get("name") or "?") for g in gpus})
        items = [
            p(
                "gpus",
                "GPU count",
                o.gpu_count,
                len(gpus) if not err else f"none ({err})",
                len(gpus) == o.gpu_count,
            ),
            p(
                "gpus",
                "GPU model",
                o.gpu_model,
                ", ".join(names) or "none",
                bool(gpus) and all(o.gpu_model.lower() in n.lower() for n in names),
            ),
        ]
        if o.memory_gib is not None:
            mem = _memory_mib(proc)
            least = min(mem.values()) if mem else None
            found = f"{least / 1024:.1f} GiB (least of {len(mem)})" if least is not None else "unknown"
            items.append(p("gpus", "memory per GPU", f">= {o.memory_gib:g} GiB", found,
                           least is not None and least >= o.memory_gib * 1024))  # fmt: skip
        if o.driver is not None:
            drivers = sorted({str(g.get("driver_version") or "") for g in gpus} - {""})
            ok = bool(drivers) and all(o.driver.holds(d) for d in drivers)
            items.append(p("gpus", "driver version", o.driver, ", ".join(drivers) or "unknown", ok))
        if o.cuda is not None:
            smi, _ = facts_part(facts, "smi")
            cuda = str((smi or {}).get("cuda_version") or "")
            items.append(p("gpus", "CUDA version", o.cuda, cuda or "unknown", o.cuda.holds(cuda)))
        return _check(proc, "gpus", items)

    return Observation("gpus", check)


def step_health(proc: AcceptProcedure) -> Remediation:
    """Every health check (modules/health/checks.py DECLARED), judged from the same facts."""

    def check() -> Check:
        facts = proc.health_facts()
        failed, unseen, passed = [], [], 0
        for c in hm.DECLARED:
            v = hm.evaluate(c.name, facts, proc.thresholds)
            evidence.current().state(f"health {c.name}", v.as_dict(), target=proc.name)
            if v.cannot_see:
                unseen.append(f"{c.name} ({v.cannot_see})")
            elif not v.ok and v.skip is None and c.fix:
                # a setting the renter can make safely (the check's declared fix): said, not a rejection
                proc.notes.append(f"{c.name}: {v.summary} (yours to fix: pytest suites/health --fix={c.fix})")
            elif not v.ok and v.skip is None:
                failed.append(f"{c.name}: {v.summary}")
                for r in v.reasons[:5]:
                    evidence.current().note(f"{c.name}: {r}")
            elif v.ok and v.skip is None:
                passed += 1
        found = "; ".join(failed) or f"{passed} of {len(hm.DECLARED)} passed, the rest not applicable"
        items = [proc.promise("health", "health checks", "every check passes", found, not failed)]
        if unseen:
            evidence.current().note("health: cannot see " + "; ".join(unseen))
        return _check(proc, "health", items)

    return Observation("health", check)


def _links(proc: AcceptProcedure, bdfs: list[str]) -> dict[str, dict[str, Any]]:
    """Each GPU's PCIe link (the `gpus` fact), what a PCIe pair's expectation is made from."""
    reply = proc.conn.call("facts", names=["gpus"], params={"minors": False})
    rows = reply.get("gpus") if isinstance(reply, dict) else None
    return {
        str(g["bdf"]): dict(g.get("link") or {})
        for g in rows or []
        if isinstance(g, dict) and g.get("bdf") in bdfs
    }


def step_interconnect(proc: AcceptProcedure) -> Remediation:
    """P2P bandwidth per GPU pair against its link's expectation, and an NCCL all-reduce."""

    def check() -> Check:
        gpus, _ = facts_gpus(proc.health_facts())
        bdfs = sorted(str(g["bdf"]) for g in gpus if g.get("bdf"))
        if len(bdfs) < 2:
            return _check(proc, "interconnect", [], skip="fewer than two GPUs: no pair to measure")
        index = {int(g["index"]): str(g["bdf"]) for g in gpus if str(g.get("index", "")).isdigit()}
        model = str(gpus[0].get("name") or "")
        matrix = p2p.measure_anywhere([proc.conn], bdfs, index=index or None)
        if matrix.no_tool:
            return Check(False, matrix.note, cannot_see=f"P2P bandwidth: {matrix.note}")
        topo = p2p.topology(proc.conn, bdfs, index or None)
        verdicts = p2p.judge(
            matrix, _links(proc, bdfs), fraction=proc.opts.p2p_fraction, topo=topo, model=model
        )
        ev = evidence.current()
        ev.matrix("P2P bandwidth", matrix.bdfs, matrix.rows(), unit="GB/s", target=proc.name)
        low = [v for v in verdicts if not v.ok]
        for v in low:
            ev.note(v.describe())
        measured = [v.gbps for v in verdicts if v.gbps is not None]
        least = f"{len(verdicts)} pairs, least {min(measured):g} GB/s" if measured else "no pair measured"
        found = f"{len(low)} of {len(verdicts)} pairs below: {low[0].describe()}" if low else least
        items = [
            proc.promise(
                "interconnect", "P2P per pair", f">= {proc.opts.p2p_fraction:g} x link", found, not low
            )
        ]
        tool, looked = find_tool([proc.conn])
        if tool is None:
            note = f"NCCL all-reduce not run: no NCCL tool ({NO_TOOL}): {'; '.join(looked)}"
            ev.note(note)
            items.append(
                proc.promise("interconnect", "NCCL all-reduce", "completes, correct data", note, False)
            )
            return _check(proc, "interconnect", items)
        first, control = run_both(tool, cuda_order(proc.conn), proc.opts.nccl_timeout)
        for arm in (first, control):
            ev.state(arm.name, side(arm), target=proc.name)
        nv = nccl.verdict(first, control)
        items.append(
            proc.promise("interconnect", "NCCL all-reduce", "completes, correct data, P2P", nv.summary, nv.ok)
        )
        return _check(proc, "interconnect", items)

    return Observation("interconnect", check)


def step_data_volume(proc: AcceptProcedure) -> Remediation:
    """The data volume's free space, and its write and read throughput on a scratch file removed after."""
    o = proc.order

    def check() -> Check:
        write = o.write_mb_s is not None and not proc.check_only
        r = read_volume(
            proc.conn, o.disk_path, mib=proc.opts.scratch_mib, write=write, bound=proc.opts.disk_timeout
        )
        p = proc.promise
        if r.free is None:
            items = [
                p("data_volume", f"data volume {o.disk_path}", "a directory", r.error or "unknown", False)
            ]
            return _check(proc, "data_volume", items)
        items = []
        if o.free_gib is not None:
            items.append(p("data_volume", "free space", f">= {o.free_gib:g} GiB", f"{r.free / GIB:.1f} GiB",
                           r.free >= o.free_gib * GIB))  # fmt: skip
        if o.write_mb_s is not None and proc.check_only:
            proc.notes.append("write throughput not measured (--check-only writes nothing)")
        elif o.write_mb_s is not None:
            got = (
                f"{r.write_mb_s:.0f} MB/s ({r.written >> 20} MiB, fsync'd)"
                if r.write_mb_s
                else (r.error or "?")
            )
            ok = r.write_mb_s is not None and r.write_mb_s >= o.write_mb_s and not r.error
            items.append(p("data_volume", "write throughput", f">= {o.write_mb_s:g} MB/s", got, ok))
            if r.read_mb_s is not None:
                evidence.current().measure("read throughput", round(r.read_mb_s, 1), "MB/s", target=proc.name)
            if r.removed is not True:
                items.append(p("data_volume", "scratch file removed", "yes", "no", False))
        return _check(proc, "data_volume", items)

    return Observation("data_volume", check)


def step_s3(proc: AcceptProcedure) -> Remediation:
    """The order's S3 bucket answers with the credentials given (HeadBucket and a listing; no write)."""
    o = proc.order

    def check() -> Check:
        if o.s3_url is None:
            return _check(proc, "s3", [], skip="the order names no S3 bucket")
        why = location_problem(o.s3_url, endpoint=o.s3_endpoint)
        found = "reachable, listed" if why is None else printable(redact(why)).replace("\n", "\\n")
        items = [
            proc.promise("s3", f"S3 {o.s3_url}", "reachable with the credentials given", found, why is None)
        ]
        return _check(proc, "s3", items)

    return Observation("s3", check)
