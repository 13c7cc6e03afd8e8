import json

import pytest

from trainer.config import PRESETS, ConfigError, TrainConfig, build_config, parse_overrides

# What sets each preset apart: model shape (seq_len, d_model, n_layers, n_heads), batch size,
# learning rate and warm-up, checkpoint interval, and the byte LM's architecture hash, pinned so
# a change to how a config is hashed cannot silently orphan existing checkpoints.
PRESET_VALUES = {
    "tiny-cpu": ((64, 64, 2, 4), 8, (3e-3, 5), 10, "477aa9c49448a063"),
    "small-cpu": ((128, 128, 4, 4), 8, (3e-3, 5), 10, "5d2afb00d0a3d3d7"),
    "bench-cpu": ((64, 640, 5, 8), 2, (3e-3, 5), 10, "97a7e315e3d464be"),
    "gpu-1b": ((1024, 2048, 20, 16), 4, (3e-4, 100), 500, "3ae6d2ce67847037"),
    "gpu-125m": ((1024, 768, 12, 12), 16, (6e-4, 200), 500, "017f22ab66a45c0a"),
}


def test_every_preset_builds_and_validates():
    assert set(PRESETS) == set(PRESET_VALUES), "a preset was added or removed: list its values here"
    for name, (shape, batch_size, (lr, warmup_steps), every_steps, model_hash) in PRESET_VALUES.items():
        config = build_config(name)
        model = config.model
        assert (model.kind, model.vocab_size) == ("byte-lm", 256), name
        assert (model.seq_len, model.d_model, model.n_layers, model.n_heads) == shape, name
        assert config.data.batch_size == batch_size, name
        assert (config.optimizer.lr, config.optimizer.warmup_steps) == (lr, warmup_steps), name
        assert config.checkpoint.every_steps == every_steps, name
        assert config.run.steps == 40, name
        assert config.model_hash() == model_hash, name
        # Written to <run>/train/config.json and passed to job pods as --config=<compact JSON>.
        assert TrainConfig.from_json(config.to_json()) == config, name
        assert TrainConfig.from_json(config.to_compact_json()) == config, name
        assert TrainConfig.from_json(config.to_json()).to_json() == config.to_json(), name
    hashes = [values[-1] for values in PRESET_VALUES.values()]
    assert len(set(hashes)) == len(hashes), "two presets share an architecture"


def test_overrides_set_typed_values():
    config = build_config(
        "tiny-cpu", ["optimizer.lr=0.01", "model.n_layers=3", "checkpoint.verify_hashes=true"]
    )
    assert config.optimizer.lr == 0.01
    assert config.model.n_layers == 3
    assert config.checkpoint.verify_hashes is True


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.lrr=1", "optimizer has"),
        ("nosuch.x=1", "sections are"),
        ("model.n_layers=two", "must be int"),
        ("model.n_heads=5", "divisible"),
        ("model.n_heads=0", "at least 1"),
        ("run.steps=0", "at least 1"),
        ("optimizer.lr", "not key=value"),
        ("checkpoint.mode=fast", "off, sync, async"),
        ("checkpoint.mode=torch-async", "checkpoint.mode=sync with checkpoint.writer=benchmarks.torch_async"),
        ("checkpoint.writer=TorchAsyncWriter", "must be module:Class"),
        ("checkpoint.keep_every_steps=-1", "keep_every_steps"),
        ("data.eval_every_steps=-1", "eval_every_steps"),
    ],
)
def test_bad_overrides_name_the_problem(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config("tiny-cpu", [override])


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="tiny-cpu"):
        build_config("huge")


def test_json_round_trip_keeps_every_field():
    config = build_config("small-cpu", ["run.seed=7", "data.holdout_fraction=0.2"])
    restored = TrainConfig.from_dict(json.loads(config.to_json()))
    assert restored == config
    assert restored.model_hash() == config.model_hash()


def test_model_hash_changes_with_architecture_only():
    base = build_config("tiny-cpu")
    assert build_config("tiny-cpu", ["run.seed=9"]).model_hash() == base.model_hash()
    assert build_config("tiny-cpu", ["model.d_model=32"]).model_hash() != base.model_hash()


def test_parse_overrides_accepts_spaces_and_commas():
    assert parse_overrides(" a.b=1, c.d=2  e.f=3 ") == ["a.b=1", "c.d=2", "e.f=3"]
    assert parse_overrides("") == []


def test_a_validation_pass_needs_holdout_windows_to_score():
    with pytest.raises(ConfigError, match=r"needs data\.eval_windows of at least 1"):
        build_config("tiny-cpu", ["data.eval_every_steps=10", "data.eval_windows=0"])
    assert build_config("tiny-cpu", ["data.eval_every_steps=10"]).data.eval_every_steps == 10
