import math
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.make_checkpoint import save_checkpoint
from components.validate_checkpoint.validate import report_markdown, validate_checkpoint
from trainer.checkpointing.storage import (
    CheckpointError,
    commit,
    prepare_staging,
    rank_state,
)
from trainer.config import build_config
from trainer.models import model_spec


def test_trained_checkpoint_passes_and_scores_deterministically(trained_run, dataset_dir):
    result = validate_checkpoint(trained_run["checkpoint"], str(dataset_dir), max_loss=10.0)
    assert result.decision == "champion"
    assert result.step == 20
    assert 0 < result.holdout_loss < 5.5  # better than uniform bytes (ln 256 = 5.55)
    assert result.perplexity == pytest.approx(torch.tensor(result.holdout_loss).exp().item(), rel=1e-5)
    # a byte is a token: bits per byte is nats per token / ln 2, over as many bytes as tokens
    assert result.evaluated_bytes == result.evaluated_tokens > 0
    assert result.holdout_bits_per_byte == pytest.approx(result.holdout_loss / math.log(2), rel=1e-9)
    assert result.holdout_nats_per_byte == pytest.approx(result.holdout_loss, rel=1e-9)
    again = validate_checkpoint(trained_run["checkpoint"], str(dataset_dir), max_loss=10.0)
    assert again.holdout_loss == result.holdout_loss
    assert "champion" in report_markdown(result)


def test_loss_above_threshold_is_rejected_with_the_reason(trained_run, dataset_dir):
    result = validate_checkpoint(trained_run["checkpoint"], str(dataset_dir), max_loss=0.01)
    assert result.decision == "reject"
    assert any("> max_loss 0.01" in reason for reason in result.reasons)


def test_later_checkpoint_beats_earlier(trained_run, dataset_dir):
    early = trained_run["checkpoint"].replace("step_20", "step_10")
    early_loss = validate_checkpoint(early, str(dataset_dir), 10.0).holdout_loss
    late_loss = validate_checkpoint(trained_run["checkpoint"], str(dataset_dir), 10.0).holdout_loss
    assert late_loss < early_loss


def test_corrupted_file_is_named(trained_run, dataset_dir, tmp_path):
    copy = tmp_path / "step_20"
    shutil.copytree(trained_run["checkpoint"], copy)
    shard = next(copy.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        validate_checkpoint(str(copy), str(dataset_dir), 10.0)


def test_non_finite_tensor_is_named(single_rank_group, dataset_dir, tmp_path):
    config = build_config("tiny-cpu")
    model = model_spec("byte-lm").build(config.model, torch.device("cpu"))
    with torch.no_grad():
        model.blocks[0].mlp_in.weight[0, 0] = float("nan")
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, 1, model, optimizer, meta={"config": config.to_dict()}, rank_extra={})
    with pytest.raises(CheckpointError, match=r"blocks\.0\.mlp_in\.weight"):
        validate_checkpoint(str(tmp_path / "step_1"), str(dataset_dir), 10.0)


def _save_tiny(tmp_path, model_overrides=()):
    """A one-rank checkpoint whose meta.json says tiny-cpu, with weights from `model_overrides`."""
    config = build_config("tiny-cpu")
    model = model_spec("byte-lm").build(
        build_config("tiny-cpu", list(model_overrides)).model, torch.device("cpu")
    )
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, 1, model, optimizer, meta={"config": config.to_dict()}, rank_extra={})
    return str(tmp_path / "step_1")


def test_missing_shard_is_named(trained_run, dataset_dir, tmp_path):
    copy = tmp_path / "step_20"
    shutil.copytree(trained_run["checkpoint"], copy)
    shard = next(copy.glob("*.distcp"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name} is listed in the manifest but missing"):
        validate_checkpoint(str(copy), str(dataset_dir), 10.0)


def test_shapes_that_do_not_fit_the_config_are_named(single_rank_group, dataset_dir, tmp_path):
    checkpoint_dir = _save_tiny(tmp_path, ["model.d_model=32"])
    with pytest.raises(
        CheckpointError, match=r"'tok_emb\.weight' has shape \[256, 32\], the model config gives"
    ):
        validate_checkpoint(checkpoint_dir, str(dataset_dir), 10.0)


def test_optimizer_state_is_required_only_when_resuming_is_intended(single_rank_group, dataset_dir, tmp_path):
    # A checkpoint holding only the model (as an export would): saved and committed with the
    # trainer's own storage functions, without the optimizer part.
    import torch.distributed.checkpoint as dcp

    config = build_config("tiny-cpu")
    model = model_spec("byte-lm").build(config.model, torch.device("cpu"))
    staging, final = prepare_staging(tmp_path, 1, rank_state({}))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(staging))
    commit(staging, final, 1, meta={"config": config.to_dict()})
    result = validate_checkpoint(str(final), str(dataset_dir), 10.0)
    assert result.decision == "champion"
    assert not any("optimizer state" in check for check in result.checks)
    with pytest.raises(CheckpointError, match=r"cannot be resumed: no optimizer state for \d+ parameter"):
        validate_checkpoint(str(final), str(dataset_dir), 10.0, require_optimizer_state=True)


def test_report_says_what_was_checked_the_numbers_and_why(trained_run, dataset_dir):
    result = validate_checkpoint(
        trained_run["checkpoint"], str(dataset_dir), 10.0, require_optimizer_state=True
    )
    report = report_markdown(result)
    assert "# Checkpoint validation: **champion**" in report
    assert "SHA-256 manifest" in report and "optimizer state present" in report
    assert "model tensors finite, read from the shards" in report
    assert "holdout scored by the training ranks" in report
    assert f"| holdout loss (nats/token) | {result.holdout_loss:.4f} |" in report
    assert f"| holdout loss (bits/byte) | {result.holdout_bits_per_byte:.4f} |" in report
    assert "there is no champion to beat" in report


def test_only_the_checkpoint_the_train_step_published_is_loaded(trained_run, dataset_dir):
    from trainer.checkpointing.storage import CheckpointError, manifest_sha256

    final = trained_run["checkpoint"]
    published = manifest_sha256(final)
    result = validate_checkpoint(final, str(dataset_dir), 10.0, published_manifest_sha256=published)
    assert "the manifest is the one the train step published" in result.checks
    earlier = final.replace("step_20", "step_10")  # another committed checkpoint, swapped in
    with pytest.raises(CheckpointError, match="not the checkpoint the train step published"):
        validate_checkpoint(earlier, str(dataset_dir), 10.0, published_manifest_sha256=published)


def test_the_final_checkpoint_is_decided_from_the_training_ranks_record(trained_run, dataset_dir):
    final = trained_run["checkpoint"]
    result = validate_checkpoint(final, str(dataset_dir), 10.0)
    assert result.scored_by == "training"
    # the weights hashed tensor by tensor from the shards are the ones the training ended with
    assert result.weights_sha256 == trained_run["model_sha256"]
    here = validate_checkpoint(final, str(dataset_dir), 10.0, eval_record="")
    assert here.scored_by == "validate"
    assert (here.evaluated_tokens, here.evaluated_bytes) == (result.evaluated_tokens, result.evaluated_bytes)
    assert here.holdout_loss == pytest.approx(result.holdout_loss, rel=1e-6)
    assert here.decision == result.decision


def test_the_record_of_the_final_step_is_not_used_for_an_earlier_checkpoint(trained_run, dataset_dir):
    early = validate_checkpoint(
        trained_run["checkpoint"].replace("step_20", "step_10"), str(dataset_dir), 10.0
    )
    assert early.scored_by == "validate"
    assert any("it scored step 20, the checkpoint is step 10" in check for check in early.checks)


def test_a_record_of_other_weights_or_windows_is_not_used(trained_run, dataset_dir, tmp_path):
    import json

    record = json.loads((Path(trained_run["checkpoint"]).parents[1] / "eval.json").read_text())
    for change, reason in (
        ({"model_sha256": "0" * 64}, "it scored weights with SHA-256 0000"),
        (
            {"holdout": {**record["holdout"], "windows_sha256": "f" * 64}},
            "its holdout differs in windows_sha256",
        ),
    ):
        path = tmp_path / "eval.json"
        path.write_text(json.dumps({**record, **change, "nats_total": 0.0}))
        result = validate_checkpoint(trained_run["checkpoint"], str(dataset_dir), 10.0, eval_record=str(path))
        assert result.scored_by == "validate" and result.holdout_loss > 0
        assert any(reason in check for check in result.checks)


def test_with_a_record_the_model_is_never_loaded_whole_and_without_one_a_large_model_is_refused(
    trained_run, dataset_dir, monkeypatch
):
    from trainer.checkpointing import storage

    def no_whole_model(*args, **kwargs):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(storage, "load_model_weights", no_whole_model)
    result = validate_checkpoint(trained_run["checkpoint"], str(dataset_dir), 10.0, max_in_process_bytes=1)
    assert result.scored_by == "training" and result.decision == "champion"
    with pytest.raises(
        CheckpointError, match=r"above the 0\.0 GiB bound .* train with data\.eval_windows > 0"
    ):
        validate_checkpoint(
            trained_run["checkpoint"], str(dataset_dir), 10.0, eval_record="", max_in_process_bytes=1
        )


def test_tensors_are_read_in_groups_within_the_byte_budget(trained_run, dataset_dir, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from components.validate_checkpoint.validate import check_model_tensors

    groups: list[tuple[int, int]] = []
    real_load = dcp.load

    def counting_load(state, **kwargs):
        groups.append((sum(t.numel() * t.element_size() for t in state.values()), len(state)))
        return real_load(state, **kwargs)

    monkeypatch.setattr(dcp, "load", counting_load)
    whole_sha, count = check_model_tensors(trained_run["checkpoint"], budget_bytes=1 << 30)
    assert len(groups) == 1
    groups.clear()
    budget = 64 * 1024
    sha, again = check_model_tensors(trained_run["checkpoint"], budget_bytes=budget)
    assert (sha, again) == (whole_sha, count) and len(groups) > 1
    # every read holds at most the budget, or one tensor larger than it
    assert all(size <= budget or tensors == 1 for size, tensors in groups)
    assert sum(tensors for _, tensors in groups) == count


def test_two_training_ranks_score_the_sharded_model_as_one_process_scores_the_checkpoint(
    plain_two_rank_run, dataset_dir
):
    from trainer.checkpointing.storage import read_meta
    from trainer.config import TrainConfig

    summary = plain_two_rank_run  # 2 ranks, the default eval windows
    config = TrainConfig.from_dict(read_meta(summary["checkpoint"])["config"])
    assert summary["world_size"] == 2 and config.data.eval_windows > 0
    result = validate_checkpoint(summary["checkpoint"], str(dataset_dir), 10.0)
    assert result.scored_by == "training" and result.weights_sha256 == summary["model_sha256"]
    here = validate_checkpoint(summary["checkpoint"], str(dataset_dir), 10.0, eval_record="")
    assert here.evaluated_tokens == result.evaluated_tokens == config.data.eval_windows * config.model.seq_len
    # each rank runs the full forward on every window: the same sums as one process, to rounding
    assert here.holdout_loss == pytest.approx(result.holdout_loss, rel=1e-6)


@pytest.mark.launches
def test_without_eval_windows_the_training_writes_no_record_and_validate_scores_in_process(
    dataset_dir, tmp_path
):
    from tests.distributed.conftest import run_training
    from trainer.config import resolve_config

    config = resolve_config(
        named={
            "dataset_dir": str(dataset_dir),
            "workdir": str(tmp_path),
            "steps": 2,
            "seed": 1,
            "checkpoint_mode": "sync",
        },
        overrides=["data.eval_windows=0"],
    )
    summary = run_training(1, config)
    assert not (tmp_path / "eval.json").exists()
    result = validate_checkpoint(summary["checkpoint"], str(dataset_dir), 10.0)
    assert result.scored_by == "validate"
    assert any(f"no eval.json in {tmp_path}" in check for check in result.checks)


def test_a_tied_head_checkpoint_is_resumable_and_loads_tied(single_rank_group, tmp_path):
    """An output head tied to the embeddings (SmolLM, Llama-3.2-1B) is one parameter: its
    optimizer state is stored once, and validation neither asks for a second one nor unties it."""
    from components.validate_checkpoint.validate import load_validated_model
    from tests.hf_tiny import write_tiny_model
    from trainer.config import ModelConfig, TrainConfig

    model_dir = write_tiny_model(tmp_path / "model", "llama", tie=True)
    config = TrainConfig(
        model=ModelConfig(kind="hf", model_dir=str(model_dir), init="pretrained", seq_len=16)
    )
    spec = model_spec("hf")
    model = spec.build(config.model, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    optimizer = torch.optim.AdamW(model.parameters())
    spec.loss(model, torch.arange(34).reshape(2, 17) % 200).backward()
    optimizer.step()
    save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, meta={"config": config.to_dict()}, rank_extra={})
    checks: list[str] = []
    loaded, _, _ = load_validated_model(
        tmp_path / "ckpt" / "step_1", require_optimizer_state=True, checks=checks
    )
    assert any("optimizer state present for every parameter" in line for line in checks)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
