"""Live metrics never block training and never log a step twice (real mlflow server)."""

from __future__ import annotations

import pytest

from rtp_support.embedded_s3 import free_port
from trainer.live_metrics import LiveMetrics, RunIdentity

pytestmark = pytest.mark.timeout(120)


def _identity(uri: str, workdir: str) -> RunIdentity:
    return RunIdentity(
        tracking_uri=uri,
        experiment="rtp-live-test",
        run_name="r",
        workdir=workdir,
        tags={"k": "v"},
        params={"p": "1"},
    )


def _history(uri: str, run_id: str, key: str) -> list[int]:
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_a_second_sink_for_the_same_run_continues_it_without_duplicate_steps(mlflow_server, tmp_path):
    first = LiveMetrics(_identity(mlflow_server, str(tmp_path)), limit=100, flush_interval_s=0.2)
    for step in range(1, 6):
        first.log({"loss": 1.0 / step}, step)
    assert first.flush(30)
    first.close()
    # A launcher restart: a new process resumes from step 3 and redoes 4 and 5.
    second = LiveMetrics(_identity(mlflow_server, str(tmp_path)), limit=100, flush_interval_s=0.2)
    assert second.flush(30) and second.run_id == first.run_id  # connected before it logs anything
    for step in range(4, 9):
        second.log({"loss": 1.0 / step}, step)
    assert second.flush(30)
    second.close()
    assert second.run_id == first.run_id
    assert _history(mlflow_server, first.run_id, "loss") == list(range(1, 9))


def test_mlflow_down_never_blocks_and_keeps_what_the_buffer_holds(tmp_path, caplog):
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sink = LiveMetrics(_identity(closed, str(tmp_path)), limit=10, flush_interval_s=0.2)
    for step in range(1, 31):
        sink.log({"loss": float(step)}, step)  # returns at once: it only appends to memory
    assert sink.buffered() == 10 and sink.dropped == 20
    assert not sink.flush(1.0)
    sink.close(timeout_s=1.0)
    warnings = [r for r in caplog.records if "newer ones are dropped" in r.getMessage()]
    assert len(warnings) == 1


def test_a_flush_that_waits_retries_soon_after_a_failure(mlflow_server, tmp_path, monkeypatch):
    """The end of training waits briefly for the buffer: an MLflow that has just come back
    is reached within that wait, not a whole flush interval later."""
    from tests.components.mlflow_server import FlakyProxy

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the client's own retries off
    with FlakyProxy(int(mlflow_server.rsplit(":", 1)[1]), failures=3) as proxy:
        sink = LiveMetrics(_identity(proxy.url, str(tmp_path)), limit=100, flush_interval_s=60)
        sink.log({"loss": 1.0}, 1)
        assert sink.flush(10)  # without the waited retry: the next try is 60 s after a failure
        assert proxy.failed == 3
        sink.close()
    assert sink.run_id and _history(mlflow_server, sink.run_id, "loss") == [1]


class _AnswerLostClient:
    """Stand-in for a flaky network in front of a real client: the first metrics batch
    reaches the server, but its answer is lost (the client sees a timeout)."""

    def __init__(self, real) -> None:
        self.real = real
        self.lost = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def log_batch(self, run_id, **kwargs):
        self.real.log_batch(run_id, **kwargs)
        if kwargs.get("metrics") and not self.lost:
            self.lost += 1
            raise TimeoutError("read timed out (stand-in)")


def test_a_batch_stored_but_unanswered_is_not_stored_twice(mlflow_server, tmp_path):
    sink = LiveMetrics(_identity(mlflow_server, str(tmp_path)), limit=100, flush_interval_s=0.2)
    sink.log({"loss": 1.0}, 1)
    assert sink.flush(30)
    sink._client = lossy = _AnswerLostClient(sink._client)
    for step in (2, 3):
        sink.log({"loss": 1.0 / step}, step)
    assert sink.flush(30)
    sink.close()
    assert lossy.lost == 1
    assert _history(mlflow_server, sink.run_id, "loss") == [1, 2, 3]
