"""The GPU machine's scripts, checked on CPU: benchmarks/gpu_smoke.sh's dry run (every command
parses and resolves to a config a CUDA rank accepts), its verdicts on fabricated summary.json
files (passing and failing ones), its whole flow with a stand-in launcher that writes those
files instead of training, its process-group probe for real (gloo), the kill of a run past
its limit, scripts/fetch-gpu-wheels.sh's checks, and `rtp bench checkpoint --override`
(how gpu_check.sh hands the 1B runs the GPU timeout table)."""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import psutil
import pytest

from benchmarks import gpu_smoke
from benchmarks.gpu_smoke import GPU_TIMEOUTS, SmokeRun, check_run, plan_runs
from trainer.checkpointing.manager import writer_class

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
PLANNED = {
    "async",
    "async-exception",
    "async-sigkill",
    "async-slow-save",
    "async-tier-off",
    "sync",
    "sync-exception",
    "sync-sigkill",
    "torch-async",
    "torch-async-exception",
    "torch-async-sigkill",
    "off",
    "process-group",
}


@functools.cache
def diagnostics_folder(collective: str = "nccl:all_reduce") -> str:
    """What an in-process restart on NCCL leaves (trainer/diagnostics.py): rank 0's stacks and
    a flight recorder dump holding `collective`."""
    folder = Path(tempfile.mkdtemp(prefix="rtp-test-diagnostics-"))
    (folder / "stacks_rank_0.txt").write_text('Thread 0x1 (most recent call first):\n  File "x.py", line 1\n')
    (folder / "fr_rank_0").write_bytes(pickle.dumps({"entries": [{"profiling_name": collective}]}))
    return str(folder)


def summary(mode: str = "async", restarts=(), sha: str = "a" * 64, **changes) -> dict:
    """A summary.json as a completed 6-step one-rank run writes it."""
    base = {
        "steps": 6,
        "target_steps": 6,
        "completed": True,
        "device": "cuda",
        "world_size": 1,
        "checkpoint_mode": mode,
        "final_loss": 4.5,
        "goodput_pct": 50.0,
        "lost_steps": 0,
        "checkpoint_blocked_s": 0.1,
        "checkpoint_saves": [{"step": 2, "blocked_s": 0.01}, {"step": 4, "blocked_s": 0.01}],
        "restarts": [
            {"kind": k, "mechanism": m, "downtime_s": 2.0, "diagnostics": diagnostics_folder()}
            for k, m in restarts
        ],
        "model_sha256": sha,
    }
    return {**base, **changes}


def verdict(run: SmokeRun, run_summary, baseline=None, *, exact=True, exit_code=0, **kwargs) -> dict:
    return check_run(
        run,
        exit_code=exit_code,
        seconds=3.0,
        summary=run_summary,
        baseline=baseline if baseline is not None else summary(run.mode),
        device="cuda",
        exact_required=exact,
        soft_timeout_s=GPU_TIMEOUTS["soft_timeout_s"],
        **kwargs,
    )


def test_the_plan_covers_every_mode_both_faults_and_the_slow_save():
    runs = {run.name: run for run in plan_runs(["async", "sync", "torch-async"])}
    assert set(runs) | {"process-group"} == PLANNED
    assert next(iter(runs)) == "async"  # the default mode runs first
    assert runs["sync-exception"].fault == "exception@3" and runs["sync-exception"].baseline == "sync"
    assert runs["torch-async-sigkill"].fault == "sigkill@4"
    assert runs["async-slow-save"].fault == "slow-save@4" and runs["off"].baseline is None
    assert runs["async-tier-off"].local_every == 0 and runs["async-tier-off"].baseline == "async"


def test_dry_run_parses_every_command_into_a_config_a_cuda_rank_accepts(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_smoke.sh"), "--dry-run", "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    document = json.loads((tmp_path / "out" / "gpu-smoke.json").read_text())
    assert document["dry_run"] and document["ok"] and not document["cpu"]
    assert document["exactness_checked"] == document["deterministic"] == gpu_smoke.deterministic_available()
    checks = {c["name"]: c for c in document["checks"]}
    assert set(checks) == PLANNED and {c["status"] for c in checks.values()} == {"planned"}
    for name, check in checks.items():
        if check["kind"] != "run":
            continue
        # The smoke's own timeouts win over the GPU table train-local puts first on CUDA.
        settings = check["settings"]
        assert (settings["soft_timeout_s"], settings["hard_timeout_s"], settings["collective_timeout_s"]) == (
            20.0,
            40.0,
            60.0,
        )
        tier = 0 if name == "async-tier-off" else 1
        assert settings["local_every_steps"] == tier and settings["checkpoint_mode"] == check["mode"]
        assert settings["faults"] == (check["fault"] or ""), name
        assert check["command"][1:4] == ["-m", "rtp_cli.main", "train-local"]
        assert f"--workdir={tmp_path / 'work' / name}" in check["command"]
    assert not (tmp_path / "out" / "gpu-smoke-logs.tar.gz").exists()
    assert "async-slow-save" in result.stdout and "planned" in result.stdout


def test_a_dry_run_reports_a_command_that_does_not_resolve(monkeypatch, tmp_path):
    # On CUDA a collective timeout at or below the hard timeout is refused (NCCL's watchdog).
    monkeypatch.setitem(gpu_smoke.GPU_TIMEOUTS, "collective_timeout_s", 30.0)
    code = gpu_smoke.main(["--dry-run", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    document = json.loads((tmp_path / "out" / "gpu-smoke.json").read_text())
    assert code == 1 and not document["ok"]
    failed = [c for c in document["checks"] if c["status"] == "fail"]
    assert len(failed) == 12 and "must exceed resilience.hard_timeout_s" in failed[0]["failures"][0]


def test_an_in_process_restart_on_nccl_must_leave_its_flight_recorder_dump():
    exception = SmokeRun("async-exception", "async", "exception@3")
    run_summary = summary(restarts=[("exception", "inprocess")])
    run_summary["restarts"][0]["diagnostics"] = diagnostics_folder("gloo:all_reduce")
    assert any("holds no NCCL collective" in f for f in verdict(exception, run_summary)["failures"])
    run_summary["restarts"][0]["diagnostics"] = ""
    assert any("left no stacks" in f for f in verdict(exception, run_summary)["failures"])


def test_recovered_runs_pass_with_the_expected_mechanism():
    exception = SmokeRun("async-exception", "async", "exception@3")
    result = verdict(exception, summary(restarts=[("exception", "inprocess")]))
    assert result["status"] == "pass", result["failures"]
    assert result["same_as_fault_free"] is True and result["restarts"][0]["mechanism"] == "inprocess"
    sigkill = SmokeRun("sync-sigkill", "sync", "sigkill@4")
    assert verdict(sigkill, summary("sync", restarts=[("sigkill", "launcher")]))["status"] == "pass"
    assert verdict(SmokeRun("off", "off"), summary("off"), baseline={})["status"] == "pass"


@pytest.mark.parametrize(
    ("run", "run_summary", "exit_code", "expected"),
    [
        # recovered, but by the wrong layer
        (
            SmokeRun("a-e", "async", "exception@3"),
            summary(restarts=[("exception", "launcher")]),
            0,
            "expected exactly one exception restart, inprocess",
        ),
        # the fault never fired
        (
            SmokeRun("a-k", "async", "sigkill@4"),
            summary(),
            0,
            "restarts none, expected exactly one sigkill restart, launcher",
        ),
        # two restarts for one fault
        (
            SmokeRun("a-k", "async", "sigkill@4"),
            summary(restarts=[("sigkill", "launcher")] * 2),
            0,
            "expected exactly one",
        ),
        # a fault-free run that restarted
        (SmokeRun("sync", "sync"), summary("sync", restarts=[("unknown", "inprocess")]), 0, "expected none"),
        (
            SmokeRun("sync", "sync"),
            summary("sync", completed=False, steps=4),
            0,
            "did not complete: step 4 of 6",
        ),
        (SmokeRun("sync", "sync"), summary("sync"), 1, "exit code 1"),
        (SmokeRun("sync", "sync"), summary("sync", device="cpu"), 0, "trained on 'cpu', expected 'cuda'"),
        (SmokeRun("sync", "sync"), summary("async"), 0, "checkpoint mode 'async', expected 'sync'"),
        (SmokeRun("sync", "sync"), summary("sync", final_loss=float("nan")), 0, "not a finite number"),
        (SmokeRun("sync", "sync"), None, 0, "no summary.json"),
    ],
)
def test_failing_runs_fail_and_say_why(run, run_summary, exit_code, expected):
    result = verdict(run, run_summary, exit_code=exit_code)
    assert result["status"] == "fail"
    assert any(expected in failure for failure in result["failures"]), result["failures"]


def test_weights_equality_fails_only_where_training_is_deterministic():
    run = SmokeRun("async-exception", "async", "exception@3")
    differing = summary(restarts=[("exception", "inprocess")], sha="b" * 64)
    strict = verdict(run, differing, exact=True)
    assert strict["status"] == "fail" and "model_sha256 differs" in strict["failures"][0]
    informative = verdict(run, differing, exact=False)
    assert informative["status"] == "pass" and informative["same_as_fault_free"] is False
    missing = verdict(run, summary(restarts=[("exception", "inprocess")]), baseline={}, exact=False)
    assert missing["status"] == "fail" and "no fault-free async run" in missing["failures"][0]


def test_the_tier_off_run_must_hold_one_copy_of_the_state_and_the_async_runs_weights():
    run = SmokeRun("async-tier-off", "async", local_every=0)
    one_slot = verdict(run, summary(checkpoint_host_copies=1.006))
    assert (
        one_slot["status"] == "pass" and one_slot["host_copies"] == 1.006 and one_slot["same_as_fault_free"]
    )
    two = verdict(run, summary(checkpoint_host_copies=2.01))
    assert two["status"] == "fail" and "expected one slot" in two["failures"][0]
    assert verdict(run, summary())["status"] == "fail"  # a summary without the figure says nothing
    other = verdict(run, summary(checkpoint_host_copies=1.0, sha="c" * 64))
    assert other["status"] == "fail" and "differs from the fault-free async run" in other["failures"][0]


def test_the_slow_save_must_block_past_the_soft_timeout_without_a_restart():
    run = SmokeRun("async-slow-save", "async", "slow-save@4")
    saves = [{"step": 2, "blocked_s": 0.01}, {"step": 4, "blocked_s": 40.3}, {"step": 6, "blocked_s": 0.01}]
    assert verdict(run, summary(checkpoint_saves=saves))["status"] == "pass"
    quick = [{"step": 4, "blocked_s": 0.2}]
    assert "the slow save did not happen" in verdict(run, summary(checkpoint_saves=quick))["failures"][0]
    restarted = verdict(run, summary(checkpoint_saves=saves, restarts=[("unknown", "inprocess")]))
    assert restarted["failures"] == ["restarts [('unknown', 'inprocess')], expected none"]


def _stand_in_launcher(bad: dict[str, dict]):
    """Writes what a run would have written (summary.json, a probe's JSON line) instead of
    training; `bad` changes the summary of the named runs."""

    def launch(command, log_path, timeout_s, env):
        log_path.write_text("stand-in\n")
        if "--process-group-probe" in command:
            probe = {
                "device": "cpu",
                "backend": "gloo",
                "world_size": 1,
                "host_all_reduce": True,
                "device_all_reduce": True,
                "polled_barrier": True,
            }
            log_path.write_text(json.dumps(probe) + "\n")
            return gpu_smoke.Outcome(0, 0.5)
        flags = dict(
            arg.removeprefix("--").split("=", 1) for arg in command if arg.startswith("--") and "=" in arg
        )
        workdir = Path(flags["workdir"])
        kind = flags.get("fault", "").partition("@")[0]
        restarts = [(kind, gpu_smoke.EXPECTED_RESTART[kind])] if kind in gpu_smoke.EXPECTED_RESTART else []
        blocked = 2 * gpu_smoke.CPU_TIMEOUTS["soft_timeout_s"]
        saves = [{"step": 4, "blocked_s": blocked}] if kind == "slow-save" else []
        tier_off = "--override=checkpoint.local_every_steps=0" in command
        # The summary names the writer's mode, a plug-in's (torch-async) too, as a rank does.
        plug_in = [arg.split("=", 2)[2] for arg in command if arg.startswith("--override=checkpoint.writer=")]
        written = summary(
            writer_class(plug_in[0]).mode if plug_in else flags["checkpoint-mode"],
            restarts=restarts,
            device="cpu",
            checkpoint_saves=saves,
            checkpoint_host_copies=1.006 if tier_off else 2.01,
        )
        written.update(bad.get(workdir.name, {}))
        (workdir / "logs").mkdir(parents=True)
        (workdir / "logs" / "train.log").write_text("rank 0\n")
        (workdir / "summary.json").write_text(json.dumps(written))
        return gpu_smoke.Outcome(0, 1.0)

    return launch


def test_the_whole_flow_writes_the_verdicts_and_exits_non_zero_on_any_failure(tmp_path, capsys):
    args = ["--cpu", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--jobs", "3"]
    assert gpu_smoke.main(args, launcher=_stand_in_launcher({})) == 0
    document = json.loads((tmp_path / "out" / "gpu-smoke.json").read_text())
    assert document["ok"] and {c["name"] for c in document["checks"]} == PLANNED
    assert {c["status"] for c in document["checks"]} == {"pass"}
    with tarfile.open(tmp_path / "out" / "gpu-smoke-logs.tar.gz") as archive:
        names = archive.getnames()
    assert (
        "async-sigkill.log" in names and "async-sigkill.train.log" in names and "process-group.log" in names
    )
    assert "gpu_smoke: ok" in capsys.readouterr().out

    # One recovered run whose weights differ: on CPU training is deterministic, so that fails.
    bad = {"sync-exception": {"model_sha256": "f" * 64}}
    assert gpu_smoke.main(args, launcher=_stand_in_launcher(bad)) == 1
    document = json.loads((tmp_path / "out" / "gpu-smoke.json").read_text())
    failed = [c["name"] for c in document["checks"] if c["status"] != "pass"]
    assert not document["ok"] and failed == ["sync-exception"]
    assert "gpu_smoke: FAILED" in capsys.readouterr().out


def test_runs_that_cannot_start_within_the_budget_are_failures(tmp_path):
    args = ["--cpu", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--budget", "5"]
    assert gpu_smoke.main(args, launcher=_stand_in_launcher({})) == 1
    document = json.loads((tmp_path / "out" / "gpu-smoke.json").read_text())
    assert {c["status"] for c in document["checks"]} == {"skipped"}


def test_the_process_group_probe_reduces_host_and_device_tensors(tmp_path):
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(gpu_smoke._free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_smoke", "--process-group-probe"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe == {
        "device": "cpu",
        "backend": "gloo",
        "barrier_backend": "gloo",  # torch's barrier takes the group's CPU backend
        "world_size": 1,
        "host_all_reduce": True,
        "device_all_reduce": True,
        "polled_barrier": True,
        "node_health": [],  # the GPU node checks run on CUDA only
    }
    assert gpu_smoke.check_process_group(probe, exit_code=0, seconds=1.0, device="cpu")["status"] == "pass"
    sick = {**probe, "node_health": [{"name": "gpus", "ok": False, "detail": "0 GPUs visible, 1 expected"}]}
    verdict = gpu_smoke.check_process_group(sick, exit_code=0, seconds=1.0, device="cpu")
    assert verdict["failures"] == ["node health: gpus: 0 GPUs visible, 1 expected"]
    wrong = gpu_smoke.check_process_group(
        {**probe, "device_all_reduce": False}, exit_code=0, seconds=1.0, device="cpu"
    )
    assert wrong["status"] == "fail"
    stuck = gpu_smoke.check_process_group(
        {**probe, "polled_barrier": False}, exit_code=0, seconds=1.0, device="cpu"
    )
    assert stuck["failures"] == ["the polled barrier (trainer/waiting.py) did not complete"]
    assert gpu_smoke.check_process_group(probe, exit_code=0, seconds=1.0, device="cuda")["status"] == "fail"


def test_a_run_past_its_limit_is_killed_with_what_it_started(tmp_path):
    # A child in a session of its own, as ft_launcher starts its ranks.
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    outcome = gpu_smoke.launch([sys.executable, "-c", script], tmp_path / "run.log", 3.0, dict(os.environ))
    assert outcome.timed_out and outcome.exit_code is None and time.monotonic() - started < 30
    child = int((tmp_path / "run.log").read_text().split()[0])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the run's child outlived it"
        time.sleep(0.1)
    result = verdict(SmokeRun("sync", "sync"), None, exit_code=None, timed_out=True)
    assert "ran past its time limit" in result["failures"][0]


def _wheel(folder: Path, name: str, requires: list[str], size: int = 0) -> None:
    path = folder / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        lines = [f"Name: {name}", *(f"Requires-Dist: {r}" for r in requires)]
        archive.writestr(f"{name.replace('-', '_')}-1.0.dist-info/METADATA", "\n".join(lines) + "\n")
    if size:
        with path.open("ab") as handle:  # sparse: the apparent size is what counts
            handle.truncate(size)


def _fetch_check(wheels: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "RTP_WHEELS": str(wheels)}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "fetch-gpu-wheels.sh"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def test_fetch_wheels_checks_the_metadata_and_the_64_mib_limit(tmp_path):
    requires = [
        "defusedxml",
        "nvidia-ml-py (>=12.570.86)",
        "pynvml (>=12.0.0)",
        "torch (>=2.3.0)",
        "pytest ; extra == 'test'",
    ]
    _wheel(tmp_path, "nvidia-resiliency-ext", requires)
    _wheel(tmp_path, "defusedxml", [])
    lacking = _fetch_check(tmp_path)
    assert lacking.returncode != 0 and "needs nvidia-ml-py, not fetched" in lacking.stderr
    _wheel(tmp_path, "nvidia-ml-py", [])
    fits = _fetch_check(tmp_path)
    assert fits.returncode == 0, fits.stderr
    assert "of the 64 MiB that travel with a run" in fits.stdout
    _wheel(tmp_path, "numpy", [], size=64 * 2**20)
    too_big = _fetch_check(tmp_path)
    assert too_big.returncode != 0 and "is over 64 MiB" in too_big.stderr


def test_bench_checkpoint_hands_its_overrides_to_every_mode(monkeypatch, tmp_path):
    """gpu_check.sh gives the 1B runs the GPU timeout table this way (a CUDA rank refuses the
    CPU defaults: collective 15 s is below the hard 45 s)."""
    from benchmarks import checkpoint
    from rtp_cli.main import build_parser
    from trainer import gpu_defaults

    seen = []

    class Stop(Exception):
        pass

    def record(nproc, config, **kwargs):  # a stand-in for the launcher: no processes
        seen.append(config)
        raise Stop

    monkeypatch.setattr(checkpoint, "run_local_training", record)
    table = [arg for item in gpu_defaults.resilience_overrides() for arg in ("--override", item)]
    args = build_parser().parse_args(
        ["bench", "checkpoint", "--preset", "tiny-cpu", "--modes", "sync", *table]
    )
    with pytest.raises(Stop):
        checkpoint.run_mode(
            "sync",
            tmp_path,
            tmp_path / "w",
            nproc=1,
            steps=2,
            every=1,
            preset=args.preset,
            overrides=args.override,
        )
    gpu_defaults.check_timeouts(seen[0].resilience, "cuda")
    assert seen[0].resilience.timeout_floor_s == gpu_defaults.GPU_RESILIENCE["timeout_floor_s"]
    assert seen[0].checkpoint.mode == "sync"


def _merge_program() -> str:
    """gpu_check.sh's last Python program: it writes gpu-check.json from the parts' results."""
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    start = text.index("# gpu-check.json from the parts' results")
    body = text[start:].split("<<'PY'\n", 1)[1]
    return body.split("\nPY\n", 1)[0]


def test_gpu_check_merges_the_parts_and_a_skipped_part_does_not_fail_it(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    modes = {
        "off": {"wall_vs_off": 1.0, "window_vs_off": 1.0},
        "async": {"wall_vs_off": 1.2, "window_vs_off": 1.02},
    }
    (work / "gpu-checkpoint.json").write_text(json.dumps({"modes": modes}))
    (work / "gpu-recovery.json").write_text(json.dumps({"inprocess": {"exact": True}}))
    table = "--override resilience.soft_timeout_s=300 --override resilience.hard_timeout_s=600"

    def merge(*results: str) -> tuple[subprocess.CompletedProcess, dict]:
        argv = [sys.executable, "-c", _merge_program(), str(out), str(work), "255", "off,async", "20", table]
        done = subprocess.run([*argv, *results], capture_output=True, text=True, timeout=60)
        return done, json.loads((out / "gpu-check.json").read_text())

    done, check = merge("checkpoint 0 50", "recovery 0 30")
    assert done.returncode == 0, done.stderr
    assert check["ok"] and check["checkpoint_vs_off"]["async"]["window_vs_off"] == 1.02
    assert check["fast_tier_every_steps"] == 20 and check["checkpoint_modes"] == ["off", "async"]
    assert check["gpu_resilience_overrides"] == [
        "resilience.soft_timeout_s=300",
        "resilience.hard_timeout_s=600",
    ]
    assert check["parts"]["recovery"] == {
        "status": "pass",
        "exit_code": 0,
        "seconds": 30,
        "result": {"inprocess": {"exact": True}},
    }
    # A part the budget skipped is said, not a failure.
    done, check = merge("checkpoint 0 50", "recovery 0 30", "throughput skipped 0")
    assert done.returncode == 0 and check["ok"] and check["skipped"] == ["throughput"]
    # A part that failed, or left no JSON: each fails the check.
    done, check = merge("checkpoint 0 50", "throughput 0 9", "recovery 124 80")
    assert done.returncode == 1 and not check["ok"]
    statuses = {name: part["status"] for name, part in check["parts"].items()}
    assert statuses == {"checkpoint": "pass", "throughput": "fail", "recovery": "fail"}
    # Nothing ran: no verdict to give.
    done, check = merge("throughput skipped 0")
    assert done.returncode == 1 and not check["ok"]


GPU_CHECK_SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
RECIPE = ROOT / "benchmarks" / "gpu_recipe.sh"


def _shell_number(script: Path, name: str) -> int:
    """A `NAME=N` (or `NAME=${VAR:-N}`) assignment's number in `script`."""
    match = re.search(rf"^{name}=(?:\$\{{\w+:-)?(\d+)", script.read_text(), re.MULTILINE)
    assert match, f"{name} is not set in {script.name}"
    return int(match.group(1))


def _check_parts() -> dict[str, int]:
    """gpu_check.sh's part table: name -> time limit in seconds."""
    rows = re.findall(r'^  "([\w-]+) (\d+) bench ', GPU_CHECK_SCRIPT.read_text(), re.MULTILINE)
    return {name: int(limit) for name, limit in rows}


def test_the_default_parts_limits_with_setup_and_report_fit_the_checks_budget():
    parts = _check_parts()
    default = (
        re.search(r'^DEFAULT_PARTS="([^"]+)"', GPU_CHECK_SCRIPT.read_text(), re.MULTILINE).group(1).split()
    )
    assert default == ["checkpoint", "throughput", "recovery"] and set(default) < set(parts)
    needed = (
        _shell_number(GPU_CHECK_SCRIPT, "SETUP_RESERVE_S")
        + sum(parts[name] for name in default)
        + _shell_number(GPU_CHECK_SCRIPT, "REPORT_RESERVE_S")
    )
    assert needed <= _shell_number(GPU_CHECK_SCRIPT, "BUDGET_S")
    # The recipe hands the check at least that budget.
    assert needed <= _shell_number(RECIPE, "CHECK_BUDGET_S")


def test_the_recipe_is_one_call_of_at_most_seven_minutes():
    smoke_limit = sum(_shell_number(RECIPE, n) for n in ("SMOKE_SETUP_S", "SMOKE_BUDGET_S", "SMOKE_REPORT_S"))
    total = (
        smoke_limit
        + _shell_number(RECIPE, "CHECK_BUDGET_S")
        + 2 * _shell_number(RECIPE, "CUT_GRACE_S")
        + _shell_number(RECIPE, "MARGIN_S")
    )
    assert total <= _shell_number(RECIPE, "CALL_LIMIT_S") == 420
    # Each script is cut at its share; the check after the smoke whatever the smoke's verdict.
    text = RECIPE.read_text()
    assert 'timeout --kill-after=5 "$SMOKE_LIMIT_S" bash benchmarks/gpu_smoke.sh' in text
    assert 'timeout --kill-after=5 "$((CHECK_BUDGET_S + 5))" bash benchmarks/gpu_check.sh' in text
    # The documented call is this recipe within that limit, and a part reruns alone.
    docs = (ROOT / "docs" / "performance.md").read_text()
    assert 'run(command="bash benchmarks/gpu_recipe.sh", carry=["benchmarks/wheels"], timeout_s=420)' in docs
    assert "gpu_check.sh --parts " in docs and "gpu_smoke.sh --only " in docs


def test_a_check_whose_parts_exceed_its_budget_is_refused_before_anything_runs(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "RTP_GPU_CHECK_BUDGET_S": "100"}
    refused = subprocess.run(
        ["bash", str(GPU_CHECK_SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60, env=env
    )
    assert refused.returncode == 2 and "more than the budget of 100 s" in refused.stderr
    # One part alone fits (a rerun in a second call); an unknown part is named.
    alone = subprocess.run(
        ["bash", str(GPU_CHECK_SCRIPT), "--dry-run", "--parts", "recovery"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-2000:]
    planned = [line for line in alone.stdout.splitlines() if ": rtp bench " in line]
    assert len(planned) == 1 and planned[0].startswith("gpu_check: recovery (35 s)")
    unknown = subprocess.run(
        ["bash", str(GPU_CHECK_SCRIPT), "--dry-run", "--parts", "bogus"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert unknown.returncode == 2 and "no part named bogus" in unknown.stderr


def test_each_part_cleans_its_files_and_processes_on_exit_even_when_killed():
    text = GPU_CHECK_SCRIPT.read_text()
    assert "trap 'cleanup_part \"$CURRENT\"' EXIT" in text
    assert "trap 'exit 143' TERM INT HUP" in text  # a signal ends the script through its EXIT trap
    # The part runs in the background and is waited for, so a signal is handled at once.
    assert re.search(r'--json "\$WORK/gpu-\$name.json" >"\$WORK/logs/\$name.log" 2>&1 &\n  wait \$!', text)
    cleanup = text[text.index("cleanup_part() {") : text.index("trap 'cleanup_part")]
    for removed in ('"$WORK/tmp-$name"', '"$SHM_ROOT/$name"', "torch_*", "RTP_GPU_CHECK_PART"):
        assert removed in cleanup, removed
    # Each part writes its temporary files and its fast tier into the folders removed.
    assert 'TMPDIR="$WORK/tmp-$name"' in text and "checkpoint.local_dir=@SHM@" in text


def test_the_part_cleanup_removes_what_a_killed_part_left(tmp_path):
    """The script's cleanup, run as its trap runs it, over the folders a killed part leaves."""
    text = GPU_CHECK_SCRIPT.read_text()
    cleanup = text[text.index("cleanup_part() {") : text.index("trap 'cleanup_part")]
    work, shm = tmp_path / "work", tmp_path / "shm"
    (work / "tmp-checkpoint" / "rtp-bench-ckpt-x").mkdir(parents=True)
    (work / "tmp-checkpoint" / "rtp-bench-ckpt-x" / "shard").write_bytes(b"x" * 1000)
    (shm / "checkpoint").mkdir(parents=True)
    (shm / "checkpoint" / "rank_0_slot_0.data").write_bytes(b"x" * 1000)
    (shm / "throughput").mkdir()  # another part's: not this one's to remove
    sleeper = subprocess.Popen(
        ["sleep", "60"], env={**os.environ, "RTP_GPU_CHECK_PART": "checkpoint"}, start_new_session=True
    )
    program = f"PYTHON={sys.executable}; WORK={work}; SHM_ROOT={shm}\n{cleanup}\ncleanup_part checkpoint\n"
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sleeper.wait(timeout=10) == -9  # the part's process that outlived it
    assert not (work / "tmp-checkpoint").exists() and not (shm / "checkpoint").exists()
    assert (shm / "throughput").is_dir()
