#!/usr/bin/env bash
# Install everything the demo and the tests need, from nothing, on Debian 12 as root. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for pkg in ca-certificates python3 python3-venv python3-dev openssh-server openssh-client fuse3 libfuse3-3 rsync \
           iproute2 psmisc lsof procps util-linux systemd dbus vim curl chromium awscli git python3-setproctitle; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  echo "setup: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import pytest_gpuhost, mfusepy, moto, testinfra, pytest_html, xdist" 2>/dev/null \
   || [[ pyproject.toml -nt .venv/.installed ]]; then
  echo "setup: pip install -e .[dev]"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -m pip install -q -e '.[dev]' 2>&1 | grep -Ev '^WARNING: Location|^ *$' || true
  .venv/bin/python -c "import pytest_gpuhost, mfusepy, moto, testinfra, pytest_html, xdist" \
    || { echo "setup: pip install failed" >&2; exit 1; }
  touch .venv/.installed
fi
modprobe fuse 2>/dev/null || true
[[ -e /dev/fuse ]] || { echo "setup: /dev/fuse is missing: the lab needs FUSE" >&2; exit 1; }
echo "setup: ready (.venv: $(.venv/bin/python --version))"
