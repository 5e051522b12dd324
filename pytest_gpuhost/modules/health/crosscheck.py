"""NVML against nvidia-smi on one host: the health facts read both ways, compared.

The health suite reads the GPUs through NVML where the host has libnvidia-ml.so.1 and through
nvidia-smi otherwise (facts.py). Both read the same driver, so on a healthy driver they agree;
where they do not, one of the two readers (ours) is wrong for that driver. `read_both` asks the
agent twice on one connection, once with the `health_nvml` fact and once without, and
`differences` lists every disagreement, one line each. scripts/gpu_check.py runs it on a real GPU;
tests/health/test_health_crosscheck.py runs it on lab hosts and on made-up disagreements.

What is compared: per GPU (by bus id) the identity, ECC, retired-page, remap, recovery and PCIe
link fields; per GPU the NVLinks each side lists as up and down, and the non-zero NVLink error
counters; the fabric state and status, and the HBM limit. Temperatures move between the two
reads: they are compared within `TEMPERATURE_SLACK`. A field one side does not have (an older
driver's nvidia-smi drops it, NVML says not supported) is not a disagreement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_gpuhost.modules.health.facts import NVML_FACT, merge

__all__ = ["FIELDS", "PARTS", "TEMPERATURE_SLACK", "differences", "read_both"]

PARTS = ("gpus", "smi", "remap", "nvlink", "fabric")
FIELDS = (
    "name",
    "uuid",
    "persistence_mode",
    "ecc.mode.current",
    "ecc.errors.corrected.volatile.total",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.failure",
    "gpu_recovery_action",
    "reset_status.reset_required",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
)
TEMPERATURES = ("temperature.gpu", "temperature.memory")
TEMPERATURE_SLACK = 3.0  # C between two reads a second apart
REMAP = ("remapped_rows.correctable", "remapped_rows.uncorrectable", "remapped_rows.pending")


def read_both(
    conn: Any, params: Mapping[str, Any], timeout: float = 120
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (facts through NVML, facts through nvidia-smi) of one host, one request each."""
    p = dict(params, parts=list(PARTS))
    nvml = conn.call("facts", names=[NVML_FACT, "health"], params=p, reply_timeout=timeout)
    smi = conn.call("facts", names=["health"], params=dict(p), reply_timeout=timeout)
    return merge(nvml), merge(smi)


def _part(facts: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    part = facts.get(name)
    return part if isinstance(part, Mapping) else {}


def _by_bdf(facts: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(g.get("bdf")): g for g in _part(facts, "gpus").get("gpus") or [] if isinstance(g, Mapping)}


def _value(row: Mapping[str, Any], key: str) -> Any:
    """A field's value, or the error cell nvidia-smi prints in brackets; None where there is none."""
    err = (row.get("cell_errors") or {}).get(key)
    return f"[{err}]" if err else row.get(key)


def _gpus(nvml: Mapping[str, Any], smi: Mapping[str, Any]) -> list[str]:
    a, b = _by_bdf(nvml), _by_bdf(smi)
    out = [
        f"GPU {bdf}: read by {'NVML' if bdf in a else 'nvidia-smi'} only" for bdf in sorted(set(a) ^ set(b))
    ]
    for bdf in sorted(set(a) & set(b)):
        x, y = a[bdf], b[bdf]
        for key in FIELDS:
            if key not in x or key not in y:
                continue
            u, v = _value(x, key), _value(y, key)
            if u is not None and v is not None and u != v:
                out.append(f"GPU {bdf} {key}: NVML {u!r}, nvidia-smi {v!r}")
        for key in TEMPERATURES:
            u, v = x.get(key), y.get(key)
            if isinstance(u, int | float) and isinstance(v, int | float) and abs(u - v) > TEMPERATURE_SLACK:
                out.append(
                    f"GPU {bdf} {key}: NVML {u}, nvidia-smi {v} (more than {TEMPERATURE_SLACK:g} C apart)"
                )
    ra, rb = _part(nvml, "remap").get("gpus") or {}, _part(smi, "remap").get("gpus") or {}
    for bdf in sorted(set(ra) & set(rb)):
        for key in REMAP:
            u, v = (ra[bdf] or {}).get(key), (rb[bdf] or {}).get(key)
            if u is not None and v is not None and u != v:
                out.append(f"GPU {bdf} {key}: NVML {u!r}, nvidia-smi {v!r}")
    return out


def _links(part: Mapping[str, Any]) -> dict[str, tuple[set[str], set[str]]]:
    """GPU index -> (links up, links listed down)."""
    out = {}
    for idx, g in (part.get("gpus") or {}).items():
        links = (g or {}).get("links") or {}
        out[str(idx)] = (
            {k for k, st in links.items() if st.get("up")},
            {k for k, st in links.items() if not st.get("up")},
        )
    return out


def _nvlink(nvml: Mapping[str, Any], smi: Mapping[str, Any]) -> list[str]:
    a, b = _part(nvml, "nvlink"), _part(smi, "nvlink")
    if not (a.get("ok") and b.get("ok")):
        return (
            []
            if a.get("ok") == b.get("ok")
            else [f"nvlink: NVML {a.get('error') or 'ok'}, nvidia-smi {b.get('error') or 'ok'}"]
        )
    out = []
    la, lb = _links(a), _links(b)
    for idx in sorted(set(la) | set(lb), key=lambda i: int(i) if i.isdecimal() else -1):
        (ua, da), (ub, db) = la.get(idx, (set(), set())), lb.get(idx, (set(), set()))
        if ua != ub:
            out.append(f"GPU {idx} NVLinks up: NVML {sorted(ua, key=int)}, nvidia-smi {sorted(ub, key=int)}")
        elif da and db and da != db:  # nvidia-smi may list no line for a GPU whose links are all down
            out.append(
                f"GPU {idx} NVLinks down: NVML {sorted(da, key=int)}, nvidia-smi {sorted(db, key=int)}"
            )
    ea, eb = (a.get("errors") or {}).get("gpus") or {}, (b.get("errors") or {}).get("gpus") or {}
    for idx in sorted(set(ea) & set(eb)):
        ca, cb = (ea[idx] or {}).get("links") or {}, (eb[idx] or {}).get("links") or {}
        if ca != cb:
            out.append(f"GPU {idx} NVLink error counters: NVML {dict(ca)}, nvidia-smi {dict(cb)}")
    return out


def _fabric(nvml: Mapping[str, Any], smi: Mapping[str, Any]) -> list[str]:
    a, b = _part(nvml, "fabric"), _part(smi, "fabric")
    if not (a.get("ok") and b.get("ok")):
        return []
    out = []
    ga, gb = a.get("gpus") or {}, b.get("gpus") or {}
    for bdf in sorted(set(ga) & set(gb)):
        if dict(ga[bdf]) != dict(gb[bdf]):
            out.append(f"GPU {bdf} fabric: NVML {dict(ga[bdf])}, nvidia-smi {dict(gb[bdf])}")
    ma, mb = a.get("memory_temp_max") or {}, b.get("memory_temp_max") or {}
    for bdf in sorted(set(ma) & set(mb)):
        if ma[bdf] != mb[bdf]:
            out.append(f"GPU {bdf} memory limit: NVML {ma[bdf]} C, nvidia-smi {mb[bdf]} C")
    return out


def differences(nvml: Mapping[str, Any], smi: Mapping[str, Any]) -> list[str]:
    """Every disagreement between the two reads, one line each; [] where they agree.

    A first line says so where the NVML read did not come from NVML (no library, a failed init,
    a hung call): there is nothing to compare then.
    """
    source = _part(nvml, "gpus").get("source")
    if source != "nvml":
        why = _part(nvml, "gpus").get("nvml_fallback") or _part(nvml, "gpus").get("error") or source
        return [f"NVML was not read: {why}"]
    return _gpus(nvml, smi) + _nvlink(nvml, smi) + _fabric(nvml, smi)
