"""Long waits of the training thread that keep the in-process watchdog's progress stamp fresh.

NVRx's progress watchdog stamps progress through a pending call that only the main thread's
eval loop runs. A rank blocked inside C (a collective waiting for a slower peer, a thread
join or future waiting for a write) runs no bytecode and looks hung after the wrapper's soft
timeout (`trainer.timeouts.watchdog_timeouts`: `resilience.timeout_floor_s` unless
`soft_timeout_s` is set), whatever `keepalive()` pings. These waits return to Python at
least every `BLOCK_S` (threads, futures) or poll (collectives, which have no timed wait).
A library call that blocks inside C and cannot be polled (torch DCP's save, whose result
gather waits for the slowest rank's write) runs in a thread of its own (`off_main_thread`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

POLL_S = 0.01
BLOCK_S = 0.5
T = TypeVar("T")


def wait_polled(work: dist.Work) -> None:
    """Wait for an async collective between short sleeps. The group's timeout still bounds
    it: the work then completes with the error `wait` raises."""
    while not work.is_completed():
        time.sleep(POLL_S)
    work.wait()


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """`dist.barrier`, waited for from Python."""
    wait_polled(dist.barrier(group=group, async_op=True))


def join(thread: threading.Thread) -> None:
    """`thread.join()`, back in Python every BLOCK_S."""
    while thread.is_alive():
        thread.join(BLOCK_S)


def result(future: concurrent.futures.Future[T]) -> T:
    """`future.result()` (raising what it raised), back in Python every BLOCK_S."""
    while not concurrent.futures.wait([future], BLOCK_S).done:
        pass
    return future.result()


def off_main_thread(name: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`function(*args, **kwargs)` in a new thread named `name`, waited for with `result`:
    its return value, or what it raised. For blocking work that runs collectives: the calling
    thread runs none meanwhile, so they keep their order on every rank; the thread uses the
    caller's CUDA device (a new thread starts on device 0).

    A daemon: if the wait is interrupted (an in-process restart raises into the main thread),
    the work ends on its own, failing once the restart's abort closes its process group. So
    pass the collectives' group bound at the call (`dist.group.WORLD` now, or a group of
    their own): on none they resolve the default group when each runs, by then perhaps the
    next attempt's, where the peers run their own collectives."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            future.set_result(function(*args, **kwargs))
        except BaseException as exc:  # raised again where it is waited for
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return result(future)
