#!/usr/bin/env bash
# GPU check: runs on a CUDA machine whose Python already has torch >= 2.6 (e.g. an H200 with
# Python 3.12 and torch 2.11), in under 8 minutes, and writes JSON under $OUT:
#
#   gpu-checkpoint.json  checkpoint efficiency at ~1B parameters (preset gpu-1b, ~12 GB of
#                        fp32 weights + AdamW state): off vs sync vs torch-async vs NVRx async
#   gpu-recovery.json    in-process restart time on NCCL (exception@N:0, one rank)
#   gpu-throughput.json  bf16 throughput and MFU of gpu-1b: the rtp stack vs a bare FSDP loop
#   gpu-check.json       torch/CUDA/device, and each part's exit code and seconds
#
# Torch is never installed or replaced. The project is installed with --no-deps; of its
# runtime modules only the missing ones are installed, with --no-deps, from the wheels in
# ${RTP_WHEELS:-benchmarks/wheels} (git-ignored; e.g. nvidia-resiliency-ext 0.4.1 for cp312 and
# whatever of pyyaml, psutil, defusedxml, nvidia-ml-py the machine lacks: `pip download
# --no-deps --python-version 3.12 --only-binary=:all: -d benchmarks/wheels ...` on a machine
# with network access; keep it under 64 MiB). Nothing is downloaded here. kfp and mlflow
# are not needed: the trainer and these benchmarks do not import them (checked below).
#
# `gpu_check.sh --dry-run` does everything up to the benchmarks without a GPU and without
# installing: checks torch, lists what would be installed from which wheel, checks the
# imports with kfp and mlflow made unimportable, and parses every benchmark command line.
# `--install-only` installs as on the GPU machine and runs those checks, without a GPU
# and without the benchmarks (to try the install path in a throwaway venv).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${RTP_WHEELS:-benchmarks/wheels}
OUT_DIR=${OUT:-/tmp/rtp-gpu-check}
DRY_RUN=0
INSTALL_ONLY=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  --install-only) INSTALL_ONLY=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --install-only]" >&2; exit 2 ;;
esac
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # works even where the editable install cannot
STARTED=$(date +%s)

# 1. torch: already there, >= 2.6, with CUDA (not needed for a dry run).
"$PYTHON" - "$((DRY_RUN + INSTALL_ONLY))" <<'PY' || exit 2
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: this Python has no torch: it needs torch >= 2.6 with CUDA installed (the check never installs torch)")
version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if version < (2, 6):
    sys.exit(f"gpu_check: torch {torch.__version__} is older than 2.6 (FSDP2 fully_shard and MixedPrecisionPolicy)")
if not torch.cuda.is_available() and sys.argv[1] == "0":
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (use --dry-run to check the install path only)")
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device (dry run)"
print(f"gpu_check: python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, {device}")
PY

# 2. Missing runtime modules -> wheels to install (module:distribution).
MISSING=$("$PYTHON" - <<'PY'
import importlib.util
needed = {
    "nvidia_resiliency_ext": "nvidia-resiliency-ext==0.4.1",
    "numpy": "numpy",
    "safetensors": "safetensors",
    "yaml": "pyyaml",
    "psutil": "psutil",
    "defusedxml": "defusedxml",
    "pynvml": "nvidia-ml-py",
    "packaging": "packaging",
}
print(" ".join(dist for module, dist in needed.items() if importlib.util.find_spec(module) is None))
PY
)
echo "gpu_check: missing runtime packages: ${MISSING:-none}"
if [ "$DRY_RUN" = 1 ]; then
  for dist in $MISSING; do
    name=$(echo "${dist%%==*}" | tr '-' '_')
    found=$(ls "$WHEELS"/"${name}"-*.whl 2>/dev/null | head -1)
    echo "gpu_check: would install ${dist} --no-deps from ${found:-NOTHING (no wheel in $WHEELS)}"
  done
  echo "gpu_check: would run: $PYTHON -m pip install --no-deps --no-build-isolation -e ."
else
  if [ -n "$MISSING" ]; then
    # shellcheck disable=SC2086  # one argument per distribution
    "$PYTHON" -m pip install --no-index --find-links "$WHEELS" --no-deps $MISSING || {
      echo "gpu_check: could not install $MISSING from $WHEELS (see the header)" >&2
      exit 2
    }
  fi
  "$PYTHON" -m pip install --no-deps --no-build-isolation -e . >"$OUT_DIR/pip-editable.log" 2>&1 ||
    echo "gpu_check: the editable install failed (see $OUT_DIR/pip-editable.log; old setuptools need the wheel package); running from the checkout (PYTHONPATH)" >&2
fi

# 3. The trainer and the benchmarks below import neither kfp nor mlflow; their flags parse.
if [ "$DRY_RUN" = 1 ] && [ -n "$MISSING" ]; then
  echo "gpu_check: dry run: imports not checked (packages missing; --install-only installs them)"
  exit 0
fi
"$PYTHON" - <<'PY' || exit 2
import importlib, importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("kfp", "mlflow"):
            raise ImportError(f"{name} must not be needed on the GPU machine")
        return None

sys.meta_path.insert(0, Absent())
for module in ("trainer.launch", "trainer.loop", "trainer.resilience", "trainer.__main__",
               "benchmarks.throughput", "benchmarks.bare_fsdp", "benchmarks.checkpoint",
               "benchmarks.recovery", "nvidia_resiliency_ext.inprocess",
               "nvidia_resiliency_ext.fault_tolerance", "nvidia_resiliency_ext.checkpointing.async_ckpt"):
    importlib.import_module(module)
from rtp_cli.main import build_parser
parser = build_parser()
for argv in (
    ["bench", "checkpoint", "--preset", "gpu-1b", "--modes", "off,sync,torch-async,async", "--nproc", "1", "--steps", "8", "--every", "4"],
    ["bench", "checkpoint", "--preset", "gpu-1b", "--modes", "off,sync,torch-async", "--nproc", "1", "--steps", "8", "--every", "4", "--local-every", "0"],
    ["bench", "recovery", "--mechanisms", "inprocess", "--nproc", "1", "--steps", "20", "--every", "5", "--fault-steps", "8,14"],
    ["bench", "throughput", "--preset", "gpu-1b", "--steps", "30", "--every", "15", "--nproc", "1"],
    ["bench", "throughput", "--preset", "gpu-1b", "--steps", "30", "--every", "15", "--nproc", "1", "--override", "checkpoint.local_every_steps=0"],
):
    parser.parse_args(argv)
print("gpu_check: imports without kfp/mlflow and benchmark flags: ok")
PY

if [ "$DRY_RUN" = 1 ] || [ "$INSTALL_ONLY" = 1 ]; then
  echo "gpu_check: checks done in $(($(date +%s) - STARTED)) s (no benchmarks run)"
  exit 0
fi

# 4. The measurements, each under its own time limit (all together < 8 minutes).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
declare -A RC SECONDS_TAKEN
run_part() {  # name, time limit in seconds, rtp arguments...
  local name=$1 limit=$2 start
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$PYTHON" -m rtp_cli.main "$@" --json "$OUT_DIR/gpu-$name.json" \
    >"$OUT_DIR/gpu-$name.log" 2>&1
  RC[$name]=$?
  SECONDS_TAKEN[$name]=$(($(date +%s) - start))
  echo "gpu_check: $name exit ${RC[$name]} after ${SECONDS_TAKEN[$name]} s"
  tail -8 "$OUT_DIR/gpu-$name.log"
}

# The async mode's host snapshot lives in /dev/shm (~12 GB for gpu-1b), and so do the fast
# tier's two slot files (~12 GB each); containers often mount 64 MB there. Without room for
# both, the fast tier is turned off for the 1B runs, and without room for the snapshot the
# async mode is left out (each said so) rather than failing.
MODES=off,sync,torch-async,async
TIER=()
SHM_KB=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
if [ "${SHM_KB:-0}" -lt $((40 * 1024 * 1024)) ]; then
  echo "gpu_check: /dev/shm has $((${SHM_KB:-0} / 1024)) MB free, the fast tier's two slots and the async snapshot need ~36 GB: fast tier off for the 1B runs" >&2
  TIER=(--override checkpoint.local_every_steps=0)
fi
if [ "${SHM_KB:-0}" -lt $((14 * 1024 * 1024)) ]; then
  echo "gpu_check: /dev/shm has $((${SHM_KB:-0} / 1024)) MB free, the async snapshot needs ~12 GB: async left out" >&2
  MODES=off,sync,torch-async
fi
CKPT_TIER=()
[ ${#TIER[@]} -gt 0 ] && CKPT_TIER=(--local-every 0)
run_part checkpoint 220 bench checkpoint --preset gpu-1b --modes "$MODES" --nproc 1 --steps 8 --every 4 "${CKPT_TIER[@]}"
run_part recovery 90 bench recovery --mechanisms inprocess --nproc 1 --steps 20 --every 5 --fault-steps 8,14
run_part throughput 140 bench throughput --preset gpu-1b --steps 30 --every 15 --nproc 1 "${TIER[@]}"

"$PYTHON" - "$OUT_DIR" "${RC[checkpoint]}" "${RC[recovery]}" "${RC[throughput]}" \
  "${SECONDS_TAKEN[checkpoint]}" "${SECONDS_TAKEN[recovery]}" "${SECONDS_TAKEN[throughput]}" "$MODES" \
  "${#TIER[@]}" <<'PY'
import json, sys
from pathlib import Path
import torch
out, rc_c, rc_r, rc_t, s_c, s_r, s_t, modes, tier_off = sys.argv[1:]
check = {
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "device": torch.cuda.get_device_name(0),
    "python": sys.version.split()[0],
    "checkpoint_modes": modes.split(","),
    "fast_tier_in_1b_runs": tier_off == "0",
    "parts": {
        name: {"exit_code": int(rc), "seconds": int(s), "json": f"gpu-{name}.json"}
        for name, rc, s in (("checkpoint", rc_c, s_c), ("recovery", rc_r, s_r), ("throughput", rc_t, s_t))
    },
}
Path(out, "gpu-check.json").write_text(json.dumps(check, indent=2) + "\n")
print(json.dumps(check, indent=2))
PY
echo "gpu_check: done in $(($(date +%s) - STARTED)) s; JSON under $OUT_DIR"
[ "${RC[checkpoint]}" = 0 ] && [ "${RC[recovery]}" = 0 ] && [ "${RC[throughput]}" = 0 ]
