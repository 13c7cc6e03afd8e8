"""LoRA (`training.method=lora`) on 2 ranks through the real trainer: every recovery path ends
with the uninterrupted run's adapters — stop and resume, an exception (in-process restart)
and a killed rank (launcher restart) in one run, and a resume on one rank — and the
checkpoints hold the adapters only. In-process checks of the same (base bit-identical,
refusal against another base, export) are tests/unit/test_lora.py's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainer.lora import is_adapter

pytestmark = pytest.mark.timeout(300)

FAST = ["resilience.collective_timeout_s=5", "resilience.soft_timeout_s=8", "resilience.hard_timeout_s=30"]
LORA = ["model.seq_len=32", "training.lora_rank=4", "optimizer.lr=1e-2", *FAST]


@pytest.fixture(scope="module")
def lora_inputs(tmp_path_factory):
    """A tiny pretrained Llama with its head tied to the embeddings, and tokens for it."""
    from tests.hf_tiny import write_corpus, write_tiny_model, write_token_snapshot

    root = tmp_path_factory.mktemp("lora-run")
    model_dir = write_tiny_model(root / "model", "llama", tie=True)
    snapshot = write_token_snapshot(
        write_corpus(root / "corpus", documents=120), model_dir, root / "snapshot"
    )
    return snapshot, {"model_dir": str(model_dir), "model_init": "pretrained", "training_method": "lora"}


@pytest.fixture(scope="module")
def lora_workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora-full")


@pytest.fixture(scope="module")
def lora_uninterrupted(lora_inputs, lora_workdir) -> dict:
    """6 LoRA steps on 2 ranks, async checkpoints (the default) every 3."""
    from tests.distributed.conftest import train

    snapshot, named = lora_inputs
    return train(snapshot, lora_workdir, steps=6, every=3, overrides=LORA, **named)


@pytest.mark.launches
def test_lora_checkpoints_hold_the_adapters_and_validate(lora_inputs, lora_uninterrupted):
    from components.validate_checkpoint.validate import stored_tensor_shapes, validate_checkpoint

    snapshot, _ = lora_inputs
    summary = lora_uninterrupted
    assert summary["completed"] and summary["world_size"] == 2 and summary["checkpoint_mode"] == "async"
    losses = [entry["loss"] for entry in summary["losses"]]
    assert losses[-1] < losses[0]
    keys = stored_tensor_shapes(summary["checkpoint"])
    model_keys = [k.removeprefix("model.") for k in keys if k.startswith("model.")]
    assert model_keys and all(is_adapter(k) for k in model_keys)
    assert all(is_adapter(k) for k in keys if k.startswith("optim.state."))
    result = validate_checkpoint(
        summary["checkpoint"], str(snapshot), max_loss=100.0, require_optimizer_state=True
    )
    assert result.weights_sha256 == summary["model_sha256"]


@pytest.mark.launches
def test_lora_stopped_and_resumed_ends_with_the_uninterrupted_adapters(
    lora_inputs, lora_uninterrupted, tmp_path
):
    from tests.distributed.conftest import train

    snapshot, named = lora_inputs
    first = train(
        snapshot, tmp_path, steps=6, every=3, overrides=LORA, checkpoint_mode="sync", stop_after=3, **named
    )
    assert first["steps"] == 3
    resumed = train(snapshot, tmp_path, steps=6, every=3, overrides=LORA, checkpoint_mode="sync", **named)
    assert resumed["resumed_from"].endswith("step_3")
    assert resumed["model_sha256"] == lora_uninterrupted["model_sha256"]


@pytest.mark.launches
def test_lora_faults_recover_the_uninterrupted_adapters(lora_inputs, lora_uninterrupted, tmp_path):
    """An exception (in-process restart, from the fast tier's adapters) and a killed rank
    (launcher restart) in one run."""
    from tests.distributed.conftest import restart_story, train

    snapshot, named = lora_inputs
    summary = train(
        snapshot, tmp_path, steps=6, every=3, overrides=LORA, faults=["exception@2:1", "sigkill@5:0"], **named
    )
    assert summary["completed"]
    assert summary["model_sha256"] == lora_uninterrupted["model_sha256"]
    assert [(r["kind"], r["mechanism"]) for r in summary["restarts"]] == [
        ("exception", "inprocess"),
        ("sigkill", "launcher"),
    ], restart_story(summary, tmp_path)


@pytest.mark.launches
def test_a_lora_checkpoint_reshards_from_two_ranks_to_one(
    lora_inputs, lora_uninterrupted, lora_workdir, tmp_path
):
    from tests.distributed.conftest import train

    snapshot, named = lora_inputs
    shutil.copytree(lora_workdir, tmp_path, dirs_exist_ok=True)
    # Resuming at the target step runs no step: the adapters are exactly what was loaded.
    loaded = train(
        snapshot, tmp_path, nproc=1, steps=6, every=3, overrides=[*LORA, "data.global_batch=16"], **named
    )
    assert loaded["world_size"] == 1 and loaded["steps_run"] == 0
    assert loaded["resumed_from"].endswith("step_6")
    assert loaded["model_sha256"] == lora_uninterrupted["model_sha256"]
