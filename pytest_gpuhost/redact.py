"""Hide credentials in text before it is stored in evidence or a report.

Redaction is applied where evidence is recorded (commands, states, notes) and to report
sections and failure text, so a secret that a command printed never reaches an output file.
It errs on the side of hiding: a value that merely looks like a credential is replaced.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "MASK",
    "printable",
    "redact",
    "redact_argv",
    "redact_env",
    "redact_obj",
    "remember",
    "remember_env",
    "secret_name",
]

MASK = "***"

_SECRET_WORDS = frozenset(
    {
        "KEY",
        "KEYS",
        "APIKEY",
        "TOKEN",
        "TOKENS",
        "SECRET",
        "SECRETS",
        "PASSWORD",
        "PASSWORDS",
        "PASSWD",
        "PASS",
        "CREDENTIAL",
        "CREDENTIALS",
        "PASSPHRASE",
        "AUTH",
    }
)
_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
# Lower-case names are matched narrowly ("monkey=3" is not a secret, "api_key=..." is).
_LOWER_SECRET = (
    r"[\w.-]*(?:password|passwd|passphrase|token|secret|credential|api[_-]?key|access[_-]?key"
    r"|private[_-]?key|secret[_-]?key|auth[_-]?key)s?[\w.-]*"
)
_UPPER_SECRET = r"[A-Z0-9_]*(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PASSPHRASE)S?[A-Z0-9_]*"

# Values seen under a secret name (env var, flag, name=value) are hidden wherever they appear
# later, e.g. when a command echoes $MY_TOKEN without its name.
_known: set[str] = set()
_MIN_KNOWN = 6


def remember(value: str) -> None:
    """Hide this exact value in everything redacted from now on (this process)."""
    value = value.strip().strip("\"'")
    if len(value) < _MIN_KNOWN or MASK in value or value.isalpha() and (value.islower() or value.isupper()):
        return  # a plain word ("enabled", "NONE") would garble every output it appears in
    _known.add(value)


def remember_env(env: Mapping[str, str]) -> None:
    """Remember the values of secret-looking variables of an environment (paths excluded)."""
    for name, value in env.items():
        if secret_name(name) and len(value) >= 8 and not value.startswith("/"):
            remember(value)


def _keep_and_mask(match: re.Match[str]) -> str:
    remember(match.group(2))
    return match.group(1) + MASK


_Repl = str | Callable[[re.Match[str]], str]

_PATTERNS: list[tuple[re.Pattern[str], _Repl]] = [
    # AWS access key ids.
    (re.compile(r"()\b((?:AKIA|ASIA|AIDA|AROA|AGPA)[A-Z0-9]{16})\b"), _keep_and_mask),
    # URLs with user:password@.
    (re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:)([^@\s/]+)(?=@)"), _keep_and_mask),
    # Authorization headers and bearer tokens.
    (
        re.compile(
            r"(?i)(\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?(?:bearer|basic|token|digest)?\s*)([^\s\"',;]+)"
        ),
        _keep_and_mask,
    ),
    (re.compile(r"(?i)(\bbearer\s+)([A-Za-z0-9._~+/=-]+)"), _keep_and_mask),
    # name=value, name: value, "name": "value" for secret-looking names.
    (
        re.compile(
            r"((?<![\w-])(?:" + _UPPER_SECRET + r"|(?i:" + _LOWER_SECRET + r"))[\"']?\s*[:=]\s*)"
            r"(\"[^\"\n]*\"|'[^'\n]*'|[^\s&,;\"']+)"
        ),
        _keep_and_mask,
    ),
    # --password VALUE, --token VALUE (space separated command-line flags).
    (
        re.compile(r"(?i)((?<![\w-])--?" + _LOWER_SECRET + r"\s+)(?!-)([^\s\"']+|\"[^\"\n]*\"|'[^'\n]*')"),
        _keep_and_mask,
    ),
    # PEM private keys.
    (
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.DOTALL),
        "-----PRIVATE KEY " + MASK + "-----",
    ),
]


def secret_name(name: str) -> bool:
    """Tell whether an environment variable, flag or field name looks like it holds a credential.

    The name is split into words (`AWS_SECRET_ACCESS_KEY`, `--api-key`, `SecretAccessKey`), so
    `MONKEY` or `keyboard` are not secrets while `DB_PASSWORD` and `x-auth-token` are.
    """
    return any(word.upper() in _SECRET_WORDS for word in _WORD.findall(name))


def redact(text: str) -> str:
    """Return `text` with credentials replaced by `***`."""
    if not text:
        return text
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    for value in sorted(_known, key=len, reverse=True):
        if value in text:
            text = text.replace(value, MASK)
    return text


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Return a copy of an environment with secret-looking names' values masked (and remembered)."""
    for name, value in env.items():
        if secret_name(name):
            remember(str(value))
    return {k: (MASK if secret_name(k) else redact(str(v))) for k, v in env.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """Return a copy of an argument vector with credentials masked.

    Handles `--password VALUE` split over two arguments as well as everything `redact` finds.
    """
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("-"):
            remember(arg)
            out.append(MASK)
            hide_next = False
            continue
        hide_next = arg.startswith("-") and "=" not in arg and secret_name(arg.lstrip("-"))
        out.append(redact(arg))
    return out


def redact_obj(obj: Any) -> Any:
    """Redact every string in a JSON-like structure; dict values under secret names are masked."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, Mapping):
        return {
            k: (MASK if isinstance(k, str) and secret_name(k) and isinstance(v, str) else redact_obj(v))
            for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [redact_obj(v) for v in obj]
    return obj


_KEEP = frozenset("\n\t")


def printable(text: str) -> str:
    """Return `text` with control characters and escape sequences shown, not obeyed (`\\x1b`).

    For every line the plugin prints to a terminal: a host name, command output or summary
    holding `ESC [2J` or `ESC ] 0; title BEL` would otherwise clear or retitle the operator's
    terminal, or hide a line with `\\r`. Newlines and tabs are kept.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in _KEEP else repr(c)[1:-1] for c in text)
