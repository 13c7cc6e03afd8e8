"""Each restart's real cause (trainer/restart_causes.py), as the run's records report it:
summary.json's restarts (trainer/goodput.py) and the progress line."""

from __future__ import annotations

import logging

import pytest
from nvidia_resiliency_ext.inprocess.attribution import (
    Interruption,
    InterruptionRecord,
    format_interruption_records,
)
from nvidia_resiliency_ext.inprocess.monitor_thread import RankShouldRestart

from trainer.config import TrainConfig
from trainer.faults import InjectedFault
from trainer.goodput import analyze
from trainer.progress import Progress
from trainer.restart_causes import cause_of, read_notes, write_note


def _interrupted(*records: tuple[int, Interruption]) -> RankShouldRestart:
    """What NVRx's monitor thread raises in the main thread, with NVRx's own message."""
    return RankShouldRestart(format_interruption_records([InterruptionRecord(r, i) for r, i in records]))


def test_a_soft_timeout_named_by_nvrx_is_a_soft_timeout():
    cause = cause_of(_interrupted((1, Interruption.SOFT_TIMEOUT)), rank=0, soft_timeout_s=23.0)
    assert (cause.cause, cause.ranks) == ("soft_timeout", (1,))
    assert cause.describe() == "soft timeout on rank 1 (no progress for 23 s)"


def test_a_hard_timeout_outranks_the_soft_timeout_before_it():
    both = _interrupted((1, Interruption.SOFT_TIMEOUT), (1, Interruption.HARD_TIMEOUT))
    assert cause_of(both, rank=0).cause == "hard_timeout"


def test_a_rank_own_exception_is_an_exception_with_its_type():
    cause = cause_of(InjectedFault("injected fault exception@3:0"), rank=0)
    assert (cause.cause, cause.exception, cause.ranks) == ("exception", "InjectedFault", (0,))


def test_a_collective_that_waited_for_a_peer_past_its_timeout_is_a_collective_timeout():
    gloo = RuntimeError(
        "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation"
    )
    cause = cause_of(gloo, rank=0)
    assert (cause.cause, cause.exception, cause.ranks) == ("collective_timeout", "RuntimeError", (0,))


def test_an_interruption_met_while_tearing_down_still_names_the_timeout():
    try:
        try:
            raise _interrupted((0, Interruption.SOFT_TIMEOUT))
        except RankShouldRestart:
            raise OSError("socket closed during abandon") from None
    except OSError as error:
        assert cause_of(error, rank=0).cause == "soft_timeout"


def _attempt(at: float, iteration: int, restart: int = 0) -> dict:
    return {
        "kind": "attempt_start",
        "time": at,
        "at": at,
        "inprocess_iteration": iteration,
        "launcher_restart": restart,
        "process_started_at": 0.5,
    }


EVENTS = [
    {"kind": "launch", "time": 0.0, "at": 0.0},
    _attempt(1.0, 0),
    {"kind": "resumed", "time": 2.0, "step": 0},
    {"kind": "step", "time": 3.0, "step": 1, "duration_s": 1.0},
    _attempt(7.0, 1),
    {"kind": "resumed", "time": 8.0, "step": 0},
]


def test_a_soft_timeout_restart_is_reported_as_a_soft_timeout(tmp_path):
    cause = cause_of(_interrupted((1, Interruption.SOFT_TIMEOUT)), rank=0, soft_timeout_s=23.0)
    write_note(tmp_path, cause, launcher_restart=0, iteration=0, rank=0, at=6.0)
    [restart] = analyze(EVENTS, [], 9.0, read_notes(tmp_path))["restarts"]
    assert (restart["kind"], restart["cause"]) == ("soft_timeout", "soft_timeout")
    assert restart["cause_detail"] == "soft timeout on rank 1 (no progress for 23 s)"


def test_an_exception_restart_is_reported_with_its_type_from_the_rank_that_raised_it(tmp_path):
    seen_by_rank0 = cause_of(_interrupted((1, Interruption.EXCEPTION)), rank=0)
    raised_on_rank1 = cause_of(ValueError("bad batch"), rank=1)
    write_note(tmp_path, seen_by_rank0, launcher_restart=0, iteration=0, rank=0, at=6.0)
    write_note(tmp_path, raised_on_rank1, launcher_restart=0, iteration=0, rank=1, at=6.0)
    [restart] = analyze(EVENTS, [], 9.0, read_notes(tmp_path))["restarts"]
    assert restart["cause"] == "exception"
    assert restart["cause_detail"] == "exception ValueError on rank 1: bad batch"


def test_a_peers_error_caused_by_the_restart_is_not_taken_for_the_exception(tmp_path):
    """Rank 1 raises; the restart takes its connections down before rank 0 is told, and rank
    0's collective fails with an error of its own, written down a moment later."""
    raised_on_rank1 = cause_of(InjectedFault("injected fault exception@6:1"), rank=1)
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33481")
    consequence_on_rank0 = cause_of(gloo, rank=0)
    assert consequence_on_rank0.cause == "exception"
    for rank0_noted_at in (6.2, 5.9):  # the raising rank's teardown may note it later
        write_note(tmp_path, consequence_on_rank0, launcher_restart=0, iteration=0, rank=0, at=rank0_noted_at)
        write_note(tmp_path, raised_on_rank1, launcher_restart=0, iteration=0, rank=1, at=6.0)
        [restart] = analyze(EVENTS, [], 9.0, read_notes(tmp_path))["restarts"]
        assert restart["cause_detail"] == "exception InjectedFault on rank 1: injected fault exception@6:1"


def test_a_repeated_restart_request_without_a_message_is_not_taken_for_the_exception(tmp_path):
    """NVRx raises RankShouldRestart again without its message (until the rank reaches the
    wrapper; or after one landed in a weakref callback, where Python ignores it): a rank
    whose attempt ended on a bare one (noted first) knows nothing of the cause (a fresh-clone
    run reported "exception RankShouldRestart on rank 0")."""
    bare_on_rank0 = cause_of(RankShouldRestart(), rank=0)
    assert bare_on_rank0.cause == "unknown"
    raised_on_rank1 = cause_of(InjectedFault("injected fault exception@6:1"), rank=1)
    write_note(tmp_path, bare_on_rank0, launcher_restart=0, iteration=0, rank=0, at=5.9)
    write_note(tmp_path, raised_on_rank1, launcher_restart=0, iteration=0, rank=1, at=6.0)
    [restart] = analyze(EVENTS, [], 9.0, read_notes(tmp_path))["restarts"]
    assert restart["cause_detail"] == "exception InjectedFault on rank 1: injected fault exception@6:1"
    # Alone, before a worker-group restart (a rank was killed), it leaves the launcher's cause.
    (tmp_path / "restart_causes" / "group0-attempt0-rank1.json").unlink()
    events = [*EVENTS[:4], _attempt(7.0, 0, restart=1), EVENTS[5]]
    [restart] = analyze(events, [], 9.0, read_notes(tmp_path))["restarts"]
    assert (restart["mechanism"], restart["cause"]) == ("launcher", "launcher")


def test_a_worker_group_restart_after_a_rank_died_is_the_launcher_s_not_the_survivors_error(tmp_path):
    """Rank 1 is SIGKILLed (or aborts): rank 0's collective fails with "Connection reset by
    peer" and rank 0 notes that before ft_launcher restarts the group. The restart is the
    launcher's (a process ended); rank 0's error is what it saw of it, not the cause."""
    gloo = RuntimeError(
        "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:28881: Connection reset by peer"
    )
    write_note(tmp_path, cause_of(gloo, rank=0), launcher_restart=0, iteration=0, rank=0, at=6.0)
    events = [*EVENTS[:4], _attempt(7.0, 0, restart=1), EVENTS[5]]
    [restart] = analyze(events, [], 9.0, read_notes(tmp_path))["restarts"]
    assert (restart["mechanism"], restart["cause"]) == ("launcher", "launcher")
    # In process, the survivors' error is all there is to say (the raising rank's note is missing).
    [restart] = analyze(EVENTS, [], 9.0, read_notes(tmp_path))["restarts"]
    assert (restart["mechanism"], restart["cause"]) == ("inprocess", "exception")
    # A rank's own exception before a launcher restart stays the cause.
    write_note(
        tmp_path, cause_of(ValueError("bad batch"), rank=1), launcher_restart=0, iteration=0, rank=1, at=6.0
    )
    [restart] = analyze(events, [], 9.0, read_notes(tmp_path))["restarts"]
    assert restart["cause_detail"] == "exception ValueError on rank 1: bad batch"


def test_a_note_of_an_earlier_attempt_is_not_taken_for_this_restart_cause(tmp_path):
    old = cause_of(ValueError("long ago"), rank=0)
    write_note(tmp_path, old, launcher_restart=0, iteration=0, rank=0, at=0.5)  # before the attempt
    [restart] = analyze(EVENTS, [], 9.0, read_notes(tmp_path))["restarts"]
    assert restart["cause"] == "unknown"


def test_a_worker_group_restart_without_a_note_is_the_launcher_s():
    events = [*EVENTS[:4], _attempt(7.0, 0, restart=1), EVENTS[5]]
    [restart] = analyze(events, [], 9.0, [])["restarts"]
    assert (restart["mechanism"], restart["cause"]) == ("launcher", "launcher")
    assert restart["cause_detail"] == "process exit or missed ft_launcher heartbeat"


def test_the_progress_line_names_the_restart_cause_and_the_injected_fault(caplog):
    progress = Progress(TrainConfig(), rank=0, world_size=2)
    restart = {
        "kind": "hang",
        "cause": "soft_timeout",
        "cause_detail": "soft timeout on rank 1 (no progress for 23 s)",
        "mechanism": "inprocess",
        "downtime_s": 4.0,
        "steps_redone": 2,
    }
    with caplog.at_level(logging.INFO, logger="trainer.progress"):
        progress.on_restart(restart, 1)
    assert "restart 1: soft timeout on rank 1 (no progress for 23 s) (injected hang), inprocess restart" in (
        caplog.text
    )
    assert "unknown" not in caplog.text


@pytest.mark.timeout(60)
def test_the_wrapper_teardown_writes_down_why_the_attempt_ended(tmp_path, monkeypatch):
    """The Finalize given to NVRx's wrapper, called as the wrapper calls it after a restart."""
    from types import SimpleNamespace

    from trainer.resilience import _Restarts, _wrapper

    monkeypatch.setenv("MASTER_PORT", "29555")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    config = TrainConfig()
    config.run.workdir = str(tmp_path)
    restarts = _Restarts()
    finalize = _wrapper(config, restarts).finalize
    finalize(SimpleNamespace(iteration=0, fn_exception=InjectedFault("injected fault exception@3:1")))
    restarts.cause = cause_of(_interrupted((0, Interruption.SOFT_TIMEOUT)), rank=1, soft_timeout_s=40.0)
    finalize(SimpleNamespace(iteration=1, fn_exception=None))
    first, second = read_notes(tmp_path)
    assert (first["launcher_restart"], first["iteration"], first["rank"]) == (2, 0, 1)
    assert (first["cause"], first["exception"]) == ("exception", "InjectedFault")
    assert (second["iteration"], second["cause"], second["ranks"]) == (1, "soft_timeout", [0])
