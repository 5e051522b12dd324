"""Lab machines of the node shapes real fleets have and the lab's usual hosts are not.

``rented_container(visible=4, init="sleep")``: the HGX node (`b200-nvl8`) as a rented GPU container reached as
``ssh -p PORT root@IP``: PID 1 is ``sleep infinity``, ``/.dockerenv`` exists, systemctl and
journalctl are not installed, dmesg fails with EPERM (the container has no CAP_SYSLOG), /sys is
read-only, and only the first ``visible`` GPUs are the node's (their /dev/nvidiaN, as
``NVIDIA_VISIBLE_DEVICES`` makes the NVIDIA container toolkit create; sysfs shows all eight
functions). Its SGLang servers on those GPUs were started with nohup; Fabric Manager runs on the
host, not here. ``init="tini"`` or ``"supervisord"``: the same container under those PID 1s.
docs/LAB-SOURCES.md, "Node shapes", cites each behaviour.

``idle_gpus()``: the small inference node (`health-ok`) whose links train down to Gen1 while a
GPU idles (P8) and run at Gen5 under load (P0); its SGLang server holds GPUs 0 and 1 only, so
GPUs 2 and 3 idle until something opens them.

``no_driver()``: the small inference node's host without the NVIDIA driver: no nvidia-smi, no
/dev/nvidia*, no nvidia module, its GPUs on the bus with no driver bound (as after a driver
removal), and no GPU service.
"""

from __future__ import annotations

from typing import Any

from gpulab.profiles.load import load_profile
from gpulab.profiles.types import Profile

__all__ = ["IDLE_SPEED", "idle_gpus", "no_driver", "rented_container"]

#: PCIe Gen1 (2.5 GT/s): where an idle GPU's link trains down to (public -q captures: P8, Gen1).
IDLE_SPEED = "2.5 GT/s PCIe"


def rented_container(visible: int = 4, init: str = "sleep") -> Profile:
    """`b200-nvl8` as a rented container given its first ``visible`` GPUs, PID 1 ``init``.

    ``init``: ``sleep`` (`sleep infinity`), ``tini`` (`tini -- sleep infinity`, as Docker's
    `--init` and images with tini as their ENTRYPOINT run) or ``supervisord`` (`supervisord -n`
    with sshd as its program, as images with several programs run).
    """
    base = load_profile("b200-nvl8")
    given = sorted(g["bdf"] for g in base.raw["gpus"])[:visible]
    services: list[dict[str, Any]] = []
    for s in base.raw["services"]:
        if s.get("manager") == "systemd":
            continue  # Fabric Manager runs on the host; nothing here has a unit
        if s.get("gpus") and not set(s["gpus"]) <= set(given):
            continue  # a server on a GPU this container was not given runs elsewhere
        services.append(s)
    return load_profile(
        "b200-nvl8",
        overrides={
            "name": f"rented-container-{visible}" + ("" if init == "sleep" else f"-{init}"),
            "hostname": "c-4f7a21",
            "services": services,
            "node": {
                "init": init,
                "container": "docker",
                "kernel_log": "denied",
                "visible_gpus": given,
            },
        },
    )


def idle_gpus() -> Profile:
    """`health-ok` whose GPU links idle at Gen1; SGLang holds GPUs 0 and 1, 2 and 3 idle."""
    base = load_profile("health-ok")
    gpu_bdfs = {g["bdf"] for g in base.raw["gpus"]}
    pci = [
        {**f, "link": {**f["link"], "idle_speed": IDLE_SPEED}}
        if f["bdf"] in gpu_bdfs and f.get("link")
        else f
        for f in base.raw["pci"]
    ]
    held = sorted(gpu_bdfs)[:2]
    services = []
    for s in base.raw["services"]:
        if s.get("kind") == "sglang":
            argv = list(s["argv"])
            argv[argv.index("--tp") + 1] = str(len(held))
            s = {**s, "gpus": held, "argv": argv}
        services.append(s)
    return load_profile(
        "health-ok", overrides={"name": "idle-gpus", "hostname": "gpu-idle", "pci": pci, "services": services}
    )


def no_driver() -> Profile:
    """`health-ok` without the NVIDIA driver: GPUs on the bus, none bound, no NVIDIA tools."""
    base = load_profile("health-ok")
    gpu_bdfs = {g["bdf"] for g in base.raw["gpus"]}
    pci = [{**f, "driver": None} if f["bdf"] in gpu_bdfs else f for f in base.raw["pci"]]
    services = [s for s in base.raw["services"] if s.get("kind") not in ("sglang", "persistenced")]
    kernel_log = [k for k in base.raw["kernel_log"] if "NVRM" not in k["msg"] and "nvidia" not in k["msg"]]
    return load_profile(
        "health-ok",
        overrides={
            "name": "no-driver",
            "hostname": "plain-node",
            "pci": pci,
            "services": services,
            "kernel_log": kernel_log,
            "node": {"nvidia_driver": False},
        },
    )
