"""Two ranks over gloo: stop-and-resume is bit-identical in every checkpoint mode, checkpoints
reshard between world sizes, and a run resumed on one rank with gradient accumulation ends with
the two-rank run's weights."""

import shutil

import pytest
import torch

from benchmarks.checkpoint import mode_overrides
from tests.distributed.conftest import PLAIN_EVERY, PLAIN_STEPS, events, run_config, train
from tests.weights import state_dict_sha256
from trainer.checkpointing import latest_committed_checkpoint, load_model_weights
from trainer.checkpointing.storage import committed_steps, read_meta
from trainer.config import TrainConfig
from trainer.launch import TrainingFailed
from trainer.models import model_spec

pytestmark = [pytest.mark.launches, pytest.mark.timeout(600)]

STEPS, EVERY = PLAIN_STEPS, PLAIN_EVERY


@pytest.fixture(scope="module")
def uninterrupted(plain_two_rank_run):
    """Trained through the user's command, `rtp train-local` (default mode: async): the
    session's plain run (its restart timeouts and metrics interval change no weight)."""
    return plain_two_rank_run


def test_uninterrupted_run_trains_and_checkpoints(uninterrupted):
    assert uninterrupted["world_size"] == 2 and uninterrupted["checkpoint_mode"] == "async"
    assert uninterrupted["steps"] == STEPS and uninterrupted["completed"]
    losses = [entry["loss"] for entry in uninterrupted["losses"]]
    assert losses[-1] < losses[0] - 0.5  # it learns
    saves = uninterrupted["checkpoint_saves"]
    assert [save["step"] for save in saves] == list(range(EVERY, STEPS + 1, EVERY))
    assert all(save["write_s"] is not None and save["bytes_total"] > 0 for save in saves)
    assert 0 < uninterrupted["efficiency_pct"] <= 100


# Asynchronous saves record the weights they were taken from, so each checkpoint can be checked
# against the step it is named after (a torn save would hold weights of a later step).
RECORDED = ("checkpoint.keep_last=100", "checkpoint.record_weight_hashes=true")


def assert_saves_hold_the_weights_of_their_step(workdir) -> None:
    at_save = {e["step"]: e["weights_sha256"] for e in events(workdir) if e["kind"] == "checkpoint_queued"}
    committed = committed_steps(workdir / "checkpoints")
    assert sorted(step for step, _ in committed) == sorted(at_save)
    for step, folder in committed:
        model = model_spec("byte-lm").build(
            TrainConfig.from_dict(read_meta(folder)["config"]).model, torch.device("cpu")
        )
        load_model_weights(folder, model)
        assert state_dict_sha256(model.state_dict()) == at_save[step], f"step {step} checkpoint is torn"


@pytest.mark.parametrize("mode", ["sync", "torch-async", "async"])
def test_stopped_and_resumed_run_matches_uninterrupted(mode, dataset_dir, tmp_path, uninterrupted):
    mode_setting, *plug_in = mode_overrides(mode)  # torch-async: sync with a plug-in writer
    named = mode_setting.removeprefix("checkpoint.mode=")
    overrides = (*(RECORDED if mode != "sync" else ()), *plug_in)
    first = train(dataset_dir, tmp_path, steps=STEPS, every=EVERY, overrides=overrides, checkpoint_mode=named,
                  stop_after=6)  # fmt: skip
    assert first["checkpoint_mode"] == mode
    assert first["steps"] == 6 and not first["completed"]
    assert first["checkpoint"].endswith("step_6")
    assert first["model_sha256"] != uninterrupted["model_sha256"]

    # A save that died before committing must be ignored on resume.
    torn = tmp_path / "checkpoints" / "step_8.tmp"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")

    resumed = train(
        dataset_dir, tmp_path, steps=STEPS, every=EVERY, overrides=overrides, checkpoint_mode=named
    )
    assert resumed["resumed_from"].endswith("step_6")
    assert resumed["steps_run"] == STEPS - 6
    assert resumed["model_sha256"] == uninterrupted["model_sha256"]
    assert resumed["final_loss"] == uninterrupted["final_loss"]
    assert latest_committed_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / f"step_{STEPS}"
    assert any(e["kind"] == "resume" and e["step"] == 6 for e in events(tmp_path))
    if mode != "sync":  # steps 4, 8 and 12 were written in the background; 6 and 16 are last saves
        assert_saves_hold_the_weights_of_their_step(tmp_path)


@pytest.mark.parametrize(("saved_with", "loaded_with"), [(2, 1), (1, 2)])
def test_checkpoint_reshards_between_world_sizes(saved_with, loaded_with, dataset_dir, tmp_path):
    # One global batch on both world sizes (8 sequences x 2 ranks), else the resume is refused.
    fixed = ("data.global_batch=16",)
    # Synchronous saves: every mode writes the same layout (test_hf_models reshards an async one).
    saved = train(
        dataset_dir, tmp_path, nproc=saved_with, stop_after=4, overrides=fixed, checkpoint_mode="sync"
    )
    # Resuming at the target step runs no step: the weights are exactly what was loaded.
    loaded = train(dataset_dir, tmp_path, nproc=loaded_with, steps=4, overrides=fixed, checkpoint_mode="sync")
    assert loaded["world_size"] == loaded_with and loaded["steps_run"] == 0
    assert loaded["resumed_from"].endswith("step_4")
    assert loaded["model_sha256"] == saved["model_sha256"]


ACCUM_STEPS, ACCUM_RESUME_AT = 6, 3
ACCUM_OVERRIDES = ("data.batch_size=2", "data.global_batch=4")
# fp32 sums in another order (one rank's two micro-batches added, not two ranks' reduced) leave
# the weights (|w| <= ~1) ulps apart (docs/data.md); other data would move them by ~lr = 3e-3.
ACCUM_TOLERANCE = 1e-6


def _weights(folder, config) -> dict:
    model = model_spec(config.model.kind).build(config.model, torch.device("cpu"))
    load_model_weights(folder, model)
    return model.state_dict()


def test_a_run_resumed_on_one_rank_with_accumulation_ends_with_the_weights_of_the_two_rank_run(
    dataset_dir, tmp_path
):
    """2 ranks x 2 sequences to step 6, against 2 ranks to step 3 then 1 rank x 2 micro-batches of
    2 from its checkpoint: the same data, so the same weights to within the reduction order."""
    whole = train(dataset_dir, tmp_path / "whole", steps=ACCUM_STEPS, every=ACCUM_RESUME_AT,
                  overrides=ACCUM_OVERRIDES, checkpoint_mode="sync")  # fmt: skip
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "whole" / "checkpoints" / f"step_{ACCUM_RESUME_AT}",
        resumed_dir / "checkpoints" / f"step_{ACCUM_RESUME_AT}",
    )
    resumed = train(dataset_dir, resumed_dir, nproc=1, steps=ACCUM_STEPS, every=ACCUM_RESUME_AT,
                    overrides=ACCUM_OVERRIDES, checkpoint_mode="sync")  # fmt: skip
    assert resumed["world_size"] == 1 and resumed["steps_run"] == ACCUM_STEPS - ACCUM_RESUME_AT
    assert resumed["resumed_from"].endswith(f"step_{ACCUM_RESUME_AT}")
    config = run_config(dataset_dir, tmp_path, overrides=ACCUM_OVERRIDES)
    expected = _weights(tmp_path / "whole" / "checkpoints" / f"step_{ACCUM_STEPS}", config)
    got = _weights(resumed_dir / "checkpoints" / f"step_{ACCUM_STEPS}", config)
    start = _weights(resumed_dir / "checkpoints" / f"step_{ACCUM_RESUME_AT}", config)
    max_diff = max((got[name] - expected[name]).abs().max().item() for name in expected)
    trained = max((start[name] - expected[name]).abs().max().item() for name in expected)
    largest = max(w.abs().max().item() for w in expected.values())
    print(f"max |w_resumed - w_whole| = {max_diff:.3g} (largest |w| {largest:.3g}); "
          f"the resumed steps moved a weight by up to {trained:.3g}")  # fmt: skip
    assert max_diff <= ACCUM_TOLERANCE < trained / 100
    losses = {entry["step"]: entry["loss"] for entry in whole["losses"]}
    for entry in resumed["losses"]:  # the same data: the same losses, the mean over the global batch
        assert entry["loss"] == pytest.approx(losses[entry["step"]], rel=1e-5)

    # Another global batch would train on other data: the checkpoint is refused, in one line.
    with pytest.raises(TrainingFailed, match=r"global batch of 4 sequences but this run's is 2"):
        train(dataset_dir, resumed_dir, nproc=1, steps=ACCUM_STEPS + 1, overrides=("data.batch_size=2",),
              checkpoint_mode="sync")  # fmt: skip
