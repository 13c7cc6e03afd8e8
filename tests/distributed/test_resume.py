"""Two ranks over gloo: stop-and-resume is bit-identical in every checkpoint mode, and
checkpoints reshard between world sizes."""

import json
import subprocess

import pytest

from tests.distributed.conftest import events, run_config, train, train_local_command
from trainer.checkpointing import latest_committed_checkpoint
from trainer.launch import TrainingFailed, run_local_training

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS = 12


@pytest.fixture(scope="module")
def uninterrupted(dataset_dir, tmp_path_factory):
    """Trained through the user's command, `rtp train-local` (default mode: async)."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    command = train_local_command(dataset_dir, workdir, STEPS, 4)
    result = subprocess.run(command, capture_output=True, text=True, timeout=500, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert json.loads(result.stdout[result.stdout.rindex("{") :])["model_sha256"] == summary["model_sha256"]
    return summary


def test_uninterrupted_run_trains_and_checkpoints(uninterrupted):
    assert uninterrupted["world_size"] == 2 and uninterrupted["checkpoint_mode"] == "async"
    assert uninterrupted["steps"] == STEPS and uninterrupted["completed"]
    losses = [entry["loss"] for entry in uninterrupted["losses"]]
    assert losses[-1] < losses[0] - 0.5  # it learns
    saves = uninterrupted["checkpoint_saves"]
    assert [save["step"] for save in saves] == [4, 8, 12]
    assert all(save["write_s"] is not None and save["bytes_total"] > 0 for save in saves)
    assert 0 < uninterrupted["efficiency_pct"] <= 100


@pytest.mark.parametrize("mode", ["sync", "torch-async", "async"])
def test_stopped_and_resumed_run_matches_uninterrupted(mode, dataset_dir, tmp_path, uninterrupted):
    first = train(dataset_dir, tmp_path, checkpoint_mode=mode, stop_after=6)
    assert first["steps"] == 6 and not first["completed"]
    assert first["checkpoint"].endswith("step_6")
    assert first["model_sha256"] != uninterrupted["model_sha256"]

    # A save that died before committing must be ignored on resume.
    torn = tmp_path / "checkpoints" / "step_8.tmp"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")

    resumed = train(dataset_dir, tmp_path, checkpoint_mode=mode)
    assert resumed["resumed_from"].endswith("step_6")
    assert resumed["steps_run"] == STEPS - 6
    assert resumed["model_sha256"] == uninterrupted["model_sha256"]
    assert resumed["final_loss"] == uninterrupted["final_loss"]
    assert latest_committed_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / f"step_{STEPS}"
    assert any(e["kind"] == "resume" and e["step"] == 6 for e in events(tmp_path))


@pytest.mark.parametrize(("saved_with", "loaded_with"), [(2, 1), (1, 2)])
def test_checkpoint_reshards_between_world_sizes(saved_with, loaded_with, dataset_dir, tmp_path):
    saved = train(dataset_dir, tmp_path, nproc=saved_with, stop_after=4)
    # Resuming at the target step runs no step: the weights are exactly what was loaded.
    loaded = train(dataset_dir, tmp_path, nproc=loaded_with, steps=4)
    assert loaded["world_size"] == loaded_with and loaded["steps_run"] == 0
    assert loaded["resumed_from"].endswith("step_4")
    assert loaded["model_sha256"] == saved["model_sha256"]


def test_rank_failure_surfaces_with_the_log(dataset_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    config = run_config(tmp_path / "empty", tmp_path, steps=2, every=1)
    with pytest.raises(TrainingFailed, match=r"train\.log"):
        run_local_training(2, config, echo=False)
