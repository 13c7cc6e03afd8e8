"""Live training metrics for MLflow: a bounded buffer that a background thread flushes.

Rank 0 hands metrics to `LiveMetrics.log` and goes on: the call only appends to an
in-memory buffer. A daemon thread opens the run's MLflow run (find-or-create by the
`rtp.workdir` tag, so every attempt of a run — resume, in-process or launcher restart,
KFP retry — continues one MLflow run), starts MLflow's own system-metrics monitor, and
sends the buffer in batches. While MLflow is unreachable the values stay buffered and are
retried; past `limit` values new ones are dropped, with one warning line.

No step is logged twice. Every value carries its training step; a value whose step is not
above the highest step already logged for that key is skipped. The highest steps come
from this process (which survives an in-process restart: the sink is kept per run, below)
and, once the server answers, from the run's own metric history (a launcher restart is a
new process, and after an in-process restart rank 0 may be another process). So after a restart that redoes steps, the redone steps are *skipped* where
the first execution's values reached MLflow, and *filled in* where they were lost (still
buffered when a rank was killed): each step appears once, without gaps.

mlflow is imported inside the thread only: the trainer imports and trains without it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WORKDIR_TAG = "rtp.workdir"
FLUSH_INTERVAL_S = 2.0
WAITED_RETRY_S = 0.25
"""Retry interval after a failed send while a `flush()` waits (the end of training): its
wait is short (rank 0 is inside the in-process watchdog), and an MLflow that has just come
back is then reached within it, so the summary gets the run's id."""
BATCH_SIZE = 900  # MLflow's log_batch takes at most 1000 metrics per call


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """Which MLflow run a training run's metrics belong to."""

    tracking_uri: str
    experiment: str
    run_name: str
    workdir: str
    """Resolved workdir: the tag that finds the run again on every attempt."""
    tags: dict[str, str]
    params: dict[str, str]
    """Logged once, when the run is created (a resumed run may change stop_after etc.)."""


@dataclass(frozen=True, slots=True)
class MetricValue:
    key: str
    value: float
    step: int
    timestamp_ms: int


def find_or_create_run(client: Any, identity: RunIdentity) -> str:
    """The id of the run tagged with `identity.workdir`, created (with params) if there is none."""
    experiment = client.get_experiment_by_name(identity.experiment)
    if experiment is None:
        location = None
        if identity.tracking_uri.startswith("sqlite:///"):
            # A sqlite store would put artifacts under ./mlruns of whatever directory rank 0
            # runs in; keep them beside the database, as the register step does.
            db_path = Path(identity.tracking_uri[len("sqlite:///") :])
            location = (db_path.parent / "mlartifacts").resolve().as_uri()
        try:
            experiment_id = client.create_experiment(identity.experiment, artifact_location=location)
        except Exception:  # created meanwhile by another run
            experiment = client.get_experiment_by_name(identity.experiment)
            if experiment is None:
                raise
            experiment_id = experiment.experiment_id
    else:
        experiment_id = experiment.experiment_id
    quoted = identity.workdir.replace("'", "\\'")
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{WORKDIR_TAG}` = '{quoted}'", max_results=1
    )
    if found:
        run = found[0]
        if run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
        return str(run.info.run_id)
    run = client.create_run(
        experiment_id, run_name=identity.run_name, tags={**identity.tags, WORKDIR_TAG: identity.workdir}
    )
    from mlflow.entities import Param

    params = [Param(k, v[:6000]) for k, v in identity.params.items()]
    for start in range(0, len(params), 90):
        client.log_batch(run.info.run_id, params=params[start : start + 90])
    return str(run.info.run_id)


class LiveMetrics:
    """The buffer and its flusher thread for one MLflow run (see the module docstring)."""

    def __init__(self, identity: RunIdentity, limit: int, flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.identity = identity
        self.limit = limit
        self.flush_interval_s = flush_interval_s
        self.run_id = ""
        self.dropped = 0
        self._buffer: deque[MetricValue] = deque()
        self._last_step: dict[str, int] = {}
        self._learned_keys: set[str] = set()
        """Keys whose highest step in the run has been read from the server."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._system_monitor: Any = None
        self._client: Any = None
        self._warned_unreachable = False
        self._pending_tags: dict[str, str] = {}
        self._flush_waited = False
        self._thread = threading.Thread(target=self._run, name="rtp-live-metrics", daemon=True)
        self._thread.start()

    # -- the training side: never blocks on MLflow -------------------------------------
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Buffer `metrics` at `step`; values at or below a step already logged are skipped."""
        now_ms = int(time.time() * 1000)
        with self._lock:
            for key, value in metrics.items():
                if step <= self._last_step.get(key, -1):
                    continue
                if len(self._buffer) >= self.limit:
                    if self.dropped == 0:
                        log.warning(
                            "MLflow has been unreachable for a while: %d metric values are buffered "
                            "(run.mlflow_buffer_limit); newer ones are dropped until it answers",
                            self.limit,
                        )
                    self.dropped += 1
                    continue
                self._last_step[key] = step
                self._buffer.append(MetricValue(key, float(value), step, now_ms))
            self._idle.clear()

    def set_tags(self, tags: dict[str, str]) -> None:
        """Tags for the run (sent with the next flush; best effort)."""
        with self._lock:
            self._pending_tags.update(tags)
            self._idle.clear()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the buffer to reach MLflow; True when it did."""
        self._flush_waited = True  # from now on a failed send is retried within WAITED_RETRY_S
        self._wake.set()
        return self._idle.wait(timeout_s)

    def buffered(self) -> int:
        with self._lock:
            return len(self._buffer)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush (bounded; warns what did not make it) and stop the system-metrics monitor."""
        if not self.flush(timeout_s):
            log.warning(
                "live metrics: %d values did not reach MLflow%s",
                self.buffered(),
                f"; {self.dropped} more were dropped when the buffer was full" if self.dropped else "",
            )
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._system_monitor is not None:
            with contextlib.suppress(Exception):  # best effort: the monitor's thread may have died
                self._system_monitor.finish()

    # -- the flusher thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            failed = False
            try:
                self._send_once()
            except Exception as exc:  # MLflow down or failing: keep the buffer, try later
                failed = True
                if not self._warned_unreachable:
                    self._warned_unreachable = True
                    log.warning(
                        "live metrics: MLflow at %s did not answer (%s); buffering and retrying",
                        self.identity.tracking_uri,
                        str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                    )
            if stopping:
                return
            self._wake.wait(WAITED_RETRY_S if failed and self._flush_waited else self.flush_interval_s)
            self._wake.clear()

    def _connect(self) -> None:
        if self.run_id:
            return
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=self.identity.tracking_uri)
        self.run_id = find_or_create_run(self._client, self.identity)
        log.info("live metrics go to MLflow run %s", self.run_id)
        self._start_system_metrics()

    def _start_system_metrics(self) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_monitor = SystemMetricsMonitor(
                self.run_id,
                sampling_interval=10,
                samples_before_logging=1,
                resume_logging=True,  # later attempts continue the run's system metrics
                tracking_uri=self.identity.tracking_uri,  # not the process default (./mlflow.db)
            )
            self._system_monitor.start()
        except Exception as exc:  # psutil missing, or an mlflow without the monitor
            log.info("MLflow system metrics are not available here: %s", exc)
            self._system_monitor = None

    def _learn_server_steps(self) -> None:
        """The highest step already in the run of each buffered key not yet looked up (values
        logged by an earlier process), and the buffered values at or below it dropped."""
        with self._lock:
            keys = {m.key for m in self._buffer} - self._learned_keys
        if not keys:
            return
        highest: dict[str, int] = {}
        for key in keys:
            history = self._client.get_metric_history(self.run_id, key)
            if history:
                highest[key] = max(m.step for m in history)
        with self._lock:
            for key, step in highest.items():
                self._last_step[key] = max(self._last_step.get(key, -1), step)
            self._buffer = deque(m for m in self._buffer if m.step > highest.get(m.key, -1))
            self._learned_keys |= keys

    def _send_once(self) -> None:
        with self._lock:
            empty = not self._buffer and not self._pending_tags
        if empty and self.run_id:
            self._idle.set()
            return
        self._connect()
        self._learn_server_steps()
        from mlflow.entities import Metric, RunTag

        with self._lock:
            tags, self._pending_tags = self._pending_tags, {}
        if tags:
            try:
                self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            except Exception:
                with self._lock:
                    self._pending_tags = {**tags, **self._pending_tags}
                raise
        while True:
            with self._lock:
                batch = [self._buffer[i] for i in range(min(BATCH_SIZE, len(self._buffer)))]
            if not batch:
                break
            # Resending a batch whose answer was lost stores nothing twice: each value keeps
            # the timestamp it was logged with, and MLflow keeps one row per identical point.
            self._client.log_batch(
                self.run_id, metrics=[Metric(m.key, m.value, m.timestamp_ms, m.step) for m in batch]
            )
            with self._lock:
                for _ in batch:
                    self._buffer.popleft()
        self._warned_unreachable = False
        with self._lock:
            if not self._buffer:
                self._idle.set()


_SINKS: dict[str, LiveMetrics] = {}
"""One sink per run and process, kept across calls of the training function: an in-process
restart continues with the buffer and the logged steps of the attempt it replaces."""


def live_metrics_for(identity: RunIdentity, limit: int) -> LiveMetrics:
    sink = _SINKS.get(identity.workdir)
    if sink is None or sink.identity.tracking_uri != identity.tracking_uri:
        sink = _SINKS[identity.workdir] = LiveMetrics(identity, limit)
    return sink


def close_live_metrics(sink: LiveMetrics, timeout_s: float = 10.0) -> None:
    """End of an attempt that did not fail: flush, stop the monitor, forget the sink."""
    if _SINKS.get(sink.identity.workdir) is sink:
        del _SINKS[sink.identity.workdir]
    sink.close(timeout_s)


def close_sink_of(workdir: str, timeout_s: float) -> None:
    """Flush and close this process's sink for the run in `workdir`, if it has one."""
    sink = _SINKS.get(str(Path(workdir).resolve()))
    if sink is not None:
        close_live_metrics(sink, timeout_s)


def run_identity(config: Any, tracking_uri: str) -> RunIdentity:
    """What identifies `config`'s run in MLflow (experiment, name, tags, first-time params)."""
    workdir = Path(config.run.workdir).resolve()
    # <run>/train in a pipeline run: the run folder names the run.
    folder = workdir.parent if workdir.name == "train" else workdir
    params = {
        f"{section}.{key}": str(value)
        for section, values in config.to_dict().items()
        for key, value in values.items()
        if section in ("model", "optimizer", "data", "checkpoint") or key in ("steps", "seed")
    }
    return RunIdentity(
        tracking_uri=tracking_uri,
        experiment=config.run.mlflow_experiment,
        run_name=config.run.mlflow_run_name or folder.name,
        workdir=str(workdir),
        tags={"rtp.run": config.run.mlflow_run_name or folder.name, **config.run.mlflow_tags},
        params=params,
    )
