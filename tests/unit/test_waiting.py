"""Long waits keep NVRx's automatic progress stamp fresh: collectives, thread joins, futures."""

from __future__ import annotations

import concurrent.futures
import ctypes
import datetime
import itertools
import threading
import time
from collections.abc import Callable

import pytest
import torch.distributed as dist

from trainer import waiting

PEER_DELAY_S = 1.0
STAMP_EVERY_S = 0.05
PendingCall = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


def two_ranks(timeout_s: float = 30.0) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Rank 0 and rank 1 of one gloo group, both in this process (one thread each to join)."""
    store = dist.HashStore()
    groups: dict[int, dist.ProcessGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return groups[0], groups[1]


def longest_gap_between_stamps(wait: Callable[[], None]) -> float:
    """Run `wait` on the main thread while another thread schedules a pending call every
    STAMP_EVERY_S, as NVRx's progress watchdog does; the longest time without a stamp."""
    stamps = [time.monotonic()]

    @PendingCall
    def stamp(_: int | None) -> int:
        stamps.append(time.monotonic())
        return 0

    add_pending_call = ctypes.pythonapi.Py_AddPendingCall
    add_pending_call.argtypes = [PendingCall, ctypes.c_void_p]
    add_pending_call.restype = ctypes.c_int
    done = threading.Event()

    def schedule() -> None:
        while not done.wait(STAMP_EVERY_S):
            add_pending_call(stamp, None)

    scheduler = threading.Thread(target=schedule, daemon=True)
    scheduler.start()
    wait()
    done.set()
    scheduler.join()
    time.sleep(0.01)  # the last scheduled stamp runs
    return max(later - earlier for earlier, later in itertools.pairwise(stamps))


def late_peer(group: dist.ProcessGroup) -> threading.Thread:
    def arrive() -> None:
        time.sleep(PEER_DELAY_S)
        group.barrier().wait()

    thread = threading.Thread(target=arrive)
    thread.start()
    return thread


def test_a_rank_waiting_in_a_polled_barrier_keeps_stamping_progress() -> None:
    rank0, rank1 = two_ranks()
    peer = late_peer(rank1)
    gap = longest_gap_between_stamps(lambda: waiting.wait_polled(rank0.barrier()))
    peer.join()
    assert gap < PEER_DELAY_S / 3


def test_a_rank_blocked_in_a_plain_barrier_stamps_nothing_until_its_peer_arrives() -> None:
    """The failure the polled wait avoids: this oracle sees it."""
    rank0, rank1 = two_ranks()
    peer = late_peer(rank1)
    gap = longest_gap_between_stamps(lambda: rank0.barrier().wait())
    peer.join()
    assert gap > PEER_DELAY_S * 0.8


def test_a_collective_whose_peer_never_comes_raises_at_the_groups_timeout() -> None:
    rank0, _ = two_ranks(timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?i)timed out|timeout"):
        waiting.wait_polled(rank0.barrier())  # rank 1 never calls it
    assert time.monotonic() - started < 10


def test_joining_a_long_thread_returns_to_python_every_block(monkeypatch) -> None:
    monkeypatch.setattr(waiting, "BLOCK_S", 0.2)
    writer = threading.Thread(target=time.sleep, args=(PEER_DELAY_S,))
    writer.start()
    gap = longest_gap_between_stamps(lambda: waiting.join(writer))
    assert not writer.is_alive() and gap < PEER_DELAY_S / 2

    writer = threading.Thread(target=time.sleep, args=(PEER_DELAY_S,))
    writer.start()
    assert longest_gap_between_stamps(writer.join) > PEER_DELAY_S * 0.8  # the plain join, for contrast


def test_a_long_futures_result_or_error_comes_back_while_python_runs(monkeypatch) -> None:
    monkeypatch.setattr(waiting, "BLOCK_S", 0.2)

    def write(fail: bool) -> str:
        time.sleep(PEER_DELAY_S)
        if fail:
            raise OSError("disk full")
        return "written"

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        outcome: list[str] = []
        gap = longest_gap_between_stamps(lambda: outcome.append(waiting.result(pool.submit(write, False))))
        assert outcome == ["written"] and gap < PEER_DELAY_S / 2
        with pytest.raises(OSError, match="disk full"):
            waiting.result(pool.submit(write, True))
