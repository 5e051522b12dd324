"""The health checks: verdicts over one host's facts (`checks` is the front: CHECKS, FIXES, evaluate).

`thresholds` holds every inventory variable a check reads, `verdict` what a check returns,
`facts` the agent facts asked for in one request, `xid` NVIDIA's Xid catalogue, one module per
family of checks (`gpu`, `fabric`, `host`, `memory`, `mounts`, `ib`, `nvlink`, `counters`,
`diag`), and `fast` the check-only subset `gpuhost-nodecheck` runs within a time budget.
"""
