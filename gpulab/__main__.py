"""Command line of the lab: ``python -m gpulab up|down|list|ssh|pytest-args|record|<fault> ...``."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from gpulab.host.lab import Lab, LabError, LabHost
from gpulab.profiles.python_variants import SHAPES, node_python_profile

FAULTS = {
    "cut-link": ("take the host's link down", LabHost.cut_link),
    "heal-link": ("bring the host's link back", LabHost.heal_link),
    "freeze": ("freeze every process of the host (cgroup freezer)", LabHost.freeze),
    "thaw": ("thaw a frozen host", LabHost.thaw),
    "kill-sshd": ("kill the host's sshd and keep it down", LabHost.kill_sshd),
    "start-sshd": ("start the host's sshd again", LabHost.start_sshd),
    "fill-disk": ("fill the host's root filesystem", LabHost.fill_disk),
    "free-disk": ("undo fill-disk", LabHost.free_disk),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m gpulab", description="Emulated GPU hosts for pytest-gpuhost."
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    up = sub.add_parser("up", help="boot a lab host from a profile")
    up.add_argument("profile", help="profile name (fixtures/profiles/NAME.yaml) or file")
    up.add_argument("--name", help="host name (default: the profile's name)")
    up.add_argument(
        "--delay-ms",
        type=int,
        default=0,
        help="delay each way on the host's link (netem, else a user-space delay of its SSH port)",
    )
    up.add_argument("--loss-pct", type=float, default=0, help="netem loss on the host's link")
    up.add_argument(
        "--data-scale", choices=("small", "bench"), default="small", help="size of the profile's file trees"
    )
    up.add_argument(
        "--node-python",
        choices=SHAPES,
        help="the node's python3 (gpulab/host/pythons.py); its services run under their own interpreter",
    )
    up.add_argument(
        "--no-services",
        action="store_true",
        help="with --node-python: no services, so no Python runs on the node",
    )
    down = sub.add_parser("down", help="tear a lab host down")
    g = down.add_mutually_exclusive_group(required=True)
    g.add_argument("name", nargs="?")
    g.add_argument("--all", action="store_true", help="every lab host and every leftover of a crashed run")
    down.add_argument(
        "--match", default="", metavar="PREFIX", help="with --all: only names starting with PREFIX"
    )
    sub.add_parser("list", help="list lab hosts")
    ssh = sub.add_parser(
        "ssh", help="run a command on a host over SSH, print its output, return its exit code"
    )
    ssh.add_argument("name")
    ssh.add_argument("--container", type=int, metavar="ID", help="run it in container ID (its own sshd)")
    ssh.add_argument("--timeout", type=float, default=120)
    ssh.add_argument("command", nargs="*", help="-- COMMAND...")
    for name, helptext in (
        ("pytest-args", "print the plugin options that target the host (and its container)"),
        ("record", "print the host's record as JSON lines"),
        ("reboot", "kill the host's PID 1, reset sysfs to the boot state, boot again (enabled units start)"),
        ("reset", "reboot into a pristine host (installed files are gone)"),
    ):
        sub.add_parser(name, help=helptext).add_argument("name")
    for name, (helptext, _) in FAULTS.items():
        sub.add_parser(name, help=helptext).add_argument("name")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run one lab command; errors are one line on stderr and exit status 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    tail: list[str] | None = None
    if argv and argv[0] == "ssh" and "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    if tail is not None:
        args.command = tail
    lab = Lab()
    try:
        if args.cmd == "up":
            profile: Any = args.profile
            if args.node_python:
                profile = node_python_profile(
                    args.node_python, services=not args.no_services, base=args.profile
                )
            h = lab.up(
                profile,
                name=args.name,
                delay_ms=args.delay_ms,
                loss_pct=args.loss_pct,
                data_scale=args.data_scale,
            )
            t = h.meta.get("boot_timings", {})
            print(f"{h.name} up at {h.address} in {h.meta.get('up_s')} s (boot {t.get('total')} s)")
            print("  " + shlex.join(h.pytest_args()))
            return 0
        if args.cmd == "down":
            if args.all:
                lab.check()
                removed = lab.down_all(match=args.match)
                print("removed: " + (", ".join(removed) if removed else "nothing"))
            else:
                lab.check()
                lab.down(args.name)
                print(f"{args.name} down")
            return 0
        if args.cmd == "list":
            for name in lab.names():
                h = lab.get(name)
                state = h.system_state(timeout=3) if h.is_running() else "down"
                print(f"{h.name:<24} {h.address:<14} {h.profile.name:<20} {state}")
            return 0
        h = lab.get(args.name)
        if args.cmd == "ssh":
            cmd = list(args.command)
            if not cmd:
                raise LabError("ssh: give a command after --")
            line = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
            try:
                p = h.ssh(line, timeout=args.timeout, cid=args.container)
            except subprocess.TimeoutExpired:
                raise LabError(f"ssh {h.name}: no answer within {args.timeout:g} s") from None
            sys.stdout.write(p.stdout)
            sys.stderr.write(p.stderr)
            return p.returncode
        if args.cmd == "pytest-args":
            print(shlex.join(h.pytest_args()))
            return 0
        if args.cmd == "record":
            for entry in h.record():
                print(json.dumps(entry, sort_keys=True))
            return 0
        if args.cmd in ("reboot", "reset"):
            secs = h.reboot() if args.cmd == "reboot" else h.reset()
            print(f"{h.name} {'rebooted' if args.cmd == 'reboot' else 'reset'} in {secs:.2f} s")
            return 0
        FAULTS[args.cmd][1](h)
        print(f"{h.name}: {args.cmd} done")
        return 0
    except LabError as e:
        print(f"gpulab: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gpulab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
