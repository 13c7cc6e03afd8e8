"""The GPU smoke check (`benchmarks/gpu_smoke.sh`): does rtp train, save, fault and resume on
one GPU at all? Short runs of the user's own command, `rtp train-local`, then one verdict.

Runs (one rank each, preset small-cpu on CUDA, 6 steps, a durable save every 2 steps, the
fast tier every step, so a fault redoes at most one step):

- a fault-free run in every checkpoint mode (off, sync, torch-async, async), and one of
  async with the fast tier off (`async-tier-off`: saves captured into the host-state
  engine's one slot; host memory must be one copy of the state, the weights those of the
  async run);
- per mode in `--fault-modes`: `exception@3` (must be recovered in process: one restart of
  kind exception, mechanism inprocess, whose teardown left rank 0's stacks and a flight
  recorder dump with NCCL collectives in it) and `sigkill@4` (recovered by ft_launcher: kind
  sigkill, mechanism launcher), each to the last step;
- `slow-save@4`: that save blocks for twice the soft timeout; the run must finish with no
  restart (the keep-alive feeds the watchdog through blocking checkpoint work);
- a process-group probe: the job pods' GPU node checks (trainer/health.py: a matmul on the
  GPU, NVML's ECC counters), the trainer's own `init_distributed`, then an all-reduce of a host
  tensor and of a device tensor (NCCL has no CPU backend: both must work on CUDA), and the
  barrier the training thread polls, which torch serves on the group's CPU backend (gloo)
  wherever the group has one (`barrier_backend` says which).

Each faulted run's `model_sha256` is compared with the fault-free run of its mode. Only
with deterministic training (`training.deterministic`, when the config has it; always on
CPU) is a difference a failure; otherwise equality is recorded as information (bf16 kernels
on a GPU may differ between runs). On CUDA `rtp train-local` applies the GPU timeout table
(trainer/gpu_defaults.py: 300/600/900 s); the runs override it with seconds-scale timeouts
so that a restart and the slow save fit the time budget.

Writes `<out>/gpu-smoke.json` (every check: pass/fail/skipped, seconds, key numbers, the
command) and `<out>/gpu-smoke-logs.tar.gz` (each run's output and train.log), prints a
table and exits 1 when any check did not pass. `--dry-run` builds every command line,
parses and resolves it with the real parser and config (the GPU table first, as
train-local does on CUDA, and the CUDA timeout ordering check), and writes the JSON with
every check `planned`: no GPU, no training.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

STEPS = 6
EVERY = 2
MODES = ("async", "sync", "torch-async", "off")
"""Every checkpoint mode and torch-async (a plug-in writer); async (the default) first, so it runs first."""
GPU_PRESET, CPU_PRESET = "small-cpu", "tiny-cpu"
GPU_TIMEOUTS = {"soft_timeout_s": 20.0, "hard_timeout_s": 40.0, "collective_timeout_s": 60.0}
"""On CUDA the collective timeout (NCCL's watchdog) must exceed the hard timeout."""
CPU_TIMEOUTS = {"soft_timeout_s": 15.0, "hard_timeout_s": 40.0, "collective_timeout_s": 5.0}
"""On CPU (gloo) it must stay below it (trainer/gpu_defaults.check_timeouts); the soft timeout
leaves room for a small, busy CPU machine."""
EXPECTED_RESTART = {"exception": "inprocess", "sigkill": "launcher"}
"""Fault kind -> the mechanism that must recover it."""
FAULT_STEP = {"exception": 3, "sigkill": 4, "slow-save": 4}
"""slow-save acts inside a save: its step must be a save step (a multiple of EVERY)."""
SUMMARY_FILE, LOGS_FILE = "gpu-smoke.json", "gpu-smoke-logs.tar.gz"


@dataclasses.dataclass(frozen=True, slots=True)
class SmokeRun:
    """One `rtp train-local` run of the smoke check and what it must show."""

    name: str
    mode: str
    fault: str = ""
    """KIND@STEP, empty for a fault-free run."""
    local_every: int = 1
    """`checkpoint.local_every_steps` (0: the fast tier off)."""

    @property
    def fault_kind(self) -> str:
        return self.fault.partition("@")[0]

    @property
    def baseline(self) -> str | None:
        """The fault-free run of the same mode that this run's weights are compared with."""
        return self.mode if self.fault or self.local_every != 1 else None


def plan_runs(fault_modes: Sequence[str], slow_save_mode: str = "async") -> list[SmokeRun]:
    """Every run, in the order they start (async first)."""
    runs: list[SmokeRun] = []
    for mode in MODES:
        runs.append(SmokeRun(mode, mode))
        if mode == "async":
            runs.append(SmokeRun("async-tier-off", mode, local_every=0))
        if mode in fault_modes:
            for kind in ("exception", "sigkill"):
                runs.append(SmokeRun(f"{mode}-{kind}", mode, f"{kind}@{FAULT_STEP[kind]}"))
        if mode == slow_save_mode:
            runs.append(SmokeRun(f"{mode}-slow-save", mode, f"slow-save@{FAULT_STEP['slow-save']}"))
    return runs


def deterministic_available() -> bool:
    """Whether the config has `training.deterministic` (bit-identical GPU resumes)."""
    from trainer.config import TrainingConfig

    return "deterministic" in {f.name for f in dataclasses.fields(TrainingConfig)}


def train_args(run: SmokeRun, root: Path, dataset: Path, *, cpu: bool, deterministic: bool) -> list[str]:
    """The `rtp` arguments of one run (after `python -m rtp_cli.main`)."""
    from benchmarks.checkpoint import mode_overrides

    timeouts = CPU_TIMEOUTS if cpu else GPU_TIMEOUTS
    args = [
        "train-local",
        "--nproc=1",
        f"--preset={CPU_PRESET if cpu else GPU_PRESET}",
        f"--dataset-dir={dataset}",
        f"--workdir={root / run.name}",
        f"--checkpoint-local-dir={root / run.name / 'local-tier'}",
        f"--steps={STEPS}",
        f"--checkpoint-every={EVERY}",
        # torch-async is a plug-in writer in place of sync's (benchmarks/torch_async.py).
        *[
            f"--checkpoint-mode={value}" if key == "checkpoint.mode" else f"--override={key}={value}"
            for key, value in (setting.split("=", 1) for setting in mode_overrides(run.mode))
        ],
        "--seed=5",
        *[f"--override=resilience.{key}={value:g}" for key, value in timeouts.items()],
        f"--override=checkpoint.local_every_steps={run.local_every}",
        "--override=run.log_every_steps=1",
    ]
    if run.fault:
        args.append(f"--fault={run.fault}")
    if deterministic:
        args.append("--override=training.deterministic=true")
    return args


def resolve(args: list[str], *, cpu: bool) -> Any:
    """The config `rtp train-local` would train with for `args` (the GPU table first unless
    `cpu`, as train-local does on CUDA), checked as a rank checks it on that device."""
    from trainer import gpu_defaults
    from trainer.arguments import add_training_arguments, config_from_args

    parser = argparse.ArgumentParser(prog="rtp train-local")
    add_training_arguments(parser)
    parsed, launcher_args = parser.parse_known_args(args)
    if launcher_args[:1] != ["train-local"] or any(not a.startswith("--nproc=") for a in launcher_args[1:]):
        raise ValueError(f"not a train-local command line with trainer flags only: {launcher_args}")
    if not cpu:
        parsed.override = [*gpu_defaults.resilience_overrides(), *parsed.override]
    config = config_from_args(parsed)
    gpu_defaults.check_timeouts(config.resilience, "cpu" if cpu else "cuda")
    return config


# ----------------------------------------------------------------------------- checking


def check_run(
    run: SmokeRun,
    *,
    exit_code: int | None,
    seconds: float,
    summary: dict[str, Any] | None,
    baseline: dict[str, Any] | None,
    device: str,
    exact_required: bool,
    soft_timeout_s: float,
    timed_out: bool = False,
) -> dict[str, Any]:
    """One run's verdict from its exit code and summary.json (and its mode's fault-free
    run's summary): status pass/fail, what failed, and the key numbers."""
    failures: list[str] = []
    result: dict[str, Any] = {
        "name": run.name,
        "kind": "run",
        "mode": run.mode,
        "fault": run.fault or None,
        "exit_code": exit_code,
        "seconds": round(seconds, 2),
    }
    if timed_out:
        failures.append(f"ran past its time limit ({seconds:.0f} s) and was killed")
    elif exit_code != 0:
        failures.append(f"exit code {exit_code} (see {run.name}.log in {LOGS_FILE})")
    if summary is None:
        failures.append("no summary.json was written")
        return _verdict(result, failures)
    restarts = summary.get("restarts", [])
    result.update(
        completed=summary.get("completed"),
        steps=summary.get("steps"),
        device=summary.get("device"),
        world_size=summary.get("world_size"),
        checkpoint_mode=summary.get("checkpoint_mode"),
        final_loss=summary.get("final_loss"),
        goodput_pct=summary.get("goodput_pct"),
        lost_steps=summary.get("lost_steps"),
        checkpoint_blocked_s=summary.get("checkpoint_blocked_s"),
        restarts=[
            {k: r.get(k) for k in ("kind", "mechanism", "fault_step", "resumed_step", "downtime_s")}
            for r in restarts
        ],
        model_sha256=summary.get("model_sha256"),
    )
    if not summary.get("completed") or summary.get("steps") != summary.get("target_steps"):
        failures.append(f"did not complete: step {summary.get('steps')} of {summary.get('target_steps')}")
    if summary.get("device") != device:
        failures.append(f"trained on {summary.get('device')!r}, expected {device!r}")
    if summary.get("world_size") != 1:
        failures.append(f"world size {summary.get('world_size')}, expected 1")
    if summary.get("checkpoint_mode") != run.mode:
        failures.append(f"checkpoint mode {summary.get('checkpoint_mode')!r}, expected {run.mode!r}")
    loss = summary.get("final_loss")
    if not isinstance(loss, int | float) or not math.isfinite(loss):
        failures.append(f"final loss {loss!r} is not a finite number")
    seen = [(r.get("kind"), r.get("mechanism")) for r in restarts]
    if run.fault_kind in EXPECTED_RESTART:
        expected = (run.fault_kind, EXPECTED_RESTART[run.fault_kind])
        if seen != [expected]:
            failures.append(
                f"restarts {seen or 'none'}, expected exactly one {expected[0]} restart, {expected[1]}"
            )
    elif seen:
        failures.append(f"restarts {seen}, expected none")
    if run.fault_kind == "exception" and restarts:
        failures += _diagnostics_problems(restarts[0])
    if run.fault_kind == "slow-save":
        step = FAULT_STEP["slow-save"]
        blocked = [
            s.get("blocked_s", 0.0) for s in summary.get("checkpoint_saves", []) if s.get("step") == step
        ]
        result["slow_save_blocked_s"] = blocked[0] if blocked else None
        if not blocked or blocked[0] < 2 * soft_timeout_s * 0.95:
            failures.append(
                f"the save at step {step} blocked {blocked[0] if blocked else 'never'} s, expected at least "
                f"{2 * soft_timeout_s:g} s (twice the soft timeout): the slow save did not happen"
            )
    if run.local_every == 0:
        copies = result["host_copies"] = summary.get("checkpoint_host_copies")
        if not isinstance(copies, int | float) or copies > 1.1:
            failures.append(
                f"checkpointing held {copies} copies of the state in host memory, expected one slot "
                "(the fast tier is off)"
            )
    if run.baseline is not None:
        if baseline is None or not baseline.get("model_sha256"):
            result["same_as_fault_free"] = None
            failures.append(f"no fault-free {run.mode} run to compare the weights with")
        else:
            same = summary.get("model_sha256") == baseline["model_sha256"]
            result["same_as_fault_free"] = same
            if not same and exact_required:
                failures.append(
                    f"model_sha256 differs from the fault-free {run.mode} run (training is deterministic)"
                )
    return _verdict(result, failures)


def _diagnostics_problems(restart: dict[str, Any]) -> list[str]:
    """An in-process restart on NCCL leaves rank 0's stacks and, as `fr_rank_0` (the file
    torch's fr_trace analyzer reads), the NCCL flight recorder's dump, with NCCL collectives
    in it (trainer/diagnostics.py; gloo's dump lies beside it)."""
    import pickle

    from trainer.diagnostics import FR_PREFIX, STACKS_PREFIX

    folder = Path(restart.get("diagnostics") or "")
    if not restart.get("diagnostics") or not (folder / f"{STACKS_PREFIX}0.txt").is_file():
        return [f"the restart left no stacks in {folder or 'a diagnostics folder'}"]
    dump_path = folder / f"{FR_PREFIX}0"
    try:
        dump = pickle.loads(dump_path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        return [f"no readable flight recorder dump {dump_path}: {exc}"]
    names = {str(e.get("profiling_name", "")) for e in dump.get("entries", [])}
    if not any(name.startswith("nccl:") for name in names):
        return [f"the flight recorder dump {dump_path} holds no NCCL collective ({sorted(names)[:5]})"]
    return []


def check_process_group(
    probe: dict[str, Any] | None, *, exit_code: int | None, seconds: float, device: str
) -> dict[str, Any]:
    """The process-group probe's verdict (see `probe_process_group`)."""
    failures: list[str] = []
    result: dict[str, Any] = {
        "name": "process-group",
        "kind": "probe",
        "exit_code": exit_code,
        "seconds": round(seconds, 2),
    }
    if exit_code != 0 or probe is None:
        failures.append(f"the probe failed (exit code {exit_code}; see process-group.log in {LOGS_FILE})")
    else:
        result.update(probe)
        if probe.get("device") != device:
            failures.append(f"probe ran on {probe.get('device')!r}, expected {device!r}")
        if not probe.get("host_all_reduce") or not probe.get("device_all_reduce"):
            failures.append("an all-reduce returned a wrong value")
        if not probe.get("polled_barrier"):
            failures.append("the polled barrier (trainer/waiting.py) did not complete")
        for check in probe.get("node_health", []):  # trainer/health.py's GPU checks, on CUDA
            if not check["ok"]:
                failures.append(f"node health: {check['name']}: {check['detail']}")
    return _verdict(result, failures)


def _verdict(result: dict[str, Any], failures: list[str]) -> dict[str, Any]:
    return {**result, "status": "fail" if failures else "pass", "failures": failures}


def probe_process_group() -> dict[str, Any]:
    """In a fresh process with RANK/WORLD_SIZE/MASTER_* set: the trainer's process group,
    an all-reduce of a host tensor (gloo) and of a training-device tensor (NCCL on CUDA),
    and the barrier the training thread polls (`waiting.barrier`: `is_completed()` on the
    barrier's work). torch runs a barrier on the group's CPU backend when it has one (and
    no device was bound at `init_process_group`), so on `cpu:gloo,cuda:nccl` gloo serves
    it; `barrier_backend` records which did."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group, _get_object_coll_device

    from trainer import waiting
    from trainer.parallelize import init_distributed, shutdown_distributed, training_device

    device = training_device()
    node_health = []
    if device.type == "cuda":  # the job pods' node check on a real GPU, NVML included
        from dataclasses import asdict

        from trainer import health

        node_health = [asdict(health.gpus_compute(1)), asdict(health.gpu_memory_errors(1))]
    init_distributed(timeout_s=60)
    try:
        host = torch.tensor([1.5, 2.0])
        dist.all_reduce(host)
        on_device = torch.tensor([3.0], device=device)
        dist.all_reduce(on_device)
        world = dist.get_world_size()
        waiting.barrier()
        barrier_device = torch.device(_get_object_coll_device())  # torch's own choice for a barrier
        return {
            "device": device.type,
            "backend": str(dist.get_backend()),
            "barrier_backend": _get_default_group()._get_backend(barrier_device).name(),
            "world_size": world,
            "host_all_reduce": host.tolist() == [1.5 * world, 2.0 * world],
            "device_all_reduce": on_device.cpu().tolist() == [3.0 * world],
            "polled_barrier": True,
            "node_health": node_health,
        }
    finally:
        shutdown_distributed()


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass(slots=True)
class Outcome:
    exit_code: int | None
    seconds: float
    timed_out: bool = False


Launch = Callable[[list[str], Path, float, dict[str, str]], Outcome]


def launch(command: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> Outcome:
    """Run `command` with its output in `log_path`; past `timeout_s` kill it and every
    process it started (ft_launcher's ranks run in sessions of their own)."""
    import psutil

    started = time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        try:
            return Outcome(process.wait(timeout=max(1.0, timeout_s)), time.monotonic() - started)
        except subprocess.TimeoutExpired:
            try:
                tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            for member in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    member.send_signal(signal.SIGKILL)
            process.wait()
            return Outcome(None, time.monotonic() - started, timed_out=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _read_summary(workdir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((workdir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def run_all(
    runs: list[SmokeRun],
    *,
    root: Path,
    dataset: Path,
    cpu: bool,
    deterministic: bool,
    jobs: int,
    run_timeout_s: float,
    budget_s: float,
    probe: bool = True,
    launcher: Launch = launch,
) -> list[dict[str, Any]]:
    """Start every run and the probe (at most `jobs` at a time, none after `budget_s`), then
    check each; a run that could not start within the budget is a failure (`skipped`)."""
    deadline = time.monotonic() + budget_s
    device = "cpu" if cpu else "cuda"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def start(name: str, command: list[str], extra_env: dict[str, str]) -> Outcome | None:
        left = deadline - time.monotonic()
        if left < 10:
            return None
        return launcher(command, logs / f"{name}.log", min(run_timeout_s, left), {**env, **extra_env})

    probe_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    probe_command = [sys.executable, "-m", "benchmarks.gpu_smoke", "--process-group-probe"]
    commands = {
        run.name: [
            sys.executable,
            "-m",
            "rtp_cli.main",
            *train_args(run, root, dataset, cpu=cpu, deterministic=deterministic),
        ]
        for run in runs
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = (
            {"process-group": pool.submit(start, "process-group", probe_command, probe_env)} if probe else {}
        )
        futures.update({run.name: pool.submit(start, run.name, commands[run.name], {}) for run in runs})
        outcomes = {name: future.result() for name, future in futures.items()}

    exact_required = cpu or deterministic
    soft = (CPU_TIMEOUTS if cpu else GPU_TIMEOUTS)["soft_timeout_s"]
    summaries = {run.name: _read_summary(root / run.name) for run in runs}
    results = []
    for run in runs:
        outcome = outcomes[run.name]
        if outcome is None:
            results.append(_skipped(run.name, "run", commands[run.name]))
            continue
        checked = check_run(
            run,
            exit_code=outcome.exit_code,
            seconds=outcome.seconds,
            summary=summaries[run.name],
            baseline=summaries.get(run.baseline) if run.baseline else None,
            device=device,
            exact_required=exact_required,
            soft_timeout_s=soft,
            timed_out=outcome.timed_out,
        )
        results.append({**checked, "command": commands[run.name]})
    if not probe:
        return results
    outcome = outcomes["process-group"]
    if outcome is None:
        results.append(_skipped("process-group", "probe", probe_command))
    else:
        probed = _last_json_line(logs / "process-group.log")
        results.append(
            {
                **check_process_group(
                    probed, exit_code=outcome.exit_code, seconds=outcome.seconds, device=device
                ),
                "command": probe_command,
            }
        )
    return results


def _skipped(name: str, kind: str, command: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "status": "skipped",
        "failures": ["not started: the time budget was spent"],
        "seconds": 0.0,
        "command": command,
    }


def _last_json_line(path: Path) -> dict[str, Any] | None:
    try:
        lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def plan_only(
    runs: list[SmokeRun], *, root: Path, dataset: Path, cpu: bool, deterministic: bool, probe: bool = True
) -> list[dict[str, Any]]:
    """The dry run: each command built, parsed and resolved; nothing trains."""
    from trainer.checkpointing.manager import writer_class

    results = []
    for run in runs:
        args = train_args(run, root, dataset, cpu=cpu, deterministic=deterministic)
        entry: dict[str, Any] = {
            "name": run.name,
            "kind": "run",
            "mode": run.mode,
            "fault": run.fault or None,
        }
        try:
            config = resolve(args, cpu=cpu)
        except (SystemExit, ValueError) as exc:  # argparse exits; ConfigError is a ValueError
            entry.update(status="fail", failures=[f"does not parse: {exc}"])
        else:
            r = config.resilience
            entry.update(
                status="planned",
                failures=[],
                settings={
                    # As the summary reports it: the writer's (torch-async is sync's plug-in).
                    "checkpoint_mode": writer_class(config.checkpoint.writer or config.checkpoint.mode).mode,
                    "faults": config.run.faults,
                    "soft_timeout_s": r.soft_timeout_s,
                    "hard_timeout_s": r.hard_timeout_s,
                    "collective_timeout_s": r.collective_timeout_s,
                    "local_every_steps": config.checkpoint.local_every_steps,
                    "deterministic": getattr(config.training, "deterministic", None),
                },
            )
        results.append({**entry, "command": [sys.executable, "-m", "rtp_cli.main", *args]})
    if not probe:
        return results
    results.append(
        {
            "name": "process-group",
            "kind": "probe",
            "status": "planned",
            "failures": [],
            "command": [sys.executable, "-m", "benchmarks.gpu_smoke", "--process-group-probe"],
        }
    )
    return results


# ----------------------------------------------------------------------------- report


def report(checks: list[dict[str, Any]], header: dict[str, Any], out: Path) -> dict[str, Any]:
    """gpu-smoke.json: the header, every check, and `ok` (every check passed, or planned in a dry run)."""
    passing = ("pass", "planned") if header.get("dry_run") else ("pass",)
    document = {**header, "ok": all(c["status"] in passing for c in checks), "checks": checks}
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_FILE).write_text(json.dumps(document, indent=2) + "\n")
    return document


def format_table(document: dict[str, Any]) -> str:
    lines = [
        f"{'check':<22} {'status':<8} {'seconds':>7} {'restarts':<22} {'same weights':<12} first failure"
    ]
    for c in document["checks"]:
        restarts = ",".join(f"{r['kind']}/{r['mechanism']}" for r in c.get("restarts", [])) or "-"
        same = c.get("same_as_fault_free")
        same_cell = "-" if same is None else ("yes" if same else "no")
        seconds = c.get("seconds")
        seconds_cell = f"{seconds:.1f}" if isinstance(seconds, int | float) else "-"
        lines.append(
            f"{c['name']:<22} {c['status']:<8} {seconds_cell:>7} {restarts:<22} {same_cell:<12} {(c['failures'] or [''])[0]}"
        )
    verdict = "ok" if document["ok"] else "FAILED"
    exact = "checked" if document["exactness_checked"] else "information only (not deterministic)"
    lines.append(f"gpu_smoke: {verdict} in {document['seconds']:.0f} s; weights equality {exact}")
    return "\n".join(lines)


def pack_logs(root: Path, runs: list[SmokeRun], out: Path) -> None:
    """Every run's output and train.log, in one small archive (a GPU machine returns few files)."""
    with tarfile.open(out / LOGS_FILE, "w:gz") as archive:
        for path in sorted((root / "logs").glob("*.log")):
            archive.add(path, arcname=path.name)
        for run in runs:
            train_log = root / run.name / "logs" / "train.log"
            if train_log.is_file():
                archive.add(train_log, arcname=f"{run.name}.train.log")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_smoke", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "/tmp/rtp-gpu-smoke/out",
        help="folder for gpu-smoke.json and the logs archive (default: $OUT)",
    )
    parser.add_argument(
        "--work", default="/tmp/rtp-gpu-smoke/work", help="run folders (emptied first; default: %(default)s)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="build, parse and resolve every command; train nothing"
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help=f"run on CPU (preset {CPU_PRESET}, gloo, CPU timeouts): the same checks, slowly",
    )
    parser.add_argument(
        "--fault-modes",
        default="async,sync,torch-async",
        help="modes that get the exception and sigkill runs (default: %(default)s)",
    )
    parser.add_argument("--jobs", type=int, default=4, help="runs at a time (default: %(default)s)")
    parser.add_argument(
        "--run-timeout", type=float, default=100.0, help="seconds one run may take (default: %(default)s)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=170.0,
        help="seconds after which no run starts and running ones are cut (default: %(default)s)",
    )
    parser.add_argument(
        "--no-deterministic",
        action="store_true",
        help="leave training.deterministic off (weights equality is then information only)",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated checks to run (a faulted run brings its mode's fault-free run; default: all)",
    )
    parser.add_argument("--process-group-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.fault_modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--fault-modes: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    args.fault_modes = modes
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    return args


def main(argv: Sequence[str] | None = None, launcher: Launch = launch) -> int:
    args = parse_args(argv)
    if args.process_group_probe:
        print(json.dumps(probe_process_group()))
        return 0
    started = time.monotonic()
    import torch

    out, root = Path(args.out), Path(args.work)
    deterministic = deterministic_available() and not args.cpu and not args.no_deterministic
    runs = plan_runs(args.fault_modes)
    probe = True
    if args.only:
        wanted = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = sorted(wanted - {run.name for run in runs} - {"process-group"})
        if unknown:
            print(f"gpu_smoke: --only: unknown check(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
        wanted |= {run.baseline for run in runs if run.name in wanted and run.baseline}
        runs, probe = [run for run in runs if run.name in wanted], "process-group" in wanted
    header: dict[str, Any] = {
        "dry_run": args.dry_run,
        "cpu": args.cpu,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "preset": CPU_PRESET if args.cpu else GPU_PRESET,
        "steps": STEPS,
        "checkpoint_every": EVERY,
        "timeouts": CPU_TIMEOUTS if args.cpu else GPU_TIMEOUTS,
        "deterministic": deterministic,
        "exactness_checked": args.cpu or deterministic,
        "jobs": args.jobs,
        "budget_s": args.budget,
    }
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    dataset = root / "dataset"
    if args.dry_run:
        checks = plan_only(
            runs, root=root, dataset=dataset, cpu=args.cpu, deterministic=deterministic, probe=probe
        )
    else:
        if not args.cpu and not torch.cuda.is_available():
            print(
                "gpu_smoke: torch sees no CUDA device: use --cpu to run on CPU or --dry-run to plan only",
                file=sys.stderr,
            )
            return 2
        from rtp_support.demo_data import write_local_dataset

        write_local_dataset(dataset, budget_bytes=300_000)
        checks = run_all(
            runs,
            root=root,
            dataset=dataset,
            cpu=args.cpu,
            deterministic=deterministic,
            jobs=args.jobs,
            run_timeout_s=args.run_timeout,
            budget_s=args.budget,
            probe=probe,
            launcher=launcher,
        )
    header["seconds"] = round(time.monotonic() - started, 1)
    document = report(checks, header, out)
    if not args.dry_run:
        pack_logs(root, runs, out)
    print(format_table(document))
    return 0 if document["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
