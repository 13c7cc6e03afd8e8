#!/usr/bin/env bash
# The GPU recipe: one `run` call of the device tool, at most CALL_LIMIT_S (7 minutes), gives the
# smoke's verdict and the check's figures; a 15-minute loan (start-up included) then has room
# to rerun a failed part alone in a second call (docs/performance.md, "GPU check"):
#
#   run(command="bash benchmarks/gpu_recipe.sh", carry=["benchmarks/wheels"], timeout_s=420)
#
# 1. benchmarks/gpu_smoke.sh (readies the machine: benchmarks/gpu_setup.sh), all its runs at
#    once, none started after SMOKE_BUDGET_S and none running past it, the whole cut at
#    SMOKE_LIMIT_S;
# 2. benchmarks/gpu_check.sh within CHECK_BUDGET_S (its parts' limits are checked against it),
#    cut at that plus CUT_GRACE_S.
#
# Each writes its JSON and logs archive under $OUT, and its output to $OUT/gpu-smoke.log and
# $OUT/gpu-check.log: six files (a call brings back at most eight). Exits 0 when both passed.
# `--dry-run` checks the arithmetic and runs both scripts' dry runs (no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
CALL_LIMIT_S=420     # the run call's timeout_s
SMOKE_SETUP_S=25     # gpu_setup.sh on a bare machine: wheels, the editable install, the import check
SMOKE_BUDGET_S=95    # gpu_smoke.py --budget: no run starts or runs past it
SMOKE_REPORT_S=15    # the dataset before, the verdicts and the logs archive after
SMOKE_LIMIT_S=$((SMOKE_SETUP_S + SMOKE_BUDGET_S + SMOKE_REPORT_S))
CHECK_BUDGET_S=255   # gpu_check.sh's own budget, its setup included
CUT_GRACE_S=10       # after a cut: SIGTERM, then SIGKILL 5 s later
MARGIN_S=10          # the call's own start and the logs' flush
TOTAL_S=$((SMOKE_LIMIT_S + CUT_GRACE_S + CHECK_BUDGET_S + CUT_GRACE_S + MARGIN_S))
echo "gpu_recipe: smoke $SMOKE_LIMIT_S s + check $CHECK_BUDGET_S s + cuts $((2 * CUT_GRACE_S)) s + margin $MARGIN_S s = $TOTAL_S s of a $CALL_LIMIT_S s call"
if [ "$TOTAL_S" -gt "$CALL_LIMIT_S" ]; then
  echo "gpu_recipe: $TOTAL_S s does not fit a $CALL_LIMIT_S s call" >&2
  exit 2
fi
OUT_DIR=${OUT:-/tmp/rtp-gpu-recipe}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
# Every run at once: 13 one-rank runs of a small model share the GPU; their timings are verdicts'
# evidence, not figures (the check's parts run one at a time).
SMOKE_ARGS=(--jobs 13 --budget "$SMOKE_BUDGET_S" --run-timeout "$SMOKE_BUDGET_S")
if [ "${1:-}" = --dry-run ]; then
  bash benchmarks/gpu_smoke.sh --dry-run "${SMOKE_ARGS[@]}" || exit 1
  RTP_GPU_CHECK_BUDGET_S=$CHECK_BUDGET_S bash benchmarks/gpu_check.sh --dry-run || exit 1
  exit 0
fi
SMOKE_WORK=/tmp/rtp-gpu-smoke/work
timeout --kill-after=5 "$SMOKE_LIMIT_S" bash benchmarks/gpu_smoke.sh "${SMOKE_ARGS[@]}" --work "$SMOKE_WORK" 2>&1 | tee "$OUT_DIR/gpu-smoke.log"
SMOKE_RC=${PIPESTATUS[0]}
rm -rf "$SMOKE_WORK"  # its runs' checkpoints and fast-tier files: not the check's to find
RTP_GPU_CHECK_BUDGET_S=$CHECK_BUDGET_S timeout --kill-after=5 "$((CHECK_BUDGET_S + 5))" bash benchmarks/gpu_check.sh 2>&1 | tee "$OUT_DIR/gpu-check.log"
CHECK_RC=${PIPESTATUS[0]}
echo "gpu_recipe: smoke exit $SMOKE_RC, check exit $CHECK_RC"
[ "$SMOKE_RC" = 0 ] && [ "$CHECK_RC" = 0 ]
