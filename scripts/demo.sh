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
cleanup() {
  [[ -n $MOTO_PID ]] && kill "$MOTO_PID" 2>/dev/null || true
  $PY -m gpulab down --all >/dev/null 2>&1 || true
}
trap cleanup EXIT
$PY -m gpulab down --all >/dev/null 2>&1 || true

echo "== 1/3 Proxmox host: restore GPU peer-to-peer DMA (suites/p2p)"
$PY -m gpulab up proxmox-rtx6000 --name pve-demo
read -r -a P2P_ARGS <<<"$($PY -m gpulab pytest-args pve-demo)"
$PY -m pytest suites/p2p "${P2P_ARGS[@]}" --stop-timeout=5 --report-name="p2p-pve-demo-$STAMP" -p no:cacheprovider || P2P_RC=$?
echo "   second run on the repaired host (everything should pass, nothing stopped):"
$PY -m pytest suites/p2p "${P2P_ARGS[@]}" --report-name="p2p-pve-demo-rerun-$STAMP" -p no:cacheprovider -q || P2P_RC=$?

echo "== 2/3 B200 node: decommission with backup to a local folder and to S3 (suites/decommission)"
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo AWS_DEFAULT_REGION=us-east-1
.venv/bin/moto_server -H 127.0.0.1 -p "$PORT" >/tmp/gpuhost-demo-moto.log 2>&1 &
MOTO_PID=$!
for _ in $(seq 50); do curl -fs "http://127.0.0.1:$PORT/" >/dev/null 2>&1 && break; sleep 0.2; done
$PY - "$PORT" <<'PYEOF'
import sys, boto3
boto3.client("s3", endpoint_url=f"http://127.0.0.1:{sys.argv[1]}").create_bucket(Bucket="node-handback")
PYEOF
$PY -m gpulab up b200-nvl8 --name b200-demo
read -r -a B200_ARGS <<<"$($PY -m gpulab pytest-args b200-demo)"
$PY -m pytest suites/decommission "${B200_ARGS[@]}" --manifest=fixtures/manifests/b200-node-backup.yaml \
  --backup-dir="backups/b200-demo" --backup-to="s3://node-handback/b200-demo" \
  --s3-endpoint="http://127.0.0.1:$PORT" --report-name="decommission-b200-demo-$STAMP" -p no:cacheprovider || DEC_RC=$?

echo "== 3/3 Fleet health check of both hosts (suites/health, check only)"
$PY -m pytest suites/health "${P2P_ARGS[@]/--container=*/}" "${B200_ARGS[@]}" --check-only -n 2 \
  --report-name="health-demo-$STAMP" -p no:cacheprovider -q || true

echo
echo "Reports:"
ls -1 reports/*"$STAMP"*.html 2>/dev/null | sed 's/^/  /'
echo "Backup: backups/b200-demo"
exit $(( ${P2P_RC:-0} || ${DEC_RC:-0} ))
