"""Plant the credentials an operator leaves on a rented GPU node (profile ``files: generator: credentials``).

The B200 node fetched its model with a Hugging Face token, wrote results to S3 with AWS keys,
logged to W&B, pulled images from a registry, pushed to git and GitHub, reached a Kubernetes
cluster and an rclone remote, and kept an SSH deploy key, a ``.env`` and a launch script with
``--api-key`` under ``/data``, and a shell history that typed some of them. Each file is where
the tool that writes it puts it, in the tool's own format (docs/LAB-SOURCES.md cites them), with
a value that has the real shape and is random: ``PLANTED`` lists every value, so tests can
require each to be found and none to reach an artefact. The SGLang server's ``HF_TOKEN`` lives
in its process environment (the profile's ``env``), listed here too.

Nothing here is a real credential: each value comes from a seeded generator.
"""

from __future__ import annotations

import base64
import os
import random
import string
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENVIRON", "PLANTED", "Planted", "plant"]

_R = random.Random(20261207)
_ALNUM = string.ascii_letters + string.digits


def _s(n: int, alphabet: str = _ALNUM) -> str:
    return "".join(_R.choice(alphabet) for _ in range(n))


@dataclass(frozen=True)
class Planted:
    """One credential on the lab node: the file (or ``environ:NAME``) that holds it and its value."""

    path: str
    kind: str
    value: str


HF = "hf_" + _s(34)
HF_ENV = "hf_py3MPNZEPFqzi0OZUrNsPqPdQ1Og7YN8gK"  # sglang-dp0's HF_TOKEN: the profile's env
AWS_ID = "AKIA" + _s(16, string.ascii_uppercase + string.digits)
AWS_SECRET = _s(40, _ALNUM + "+/")
AWS_SSO = "aoa" + _s(60) + ":" + _s(80)
WANDB = _s(40, "0123456789abcdef")
DOCKER_PAT = "dckr_pat_" + _s(27, _ALNUM + "-_")
DOCKER_AUTH = base64.b64encode(f"mlops-bot:{DOCKER_PAT}".encode()).decode()
GIT_PAT = "ghp_" + _s(36)
GH_OAUTH = "gho_" + _s(36)
KUBE_JWT = (
    (
        "eyJhbGciOiJSUzI1NiIsImtpZCI6I"
        + _s(14)
        + "."
        + "eyJpc3MiOiJrdWJlcm5ldGVzL3NlcnZpY2VhY2NvdW50Ii"
        + _s(40)
    )
    + "."
    + _s(86, _ALNUM + "-_")
)
RCLONE_ID = "AKIA" + _s(16, string.ascii_uppercase + string.digits)
RCLONE_SECRET = _s(40, _ALNUM + "+/")
S3CMD_SECRET = _s(40, _ALNUM + "+/")
SSH_KEY_BODY = "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n" + "\n".join(
    _s(70, _ALNUM + "+/") for _ in range(4)
)
SSH_KEY = f"-----BEGIN OPENSSH PRIVATE KEY-----\n{SSH_KEY_BODY}\n-----END OPENSSH PRIVATE KEY-----"
ENV_OPENAI = "sk-proj-" + _s(48, _ALNUM + "_-")
ENV_WANDB = _s(40, "0123456789abcdef")
API_KEY = "sgl-" + _s(32)
HIST_HF = "hf_" + _s(34)
HIST_PASSWORD = _s(18)

#: Every credential the generator plants, by the file that holds it.
PLANTED: tuple[Planted, ...] = (
    Planted("/root/.cache/huggingface/token", "Hugging Face token", HF),
    Planted("/root/.aws/credentials", "AWS access key id", AWS_ID),
    Planted("/root/.aws/credentials", "secret by its name", AWS_SECRET),
    Planted("/root/.aws/sso/cache/4f1c2a0d9e.json", "secret by its name", AWS_SSO),
    Planted("/root/.netrc", "netrc password", WANDB),
    Planted("/root/.docker/config.json", "secret by its name", DOCKER_AUTH),
    Planted("/root/.git-credentials", "GitHub token", GIT_PAT),
    Planted("/root/.config/gh/hosts.yml", "GitHub token", GH_OAUTH),
    Planted("/root/.kube/config", "JWT", KUBE_JWT),
    Planted("/root/.config/rclone/rclone.conf", "AWS access key id", RCLONE_ID),
    Planted("/root/.config/rclone/rclone.conf", "secret by its name", RCLONE_SECRET),
    Planted("/home/ubuntu/.s3cfg", "secret by its name", S3CMD_SECRET),
    Planted("/home/ubuntu/.ssh/id_ed25519", "private key", SSH_KEY),
    Planted("/data/.env", "API key (sk-)", ENV_OPENAI),
    Planted("/data/.env", "secret by its name", ENV_WANDB),
    Planted("/data/scripts/serve_dp6.sh", "secret by its name", API_KEY),
    Planted("/root/.bash_history", "Hugging Face token", HIST_HF),
    Planted("/root/.bash_history", "password on a command line", HIST_PASSWORD),
)

#: The process environment the profile gives the SGLang server sglang-dp0 (gpulab/host/lab.py).
ENVIRON: tuple[Planted, ...] = (Planted("environ:HF_TOKEN", "Hugging Face token", HF_ENV),)

_FILES: dict[str, str] = {
    "root/.cache/huggingface/token": HF,
    "root/.aws/credentials": (
        f"[default]\naws_access_key_id = {AWS_ID}\naws_secret_access_key = {AWS_SECRET}\nregion = us-east-2\n"
    ),
    "root/.aws/config": "[default]\nregion = us-east-2\noutput = json\n",
    "root/.aws/sso/cache/4f1c2a0d9e.json": (
        '{"startUrl": "https://example-lab.awsapps.com/start", "region": "us-east-2", '
        f'"accessToken": "{AWS_SSO}", "expiresAt": "2026-12-08T02:11:09Z"}}\n'
    ),
    "root/.netrc": f"machine api.wandb.ai\n  login user\n  password {WANDB}\n",
    "root/.docker/config.json": (
        '{\n\t"auths": {\n\t\t"nvcr.io": {\n\t\t\t"auth": "' + DOCKER_AUTH + '"\n\t\t}\n\t}\n}\n'
    ),
    "root/.git-credentials": f"https://mlops-bot:{GIT_PAT}@github.com\n",
    "root/.config/gh/hosts.yml": (
        f"github.com:\n    git_protocol: https\n    users:\n        mlops-bot:\n"
        f"            oauth_token: {GH_OAUTH}\n    oauth_token: {GH_OAUTH}\n    user: mlops-bot\n"
    ),
    "root/.kube/config": (
        "apiVersion: v1\nclusters:\n- cluster:\n    server: https://10.20.0.1:6443\n  name: eval\n"
        "contexts:\n- context:\n    cluster: eval\n    user: eval-sa\n  name: eval\ncurrent-context: eval\n"
        f"kind: Config\nusers:\n- name: eval-sa\n  user:\n    token: {KUBE_JWT}\n"
    ),
    "root/.config/rclone/rclone.conf": (
        f"[results]\ntype = s3\nprovider = AWS\naccess_key_id = {RCLONE_ID}\n"
        f"secret_access_key = {RCLONE_SECRET}\nregion = us-east-2\n"
    ),
    "home/ubuntu/.s3cfg": (
        f"[default]\naccess_key = {RCLONE_ID}\nsecret_key = {S3CMD_SECRET}\nhost_base = s3.amazonaws.com\n"
        "use_https = True\n"
    ),
    "home/ubuntu/.ssh/id_ed25519": SSH_KEY + "\n",
    "home/ubuntu/.ssh/id_ed25519.pub": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI" + _s(43) + " deploy@b200\n",
    "data/.env": (
        "MODEL_PATH=/data/models/Qwen3-235B-A22B-FP8\nTOKENIZERS_PARALLELISM=false\nMAX_TOTAL_TOKENS=65536\n"
        f"OPENAI_API_KEY={ENV_OPENAI}\nWANDB_API_KEY={ENV_WANDB}\nWANDB_PROJECT=qwen3-eval\n"
    ),
    "data/scripts/serve_dp6.sh": (
        "#!/bin/bash\nset -euo pipefail\nexport CUDA_VISIBLE_DEVICES=6\n"
        "python3 -m sglang.launch_server --model-path /data/models/Qwen3-235B-A22B-FP8 --port 30006 \\\n"
        f"  --base-gpu-id 6 --tp 1 --api-key {API_KEY} --log-file /data/logs/sglang-dp6.log\n"
    ),
    "root/.bash_history": (
        "nvidia-smi\ncd /data\n"
        f"huggingface-cli login --token {HIST_HF}\n"
        "python3 -m sglang.launch_server --model-path /data/models/Qwen3-235B-A22B-FP8 --port 30000\n"
        f"mysql -u eval -p{HIST_PASSWORD} -h 10.20.0.5 results\n"
        "tail -f /data/logs/sglang-dp0.log\n"
    ),
}
_SECRET_FILES = {".ssh/id_ed25519", ".netrc", ".git-credentials", ".aws/credentials", ".docker/config.json"}
_MTIME = 1_762_000_000


def plant(root: str | os.PathLike[str]) -> dict[str, int]:
    """Write every file of the set under ``root`` (the host's ``/``); return counts (files, bytes)."""
    base = Path(root)
    n = total = 0
    for rel, text in _FILES.items():
        p = base / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        if any(rel.endswith(s) for s in _SECRET_FILES) or "/.ssh/" in rel:
            p.chmod(0o600)
        os.utime(p, (_MTIME + n, _MTIME + n))
        n += 1
        total += len(text)
    return {"files": n, "bytes": total, "large": 0, "links": 0}
