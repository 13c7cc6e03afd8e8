"""What the Kubeflow UI shows: task names that read as sentences, parameters that explain
themselves and whose defaults make a run that starts."""

from pathlib import Path

import pytest
import yaml

from components.train.train import TrainRequest
from pipelines.pipeline import compile_pipeline
from rtp_cli import kfp_checks
from trainer.arguments import PIPELINE_SETTINGS


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> dict:
    path = compile_pipeline(str(tmp_path_factory.mktemp("ui") / "pipeline.yaml"))
    return next(doc for doc in yaml.safe_load_all(Path(path).read_text()) if doc)


def _task_names(spec: dict) -> list[str]:
    dags = [spec["root"]["dag"]] + [c["dag"] for c in spec["components"].values() if "dag" in c]
    return [task["taskInfo"]["name"] for dag in dags for task in dag["tasks"].values()]


def test_every_task_name_reads_as_a_sentence(spec):
    names = _task_names(spec)
    # check, stage data, stage model, train, validate, the condition, register, retain runs,
    # the exit handler's group and its cleanup
    assert len(names) == 10
    for name in names:
        words = name.split()
        assert len(words) >= 4, f"{name!r} is too short to say what happens"
        assert words[0][0].isupper() and words[0].isalpha(), f"{name!r} should start with a capitalised word"
        assert "-" not in words[0] and "_" not in name, f"{name!r} reads like an identifier"


def test_every_parameter_default_is_accepted_and_makes_a_valid_training_config(spec):
    parameters = kfp_checks.pipeline_parameters(spec)
    defaults = {}
    for name, parameter in parameters.items():
        assert parameter.description, f"{name} has no description"
        value = parameter.default
        if parameter.parameter_type == "NUMBER_INTEGER":
            assert float(value).is_integer(), name
            value = int(value)
        defaults[name] = kfp_checks.check_allowed_value(name, value)
    # The defaults a user sees in the UI make a valid training config.
    TrainRequest(
        dataset_dir="d",
        run_folder=Path("r"),
        preset=defaults["preset"],
        overrides=defaults["overrides"],
        settings={name: defaults[name] for name in PIPELINE_SETTINGS},
    ).config()
    assert defaults["source"].startswith("s3://")
