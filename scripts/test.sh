#!/usr/bin/env bash
# Set up from nothing and run every test: the plugin's own tests, the lab, the suites against
# lab hosts, a smoke run of each benchmark, and lint. Run as root on Debian 12.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# The lab fixture boots hosts once per session, tears them down at its end, and sweeps hosts left by
# a test session that was killed; hosts of a running demo or another session are left alone.
# Every lab host runs a systemd, which takes several inotify instances: the kernel's default of 128
# per user runs out with a Slurm cluster of lab hosts up beside the other tests' hosts ("systemd
# died while booting"). Raise it for the run and put the machine's value back when it ends.
limit=/proc/sys/fs/inotify/max_user_instances
was=$(cat "$limit" 2>/dev/null || echo "")
if [[ -n "$was" ]] && ((was < 1024)); then
  echo 1024 >"$limit" && trap 'echo "$was" >"$limit"' EXIT
fi
# Two workers, one test file each at a time (--dist loadfile): a file's lab hosts are booted by one
# worker, once. Arguments after the script's name go to pytest and win (-n 0 runs serially).
.venv/bin/python -m pytest tests -q -ra --durations=20 -p no:cacheprovider -n 2 --dist loadfile "$@"
