#!/usr/bin/env bash
# The main job, on the lab: boot the Proxmox host whose IOMMU blocks GPU P2P and repair it with
# suites/p2p; boot the rented B200 node and empty it with suites/decommission (backup to a local
# folder and to a real S3 endpoint on loopback); then a fleet health check of both. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
PY=.venv/bin/python
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
MOTO_PID=
# What the check-only health run keeps between runs (modules/health/controller_state.py) is about
# lab hosts that are gone when the demo ends: kept in a folder of the demo's own, removed at exit.
GPUHOST_CONTROLLER_STATE_DIR=$(mktemp -d /tmp/gpuhost-demo-state.XXXXXX)
export GPUHOST_CONTROLLER_STATE_DIR
cleanup() {
  [[ -n $MOTO_PID ]] && kill "$MOTO_PID" 2>/dev/null || true
  $PY -m gpulab down --all --match demo- >/dev/null 2>&1 || true
  rm -rf "$GPUHOST_CONTROLLER_STATE_DIR"
}
trap cleanup EXIT
$PY -m gpulab down --all --match demo- >/dev/null 2>&1 || true   # a crashed demo's leftovers

echo "== 1/4 Proxmox host: restore GPU peer-to-peer DMA (suites/p2p)"
$PY -m gpulab up proxmox-rtx6000 --name demo-pve
read -r -a P2P_ARGS <<<"$($PY -m gpulab pytest-args demo-pve)"
$PY -m pytest suites/p2p "${P2P_ARGS[@]}" --stop-timeout=5 --report-name="p2p-demo-pve-$STAMP" -p no:cacheprovider || P2P_RC=$?
echo "   second run on the repaired host (everything should pass, nothing stopped):"
$PY -m pytest suites/p2p "${P2P_ARGS[@]}" --report-name="p2p-demo-pve-rerun-$STAMP" -p no:cacheprovider -q || P2P_RC=$?

echo "== B200 node: booted, with an S3 endpoint on loopback"
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo AWS_DEFAULT_REGION=us-east-1
.venv/bin/moto_server -H 127.0.0.1 -p "$PORT" >/tmp/gpuhost-demo-moto.log 2>&1 &
MOTO_PID=$!
for _ in $(seq 50); do curl -fs "http://127.0.0.1:$PORT/" >/dev/null 2>&1 && break; sleep 0.2; done
$PY - "$PORT" <<'PYEOF'
import sys, boto3
boto3.client("s3", endpoint_url=f"http://127.0.0.1:{sys.argv[1]}").create_bucket(Bucket="node-handback")
PYEOF
$PY -m gpulab up b200-nvl8 --name demo-b200
read -r -a B200_ARGS <<<"$($PY -m gpulab pytest-args demo-b200)"
echo "== 2/4 B200 node: acceptance against what the order promised (suites/accept, before the job)"
$PY -m pytest suites/accept "${B200_ARGS[@]}" --order=fixtures/orders/b200-order.yaml \
  --report-name="accept-demo-b200-$STAMP" -p no:cacheprovider -q || ACC_RC=$?
echo "== 3/4 B200 node: decommission with backup to a local folder and to S3 (suites/decommission)"
$PY -m pytest suites/decommission "${B200_ARGS[@]}" --manifest=fixtures/manifests/b200-node-backup.yaml \
  --backup-dir="backups/demo-b200-$STAMP" --backup-to="s3://node-handback/demo-b200" \
  --s3-endpoint="http://127.0.0.1:$PORT" --report-name="decommission-demo-b200-$STAMP" -p no:cacheprovider || DEC_RC=$?

echo "== 4/4 Fleet health check of both hosts (suites/health, check only, two workers)"
KH=$(mktemp); cat /run/gpulab/demo-pve/known_hosts /run/gpulab/demo-b200/known_hosts >"$KH"
HOSTS=()
for a in "${P2P_ARGS[@]}" "${B200_ARGS[@]}"; do [[ $a == --host=* ]] && HOSTS+=("$a"); done
$PY -m pytest suites/health "${HOSTS[@]}" --ssh-identity=/run/gpulab/id_ed25519 --known-hosts="$KH" \
  --check-only -n 2 --report-name="health-demo-$STAMP" -p no:cacheprovider -q || true
rm -f "$KH"

echo
echo "Reports:"
ls -1 reports/*"$STAMP"*.html 2>/dev/null | sed 's/^/  /'
echo "Backup: backups/demo-b200-$STAMP"
exit $(( ${P2P_RC:-0} || ${ACC_RC:-0} || ${DEC_RC:-0} ))
