"""Precision and recall of credential detection (`redact.detect`) on a corpus of honest strings and secrets.

The honest strings are what an LLM host's files are full of: model paths, config keys named
`*_token` that are not secrets, UUIDs, SHA-256 digests, git SHAs, numbers under secret-sounding
names. The secrets have the real formats of the tools an operator uses on a rented node. Every
secret must be found (recall 100%) and no honest string flagged (precision 100%): a finding on a
node is something the operator is told to rotate, and a false one teaches them to ignore the list.
The values are random, of the real shapes; none is a real credential.
"""

from __future__ import annotations

import base64

import pytest

from pytest_gpuhost.modules.credentials import fingerprint
from pytest_gpuhost.redact import MASK, detect, redact

# (text, the secret in it)
SECRETS: list[tuple[str, str]] = [
    ("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", "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"),
    ("export HF_TOKEN=hf_aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3z", "hf_aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3z"),
    ("aws_access_key_id = AKIAQ3EGRB7NPLF2XK4M", "AKIAQ3EGRB7NPLF2XK4M"),
    (
        "aws_secret_access_key = 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",
        "9fJ2+kQv/Lm3Xw8ZpT1rYb6NcH0dGs4EuAiKoVWe",
    ),
    ("aws_session_token = IQoJb3JpZ2luX2VjEJr//////////wEaCXVzLWVhc3QtMiJHMEUCIQ", None),
    (
        "machine api.wandb.ai\n  login user\n  password 5f3c9a1e7b2d4f6a8c0e1b3d5f7a9c1e3b5d7f9a",
        "5f3c9a1e7b2d4f6a8c0e1b3d5f7a9c1e3b5d7f9a",
    ),
    (
        '{"auths": {"ghcr.io": {"auth": "bWxvcHM6Z2hwX3h4eHh4eHh4eHh4eHh4eHh4eHh4"}}}',
        "bWxvcHM6Z2hwX3h4eHh4eHh4eHh4eHh4eHh4eHh4",
    ),
    (
        "https://bot:ghp_R2d4F6h8J0l2N4p6R8t0V2x4Z6b8D0f2H4j6@github.com",
        "ghp_R2d4F6h8J0l2N4p6R8t0V2x4Z6b8D0f2H4j6",
    ),
    ("    oauth_token: gho_Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0Fe9Dc8", "gho_Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0Fe9Dc8"),
    (
        "    token: eyJhbGciOiJSUzI1NiIsImtpZCI6IkR.eyJpc3MiOiJrdWJlcm5ldGVzIn0.c2lnbmF0dXJlLXNpZ25hdHVyZQ",
        "eyJhbGciOiJSUzI1NiIsImtpZCI6IkR.eyJpc3MiOiJrdWJlcm5ldGVzIn0.c2lnbmF0dXJlLXNpZ25hdHVyZQ",
    ),
    (
        "secret_access_key = Wq8rT2yU4iO6pA8sD0fG2hJ4kL6zX8cV0bN2mQ4w",
        "Wq8rT2yU4iO6pA8sD0fG2hJ4kL6zX8cV0bN2mQ4w",
    ),
    ("secret_key = Pk3Lj5Hg7Fd9Sa1Qw3Er5Ty7Ui9Op1As3Df5Gh7J", "Pk3Lj5Hg7Fd9Sa1Qw3Er5Ty7Ui9Op1As3Df5Gh7J"),
    (
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n-----END OPENSSH PRIVATE KEY-----",
        None,
    ),
    (
        "OPENAI_API_KEY=sk-proj-Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op8Qr9St0Uv1Wx2Yz3",
        "sk-proj-Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op8Qr9St0Uv1Wx2Yz3",
    ),
    ("WANDB_API_KEY=0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c", "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"),
    (
        "python3 -m sglang.launch_server --model-path /m --api-key sgl-Q7w8E9r0T1y2U3i4O5p6",
        "sgl-Q7w8E9r0T1y2U3i4O5p6",
    ),
    (
        "huggingface-cli login --token hf_Mn8Bv7Cx6Zl5Kj4Hg3Fd2Sa1Qw9Er8Ty7Ui6",
        "hf_Mn8Bv7Cx6Zl5Kj4Hg3Fd2Sa1Qw9Er8Ty7Ui6",
    ),
    ("mysql -u eval -pT0pS3cretPassw0rd -h 10.0.0.5 results", "T0pS3cretPassw0rd"),
    (
        'curl -H "Authorization: Bearer sk-ant-api03-Xy9Wv8Ut7Sr6Qp5On4Ml3Kj2" https://api',
        "sk-ant-api03-Xy9Wv8Ut7Sr6Qp5On4Ml3Kj2",
    ),
    ('"client_secret": "d-FL95Q19q7MQmFpd7hHD0Ty"', "d-FL95Q19q7MQmFpd7hHD0Ty"),
    (
        '"refresh_token": "1//0gLq3Zx8Wv6Ut4Sr2Qp0On8Ml6Kj4Hg2Fd0Sa"',
        "1//0gLq3Zx8Wv6Ut4Sr2Qp0On8Ml6Kj4Hg2Fd0Sa",
    ),
    ("DB_PASSWORD=Correct-Horse-Battery-9", "Correct-Horse-Battery-9"),
    ("glpat-Ab3De6Gh9Jk2Mn5Pq8St1V", "glpat-Ab3De6Gh9Jk2Mn5Pq8St1V"),
    ("xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOp", "xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOp"),
    (
        "NGC_API_KEY=nvapi-Zq1Xw2Ce3Vr4Bt5Ny6Mu7Ki8Lo9Pa0SdFgHjKl",
        "nvapi-Zq1Xw2Ce3Vr4Bt5Ny6Mu7Ki8Lo9Pa0SdFgHjKl",
    ),
    ("https://user:pa55w0rd-x@registry.example.com/v2/", "pa55w0rd-x"),
]

HONEST: list[str] = [
    "--model-path /data/models/Qwen3-235B-A22B-FP8",
    "model: meta-llama/Llama-3.1-70B-Instruct",
    "tokenizer_path: /models/qwen/tokenizer.json",
    '"bos_token_id": 151643',
    '"eos_token": "<|im_end|>"',
    "pad_token: <pad>",
    '"pad_token_id": 0',
    "max_tokens: 8192",
    "--max-total-tokens 65536",
    "TOKENIZERS_PARALLELISM=false",
    "use_fast_tokenizer: true",
    "cache_key: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  data/shard-00001.arrow",
    "commit 4b825dc642cb6eb9a060e54bf8d69288fbee4904",
    "revision: 4b825dc642cb6eb9a060e54bf8d69288fbee4904",
    "GPU-4fe656c6-3035-7d82-9c8d-0da4eb4f1b57",
    "uuid = 5f2a9c4e-0b7d-4c1a-9e33-7d1c2b8a6f10",
    "root=UUID=5f2a9c4e-0b7d-4c1a-9e33-7d1c2b8a6f10 ro iommu=pt",
    "sort_key: created_at",
    "api_key_file: /etc/sglang/key",
    "hf_token: $HF_TOKEN",
    "HF_TOKEN=",
    "token_budget: 4096",
    "num_tokens = 128000",
    "passwd: password updated successfully",
    "secret_name: results-bucket-credentials",
    "s3 key: data/shard-00001.arrow",
    "docker run -u 1000:1000 --gpus all image",
    "[2025-11-01 12:00:00] Decode batch. #running-req: 12, #token: 40960, gen throughput (token/s): 2310.52",
    "export CUDA_VISIBLE_DEVICES=0,1,2,3",
    "python3 -m sglang.launch_server --model-path /data/models/Qwen3-235B-A22B-FP8 --port 30000 --tp 1",
    "https://huggingface.co/Qwen/Qwen3-235B-A22B-FP8/resolve/main/config.json",
    "/data/scripts/launch_0002.sh --base-gpu-id 2 --log-file /data/logs/sglang-dp2.log",
    "region = us-east-2",
    "output = json",
    "git_protocol: https",
    "server: https://10.20.0.1:6443",
    "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub",
    "ENABLE_TOKEN_CACHE=1",
    "keyring_backend: file",
    "MONKEY=banana",
    "keyboard: us",
]


def secrets_of(text: str) -> list[str]:
    return [f.value for f in detect(text)]


@pytest.mark.parametrize(("text", "secret"), SECRETS)
def test_every_secret_of_the_corpus_is_found(text, secret):
    got = secrets_of(text)
    assert got, f"missed: {text!r}"
    if secret is not None:
        assert secret in got or any(secret in g for g in got), (text, got)


@pytest.mark.parametrize("text", HONEST)
def test_no_honest_string_is_flagged(text):
    assert secrets_of(text) == [], text


def test_precision_and_recall_on_the_whole_corpus():
    """Recall 100% of the corpus's secrets, precision 100%: asserted as figures, not only per case."""
    true_pos = sum(bool(secrets_of(t)) for t, _ in SECRETS)
    false_pos = sum(bool(secrets_of(t)) for t in HONEST)
    recall = true_pos / len(SECRETS)
    precision = true_pos / (true_pos + false_pos)
    assert (recall, precision) == (1.0, 1.0), (recall, precision)
    assert len(SECRETS) >= 25 and len(HONEST) >= 40


@pytest.mark.parametrize(("text", "secret"), [s for s in SECRETS if s[1] is not None])
def test_redaction_and_detection_agree(text, secret):
    """One definition serves both: what detect reports, redact hides; what it leaves, redact leaves."""
    assert secret not in redact(text) and MASK in redact(text)


@pytest.mark.parametrize("text", HONEST)
def test_redaction_leaves_honest_strings_whole(text):
    assert redact(text) == text


def test_fingerprint_is_short_and_not_the_value():
    value = "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"
    fp = fingerprint(value)
    assert len(fp) == 8 and int(fp, 16) >= 0 and fp not in value
    assert fingerprint(value) == fp != fingerprint(value + "x")
    assert base64.b64encode(value.encode()).decode() not in fp
