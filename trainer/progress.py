"""What rank 0 tells people while training runs: the progress line and live metrics.

Every `run.log_every_steps` steps the log gets one line (step/total, loss, tokens/s, ETA)
and, when MLflow is configured (MLFLOW_TRACKING_URI), the run's MLflow run gets loss,
learning rate, grad norm, tokens/s and step time (`trainer.live_metrics`). Checkpoint
commits, restarts and the final goodput go there too. Each attempt first re-sends, from
the run's event log, logged steps up to its resume point that MLflow may not have got. Nothing here touches the RNG or the
training math, and nothing waits on MLflow; other ranks get a no-op.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainer import env
from trainer.config import TrainConfig
from trainer.timeouts import watchdog_timeouts

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.enabled = rank == 0
        self.every = max(1, config.run.log_every_steps)
        self.tokens_per_step = (
            config.data.global_batch or config.data.batch_size * world_size
        ) * config.model.seq_len
        self._window_s = 0.0
        self._window_steps = 0
        self._started = time.monotonic()
        self._first_step: int | None = None
        self.live: Any = None
        uri = env.mlflow_tracking_uri()
        if uri and not self.enabled:
            # After an in-process restart another process may be rank 0: what this one
            # still buffers goes out now, before the new rank 0 looks at the run's history.
            from trainer.live_metrics import close_sink_of

            close_sink_of(config.run.workdir, timeout_s=min(5.0, watchdog_timeouts(config.resilience)[0] / 4))
        if self.enabled and uri:
            from trainer.live_metrics import live_metrics_for, run_identity

            self.live = live_metrics_for(run_identity(config, uri), config.run.mlflow_buffer_limit)

    def wants_detail(self, step: int) -> bool:
        """Whether `step` is a logging step (same answer on every rank: grad norm is gathered then)."""
        return step % self.every == 0 or step == self.config.run.steps

    def on_step(self, step: int, loss: float, lr: float, duration_s: float, grad_norm: float | None) -> None:
        if not self.enabled:
            return
        if self._first_step is None:
            self._first_step, self._started = step, time.monotonic() - duration_s
        self._window_s += duration_s
        self._window_steps += 1
        if not self.wants_detail(step):
            return
        step_time_s = self._window_s / max(1, self._window_steps)
        tokens_per_s = self.tokens_per_step / step_time_s if step_time_s > 0 else 0.0
        self._window_s, self._window_steps = 0.0, 0
        total = self.config.run.steps
        done = step - self._first_step + 1
        elapsed = time.monotonic() - self._started
        eta_s = elapsed / done * (total - step) if done > 0 else 0.0
        log.info(
            "step %d/%d loss %.4f tokens/s %.0f eta %s",
            step,
            total,
            loss,
            tokens_per_s,
            timedelta(seconds=round(eta_s)),
        )
        if self.live is not None:
            metrics = {"loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "step_time_s": step_time_s}
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
            self.live.log(metrics, step)

    def backfill(self, workdir: Path, resumed_step: int) -> None:
        """Re-send the logging steps up to `resumed_step` from the run's event log: a rank 0
        killed before its buffer went out took those values with it, and the steps will not
        run again. Steps MLflow already holds are skipped (`trainer.live_metrics`)."""
        if self.live is None:
            return
        path = Path(workdir) / "events.jsonl"
        last: dict[int, dict[str, Any]] = {}
        for line in path.read_text().splitlines() if path.is_file() else []:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut short by a killed writer
            if event.get("kind") == "step" and event["step"] <= resumed_step:
                last[int(event["step"])] = event
        window: list[float] = []
        for step in sorted(last):
            event = last[step]
            window.append(float(event.get("duration_s", 0.0)))
            if not self.wants_detail(step):
                continue
            step_time_s = sum(window) / len(window)
            window = []
            metrics = {"loss": float(event["loss"]), "lr": float(event["lr"]), "step_time_s": step_time_s}
            if step_time_s > 0:
                metrics["tokens_per_s"] = self.tokens_per_step / step_time_s
            if "grad_norm" in event:
                metrics["grad_norm"] = float(event["grad_norm"])
            self.live.log(metrics, step)

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        """EventLog listener: checkpoint commits go to MLflow as they happen."""
        if self.live is None:
            return
        if kind == "checkpoint_committed":
            self.live.log(
                {"checkpoint.blocked_s": float(fields.get("blocked_s", 0.0)), "checkpoint.committed": 1.0},
                int(fields["step"]),
            )

    def on_eval(self, step: int, loss: float, bits_per_byte: float) -> None:
        """A validation pass's holdout score: a log line, and MLflow metrics at its step."""
        if not self.enabled:
            return
        log.info("eval at step %d: holdout loss %.4f (%.4f bits per byte)", step, loss, bits_per_byte)
        if self.live is not None:
            self.live.log({"eval.loss": loss, "eval.bits_per_byte": bits_per_byte}, step)

    def on_stragglers(self, report: dict[str, Any]) -> None:
        """A comparison of the ranks' local work (trainer/stragglers.py): the slow ones in the log, the worst ratio in MLflow."""
        if not self.enabled:
            return
        first, last = report["steps"]
        for rank in report["slow"]:
            entry = report["ranks"][rank]
            log.warning(
                "straggler: rank %d on %s took %.2fx the other ranks' median local work (optimizer step) over steps %d-%d",
                rank, entry["host"], entry["relative"], first, last,
            )  # fmt: skip
        if self.live is not None:
            worst = max(report["ranks"], key=lambda entry: entry["relative"])
            self.live.log(
                {
                    "straggler.max_relative": float(worst["relative"]),
                    "straggler.slow_ranks": float(len(report["slow"])),
                },
                last,
            )
            if report["slow"]:
                self.live.set_tags({"rtp.stragglers": ",".join(f"rank {r}" for r in report["slow"])})

    def on_restart(self, restart: dict[str, Any], number: int) -> None:
        """A restart (from `trainer.goodput`), logged at the step training resumed from."""
        if not self.enabled:
            return
        log.info(
            "restart %d: %s, %s restart, %.1f s down, %s steps redone",
            number,
            _what_happened(restart),
            restart.get("mechanism"),
            restart.get("downtime_s") or 0.0,
            restart.get("steps_redone"),
        )
        if self.live is None or restart.get("resumed_step") is None:
            return
        self.live.log(
            {
                "restart.count": float(number),
                "restart.downtime_s": float(restart.get("downtime_s") or 0.0),
                "restart.steps_redone": float(restart.get("steps_redone") or 0),
            },
            int(restart["resumed_step"]),
        )
        self.live.set_tags(
            {f"rtp.restart.{number}": f"{_what_happened(restart)}, {restart.get('mechanism')} restart"}
        )

    def finish(self, summary: dict[str, Any]) -> str:
        """Final figures, then a bounded flush; returns the MLflow run id ('' without MLflow)."""
        if self.live is None:
            return ""
        self.live.log(
            {
                "goodput_pct": float(summary.get("goodput_pct", 0.0)),
                "checkpoint_efficiency_pct": float(summary.get("efficiency_pct", 0.0)),
                "steps_redone": float(summary.get("lost_steps", 0)),
                "restarts": float(len(summary.get("restarts", []))),
            },
            int(summary["steps"]),
        )
        from trainer.live_metrics import close_live_metrics

        # A short wait here: rank 0 is inside the in-process wrapper, whose watchdog takes a
        # rank that makes no progress for its soft timeout for hung. What is left is sent while
        # the process exits (the flusher keeps running until then).
        if self.live.flush(timeout_s=min(10.0, watchdog_timeouts(self.config.resilience)[0] / 4)):
            close_live_metrics(self.live)
        else:
            import atexit

            atexit.register(close_live_metrics, self.live)
        return str(self.live.run_id)


def _what_happened(restart: dict[str, Any]) -> str:
    """The restart's cause as the machinery saw it, and the injected fault behind it if any:
    "soft timeout on rank 1 (no progress for 23 s) (injected hang)"."""
    detail = restart.get("cause_detail") or str(restart.get("kind"))
    kind = restart.get("kind")
    if kind and kind != restart.get("cause"):
        detail += f" (injected {kind})"
    return detail
