"""Inventory variables: Ansible's connection variables mapped onto a TargetSpec, and typo warnings.

A host's URL is `gpuhost_url` when set, else built from the Ansible variables (when two names of
one setting are both set, the `ansible_ssh_*` one wins, as Ansible's ssh plugin reads its
variables in order and keeps the last it finds):

- address: `ansible_host` / `ansible_ssh_host` (default the inventory name);
- port: `ansible_port` / `ansible_ssh_port`; user: `ansible_user` / `ansible_ssh_user`;
- key: `ansible_private_key_file` / `ansible_ssh_private_key_file` -> `?identity=PATH` (`~` expanded);
- `ansible_become: true` -> `?sudo=1` (we run `sudo -n`, so only `ansible_become_method: sudo`
  and `ansible_become_user: root` are accepted; anything else is refused, never ignored);
- `ansible_connection`: `ssh`/`paramiko`/`smart` (default), `local`, `docker`, `podman`, `lxd`, `kubectl`;
- `ansible_python_interpreter` -> `?python=` (Ansible's `auto*` values mean discovery: none named).

`container` (or `gpuhost_container`) names the host's service container. A variable whose name is
close to a known one (difflib) or that starts with `gpuhost_` without being ours is reported by
`KeyCheck`, once per name, with the first host or group and file that used it.
"""

from __future__ import annotations

import difflib
import os
import re
import urllib.parse
from collections.abc import Iterable
from typing import Any

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.targets import TargetSpec, parse_container, parse_host_url

__all__ = ["ANSIBLE_VARS", "GPUHOST_VARS", "KeyCheck", "check_var_name", "make_spec"]

#: Ansible variables this loader reads.
ANSIBLE_VARS = frozenset(
    {
        "ansible_host", "ansible_ssh_host", "ansible_port", "ansible_ssh_port", "ansible_user",
        "ansible_ssh_user", "ansible_private_key_file", "ansible_ssh_private_key_file",
        "ansible_become", "ansible_become_user", "ansible_become_method", "ansible_connection",
        "ansible_python_interpreter", "ansible_kubectl_namespace", "ansible_kubectl_container",
    }
)  # fmt: skip
#: Ansible variables an Ansible inventory may carry that we do not use (known, so not typos).
_ANSIBLE_OTHER = frozenset(
    {
        "ansible_password", "ansible_ssh_pass", "ansible_become_password", "ansible_become_pass",
        "ansible_become_exe", "ansible_become_flags", "ansible_ssh_common_args",
        "ansible_ssh_extra_args", "ansible_sftp_extra_args", "ansible_scp_extra_args",
        "ansible_ssh_pipelining", "ansible_ssh_executable", "ansible_shell_type",
        "ansible_shell_executable", "ansible_timeout", "ansible_network_os", "ansible_ssh_timeout",
    }
)  # fmt: skip
#: Our own variables.
GPUHOST_VARS = frozenset(
    {"gpuhost_url", "gpuhost_container", "container", "gpu_count", "expected_gpus", "groups"}
)

_CONNECTIONS = {
    "ssh": "ssh", "paramiko": "ssh", "smart": "ssh", "ansible.builtin.ssh": "ssh",
    "ansible.builtin.paramiko_ssh": "ssh", "paramiko_ssh": "ssh", "local": "local",
    "ansible.builtin.local": "local", "docker": "docker", "community.docker.docker": "docker",
    "podman": "podman", "containers.podman.podman": "podman", "lxd": "lxc",
    "community.general.lxd": "lxc", "kubectl": "kubectl", "kubernetes.core.kubectl": "kubectl",
}  # fmt: skip
_VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


def check_var_name(key: object, where: str, owner: str) -> None:
    """Refuse a variable name that is not an identifier (Ansible's rule), naming file and owner."""
    if not isinstance(key, str) or not _VAR_NAME.match(key):
        raise TargetError(
            f"{where}: {owner} has variable {key!r}: a variable name is letters, digits and '_', not starting with a digit"
        )


class KeyCheck:
    """Collect one warning per misspelled-looking variable name, with where it was first seen."""

    def __init__(self, extra_known: Iterable[str] = ()) -> None:
        self.known = ANSIBLE_VARS | _ANSIBLE_OTHER | GPUHOST_VARS | frozenset(extra_known)
        self._verdict: dict[str, str | None] = {}  # name -> warning text, or None when fine
        self._first: dict[str, str] = {}
        self._count: dict[str, int] = {}

    def seen(self, key: str, owner: str, where: str) -> bool:
        """Note that `owner` (e.g. "host 'gpu-01'") in `where` sets `key`; return whether the name is fine."""
        verdict = self._verdict.get(key, "")
        if verdict == "":
            verdict = self._verdict[key] = self._judge(key)
        if verdict is None:
            return True
        self._count[key] = self._count.get(key, 0) + 1
        self._first.setdefault(key, f"{where}: {owner}")
        return False

    def _judge(self, key: str) -> str | None:
        if key in self.known:
            return None
        close = difflib.get_close_matches(key, self.known, n=1, cutoff=0.85)
        if close:
            return f"did you mean {close[0]!r}?"
        if key.startswith("gpuhost_"):
            ours = sorted(k for k in self.known if k.startswith("gpuhost_"))
            return f"gpuhost_ variables are {', '.join(ours)}."
        if key.startswith("ansible_"):
            prefix = difflib.get_close_matches(key, self.known, n=1, cutoff=0.8)
            return f"did you mean {prefix[0]!r}?" if prefix else None
        return None

    def warnings(self) -> list[str]:
        """Return the warnings, one line per variable name, in the order first seen."""
        out = []
        for key, first in self._first.items():
            more = self._count[key] - 1
            also = f" (and {more:,} more place{'s' if more > 1 else ''})" if more else ""
            out.append(f"{first} sets unknown variable {key!r}{also}: {self._verdict[key]} It is kept as is.")
        return out


def _last(hv: dict[str, Any], *names: str) -> Any:
    """Return the value of the last of `names` that is set (Ansible's order for aliases)."""
    value = None
    for n in names:
        if hv.get(n) is not None:
            value = hv[n]
    return value


def _flag(value: Any, key: str, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "yes", "true", "on", "y"):
        return True
    if text in ("0", "no", "false", "off", "n", ""):
        return False
    raise TargetError(f"{where}: {key}={value!r}: expected true or false")


def _text(value: Any, key: str, where: str) -> str:
    if isinstance(value, dict | list | bool) or value is None:
        raise TargetError(f"{where}: {key}={value!r}: expected a string")
    text = str(value)
    if "{{" in text or "{%" in text:
        raise TargetError(
            f"{where}: {key}={text!r}: Jinja templates are not expanded here; write the value itself"
        )
    return text


def _url(name: str, hv: dict[str, Any], where: str) -> tuple[str, dict[str, str]]:
    """Return the target URL and query options the Ansible variables of one host ask for."""
    query: dict[str, str] = {}
    conn = str(hv.get("ansible_connection") or "ssh")
    scheme = _CONNECTIONS.get(conn)
    if scheme is None:
        raise TargetError(
            f"{where}: ansible_connection={conn!r} is not supported: use one of ssh, paramiko, local, docker, podman, lxd, kubectl"
        )
    key = _last(hv, "ansible_private_key_file", "ansible_ssh_private_key_file")
    if key is not None:
        query["identity"] = os.path.expanduser(_text(key, "ansible_ssh_private_key_file", where))
    if _flag(hv.get("ansible_become", False), "ansible_become", where):
        method = str(hv.get("ansible_become_method") or "sudo")
        if method not in ("sudo", "ansible.builtin.sudo"):
            raise TargetError(
                f"{where}: ansible_become_method={method!r} is not supported: only sudo (run as sudo -n)"
            )
        user = str(hv.get("ansible_become_user") or "root")
        if user != "root":
            raise TargetError(f"{where}: ansible_become_user={user!r} is not supported: only root (sudo -n)")
        query["sudo"] = "1"
    python = hv.get("ansible_python_interpreter")
    if python is not None:
        py = _text(python, "ansible_python_interpreter", where)
        if not py.startswith("auto"):  # Ansible's auto*: discovery, which the agent's start does
            query["python"] = py
    if scheme == "local":
        return "local://", query
    address = _text(_last(hv, "ansible_host", "ansible_ssh_host") or name, "ansible_host", where)
    user = _last(hv, "ansible_user", "ansible_ssh_user")
    userinfo = (
        urllib.parse.quote(_text(user, "ansible_user", where), safe="") + "@" if user is not None else ""
    )
    if scheme == "kubectl":
        for var, opt in (
            ("ansible_kubectl_namespace", "namespace"),
            ("ansible_kubectl_container", "container"),
        ):
            if hv.get(var) is not None:
                query[opt] = _text(hv[var], var, where)
        return f"kubectl://{address}", query
    if scheme != "ssh":
        return f"{scheme}://{userinfo}{address}", query
    port = _last(hv, "ansible_port", "ansible_ssh_port")
    portinfo = ""
    if port is not None:
        ptext = str(port).strip()
        if isinstance(port, bool) or not ptext.isdigit() or not 0 < int(ptext) < 65536:
            raise TargetError(f"{where}: ansible_port={port!r}: expected a port number from 1 to 65535")
        portinfo = f":{int(ptext)}"
    if ":" in address and not address.startswith("["):
        address = f"[{address}]"
    return f"ssh://{userinfo}{address}{portinfo}", query


def make_spec(name: str, hv: dict[str, Any], source: str) -> TargetSpec:
    """Build one host's TargetSpec from its merged variables; errors name `source` and the host."""
    where = f"{source}: host {name!r}"
    given = hv.get("gpuhost_url")
    url, query = _url(name, hv, where)
    if given:
        url = _text(given, "gpuhost_url", where)
        have = urllib.parse.urlsplit(url).query if "?" in url else ""
        query = {
            k: v for k, v in query.items() if k in ("sudo", "identity", "python") and f"{k}=" not in have
        }
    if query:
        url += ("&" if "?" in url else "?") + urllib.parse.urlencode(query, safe="/")
    try:
        spec = parse_host_url(url, name=name)
    except TargetError as exc:
        raise TargetError(f"{where}: {exc}") from None
    spec.vars = hv
    container = hv.get("container") or hv.get("gpuhost_container")
    if container:
        try:
            spec.container = parse_container(_text(container, "container", where))
        except TargetError as exc:
            raise TargetError(f"{where}: {exc}") from None
    return spec
