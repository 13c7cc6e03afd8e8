"""Start the training ranks on this machine and wait for them.

The launcher is NVRx's ft_launcher (a torchrun-compatible launcher with a rank monitor per
rank): `--standalone` picks a free rendezvous port on loopback, starts `nproc` copies of
`python -m trainer`, and restarts the whole worker group — up to `max_restarts` times —
when a rank dies or stops heart-beating (the hard faults in-process restart cannot
handle). The NIC monitor is turned off on CPU (it needs NVML). The command is built by a
pure function so it can be shown and tested; `run_local_training` marks the start of a new
run in the event log, writes the run's config where every rank reads it, streams the
ranks' output to a log file and the caller's stdout, and returns the run's summary.json
as a TrainSummary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig
from trainer.summary import TrainSummary

log = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    """The training ranks exited non-zero; the message points at the log."""


@dataclass(frozen=True, slots=True)
class LauncherSettings:
    """ft_launcher's knobs (one name each, shared by `rtp train-local` and the pipeline)."""

    max_restarts: int = 3
    """Worker-group restarts after a hard fault (a rank killed, exited or hung)."""
    initial_heartbeat_timeout_s: float = 120.0
    """Time allowed until a rank's first heartbeat (imports, model build, checkpoint load)."""
    heartbeat_timeout_s: float = 60.0
    """Time allowed between heartbeats before the rank monitor kills a rank as hung; once
    learned from step times (with a floor), the learned value applies."""
    workers_stop_timeout_s: float = 5.0
    """SIGTERM → SIGKILL grace when the launcher stops a worker group."""
    monitor_interval_s: float = 0.5
    """How often the launcher checks worker health."""
    rank_module: str = "trainer"
    """What the launcher starts per rank, `python -m <it> --config=…`: the trainer, or a
    launcher plugin that runs it (`rtp_prefork.launcher_settings`)."""


def build_launch_command(
    nproc: int,
    trainer_args: list[str],
    python: str = sys.executable,
    settings: LauncherSettings | None = None,
    cpu: bool = True,
) -> list[str]:
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    return [
        python,
        "-m",
        "nvidia_resiliency_ext.fault_tolerance.launcher",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *launcher_flags(settings or LauncherSettings(), cpu),
        "-m",
        (settings or LauncherSettings()).rank_module,
        *trainer_args,
    ]


def launcher_flags(settings: LauncherSettings, cpu: bool) -> list[str]:
    """ft_launcher's restart and monitoring flags; the same on one machine and in job pods."""
    s = settings
    if s.max_restarts < 0:
        raise ValueError(f"max_restarts must be 0 or more, got {s.max_restarts}")
    return [
        f"--max-restarts={s.max_restarts}",
        f"--monitor-interval={s.monitor_interval_s:g}",
        f"--workers-stop-timeout={s.workers_stop_timeout_s:g}",
        f"--ft-initial-rank-heartbeat-timeout={s.initial_heartbeat_timeout_s:g}",
        f"--ft-rank-heartbeat-timeout={s.heartbeat_timeout_s:g}",
        # The NIC health monitor reads the GPU/NIC PCI topology through NVML: GPU nodes only.
        f"--ft-enable-nic-monitor={'false' if cpu else 'true'}",
    ]


CONFIG_FILE = "config.json"


def trainer_arguments(config_path: str | Path) -> list[str]:
    """What every rank is started with: the one serialized config (`TrainConfig.write`)."""
    return [f"--config={config_path}"]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _copy_output(process: subprocess.Popen[str], log_file: Any, echo: bool) -> None:
    """Copy the launcher's output into the log (and to stdout) until the pipe's end; the
    log file is closed here, by the last writer."""
    assert process.stdout is not None
    try:
        for line in process.stdout:
            log_file.write(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
    finally:
        log_file.close()


CLEAN_EXIT_DRAIN_S = 0.5
"""After a clean launcher exit, how long to wait for the pipe's end. What may still hold it
is a helper a rank started (torch_shm_manager keeps its inherited stderr for about a second
after its clients left) and writes nothing; the copy goes on in the background meanwhile."""


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s*")
_ERROR_LINE = re.compile(r"^(?:[\w.]+(?:Error|Exception|Fault|Abort)|trainer: error): .+")
_RESTART_LINE = "will restart worker group"


def root_cause(log_text: str) -> str | None:
    """The error that ended the run, for a one-line message: the first one a rank reported
    after the last worker-group restart (earlier attempts were recovered from), preferring
    an injected fault (a peer's broken-connection error follows it)."""
    final_attempt = log_text.rsplit(_RESTART_LINE, 1)[-1]
    found = []
    for raw in final_attempt.splitlines():
        line = _RANK_PREFIX.sub("", raw.strip())
        while _RANK_PREFIX.match(line):
            line = _RANK_PREFIX.sub("", line)
        if _ERROR_LINE.match(line) and "ChildFailedError" not in line:
            found.append(line)
    injected = [line for line in found if "InjectedFault" in line]
    candidates = injected or found
    return candidates[0] if candidates else None


_SOCKET_PATH_MAX = 107
"""Bytes of a Unix socket's path (108 with its NUL)."""
_SOCKET_NAME_ROOM = 40
"""The longest path the launcher's processes make in their temporary folder for a socket:
ft_launcher's `_ft_launcher<pid>_rmon<rank>.socket`, torch_shm_manager's
`torch-shm-dir-XXXXXX/manager.sock`, a launcher plugin's (rtp_prefork's `rtp-prefork-<uid>-<pid>.sock`)."""


@contextlib.contextmanager
def launch_tempdir(env: MutableMapping[str, str], prefix: str = "rtp-launch-") -> Iterator[Path]:
    """A temporary folder of one launch's own, made the TMPDIR of `env` (the environment
    the launcher, or `rtp local`'s tasks, start with and pass on to everything they start),
    removed when the launch is over, `env`'s TMPDIR as it was before.

    The launcher and its processes leave files in the temporary folder that nobody removes:
    torch elastic's log folder (one per launch), ft_launcher's and its rank monitors'
    sockets, multiprocessing's `pymp-*` folders and torch_shm_manager's socket folder when a
    process is killed, a launcher plugin's sockets; kfp.local's tasks leave the folder their
    command writes its program to. On one machine those piled up in /tmp (several thousand
    after a few days of test runs); in a pod they go with the pod."""
    base = tempfile.gettempdir()  # (fixes this process's own first: `env` may be os.environ)
    if len(base) + len(prefix) + 10 + _SOCKET_NAME_ROOM > _SOCKET_PATH_MAX:
        base = "/tmp"  # a socket path in a deep TMPDIR would not fit
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    previous = env.get("TMPDIR")
    env["TMPDIR"] = str(folder)
    try:
        yield folder
    finally:
        if previous is None:
            env.pop("TMPDIR", None)
        else:
            env["TMPDIR"] = previous
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _forward_sigterm(process: subprocess.Popen[str]) -> Iterator[None]:
    """Pass SIGTERM on to the launcher and keep waiting for it.

    In a pod, kubelet sends SIGTERM to the component's process only; the launcher and its
    ranks must hear it to write their final checkpoint within the grace period, and this
    process must outlive them so nothing is orphaned.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_launcher(command: list[str], env: dict[str, str], log_path: Path, echo: bool) -> int:
    """Run the launcher to its end, its output copied to the log (and stdout); its exit code."""
    log_file = log_path.open("a")  # closed by the copier at the pipe's end
    log_file.write("$ " + " ".join(command) + "\n")
    log_file.flush()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    # Output is copied by a thread and the launcher's exit ends the wait: a stray
    # process that inherited the pipe (say, a writer whose rank was killed) must not
    # keep this call waiting for an end of file that never comes.
    copier = threading.Thread(target=_copy_output, args=(process, log_file, echo), daemon=True)
    copier.start()
    with _forward_sigterm(process):
        returncode = process.wait()
    # A failure's message quotes the log's tail: wait for all of it then.
    copier.join(timeout=10 if returncode else CLEAN_EXIT_DRAIN_S)
    if copier.is_alive():
        with contextlib.suppress(ValueError):  # closed by the copier meanwhile
            log_file.flush()
    return returncode


def mark_new_run(workdir: str | Path) -> None:
    """A new run (not a restart) begins: forget fired faults, restart causes and learned
    timeouts; open a new goodput window."""
    from trainer import restart_causes, timeouts
    from trainer.faults import clear_fault_records

    work = Path(workdir)
    clear_fault_records(work)
    restart_causes.forget(work)
    timeouts.forget(work)  # learned from another run's steps
    with (work / "events.jsonl").open("a") as handle:
        handle.write(json.dumps({"kind": "launch", "time": time.time(), "at": time.time()}) + "\n")


RankStarter = Callable[[int, list[str], dict[str, str], Path], int]
"""Runs `nproc` ranks of `python -m trainer <args>` in this environment, their output appended
to the log, and returns their exit code: what `run_local_training` does through ft_launcher
unless given another (the test suite's in-process harness, tests/distributed/harness.py)."""


def ranks_environment(inprocess_restarts: bool, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment ranks start with: `base` (default: this process's) and rtp's defaults,
    which the user's values win over."""
    env = dict(os.environ if base is None else base)
    # One intra-op thread per rank: ranks with torch's default threading oversubscribe the cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if inprocess_restarts:
        # NVRx's monitor thread polls the store with 1 s timeouts and c10d warns twice at each
        # ("waitForInput ... timed out"); torch 2.13's only switch is the C++ log level, read
        # when a rank imports torch, so it goes into the ranks' environment (the user's wins).
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if _has_cuda():  # read when CUDA initializes in a rank: set before the ranks start (the user's wins)
        from trainer.gpu_defaults import NCCL_ENV

        for key, value in NCCL_ENV.items():
            env.setdefault(key, value)
    return env


def resolve_auto_settings(
    config: TrainConfig, *, nnodes: int, gpus_per_node: int, gpu_memory_gib: float | None = None
) -> TrainConfig:
    """The config the ranks read, with the settings decided before they start made concrete:
    `training.activation_checkpointing=auto` from the memory plan on GPUs (this machine's
    GPU memory unless given), none on CPU. Logged in one line."""
    if config.training.activation_checkpointing != "auto":
        return config
    from trainer.memory_plan import resolve_activation_checkpointing

    if gpus_per_node and gpu_memory_gib is None and _has_cuda():
        import torch

        gpu_memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    resolved, line = resolve_activation_checkpointing(
        config,
        gpu_memory_gib=gpu_memory_gib if gpus_per_node else None,
        nnodes=nnodes,
        gpus_per_node=gpus_per_node,
    )
    log.info("%s", line)
    return resolved


def run_local_training(
    nproc: int,
    config: TrainConfig,
    echo: bool = True,
    settings: LauncherSettings | None = None,
    new_run: bool = True,
    start_ranks: RankStarter | None = None,
) -> TrainSummary:
    """Run the ranks to completion on `config`; raise TrainingFailed with the log's tail on
    failure. The config is written to `<workdir>/config.json` and is all the ranks read.

    `new_run=False` continues the previous run's fault records and goodput window: a
    relaunch after the whole launcher died (what a pod restart does). `start_ranks`: what
    runs the ranks instead of ft_launcher (`settings` and `echo` are then unused)."""
    work = Path(config.run.workdir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    config = resolve_auto_settings(config, nnodes=1, gpus_per_node=nproc if _has_cuda() else 0)
    trainer_args = trainer_arguments(config.write(work / CONFIG_FILE))
    if new_run:
        mark_new_run(work)
        from trainer.checkpointing import forget_run

        forget_run(config.checkpoint.local_dir, config.checkpoint_dir())  # the previous run's fast tier
    log_path = work / "logs" / "train.log"
    summary_path = work / "summary.json"
    summary_path.unlink(missing_ok=True)
    env = ranks_environment(bool(config.resilience.inprocess_restarts))
    with launch_tempdir(env):
        if start_ranks is not None:
            returncode = start_ranks(nproc, trainer_args, env, log_path)
        else:
            command = build_launch_command(nproc, trainer_args, settings=settings, cpu=not _has_cuda())
            returncode = _run_launcher(command, env, log_path, echo)
    if returncode != 0:
        from trainer.checkpointing import latest_committed_checkpoint
        from trainer.faults import recorded_fatal_error

        text = log_path.read_text()
        tail = "".join(text.splitlines(keepends=True)[-20:])
        fatal = recorded_fatal_error(work)
        cause = f"{fatal} (not retried: a restart would fail the same way)" if fatal else root_cause(text)
        reason = f": {cause}" if cause else ""
        restarts = len(re.findall(r"will restart worker group", text))
        kept = latest_committed_checkpoint(Path(config.checkpoint_dir()))
        raise TrainingFailed(
            f"training exited with code {returncode}{reason}; worker-group restarts used: {restarts}"
            f"{f' of {settings.max_restarts}' if settings else ''}; last committed checkpoint: "
            f"{kept or 'none'} (a new run with the same checkpoint dir resumes from it); "
            f"full log: {log_path}\n{tail}"
        )
    if not summary_path.is_file():
        raise TrainingFailed(f"training exited cleanly but wrote no {summary_path}; see {log_path}")
    return TrainSummary.read(summary_path)
