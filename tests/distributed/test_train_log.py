"""The train log is for people: a fault-free run's log says what happened and holds none of
the noise each rank used to print (each silenced at its source, not filtered)."""

from pathlib import Path

import pytest

pytestmark = [pytest.mark.launches, pytest.mark.timeout(600)]

NOISE = {
    # NVRx's monitor thread polls the store with 1 s timeouts: TORCH_CPP_LOG_LEVEL (trainer/launch.py).
    "c10d store-poll timeouts": "waitForInput",
    # pynvml 13's import hook: pynvml pinned to 12.0.0 (setup.cfg).
    "pynvml deprecation": "The pynvml package is deprecated",
    # rtp set the flight recorder's old name too: trainer/diagnostics.py.
    "deprecated flight-recorder variable": "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated",
}


def test_a_fault_free_run_log_has_none_of_the_known_noise(plain_two_rank_run):
    log = Path(plain_two_rank_run["checkpoint"]).parents[1] / "logs" / "train.log"
    text = log.read_text()
    assert "trainer.progress: step" in text and "committed" in text, "the log still says what happened"
    found = {name: text.count(needle) for name, needle in NOISE.items() if needle in text}
    assert not found, f"{log} has {found}"
