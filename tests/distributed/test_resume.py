"""Two ranks over gloo: a run stopped after a checkpoint and resumed ends bit-identical to
an uninterrupted run, and a checkpoint that never committed is never resumed from."""

import json
import subprocess
import sys

import pytest

from trainer.checkpoint import latest_committed_checkpoint
from trainer.launch import TrainingFailed, run_local_training, trainer_arguments

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS = 12


def _train(dataset_dir, workdir, **extra):
    args = trainer_arguments(
        dataset_dir=str(dataset_dir), workdir=str(workdir), steps=STEPS, checkpoint_every=4, seed=7, **extra
    )
    return run_local_training(2, args, workdir, echo=False)


@pytest.fixture(scope="module")
def uninterrupted(dataset_dir, tmp_path_factory):
    """Trained through the user's command, `rtp train-local`."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    command = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "train-local",
        "--nproc",
        "2",
        "--dataset-dir",
        str(dataset_dir),
        "--workdir",
        str(workdir),
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        "4",
        "--seed",
        "7",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=500, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert json.loads(result.stdout[result.stdout.rindex("{") :])["model_sha256"] == summary["model_sha256"]
    return summary


def test_uninterrupted_run_trains_and_checkpoints(uninterrupted):
    assert uninterrupted["world_size"] == 2
    assert uninterrupted["steps"] == STEPS and uninterrupted["completed"]
    losses = [entry["loss"] for entry in uninterrupted["losses"]]
    assert losses[-1] < losses[0] - 0.5  # it learns
    assert [save["step"] for save in uninterrupted["checkpoint_saves"]] == [4, 8, 12]


def test_stopped_and_resumed_run_matches_uninterrupted(dataset_dir, tmp_path, uninterrupted):
    first = _train(dataset_dir, tmp_path, stop_after=6)
    assert first["steps"] == 6 and not first["completed"]
    assert first["model_sha256"] != uninterrupted["model_sha256"]

    # A save that died before committing must be ignored on resume.
    torn = tmp_path / "checkpoints" / "step_8.tmp"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")

    resumed = _train(dataset_dir, tmp_path)
    assert resumed["resumed_from"].endswith("step_6")
    assert resumed["steps_run"] == STEPS - 6
    assert resumed["model_sha256"] == uninterrupted["model_sha256"]
    assert resumed["final_loss"] == uninterrupted["final_loss"]
    assert latest_committed_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / f"step_{STEPS}"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "resume" and e["step"] == 6 for e in events)


def test_rank_failure_surfaces_with_the_log(dataset_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainingFailed, match=r"train\.log"):
        run_local_training(
            2,
            trainer_arguments(
                dataset_dir=str(tmp_path / "empty"),
                workdir=str(tmp_path),
                steps=2,
                checkpoint_every=1,
                seed=1,
            ),
            tmp_path,
            echo=False,
        )
