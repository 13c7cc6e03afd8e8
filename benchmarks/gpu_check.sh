#!/usr/bin/env bash
# GPU check: the benchmarks at GPU scale on one CUDA GPU, after gpu_smoke.sh (both in one call:
# benchmarks/gpu_recipe.sh). Each part is one `rtp bench` process under its own time limit, and
# the modes a part compares run in that one process. The limits of the parts to run, with the
# setup and the report, must fit the budget, ${RTP_GPU_CHECK_BUDGET_S:-255} s (checked before
# anything runs):
#
#   part             limit  what
#   checkpoint        120 s rtp bench checkpoint --preset gpu-1b --modes off,async,torch-async
#                           (~1B params, ~12 GB of state): blocked time per save, and the steady
#                           state (steps 20-60: saves every 20 overlap the steps) against off
#   throughput         70 s rtp bench throughput --preset gpu-1b: tokens/s and MFU from the median
#                           step, rtp vs bare FSDP, memory per phase beside the memory plan's
#   recovery           35 s rtp bench recovery --mechanisms inprocess --deterministic: exception@8,14
#   checkpoint-sync   120 s only when named (--parts): off,sync (sync's 12 GB blocking writes do
#                           not fit the recipe's call)
#
# The 1B runs take the GPU timeout table (trainer/gpu_defaults.py, as `--override` items) and a
# pinned fast-tier interval (on CUDA `auto` calibrates it per run, over the first steps).
# recovery keeps the trainer's soft/hard timeouts and a collective timeout above the hard one
# (required on CUDA), so its faults recover in seconds.
#
# A part runs with its own TMPDIR and fast-tier folder (/dev/shm) and leaves neither behind, nor
# its processes, also when it is killed at its limit or the script is (trap on EXIT). A part
# that would start with less of the budget left than its limit is skipped: said, recorded as
# `skipped`, and not a failure; `ok` is every part run passed, and at least one ran.
#
#   $OUT/gpu-check.json          torch/CUDA/device, settings, budget, each part's status, exit code,
#                                seconds and JSON
#   $OUT/gpu-check-logs.tar.gz   each part's log
#
#   gpu_check.sh [--parts NAME,...] [--dry-run | --install-only]
#
# Readies the machine first (benchmarks/gpu_setup.sh). `--parts` runs those parts alone (a
# rerun of a failed part: a call of its own). `--dry-run`: no GPU, nothing installed; lists what
# would be installed, checks the imports, the budget, and parses every part's command line and
# checks its config against the CUDA timeout rules. `--install-only`: installs as on the GPU
# machine and runs those checks, no GPU and no benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
TAG=gpu_check
SETUP_MODE=run
SELECTED=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) SETUP_MODE=dry ;;
    --install-only) SETUP_MODE=install ;;
    --parts) SELECTED=${2:-}; shift ;;
    --parts=*) SELECTED=${1#--parts=} ;;
    *) echo "usage: $0 [--parts NAME,...] [--dry-run | --install-only]" >&2; exit 2 ;;
  esac
  shift
done
OUT_DIR=${OUT:-/tmp/rtp-gpu-check}
WORK=${RTP_GPU_CHECK_WORK:-/tmp/rtp-gpu-check-work}
SHM_ROOT=${RTP_GPU_CHECK_SHM:-/dev/shm/rtp-gpu-check}
BUDGET_S=${RTP_GPU_CHECK_BUDGET_S:-255}
SETUP_RESERVE_S=20   # gpu_setup.sh on a machine the smoke readied: the import checks
REPORT_RESERVE_S=10  # a part's leftovers removed, gpu-check.json, the logs archive
DEFAULT_PARTS="checkpoint throughput recovery"
STARTED=$(date +%s)

# name, time limit in seconds, `rtp` arguments (no argument holds a space; @TIER@ and @SHM@ are
# the fast tier's pinned interval and the part's own fast-tier folder).
ONE_B="--preset gpu-1b --nproc 1 --override data.batch_size=8"
PART_TABLE=(
  "checkpoint 120 bench checkpoint $ONE_B --modes @MODES@ --steps 60 --every 20 --warmup-steps 20 --local-every @TIER@ --override checkpoint.local_dir=@SHM@"
  "throughput 70 bench throughput $ONE_B --steps 40 --every 20 --warmup-steps 10 --memory-plan --override checkpoint.local_every_steps=@TIER@ --override checkpoint.local_dir=@SHM@"
  "recovery 35 bench recovery --mechanisms inprocess --nproc 1 --steps 20 --every 5 --fault-steps 8,14 --collective-timeout 60 --deterministic"
  "checkpoint-sync 120 bench checkpoint $ONE_B --modes off,sync --steps 60 --every 20 --warmup-steps 20 --local-every @TIER@ --override checkpoint.local_dir=@SHM@"
)
SELECTED=${SELECTED//,/ }
SELECTED=${SELECTED:-$DEFAULT_PARTS}
for name in $SELECTED; do
  printf '%s\n' "${PART_TABLE[@]}" | grep -q "^$name " || {
    echo "$TAG: --parts: no part named $name (parts: $(printf '%s\n' "${PART_TABLE[@]}" | cut -d' ' -f1 | tr '\n' ' '))" >&2
    exit 2
  }
done
LIMITS_S=0
for name in $SELECTED; do
  LIMITS_S=$((LIMITS_S + $(printf '%s\n' "${PART_TABLE[@]}" | grep "^$name " | cut -d' ' -f2)))
done
NEEDED_S=$((SETUP_RESERVE_S + LIMITS_S + REPORT_RESERVE_S))
echo "$TAG: budget $BUDGET_S s: setup $SETUP_RESERVE_S + parts $LIMITS_S ($SELECTED) + report $REPORT_RESERVE_S = $NEEDED_S s"
if [ "$NEEDED_S" -gt "$BUDGET_S" ]; then
  echo "$TAG: the parts' limits need $NEEDED_S s, more than the budget of $BUDGET_S s (RTP_GPU_CHECK_BUDGET_S): run fewer with --parts" >&2
  exit 2
fi

# shellcheck source=benchmarks/gpu_setup.sh
. benchmarks/gpu_setup.sh
gpu_setup || exit 2
[ "$SETUP_READY" = 1 ] || exit 0

GPU_TABLE=$("$PYTHON" -c "from trainer.gpu_defaults import resilience_overrides as r; print(' '.join('--override ' + o for o in r()))") || exit 2
# The async snapshot of gpu-1b lives in /dev/shm (~12 GB), and so do the fast tier's two slot
# files (~12 GB each); containers often mount 64 MB there. Without room for both the 1B runs
# go without the fast tier, without room for the snapshot async is left out (each said).
TIER=20
CKPT_MODES="off,async,torch-async"
SHM_KB=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
if [ "${SHM_KB:-0}" -lt $((40 * 1024 * 1024)) ]; then
  echo "$TAG: /dev/shm has $((${SHM_KB:-0} / 1024)) MB free; the fast tier's slots and the async snapshot need ~36 GB: fast tier off in the 1B runs" >&2
  TIER=0
fi
if [ "${SHM_KB:-0}" -lt $((14 * 1024 * 1024)) ]; then
  echo "$TAG: /dev/shm has $((${SHM_KB:-0} / 1024)) MB free; the async snapshot needs ~12 GB: async left out" >&2
  CKPT_MODES="off,torch-async"
fi
PARTS=()
for name in $SELECTED; do
  part=$(printf '%s\n' "${PART_TABLE[@]}" | grep "^$name ")
  part=${part//@MODES@/$CKPT_MODES}
  part=${part//@TIER@/$TIER}
  part=${part//@SHM@/$SHM_ROOT/$name}
  case "$part" in *" --preset gpu-1b "*) part="$part $GPU_TABLE" ;; esac
  PARTS+=("$part")
done

if [ "$SETUP_MODE" != run ]; then
  "$PYTHON" - "$TAG" "${PARTS[@]}" <<'PY' || exit 2
import sys
from rtp_cli.main import build_parser
from trainer.config import build_config
from trainer.gpu_defaults import check_timeouts

parser = build_parser()
for part in sys.argv[2:]:
    name, limit, *argv = part.split()
    args = parser.parse_args(argv)
    print(f"{sys.argv[1]}: {name} ({limit} s): rtp {' '.join(argv)}")
    # The config each part's ranks would check on CUDA (the benchmark adds only its own run settings).
    if args.benchmark == "recovery":
        given = args.collective_timeout
        config = build_config("tiny-cpu", [] if given is None else [f"resilience.collective_timeout_s={given:g}"])
    else:
        config = build_config(args.preset, args.override)
    check_timeouts(config.resilience, "cuda")
print(f"{sys.argv[1]}: every part's command line parses and its config passes the CUDA timeout check: ok")
PY
  echo "$TAG: checks done in $(($(date +%s) - STARTED)) s (no benchmarks run)"
  exit 0
fi

# A part's files and processes, gone when it ends, is killed at its limit, or this script is.
CURRENT=""
cleanup_part() {
  local name=$1
  [ -n "$name" ] || return 0
  # ft_launcher's ranks run in sessions of their own: end whatever of this part outlived it.
  "$PYTHON" - "$name" <<'PY'
import sys, psutil
for process in psutil.process_iter():
    try:
        if process.environ().get("RTP_GPU_CHECK_PART") == sys.argv[1]:
            process.kill()
    except (psutil.Error, OSError):
        continue
PY
  rm -rf "$WORK/tmp-$name" "$SHM_ROOT/$name"
  # What torch and NVRx put in /dev/shm themselves (shared tensors, the default tier folder).
  if [ -e "$WORK/started-$name" ]; then
    find /dev/shm /dev/shm/rtp-local -mindepth 1 -maxdepth 1 -newer "$WORK/started-$name" \
      \( -name 'torch_*' -o -path '/dev/shm/rtp-local/*' \) -exec rm -rf {} + 2>/dev/null
  fi
  CURRENT=""
}
trap 'cleanup_part "$CURRENT"' EXIT
trap 'exit 143' TERM INT HUP

rm -rf "$WORK" && mkdir -p "$WORK/logs" "$OUT_DIR" "$SHM_ROOT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
RESULTS=()
for part in "${PARTS[@]}"; do
  read -r name limit args <<<"$part"
  left=$((BUDGET_S - ($(date +%s) - STARTED)))
  if [ "$left" -lt $((limit + REPORT_RESERVE_S)) ]; then
    echo "$TAG: $name skipped: $left s of the budget left, its limit is $limit s"
    RESULTS+=("$name skipped 0")
    continue
  fi
  CURRENT=$name
  mkdir -p "$WORK/tmp-$name" && touch "$WORK/started-$name"
  start=$(date +%s)
  # In the background, waited for: a signal to this script runs its trap at once, not after the part.
  # shellcheck disable=SC2086  # one word per argument
  TMPDIR="$WORK/tmp-$name" RTP_GPU_CHECK_PART=$name timeout --kill-after=10 "$((limit - 10))" \
    "$PYTHON" -m rtp_cli.main $args --json "$WORK/gpu-$name.json" >"$WORK/logs/$name.log" 2>&1 &
  wait $!
  rc=$?
  cleanup_part "$name"
  RESULTS+=("$name $rc $(($(date +%s) - start))")
  echo "$TAG: $name exit $rc after $(($(date +%s) - start)) s (limit $limit s)"
  tail -8 "$WORK/logs/$name.log"
done

# gpu-check.json from the parts' results ("name exit-code seconds" each) and their JSON.
"$PYTHON" - "$OUT_DIR" "$WORK" "$BUDGET_S" "$CKPT_MODES" "$TIER" "$GPU_TABLE" "${RESULTS[@]}" <<'PY'
import json, sys
from pathlib import Path
import torch
out, work, budget, modes, tier, table, *results = sys.argv[1:]
parts = {}
for line in results:
    name, rc, seconds = line.split()
    path = Path(work, f"gpu-{name}.json")
    result = json.loads(path.read_text()) if path.is_file() else None
    status = "skipped" if rc == "skipped" else ("pass" if rc == "0" and result is not None else "fail")
    parts[name] = {"status": status, "exit_code": None if rc == "skipped" else int(rc), "seconds": int(seconds), "result": result}
# The modes compared in one process: each against that process's own `off` run.
compared = {}
for name, part in parts.items():
    if name.startswith("checkpoint") and part["result"]:
        for mode, row in part["result"]["modes"].items():
            compared[mode] = {key: row.get(key) for key in ("wall_vs_off", "window_vs_off", "blocked_s_per_save_median", "window_efficiency_pct")}
ran = [p for p in parts.values() if p["status"] != "skipped"]
check = {
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    "python": sys.version.split()[0],
    "budget_s": int(budget),
    "checkpoint_modes": modes.split(","),
    "fast_tier_every_steps": int(tier),
    "gpu_resilience_overrides": table.replace("--override ", "").split(),
    "checkpoint_vs_off": compared or None,
    "skipped": [name for name, p in parts.items() if p["status"] == "skipped"],
    "ok": bool(ran) and all(p["status"] == "pass" for p in ran),
    "parts": parts,
}
Path(out, "gpu-check.json").write_text(json.dumps(check, indent=2) + "\n")
for name, p in parts.items():
    print(f"gpu_check: {name:<24} {p['status']:<8} exit {p['exit_code']!s:>4} {p['seconds']:>5} s")
sys.exit(0 if check["ok"] else 1)
PY
RC=$?
tar -czf "$OUT_DIR/gpu-check-logs.tar.gz" -C "$WORK" logs
echo "$TAG: done in $(($(date +%s) - STARTED)) s; $OUT_DIR/gpu-check.json"
exit $RC
