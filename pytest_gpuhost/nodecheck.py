"""`gpuhost-nodecheck`: the node health program for Slurm (and Kubernetes), check-only, time-bounded.

Runs the fast check-only subset of suites/health on this node (modules/health/fast.py: the same
agent facts and verdicts, one connection per fact, in parallel) within a time budget counted from
the program's start, prints one line per failed check (`CHECK: VALUE`), and exits

    0  healthy          1  unhealthy (a check failed, or did not finish in the budget)
    2  usage error (a bad option, environment variable or configuration file)

`--slurm-drain` drains the node when it is unhealthy (reason `gpuhost: CHECK: VALUE`) and resumes
it when healthy, only when gpuhost drained it; a node drained by anyone else is never touched
(modules/slurm.py). Slurm runs its HealthCheckProgram with no arguments, so every option can also
come from the environment or a YAML file (docs/nodecheck.md):

    flag            environment                      file key
    --budget S      GPUHOST_NODECHECK_BUDGET         budget
    --slurm-drain   GPUHOST_NODECHECK_SLURM_DRAIN=1  slurm_drain
    --checks A,B    GPUHOST_NODECHECK_CHECKS         checks
    --node-name N   SLURMD_NODENAME, GPUHOST_NODE_NAME  node_name
    --config FILE   GPUHOST_NODECHECK_CONFIG         (default /etc/gpuhost/nodecheck.yaml if present)
                                                     vars: the health thresholds (inventory vars)

A flag wins over the environment, the environment over the file.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.exec.nodename import ENV as NODE_NAME_ENV
from pytest_gpuhost.exec.nodename import check_node_name, safe_host_name
from pytest_gpuhost.exec.targets import MAX_TIMEOUT, TargetOptions, open_connection, parse_host_url
from pytest_gpuhost.modules import slurm
from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import fast as nc
from pytest_gpuhost.redact import printable
from pytest_gpuhost.values import as_bool

__all__ = ["DEFAULT_BUDGET", "DEFAULT_CONFIG", "Config", "UsageError", "load_config", "main"]

PROG = "gpuhost-nodecheck"
DEFAULT_BUDGET = 10.0
DEFAULT_CONFIG = "/etc/gpuhost/nodecheck.yaml"
EXIT_MARGIN = 0.25  # seconds kept at the end of the budget to print and exit
SLURM_SHARE = 0.25  # of the budget kept for scontrol (at most SLURM_MAX seconds) with --slurm-drain
SLURM_MAX = 2.5
#: PATH when the program gets none: slurmd runs HealthCheckProgram with SLURMD_NODENAME as its only
#: environment variable (seen with Slurm 22.05 in the lab: no PATH, no SLURM_CONF); the agents and
#: scontrol it starts need nvidia-smi, dmesg, python3 and scontrol found where packages put them.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FILE_KEYS = ("budget", "slurm_drain", "checks", "node_name", "vars", "k8s_label", "k8s_cordon")


class UsageError(GpuhostError):
    """A bad option, environment variable or configuration value; exit status 2."""


@dataclass
class Config:
    budget: float = DEFAULT_BUDGET
    slurm_drain: bool = False
    checks: list[str] = field(default_factory=nc.default_checks)
    node_name: str = ""
    node_name_from: str = "host name"
    vars: dict[str, Any] = field(default_factory=dict)
    k8s_label: bool = False
    k8s_cordon: bool = False
    source: str = ""


def started_at() -> float:
    """Return the time.monotonic() at which this process started (the budget counts from there).

    From /proc/self/stat (field 22, start time in clock ticks since boot) against CLOCK_BOOTTIME;
    the interpreter's own start then counts in the budget too. Falls back to now.
    """
    now = time.monotonic()
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age if 0 <= age < 60 else now


def _budget(raw: Any, where: str) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise UsageError(f"{where}={raw!r} is not a number of seconds; give e.g. 10") from None
    if not 1.0 <= value <= MAX_TIMEOUT:  # false for NaN
        raise UsageError(f"{where}={raw!r}: give at least 1 second (the default is {DEFAULT_BUDGET:g})")
    return value


def _flag(raw: Any, where: str) -> bool:
    try:
        return as_bool(raw)
    except ValueError:
        raise UsageError(f"{where}={raw!r}: give 1 or 0 (yes/no, true/false)") from None


def _checks(raw: Any, where: str) -> list[str]:
    items = raw if isinstance(raw, list) else str(raw).replace(",", " ").split()
    names = [str(i).strip() for i in items if str(i).strip()]
    unknown = [n for n in names if n not in hm.CHECKS]
    if unknown or not names:
        raise UsageError(
            f"{where}={raw!r}: {'unknown check ' + repr(unknown[0]) if unknown else 'no check named'}; "
            f"choose from {', '.join(nc.default_checks())}"
        )
    return names


def _read_file(path: str, explicit: bool) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        if explicit:
            raise UsageError(f"configuration file {path}: no such file")
        return {}
    import yaml  # only when there is a file

    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UsageError(f"configuration file {path}: {' '.join(str(exc).split())[:200]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"configuration file {path}: expected a mapping of {', '.join(FILE_KEYS)}")
    unknown = [k for k in data if k not in FILE_KEYS]
    if unknown:
        raise UsageError(
            f"configuration file {path}: unknown key {unknown[0]!r}; known: {', '.join(FILE_KEYS)}"
        )
    return data


def load_config(args: argparse.Namespace, env: Mapping[str, str]) -> Config:
    """Merge flags, environment and file (in that order of precedence); raise UsageError."""
    path = args.config or env.get("GPUHOST_NODECHECK_CONFIG") or DEFAULT_CONFIG
    explicit = bool(args.config or env.get("GPUHOST_NODECHECK_CONFIG"))
    data = _read_file(path, explicit)
    where = f"{path}: "
    cfg = Config(source=path if data else "")
    if "budget" in data:
        cfg.budget = _budget(data["budget"], where + "budget")
    if "slurm_drain" in data:
        cfg.slurm_drain = _flag(data["slurm_drain"], where + "slurm_drain")
    for key in ("k8s_label", "k8s_cordon"):
        if key in data:
            setattr(cfg, key, _flag(data[key], where + key))
    if "checks" in data:
        cfg.checks = _checks(data["checks"], where + "checks")
    if "vars" in data:
        if not isinstance(data["vars"], dict):
            raise UsageError(f"{where}vars: expected a mapping of health thresholds (inventory variables)")
        cfg.vars = dict(data["vars"])
    if env.get("GPUHOST_NODECHECK_BUDGET"):
        cfg.budget = _budget(env["GPUHOST_NODECHECK_BUDGET"], "$GPUHOST_NODECHECK_BUDGET")
    if env.get("GPUHOST_NODECHECK_SLURM_DRAIN"):
        cfg.slurm_drain = _flag(env["GPUHOST_NODECHECK_SLURM_DRAIN"], "$GPUHOST_NODECHECK_SLURM_DRAIN")
    if env.get("GPUHOST_NODECHECK_CHECKS"):
        cfg.checks = _checks(env["GPUHOST_NODECHECK_CHECKS"], "$GPUHOST_NODECHECK_CHECKS")
    if args.budget is not None:
        cfg.budget = _budget(args.budget, "--budget")
    if args.slurm_drain:
        cfg.slurm_drain = True
    if args.k8s_label:
        cfg.k8s_label = True
    if args.k8s_cordon:
        cfg.k8s_label = cfg.k8s_cordon = True
    if args.checks is not None:
        cfg.checks = _checks(args.checks, "--checks")
    try:
        hm.Thresholds.from_vars(cfg.vars)
    except hm.ThresholdError as exc:
        raise UsageError(f"{where}vars: {exc}") from None
    cfg.node_name, cfg.node_name_from = _node_name(args.node_name, data.get("node_name"), env, where)
    return cfg


def _node_name(flag: str | None, from_file: Any, env: Mapping[str, str], where: str) -> tuple[str, str]:
    """The node's name: --node-name, $SLURMD_NODENAME, $GPUHOST_NODE_NAME, the file's, the host name."""
    for value, origin in (
        (flag, "--node-name"),
        (env.get("SLURMD_NODENAME"), "$SLURMD_NODENAME"),
        (env.get(NODE_NAME_ENV), f"${NODE_NAME_ENV}"),
        (from_file, where + "node_name"),
    ):
        if value:
            try:
                return check_node_name(str(value), origin), origin
            except GpuhostError as exc:
                raise UsageError(str(exc)) from None
    return safe_host_name(socket.gethostname()), "host name"


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2, no usage dump
        raise _Usage(message)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog=PROG,
        description="Check this GPU node (fast, check-only) within a time budget; optionally drain it in Slurm.",
        epilog="Exit status: 0 healthy, 1 unhealthy, 2 usage error. Every option also comes from the "
        "environment or a configuration file: see docs/nodecheck.md.",
    )
    ap.add_argument(
        "--budget", metavar="S", help=f"seconds the whole check may take (default {DEFAULT_BUDGET:g})"
    )
    ap.add_argument(
        "--slurm-drain", action="store_true", help="drain when unhealthy, resume what gpuhost drained"
    )
    ap.add_argument("--checks", metavar="A,B", help="checks to run (default: every fast health check)")
    ap.add_argument(
        "--node-name", metavar="NAME", help="this node's name (default $SLURMD_NODENAME, host name)"
    )
    ap.add_argument(
        "--config", metavar="FILE", help=f"YAML configuration (default {DEFAULT_CONFIG} if present)"
    )
    ap.add_argument(
        "--k8s-label", action="store_true", help="label the Kubernetes node (modules/kube_node.py)"
    )
    ap.add_argument("--k8s-cordon", action="store_true", help="with --k8s-label: cordon/uncordon as well")
    return ap


def _say(lines: Sequence[str], stream: Any = None) -> None:
    out = stream or sys.stdout
    for line in lines:
        print(printable(line), file=out)
    out.flush()


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the node check; return the exit status (0 healthy, 1 unhealthy, 2 usage error)."""
    start = started_at()
    env = os.environ if env is None else env
    ap = _parser()
    try:
        args = ap.parse_args(argv)
        cfg = load_config(args, env)
    except (_Usage, UsageError) as exc:
        _say([f"{PROG}: {exc}"], sys.stderr)
        return 2
    if not os.environ.get("PATH"):
        os.environ["PATH"] = DEFAULT_PATH  # inherited by the agents and scontrol
    deadline = start + cfg.budget - EXIT_MARGIN
    share = min(SLURM_MAX, SLURM_SHARE * cfg.budget)  # for scontrol, and again for the Kubernetes API
    reserve = share * (int(cfg.slurm_drain) + int(cfg.k8s_label))
    conns: list[Any] = []
    lock = threading.Lock()

    def keep(conn: Any) -> None:
        with lock:
            conns.append(conn)

    spec = parse_host_url("local://", node_name=cfg.node_name)
    opts = TargetOptions(connect_timeout=max(1.0, cfg.budget))
    result = nc.run_checks(
        lambda: open_connection(spec, opts),
        cfg.checks,
        hm.Thresholds.from_vars(cfg.vars),
        deadline - reserve,
        cfg.budget,
        on_conn=keep,
    )
    failures = result.failures()
    lines = [f"{check}: {value}" for check, value in failures]
    if cfg.slurm_drain:
        lines.append(_slurm(cfg, result, failures, deadline - (share if cfg.k8s_label else 0.0)))
    if cfg.k8s_label:
        lines.append(_kube(cfg, failures, deadline))
    took = time.monotonic() - start
    state = "healthy" if not failures else f"unhealthy ({len(failures)} failure(s))"
    lines.append(
        f"{PROG}: {cfg.node_name} {state}: {len(result.verdicts)} of {len(cfg.checks)} checks judged "
        f"in {took:.2f} s (budget {cfg.budget:g} s)"
    )
    _say(lines)
    _close(conns, deadline + EXIT_MARGIN / 2)
    return 0 if not failures else 1


def _slurm(cfg: Config, result: nc.NodeResult, failures: list[tuple[str, str]], deadline: float) -> str:
    """Drain or resume the node (modules/slurm.py rules); return one line saying what happened."""
    first = f"{failures[0][0]}: {failures[0][1]}" if failures else None
    conn = result.live
    try:
        if conn is None:
            conn = open_connection(parse_host_url("local://", node_name=cfg.node_name))
        left = deadline - time.monotonic()
        node = slurm.read_node(conn, cfg.node_name, timeout=max(0.2, left / 2))
        p = slurm.plan(node, first)
        slurm.act(conn, p, timeout=max(0.2, deadline - time.monotonic()))
    except GpuhostError as exc:
        return f"slurm: {exc}"
    return f"slurm: {p.why}" if p.changes else f"slurm: nothing to do: {p.why}"


def _kube(cfg: Config, failures: list[tuple[str, str]], deadline: float) -> str:
    try:
        from pytest_gpuhost.modules import kube_node
    except ImportError as exc:  # the optional kubernetes client
        return f"k8s: not available ({exc}): pip install 'pytest-gpuhost[k8s]'"
    try:
        out = kube_node.apply_health(
            cfg.node_name, [f"{c}: {v}" for c, v in failures], cordon=cfg.k8s_cordon, deadline=deadline
        )
    except GpuhostError as exc:
        return f"k8s: {exc}"
    said = list(out.actions) + [f"left alone: {why}" for why in out.left]
    return "k8s: " + ("; ".join(said) if said else "nothing to do")


def _close(conns: list[Any], by: float) -> None:
    """Close the connections, waiting no later than `by` (an agent stuck in the kernel is left)."""

    def close_all() -> None:
        for c in conns:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - every connection gets its close
                pass

    t = threading.Thread(target=close_all, name="nodecheck-close", daemon=True)
    t.start()
    t.join(max(0.0, by - time.monotonic()))


def run() -> None:
    """Console-script entry point: exit at once with main's status (threads still out are dropped)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
