"""Pure parts of fault tolerance: fault specs, once-per-run firing, goodput accounting,
the goodput report and the launcher's one-line failure reason."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from trainer.config import ConfigError, build_config
from trainer.faults import (
    FaultInjector,
    FaultSpec,
    FaultSpecError,
    InjectedFault,
    clear_fault_records,
    fired_faults,
    parse_faults,
    record_fatal_error,
    recorded_fatal_error,
)
from trainer.goodput import analyze, read_events
from trainer.launch import mark_new_run, root_cause
from trainer.report import goodput_html


def test_fault_specs_parse_and_bad_ones_say_the_form():
    assert parse_faults("exception@12, sigkill@20:1 hang@3") == [
        FaultSpec("exception", 12, 0),
        FaultSpec("sigkill", 20, 1),
        FaultSpec("hang", 3, 0),
    ]
    assert parse_faults("none") == [] and parse_faults("") == []
    for bad, hint in [
        ("boom@3", "unknown fault kind"),
        ("exception", "KIND@STEP"),
        ("exception@0", "at least 1"),
    ]:
        with pytest.raises(FaultSpecError, match=hint):
            parse_faults(bad)
    with pytest.raises(FaultSpecError, match="twice"):
        parse_faults("exception@3,exception@3")
    with pytest.raises(ConfigError, match="unknown fault kind"):
        build_config("tiny-cpu", ["run.faults=explode@3"])


def test_a_fault_fires_once_per_run_and_only_on_its_rank(tmp_path):
    specs = parse_faults("exception@3:1")
    with pytest.raises(FaultSpecError, match="2 ranks"):
        FaultInjector(parse_faults("exception@3:2"), tmp_path, rank=0, world_size=2)
    FaultInjector(specs, tmp_path, rank=0, world_size=2).at_step(3)  # not rank 0's fault
    injector = FaultInjector(specs, tmp_path, rank=1, world_size=2)
    injector.at_step(2)
    with pytest.raises(InjectedFault, match="exception@3:1"):
        injector.at_step(3)
    FaultInjector(specs, tmp_path, rank=1, world_size=2).at_step(3)  # a restarted rank redoes step 3
    [record] = fired_faults(tmp_path)
    assert (record["kind"], record["step"], record["rank"]) == ("exception", 3, 1)
    clear_fault_records(tmp_path)  # a new run fires it again
    with pytest.raises(InjectedFault):
        FaultInjector(specs, tmp_path, rank=1, world_size=2).at_step(3)


def test_a_fatal_error_is_remembered_until_a_new_run(tmp_path):
    record_fatal_error(tmp_path, FloatingPointError("loss became nan"))
    assert recorded_fatal_error(tmp_path) == "FloatingPointError: loss became nan"
    mark_new_run(tmp_path)
    assert recorded_fatal_error(tmp_path) is None


def _record_many(workdir: str, count: int) -> None:
    for i in range(count):
        record_fatal_error(workdir, FloatingPointError(f"loss became nan at step {i}"))


def test_ranks_recording_the_same_fatal_error_at_once_leave_a_whole_record(tmp_path):
    """Every rank records a diverged loss at the same moment: none fails doing so, and a
    reader (a restarted rank) never finds the record missing or cut short."""
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_record_many, args=(str(tmp_path), 300)) for _ in range(3)]
    record_fatal_error(tmp_path, FloatingPointError("loss became nan"))
    for writer in writers:
        writer.start()
    seen = 0
    while any(writer.is_alive() for writer in writers):
        assert (recorded_fatal_error(tmp_path) or "").startswith("FloatingPointError: loss became nan")
        seen += 1
    for writer in writers:
        writer.join()
    assert [writer.exitcode for writer in writers] == [0, 0, 0]
    assert seen > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fatal_error.json"]


def _steps(first: int, last: int, t0: float, duration: float = 0.5) -> list[dict]:
    return [
        {"kind": "step", "step": s, "time": t0 + (s - first + 1) * duration, "duration_s": duration}
        for s in range(first, last + 1)
    ]


def test_goodput_counts_each_step_once_and_splits_each_restart():
    events = [
        {"kind": "launch", "time": 0.0, "at": 0.0},
        {
            "kind": "attempt_start",
            "time": 1.0,
            "at": 1.0,
            "inprocess_iteration": 0,
            "launcher_restart": 0,
            "process_started_at": 0.5,
        },
        {"kind": "resumed", "time": 2.0, "step": 0, "phases": {"checkpoint_load_s": 0.0}},
        *_steps(1, 6, 2.0),  # steps 1..6 end at 2.5 .. 5.0
        # fault at 5.2 (step 7 on rank 1); in-process restart resumes from step 4
        {
            "kind": "attempt_start",
            "time": 7.0,
            "at": 7.0,
            "inprocess_iteration": 1,
            "launcher_restart": 0,
            "fault_detected_at": 6.0,
            "process_started_at": 0.5,
        },
        {"kind": "resumed", "time": 8.0, "step": 4, "phases": {"checkpoint_load_s": 0.3}},
        *_steps(5, 8, 8.0),  # ends at 10.0
        # sigkill at 10.1; the launcher's new processes start at 12.0
        {
            "kind": "attempt_start",
            "time": 13.0,
            "at": 13.0,
            "inprocess_iteration": 0,
            "launcher_restart": 1,
            "process_started_at": 12.0,
        },
        {"kind": "resumed", "time": 14.0, "step": 8, "phases": {}},
        *_steps(9, 10, 14.0),  # ends at 15.0
    ]
    faults = [
        {"kind": "exception", "step": 7, "rank": 1, "time": 5.2},
        {"kind": "sigkill", "step": 9, "rank": 0, "time": 10.1},
    ]
    result = analyze(events, faults, end_time=16.0)
    first, second = result["restarts"]
    assert (first["kind"], first["mechanism"], first["fault_step"], first["resumed_step"]) == (
        "exception",
        "inprocess",
        7,
        4,
    )
    assert first["detection_s"] == pytest.approx(0.8)
    assert first["shutdown_s"] == pytest.approx(1.8) and first["startup_s"] == pytest.approx(1.0)
    assert first["downtime_s"] == pytest.approx(2.8) and first["steps_redone"] == 2  # steps 5 and 6
    assert (second["kind"], second["mechanism"], second["resumed_step"]) == ("sigkill", "launcher", 8)
    assert second["detection_s"] is None
    assert second["shutdown_s"] == pytest.approx(1.9) and second["startup_s"] == pytest.approx(2.0)
    assert second["steps_redone"] == 0
    assert result["lost_steps"] == 2
    assert result["goodput_pct"] == pytest.approx(100 * 10 * 0.5 / 16.0, abs=0.01)  # 10 steps count once


def test_a_relaunch_of_the_same_run_counts_as_a_cold_restart():
    events = [
        {"kind": "launch", "time": 0.0, "at": 0.0},
        {"kind": "attempt_start", "time": 1.0, "at": 1.0, "inprocess_iteration": 0, "launcher_restart": 0},
        {"kind": "resumed", "time": 2.0, "step": 0},
        {
            "kind": "attempt_start",
            "time": 9.0,
            "at": 9.0,
            "inprocess_iteration": 0,
            "launcher_restart": 0,
            "process_started_at": 7.0,
        },
        {"kind": "resumed", "time": 10.0, "step": 0},
    ]
    [restart] = analyze(events, [{"kind": "exception", "step": 1, "rank": 1, "time": 3.0}], 11.0)["restarts"]
    assert restart["mechanism"] == "cold" and restart["shutdown_s"] == pytest.approx(4.0)


def test_events_of_earlier_runs_are_not_counted(tmp_path):
    lines = [
        {"kind": "step", "step": 1, "time": 1.0},
        {"kind": "launch", "time": 2.0},
        {"kind": "step", "step": 1, "time": 3.0},
    ]
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{cut sho")
    assert [e["time"] for e in read_events(tmp_path)] == [2.0, 3.0]


def test_the_report_shows_the_timeline_and_the_restarts():
    events = [
        {"kind": "step", "step": 1, "time": 1.0, "duration_s": 0.5},
        {"kind": "checkpoint_committed", "step": 1, "time": 1.2},
    ]
    faults = [{"kind": "hang", "step": 2, "rank": 1, "time": 1.5}]
    restarts = [
        {
            "kind": "hang",
            "mechanism": "inprocess",
            "fault_step": 2,
            "resumed_step": 0,
            "fault_at": 1.5,
            "resumed_at": 3.0,
            "downtime_s": 1.5,
            "detection_s": 1.0,
            "shutdown_s": 1.2,
            "startup_s": 0.3,
            "steps_redone": 1,
        }
    ]
    page = goodput_html(
        {"goodput_pct": 42.0, "restarts": restarts, "steps": 2, "target_steps": 2}, events, faults
    )
    assert "<svg" in page and "42.0 %" in page and "hang at step 2 on rank 1" in page
    assert "inprocess restart: 1.5 s down" in page


def test_root_cause_names_the_error_that_ended_the_run():
    log = "\n".join(
        [
            "[rank1]: trainer.faults.InjectedFault: injected fault exception@6:1",
            "[default] Worker group UNHEALTHY. 1/1 attempts left; will restart worker group",
            "[rank1]: RuntimeError: [gloo] Connection reset by peer",
            "[rank0]: trainer.faults.InjectedFault: injected fault exception@10:0",
        ]
    )
    assert root_cause(log) == "trainer.faults.InjectedFault: injected fault exception@10:0"
