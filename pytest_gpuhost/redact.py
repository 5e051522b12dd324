"""Hide credentials in text before it is stored in evidence or a report: the one redaction pass.

Every output goes through `redact` (`redact_obj` for JSON-like data, `redact_argv` for argument
vectors): evidence when it is recorded, failure text and captured sections on each report, JUnit
properties, the JSON evidence file, the fleet summary (and so its Prometheus textfile, HTML section
and terminal lines), the merge's outputs. Files the suites write (NOTES.md, stop logs) call
`redact` too. It errs on the side of hiding: a value that merely looks like a credential is
replaced, but prose keeps its words (`passwd: password updated successfully`).

The patterns cover the families a secret scanner such as detect-secrets (Apache-2.0) knows
(AWS, GitHub, GitLab, Slack, JWT, private keys, Basic auth in URLs, Azure, Stripe, OpenAI-style
`sk-`, Hugging Face) plus the command-line forms operators type (`curl -u`, `mysql -p`,
`sshpass -p`, `aws configure set`, `--key`). detect-secrets itself is not used: it reports
findings for a line rather than rewriting text, and its keyword and high-entropy detectors flag
what our evidence is full of (sha256 digests, GPU UUIDs, serials) -- a masked digest would make
a backup manifest unreadable.

`printable` is the other half of what reaches a terminal: control characters shown, not obeyed.
"""

from __future__ import annotations

import functools
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
# redact()'s results by text. Outputs redact the same strings many times (evidence, run record,
# fleet summary): at 16 hosts about 16,000 calls for ~2,000 distinct strings. Cleared whenever
# _known grows, so a result is always what redact() would return now.
_memo: dict[str, str] = {}
_MEMO_MAX = 50_000


def remember(value: str) -> None:
    """Hide this exact value in everything redacted from now on (this process)."""
    value = value.strip().strip("\"'")
    if len(value) < _MIN_KNOWN or MASK in value or value.isalpha() and (value.islower() or value.isupper()):
        return  # a plain word ("enabled", "NONE") would garble every output it appears in
    if sum(c.isalnum() for c in value) < _MIN_KNOWN:
        return  # "======" or "--------" would eat the rules of every report
    if value not in _known:
        _known.add(value)
        _memo.clear()  # results memoised before this value was known would still show it


def remember_env(env: Mapping[str, str]) -> None:
    """Remember the values of secret-looking variables of an environment (paths excluded)."""
    for name, value in env.items():
        if secret_name(name) and len(value) >= 8 and not value.startswith("/"):
            remember(value)


def _keep_and_mask(match: re.Match[str]) -> str:
    remember(match.group(2))
    return match.group(1) + MASK


def _mask_whole(match: re.Match[str]) -> str:
    remember(match.group(0))
    return MASK


def _name_value(match: re.Match[str]) -> str:
    """Mask a `name: value`, unless it is prose: `passwd: password updated successfully`."""
    value, rest = match.group(2), match.string[match.end() :]
    if "=" not in match.group(1) and value.isalpha() and re.match(r" +[A-Za-z]", rest):
        return match.group(0)
    return _keep_and_mask(match)


def _user_password(match: re.Match[str]) -> str:
    if match.group(2).isdigit():  # `docker run -u 1000:1000` is a uid:gid, not user:password
        return match.group(0)
    return _keep_and_mask(match)


def _key_body_line(match: re.Match[str]) -> str:
    """Mask a run of base64 key material (40 characters or more) found without its BEGIN/END lines."""
    body = match.group(1)
    mixed = (
        any(c.isupper() for c in body) and any(c.islower() for c in body) and any(c.isdigit() for c in body)
    )
    # Hex digests and GPU UUIDs lack a class; a path has a `/` every few characters where
    # base64 has one in 64 on average.
    if not mixed or body.startswith("/") or body.count("/") * 12 > len(body):
        return match.group(0)
    return match.group(0).replace(body, MASK)


_Repl = str | Callable[[re.Match[str]], str]
_VALUE = r"(\"[^\"\n]*\"|'[^'\n]*'|[^\s\"']+)"

_PATTERNS: list[tuple[re.Pattern[str], _Repl]] = [
    # Private key blocks (PEM, OpenSSH, PGP); a block cut before its END line: its base64 lines.
    (
        re.compile(
            r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"
            r"(?:.*?-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|(?:[ \t]*\r?\n[ \t]*[A-Za-z0-9+/=]*)*)",
            re.DOTALL,
        ),
        "-----PRIVATE KEY " + MASK + "-----",
    ),
    # Key material on its own (its BEGIN/END lines were another string, or another record).
    (re.compile(r"(?<![A-Za-z0-9+/=._-])([A-Za-z0-9+/]{40,}={0,2})(?![A-Za-z0-9+/=._-])"), _key_body_line),
    # Tokens recognisable by their prefix: AWS key ids, GitHub, GitLab, Hugging Face, Slack,
    # OpenAI/Anthropic-style sk-, Stripe, Google API keys, npm; and JWTs.
    (
        re.compile(
            r"\b(?:(?:AKIA|ASIA|AIDA|AROA|AGPA)[A-Z0-9]{16}\b"
            r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{20,}"
            r"|hf_[A-Za-z0-9]{20,}"
            r"|x(?:ox[abposr]|app)-[A-Za-z0-9-]{10,}"
            r"|sk-(?:proj-|ant-|live-|svcacct-)?[A-Za-z0-9_-]{20,}|[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"
            r"|AIza[0-9A-Za-z_-]{35}|npm_[A-Za-z0-9]{36}"
            r"|eyJ[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*)"
        ),
        _mask_whole,
    ),
    # URLs with user:password@.
    (re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:)([^@\s/]+)(?=@)"), _keep_and_mask),
    # Signed URLs and connection strings: SAS sig=, X-Amz-/X-Goog-Signature, Azure AccountKey=.
    (
        re.compile(
            r"(?i)((?<![\w-])(?:sig|signature|x-amz-signature|x-amz-security-token|x-goog-signature"
            r"|x-goog-credential|accountkey|sharedaccesskey|sharedaccesssignature|access_token"
            r"|refresh_token|client_secret)=)([^&;\s\"'#]+)"
        ),
        _keep_and_mask,
    ),
    # Authorization headers and bearer tokens.
    (
        re.compile(
            r"(?i)(\b(?:proxy-)?authorization[\"']?[ \t]*[:=][ \t]*[\"']?(?:bearer|basic|token|digest)?[ \t]*)([^\s\"',;]+)"
        ),
        _keep_and_mask,
    ),
    (re.compile(r"(?i)(\bbearer[ \t]+)([A-Za-z0-9._~+/=-]+)"), _keep_and_mask),
    # Passwords given to programs: curl -u user:pass, mysql -pX, sshpass -p X,
    # aws configure set aws_secret_access_key V.
    (
        re.compile(r"((?<![\w-])(?:-u[ \t]*|--(?:proxy-)?user[= \t][ \t]*)['\"]?[^\s:'\"]+:)([^\s'\"]+)"),
        _user_password,
    ),
    (re.compile(r"(\bmysql\w*\b[^\n|;&]*?[ \t]-p)([^\s'\"]+)"), _keep_and_mask),
    (re.compile(r"(\bsshpass\b[^\n|;&]*?[ \t]-p[ \t]*)([^\s'\"]+)"), _keep_and_mask),
    (
        re.compile(
            r"(?i)(\bconfigure[ \t]+set[ \t]+[\w.-]*(?:secret|token|password|key)[\w.-]*[ \t]+)" + _VALUE
        ),
        _keep_and_mask,
    ),
    # name=value, name: value, "name": "value" for secret-looking names.
    (
        re.compile(
            r"((?<![\w-])(?:"
            + _UPPER_SECRET
            + r"|(?i:"
            + _LOWER_SECRET
            + r"))[\"']?[ \t]*[:=][ \t]*)"
            + _VALUE
        ),
        _name_value,
    ),
    # --password VALUE, --token VALUE, --key VALUE (space separated command-line flags).
    (
        re.compile(r"(?i)((?<![\w-])--?" + _LOWER_SECRET + r"[ \t]+)(?!-)" + _VALUE),
        _keep_and_mask,
    ),
    (
        re.compile(r"(?i)((?<![\w-])--(?:[\w-]*-)?(?:key|secret|pass|pwd)[ \t]+)(?!-)" + _VALUE),
        _keep_and_mask,
    ),
]


@functools.lru_cache(maxsize=4096)
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
    done = _memo.get(text)
    if done is not None:
        return done
    out = text
    for pattern, repl in _PATTERNS:
        out = pattern.sub(repl, out)
    for value in sorted(_known, key=len, reverse=True):
        if value in out:
            out = out.replace(value, MASK)
    if len(_memo) >= _MEMO_MAX:
        _memo.clear()
    _memo[text] = out
    return out


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
