"""How training processes end: with their parent, and (for writers) behind training.

torchrun starts every rank in a session of its own, and a rank's NVRx writer process is
spawned by the rank. If a parent dies hard (OOM-kill, SIGKILL), Linux only tells the child
when the child asked for it; otherwise the child lives on, training or idling forever and
holding the job's log pipe open. Each of these processes asks once, at start.
The opposite case is a signal meant for the rank alone: the writer must survive the
SIGTERM its launcher sends the rank's process group, to finish the final save.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1
_background_prepared = False
_forking_pid = 0


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere).

    `parent_pid`, the process that started this one, closes the race of a parent that died
    before the request was made (Linux then never sends the signal): such a process, already
    handed to another parent, exits at once. A spawned child (a fresh interpreter that
    imports torch first) is seconds old when it gets here: a rank killed meanwhile is common.
    """
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _remember_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _forked_child_dies_with_parent() -> None:
    die_with_parent(_forking_pid)


def prepare_background_writer(parent_pid: int | None = None) -> None:
    """Once per writer process, first thing: die with the rank (`parent_pid`), and let
    training win the CPU (nice 10); the writer and the processes it forks use what training
    leaves."""
    global _background_prepared
    if _background_prepared:
        return
    die_with_parent(parent_pid)
    # NVRx forks a writer process per save from here; fork clears the request, so each
    # child asks again (else a child of a killed writer waits on a semaphore forever).
    os.register_at_fork(before=_remember_forking_pid, after_in_child=_forked_child_dies_with_parent)
    os.nice(10)
    _background_prepared = True


@contextlib.contextmanager
def children_ignore_sigterm() -> Iterator[None]:
    """Processes started inside inherit an ignored SIGTERM.

    The NVRx writer and its Manager live in the rank's process group, and launchers stop a
    rank by signalling the whole group (torchrun: killpg SIGTERM). They must outlive that
    signal so the rank can finish its final save; they end when the rank closes them.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
