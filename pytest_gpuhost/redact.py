"""Hide credentials in text before it is stored in evidence or a report: the one redaction pass.

Every output goes through `redact` (`redact_obj` for JSON-like data, `redact_argv` for argument
vectors): evidence when it is recorded, failure text and captured sections on each report, JUnit
properties, the JSON evidence file, the fleet summary (and so its Prometheus textfile, HTML section
and terminal lines), the merge's outputs. Files the suites write (NOTES.md, stop logs) call
`redact` too. It hides what a secret looks like: known formats, and values under a secret's
name judged by the name's last word and, where that is ambiguous, the value's own shape; the
words LLM hosts are made of (`--max-total-tokens 65536`, `--tokenizer-path /models/...`,
`"bos_token_id": 151643`) and prose (`passwd: password updated successfully`) stay whole.

The patterns cover the families a secret scanner such as detect-secrets (Apache-2.0) knows
(AWS, GitHub, GitLab, Slack, JWT, private keys, Basic auth in URLs, Azure, Stripe, OpenAI-style
`sk-`, Hugging Face) plus the command-line forms operators type (`curl -u`, `mysql -p`,
`sshpass -p`, `aws configure set`, `--key`). detect-secrets itself is not used: it reports
findings for a line rather than rewriting text, and its keyword and high-entropy detectors flag
what our evidence is full of (sha256 digests, GPU UUIDs, serials) -- a masked digest would make
a backup manifest unreadable.

Each kind of secret is defined once, as a `Detector` in `DETECTORS` (its pattern, and which part
of a match is the secret, decided by the name's words and the value's shape where needed). The
same definitions serve `redact`, which hides what they find, and `detect`, which reports it
(kind, span, value) for suites/decommission's look at a node's files
(pytest_gpuhost/modules/credentials.py): a format is never written twice.

`printable` is the other half of what reaches a terminal: control characters shown, not obeyed.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DETECTORS",
    "MASK",
    "Detector",
    "Found",
    "detect",
    "printable",
    "redact",
    "redact_argv",
    "redact_env",
    "redact_obj",
    "remember",
    "remember_env",
    "name_kind",
    "secret_name",
]

MASK = "***"

# A name is a secret's name by its last word, or by its last two (`AWS_SECRET_ACCESS_KEY`,
# `--hf-token`, `apiKey`), never because a secret word sits inside another word
# (`--tokenizer-path`, `--max-total-tokens`, `bos_token_id`, `TOKENIZERS_PARALLELISM`,
# `detokenizer`). Unambiguous last words hide any value but a boolean, an empty one, a
# reference (`$VAR`) or an absolute path; `KEY` and `TOKEN` after another word are ambiguous
# (`pad_token`, `sort_key`) and hide a value only when it is shaped like a secret (`_secret_shaped`).
_SECRET_LAST = frozenset(
    {
        "SECRET",
        "SECRETS",
        "PASSWORD",
        "PASSWORDS",
        "PASSWD",
        "PASSPHRASE",
        "CREDENTIAL",
        "CREDENTIALS",
        "APIKEY",
    }
)
_AMBIGUOUS_LAST = frozenset({"KEY", "TOKEN"})
_ALONE = frozenset({"KEY", "TOKEN", "PASS", "PWD", "AUTH"})  # `--key X`, `token: X`, `-pass X`
_CREDENTIAL_QUALIFIERS = frozenset(
    {
        "API",
        "ACCESS",
        "SECRET",
        "PRIVATE",
        "AUTH",
        "SESSION",
        "REFRESH",
        "BEARER",
        "CLIENT",
        "HF",
        "HUGGINGFACE",
        "HUGGING",
        "FACE",
        "GITHUB",
        "GH",
        "GITLAB",
        "SLACK",
        "OPENAI",
        "ANTHROPIC",
        "NPM",
        "PYPI",
        "WANDB",
        "SECURITY",
        "MASTER",
        "SIGNING",
        "ENCRYPTION",
        "ID",
        "OAUTH",
        "WEBHOOK",
        "BOT",
        "APP",
        "SERVICE",
        "SSH",
        "LICENSE",
        "STRIPE",
        "DEPLOY",
        "PERSONAL",
        "REGISTRY",
        "DOCKER",
        "NGC",
    }
)
_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
_BOOLEAN = frozenset({"true", "false", "yes", "no", "on", "off", "none", "null", "nil", "0", "1"})
_NAME = r"[A-Za-z_][\w.-]*"

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
    """Remember the values of an environment's secrets (by name, or shaped like one under `KEY`/`TOKEN`)."""
    for name, value in env.items():
        if len(value) >= 8 and _hide(name, value):
            remember(value)


def _secret_shaped(value: str) -> bool:
    """Tell whether a value looks like a key or token by itself: long, one token, mixed, high entropy.

    Hex digests and GPU UUIDs are long too; they are not hidden under an ambiguous name
    (`cache_key: e3b0...`) because a lowercase hex alphabet is one class only.
    """
    v = value.strip("\"'")
    if len(v) < 16 or not re.fullmatch(r"[A-Za-z0-9_+/=.~-]+", v) or v.startswith(("/", "./", "~/")):
        return False
    if re.fullmatch(r"[0-9a-f-]+|[0-9A-F-]+", v):
        return False  # a digest, a UUID, a serial: evidence, not a key
    classes = sum(any(f(c) for c in v) for f in (str.isupper, str.islower, str.isdigit))
    if classes < 2:
        return False
    counts = {c: v.count(c) for c in set(v)}
    entropy = -sum(n / len(v) * math.log2(n / len(v)) for n in counts.values())
    return entropy >= 3.0


def _hide(name: str, value: str) -> str:
    """Return "remember" (hide, and everywhere later), "hide" (here only) or "" (honest)."""
    kind = name_kind(name)
    if not kind:
        return ""
    v = value.strip("\"'")
    if MASK in v:
        return "hide"  # already masked (`NAME='***'` from shlex.quote): shown as NAME=***
    if re.fullmatch(r"-?\d+(?:\.\d+)?[,;]?", v) or re.fullmatch(
        r"[\w.-]+(?:/[\w.-]+)*/[\w-]+\.[A-Za-z]\w*", v
    ):
        return ""  # a number, or a relative file path (`s3 key: data/shard-00001.arrow`)
    # an option (`hf_token: --key-file`, where "name: value" was made by joining words) is no value
    if not v or v.lower() in _BOOLEAN or v.startswith(("$", "/", "./", "../", "~/", "-")):
        return ""
    if kind == "secret":
        return "remember"
    return "remember" if _secret_shaped(v) else ""


# A detector's verdict on one match: the spans of the secrets in it, each (start, end, remember).
# An empty list is an honest match (`--max-total-tokens 65536`, a digest under `cache_key`).
Span = tuple[int, int, bool]


def _group(n: int) -> Callable[[re.Match[str]], list[Span]]:
    """The secret is group `n` of the match, always (and is hidden wherever it appears later)."""

    def spans(match: re.Match[str]) -> list[Span]:
        return [(match.start(n), match.end(n), True)]

    return spans


def _hide_span(match: re.Match[str], name: str, group: int) -> list[Span]:
    hide = _hide(name, match.group(group))
    if not hide:
        return []
    return [(match.start(group), match.end(group), hide == "remember")]


def _name_value(match: re.Match[str]) -> list[Span]:
    """A `name: value` whose name is a secret's, unless it is prose (`passwd: password updated`)."""
    value, rest = match.group(3), match.string[match.end() :]
    if not _hide(
        match.group(2), value
    ):  # the value may hold a pair of its own: `Environment=HF_TOKEN=hf_...`
        if "=" not in value:
            return []
        inner = _NAME_VALUE.finditer(match.string, match.start(3), match.end(3))
        return [s for m in inner for s in _name_value(m)]
    if "=" not in match.group(1) and value.isalpha() and re.match(r" +[A-Za-z]", rest):
        return []
    return _hide_span(match, match.group(2), 3)


def _flag_value(match: re.Match[str]) -> list[Span]:
    """`--name VALUE` whose name is a secret's (`--api-key X`, `--token X`, `--key X`)."""
    return _hide_span(match, match.group(2), 3)


def _user_password(match: re.Match[str]) -> list[Span]:
    if match.group(2).isdigit():  # `docker run -u 1000:1000` is a uid:gid, not user:password
        return []
    return [(match.start(2), match.end(2), True)]


def _key_body_line(match: re.Match[str]) -> list[Span]:
    """A run of base64 key material (40 characters or more) found without its BEGIN/END lines."""
    body = match.group(1)
    mixed = (
        any(c.isupper() for c in body) and any(c.islower() for c in body) and any(c.isdigit() for c in body)
    )
    # Hex digests and GPU UUIDs lack a class; a path has a `/` every few characters where
    # base64 has one in 64 on average.
    if not mixed or body.startswith("/") or body.count("/") * 12 > len(body):
        return []
    return [(match.start(1), match.end(1), False)]


@dataclass(frozen=True)
class Detector:
    """One kind of secret: how it is found in text, and which part of a match is the secret.

    The same definition serves `redact` (each span becomes `***`) and `detect` (each span is a
    finding: suites/decommission's look at a node). `kind` names it for an operator; `outlives`
    says whether the credential stays valid after the node is gone (a cloud key, a token:
    rotate it), which deleting a file cannot undo.
    """

    kind: str
    pattern: re.Pattern[str]
    spans: Callable[[re.Match[str]], list[Span]]
    outlives: bool = True
    replace: str | None = None  # the whole match becomes this (a private key block)
    named: bool = False  # the secret is the value of the name in group 2


def _prefixed(kind: str, regex: str) -> Detector:
    return Detector(kind, re.compile(r"\b(?:" + regex + r")"), _group(0))


_VALUE = r"(\"[^\"\n]*\"|'[^'\n]*'|[^\s\"']+)"
_NAME_VALUE = re.compile(r"((?<![\w-])(?:--?)?(" + _NAME + r")[\"']?[ \t]*[:=](?!=)[ \t]*)" + _VALUE)

#: Every detector, in the order `redact` applies them (a later one sees the earlier ones' `***`).
DETECTORS: tuple[Detector, ...] = (
    # Private key blocks (PEM, OpenSSH, PGP); a block cut before its END line: its base64 lines.
    Detector(
        "private key",
        re.compile(
            r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"
            r"(?:.*?-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|(?:[ \t]*\r?\n[ \t]*[A-Za-z0-9+/=]*)*)",
            re.DOTALL,
        ),
        _group(0),
        replace="-----PRIVATE KEY " + MASK + "-----",
    ),
    # Key material on its own (its BEGIN/END lines were another string, or another record).
    Detector(
        "key material",
        re.compile(r"(?<![A-Za-z0-9+/=._-])([A-Za-z0-9+/]{40,}={0,2})(?![A-Za-z0-9+/=._-])"),
        _key_body_line,
    ),
    # Tokens recognisable by their prefix, and JWTs.
    _prefixed("AWS access key id", r"(?:AKIA|ASIA|AIDA|AROA|AGPA)[A-Z0-9]{16}\b"),
    _prefixed("GitHub token", r"gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"),
    _prefixed("GitLab token", r"glpat-[A-Za-z0-9_-]{20,}"),
    _prefixed("Hugging Face token", r"hf_[A-Za-z0-9]{20,}"),
    _prefixed("Slack token", r"x(?:ox[abposr]|app)-[A-Za-z0-9-]{10,}"),
    _prefixed("API key (sk-)", r"sk-(?:proj-|ant-|live-|svcacct-)?[A-Za-z0-9_-]{20,}"),
    _prefixed("Stripe key", r"[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"),
    _prefixed("Google API key", r"AIza[0-9A-Za-z_-]{35}"),
    _prefixed("npm token", r"npm_[A-Za-z0-9]{36}"),
    _prefixed("JWT", r"eyJ[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"),
    # URLs with user:password@.
    Detector(
        "password in a URL",
        re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:)([^@\s/]+)(?=@)"),
        _group(2),
    ),
    # Signed URLs and connection strings: SAS sig=, X-Amz-/X-Goog-Signature, Azure AccountKey=.
    Detector(
        "signature or token in a URL",
        re.compile(
            r"(?i)((?<![\w-])(?:sig|signature|x-amz-signature|x-amz-security-token|x-goog-signature"
            r"|x-goog-credential|accountkey|sharedaccesskey|sharedaccesssignature|access_token"
            r"|refresh_token|client_secret)=)([^&;\s\"'#]+)"
        ),
        _group(2),
    ),
    # Authorization headers and bearer tokens.
    Detector(
        "authorization header",
        re.compile(
            r"(?i)(\b(?:proxy-)?authorization[\"']?[ \t]*[:=][ \t]*[\"']?(?:bearer|basic|token|digest)?[ \t]*)"
            r"([^\s\"',;]+)"
        ),
        _group(2),
    ),
    Detector("bearer token", re.compile(r"(?i)(\bbearer[ \t]+)([A-Za-z0-9._~+/=-]+)"), _group(2)),
    # ~/.netrc (W&B keeps its API key there): `machine H login U password P`, on one line or several.
    Detector(
        "netrc password",
        re.compile(r"(?<![\w-])(login[ \t\r\n]+\S+[ \t\r\n]+password[ \t\r\n]+)(\S+)"),
        _group(2),
    ),
    # Passwords given to programs: curl -u user:pass, mysql -pX, sshpass -p X,
    # aws configure set aws_secret_access_key V.
    Detector(
        "password on a command line",
        re.compile(r"((?<![\w-])(?:-u[ \t]*|--(?:proxy-)?user[= \t][ \t]*)['\"]?[^\s:'\"]+:)([^\s'\"]+)"),
        _user_password,
    ),
    Detector(
        "password on a command line", re.compile(r"(\bmysql\w*\b[^\n|;&]*?[ \t]-p)([^\s'\"]+)"), _group(2)
    ),
    Detector(
        "password on a command line",
        re.compile(r"(\bsshpass\b[^\n|;&]*?[ \t]-p[ \t]*)([^\s'\"]+)"),
        _group(2),
    ),
    Detector(
        "secret on a command line",
        re.compile(
            r"(?i)(\bconfigure[ \t]+set[ \t]+[\w.-]*(?:secret|token|password|key)[\w.-]*[ \t]+)" + _VALUE
        ),
        _group(2),
    ),
    # name=value, name: value, "name": "value", and `--name VALUE`, when the name is a secret's
    # (`_name_value` decides by the name's words and the value's shape).
    Detector("secret by its name", _NAME_VALUE, _name_value, named=True),
    Detector(
        "secret by its name",
        re.compile(r"((?<![\w-])--?(" + _NAME + r")[ \t]+)(?!-)" + _VALUE),
        _flag_value,
        named=True,
    ),
)


def _masked(det: Detector) -> Callable[[re.Match[str]], str]:
    """The `re.sub` replacement of one detector: each secret span becomes `***` (and is remembered)."""

    def repl(match: re.Match[str]) -> str:
        spans = det.spans(match)
        if not spans:
            return match.group(0)
        if det.replace is not None:
            return det.replace
        text, out, at = match.string, [], match.start()
        for start, end, keep in sorted(spans):
            if keep:
                remember(text[start:end])
            out += [text[at:start], MASK]
            at = end
        out.append(text[at : match.end()])
        return "".join(out)

    return repl


_PATTERNS = [(det.pattern, _masked(det)) for det in DETECTORS]
# `detect` tries the detectors that name what they find before bare key material.
_BY_SPECIFICITY = sorted(DETECTORS, key=lambda d: d.kind == "key material")


@dataclass(frozen=True)
class Found:
    """One secret `detect` found: its kind, where it is in the text, and the value itself.

    The value is there for the caller to fingerprint or to remove, never to show or to store.
    """

    kind: str
    start: int
    end: int
    value: str
    outlives: bool
    name: str = ""  # the variable, flag or field it was found under, when a name decided


def detect(text: str) -> list[Found]:
    """Return the secrets in `text` that `redact` would hide, found by the same detectors, in order.

    Overlapping finds are one secret, named by the most specific detector (a GitHub token that is
    a URL's password is a GitHub token; base64 under `"auth":` is a secret by its name before it
    is key material); a value already masked (`***`) is none.
    """
    found: list[Found] = []
    taken: list[tuple[int, int]] = []
    for det in _BY_SPECIFICITY:
        for match in det.pattern.finditer(text):
            for start, end, _ in det.spans(match):
                value = text[start:end].strip("\"'")
                if not value or MASK in value or any(s < end and start < e for s, e in taken):
                    continue
                taken.append((start, end))
                name = match.group(2) if det.named else ""
                found.append(Found(det.kind, start, end, value, det.outlives, name))
    return sorted(found, key=lambda f: f.start)


@functools.lru_cache(maxsize=4096)
def name_kind(name: str) -> str:
    """Classify a variable, flag or field name: "secret", "ambiguous" or "" (not a secret's name).

    By its words (`AWS_SECRET_ACCESS_KEY`, `--api-key`, `SecretAccessKey`, `hf_token`), the last
    deciding: `DB_PASSWORD` and `x-auth-token` are secrets' names, `pad_token` and `sort_key`
    ambiguous, and `MONKEY`, `keyboard`, `--max-total-tokens`, `bos_token_id` not at all.
    """
    words = [w.upper() for w in _WORD.findall(name)]
    if not words:
        return ""
    last = words[-1]
    if last in _SECRET_LAST or (len(words) == 1 and last in _ALONE):
        return "secret"
    if last in _AMBIGUOUS_LAST:
        return "secret" if words[-2] in _CREDENTIAL_QUALIFIERS else "ambiguous"
    return ""


def secret_name(name: str) -> bool:
    """Tell whether a name holds a credential whatever its value (see `name_kind`)."""
    return name_kind(name) == "secret"


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
        if value in out:  # whole tokens only: a remembered "Qwen3-27B" must not eat "Qwen3-27B-FP8"'s prefix
            out = re.sub(r"(?<![A-Za-z0-9])" + re.escape(value) + r"(?![A-Za-z0-9])", MASK, out)
    if len(_memo) >= _MEMO_MAX:
        _memo.clear()
    _memo[text] = out
    return out


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Return a copy of an environment with secrets' values masked (and remembered)."""
    out = {}
    for name, value in env.items():
        hide = _hide(name, str(value))
        if hide:
            remember(str(value))
        out[name] = MASK if hide else redact(str(value))
    return out


def redact_argv(argv: Sequence[str]) -> list[str]:
    """Return a copy of an argument vector with credentials masked.

    Handles `--password VALUE` split over two arguments as well as everything `redact` finds.
    """
    out: list[str] = []
    flag = ""
    for arg in argv:
        if flag and not arg.startswith("-") and _hide(flag, arg):
            remember(arg)
            out.append(MASK)
            flag = ""
            continue
        flag = arg.lstrip("-") if arg.startswith("-") and "=" not in arg else ""
        out.append(redact(arg))
    return out


def redact_obj(obj: Any) -> Any:
    """Redact every string in a JSON-like structure; dict values under secrets' names are masked."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, Mapping):
        return {
            k: (MASK if isinstance(k, str) and isinstance(v, str) and _hide(k, v) else redact_obj(v))
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
