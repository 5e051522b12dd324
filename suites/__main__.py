"""`python -m gpuhost_suites`: where the installed suites and example manifests are, and how to run them.

`python -m gpuhost_suites manifest NAME` prints the path of a shipped example manifest
(`b200-node-backup`), to copy and edit: `cp "$(python -m gpuhost_suites manifest b200-node-backup)" node.yaml`.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = __spec__.name.rpartition(".")[0] if __spec__ else "gpuhost_suites"
SUITES = {
    "health": "--host=ssh://root@gpu-node --check-only",
    "p2p": "--host=ssh://root@gpu-host --container=pct:101 --check-only",
    "decommission": "--host=ssh://root@node --manifest=node.yaml --backup-dir=backups/node --check-only",
    "accept": "--host=ssh://root@node --order=order.yaml",
}


def manifests_dir() -> Path:
    """Return the directory of the example manifests (the wheel's copy, else the checkout's)."""
    shipped = HERE / "manifests"
    return shipped if shipped.is_dir() else HERE.parent / "fixtures" / "manifests"


def main(argv: list[str]) -> int:
    if argv[:1] == ["manifest"] and len(argv) == 2:
        path = manifests_dir() / f"{Path(argv[1]).stem}.yaml"
        if not path.is_file():
            names = ", ".join(sorted(p.stem for p in manifests_dir().glob("*.yaml")))
            print(f"gpuhost_suites: no example manifest {argv[1]!r}; there are: {names}", file=sys.stderr)
            return 2
        print(path)
        return 0
    if argv:
        print("usage: python -m gpuhost_suites [manifest NAME]", file=sys.stderr)
        return 2
    for name, example in SUITES.items():
        print(f"{name:13} {HERE / name}")
        print(f"{'':13} pytest --pyargs {PACKAGE}.{name} {example}")
    print(f"{'manifests':13} {manifests_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
