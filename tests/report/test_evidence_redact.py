"""Redaction: patterns, remembered values, and a canary secret that no output file may contain."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

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


#: Every secret form an operator's command lines hold, with the secret each line holds (the canary).
CORPUS = [
    ("aws configure set aws_secret_access_key wJalrXUtnFEMI/K7MDENG/Canary01xyz", "Canary01xyz"),
    ("curl -u deploy:Canary02pw https://repo.example/x", "Canary02pw"),
    ("mysql -uroot -pCanary03pw -e 'select 1'", "Canary03pw"),
    ("sshpass -p Canary04pw ssh root@gpu-1", "Canary04pw"),
    ("s3cmd --key Canary05kv --verbose", "Canary05kv"),
    ("git clone https://ghp_Canary06aaaaaaaaaaaaaaaaaaaaaaaaaaaa@github.com/o/r.git", "Canary06"),
    ("huggingface-cli login --add hf_Canary07bbbbbbbbbbbbbbbbbbbbbbbbbbbb", "Canary07"),
    ("cookie eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJDYW5hcnkwOCJ9.Canary08sig_Q", "Canary08"),
    ("posted with xoxb-1234567890-Canary09cccccccccc", "Canary09"),
    ("DefaultEndpointsProtocol=https;AccountName=a;AccountKey=Canary10Zm9v==;EndpointSuffix=x", "Canary10"),
    ("https://a.blob.core.windows.net/c/b?sv=2022-11-02&sig=Canary11%2Fdd&se=2030", "Canary11"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Date=20260101&X-Amz-Signature=Canary12ff00", "Canary12"),
    ("https://storage.googleapis.com/b/o?X-Goog-Signature=Canary13ee&X-Goog-Date=1", "Canary13"),
    ("using key sk-proj-Canary14ffffffffffffffffffffff for the eval", "Canary14"),
    (
        "-----BEGIN PGP PRIVATE KEY BLOCK-----\n\nlQOYBGCanary15AQgAxyzxyzxyzxyzxyzxyzxyzxyzxyzxyzxyzxyzxyzxyzxyz\n"
        "=Ab1c\n-----END PGP PRIVATE KEY BLOCK-----",
        "Canary15",
    ),
    ("b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQCanary16AAAAAAABAAAAMwAAAAtz", "Canary16"),
    (
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaCanary17AAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMw",
        "Canary17",
    ),
]

#: Text that looks like a secret but is not: every word must survive.
FALSE_POSITIVES = [
    "passwd: password updated successfully",
    "Changing password for user root.",
    "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "GPU-5f1c2b6e-0c9d-4a7e-9f3b-2d4c6e8a0b1c on 0000:3b:00.0",
    "docker run -u 1000:1000 nvidia/cuda",
    "monkey=3 keyboard=us",
]


def _llm_corpus(name: str) -> list[str]:
    path = Path(__file__).parents[1] / "data" / "redact" / name
    return [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln and not ln.startswith("#")]


#: The LLM-host corpus of tests/report/test_redact.py, through every artefact too: honest lines
#: that every output prints as they are (no quote, backslash or markup, which JSON and HTML escape).
LLM_HONEST = [ln for ln in _llm_corpus("honest.txt") if not set(ln) & set("\"\\<>&'")]
LLM_SECRETS = [(ln.split("\t")[0], ln.split("\t")[1]) for ln in _llm_corpus("secrets.txt") if "\\n" not in ln]


@pytest.mark.parametrize(("text", "canary"), CORPUS, ids=[c for _, c in CORPUS])
def test_every_secret_form_is_hidden(text: str, canary: str) -> None:
    out = redact(text)
    assert canary not in out and MASK in out, out


def test_false_positives_keep_their_words() -> None:
    for text in FALSE_POSITIVES:
        assert redact(text) == text


CORPUS_SUITE = """
import json, pathlib
import pytest
from pytest_gpuhost.run.remediation import Action, Check

LINES = json.loads(pathlib.Path(__file__).with_name("corpus.json").read_text())

def test_corpus(target, evidence, request):
    for line in LINES:
        r = target.conn.run(["printf", "%s\\\\n", line])
        assert r.rc == 0
        evidence.note(line)
    print("\\n".join(LINES))
    request.node.user_properties.append(
        ("gpuhost_verdict", {"summary": " | ".join(LINES), "reasons": LINES, "state": {"lines": LINES}})
    )
    pytest.fail("\\n".join(LINES), pytrace=False)

def test_remediation(target, remediate):
    remediate(name="rotate", check=lambda: Check(False, " ; ".join(LINES), state={"lines": LINES}),
              plan=lambda b: [Action("set " + line, line) for line in LINES], fix=lambda a, b: None)
"""


def test_secret_corpus_reaches_no_artefact(pytester: pytest.Pytester) -> None:
    """Run a suite whose commands print every form; grep every artefact and the terminal."""
    import html
    import json
    import subprocess
    import sys

    lines = [text for text, _ in CORPUS] + FALSE_POSITIVES + [text for text, _ in LLM_SECRETS] + LLM_HONEST
    (pytester.path / "corpus.json").write_text(json.dumps(lines))
    pytester.makepyfile(test_corpus=CORPUS_SUITE)
    prom = pytester.path / "gpuhost.prom"
    result = pytester.runpytest_subprocess(
        "--host=local://", "--report-name=corpus", f"--prometheus-textfile={prom}", "-rA"
    )
    result.assert_outcomes(failed=2)
    reports = pytester.path / "reports"
    merged = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest_gpuhost.merge",
            str(reports / "fleet-summary.json"),
            "-o",
            str(pytester.path / "merged" / "fleet.html"),
            "--prometheus-textfile",
            str(pytester.path / "merged" / "m.prom"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=pytester.path,
    )
    assert merged.returncode == 1, merged.stderr  # a host failed
    artefacts = {
        p.relative_to(pytester.path).as_posix(): p.read_text()
        for p in sorted(pytester.path.rglob("*"))
        if p.is_file()
        and p.suffix in (".html", ".json", ".xml", ".prom")
        and p.parent != pytester.path
        or p.suffix == ".prom"
    }
    assert set(artefacts) >= {
        "reports/corpus.html",
        "reports/corpus.json",
        "reports/corpus.xml",
        "reports/fleet-summary.json",
        "gpuhost.prom",
        "merged/fleet.html",
        "merged/fleet.json",
        "merged/m.prom",
    }, sorted(artefacts)
    artefacts["terminal"] = result.stdout.str() + result.stderr.str()
    artefacts["merge terminal"] = merged.stdout + merged.stderr
    for name, text in artefacts.items():
        readable = html.unescape(html.unescape(text)).replace("\\n", "\n")
        found = [canary for _, canary in CORPUS + LLM_SECRETS if canary in readable]
        assert found == [], f"{name} holds {found}"
    # Not vacuous, and no word lost: the lines reached the outputs, the false positives whole.
    for name in (
        "reports/corpus.html",
        "reports/corpus.json",
        "reports/corpus.xml",
        "reports/fleet-summary.json",
        "merged/fleet.json",
        "terminal",
    ):
        readable = html.unescape(html.unescape(artefacts[name])).replace("\\n", "\n")
        assert MASK in readable, name
        missing = [fp for fp in FALSE_POSITIVES + LLM_HONEST if fp not in readable]
        assert missing == [], f"{name} lost {missing}"
