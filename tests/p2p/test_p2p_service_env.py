"""The service's own NCCL settings, read as systemd and the kernel give them (no host needed).

The EnvironmentFile= cases follow src/basic/env-file.c's states (pytest_gpuhost/modules/env_file.py);
the rest is `systemctl show` and /proc/PID/environ as they print them.
"""

from __future__ import annotations

import pytest

from pytest_gpuhost.modules import env_file, service_env
from pytest_gpuhost.modules.service_env import ServiceEnv, Setting


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("NCCL_P2P_DISABLE=1\n", {"NCCL_P2P_DISABLE": "1"}),
        ("A=1", {"A": "1"}),  # no final newline
        ("  A = 1  \n", {"A": "1"}),  # blanks around key and value
        ("A=\n", {"A": ""}),
        ("# A=1\n; B=2\n  # C=3\n", {}),  # comments, indented too
        ("A\nB=2\n", {"B": "2"}),  # a line without '=' sets nothing
        ('A="x y" \n', {"A": "x y"}),
        ("A='x \\ y'\n", {"A": "x \\ y"}),  # no escapes in single quotes
        ('A="a\\$b\\"c\\\\d\\ne"\n', {"A": 'a$b"c\\d\\ne'}),  # backslash kept before other characters
        ('A="two\nlines"\n', {"A": "two\nlines"}),
        ("A=one\\\ntwo\n", {"A": "onetwo"}),  # continuation: the newline is eaten
        ('A="one\\\ntwo"\n', {"A": "onetwo"}),
        ('A="a"b\n', {"A": "ab"}),  # the value goes on after the closing quote
        ('A="a" "b"\n', {"A": "ab"}),
        ('A=a"b"\n', {"A": 'a"b"'}),  # a quote inside an unquoted value is kept
        ("A=a\\ b\n", {"A": "a b"}),
        ("A=1\nA=2\n", {"A": "2"}),  # later wins
        ("export NCCL_P2P_DISABLE=1\n", {}),  # the key is "export NCCL_P2P_DISABLE": not a name
        ("1A=1\nA-B=2\nA.B=3\n", {}),
        ("A=1\r\nB=2\r\n", {"A": "1", "B": "2"}),  # CRLF
        ("#comment \\\nNCCL_P2P_DISABLE=1\n", {"NCCL_P2P_DISABLE": "1"}),  # v254+: not part of the comment
        ("A=$(reboot)\nB=`id`\n", {"A": "$(reboot)", "B": "`id`"}),  # data, never run
        ('A="unterminated\n', {"A": "unterminated\n"}),
        ("\x00\x1b[2J=1\nA=\x1b]0;x\x07\n", {"A": "\x1b]0;x\x07"}),
        ("=1\n", {}),
    ],
)
def test_env_file_parse(text: str, want: dict[str, str]) -> None:
    assert env_file.parse(text) == want


def test_env_file_parse_garbage_does_not_raise() -> None:
    blob = "".join(chr(c) for c in range(1, 800)) * 3 + "\"\\'=\\"
    assert isinstance(env_file.parse(blob), dict)


SHOW = """\
Environment=GPULAB_SERVICE=sglang-qwen "NCCL_DEBUG=INFO"
UnsetEnvironment=NCCL_P2P_LEVEL OTHER=1
MainPID=4242
ExecStart={ path=/usr/bin/python3 ; argv[]=/usr/bin/python3 -m sglang.launch_server --tp 4 --disable-custom-all-reduce ; ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }
EnvironmentFiles=/etc/default/sglang (ignore_errors=no)
EnvironmentFiles=/etc/sglang/*.env (ignore_errors=yes)
"""


def test_parse_show() -> None:
    got = service_env.parse_show(SHOW)
    assert got["environment"] == {"GPULAB_SERVICE": "sglang-qwen", "NCCL_DEBUG": "INFO"}
    assert got["files"] == [("/etc/default/sglang", False), ("/etc/sglang/*.env", True)]
    assert got["unset"] == ["NCCL_P2P_LEVEL", "OTHER=1"]
    assert got["main_pid"] == 4242
    assert "--disable-custom-all-reduce" in got["exec_start"]


def test_parse_environ_first_of_a_name_counts() -> None:
    data = "PATH=/bin\0NCCL_P2P_DISABLE=1\0NCCL_P2P_DISABLE=0\0junk\0=x\0"
    assert service_env.parse_environ(data) == {"PATH": "/bin", "NCCL_P2P_DISABLE": "1"}


def test_unset_settings_are_not_findings_but_a_process_keeps_its_own() -> None:
    env = ServiceEnv(
        "x.service",
        [
            Setting("NCCL_P2P_DISABLE", "NCCL_P2P_DISABLE=1", "EnvironmentFile=/etc/default/x", "file", True),
            Setting(
                "NCCL_P2P_DISABLE",
                "NCCL_P2P_DISABLE=1",
                "the environment of PID 7 (x.service)",
                "process",
                True,
            ),
            Setting(
                "NCCL_P2P_LEVEL", "NCCL_P2P_LEVEL=LOC (LOC: ...)", "the Environment= of x.service", "unit"
            ),
        ],
    )
    assert [s.kind for s in env.findings] == ["process", "unit"]
    assert env.names_to_unset() == ["NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL"]
    assert "drops it from the next start" in env.findings[0].describe()


def test_shown_escapes_and_clips_node_strings() -> None:
    assert service_env.shown("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert len(service_env.shown("x" * 5000)) == 160


def test_dropin_unsets_only_known_names() -> None:
    text = service_env.dropin_text(["NCCL_P2P_DISABLE"])
    assert "[Service]\nUnsetEnvironment=NCCL_P2P_DISABLE\n" in text
    with pytest.raises(ValueError):
        service_env.dropin_text(["LD_PRELOAD"])
    with pytest.raises(ValueError):
        service_env.dropin_text([])
    assert service_env.dropin_path("sglang-qwen.service") == (
        "/etc/systemd/system/sglang-qwen.service.d/gpuhost-p2p-env.conf"
    )
