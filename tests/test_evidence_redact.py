"""Redaction: patterns, remembered values, and a canary secret that no output file may contain."""

from __future__ import annotations

import os
import secrets

import pytest

# Imported here, outside pytester's inline runs (see test_plugin_fixtures.py).
import pytest_gpuhost.exec.targets  # noqa: F401
from pytest_gpuhost.redact import MASK, redact, redact_argv, redact_env, redact_obj, secret_name


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        ("export AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE"),
        ("key ASIAY34FZKBOKMUTVV7A in use", "ASIAY34FZKBOKMUTVV7A"),
        (
            "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        ),
        ('curl -H "Authorization: Bearer eyJhbGciOi.x.y" http://h', "eyJhbGciOi.x.y"),
        ("https://deploy:s3cr3tPW@git.example/repo.git", "s3cr3tPW"),
        ("mysql --password=hunter2x -u root", "hunter2x"),
        ("tool --token Abc123xyz --verbose", "Abc123xyz"),
        ("api_key: 'k-123-456'", "k-123-456"),
        ('{"secret": "v4lue-9"}', "v4lue-9"),
        ("GITHUB_TOKEN=ghp_abcdef0123 make", "ghp_abcdef0123"),
    ],
)
def test_patterns_hide_credentials(text: str, hidden: str) -> None:
    out = redact(text)
    assert hidden not in out and MASK in out


def test_ordinary_text_is_left_alone() -> None:
    for text in (
        "monkey=3 keyboard=us",
        "0000:3b:00.0 nvidia DMA-FQ",
        "systemctl is-enabled sglang: enabled",
    ):
        assert redact(text) == text
    assert not secret_name("MONKEY") and not secret_name("PATH") and secret_name("SecretAccessKey")


def test_env_argv_objects_and_remembered_values() -> None:
    value = "Zq9-" + secrets.token_hex(6)
    assert redact_env({"DB_PASSWORD": value, "HOME": "/root"}) == {"DB_PASSWORD": MASK, "HOME": "/root"}
    assert value not in redact(f"it printed {value} bare"), "a value seen under a secret name is remembered"
    other = "Yx8-" + secrets.token_hex(6)
    assert redact_argv(["login", "--password", other, "-v"]) == ["login", "--password", MASK, "-v"]
    assert redact_obj({"token": "abc", "nested": [f"password={other}"]}) == {
        "token": MASK,
        "nested": [f"password={MASK}"],
    }


CANARY_SUITE = """
import os
from pytest_gpuhost.run.remediation import Action, Check

SECRET = os.environ["GPUHOST_CANARY"]

def test_leaky(target, evidence, remediate):
    r = target.conn.run(["sh", "-c", 'echo "token=$MY_TOKEN"; echo "$MY_TOKEN"; echo "$1" >&2', "sh",
                         "--password=" + SECRET], env={"MY_TOKEN": SECRET})
    assert r.rc == 0 and r.stdout.count(SECRET) == 2
    target.conn.run(["printf", "%s\\\\n", "--token", SECRET, "https://admin:" + SECRET + "@example.invalid/x"])
    evidence.state("creds", {"aws_secret_access_key": SECRET, "header": "Authorization: Bearer " + SECRET})
    evidence.note("password=" + SECRET)
    print("the operator's token=" + SECRET)
    remediate(name="rotate", check=lambda: Check(False, "token=" + SECRET, state={"password": SECRET}),
              plan=lambda b: [Action("set it", "chpasswd password=" + SECRET)], fix=lambda a, b: None)

def test_assert_shows_value():
    print(SECRET)
    assert SECRET == "something else"
"""


def test_canary_secret_reaches_no_output_file(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    canary = "Cn4ry-" + secrets.token_hex(8)
    monkeypatch.setenv("GPUHOST_CANARY", canary)
    pytester.makepyfile(test_canary=CANARY_SUITE)
    result = pytester.runpytest("--host=local://", "--report-name=canary", "-rA")
    result.assert_outcomes(failed=2)
    reports = pytester.path / "reports"
    outputs = sorted(
        p for p in pytester.path.rglob("*") if p.is_file() and p.suffix in (".html", ".json", ".xml")
    )
    assert {p.name for p in outputs} >= {"canary.html", "canary.json", "canary.xml"}
    for path in outputs:
        assert canary not in path.read_text(), f"{path.name} contains the canary"
    for suffix in ("html", "json", "xml"):
        text = (reports / f"canary.{suffix}").read_text()
        # Not vacuous: the evidence is there, with the secret masked.
        assert "MY_TOKEN" in text or suffix == "xml"
        assert MASK in text
    json_text = (reports / "canary.json").read_text()
    assert '"command": "MY_TOKEN=***' in json_text and "--password=***" in json_text
    assert os.environ["GPUHOST_CANARY"] == canary
