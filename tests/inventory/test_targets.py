"""Target URLs, container specs, the pool, exec chains and the testinfra backend."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.backend import GpuhostBackend, make_host
from pytest_gpuhost.exec.targets import (
    TargetOptions,
    TargetPool,
    open_connection,
    parse_container,
    parse_host_url,
)


@pytest.mark.parametrize(
    ("url", "scheme", "user", "host", "port"),
    [
        ("ssh://root@gpu-host", "ssh", "root", "gpu-host", 22),
        ("ssh://198.18.1.2:2222", "ssh", None, "198.18.1.2", 2222),
        ("paramiko://ops@[fd00::2]:22", "ssh", "ops", "fd00::2", 22),
        ("local://", "local", None, "localhost", None),
        ("docker://app@sglang-1", "docker", "app", "sglang-1", None),
        ("kubectl://pod-1?container=main&namespace=gpu", "kubectl", None, "pod-1", None),
    ],
)
def test_parse_host_url(url, scheme, user, host, port):
    spec = parse_host_url(url)
    assert (spec.scheme, spec.user, spec.hostname, spec.port) == (scheme, user, host, port)
    assert spec.url == url and spec.name


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("gpu-host", "no scheme"),
        ("ftp://host", "unknown target scheme 'ftp'"),
        ("ansible://all", "not supported"),
        ("ssh://", "needs a host"),
        ("ssh://root@host:99999", "port '99999'"),
        ("ssh://root@host:abc", "port 'abc'"),
        ("ssh://root:secret@host", "passwords in URLs"),
        ("ssh://bad host", "not a host name"),
        ("ssh://[fd00::1", "unclosed"),
        ("local://somewhere", "local:// takes no host"),
        ("", "empty"),
    ],
)
def test_bad_urls_are_one_line(url, message):
    with pytest.raises(TargetError) as exc:
        parse_host_url(url)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_parse_container():
    assert parse_container("pct:101").prefix() == ["pct", "exec", "101", "--"]
    assert parse_container("lxc:sglang").prefix() == ["lxc-attach", "-n", "sglang", "--"]
    assert parse_container("docker:web").prefix() == ["docker", "exec", "-i", "web"]
    c = parse_container("ssh://root@198.19.1.10")
    assert c.kind == "ssh" and c.target is not None and c.target.hostname == "198.19.1.10"
    for bad, msg in [("pct:abc", "is a number"), ("vm:1", "unknown container kind"), ("pct", "write pct:ID")]:
        with pytest.raises(TargetError, match=msg):
            parse_container(bad)


def _fake_tool(bindir, name, body):
    path = bindir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def test_exec_chains_docker_sudo_pct(tmp_path):
    """The agent starts through argv prefixes; stand-in tools log their argv and exec the rest."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "log"
    _fake_tool(
        bindir, "docker", f'echo "docker $*" | head -c 30 >> {log}; echo >> {log}; shift 3; exec "$@"\n'
    )
    _fake_tool(bindir, "sudo", f'echo "sudo $1 $2" >> {log}; shift 2; exec "$@"\n')
    _fake_tool(bindir, "pct", f'echo "pct $1 $2 $3" >> {log}; shift 3; exec "$@"\n')
    _fake_tool(bindir, "python3", f'exec {sys.executable} "$@"\n')
    path = f"{bindir}:/usr/bin:/bin"
    with open_connection(parse_host_url(f"docker://web?path={path}")) as dc:
        assert dc.name == "web" and dc.run(["echo", "in docker"]).stdout == "in docker\n"
    host = open_connection(parse_host_url(f"local://?path={path}&sudo=1"))
    try:
        assert host.run(["echo", "via sudo"]).stdout == "via sudo\n"
        inner = host.container("pct:101")
        assert inner.name == "local/101" and inner.mode == "agent"
        assert inner.run(["echo", "inside"]).stdout == "inside\n"
        dk = host.container("docker:web")
        assert dk.run(["echo", "dock"]).stdout == "dock\n"
    finally:
        host.close()
    lines = log.read_text().splitlines()
    assert lines[0].startswith("docker exec -i web sh -c ")  # the agent's start finds its Python
    assert lines[1] == "sudo -n --"
    assert "pct exec 101 --" in lines
    assert any(line.startswith("docker exec -i web") for line in lines)


def test_pool_reuses_and_closes(tmp_path):
    pool = TargetPool(TargetOptions(command_timeout=5))
    spec = parse_host_url("local://")
    a = pool.get(spec)
    assert pool.get(spec) is a and a.opts.command_timeout == 5
    assert pool.container(spec) is None
    pid = a.hello["pid"]
    pool.close_all()
    assert pool.connections() == []
    time.sleep(0.1)
    with pytest.raises(FileNotFoundError):
        open(f"/proc/{pid}/cmdline").close()
    pool2 = TargetPool(TargetOptions(command_timeout=7))
    assert pool2.get(spec).opts.command_timeout == 7
    pool2.close_all()


def test_command_timeout_option_applies(tmp_path):
    c = open_connection(parse_host_url("local://"), TargetOptions(command_timeout=0.5))
    try:
        t0 = time.monotonic()
        r = c.run("sleep 30")
        assert r.timed_out and time.monotonic() - t0 < 2
    finally:
        c.close()


def test_testinfra_host_through_our_backend(tmp_path):
    c = open_connection(parse_host_url("local://"))
    seen = []
    c.on_command.append(lambda target, res: seen.append(res.command))
    try:
        host = make_host(c)
        assert isinstance(host.backend, GpuhostBackend) and host.gpuhost_conn is c
        assert host.backend.get_pytest_id() == "local"
        r = host.run("echo %s", "$(touch /tmp/never)")
        assert r.stdout == "$(touch /tmp/never)\n" and r.rc == 0
        (tmp_path / "f").write_bytes(b"\xff data")
        f = host.file(str(tmp_path / "f"))
        assert f.exists and f.is_file and f.content == b"\xff data"
        assert host.check_output("echo ok") == "ok"
        t0 = time.monotonic()
        r = host.run("echo so-far; sleep 30", timeout=0.5)
        assert r.rc == -9 and r.timed_out and r.stdout == "so-far\n" and time.monotonic() - t0 < 2
        assert host.process.filter(pid=c.hello["pid"])
        assert host.exists("sh")
    finally:
        c.close()
    assert "echo '$(touch /tmp/never)'" in seen
    assert all("python3 -c 'import locale" not in cmd for cmd in seen)


def test_testinfra_host_over_ssh(sshd):
    opts = TargetOptions(identity=sshd.identity, known_hosts=sshd.known_hosts)
    c = open_connection(parse_host_url(sshd.url), opts)
    try:
        host = make_host(c)
        assert host.file("/proc/version").contains("Linux")
        assert host.user().name == sshd.user
    finally:
        c.close()


def test_hook_called_when_config_attached(tmp_path):
    calls = []

    class Hook:
        def pytest_gpuhost_command(self, target, result):
            calls.append((target, result.command, result.rc))

    c = open_connection(parse_host_url("local://"))
    c.config = SimpleNamespace(hook=Hook())
    try:
        c.run(["sh", "-c", "exit 3"])
        c.run(["env"], env={"API_TOKEN": "s3cr3t-value"})
    finally:
        c.close()
    assert calls[0] == ("local", "sh -c 'exit 3'", 3)
    assert "s3cr3t-value" not in calls[1][1]


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "1e308", "0", "-5", ""])
def test_url_timeout_must_be_sensible_seconds(value: str) -> None:
    with pytest.raises(TargetError, match=r"^bad target URL .*: timeout="):
        parse_host_url(f"ssh://root@gpu-host?timeout={value}")


def test_url_timeout_in_range_is_kept() -> None:
    assert parse_host_url("ssh://root@gpu-host?timeout=90").query["timeout"] == "90"
