"""systemd unit files for a profile's services.

A service with ``manager: systemd`` becomes ``/etc/systemd/system/NAME.service`` in the machine that
runs it (the host, or container ``ID`` for ``where: container:ID``), wanted by multi-user.target
when ``enabled``. Services with ``manager: none`` get no unit: the lab starts them by hand after
boot, like the B200's SGLang servers. Every service process gets ``GPULAB_SERVICE=NAME`` in its
environment so the in-host tools can tell which profile service they are.

An SGLang server started by hand runs with ``--gpulab-workers orphans`` unless its argv says
otherwise: it starts SGLang's renamed worker children (``sglang::scheduler_TP0``,
``sglang::detokenizer``), and its schedulers outlive it. That is the data-parallel deployment
of sgl-project/sglang#23627: servers in an operator's session, no unit whose cgroup systemd
kills on stop, so workers reparented to PID 1 keep their GPUs (``gpulab/tools/sglang/workers.py``).
Under systemd (``manager: systemd``) the stand-in keeps its default, ``off``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpulab.profiles.types import Service

__all__ = ["service_argv", "unit_name", "unit_text"]

DEFAULT_ARGV = {
    "persistenced": ("/usr/bin/nvidia-persistenced", "--verbose"),
}
BY_HAND_WORKERS = ("--gpulab-workers", "orphans")  # the stand-in's flag for hand-started servers


def unit_name(service: Service) -> str:
    """Return the unit file name of a service (``sglang-qwen.service``)."""
    return service.name if service.name.endswith(".service") else f"{service.name}.service"


def service_argv(service: Service) -> list[str]:
    """Return the command line a service runs with (the profile's argv or the kind's default)."""
    if service.argv:
        argv = list(service.argv)
        flag = BY_HAND_WORKERS[0]
        if (
            service.kind == "sglang"
            and service.manager == "none"
            and not any(a.startswith(flag) for a in argv)
        ):
            argv += BY_HAND_WORKERS
        return argv
    if service.kind in DEFAULT_ARGV:
        return list(DEFAULT_ARGV[service.kind])
    raise ValueError(f"service {service.name}: no argv and no default for kind {service.kind}")


def _quote(arg: str) -> str:
    """Quote one argument for an ExecStart= line (systemd's own quoting rules)."""
    if arg and all(c.isalnum() or c in "-_./:=,+@%" for c in arg):
        return arg.replace("%", "%%")
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$") + '"'


def _exec_line(argv: Iterable[str]) -> str:
    return " ".join(_quote(a) for a in argv)


def unit_text(service: Service, extra: Mapping[str, Any] | None = None) -> str:
    """Return the unit file for ``service``; ``unit`` settings of the profile go into [Service]."""
    argv = service_argv(service)
    desc = {
        "sglang": f"SGLang server {service.name}",
        "persistenced": "NVIDIA Persistence Daemon",
        "decoy": f"{service.name}",
    }.get(service.kind, service.name)
    service_lines: dict[str, str] = {
        "Type": "simple",
        "ExecStart": _exec_line(argv),
        "Environment": f"GPULAB_SERVICE={service.name}",
        "Restart": "no",
    }
    if service.kind == "sglang":
        service_lines["WorkingDirectory"] = "/root"
    for key, value in dict(service.unit).items():
        service_lines[str(key)] = str(value)
    for key, value in dict(extra or {}).items():
        service_lines[str(key)] = str(value)
    lines = [
        "# gpulab: generated from the host profile",
        "[Unit]",
        f"Description={desc}",
        "After=network.target",
        "",
        "[Service]",
    ]
    lines += [f"{k}={v}" for k, v in service_lines.items()]
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)
