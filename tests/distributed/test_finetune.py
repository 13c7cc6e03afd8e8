"""Fine-tuning on conversations through the real trainer (2 ranks, a tied tiny Llama with a
ChatML template): `data.format=examples` trains on the assistant's tokens only, a run
stopped and resumed, and one recovered from an exception and a killed rank, end with the
uninterrupted run's weights; the training's eval record scores the holdout conversations'
assistant tokens, and the validate step uses it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.hf_tiny import write_tiny_model
from tests.unit.test_examples_data import CHATML, CONVERSATIONS

pytestmark = [pytest.mark.timeout(300), pytest.mark.launches]

FAST = ["resilience.collective_timeout_s=5", "resilience.soft_timeout_s=8", "resilience.hard_timeout_s=30"]
# 8 examples a step over 2 ranks, micro-batches of 2 rows: packing makes the row count vary by step.
SETTINGS = ["model.seq_len=127", "data.batch_size=2", "data.global_batch=8", *FAST]


@pytest.fixture(scope="module")
def chat_inputs(tmp_path_factory):
    from rtp_support.demo_data import write_local_manifest
    from trainer.chat_data import write_example_shards

    root = tmp_path_factory.mktemp("finetune")
    model_dir = write_tiny_model(root / "model", "llama", tie=True)
    (model_dir / "chat_template.jinja").write_text(CHATML)  # the tokenizer's own template
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS))
    write_example_shards(root / "chat.jsonl", root / "snapshot" / "files", model_dir)
    snapshot = write_local_manifest(root / "snapshot", key_prefix="chat/", snapshot_id="test-chat")
    named = {"model_dir": str(model_dir), "model_init": "pretrained", "data_format": "examples"}
    return snapshot, named


@pytest.fixture(scope="module")
def uninterrupted(chat_inputs, tmp_path_factory) -> dict:
    from tests.distributed.conftest import train

    snapshot, named = chat_inputs
    work = tmp_path_factory.mktemp("finetune-full")
    return train(snapshot, work, steps=6, every=3, overrides=SETTINGS, checkpoint_mode="sync", **named)


def test_examples_train_resume_exactly_and_validate_on_assistant_tokens(chat_inputs, uninterrupted, tmp_path):
    from components.validate_checkpoint.validate import validate_checkpoint
    from tests.distributed.conftest import train

    snapshot, named = chat_inputs
    full = uninterrupted
    assert full["completed"] and full["world_size"] == 2
    losses = [entry["loss"] for entry in full["losses"]]
    assert losses[-1] < losses[0]
    first = train(
        snapshot,
        tmp_path,
        steps=6,
        every=3,
        overrides=SETTINGS,
        checkpoint_mode="sync",
        stop_after=3,
        **named,
    )
    assert first["steps"] == 3
    resumed = train(snapshot, tmp_path, steps=6, every=3, overrides=SETTINGS, checkpoint_mode="sync", **named)
    assert resumed["resumed_from"].endswith("step_3")
    assert resumed["model_sha256"] == full["model_sha256"]

    record = json.loads((Path(full["checkpoint"]).parent.parent / "eval.json").read_text())
    assert record["holdout"]["format"] == "examples"
    # only the holdout conversations' assistant tokens are scored
    index = json.loads((snapshot / "files" / "index.json").read_text())
    held = [s for s in index["shards"] if s["split"] == "holdout"]
    assert 0 < record["tokens"] < sum(s["tokens"] for s in held)
    validation = validate_checkpoint(
        full["checkpoint"], str(snapshot), max_loss=100.0, require_optimizer_state=True
    )
    assert validation.scored_by == "training" and validation.evaluated_tokens == record["tokens"]
    in_process = validate_checkpoint(full["checkpoint"], str(snapshot), max_loss=100.0, eval_record="")
    assert in_process.scored_by == "validate"
    assert in_process.holdout_loss == pytest.approx(validation.holdout_loss, rel=1e-5)


def test_examples_recover_exactly_from_an_exception_and_a_killed_rank(chat_inputs, uninterrupted, tmp_path):
    from tests.distributed.conftest import restart_story, train

    snapshot, named = chat_inputs
    summary = train(
        snapshot,
        tmp_path,
        steps=6,
        every=3,
        overrides=SETTINGS,
        checkpoint_mode="sync",
        faults=["exception@2:1", "sigkill@5:0"],
        **named,
    )
    assert summary["completed"]
    assert summary["model_sha256"] == uninterrupted["model_sha256"], restart_story(summary, tmp_path)
    assert [r["kind"] for r in summary["restarts"]] == ["exception", "sigkill"], restart_story(
        summary, tmp_path
    )


def test_example_shards_are_refused_by_the_token_format(chat_inputs, tmp_path):
    """data.format=tokens would train on every token of the conversations: refused in one line
    (the other way round, tests/unit/test_examples_data.py)."""
    from tests.distributed.conftest import train
    from trainer.launch import TrainingFailed

    snapshot, named = chat_inputs
    tokens_named = {**named, "data_format": "tokens"}
    with pytest.raises(TrainingFailed) as failure:
        train(
            snapshot,
            tmp_path / "a",
            steps=2,
            every=2,
            overrides=SETTINGS,
            **tokens_named,
        )
    assert "holds example shards" in str(failure.value) and "data.format=examples" in str(failure.value)
