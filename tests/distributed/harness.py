"""The in-process rank harness: training runs that need no launcher, without one.

Most launches in the suite drill nothing a launcher does: they stop and resume, reshard,
compare modes, or recover from soft faults, which NVRx's in-process wrapper handles inside
the ranks. Under ft_launcher each such run paid a launcher and `nproc` new interpreters
importing torch, NVRx and the trainer. Here those ranks are forked from one pre-imported
process per test session instead: rtp_prefork's zygote, the one a worker-group restart forks
its ranks from, serving the pytest process (it ends with it). Each rank runs what the
launcher starts, `python -m trainer --config=…` (runpy, as `__main__`), with the launcher's
environment for it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and a free
MASTER_PORT for rank 0's store), and `trainer.launch.run_local_training` does everything
around the ranks as for a launch: the config file, the new-run marks, the launch folder for
TMPDIR, the log, summary.json and the one-line `TrainingFailed`.

What only a launcher does stays with it (tests/distributed/conftest.py `run_training`):
restarting a worker group after a hard fault, heartbeats to its rank monitors, prefork itself.
As ft_launcher does once a rank fails for good, the other ranks get SIGTERM, then SIGKILL
after `STOP_GRACE_S`.

Leftovers: the ranks, and what they fork, carry the environment the zygote was started with
(a fork keeps the process's original environment block, which is what /proc shows), so the
zygote starts with a mark of its own (`mark`); what the ranks start anew (writers,
torch_shm_manager) carries the test's. The leftover checks look for both.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from rtp_prefork import zygote
from rtp_support.embedded_s3 import free_port
from trainer.config import TrainConfig
from trainer.launch import ranks_environment, run_local_training
from trainer.summary import TrainSummary

AUDIT_EVENT = "rtp.tests.harness_ranks"
"""Raised (sys.audit) before the harness starts ranks: tests/conftest.py refuses it in a test
not marked `launches`, as it refuses a launcher's process."""
START_TIMEOUT_S = 180.0
"""How long the zygote may take to import torch, NVRx, transformers and the trainer."""
STOP_GRACE_S = 5.0
"""SIGTERM -> SIGKILL for the other ranks once one failed (ft_launcher's workers_stop_timeout)."""
PRELOAD = json.dumps({"model": {"kind": "hf"}})
"""What the zygote imports (`zygote.modules_for`): a rank's modules, transformers included."""


class HarnessError(RuntimeError):
    """The session's zygote could not start or fork a rank (a fault of the harness, not of the run)."""


class RankHarness:
    """Forks training ranks from the session's zygote (started on first use, in `folder`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.mark = f"rank-harness-{uuid.uuid4().hex}"
        """RTP_TEST_RUN_MARK of the zygote, and so of every process forked from it."""
        self._zygote: subprocess.Popen[bytes] | None = None
        self._path = zygote.socket_path(os.getpid(), folder=str(self.folder))
        self._log = self.folder / "rank-harness-zygote.log"

    @property
    def zygote_pid(self) -> int | None:
        return self._zygote.pid if self._zygote is not None else None

    def run(self, nproc: int, config: TrainConfig) -> TrainSummary:
        """`run_local_training(nproc, config)` with the ranks forked here instead of launched."""
        sys.audit(AUDIT_EVENT, nproc)
        self._start()
        return run_local_training(nproc, config, echo=False, start_ranks=self._run_ranks)

    def close(self) -> None:
        if self._zygote is None:
            return
        self._zygote.terminate()  # its waiters, and their ranks, die with it (PR_SET_PDEATHSIG)
        try:
            self._zygote.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._zygote.kill()
            self._zygote.wait()
        self._zygote = None
        for leftover in (self._path, self._path + ".lock", zygote.hurry_path(self._path)):
            with contextlib.suppress(OSError):
                os.unlink(leftover)

    def _start(self) -> None:
        if self._zygote is not None and self._zygote.poll() is None and os.path.exists(self._path):
            return
        self.close()
        # What torch reads when imported (TORCH_CPP_LOG_LEVEL) is read in the zygote: it
        # imports with the environment ranks start with.
        env = {
            **ranks_environment(inprocess_restarts=True),
            "RTP_TEST_RUN_MARK": self.mark,
            "TMPDIR": str(self.folder),
        }
        with self._log.open("ab") as log:
            self._zygote = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rtp_prefork.zygote",
                    f"--launcher-pid={os.getpid()}",  # it serves this process and ends with it
                    f"--config={PRELOAD}",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # a test's signal to its own group must not reach it
            )
        # Waited for, as a restarted rank waits: its imports at normal priority, not nice 19.
        Path(zygote.hurry_path(self._path)).touch()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(self._path):
            if self._zygote.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise HarnessError(
                    f"the rank harness's zygote did not serve: {self._log.read_text()[-2000:]}"
                )
            time.sleep(0.05)

    def _run_ranks(self, nproc: int, trainer_args: list[str], env: dict[str, str], log_path: Path) -> int:
        """`run_local_training`'s rank starter: fork `nproc` ranks, their output appended to the
        log, and wait for them; returns 0, or the first failed rank's exit code."""
        port = free_port()  # rank 0's store, as ft_launcher's --standalone picks one
        ranks: list[zygote.ForkedRank] = []
        with log_path.open("ab") as log, open(os.devnull, "rb") as stdin:
            log.write(
                f"$ {nproc} ranks forked by the test session's rank harness (zygote {self.zygote_pid})\n".encode()
            )
            log.flush()
            try:
                for rank in range(nproc):
                    rank_env = {
                        **env,
                        "RANK": str(rank),
                        "LOCAL_RANK": str(rank),
                        "GROUP_RANK": "0",
                        "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                    }
                    forked = zygote.ask_for_rank(
                        self._path,
                        ["trainer", *trainer_args],
                        rank_env,
                        cwd=os.getcwd(),
                        launcher_pid=os.getpid(),
                        fds=(stdin.fileno(), log.fileno(), log.fileno()),
                    )
                    if forked is None:
                        raise HarnessError(
                            f"the rank harness's zygote forked no rank {rank}: see {self._log}"
                        )
                    ranks.append(forked)
                return _wait_for(ranks)
            finally:
                for forked in ranks:
                    forked.signal(signal.SIGKILL)  # a no-op for ranks that ended
                    forked.close()


def _wait_for(ranks: list[zygote.ForkedRank]) -> int:
    """Every rank's end; once one fails, the others are stopped as ft_launcher stops them."""
    ended: queue.Queue[tuple[int, int | None]] = queue.Queue()
    for index, forked in enumerate(ranks):
        threading.Thread(target=lambda i=index, f=forked: ended.put((i, f.wait())), daemon=True).start()
    running, failure, stop_at = set(range(len(ranks))), 0, None
    while running:
        try:
            index, status = ended.get(timeout=0.5)
        except queue.Empty:
            if stop_at is not None and time.monotonic() > stop_at:
                for index in running:
                    ranks[index].signal(signal.SIGKILL)
                stop_at = None
            continue
        running.discard(index)
        # None: the zygote's waiter went before the rank (the rank dies with it).
        code = 1 if status is None else os.waitstatus_to_exitcode(status)
        if code != 0 and not failure:
            failure = code if code > 0 else 128 - code  # killed by a signal: the shell's code
            for other in running:
                ranks[other].signal(signal.SIGTERM)
            stop_at = time.monotonic() + STOP_GRACE_S
    return failure


_session: RankHarness | None = None


@contextlib.contextmanager
def session_harness(folder: Path, enabled: bool = True) -> Iterator[RankHarness | None]:
    """The test session's harness (None when disabled: every run goes through the launcher)."""
    global _session
    harness = RankHarness(folder) if enabled else None
    _session = harness
    try:
        yield harness
    finally:
        _session = None
        if harness is not None:
            harness.close()


def current() -> RankHarness | None:
    """The session's harness, if the session has one."""
    return _session
