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

# Slurm and munge for the lab's real Slurm cluster (gpulab/slurm.py, tests/test_slurm_lab.py).
# Optional: where they cannot be installed, the Slurm tests skip and say so. Installing must not
# start or enable any daemon on this machine (the lab runs its own with its own config and key):
# a policy-rc.d that denies every start (invoke-rc.d(8)) while apt runs, then the units disabled.
need_slurm=()
for pkg in slurmctld slurmd slurm-client munge; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_slurm+=("$pkg")
done
if ((${#need_slurm[@]})); then
  echo "setup: apt-get install ${need_slurm[*]} (daemons neither started nor enabled)"
  made_policy=""
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
  fi
  ((${#need_apt[@]})) || apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_slurm[@]}" >/dev/null \
    || echo "setup: WARNING: could not install ${need_slurm[*]}: the Slurm lab tests will skip" >&2
  [[ -n "$made_policy" ]] && rm -f /usr/sbin/policy-rc.d
  systemctl disable munge.service slurmctld.service slurmd.service >/dev/null 2>&1 || true
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
