"""Start the training ranks on this machine and wait for them.

Today the launcher is torchrun (`torch.distributed.run --standalone`): it picks a free
rendezvous port on loopback, starts `nproc` copies of `python -m trainer`, and fails the
whole group when one rank fails. The command is built by a pure function so it can be
shown and tested; `run_local_training` streams the ranks' output to a log file and the
caller's stdout, and returns the run's summary.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class TrainingFailed(RuntimeError):
    """The training ranks exited non-zero; the message points at the log."""


def build_launch_command(nproc: int, trainer_args: list[str], python: str = sys.executable) -> list[str]:
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "trainer",
        *trainer_args,
    ]


def trainer_arguments(
    *,
    dataset_dir: str,
    workdir: str,
    steps: int,
    checkpoint_every: int,
    seed: int,
    preset: str = "tiny-cpu",
    checkpoint_mode: str | None = None,
    checkpoint_dir: str | None = None,
    stop_after: int | None = None,
    overrides: list[str] | None = None,
) -> list[str]:
    args = [
        f"--preset={preset}",
        f"--dataset-dir={dataset_dir}",
        f"--workdir={workdir}",
        f"--steps={steps}",
        f"--checkpoint-every={checkpoint_every}",
        f"--seed={seed}",
    ]
    if checkpoint_mode:
        args.append(f"--checkpoint-mode={checkpoint_mode}")
    if checkpoint_dir:
        args.append(f"--checkpoint-dir={checkpoint_dir}")
    if stop_after:
        args.append(f"--stop-after={stop_after}")
    args += [f"--override={item}" for item in overrides or []]
    return args


def _copy_output(process: subprocess.Popen[str], log_file: Any, echo: bool) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        log_file.write(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s*")
_ERROR_LINE = re.compile(r"^(?:[\w.]+(?:Error|Exception)|trainer: error): .+")


def root_cause(log_text: str) -> str | None:
    """The first error a rank reported (not the launcher's summary), for a one-line message.

    The first, because ranks that fail later usually fail because of it (and processes
    torn down with them add noise of their own)."""
    for raw in log_text.splitlines():
        line = _RANK_PREFIX.sub("", raw.strip())
        if _ERROR_LINE.match(line) and "ChildFailedError" not in line:
            return line
    return None


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


def run_local_training(
    nproc: int, trainer_args: list[str], workdir: str | Path, echo: bool = True
) -> dict[str, Any]:
    """Run the ranks to completion; raise TrainingFailed with the log's tail on failure."""
    work = Path(workdir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    log_path = work / "logs" / "train.log"
    summary_path = work / "summary.json"
    summary_path.unlink(missing_ok=True)
    env = dict(os.environ)
    # One intra-op thread per rank: on a 2-core machine two ranks with default threading
    # oversubscribe the cores and run several times slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    command = build_launch_command(nproc, trainer_args)
    with log_path.open("a") as log_file:
        log_file.write("$ " + " ".join(command) + "\n")
        log_file.flush()
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
        )
        # Output is copied by a thread and the launcher's exit ends the wait: a stray
        # process that inherited the pipe (say, a writer whose rank was killed) must not
        # keep this call waiting for an end of file that never comes.
        copier = threading.Thread(target=_copy_output, args=(process, log_file, echo), daemon=True)
        copier.start()
        with _forward_sigterm(process):
            returncode = process.wait()
        copier.join(timeout=10)
        log_file.flush()
    if returncode != 0:
        text = log_path.read_text()
        tail = "".join(text.splitlines(keepends=True)[-20:])
        cause = root_cause(text)
        reason = f": {cause}" if cause else ""
        raise TrainingFailed(f"training exited with code {returncode}{reason}; full log: {log_path}\n{tail}")
    if not summary_path.is_file():
        raise TrainingFailed(f"training exited cleanly but wrote no {summary_path}; see {log_path}")
    return json.loads(summary_path.read_text())
