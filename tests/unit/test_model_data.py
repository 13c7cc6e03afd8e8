import math

import pytest
import torch

from trainer.config import ConfigError, ModelConfig, TrainConfig, validate
from trainer.data import DataError, StepSampler, holdout_batches, load_tokens, split_files
from trainer.models import model_spec
from trainer.models.byte_lm import generate, next_token_loss


def test_untrained_model_predicts_near_uniform_bytes():
    torch.manual_seed(0)
    model = model_spec("byte-lm").build(ModelConfig(), torch.device("cpu"))
    batch = torch.randint(0, 256, (4, 65))
    assert model(batch[:, :-1]).shape == (4, 64, 256)
    assert abs(next_token_loss(model, batch).item() - math.log(256)) < 0.3


def test_generate_returns_the_requested_number_of_bytes():
    model = model_spec("byte-lm").build(ModelConfig(), torch.device("cpu"))
    assert len(generate(model, b"def ", max_new_tokens=7)) == 7
    assert len(generate(model, b"", max_new_tokens=3, temperature=1.0)) == 3


def test_split_is_deterministic_disjoint_and_complete(dataset_dir):
    train, holdout = split_files(dataset_dir, 0.1)
    again_train, again_holdout = split_files(dataset_dir, 0.1)
    assert [f.key for f in train] == [f.key for f in again_train]
    assert [f.key for f in holdout] == [f.key for f in again_holdout]
    assert train and holdout
    assert not {f.key for f in train} & {f.key for f in holdout}


def test_sampler_batch_depends_only_on_step_and_rank(dataset_dir):
    tokens = load_tokens(split_files(dataset_dir, 0.1)[0])
    a = StepSampler(tokens, seq_len=16, batch_size=4, seed=1, rank=0, world_size=2)
    b = StepSampler(tokens, seq_len=16, batch_size=4, seed=1, rank=0, world_size=2)
    other_rank = StepSampler(tokens, seq_len=16, batch_size=4, seed=1, rank=1, world_size=2)
    assert torch.equal(a.batch(5), b.batch(5))  # a resumed loader replays the same batch
    assert not torch.equal(a.batch(5), a.batch(6))
    assert not torch.equal(a.batch(5), other_rank.batch(5))
    assert a.batch(5).shape == (4, 17)
    assert a.global_batch == 8 and a.accum_steps == 1  # auto: batch_size x world size


def test_the_global_batch_and_its_micro_batches_are_the_same_on_1_2_and_4_ranks(dataset_dir):
    tokens = load_tokens(split_files(dataset_dir, 0.1)[0])
    for step in (1, 2, 7):
        per_world = {}
        for world in (1, 2, 4):
            ranks = [StepSampler(tokens, 16, 2, seed=3, rank=r, world_size=world, global_batch=8)
                     for r in range(world)]  # fmt: skip
            assert {s.accum_steps for s in ranks} == {8 // (2 * world)}
            micro = [m for s in ranks for m in s.micro_batches(step)]
            assert all(m.shape == (2, 17) for m in micro)
            per_world[world] = torch.cat(micro)
            assert torch.equal(per_world[world], torch.cat([s.batch(step) for s in ranks]))
        assert torch.equal(per_world[1], per_world[2]) and torch.equal(per_world[1], per_world[4])
        assert len({tuple(row.tolist()) for row in per_world[1]}) > 1  # 8 different windows, not one


def test_a_global_batch_that_does_not_split_over_the_ranks_names_the_numbers(dataset_dir):
    tokens = load_tokens(split_files(dataset_dir, 0.1)[0])
    with pytest.raises(
        ConfigError, match=r"data.global_batch 6 is not a multiple of data.batch_size 2 x 2 ranks = 4: set"
    ):
        StepSampler(tokens, 16, 2, seed=0, rank=0, world_size=2, global_batch=6)
    config = TrainConfig()
    config.data.batch_size, config.data.global_batch = 4, 6
    with pytest.raises(
        ConfigError, match=r"data.global_batch \(6\) must be 0 .* multiple of data.batch_size \(4\)"
    ):
        validate(config)
    config.data.global_batch = 8
    validate(config)


def test_a_checkpoint_of_another_global_batch_is_refused(dataset_dir):
    tokens = load_tokens(split_files(dataset_dir, 0.1)[0])
    saved = StepSampler(tokens, 16, 2, seed=0, rank=0, world_size=2).state_dict(next_step=4)
    assert saved["global_batch"] == 4
    StepSampler(tokens, 16, 2, seed=0, rank=0, world_size=1, global_batch=4).check_resumable(saved, "ckpt")
    StepSampler(tokens, 16, 2, seed=0, rank=0).check_resumable({}, "ckpt")  # saved before global_batch
    with pytest.raises(
        DataError,
        match=r"ckpt was trained with a global batch of 4 sequences but this run's is 2 .*data.global_batch=4",
    ):
        StepSampler(tokens, 16, 2, seed=0, rank=0, world_size=1).check_resumable(saved, "ckpt")


def test_holdout_batches_cover_the_holdout_evenly():
    tokens = torch.arange(1000, dtype=torch.uint8)
    batches = holdout_batches(tokens, seq_len=9, max_windows=20, batch_size=8)
    rows = torch.cat(batches)
    assert rows.shape == (20, 10)
    assert rows[0, 0] == 0 and rows[-1, -1] == tokens[-1]


def test_missing_manifest_says_what_to_do(tmp_path):
    with pytest.raises(DataError, match="rtp stage"):
        split_files(tmp_path, 0.1)


def test_dataset_needs_two_files(tmp_path):
    (tmp_path / "a").write_text("x" * 100)
    (tmp_path / "manifest.json").write_text('{"files": [{"key": "a", "size": 100, "etag": "", "path": "a"}]}')
    with pytest.raises(DataError, match="at least 2"):
        split_files(tmp_path, 0.1)
