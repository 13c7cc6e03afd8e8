import json

import pytest

from trainer.config import PRESETS, ConfigError, TrainConfig, build_config, parse_overrides


def test_every_preset_builds_and_validates():
    for name in PRESETS:
        config = build_config(name)
        assert config.model.d_model % config.model.n_heads == 0


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
        ("checkpoint.mode=fast", "torch-async"),
        ("checkpoint.keep_every_steps=-1", "keep_every_steps"),
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
