"""Redaction against a corpus from LLM serving hosts: every secret hidden, every honest line whole.

The corpus is in tests/data/redact/: `honest.txt` (SGLang and vLLM launch commands, Hugging Face
configs, serving logs, the suites' own evidence) and `secrets.txt` (env files, unit files, docker
and k8s manifests, CLI flags, URLs). The counts are quoted in docs/trust.md.
"""

from __future__ import annotations

from pathlib import Path

from pytest_gpuhost import redact as r

DATA = Path(__file__).parents[1] / "data" / "redact"


def _lines(name: str) -> list[str]:
    text = (DATA / name).read_text(encoding="utf-8")
    return [line.replace("\\n", "\n") for line in text.splitlines() if line and not line.startswith("#")]


HONEST = _lines("honest.txt")
SECRETS = [tuple(line.split("\t")) for line in _lines("secrets.txt")]


def test_every_secret_hidden_and_every_honest_line_whole() -> None:
    # Secrets first: each is remembered, as in a real run, so the honest lines must survive that too.
    shown = [secret for text, secret in SECRETS if secret in r.redact(text)]
    changed = [line for line in HONEST if r.redact(line) != line]
    print(
        f"secrets hidden {len(SECRETS) - len(shown)} of {len(SECRETS)}; "
        f"honest lines intact {len(HONEST) - len(changed)} of {len(HONEST)}"
    )
    assert shown == [] and changed == [], (shown, changed)
    assert len(SECRETS) >= 20 and len(HONEST) >= 40


def test_argv_and_env_keep_llm_words() -> None:
    argv = [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/Qwen3.6-27B",
        "--tokenizer-path",
        "/models/Qwen3.6-27B",
        "--max-total-tokens",
        "65536",
        "--api-key",
        "Rk8Lq2Zm4Xp7Wn3Vt",
    ]
    out = r.redact_argv(argv)
    assert out == argv[:-1] + [r.MASK]
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "HF_TOKEN": "hf_x",
        "MAX_TOKENS": "512",
        "PAD_TOKEN": "<|endoftext|>",
        "RUNNER_TOKEN": "Wq3Er5Ty7Ui9Op1As2Df",
    }
    assert r.redact_env(env) == {**env, "HF_TOKEN": r.MASK, "RUNNER_TOKEN": r.MASK}
    # Nothing honest was remembered: the model path and the numbers show everywhere later.
    assert (
        r.redact("loaded /models/Qwen3.6-27B with 65536 tokens")
        == "loaded /models/Qwen3.6-27B with 65536 tokens"
    )


def test_name_kind_decides_by_the_last_word() -> None:
    for name in (
        "AWS_SECRET_ACCESS_KEY",
        "--api-key",
        "hf_token",
        "HF_TOKEN",
        "SecretAccessKey",
        "DB_PASSWORD",
        "x-auth-token",
        "token",
        "--key",
    ):
        assert r.name_kind(name) == "secret", name
    for name in ("pad_token", "sort_key", "MY_TOKEN"):
        assert r.name_kind(name) == "ambiguous", name
    for name in (
        "--tokenizer-path",
        "--max-total-tokens",
        "bos_token_id",
        "TOKENIZERS_PARALLELISM",
        "detokenizer",
        "MONKEY",
        "keyboard",
        "max_tokens",
        "--key-file",
    ):
        assert r.name_kind(name) == "", name


# ----------------------------------------------------------------------
# redact() memoises its results: a value remembered later still hides in text redacted before.


def test_memo_forgets_when_a_value_is_remembered() -> None:
    text = "echo Zq8Rw2LmPx7 done"  # no secret form: passes through unchanged
    assert r.redact(text) == text
    assert r.redact(text) == text  # from the memo
    r.remember("Zq8Rw2LmPx7")
    assert r.redact(text) == f"echo {r.MASK} done"


def test_memo_hit_still_masks_what_the_patterns_found() -> None:
    line = "curl -u admin:Hx9vT4qLw2 https://example.invalid"
    first = r.redact(line)
    assert "Hx9vT4qLw2" not in first
    assert r.redact(line) == first
    # the password was remembered by the first pass: it hides wherever it shows up later
    assert r.redact("password is Hx9vT4qLw2") == f"password is {r.MASK}"


def test_secret_name_is_cached_but_exact() -> None:
    assert r.secret_name("DB_PASSWORD") and r.secret_name("DB_PASSWORD")
    assert not r.secret_name("MONKEY") and not r.secret_name("MONKEY")
