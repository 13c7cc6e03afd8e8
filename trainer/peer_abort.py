"""Fast peer abort for gloo: release ranks that wait in a collective on a failed peer.

A gloo collective cannot be aborted (pytorch issue 130345), and `destroy_process_group`
does not close its connections while anything (the FSDP model, the optimizer's DTensors,
a writer's group) still references the group. A rank waiting on a failed peer would
therefore sit in its collective until the collective timeout, making the in-process restart
on CPU as slow as that timeout (15 s by default).

What does release it at once is its TCP connections going down: gloo's pair sees the end
of stream and fails the pending operation ("Connection closed by peer"), on the peer and,
once the peer closes its side, here. So the sockets of every process group of this attempt
are recorded (`tracking()` around the group's creation), and the in-process restart's abort
step (`shutdown_tracked()`, run on every rank by NVRx's monitor thread) shuts down their
sending side. `shutdown()` leaves the descriptors to gloo, which still owns and closes
them, so no descriptor is closed under it or reused while it runs.

The sockets are made close-on-exec on the way (see `_not_inherited`). What is recorded: the sockets opened inside the block (the group's listener and the
connections it made), and the listener's port — gloo accepts a peer's connection in its
own event-loop thread, possibly after the block ended, so a connection accepted on a
recorded listener port belongs to the group too. Nothing else is touched: the stores (the
launcher's, the training store and NVRx's), ft_launcher's rank-monitor socket, MLflow
connections and the async writer's worker connections stay up. On NCCL the same call costs
nothing and NVRx's own abort handles the NCCL communicators.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator

from trainer import env

log = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"
# Only the sending direction: the peer reads the end of stream and fails its pending
# operation cleanly ("Connection closed by peer"), then closes its side, which fails ours.
# Shutting down reading too made gloo's own event loop throw (gloo::EnforceNotMet ->
# std::terminate) when an operation of this process was pending on the socket.
_HOW = socket.SHUT_WR
_lock = threading.Lock()
_tracked: set[int] = set()  # socket inodes of this attempt's process groups
_listener_ports: set[int] = set()  # their listeners' ports: accepted connections are theirs too


def _socket_inodes() -> dict[int, int]:
    """fd -> inode of every socket this process holds (Linux /proc)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue  # closed since listdir
        if target.startswith("socket:["):
            found[int(name)] = int(target[len("socket:[") : -1])
    return found


def _tcp_ends(fd: int) -> tuple[int, int | None] | None:
    """(local port, peer port or None for a listener) of a TCP socket; None for others."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        local = sock.getsockname()[1]
        try:
            peer: int | None = sock.getpeername()[1]
        except OSError:
            peer = None
        return local, peer
    except OSError:
        return None
    finally:
        sock.detach()  # the descriptor stays its owner's


@contextlib.contextmanager
def tracking() -> Iterator[None]:
    """Record the sockets of the process groups created while the block runs."""
    before = set(_socket_inodes().values())
    try:
        yield
    finally:
        current = _socket_inodes()
        new = {fd: inode for fd, inode in current.items() if inode not in before}
        _not_inherited(current)
        stores = _store_ports()
        listeners = set()
        for fd in new:
            ends = _tcp_ends(fd)
            if ends is not None and ends[1] is None and ends[0] not in stores:
                listeners.add(ends[0])
        with _lock:
            _tracked.update(new.values())
            _listener_ports.update(listeners)


def _not_inherited(fds: dict[int, int]) -> None:
    """Mark sockets close-on-exec. gloo's and the stores' are inheritable, so a helper that
    torch execs later (torch_shm_manager, started on the first tensor shared by file name)
    would hold copies: closing ours would send no end of stream, the peer would wait out the
    collective timeout, and the copies would keep dead connections open."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.set_inheritable(fd, False)


def _targets() -> list[int]:
    """The open descriptors of recorded process groups: recorded sockets and connections
    accepted on a recorded listener's port; never a store's."""
    with _lock:
        inodes, ports = set(_tracked), set(_listener_ports)
    stores = _store_ports()
    found = []
    for fd, inode in _socket_inodes().items():
        ends = _tcp_ends(fd)
        if ends is None or ends[0] in stores or ends[1] in stores:
            continue
        if inode in inodes or (ends[1] is not None and ends[0] in ports):
            found.append(fd)
    return found


def tracked_count() -> int:
    """How many sockets of recorded process groups are open now."""
    return len(_targets())


def shutdown_tracked() -> int:
    """Shut down the sending side of every socket of the recorded process groups; returns
    how many. Safe from any thread and safe to call twice; forgets the records."""
    targets = _targets()
    forget()
    for fd in targets:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            with contextlib.suppress(OSError):  # a listener, or closed meanwhile
                sock.shutdown(_HOW)
        finally:
            sock.detach()  # the descriptor stays gloo's
    log.debug("shut down %d process-group sockets", len(targets))
    return len(targets)


def _store_ports() -> set[int]:
    """The store server's port (MASTER_PORT: the training and NVRx's stores share it): a
    store created inside a `tracking()` block (plain `init_process_group`) is never shut down."""
    base = env.master_port_or_none()
    return set() if base is None else {base}


def forget() -> None:
    """Drop the records (the groups are gone)."""
    with _lock:
        _tracked.clear()
        _listener_ports.clear()
