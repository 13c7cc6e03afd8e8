"""The rank monitor's client is used from two threads (the loop, and the keep-alive thread
that heart-beats during blocking work): its messages must never interleave on the socket."""

from __future__ import annotations

import threading
import time

from trainer.resilience import _LauncherClient


class _OneMessageAtATime:
    """A rank-monitor client that fails when two messages are on its socket at once."""

    CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"
    is_initialized = True

    def __init__(self) -> None:
        self.sending = threading.Lock()
        self.overlaps = 0

    def _send(self) -> None:
        if not self.sending.acquire(blocking=False):
            self.overlaps += 1
            return
        try:
            time.sleep(0.002)
        finally:
            self.sending.release()

    def send_heartbeat(self) -> None:
        self._send()

    def load_state_dict(self, state) -> None:
        self._send()

    def state_dict(self) -> dict:
        self._send()
        return {}


def test_state_restored_while_the_keepalive_beats_never_interleaves():
    link = _LauncherClient(floor_s=15.0)
    link.client = client = _OneMessageAtATime()
    stop = threading.Event()

    def keepalive() -> None:
        while not stop.is_set():
            link.last_beat = float("-inf")  # every call beats
            link.keepalive_beat()

    beating = threading.Thread(target=keepalive)
    beating.start()
    try:
        for _ in range(100):  # a resume restoring the launcher's learned timeouts, and a save reading them
            link.load_state_dict({"current_timeouts": {"heartbeat": {"initial": 60.0, "subsequent": 15.0}}})
            link.state_dict()
    finally:
        stop.set()
        beating.join()
    assert client.overlaps == 0
