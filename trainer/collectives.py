"""Waits for collectives that keep the in-process watchdog's automatic progress stamp fresh.

NVRx's progress watchdog stamps progress through a pending call that only the main thread's
eval loop runs. A rank blocked inside a C collective for a slower peer (start-up, a commit
barrier after unequal shard writes) runs no bytecode and looks hung after
`resilience.soft_timeout_s`; polling the collective from Python does not.
"""

from __future__ import annotations

import time

import torch.distributed as dist

POLL_S = 0.01


def wait_polled(work: dist.Work) -> None:
    """Wait for an async collective between short sleeps. The group's timeout still bounds
    it: the work then completes with the error `wait` raises."""
    while not work.is_completed():
        time.sleep(POLL_S)
    work.wait()


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """`dist.barrier`, waited for from Python."""
    wait_polled(dist.barrier(group=group, async_op=True))
