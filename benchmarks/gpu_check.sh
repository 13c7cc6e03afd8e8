#!/usr/bin/env bash
# GPU check: the checkpoint benchmark on CUDA with a ~1B-parameter model (preset gpu-1b:
# ~1.0B parameters, ~12 GB of fp32 weights + AdamW state per checkpoint), comparing sync,
# torch-async and async (NVRx) side by side. 1 rank, or 2 when the machine has 2+ GPUs.
# Budget: under 8 minutes. Prints the benchmark's JSON and table; with OUT set (the device
# tool sets it) the JSON is also written to $OUT/gpu-bench.json.
#
# Needs: torch 2.13.0 with CUDA on the machine, or wheels carried along: put the wheels
# of torch==2.13.0 (a CUDA build), nvidia-resiliency-ext==0.4.1, kfp==2.17.3,
# kfp-kubernetes==2.17.3, mlflow==3.17.2, boto3 and their dependencies in
# ${RTP_WHEELS:-benchmarks/wheels} (e.g. `pip download -d benchmarks/wheels .` on a machine
# with network access and the same Python); nothing is downloaded here. The project itself
# is installed without build isolation, so setuptools must be installed already. (A CUDA
# torch wheel is ~1 GB: where only a small carry fits, use a machine that has torch.)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${RTP_WHEELS:-benchmarks/wheels}

if ! "$PYTHON" -c "import trainer.checkpointing, rtp_cli.main" 2>/dev/null; then
  if [ -d "$WHEELS" ]; then
    "$PYTHON" -m pip install --no-index --find-links "$WHEELS" --no-build-isolation -e .
  else
    echo "gpu_check: rtp's dependencies are not installed and $WHEELS does not exist (see the header)" >&2
    exit 2
  fi
fi
"$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
PY

# The async mode's host snapshot lives in shared memory (/dev/shm): ~12 GB, all ranks together.
# Containers often mount a 64 MB /dev/shm (docker run --shm-size, a Kubernetes emptyDir
# with medium: Memory). Fail early with the reason rather than mid-benchmark.
SHM_KB=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ' || echo 0)
if [ "${SHM_KB:-0}" -lt $((14 * 1024 * 1024)) ]; then
  echo "gpu_check: /dev/shm has $((${SHM_KB:-0} / 1024)) MB free; the async snapshot of gpu-1b needs ~12 GB (all ranks together)" >&2
  exit 2
fi

NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
NPROC=1
if [ "$NGPU" -ge 2 ]; then NPROC=2; fi
JSON=${OUT:-/tmp}/gpu-bench.json
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
timeout 450 "$PYTHON" -m rtp_cli.main bench checkpoint --preset gpu-1b --modes off,sync,torch-async,async \
  --nproc "$NPROC" --steps 12 --every 4 --json "$JSON"
