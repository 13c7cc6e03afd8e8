"""The run's parameters are checked in one place, before anything is staged."""

import sys

import pytest

from components.check_run.parameters import RunParameterError, check_run_parameters, normalized

GOOD = {
    "source": "s3://rtp-demo/corpus/",
    "model_source": "",
    "run_name": "",
    "dataset_name": "demo-corpus",
    "steps": 40,
    "checkpoint_every": 10,
    "checkpoint_mode": "async",
    "seed": 1234,
    "preset": "tiny-cpu",
    "overrides": "",
    "faults": "none",
    "model_init": "pretrained",
    "model_name": "rtp-byte-lm",
    "launcher": "inpod",
    "nproc": 2,
    "nnodes": 1,
    "gpus_per_node": 0,
    "efa_per_node": 0,
    "job_timeout_s": 86400,
    "gpu_node_selector": {},
    "gpu_tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "mlflow_secret_name": "mlflow-credentials",
}


@pytest.mark.parametrize("model_source", ["", "models:/rtp-model@champion"])
def test_the_defaults_pass_and_the_check_imports_no_heavy_library(model_source):
    values = {**GOOD, "model_source": model_source}
    check_run_parameters(values)
    import subprocess

    code = (
        "import sys; from components.check_run.parameters import check_run_parameters as c; "
        f"c({values!r}); sys.exit(1 if {{'torch', 'kfp', 'mlflow'}} & set(sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"run_name": "../../x"}, "run_name"),
        ({"run_name": "nightly\n"}, "run_name"),
        ({"launcher": "k8s"}, "launcher 'k8s'"),
        ({"checkpoint_every": -5}, "checkpoint.every_steps must be at least 1"),
        ({"job_timeout_s": 0}, "job_timeout_s must be"),
        ({"model_name": "a' or name != '"}, "model_name"),
        ({"gpu_node_selector": {"pool": {"nested": "x"}}}, "gpu_node_selector"),
        ({"gpu_tolerations": [1]}, "gpu_tolerations"),
        ({"source": "/data/corpus"}, "s3://bucket/prefix"),
        ({"model_source": "hf://meta-llama/x"}, "model_source"),
        ({"model_source": "models:/rtp-model"}, r"not a registry reference: write models:/<name>@<alias>"),
        ({"overrides": "checkpoint.dir=/fsx/rtp/runs/nightly/checkpoints"}, "is refused"),
        ({"checkpoint_mode": "fast"}, "checkpoint.mode"),
        ({"preset": "huge"}, "unknown preset"),
        ({"faults": "explode@3"}, "training"),
    ],
)
def test_each_wrong_parameter_is_named(changes, message):
    with pytest.raises(RunParameterError, match=message):
        check_run_parameters({**GOOD, **changes})


def test_values_arriving_as_strings_or_floats_inside_the_pipeline_are_read_as_typed():
    raw = {**GOOD, "steps": "40", "nproc": 2.0, "seed": "7", "gpu_node_selector": '{"pool": "gpu"}'}
    values = normalized(raw)
    assert values["steps"] == 40 and values["nproc"] == 2 and values["seed"] == 7
    assert values["gpu_node_selector"] == {"pool": "gpu"}
    check_run_parameters(raw)
    with pytest.raises(RunParameterError, match="steps"):
        check_run_parameters({**GOOD, "steps": "2.5"})


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_mlflow_secret_name_is_refused_in_one_line(name):
    """An empty name would render `secretKeyRef.name: ""` and every pod that reads it is refused."""
    with pytest.raises(RunParameterError) as raised:
        check_run_parameters({**GOOD, "mlflow_secret_name": name})
    message = str(raised.value)
    assert message.startswith("mlflow_secret_name is empty") and "\n" not in message
    assert "mlflow-credentials" in message


def test_the_check_step_is_given_the_mlflow_secret_name():
    import inspect

    from components.check_run.component import check_run

    assert "mlflow_secret_name" in inspect.signature(check_run).parameters
