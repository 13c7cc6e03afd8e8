"""A fork server per rank for the checkpoint writer's processes, forked from the rank itself.

NVRx starts its persistent writer, and the write-results Manager, as new interpreters
(multiprocessing's "spawn"), which import torch and NVRx again: about 4 s of CPU each on
an idle core, at every attempt's start (measured on the 2-core machine: 10-22 s for the
first save's warm-up beside the ranks' own start, docs/checkpointing.md). `start()` forks
the rank once it has imported them and while it holds one thread (before the process
group, the launcher's client and NVRx's in-process threads), and runs the standard
library's fork server loop in that copy (`multiprocessing.forkserver.main`); processes
started from `context()` are forked from it, imported already, at the first attempt and
after every in-process restart.

The server dies with the rank (Linux's parent-death signal, and the end of the rank's
"alive" pipe, as the standard library's own server) and ignores SIGTERM, as the writer
does: a launcher that signals the rank's process group must not take the writer's parent
with it while the rank writes its final save. Where it cannot start (not Linux, a thread
already running, a standard library whose fork server differs), `context()` is spawn's.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Iterable
from multiprocessing import forkserver
from typing import Any

from trainer.lifecycle import die_with_parent

_STDLIB_FIELDS = frozenset(
    {"_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds"}
)
"""The standard library's fork server state this module fills (CPython 3.11-3.13); a server
with more (3.14 adds an authentication key) is not started here."""

_server_pid: int | None = None


def stdlib_matches() -> bool:
    """Whether this Python's fork server is the one `start()` knows how to stand in for."""
    fields = set(vars(forkserver._forkserver))  # type: ignore[attr-defined]
    return fields - {"_lock", "_preload_modules"} == _STDLIB_FIELDS


def start(modules: Iterable[str] = ()) -> bool:
    """Import `modules`, then fork this process into its fork server (once). False (spawn
    stays) where it cannot: call it before this process starts any thread."""
    global _server_pid
    if _server_pid is not None:
        return True
    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    if sys.platform != "linux" or threading.active_count() > 1 or not stdlib_matches():
        return False
    if server._forkserver_pid is not None:  # started before, by the standard library
        return False
    for name in modules:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX)
    address = f"\0rtp-forkserver-{os.getpid()}-{secrets.token_hex(8)}"  # abstract: no file left
    listener.bind(address)
    listener.listen()
    alive_r, alive_w = os.pipe()
    rank = os.getpid()
    pid = os.fork()
    if pid == 0:  # the server: it never returns
        code = 0
        try:
            os.close(alive_w)
            die_with_parent(rank)
            _signals_of_a_new_interpreter()
            forkserver.main(listener.fileno(), alive_r, [])  # ends when the rank is gone
        except SystemExit:
            pass
        except BaseException:  # the writer's next start will fail: say why in the rank's log
            code = 1
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)  # never the rank's exit handlers
    os.close(alive_r)
    listener.close()
    server._forkserver_address, server._forkserver_alive_fd = address, alive_w
    server._forkserver_pid = _server_pid = pid
    return True


def _signals_of_a_new_interpreter() -> None:
    """What a spawned process starts with, inherited by what the server forks: no handler of
    the rank's, nothing blocked, SIGPIPE and SIGXFSZ ignored as Python ignores them (a write
    to a closed connection raises instead of killing: the results Manager died of SIGPIPE
    where the rank had it at the default), and SIGTERM ignored (the module doc)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for number in signal.valid_signals():
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                signal.signal(number, signal.SIG_DFL)
    for number in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def context() -> tuple[Any, int]:
    """The multiprocessing context to start the writer's processes with, and the pid of the
    process that will be their parent (for `die_with_parent`)."""
    import torch.multiprocessing as mp

    if _server_pid is None:
        return mp.get_context("spawn"), os.getpid()
    return mp.get_context("forkserver"), _server_pid
