"""The comparing half of scripts/gpu-check.sh: real nvidia-smi/NVML output against the plugin's parsers.

Reads the captures gpu-check.sh saved in DIR, opens a local:// connection (the agent, as the suites
use it) and checks that every source agrees on the GPUs: `nvidia-smi -L`, the agent's `gpus` and
`nvidia_smi_gpus` facts, NVML (pynvml, where installed), the health facts through the agent's own
NVML reader against nvidia-smi (both kept), `nvidia-smi topo -m` and `topo -p2p r`
through parsers.py; then measures P2P as the suite does (cupy probe, else nvbandwidth) and keeps
the matrix; reads the torch all-reduce program's runs on NCCL (nccl-torch-*.txt) with
nccl.parse_perf, and runs the collective as the suites do (nccl_run.find_tool, run_arm: one GPU,
then both arms and the verdict on every GPU where there are two or more). Writes DIR/compare.json
and one line per check; exits 1 when a check failed.

    python scripts/gpu_check.py DIR
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pytest_gpuhost.exec.targets import open_connection, parse_host_url  # noqa: E402
from pytest_gpuhost.modules import nccl, nccl_run, p2p, parsers  # noqa: E402
from pytest_gpuhost.modules.health import crosscheck  # noqa: E402
from pytest_gpuhost.modules.health.thresholds import Thresholds, probe_params  # noqa: E402


def _bus_ids_from_l(text: str) -> int:
    return len(re.findall(r"^GPU \d+:", text, re.M))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(
            "gpu_check: usage: python scripts/gpu_check.py DIR (the folder gpu-check.sh filled)",
            file=sys.stderr,
        )
        return 2
    out = Path(argv[0])
    results: list[dict[str, Any]] = []

    def check(name: str, fn: Callable[[], Any]) -> Any:
        try:
            detail = fn()
            results.append({"check": name, "ok": True, "detail": detail})
            return detail
        except Exception as exc:  # a parser or a source that disagrees: recorded, the next check runs
            results.append({"check": name, "ok": False, "detail": f"{type(exc).__name__}: {exc}"})
            return None

    def read(name: str) -> str:
        return (out / name).read_text(errors="replace")

    n = _bus_ids_from_l(read("nvidia-smi-L.txt"))
    conn = open_connection(parse_host_url("local://"))
    try:
        facts = conn.facts("gpus", "nvidia_smi_gpus")

        def agent_gpus() -> list[str]:
            bdfs = [g["bdf"] for g in facts["gpus"] if g.get("driver") == "nvidia"]
            assert len(bdfs) == n, f"agent sees {len(bdfs)} GPUs on nvidia, nvidia-smi -L lists {n}"
            return bdfs

        bdfs = check("gpus fact = nvidia-smi -L", agent_gpus) or []

        def smi_table() -> dict[str, Any]:
            table = facts["nvidia_smi_gpus"] or {}
            assert sorted(table) == sorted(bdfs), f"nvidia_smi_gpus {sorted(table)} != gpus {sorted(bdfs)}"
            return table

        check("nvidia_smi_gpus fact = gpus fact", smi_table)

        def nvml() -> Any:
            try:
                import pynvml
            except ImportError:
                return "pynvml not installed: skipped"
            pynvml.nvmlInit()
            try:
                ids = []
                for i in range(pynvml.nvmlDeviceGetCount()):
                    bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).busId
                    ids.append(p2p.norm_bdf(bus.decode() if isinstance(bus, bytes) else bus))
            finally:
                pynvml.nvmlShutdown()
            assert sorted(ids) == sorted(bdfs), f"NVML {sorted(ids)} != agent {sorted(bdfs)}"
            return ids

        check("NVML bus ids = gpus fact", nvml)

        def health_sources() -> str:
            # the health facts through NVML (ctypes, the agent's own reader) and through nvidia-smi,
            # both kept in DIR, then compared field by field (modules/health/crosscheck.py)
            both = crosscheck.read_both(conn, probe_params(Thresholds.from_vars({})))
            for name, facts in zip(
                ("health-facts-nvml.json", "health-facts-nvidia-smi.json"), both, strict=True
            ):
                (out / name).write_text(json.dumps(facts, indent=1, default=str) + "\n")
            diffs = crosscheck.differences(*both)
            assert not diffs, f"{len(diffs)} disagreement(s): " + "; ".join(diffs[:5])
            return f"{len(both[0]['gpus'].get('gpus') or [])} GPUs read the same both ways"

        check("health facts: NVML = nvidia-smi", health_sources)

        def topo_m() -> list[str]:
            m = parsers.parse_topo_matrix(read("nvidia-smi-topo-m.txt"))
            gpus = [d for d in m.devices if d.startswith("GPU")]
            assert len(gpus) == n, f"topo -m has {len(gpus)} GPU columns for {n} GPUs"
            return m.devices

        check("parse_topo_matrix(nvidia-smi topo -m)", topo_m)

        def topo_p2p() -> dict[str, str]:
            m = parsers.parse_topo_p2p(read("nvidia-smi-topo-p2p-r.txt"))
            assert len(m.devices) == n, f"topo -p2p r has {len(m.devices)} GPU columns for {n} GPUs"
            return {f"{a}>{b}": v for (a, b), v in m.links.items()}

        check("parse_topo_p2p(nvidia-smi topo -p2p r)", topo_p2p)

        for name in ("nvbandwidth-d2d-read-ce.txt", "nvbandwidth-d2d-read-ce.json"):
            if (out / name).is_file() and (out / name).stat().st_size:
                parse = (
                    parsers.parse_nvbandwidth_json
                    if name.endswith(".json")
                    else parsers.parse_nvbandwidth_text
                )
                check(f"parse {name}", lambda parse=parse, name=name: sorted(parse(read(name))))

        if len(bdfs) >= 2:
            matrix = check(
                "P2P measurement (as suites/p2p step 6)", lambda: p2p.measure_anywhere([conn], bdfs).to_dict()
            )
            if matrix is not None:
                (out / "p2p-matrix.json").write_text(json.dumps(matrix, indent=1) + "\n")
        else:
            results.append({"check": "P2P measurement", "ok": True, "detail": "one GPU: no pair to measure"})
        torch_runs = sorted(out.glob("nccl-torch-*.txt"))
        if not torch_runs:
            pf = out / "nccl-torch-probe.json"
            probe = pf.read_text(errors="replace").strip() if pf.is_file() else "no probe captured"
            results.append(
                {"check": "torch all-reduce on NCCL", "ok": True, "detail": f"not checked: {probe}"}
            )
        for f in torch_runs:

            def torch_run(f: Path = f) -> str:
                r = nccl.parse_perf(f.read_text(errors="replace"))
                assert r.concluded, f"no footer: {'; '.join(r.errors) or 'see ' + f.name}"
                assert r.wrong == 0, f"{r.wrong} wrong elements"
                assert [x.size for x in r.rows] == [8 << 20, 16 << 20, 32 << 20, 64 << 20, 128 << 20], r.rows
                buses = {d.bus for d in r.devices}
                assert buses <= {b.rsplit(".", 1)[0] for b in bdfs}, f"device lines {buses} vs {bdfs}"
                chans = nccl.parse_channels(f.read_text(errors="replace"))
                kinds = sorted({c.transport for c in chans})
                return f"{len(r.devices)} rank(s), avg busbw {r.avg_busbw} GB/s, 0 wrong, transports {kinds}"

            check(f"parse_perf({f.name})", torch_run)

        def collective() -> dict[str, Any]:
            tool, looked = nccl_run.find_tool([conn])
            assert tool is not None, f"no NCCL tool: {looked}"
            one = nccl_run.run_arm(tool, "compute", bdfs[:1], {}, 300.0)
            assert one.failure() == "" and one.result.wrong == 0, one.failure() or one.tail[-500:]
            kept: dict[str, Any] = {"tool": tool.describe(), "one GPU": one.to_dict()}
            if len(bdfs) >= 2:
                first, control = nccl_run.run_both(tool, bdfs, 300.0)
                kept["arms"] = [first.to_dict(), control.to_dict()]
                kept["verdict"] = nccl.verdict(first, control).summary  # kept, not judged: any host
            (out / "nccl-collective.json").write_text(json.dumps(kept, indent=1, default=str) + "\n")
            return {"tool": kept["tool"], "verdict": kept.get("verdict", "one GPU: code path only")}

        if bdfs:
            check("NCCL collective as the suites run it (nccl_run)", collective)
    finally:
        conn.close()
    (out / "compare.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    for r in results:
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']}: {str(r['detail'])[:200]}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
