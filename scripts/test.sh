#!/usr/bin/env bash
# Set up from nothing and run every test: the plugin's own tests, the lab, the suites against
# lab hosts, a smoke run of each benchmark, and lint. Run as root on Debian 12.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# The lab fixture boots hosts once per session, tears them down at its end, and sweeps hosts left by
# a test session that was killed; hosts of a running demo or another session are left alone.
.venv/bin/python -m pytest tests -q -ra --durations=20 -p no:cacheprovider "$@"
