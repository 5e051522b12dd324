#!/usr/bin/env bash
# Install everything the demo and the tests need, from nothing, on Debian 12 as root. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

# pdsh: the fleet-sweep baseline of benchmarks/bench_health.py (pdsh -R ssh, one login per host).
need_apt=()
for pkg in ca-certificates python3 python3-venv python3-dev openssh-server openssh-client fuse3 libfuse3-3 rsync \
           iproute2 psmisc lsof procps util-linux systemd dbus vim curl chromium awscli git python3-setproctitle gcc \
           pdsh; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  echo "setup: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# Slurm and munge for the lab's real Slurm cluster (gpulab/slurm/cluster.py, tests/nodecheck/test_slurm_lab.py).
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
if ! .venv/bin/python -c "import pytest_gpuhost, mfusepy, moto, testinfra, pytest_html, xdist, ansible" 2>/dev/null \
   || [[ pyproject.toml -nt .venv/.installed ]]; then
  echo "setup: pip install -e .[dev]"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -m pip install -q -e '.[dev]' 2>&1 | grep -Ev '^WARNING: Location|^ *$' || true
  .venv/bin/python -c "import pytest_gpuhost, mfusepy, moto, testinfra, pytest_html, xdist, ansible" \
    || { echo "setup: pip install failed" >&2; exit 1; }
  touch .venv/.installed
fi

# torch's CPU build, for the tests that run the torch all-reduce program with real torch processes
# (tests/p2p/test_nccl_torch.py; pytest_gpuhost/modules/nccl_torch.py). Only from a wheel pip finds
# without an index (find-links: this kind of machine keeps the CPU build on disk): PyPI's torch for
# Linux x86_64 is a CUDA build of several GB. Not in the dev extra for that reason. Without it
# those tests skip and say so. Measured here: about 46 s and 754 MB in .venv.
TORCH=torch==2.13.0
if ! .venv/bin/python -c "import torch.distributed" 2>/dev/null; then
  if out=$(.venv/bin/python -m pip install -q --no-index --no-deps "$TORCH" 2>&1); then
    echo "setup: pip install $TORCH (from a local wheel)"
    .venv/bin/python -m pip install -q "$TORCH" 2>&1 | grep -Ev '^WARNING: Location|^ *$' || true
  else
    echo "setup: WARNING: no local wheel of $TORCH ($(printf '%s' "$out" | grep -v '^WARNING: Location' | tail -n 1)):" \
      "tests/p2p/test_nccl_torch.py will skip its runs" >&2
  fi
fi

# ---- real-kernel tier (gpulab/vm, tests marked realkernel) -------------------------------------
# QEMU, busybox-static, cpio, kmod (depmod), xz and e2fsprogs (mkfs.ext4: the systemd guest's disk)
# from Debian; the two kernel images are fetched with apt-get download into the VM cache (never
# installed as this machine's kernel).
VM_CACHE=${GPUHOST_VM_CACHE:-/var/cache/gpuhost-vm}
need_vm=()
for t in qemu-system-x86_64:qemu-system-x86 cpio:cpio depmod:kmod xz:xz-utils mkfs.ext4:e2fsprogs; do
  command -v "${t%%:*}" >/dev/null 2>&1 || [[ -x /usr/sbin/${t%%:*} ]] || need_vm+=("${t#*:}")
done
[[ -x /bin/busybox ]] && /bin/busybox --list 2>/dev/null | grep -qx insmod || need_vm+=(busybox-static)
if ((${#need_vm[@]})); then
  echo "setup: apt-get install ${need_vm[*]} (real-kernel VMs)"
  apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_vm[@]}" >/dev/null \
    || echo "setup: WARNING: could not install ${need_vm[*]}: the realkernel tests will skip" >&2
fi
mkdir -p "$VM_CACHE/debs"
for pat in 'linux-image-6\.1\.0-[0-9]+-amd64-unsigned' 'linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned'; do
  pkg=$(apt-cache search --names-only "^${pat}\$" 2>/dev/null | awk '{print $1}' | sort -V | tail -1)
  if [[ -z "$pkg" ]]; then
    echo "setup: WARNING: no package matches ^$pat (bookworm and bookworm-updates carry them)" >&2
  elif ! compgen -G "$VM_CACHE/debs/${pkg}_*.deb" >/dev/null; then
    echo "setup: apt-get download $pkg into $VM_CACHE/debs"
    (cd "$VM_CACHE/debs" && apt-get download -q "$pkg" >/dev/null 2>&1) \
      || echo "setup: WARNING: could not download $pkg: the realkernel tests will skip" >&2
  fi
done
# ---- end of the real-kernel tier ----------------------------------------------------------------

modprobe fuse 2>/dev/null || true
[[ -e /dev/fuse ]] || { echo "setup: /dev/fuse is missing: the lab needs FUSE" >&2; exit 1; }
echo "setup: ready (.venv: $(.venv/bin/python --version))"
