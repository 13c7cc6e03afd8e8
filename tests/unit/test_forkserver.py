"""trainer.forkserver: the rank's own fork server for the checkpoint writer's processes.

Each case runs in a process of its own (a "rank": `start()` forks it, and must be called
before any thread runs, which pytest's process cannot promise)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from trainer import forkserver

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # not tests.conftest: a spawned child imports this module

RANK = """
import json, os, sys, threading, time
from tests.unit import test_forkserver as helpers
from trainer import forkserver
{before}
started = forkserver.start(["trainer.checkpointing.nvrx_compat"])
context, parent = forkserver.context()
queue = context.Queue()
child = context.Process(target=helpers.report, args=(queue,))
child.start()
seen = queue.get(timeout=60)
child.join(60)
sleeper = context.Process(target=helpers.sleep_with_parent, args=(parent,))
sleeper.start()
print(json.dumps({{"started": started, "method": context.get_start_method(), "parent": parent,
                  "rank": os.getpid(), "seen": seen, "exitcode": child.exitcode,
                  "sleeper": sleeper.pid}}), flush=True)
{after}
"""


def report(queue) -> None:
    """In a started process: its parent, whether NVRx was imported before it ran, and its
    signal dispositions."""
    queue.put(
        {
            "ppid": os.getppid(),
            "nvrx": "nvidia_resiliency_ext.checkpointing.async_ckpt.core" in sys.modules,
            "signals": {
                name: str(signal.getsignal(getattr(signal, name)))
                for name in ("SIGPIPE", "SIGTERM", "SIGUSR1")
            },
        }
    )


def sleep_with_parent(parent_pid: int) -> None:
    """What the writer does first (`lifecycle.prepare_background_writer`), then nothing."""
    from trainer.lifecycle import die_with_parent

    die_with_parent(parent_pid)
    time.sleep(600)


def rank(before: str = "", after: str = "") -> subprocess.Popen:
    script = RANK.format(before=textwrap.dedent(before), after=textwrap.dedent(after))
    return subprocess.Popen(
        [sys.executable, "-c", script], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True
    )


def first_line(process: subprocess.Popen) -> dict:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"the rank exited ({process.wait()}) before reporting"
    return json.loads(line)


def gone(pid: int, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_this_pythons_fork_server_is_the_one_start_stands_in_for():
    """An upgrade of Python whose fork server keeps other state (3.14: a key) fails here;
    `start()` then refuses and the writer is spawned as NVRx spawns it."""
    assert forkserver.stdlib_matches()


IGNORED, DEFAULT = str(signal.SIG_IGN), str(signal.SIG_DFL)


def test_the_writers_processes_are_forked_from_the_ranks_server_with_nvrx_imported_and_die_with_the_rank():
    # A rank forked from rtp_prefork's zygote once had SIGPIPE at the default (the results
    # Manager then died of a write to a closed connection), and a rank may hold handlers.
    process = rank(
        before="import signal; signal.signal(signal.SIGPIPE, signal.SIG_DFL); "
        "signal.signal(signal.SIGUSR1, lambda *_: None)",
        after="time.sleep(600)",
    )
    try:
        seen = first_line(process)
        assert seen["started"] and seen["method"] == "forkserver", seen
        server = seen["parent"]
        assert server != seen["rank"] and psutil.Process(server).ppid() == seen["rank"]
        # Forked from the server, NVRx imported before the process ran anything (spawn: not).
        assert seen["seen"]["ppid"] == server and seen["seen"]["nvrx"] and seen["exitcode"] == 0, seen
        # What a spawned process starts with, SIGTERM ignored (the rank's final save outlives it).
        assert seen["seen"]["signals"] == {"SIGPIPE": IGNORED, "SIGTERM": IGNORED, "SIGUSR1": DEFAULT}, seen
        # SIGTERM to the whole group (a launcher stopping the rank) leaves the server to its rank.
        os.kill(server, signal.SIGTERM)
        time.sleep(0.5)
        assert psutil.Process(server).is_running() and psutil.Process(server).status() != psutil.STATUS_ZOMBIE
        process.kill()  # the rank SIGKILLed: its server, and what the server forked, go with it
        assert gone(server)
        assert gone(seen["sleeper"])
    finally:
        process.kill()
        process.wait()


def test_a_rank_that_exits_ends_its_server():
    process = rank(after="os.kill(sleeper.pid, 9); sleeper.join()")
    seen = first_line(process)
    assert process.wait(60) == 0
    assert gone(seen["parent"])


def test_a_rank_already_running_a_thread_spawns_its_writer_as_nvrx_does():
    """Fork is safe only before any thread runs: after one, the writer is a new interpreter."""
    process = rank(
        before="threading.Thread(target=time.sleep, args=(30,), daemon=True).start()",
        after="os.kill(sleeper.pid, 9); sleeper.join()",
    )
    seen = first_line(process)
    assert process.wait(120) == 0
    assert not seen["started"] and seen["method"] == "spawn", seen
    assert seen["seen"]["ppid"] == seen["rank"] and not seen["seen"]["nvrx"], seen
