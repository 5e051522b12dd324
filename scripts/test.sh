#!/usr/bin/env bash
# Set up from nothing and run every test: the plugin's own tests, the lab, the suites against
# lab hosts, a smoke run of each benchmark, and lint. Run as root on Debian 12.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/python -m gpulab down --all >/dev/null 2>&1 || true   # leftovers of a crashed run
trap '.venv/bin/python -m gpulab down --all >/dev/null 2>&1 || true' EXIT
.venv/bin/python -m pytest tests -q -ra --durations=20 -p no:cacheprovider "$@"
