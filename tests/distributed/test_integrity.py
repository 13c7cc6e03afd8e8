"""Two ranks over gloo: retention keeps what it promises, a killed or corrupted save is never
resumed from, and SIGTERM ends with a final checkpoint (that async saves never tear is checked
by test_resume's stop-and-resume runs)."""

import contextlib
import logging
import signal
import subprocess
import time

import psutil
import pytest
import torch

from tests.distributed.conftest import events, train, train_local_command
from trainer.checkpointing.storage import (
    committed_steps,
    latest_committed_checkpoint,
    verify_checkpoint,
)

pytestmark = [pytest.mark.launches, pytest.mark.timeout(600)]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants, as a pod's death would (ranks run in
    sessions of their own, and a rank may be spawning a writer while we look)."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    seen: list[psutil.Process] = []
    for _ in range(5):
        try:
            found = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            found = []
        fresh = [p for p in found if p not in seen] + [c for p in seen for c in _children(p) if c not in seen]
        if not fresh:
            break
        for process in fresh:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        seen.extend(fresh)
    psutil.wait_procs(seen, timeout=30)


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_killed_run_leaves_only_verifiable_checkpoints_and_resumes(dataset_dir, tmp_path, caplog):
    """SIGKILL the whole job while it saves every step and deletes old checkpoints (keep 3):
    every folder named as committed verifies, whatever was mid-write or mid-delete."""
    command = train_local_command(dataset_dir, tmp_path, 400, 1, "--override", "checkpoint.keep_last=3")
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while (committed_steps(tmp_path / "checkpoints") or [(0, None)])[0][0] < 6:
            assert process.poll() is None, "training ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoints appeared"
            time.sleep(0.05)
    finally:
        kill_tree(process.pid)  # like a pod's death: every process of the job at once
        process.wait()
    root = tmp_path / "checkpoints"
    committed = committed_steps(root)
    assert len(committed) >= 2
    for _, folder in committed:  # each one, not only the newest that verifies (latest_committed_checkpoint)
        verify_checkpoint(folder, verify_hashes=True)
    newest_step = committed[0][0]

    # Corrupt the newest committed checkpoint: resume must fall back and say why.
    shard = next((root / f"step_{newest_step}").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    with caplog.at_level(logging.WARNING):
        fallback = latest_committed_checkpoint(root)
    assert fallback is not None and fallback.name != f"step_{newest_step}"
    assert shard.name in caplog.text

    resumed = train(dataset_dir, tmp_path, steps=newest_step + 2, every=1)
    assert resumed["resumed_from"] == str(fallback)
    assert resumed["completed"]


def test_sigterm_saves_a_final_checkpoint_and_exits_non_zero(dataset_dir, tmp_path):
    """A run SIGTERM stopped before its last step keeps its final checkpoint but must not
    pass for finished: the ranks exit 143 and `rtp train-local` fails (issue 18)."""
    command = train_local_command(dataset_dir, tmp_path, 100000, 100000)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while (
            not (tmp_path / "events.jsonl").exists()
            or '"step": 3,' not in (tmp_path / "events.jsonl").read_text()
        ):
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)  # to the launcher, as kubelet does to PID 1
        output, _ = process.communicate(timeout=120)
    finally:
        kill_tree(process.pid)
    assert "SIGTERM received" in output
    assert "stopped by SIGTERM at step" in output and process.returncode != 0
    latest = latest_committed_checkpoint(tmp_path / "checkpoints", verify_hashes=True)
    assert latest is not None
    stopped = [e for e in events(tmp_path) if e["kind"] == "stopped_by_signal"]
    assert stopped and latest.name == f"step_{stopped[0]['step']}"
    assert (
        torch.load(latest / "rank_state" / "rank_1.pt", weights_only=False)["sampler"]["next_step"]
        == stopped[0]["step"] + 1
    )
