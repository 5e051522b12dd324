"""The health checks: each declared once in `checks.DECLARED`, its verdict in the module of its family.

`checks` is the front (DECLARED, CHECKS, FIXES, evaluate); the suite's tests, the node check's
subset and the docs tables are made from DECLARED. `thresholds` holds every inventory variable a check reads, `verdict` what a check returns,
`facts` the agent facts asked for in one request, `xid` NVIDIA's Xid catalogue, one module per
family of checks (`gpu`, `fabric`, `host`, `memory`, `mounts`, `ib`, `nvlink`, `counters`,
`diag`), and `fast` the check-only subset `gpuhost-nodecheck` runs within a time budget.
"""
