"""The fast tier's peer replicas: who holds whose copy, and the copy transport (a real
receiver thread on a loopback port; the restore that uses the copies runs with real ranks
in tests/distributed/test_faults.py)."""

from __future__ import annotations

import socket
import time

import pytest

from trainer.checkpointing import replicas
from trainer.checkpointing.replicas import ReplicaReceiver, held_replicas, peers, replica_name, send_replica

TOKEN = b"t" * 32


@pytest.mark.parametrize(
    ("rank", "world", "local_world", "copies", "expected"),
    [
        # 2 nodes of 4: the peer is the same local rank on the other node.
        (1, 8, 4, 1, ([5], [5])),
        (6, 8, 4, 1, ([2], [2])),
        # 3 nodes of 2, two copies: one on each other node.
        (0, 6, 2, 2, ([2, 4], [4, 2])),
        # More copies asked than other nodes: one per other node.
        (0, 4, 2, 5, ([2], [2])),
        # One node: the next ranks (a drill on one machine can exercise the transport).
        (1, 2, 2, 1, ([0], [0])),
        (0, 4, 4, 2, ([1, 2], [3, 2])),
        # Nothing to replicate.
        (0, 4, 2, 0, ([], [])),
        (0, 1, 1, 1, ([], [])),
    ],
)
def test_each_rank_sends_to_and_holds_for_ranks_on_other_nodes(rank, world, local_world, copies, expected):
    assert peers(rank, world, local_world, copies) == expected


def test_every_copy_has_exactly_the_holders_that_expect_it():
    world, local_world, copies = 12, 4, 2
    sent = {(r, h) for r in range(world) for h in peers(r, world, local_world, copies)[0]}
    held = {(o, h) for h in range(world) for o in peers(h, world, local_world, copies)[1]}
    assert sent == held
    assert all(r // local_world != h // local_world for r, h in sent)  # never the same node


def test_a_one_node_job_listens_on_loopback_only():
    assert replicas.listen_host(world=4, local_world=4) == "127.0.0.1"


@pytest.fixture
def receiver(tmp_path):
    folder = tmp_path / "holder"
    receiver = ReplicaReceiver(folder, holder=1, owners=[0], token=TOKEN, host="127.0.0.1")
    yield receiver
    receiver.close()


def _own_file(tmp_path, step: int, size: int = 3 << 20):
    path = tmp_path / f"rank_0_step_{step}.pt"
    path.write_bytes(bytes(range(256)) * (size // 256) + str(step).encode())
    return path


def test_a_copy_arrives_whole_and_the_holder_keeps_the_two_newest(tmp_path, receiver):
    sources = {step: _own_file(tmp_path, step) for step in (3, 4, 5)}
    for step, path in sources.items():
        send_replica(receiver.address, TOKEN, 0, step, path)  # returns once the holder has it
    held = held_replicas(receiver.folder, 1, [0])[0]
    assert sorted(held) == [4, 5]
    assert held[5].read_bytes() == sources[5].read_bytes()
    assert held[5].name == replica_name(0, 5, 1)
    assert not list(receiver.folder.glob(".*tmp"))


def test_a_copy_with_a_wrong_token_or_from_a_rank_it_does_not_hold_is_refused(tmp_path, receiver):
    path = _own_file(tmp_path, 7)
    with pytest.raises((OSError, ValueError)):
        send_replica(receiver.address, b"x" * 32, 0, 7, path)
    with pytest.raises((OSError, ValueError)):
        send_replica(receiver.address, TOKEN, 2, 7, path)  # rank 2 does not send to rank 1
    assert held_replicas(receiver.folder, 1, [0, 2]) == {0: {}, 2: {}}
    assert receiver.rejected == 2
    send_replica(receiver.address, TOKEN, 0, 7, path)  # the receiver still works
    assert sorted(held_replicas(receiver.folder, 1, [0])[0]) == [7]


def test_a_sender_that_dies_mid_copy_leaves_no_file(tmp_path, receiver):
    """What a killed sender leaves: half a copy, then a closed connection."""
    with socket.create_connection(receiver.address) as connection:
        connection.sendall(replicas._HEADER.pack(replicas._MAGIC, TOKEN, 0, 9, 1 << 20))
        connection.sendall(b"\0" * 1000)
    deadline = time.monotonic() + 10
    while receiver.rejected == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.rejected == 1
    assert not receiver.folder.exists() or not any(receiver.folder.iterdir())


def test_a_closed_receiver_refuses_connections(tmp_path):
    receiver = ReplicaReceiver(tmp_path, holder=1, owners=[0], token=TOKEN, host="127.0.0.1")
    address = receiver.address
    receiver.close()
    with pytest.raises(OSError):
        send_replica(address, TOKEN, 0, 1, _own_file(tmp_path, 1))
