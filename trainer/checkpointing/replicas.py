"""Peer replicas of the fast checkpoint tier: a rank's newest node-local copy, also held by
other ranks, so that a rank whose node is gone (its /dev/shm with it) resumes from a peer.

With `checkpoint.local_replicas: K`, each rank sends every node-local file it writes to
the K ranks one node apart, `rank + LOCAL_WORLD_SIZE`, `rank + 2 * LOCAL_WORLD_SIZE`, …
(modulo the world size: a rank on every other node), and holds, as files in its own
node-local folder, the copies of the K ranks that send to it. On a single node, where
no node can be lost alone, the peers are the next ranks instead (`rank + 1`, …): what a
test or a drill on one machine can exercise.

The transport is a plain TCP connection per copy: the holder's receiver thread listens on
a port of its own (loopback when the job has one node; the pod's address otherwise),
the sender streams the capture (its header file, then its slot file, received as one file)
with `socket.sendfile` from a thread of its own once the header is written, so it costs
the training loop nothing; while a copy is being sent, that slot is not overwritten (a
capture is skipped) and newer captures replace each other in the queue, so a slow link
sends the newest state it can. A copy
is written to a temporary name and renamed when complete; the holder keeps the two
newest of each owner. Addresses and a random token (a receiver takes copies only from
the ranks of this attempt) are exchanged in the all-gather that starts every restore.

On restore, the ranks agree on the newest step every rank's state is held for, by the
rank itself or by a peer; a rank whose own copy is missing or unreadable receives the
peer's over the default process group (`send_object_list`). The durable checkpoint stays
the fallback when neither holds it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from trainer import env

log = logging.getLogger(__name__)

REPLICA_FILE = re.compile(r"^replica_rank_(\d+)_step_(\d+)_on_(\d+)\.pt$")
KEEP_PER_OWNER = 2
_MAGIC = b"RTPR1"
_HEADER = struct.Struct("!5s32sqqq")  # magic, token, owner, step, size
_TIMEOUT_S = 30.0


def replica_name(owner: int, step: int, holder: int) -> str:
    return f"replica_rank_{owner}_step_{step}_on_{holder}.pt"


def peers(rank: int, world: int, local_world: int, copies: int) -> tuple[list[int], list[int]]:
    """(the ranks this rank sends its copies to, the ranks whose copies it holds).

    A node's ranks are `local_world` consecutive ranks (torchrun's numbering), so a rank
    `local_world` apart is on another node; on one node the stride is 1."""
    if copies <= 0 or world <= 1:
        return [], []
    stride = local_world if 0 < local_world < world and world % local_world == 0 else 1
    copies = min(copies, world // stride - 1)
    sends = [(rank + k * stride) % world for k in range(1, copies + 1)]
    holds = [(rank - k * stride) % world for k in range(1, copies + 1)]
    return sends, holds


def listen_host(world: int, local_world: int) -> str:
    """Where the receiver listens: loopback for a one-node job; else the address peers
    reach this pod at (`RTP_REPLICA_HOST`, `POD_IP`, or the host name's address)."""
    if world <= local_world:
        return "127.0.0.1"
    return env.replica_host() or socket.gethostbyname(socket.gethostname())


def folder_names(folder: Path) -> list[str]:
    """The names in a node-local folder, in one listing; none where there is no folder."""
    try:
        return [entry.name for entry in os.scandir(folder)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def held_replicas(folder: Path, holder: int, owners: list[int]) -> dict[int, dict[int, Path]]:
    """owner -> step -> file, for the replicas this rank holds of `owners`."""
    found: dict[int, dict[int, Path]] = {owner: {} for owner in owners}
    for name in folder_names(folder):
        match = REPLICA_FILE.match(name)
        if match and int(match.group(3)) == holder and int(match.group(1)) in found:
            found[int(match.group(1))][int(match.group(2))] = folder / name
    return found


class ReplicaReceiver:
    """A thread that takes the copies the `owners` send and writes them into `folder`."""

    def __init__(self, folder: Path, holder: int, owners: list[int], token: bytes, host: str) -> None:
        self.folder = folder
        self.holder = holder
        self.owners = set(owners)
        self.token = token
        self.rejected = 0
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.2)  # how often the thread looks whether it must stop
        self.address = (host, self._listener.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rtp-replica-receiver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            # The stream's `read(n)` returns n bytes unless the peer closed the connection first.
            with connection, connection.makefile("rb") as stream:
                try:
                    self._receive(connection, stream)
                except (OSError, ValueError, struct.error) as exc:  # struct.error: a header cut short
                    self.rejected += 1
                    if self.rejected == 1:
                        log.warning("fast checkpoint tier: a peer's copy was not received: %s", exc)

    def _receive(self, connection: socket.socket, stream: BinaryIO) -> None:
        connection.settimeout(_TIMEOUT_S)
        magic, token, owner, step, size = _HEADER.unpack(stream.read(_HEADER.size))
        if magic != _MAGIC or token != self.token or owner not in self.owners or size < 0:
            raise ValueError(f"refused a copy (owner {owner}, step {step}): not from this attempt's peers")
        final = self.folder / replica_name(owner, step, self.holder)
        temporary = final.with_name(f".{final.name}.tmp")
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            with temporary.open("wb") as handle:
                for left in range(size, 0, -(1 << 20)):  # 1 MiB at a time
                    chunk = stream.read(min(left, 1 << 20))  # all of it, unless the peer closed first
                    if len(chunk) < min(left, 1 << 20):
                        raise ValueError(f"the copy of rank {owner}'s step {step} ended early")
                    handle.write(chunk)
            os.replace(temporary, final)
        finally:
            temporary.unlink(missing_ok=True)
        steps = sorted(held_replicas(self.folder, self.holder, [owner])[owner].items())
        for _, old in steps[:-KEEP_PER_OWNER]:
            old.unlink(missing_ok=True)
        connection.sendall(b"\x01")  # the sender returns: what it sees is what is held

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(timeout=_TIMEOUT_S + 1)


def send_replica(address: tuple[str, int], token: bytes, owner: int, step: int, *paths: Path) -> None:
    """Stream a node-local copy to a holder, as one file: the contents of `paths`, one
    after the other (a capture's header, then its slot); returns once the holder has it
    (raises OSError)."""
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(path.open("rb")) for path in paths]
        sizes = [os.fstat(handle.fileno()).st_size for handle in handles]
        connection = stack.enter_context(socket.create_connection(address, timeout=_TIMEOUT_S))
        connection.sendall(_HEADER.pack(_MAGIC, token, owner, step, sum(sizes)))
        for handle, size in zip(handles, sizes, strict=True):
            if size:
                connection.sendfile(handle, count=size)
        if connection.recv(1) != b"\x01":  # nothing: the holder closed the connection
            raise OSError(f"holder {address} did not confirm the copy of step {step}")


class ReplicaSender:
    """A rank's thread that sends its newest capture to the ranks holding its replicas;
    a newer capture replaces one still queued. Shares the tier's lock, under which the
    tier asks `reading(slot)` before it overwrites a slot."""

    def __init__(self, rank: int, lock: threading.Lock, lookup: Callable[[int], Any]) -> None:
        self.rank, self._lookup = rank, lookup
        # Rank -> its receiver's address, for each rank this one sends its copies to (in order).
        self.holders: dict[int, tuple[str, int]] = {}
        self.token = b""
        self.sent = self.errors = 0
        self._wake = threading.Condition(lock)  # entered: the tier's lock taken
        self._queued: int | None = None
        self._sending: int | None = None
        self._closed, self._flush = False, True
        self._thread: threading.Thread | None = None

    def reading(self, slot: int) -> bool:
        """Under the lock: whether `slot` is being sent; a queued send of it is dropped
        (the slot is about to be overwritten, and its successor will be queued)."""
        if self._queued == slot:
            self._queued = None
        return self._sending == slot

    def queue(self, slot: int) -> None:
        """Under the lock: send `slot`'s capture next (the first starts the thread, which
        waits for the lock taken by the caller)."""
        self._queued = slot
        self._wake.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rtp-local-tier-send", daemon=True)
            self._thread.start()

    def close(self, flush: bool) -> None:
        """Stop the thread; the queued capture is sent first when `flush`."""
        with self._wake:
            self._closed, self._flush = True, flush
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._queued is not None or self._closed)
                if self._closed and (self._queued is None or not self._flush):
                    return
                slot, self._queued = self._queued, None
                assert slot is not None
                self._sending = slot
                target = self._lookup(slot)
            try:
                if target is not None and target.head is not None and target.path is not None:
                    self._send(target.head, target.path, target.step)
            finally:
                with self._wake:
                    self._sending = None

    def _send(self, head: Path, path: Path, step: int) -> None:
        """The capture, as one file (header, then the slot's bytes), to every holder."""
        for holder, address in self.holders.items():
            try:
                send_replica(address, self.token, self.rank, step, head, path)
                self.sent += 1
            except (OSError, ValueError) as exc:  # a peer restarting must not stop training
                self.errors += 1
                if self.errors == 1:
                    log.warning("fast checkpoint tier: cannot send a copy to rank %d: %s", holder, exc)
