#!/usr/bin/env bash
# GPU smoke check: at most ~3 minutes on one GPU. Does rtp train, save, fault and resume there?
# Short `rtp train-local` runs (preset small-cpu, 6 steps, one rank): every checkpoint mode
# (async also with the fast tier off),
# an in-process exception and a SIGKILL per checkpointing mode, a save slowed past the soft
# timeout, and a process-group probe (benchmarks/gpu_smoke.py says what each must show).
#
#   $OUT/gpu-smoke.json          every check: pass/fail/skipped, seconds, key numbers, command
#   $OUT/gpu-smoke-logs.tar.gz   each run's output and train.log
#
# Exits 0 only when every check passed. Readies the machine first (benchmarks/gpu_setup.sh:
# missing wheels from benchmarks/wheels, nothing downloaded, torch never touched).
#
#   gpu_smoke.sh                 on the GPU machine ($OUT, else /tmp/rtp-gpu-smoke/out)
#   gpu_smoke.sh --dry-run       anywhere: builds, parses and resolves every command; no GPU
#   gpu_smoke.sh --cpu           the same runs on CPU (tiny-cpu, gloo): slow, for checking it
# Further arguments go to `python -m benchmarks.gpu_smoke` (e.g. --jobs 2 --budget 900).
set -uo pipefail
cd "$(dirname "$0")/.."
TAG=gpu_smoke
SETUP_MODE=run
case "${1:-}" in
  --dry-run) SETUP_MODE=dry ;;
  --cpu) SETUP_MODE=install ;;
  --help | -h) sed -n '2,16p' "$0"; exit 0 ;;
  "" | --*) ;;
  *) echo "usage: $0 [--dry-run | --cpu] [gpu_smoke.py options]" >&2; exit 2 ;;
esac
# shellcheck source=benchmarks/gpu_setup.sh
. benchmarks/gpu_setup.sh
gpu_setup || exit 2
if [ "$SETUP_READY" != 1 ]; then
  exit 0  # a dry run on a machine that lacks packages: gpu_setup said what would be installed
fi
exec "$PYTHON" -m benchmarks.gpu_smoke "$@"
