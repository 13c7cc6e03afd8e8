"""The train contract: one config tree, flags generated from it, one way to resolve input,
one serialized config handed to the ranks, one typed summary back."""

import argparse
import dataclasses

import pytest

from components.train.train import TrainRequest
from trainer.arguments import PIPELINE_SETTINGS, add_training_arguments, config_from_args
from trainer.config import CHECKPOINT_MODES, ConfigError, TrainConfig, named_settings, resolve_config
from trainer.summary import TrainSummary


def parse(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_every_named_setting_has_a_flag_with_the_field_docstring_as_help():
    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    actions = {action.dest: action for action in parser._actions}
    for param, setting in named_settings().items():
        assert setting.help, f"{setting.key} has no docstring"
        assert actions[param].help.startswith(setting.help.replace("%", "%%")), param
        assert f"[config {setting.key}]" in actions[param].help
    assert tuple(actions["checkpoint_mode"].choices) == CHECKPOINT_MODES
    assert set(PIPELINE_SETTINGS) <= set(named_settings())


def test_command_line_and_pipeline_resolve_to_the_same_config(tmp_path):
    from_cli = parse(
        "--dataset-dir=d", f"--workdir={tmp_path}/train", f"--checkpoint-dir={tmp_path}/checkpoints",
        "--steps=7", "--checkpoint-every=3", "--checkpoint-mode=sync", "--seed=5",
        "--fault=exception@2", "--fault=hang@4:1", "--override=optimizer.lr=0.01",
    )  # fmt: skip
    from_pipeline = TrainRequest(
        dataset_dir="d",
        run_folder=tmp_path,
        overrides="optimizer.lr=0.01",
        settings={
            "steps": 7, "checkpoint_every": 3, "checkpoint_mode": "sync", "seed": 5,
            "faults": "exception@2,hang@4:1",
        },
    ).config()  # fmt: skip
    assert from_cli == from_pipeline
    assert from_cli.run.faults == "exception@2,hang@4:1" and from_cli.optimizer.lr == 0.01


@pytest.mark.parametrize(
    "override", ["run.steps=5", "checkpoint.every_steps=2", "checkpoint.mode=sync", "run.faults=hang@1"]
)
def test_overrides_cannot_set_a_field_that_has_its_own_parameter(override):
    with pytest.raises(ConfigError, match="its own parameter"):
        resolve_config(named={"steps": 10}, overrides=[override])


@pytest.mark.parametrize("override", ["checkpoint.dir=/fsx/rtp/runs/other/checkpoints", "run.workdir=/x"])
def test_overrides_cannot_move_paths(tmp_path, override):
    request = TrainRequest(dataset_dir="d", run_folder=tmp_path, overrides=override)
    with pytest.raises(ConfigError, match="a path"):
        request.config()


def test_the_pipeline_faults_default_none_means_no_faults(tmp_path):
    config = TrainRequest(dataset_dir="d", run_folder=tmp_path, settings={"faults": "none"}).config()
    assert config.run.faults == ""
    assert config.checkpoint_dir() == str(tmp_path / "checkpoints")


def test_config_file_and_inline_json_carry_the_whole_config(tmp_path):
    config = resolve_config(named={"dataset_dir": "d", "steps": 9}, overrides=["model.n_layers=3"])
    path = config.write(tmp_path / "config.json")
    assert parse(f"--config={path}") == config
    assert parse(f"--config={config.to_compact_json()}") == config
    with pytest.raises(ConfigError, match="--steps"):
        parse(f"--config={path}", "--steps=3")
    with pytest.raises(ConfigError, match="cannot read"):
        parse(f"--config={tmp_path / 'missing.json'}")
    with pytest.raises(ConfigError, match="must be JSON"):
        parse("--config={not json")


def test_a_bad_config_file_is_checked_like_flags(tmp_path):
    raw = TrainConfig().to_dict()
    raw["model"]["n_heads"] = 5
    (tmp_path / "config.json").write_text(TrainConfig.from_dict(raw).to_json())
    with pytest.raises(ConfigError, match="divisible"):
        TrainConfig.read(tmp_path / "config.json")


def test_summary_round_trips_and_refuses_unknown_fields(tmp_path):
    summary = TrainSummary(
        steps=4, target_steps=4, completed=True, stopped_by_signal=False, steps_run=4, final_loss=1.5,
        losses=[{"step": 4, "loss": 1.5}], checkpoint="/c/step_4", checkpoint_mode="sync", resumed_from=None,
        checkpoint_saves=[], checkpoint_blocked_s=0.1, efficiency_pct=99.0, final_drain_s=0.0,
        checkpointer_start_s=0.0, checkpointer_teardown_s=0.0, loop_wall_s=2.0, world_size=2, device="cpu",
        model_sha256="ab" * 32, train_seconds=1.0, wall_seconds=3.0, restarts=[{"kind": "hang"}], lost_steps=2,
    )  # fmt: skip
    summary.write(tmp_path / "summary.json")
    assert TrainSummary.read(tmp_path / "summary.json") == summary
    with pytest.raises(ValueError, match="unknown fields"):
        TrainSummary.from_dict({**dataclasses.asdict(summary), "surprise": 1})


def test_pipeline_defaults_come_from_the_config():
    import inspect

    from pipelines.pipeline import build_pipeline

    signature = inspect.signature(build_pipeline().pipeline_func)
    for param in PIPELINE_SETTINGS:
        default = signature.parameters[param].default
        expected = named_settings()[param].default
        assert default == expected or (param == "faults" and default in ("", "none")), param


def test_a_run_folder_finished_in_another_run_is_refused_unless_it_trains_further(tmp_path):
    import json

    from components.train.train import FinishedRun, refuse_finished_run

    folder = tmp_path / "nightly"
    refuse_finished_run(folder, "run-1", 40)  # a new folder
    (folder / "steps").mkdir(parents=True)
    (folder / "steps" / "train.json").write_text(json.dumps({"steps": 40, "kfp_run_id": "run-1"}))
    refuse_finished_run(folder, "run-1", 40)  # a retry of the run that finished it resumes
    refuse_finished_run(folder, "run-2", 60)  # more steps: it continues from its checkpoint
    with pytest.raises(
        FinishedRun, match=r"'nightly' finished training at step 40 in KFP run run-1.*new run_name"
    ):
        refuse_finished_run(folder, "run-2", 40)
    (folder / "steps" / "train.json").write_text(json.dumps({"steps": 40}))  # no run id recorded
    with pytest.raises(FinishedRun, match="an earlier pipeline run"):
        refuse_finished_run(folder, "run-1", 30)
    (folder / "steps" / "train.json").write_text("{")
    with pytest.raises(FinishedRun, match="cannot be read"):
        refuse_finished_run(folder, "run-1", 30)
