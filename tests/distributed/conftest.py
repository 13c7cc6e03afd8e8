import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import rtp_prefork
from tests.distributed import harness
from trainer.config import TrainConfig, resolve_config
from trainer.launch import LauncherSettings, launch_tempdir, run_local_training

NO_ZYGOTE = "resilience.prefork_workers=false"
"""rtp_prefork's zygote imports torch and NVRx beside the ranks (seconds of both cores) to
fork the ranks of a worker-group restart: a run with none starts its ranks the plain way."""


def restarts_its_ranks(named: dict) -> bool:
    """Whether a run's injected faults make the launcher start ranks again: a hard fault, or
    any fault once in-process restarts are off."""
    from trainer.faults import HARD_FAULTS, parse_faults

    faults = named.get("faults") or ""
    specs = parse_faults(faults if isinstance(faults, str) else ",".join(faults))
    return any(spec.kind in HARD_FAULTS for spec in specs) or bool(
        specs and named.get("inprocess_restarts") == 0
    )


def run_config(dataset_dir, workdir, steps: int = 12, every: int = 4, overrides=(), **named) -> TrainConfig:
    """The config of a test run with seed 7. `named` are the trainer's named settings
    (checkpoint_mode=, faults=, stop_after=, ...), resolved with `overrides` the way every
    entry point resolves them. The fast checkpoint tier's files go to the run folder, not
    to /dev/shm; the zygote runs only where the launcher may start ranks again
    (`restarts_its_ranks`; an override of resilience.prefork_workers wins)."""
    named.setdefault("checkpoint_local_dir", str(Path(workdir) / "local-tier"))
    if not any(o.startswith("resilience.prefork_workers=") for o in overrides) and not restarts_its_ranks(
        named
    ):
        overrides = [*overrides, NO_ZYGOTE]
    return resolve_config(
        named={
            "dataset_dir": str(dataset_dir),
            "workdir": str(workdir),
            "steps": steps,
            "checkpoint_every": every,
            "seed": 7,
            **named,
        },
        overrides=list(overrides),
    )


def train(
    dataset_dir,
    workdir,
    nproc: int = 2,
    steps: int = 12,
    every: int = 4,
    overrides=(),
    launcher: LauncherSettings | None = None,
    via_launcher: bool | None = None,
    **named,
) -> dict:
    """A real multi-process run; returns its summary.json as a dict. Through the launcher
    (`launcher`: its settings, default ft_launcher's defaults) where the run needs one, else
    in the rank harness (`run_training`); `via_launcher=True` asks for the launcher anyway."""
    config = run_config(dataset_dir, workdir, steps, every, overrides, **named)
    return run_training(nproc, config, launcher, via_launcher)


def needs_launcher(config: TrainConfig, launcher: LauncherSettings | None = None) -> bool:
    """Whether only a launcher can run `config`: its faults make the launcher start ranks
    again (`restarts_its_ranks`), or launcher settings were given (their subject is the launcher)."""
    faults = {"faults": config.run.faults, "inprocess_restarts": config.resilience.inprocess_restarts}
    return launcher is not None or restarts_its_ranks(faults)


def run_training(
    nproc: int,
    config: TrainConfig,
    launcher: LauncherSettings | None = None,
    via_launcher: bool | None = None,
) -> dict:
    """`run_local_training(nproc, config)`'s summary as a dict: by default through the rank
    harness (tests/distributed/harness.py: the same `python -m trainer` ranks, forked from
    the session's pre-imported process, no launcher) unless the run needs a launcher
    (`needs_launcher`) or `via_launcher` is true; `pytest --rank-harness=off` sends every run
    through the launcher. The same summary and the same `TrainingFailed` either way."""
    required = needs_launcher(config, launcher)
    if via_launcher is False and required:
        raise ValueError("this run restarts ranks or sets the launcher's settings: it needs the launcher")
    session = harness.current()
    if session is None or required or via_launcher:
        settings = rtp_prefork.launcher_settings(config, launcher)  # ranks start as rtp starts them
        return run_local_training(nproc, config, echo=False, settings=settings).to_dict()
    return session.run(nproc, config).to_dict()


def train_local_command(dataset_dir, workdir, steps: int, every: int, *extra: str) -> list[str]:
    """The user's command, `rtp train-local`, with 2 ranks and seed 7."""
    return [
        sys.executable,
        "-m",
        "rtp_cli.main",
        "train-local",
        "--nproc",
        "2",
        "--dataset-dir",
        str(dataset_dir),
        "--workdir",
        str(workdir),
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(every),
        "--seed",
        "7",
        "--checkpoint-local-dir",
        str(Path(workdir) / "local-tier"),
        *extra,
    ]


def events(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(workdir) / "events.jsonl").read_text().splitlines()]


def restart_story(summary: dict, workdir: Path, lines: int = 150) -> str:
    """For an assertion's message: each restart's kind and mechanism, then the log lines
    that name an error. An unexpected restart on the CI machine is otherwise undiagnosable
    once its folder is gone."""
    restarts = summary.get("restarts", [])  # whole: cause, detection, steps redone, diagnostics
    log = Path(workdir) / "logs" / "train.log"
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    marks = ("Error", "error", "Exception", "restart", "Timeout", "timed out")
    errors, in_traceback = [], False
    for line in text:  # each traceback whole, and the lines that name an error
        if "waitForInput" in line:  # a store client's routine 1 s poll, not an error
            continue
        in_traceback = line.startswith("Traceback") or (in_traceback and line.startswith(" "))
        if in_traceback or any(mark in line for mark in marks):
            errors.append(line[:300])
    return (
        "restarts: "
        + json.dumps(restarts, indent=1, default=str)
        + "\nlog lines:\n"
        + "\n".join(errors[-lines:])
    )


PLAIN_STEPS, PLAIN_EVERY = 16, 4
PLAIN_OVERRIDES = (
    "resilience.collective_timeout_s=5",
    "resilience.soft_timeout_s=8",
    "resilience.hard_timeout_s=30",
    "run.log_every_steps=1",
)


@pytest.fixture
def run_mark(monkeypatch) -> Iterator[str]:
    """Tags every process the test starts (the variable is inherited by all of them: ranks,
    writers, Managers, multiprocessing's resource tracker, torch_shm_manager) to find
    leftovers. A test that failed before its own check still leaves nothing running.

    The test's temporary folder (TMPDIR, and `tempfile`'s in this process) is a new empty
    one, so that what the run leaves there is seen too."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv("RTP_TEST_RUN_MARK", mark)
    with launch_tempdir(os.environ, prefix="rtp-t-") as folder:
        monkeypatch.setattr(tempfile, "tempdir", str(folder))
        yield mark
        for process in _leftovers(mark):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def _leftovers(mark: str) -> list[psutil.Process]:
    """The processes a test started that still live: those with its mark, and those forked
    from the rank harness's zygote (they carry the zygote's mark: tests/distributed/harness.py)
    other than the zygote itself; the launches run one at a time."""
    session = harness.current()
    marks = {mark} if session is None else {mark, session.mark}
    spared = {os.getpid(), session.zygote_pid if session is not None else None}
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid not in spared and process.environ().get("RTP_TEST_RUN_MARK") in marks:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _patience(left: list[psutil.Process]) -> float:
    """15 s; 60 s while only prefork zygotes are left: one exits when it sees its launcher
    end, but runs at nice 19 in a session of its own, so on a saturated machine it may not
    be scheduled for that long (rtp_prefork.zygote)."""
    with contextlib.suppress(psutil.Error):
        if all(p.nice() == 19 and "rtp_prefork.zygote" in " ".join(p.cmdline()) for p in left):
            return 60.0
    return 15.0


def assert_nothing_left(mark: str) -> None:
    started = time.monotonic()  # writers and monitors exit right after the launcher
    while (left := _leftovers(mark)) and time.monotonic() < started + _patience(left):
        time.sleep(0.5)
    names = [(p.pid, " ".join(p.cmdline())[:120]) for p in left]
    for process in left:
        process.kill()
    assert names == [], f"processes outlived the run: {names}"
    # Nothing in the temporary folder either: sockets, log folders, multiprocessing's
    # folders of killed processes (trainer.launch.launch_tempdir).
    temporary = Path(tempfile.gettempdir())  # the test's own (run_mark)
    assert sorted(p.name for p in temporary.iterdir()) == [], f"left in {temporary}"


def assert_diagnosable(restart: dict, ranks: int, hung_rank: int, analyze: bool = True) -> None:
    """The teardown before the restart left every rank's stacks and flight recorder dump,
    the hung rank's stack shows where it hung, and torch's analyzer reads the dumps."""
    import pickle
    import subprocess
    import sys

    folder = Path(restart["diagnostics"])
    assert folder.is_dir(), restart
    for rank in range(ranks):
        stacks = (folder / f"stacks_rank_{rank}.txt").read_text()
        assert "Thread" in stacks and "File" in stacks, stacks
        dump = pickle.loads((folder / f"fr_rank_{rank}").read_bytes())
        assert any(str(e["profiling_name"]).startswith("gloo:") for e in dump["entries"]), dump["entries"][
            -3:
        ]
    assert "in _fire" in (folder / f"stacks_rank_{hung_rank}.txt").read_text()
    if not analyze:
        return
    analysis = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            str(folder),
            "--prefix",
            "fr_rank_",
            "-j",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert analysis.returncode == 0, analysis.stderr[-2000:]
