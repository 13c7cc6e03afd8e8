"""Fast peer abort on gloo (trainer/peer_abort.py), with two real gloo ranks.

Rank 0 waits in a collective that rank 1 never joins, as a rank waits on a failed peer.
It must leave its collective because the connection went down ("Connection closed"), not
because the collective timed out, when rank 1
- runs the in-process restart's abort step while alive (`shutdown`): without it, rank 0
  sat there until the timeout;
- closes its group after a process was exec'd from it (`close-after-exec`, as torch
  starts torch_shm_manager on the first tensor shared by file name): the child held
  copies of gloo's inheritable sockets, so closing them sent nothing.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer import peer_abort

TIMEOUT_S = 30.0


def _rank(rank: int, port: int, results: dict, mode: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    with peer_abort.tracking():
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("attempt0", store),
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
    dist.all_reduce(torch.ones(2))
    child = None
    if mode == "close-after-exec":  # a helper exec'd after the group exists keeps what it may inherit
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False)
    try:
        if rank == 1:
            store.wait(["rank0-waiting"])
            time.sleep(0.5)  # rank 0 is inside its collective
            if mode == "shutdown":
                results["shut"] = peer_abort.shutdown_tracked()
            else:
                dist.destroy_process_group()
                gc.collect()  # nothing else refers to the group: gloo closes its sockets
            store.set("rank1-done", "1")
            store.wait(["rank0-out"], datetime.timedelta(seconds=TIMEOUT_S + 30))
            return
        store.set("rank0-waiting", "1")
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(2))  # rank 1 never joins
            results["error"] = "the collective returned"
        except RuntimeError as exc:
            results["error"] = str(exc)
        results["waited_s"] = time.monotonic() - started
        store.set("rank0-out", "1")
    finally:
        # Each rank ends its group as a restart's abort does (a group left for the
        # interpreter's exit, its peer gone, aborted there once in CI: "terminate called
        # without an active exception").
        peer_abort.shutdown_tracked()
        if dist.is_initialized():
            dist.destroy_process_group()
        if child is not None:
            child.kill()
            child.wait()


def _run_pair(mode: str) -> dict:
    # The store's server lives here, on a port the system picked while listening (a port
    # probed free and then bound by a rank was taken in between once, in CI).
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(server.port, results, mode), nprocs=2, join=True)
        return dict(results)


@pytest.mark.parametrize("mode", ["shutdown", "close-after-exec"])
def test_a_rank_waiting_on_a_failed_peer_leaves_its_collective_at_once(mode: str) -> None:
    results = _run_pair(mode)
    if mode == "shutdown":
        assert results["shut"] >= 2, results  # the group's listener and its connection at least
    assert "Connection closed" in results["error"], results
    assert "Timed out" not in results["error"], results


def test_tracking_records_only_sockets_opened_inside_the_block() -> None:
    outside = socket.socket()
    outside.bind(("127.0.0.1", 0))
    outside.listen()
    try:
        with peer_abort.tracking():
            inside = socket.socket()
            inside.bind(("127.0.0.1", 0))
            inside.listen()
            inside.set_inheritable(True)  # as gloo's sockets are
        try:
            assert peer_abort.tracked_count() == 1
            assert not os.get_inheritable(inside.fileno())
            assert peer_abort.shutdown_tracked() == 1
            assert peer_abort.tracked_count() == 0  # forgotten after the shutdown
        finally:
            inside.close()
    finally:
        outside.close()
        peer_abort.forget()
