"""The run's parameters are checked in one place, before anything is staged."""

import sys
from pathlib import Path

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
        ({"training_method": "lora"}, "training_method lora trains adapters on a pretrained Hugging Face"),
        ({"training_method": "qlora", "model_source": "s3://bucket/models/m/"}, "training.method"),
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


# The memory a pipeline compiled without --model-params gives validate and register (the CPU presets).
CPU_SIZED = {"validate_memory": "3Gi", "register_memory": "2Gi"}


@pytest.mark.parametrize("preset", ["gpu-1b", "gpu-125m"])
def test_a_gpu_preset_on_pods_compiled_for_the_cpu_presets_is_refused_in_one_line(preset):
    with pytest.raises(RunParameterError) as raised:
        check_run_parameters({**GOOD, "preset": preset, **CPU_SIZED})
    message = str(raised.value)
    assert "\n" not in message and f"preset {preset}" in message
    assert "validate" in message and "(compiled: 3Gi)" in message and "rtp compile --model-params" in message


def test_pods_compiled_for_the_model_pass():
    from components.step_memory import byte_lm_parameters, model_step_memory
    from trainer.config import PRESETS, TrainConfig

    params = byte_lm_parameters(TrainConfig.from_dict(PRESETS["gpu-1b"]).model)
    sized = {f"{step}_memory": model_step_memory(step, params) for step in ("validate", "register")}
    check_run_parameters({**GOOD, "preset": "gpu-1b", **sized})
    check_run_parameters({**GOOD, "preset": "tiny-cpu", **CPU_SIZED})
    # A larger model sized by --model-params 8e9 fits too; a Hugging Face model is not known yet.
    check_run_parameters({**GOOD, "preset": "gpu-1b", "validate_memory": "15Gi", "register_memory": "10Gi"})
    check_run_parameters({**GOOD, "preset": "gpu-1b", "model_source": "s3://bkt/models/x/", **CPU_SIZED})


def test_an_override_that_grows_the_model_is_measured_too():
    with pytest.raises(RunParameterError, match="preset tiny-cpu"):
        check_run_parameters({**GOOD, "overrides": "model.d_model=2048 model.n_layers=8", **CPU_SIZED})


def test_the_byte_lm_size_is_the_built_model_s():
    from components.step_memory import byte_lm_parameters
    from trainer.config import PRESETS, TrainConfig
    from trainer.models.byte_lm import ByteLM

    for preset in ("tiny-cpu", "small-cpu"):
        config = TrainConfig.from_dict(PRESETS[preset]).model
        assert byte_lm_parameters(config) == sum(p.numel() for p in ByteLM(config).parameters())


def test_the_compiled_pipeline_hands_the_check_step_its_pod_memory(tmp_path):
    import yaml

    from pipelines.pipeline import compile_pipeline
    from pipelines.platform import PlatformOptions

    path = compile_pipeline(str(tmp_path / "p.yaml"), options=PlatformOptions(model_params=8e9))
    spec = next(yaml.safe_load_all(Path(path).read_text()))
    check = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["check-run"]["inputs"]["parameters"]
    assert check["validate_memory"]["runtimeValue"]["constant"] == "15Gi"
    assert check["register_memory"]["runtimeValue"]["constant"] == "10Gi"
