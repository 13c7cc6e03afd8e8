"""Live metrics end to end: real ranks over gloo, real faults, a real mlflow server.

A run that survives an in-process restart and a launcher restart holds every logged step
of every metric exactly once in its one MLflow run, and ends with the weights of the run
that logged nothing. With MLflow failing at the start, training still finishes with the
same weights and the run holds what the bounded buffer kept, each step once.
"""

from __future__ import annotations

import collections

import pytest

from tests.components.mlflow_server import FlakyProxy
from tests.distributed.conftest import PLAIN_EVERY, PLAIN_OVERRIDES, PLAIN_STEPS, restart_story, train

pytestmark = [pytest.mark.launches, pytest.mark.timeout(600)]

STEPS, EVERY = 16, 4
FAST = [
    "resilience.collective_timeout_s=5",
    "resilience.soft_timeout_s=8",
    "resilience.hard_timeout_s=30",
    "run.log_every_steps=1",
]
STEP_METRICS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s")


@pytest.fixture(scope="module")
def reference(plain_two_rank_run) -> dict:
    """The same run without MLflow and without faults (the session's plain run)."""
    assert (STEPS, EVERY, tuple(FAST)) == (PLAIN_STEPS, PLAIN_EVERY, PLAIN_OVERRIDES)
    return plain_two_rank_run


def _histories(uri: str, run_id: str, keys) -> dict[str, list[int]]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return {key: [m.step for m in client.get_metric_history(run_id, key)] for key in keys}


def _detail(uri: str, run_id: str, key: str, workdir) -> str:
    """A failing history with values and times, beside the run's step events."""
    from mlflow import MlflowClient

    history = [
        (m.step, round(m.value, 5), m.timestamp) for m in MlflowClient(uri).get_metric_history(run_id, key)
    ]
    lines = (workdir / "events.jsonl").read_text().splitlines()
    events = [e for e in lines if "attempt" in e or '"kind": "step"' in e]
    return f"history {sorted(history)}\nevents {events[:60]}"


def _client_env(monkeypatch, uri: str) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # The flusher retries on its own schedule; the client's own retries would only delay it.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def test_restarts_leave_one_complete_history_without_duplicates(
    dataset_dir, tmp_path, mlflow_server, reference, monkeypatch
):
    _client_env(monkeypatch, mlflow_server)
    summary = train(
        dataset_dir,
        tmp_path,
        steps=STEPS,
        every=EVERY,
        overrides=FAST,
        faults=["exception@6:1", "sigkill@11:0"],
    )
    assert [r["mechanism"] for r in summary["restarts"]] == ["inprocess", "launcher"], restart_story(
        summary, tmp_path
    )
    assert summary["model_sha256"] == reference["model_sha256"]  # metrics do not touch the math
    run_id = summary["mlflow_run_id"]
    assert run_id
    histories = _histories(mlflow_server, run_id, STEP_METRICS)
    for key, steps in histories.items():
        assert sorted(steps) == list(range(1, STEPS + 1)), (
            key,
            _detail(mlflow_server, run_id, key, tmp_path),
        )

    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    run = client.get_run(run_id)
    assert run.data.tags["rtp.workdir"] == str(tmp_path.resolve())
    assert run.data.metrics["goodput_pct"] == summary["goodput_pct"]
    restarts = [m.step for m in client.get_metric_history(run_id, "restart.count")]
    assert len(restarts) == len(set(restarts)) and restarts
    committed = [m.step for m in client.get_metric_history(run_id, "checkpoint.committed")]
    assert len(committed) == len(set(committed)) and STEPS in committed
    experiment = client.get_experiment(run.info.experiment_id)
    assert (
        len(client.search_runs([experiment.experiment_id], f"tags.`rtp.workdir` = '{tmp_path.resolve()}'"))
        == 1
    )


def test_mlflow_failing_at_the_start_loses_nothing_but_what_the_buffer_could_not_hold(
    dataset_dir, tmp_path, mlflow_server, reference, monkeypatch
):
    upstream_port = int(mlflow_server.rsplit(":", 1)[1])
    with FlakyProxy(upstream_port, failures=3) as proxy:
        _client_env(monkeypatch, proxy.url)
        limit = 4 * len(STEP_METRICS)  # four steps' worth
        summary = train(
            dataset_dir,
            tmp_path,
            steps=STEPS,
            every=EVERY,
            overrides=[*FAST, f"run.mlflow_buffer_limit={limit}"],
        )
        assert proxy.failed == 3
    assert summary["model_sha256"] == reference["model_sha256"]
    run_id = summary["mlflow_run_id"]
    assert run_id
    histories = _histories(mlflow_server, run_id, STEP_METRICS)
    for key, steps in histories.items():
        counts = collections.Counter(steps)
        assert all(n == 1 for n in counts.values()), key
        # Kept: the first steps, buffered while MLflow failed; which later steps also made it
        # depends on when it answered again and how often the flusher ran.
        assert sorted(steps)[:2] == [1, 2], (key, sorted(steps))
    assert len(histories["loss"]) < STEPS  # the buffer filled while MLflow failed: later steps were dropped
