"""Long waits of the training thread that keep the in-process watchdog's progress stamp fresh.

NVRx's progress watchdog stamps progress through a pending call that only the main thread's
eval loop runs. A rank blocked inside C (a collective waiting for a slower peer, a thread
join or future waiting for a write) runs no bytecode and looks hung after the wrapper's soft
timeout (`trainer.timeouts.watchdog_timeouts`: `resilience.timeout_floor_s` unless
`soft_timeout_s` is set), whatever `keepalive()` pings. These waits return to Python at
least every `BLOCK_S` (threads, futures) or poll (collectives, which have no timed wait).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import TypeVar

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
