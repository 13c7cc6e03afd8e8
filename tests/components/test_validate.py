import shutil

import pytest
import torch

from components.validate_checkpoint.validate import report_markdown, validate_checkpoint
from trainer.checkpoint import CheckpointError, save_checkpoint
from trainer.config import build_config
from trainer.model import ByteLM


def test_trained_checkpoint_passes_and_scores_deterministically(trained_run, dataset_dir):
    result = validate_checkpoint(trained_run["checkpoint"], str(dataset_dir), max_loss=10.0)
    assert result.decision == "champion"
    assert result.step == 20
    assert 0 < result.holdout_loss < 5.5  # better than uniform bytes (ln 256 = 5.55)
    assert result.perplexity == pytest.approx(torch.tensor(result.holdout_loss).exp().item(), rel=1e-5)
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
    model = ByteLM(config.model)
    with torch.no_grad():
        model.blocks[0].mlp_in.weight[0, 0] = float("nan")
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, 1, model, optimizer, meta={"config": config.to_dict()}, rank_extra={})
    with pytest.raises(CheckpointError, match=r"blocks\.0\.mlp_in\.weight"):
        validate_checkpoint(str(tmp_path / "step_1"), str(dataset_dir), 10.0)
