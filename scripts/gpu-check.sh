#!/bin/sh
# On a machine with a real NVIDIA GPU: save what nvidia-smi (and nvbandwidth, if installed) print,
# run the torch all-reduce program on NCCL, the health suite and the P2P steps (--check-only:
# nothing is changed) against local://, and compare the real output with the plugin's parsers,
# NVML, the P2P probe and the NCCL collective as nccl_run finds and runs it (scripts/gpu_check.py).
# Everything lands in DIR (MANIFEST.txt says which command made which file); copy it to
# fixtures/outputs/gpu-check-<host>-<date>/. Without a GPU it fails at once with one line.
#   usage: scripts/gpu-check.sh DIR
set -u
fail() { echo "gpu-check: $*" >&2; exit 2; }
[ $# -eq 1 ] && [ -n "$1" ] || fail "usage: scripts/gpu-check.sh DIR (a folder for the captures)"
root=$(cd "$(dirname "$0")/.." && pwd)
command -v nvidia-smi >/dev/null 2>&1 || fail "no nvidia-smi on PATH: no NVIDIA driver on this machine; run this on a machine with an NVIDIA GPU"
smi=$(nvidia-smi -L 2>&1) || fail "nvidia-smi -L failed: $(printf '%s' "$smi" | head -n 1); no usable NVIDIA GPU here"
printf '%s\n' "$smi" | grep -q '^GPU [0-9]' || fail "nvidia-smi -L lists no GPU: $(printf '%s' "$smi" | head -n 1)"
py=${GPUCHECK_PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || fail "no Python at $py: run scripts/setup.sh first (or set GPUCHECK_PYTHON)"
mkdir -p "$1" || fail "cannot create $1"
out=$(cd "$1" && pwd)
cd "$root" || fail "cannot enter $root"
export GPUHOST_STATE_DIR="$out/state"  # the checks' own state (Xid cursor, journals) stays in DIR
: >"$out/MANIFEST.txt"
cap() {  # FILE COMMAND...: stdout to FILE, stderr to FILE.stderr, one MANIFEST line with the exit code
  f=$1; shift
  "$@" >"$out/$f" 2>"$out/$f.stderr"
  printf '%s\trc %s\t%s\n' "$f" "$?" "$*" >>"$out/MANIFEST.txt"
}
cap nvidia-smi-L.txt nvidia-smi -L
cap nvidia-smi-q.txt nvidia-smi -q
cap nvidia-smi-topo-m.txt nvidia-smi topo -m
cap nvidia-smi-topo-p2p-r.txt nvidia-smi topo -p2p r
cap nvidia-smi-nvlink-s.txt nvidia-smi nvlink -s
cap nvidia-smi-query-gpu.csv nvidia-smi --format=csv \
  --query-gpu=index,pci.bus_id,name,driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max
if command -v nvbandwidth >/dev/null 2>&1; then
  cap nvbandwidth-d2d-read-ce.txt nvbandwidth -t device_to_device_memcpy_read_ce
  cap nvbandwidth-d2d-read-ce.json nvbandwidth -t device_to_device_memcpy_read_ce -j
fi
# The torch all-reduce program (pytest_gpuhost/modules/nccl_torch.py) on real NCCL, as nccl_run sends
# it: source on stdin, bounded, NCCL's INFO lines. GPUCHECK_TORCH_PYTHON (default python3) must have
# a CUDA build of torch. Every GPU as the P2P arm and the control arm, then one GPU (the code path:
# NCCL's init, CUDA events, the device lines' PCI ids, the data check; one GPU proves no P2P).
tpy=${GPUCHECK_TORCH_PYTHON:-python3}
prog="$root/pytest_gpuhost/modules/nccl_torch.py"
boot=$("$py" -c 'from pytest_gpuhost.modules.nccl_torch import BOOT; print(BOOT)')
ngpu=$(printf '%s\n' "$smi" | grep -c '^GPU [0-9]')
nccl_args="-b 8M -e 128M -f 2 -c 1 -w 5 -n 20"
cap nccl-torch-probe.json "$tpy" -c "$boot" --probe <"$prog"
# the runs only where that Python's torch has NCCL (the probe's "nccl": true); gpu_check.py says
# "not checked" otherwise, as the suites do
if grep -q '"nccl": true' "$out/nccl-torch-probe.json"; then
  # shellcheck disable=SC2086  # nccl_args is words on purpose
  cap nccl-torch-p2p-g$ngpu.txt env CUDA_DEVICE_ORDER=PCI_BUS_ID NCCL_DEBUG=INFO NCCL_P2P_DISABLE=0 \
    timeout -k 5 300 "$tpy" -c "$boot" $nccl_args -g "$ngpu" <"$prog"
  # shellcheck disable=SC2086
  cap nccl-torch-control-g$ngpu.txt env CUDA_DEVICE_ORDER=PCI_BUS_ID NCCL_DEBUG=INFO NCCL_P2P_DISABLE=1 \
    timeout -k 5 300 "$tpy" -c "$boot" $nccl_args -g "$ngpu" <"$prog"
  if [ "$ngpu" -gt 1 ]; then
    # shellcheck disable=SC2086
    cap nccl-torch-g1.txt env CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0 NCCL_DEBUG=INFO \
      timeout -k 5 300 "$tpy" -c "$boot" $nccl_args -g 1 <"$prog"
  fi
fi
cap health.txt "$py" -m pytest suites/health --host=local:// --check-only --report-dir="$out/reports" -p no:cacheprovider -q
cap p2p-check-only.txt "$py" -m pytest suites/p2p --host=local:// --check-only --report-dir="$out/reports" -p no:cacheprovider -q
exec "$py" scripts/gpu_check.py "$out"
