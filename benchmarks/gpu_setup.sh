# Sourced by gpu_smoke.sh and gpu_check.sh (not run alone): readies a CUDA machine whose
# Python already has torch >= 2.6 (an H200 with Python 3.12 and torch 2.11) for rtp.
#
# Torch is never installed or replaced. Of rtp's runtime modules only the missing ones are
# installed, --no-deps and --no-index, from the wheels in ${RTP_WHEELS:-benchmarks/wheels}
# (git-ignored; scripts/fetch-gpu-wheels.sh fills it on a machine with network access), then
# the project itself (--no-deps, editable; on failure it runs from the checkout). Nothing is
# downloaded here. kfp and mlflow are not needed: what runs here imports neither (checked).
#
# Expects TAG (message prefix) and SETUP_MODE: run (a GPU is required), dry (no GPU, nothing
# installed: what would be installed is listed) or install (install and check, no GPU).
# Sets PYTHON, PYTHONPATH and SETUP_READY (1 once the imports were checked: a dry run with
# packages missing stops before); returns non-zero on a problem, said in one line.

PYTHON=${PYTHON:-python3}
WHEELS=${RTP_WHEELS:-benchmarks/wheels}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # works even where the editable install cannot

gpu_setup() {
  SETUP_READY=0
  # 1. torch: already there, >= 2.6, with CUDA (not needed for a dry run or an install).
  "$PYTHON" - "$TAG" "$SETUP_MODE" <<'PY' || return 2
import sys
tag, mode = sys.argv[1:]
try:
    import torch
except ImportError:
    sys.exit(f"{tag}: this Python has no torch: it needs torch >= 2.6 with CUDA installed (never installed here)")
version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if version < (2, 6):
    sys.exit(f"{tag}: torch {torch.__version__} is older than 2.6 (FSDP2 fully_shard and MixedPrecisionPolicy)")
if not torch.cuda.is_available() and mode == "run":
    sys.exit(f"{tag}: torch {torch.__version__} sees no CUDA device (--dry-run checks the install path only)")
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"{tag}: python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, {device}")
PY

  # 2. Missing runtime modules -> the distributions to install from the wheels.
  local missing dist name found
  missing=$("$PYTHON" - <<'PY'
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
  echo "$TAG: missing runtime packages: ${missing:-none}"
  if [ "$SETUP_MODE" = dry ]; then
    for dist in $missing; do
      name=$(echo "${dist%%==*}" | tr '-' '_')
      found=$(ls "$WHEELS"/"${name}"-*.whl 2>/dev/null | head -1)
      echo "$TAG: would install ${dist} --no-deps from ${found:-NOTHING (no wheel in $WHEELS: run scripts/fetch-gpu-wheels.sh)}"
    done
    echo "$TAG: would run: $PYTHON -m pip install --no-deps --no-build-isolation -e ."
    if [ -n "$missing" ]; then
      echo "$TAG: dry run: imports not checked (packages missing; --install-only installs them)"
      return 0
    fi
  else
    if [ -n "$missing" ]; then
      # shellcheck disable=SC2086  # one argument per distribution
      "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps $missing || {
        echo "$TAG: could not install $missing from $WHEELS (run scripts/fetch-gpu-wheels.sh and carry benchmarks/wheels)" >&2
        return 2
      }
    fi
    if ! "$PYTHON" -c "import rtp_cli" 2>/dev/null || ! "$PYTHON" -m pip show -q rtp >/dev/null 2>&1; then
      "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >/tmp/rtp-pip-editable.log 2>&1 ||
        echo "$TAG: the editable install failed (/tmp/rtp-pip-editable.log); running from the checkout (PYTHONPATH)" >&2
    fi
  fi

  # 3. What runs here imports neither kfp nor mlflow.
  "$PYTHON" - "$TAG" <<'PY' || return 2
import importlib, importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("kfp", "mlflow"):
            raise ImportError(f"{name} must not be needed on the GPU machine")
        return None

sys.meta_path.insert(0, Absent())
for module in ("trainer.launch", "trainer.loop", "trainer.resilience", "trainer.__main__",
               "benchmarks.throughput", "benchmarks.bare_fsdp", "benchmarks.checkpoint",
               "benchmarks.recovery", "benchmarks.gpu_smoke", "rtp_cli.main",
               "nvidia_resiliency_ext.inprocess", "nvidia_resiliency_ext.fault_tolerance",
               "nvidia_resiliency_ext.checkpointing.async_ckpt"):
    importlib.import_module(module)
sys.modules["rtp_cli.main"].build_parser()
print(f"{sys.argv[1]}: imports without kfp/mlflow: ok")
PY
  SETUP_READY=1
}
