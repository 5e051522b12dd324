"""redact() memoises its results: a value remembered later still hides in text redacted before."""

from __future__ import annotations

from pytest_gpuhost import redact as r


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
