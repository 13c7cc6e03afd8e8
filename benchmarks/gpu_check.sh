#!/usr/bin/env bash
# GPU check: the benchmarks at GPU scale on one CUDA GPU, within ${RTP_GPU_CHECK_BUDGET_S:-480} s
# (run it after gpu_smoke.sh). Parts, async first, each its own `rtp bench` run under its
# own time limit; a part that would start with under 40 s of the budget left is skipped:
#
#   checkpoint-async        rtp bench checkpoint --preset gpu-1b --modes async (~1B params, ~12 GB state)
#   throughput              rtp bench throughput --preset gpu-1b: bf16 tokens/s and MFU, rtp vs bare FSDP
#   recovery                rtp bench recovery --mechanisms inprocess --deterministic: exception@8,14 on NCCL
#   checkpoint-off|sync|torch-async   the other modes, as checkpoint-async
#
# The 1B runs take the GPU timeout table (trainer/gpu_defaults.py, as `--override` items);
# recovery keeps the trainer's soft/hard timeouts and a collective timeout above the hard
# one (required on CUDA), so its faults recover in seconds.
#
#   $OUT/gpu-check.json          torch/CUDA/device, settings, each part's exit code, seconds and JSON
#   $OUT/gpu-check-logs.tar.gz   each part's log
#
# Readies the machine first (benchmarks/gpu_setup.sh). `--dry-run`: no GPU, nothing installed;
# lists what would be installed, checks the imports and parses every part's command line and
# checks its config against the CUDA timeout rules. `--install-only`: installs as on the GPU
# machine and runs those checks, no GPU and no benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
TAG=gpu_check
SETUP_MODE=run
case "${1:-}" in
  --dry-run) SETUP_MODE=dry ;;
  --install-only) SETUP_MODE=install ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --install-only]" >&2; exit 2 ;;
esac
OUT_DIR=${OUT:-/tmp/rtp-gpu-check}
WORK=${RTP_GPU_CHECK_WORK:-/tmp/rtp-gpu-check-work}
BUDGET_S=${RTP_GPU_CHECK_BUDGET_S:-480}
STARTED=$(date +%s)
# shellcheck source=benchmarks/gpu_setup.sh
. benchmarks/gpu_setup.sh
gpu_setup || exit 2
[ "$SETUP_READY" = 1 ] || exit 0

GPU_TABLE=$("$PYTHON" -c "from trainer.gpu_defaults import resilience_overrides as r; print(' '.join('--override ' + o for o in r()))") || exit 2
# The async snapshot of gpu-1b lives in /dev/shm (~12 GB), and so do the fast tier's two slot
# files (~12 GB each); containers often mount 64 MB there. Without room for both the 1B runs
# go without the fast tier, without room for the snapshot async is left out (each said).
MODES="async off sync torch-async"
CKPT_TIER="" TPUT_TIER=""
SHM_KB=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
if [ "${SHM_KB:-0}" -lt $((40 * 1024 * 1024)) ]; then
  echo "$TAG: /dev/shm has $((${SHM_KB:-0} / 1024)) MB free; the fast tier's slots and the async snapshot need ~36 GB: fast tier off in the 1B runs" >&2
  CKPT_TIER="--local-every 0" TPUT_TIER="--override checkpoint.local_every_steps=0"
fi
if [ "${SHM_KB:-0}" -lt $((14 * 1024 * 1024)) ]; then
  echo "$TAG: /dev/shm has $((${SHM_KB:-0} / 1024)) MB free; the async snapshot needs ~12 GB: async left out" >&2
  MODES="off sync torch-async"
fi
# name, time limit in seconds, `rtp` arguments (no argument holds a space).
PARTS=()
case " $MODES " in
  *" async "*) PARTS+=("checkpoint-async 110 bench checkpoint --preset gpu-1b --modes async --nproc 1 --steps 8 --every 4 $CKPT_TIER $GPU_TABLE") ;;
esac
PARTS+=("throughput 130 bench throughput --preset gpu-1b --steps 30 --every 15 --nproc 1 $TPUT_TIER $GPU_TABLE")
PARTS+=("recovery 80 bench recovery --mechanisms inprocess --nproc 1 --steps 20 --every 5 --fault-steps 8,14 --collective-timeout 60 --deterministic")
for mode in $MODES; do
  [ "$mode" = async ] && continue
  PARTS+=("checkpoint-$mode 100 bench checkpoint --preset gpu-1b --modes $mode --nproc 1 --steps 8 --every 4 $CKPT_TIER $GPU_TABLE")
done

if [ "$SETUP_MODE" != run ]; then
  "$PYTHON" - "$TAG" "${PARTS[@]}" <<'PY' || exit 2
import sys
from rtp_cli.main import build_parser
from trainer.config import build_config
from trainer.gpu_defaults import check_timeouts

parser = build_parser()
for part in sys.argv[2:]:
    name, _limit, *argv = part.split()
    args = parser.parse_args(argv)
    print(f"{sys.argv[1]}: {name}: rtp {' '.join(argv)}")
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

# The parts, each under its own limit and what is left of the budget.
rm -rf "$WORK" && mkdir -p "$WORK/logs" "$OUT_DIR"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
RESULTS=()
for part in "${PARTS[@]}"; do
  read -r name limit args <<<"$part"
  left=$((BUDGET_S - ($(date +%s) - STARTED)))
  if [ "$left" -lt 40 ]; then
    echo "$TAG: $name skipped: $left s of the budget left"
    RESULTS+=("$name skipped 0")
    continue
  fi
  [ "$limit" -gt $((left - 10)) ] && limit=$((left - 10))
  start=$(date +%s)
  # shellcheck disable=SC2086  # one word per argument
  RTP_GPU_CHECK_PART=$name timeout --kill-after=10 "$limit" "$PYTHON" -m rtp_cli.main $args \
    --json "$WORK/gpu-$name.json" >"$WORK/logs/$name.log" 2>&1
  rc=$?
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
  RESULTS+=("$name $rc $(($(date +%s) - start))")
  echo "$TAG: $name exit $rc after $(($(date +%s) - start)) s (limit $limit s)"
  tail -8 "$WORK/logs/$name.log"
done

# gpu-check.json from the parts' results ("name exit-code seconds" each) and their JSON.
"$PYTHON" - "$OUT_DIR" "$WORK" "$BUDGET_S" "$MODES" "$CKPT_TIER" "$GPU_TABLE" "${RESULTS[@]}" <<'PY'
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
walls = {n.split("-", 1)[1]: p["result"]["modes"][n.split("-", 1)[1]]["wall_s"]
         for n, p in parts.items() if n.startswith("checkpoint-") and p["result"]}
check = {
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    "python": sys.version.split()[0],
    "budget_s": int(budget),
    "checkpoint_modes": modes.split(),
    "fast_tier_in_1b_runs": not tier,
    "gpu_resilience_overrides": table.replace("--override ", "").split(),
    "checkpoint_wall_vs_off": {m: w / walls["off"] for m, w in walls.items()} if walls.get("off") else None,
    "ok": all(p["status"] == "pass" for p in parts.values()),
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
