"""Read an inventory through Ansible itself: `ansible-inventory -i SOURCE --list`, as testinfra does.

Ansible reads what no other reader can: inventory plugin configs (`plugin: amazon.aws.aws_ec2`,
`plugin: ansible.builtin.constructed`, ...), inventory directories, scripts, and every group_vars
and host_vars format. Its `--list` JSON (groups with `hosts` and `children`, every host's merged
variables in `_meta.hostvars`) is then read by `formats.read_script`, the reader for that JSON,
with the same checks on names and variables as any inventory.

`--inventory-reader` says who reads (docs/fleet.md):

- `auto` (the default): this project's readers for YAML, INI and JSON files; Ansible for a plugin
  config (a YAML file whose top-level `plugin:` names an inventory plugin), which means nothing
  without it. Nothing is executed on the way: a file is never run as a script.
- `ansible`: Ansible for every source, as `ansible-inventory` reads it: a directory, an
  executable script (run by Ansible), a plugin config.
- `builtin`: never Ansible.

The command is started without a shell, with a timeout, and its errors are one line: Ansible's
own last error line. Where it is not installed the error says how to install it or how to export
the inventory once (`ansible-inventory -i SOURCE --list > fleet.json`) on a machine that has it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from pytest_gpuhost.errors import TargetError

__all__ = ["READERS", "TIMEOUT", "ansible_inventory", "is_plugin_config", "list_inventory"]

READERS = ("auto", "ansible", "builtin")
#: Seconds `ansible-inventory --list` may take (a cloud plugin lists instances over the network).
TIMEOUT = 120.0


def ansible_inventory() -> str | None:
    """Return the `ansible-inventory` to run: on PATH, else beside this Python (a venv), or None."""
    found = shutil.which("ansible-inventory")
    if found:
        return found
    beside = Path(sys.executable).parent / "ansible-inventory"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def is_plugin_config(data: Any) -> bool:
    """Return whether parsed YAML is an inventory plugin config: a mapping whose `plugin` is a name."""
    return isinstance(data, dict) and isinstance(data.get("plugin"), str) and "all" not in data


def _last_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("ERROR", "[ERROR]"))]
    warns = [ln for ln in lines if "WARNING" in ln and ("Unable to parse" in ln or "Failed to parse" in ln)]
    text = (errors or warns or lines or ["no output"])[-1]
    return " ".join(text.split())[:300]


def list_inventory(source: Path, timeout: float = TIMEOUT) -> dict[str, Any]:
    """Return `ansible-inventory -i SOURCE --list` as parsed JSON; TargetError in one line otherwise."""
    exe = ansible_inventory()
    if exe is None:
        raise TargetError(
            f"inventory {source}: reading it needs Ansible's ansible-inventory, which is not installed "
            "(pip install ansible-core, or export it where Ansible is: "
            f"ansible-inventory -i {source} --list > fleet.json)"
        )
    env = dict(os.environ)
    # Ansible fails on a source it cannot parse instead of warning and listing an empty inventory.
    env.update(ANSIBLE_INVENTORY_UNPARSED_FAILED="True", ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED="True")
    env.setdefault("ANSIBLE_NOCOLOR", "1")
    try:
        proc = subprocess.run(
            [exe, "-i", str(source), "--list"],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise TargetError(
            f"inventory {source}: ansible-inventory --list did not finish in {timeout:g} s"
        ) from None
    except OSError as exc:
        raise TargetError(f"inventory {source}: cannot start {exe}: {exc.strerror}") from None
    if proc.returncode != 0:
        raise TargetError(
            f"inventory {source}: ansible-inventory --list exited {proc.returncode}: {_last_error(proc.stderr)}"
        )
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        raise TargetError(f"inventory {source}: ansible-inventory --list printed no JSON") from None
    if not isinstance(data, dict):
        raise TargetError(f"inventory {source}: ansible-inventory --list printed no mapping of groups")
    meta = data.get("_meta")
    if isinstance(meta, dict):
        # Ansible 2.19 adds the serialisation profile it used; it is no group and no variable.
        data["_meta"] = {k: v for k, v in meta.items() if k == "hostvars"}
    return data
