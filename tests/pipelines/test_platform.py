"""The compiled pipeline's Kubernetes platform config: strict protos, volumes, scheduling, secrets.

The platform spec (the YAML's second document) must parse strictly into kfp's
`PlatformSpec`, and each executor's entry into kfp-kubernetes' `KubernetesExecutorConfig`,
which is what the KFP backend does with it; unknown fields are errors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp.kubernetes import kubernetes_executor_config_pb2
from kfp.pipeline_spec import pipeline_spec_pb2

from components.train.jobs import LAUNCHERS
from pipelines.pipeline import compile_pipeline
from pipelines.platform import PlatformOptions

STEPS = (
    "exec-stage-data",
    "exec-train-model",
    "exec-validate-checkpoint",
    "exec-register-model",
    "exec-retain-runs",
)


def _compile(tmp_path: Path, **kwargs) -> tuple[dict, dict, str]:
    path = Path(compile_pipeline(str(tmp_path / "pipeline.yaml"), **kwargs))
    text = path.read_text()
    pipeline, platform_spec = [doc for doc in yaml.safe_load_all(text) if doc]
    return pipeline, platform_spec, text


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[dict, dict, str]:
    options = PlatformOptions(image_pull_secrets=["ecr-pull"], train_pod_gpus=8, shm_size="64Gi")
    return _compile(tmp_path_factory.mktemp("platform"), options=options)


def _executors(platform_spec: dict) -> dict[str, dict]:
    return platform_spec["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_platform_spec_parses_strictly_into_kfp_protos(compiled):
    _, platform_spec, _ = compiled
    json_format.ParseDict(platform_spec, pipeline_spec_pb2.PlatformSpec())
    for name, config in _executors(platform_spec).items():
        parsed = json_format.ParseDict(config, kubernetes_executor_config_pb2.KubernetesExecutorConfig())
        assert parsed.image_pull_policy == "IfNotPresent", name
        assert [s.secret_name for s in parsed.image_pull_secret] == ["ecr-pull"], name


def test_every_step_mounts_the_fsx_pvc_named_by_a_parameter(compiled):
    pipeline, platform_spec, _ = compiled
    assert pipeline["root"]["inputDefinitions"]["parameters"]["fsx_pvc_name"]["defaultValue"] == "fsx-claim"
    for name in STEPS:
        (mount,) = _executors(platform_spec)[name]["pvcMount"]
        assert mount["mountPath"] == "/fsx", name
        assert mount["pvcNameParameter"]["componentInputParameter"] == "pipelinechannel--fsx_pvc_name", name
    assert "pvcMount" not in _executors(platform_spec)["exec-cleanup-training-jobs"]


def test_mount_path_is_compiled_in_and_no_run_parameter_can_change_it(tmp_path):
    """Every step mounts the volume at the compiled path and looks for the run's files at
    that same path: a run parameter (issue 14) could point them somewhere else."""
    pipeline, platform_spec, _ = _compile(tmp_path, options=PlatformOptions(fsx_mount_path="/mnt/lustre"))
    assert "fsx_mount_path" not in pipeline["root"]["inputDefinitions"]["parameters"]
    assert {_executors(platform_spec)[name]["pvcMount"][0]["mountPath"] for name in STEPS} == {"/mnt/lustre"}
    tasks = {}
    for component in pipeline["components"].values():
        tasks.update((component.get("dag") or {}).get("tasks") or {})
    given = {
        name: task["inputs"]["parameters"]["fsx_mount_path"]
        for name, task in tasks.items()
        if "fsx_mount_path" in task.get("inputs", {}).get("parameters", {})
    }
    assert set(given) >= {"stage-data", "stage-model", "train-model", "validate-checkpoint", "register-model"}
    assert all(value == {"runtimeValue": {"constant": "/mnt/lustre"}} for value in given.values()), given


def test_trainer_gets_shm_gpu_scheduling_and_resources(compiled):
    pipeline, platform_spec, _ = compiled
    train = _executors(platform_spec)["exec-train-model"]
    assert train["emptyDirMounts"] == [
        {"medium": "Memory", "mountPath": "/dev/shm", "volumeName": "dshm", "sizeLimit": "64Gi"}
    ]
    assert (
        train["nodeSelector"]["nodeSelectorJson"]["componentInputParameter"]
        == "pipelinechannel--gpu_node_selector"
    )
    (toleration,) = train["tolerations"]
    assert toleration["tolerationJson"]["componentInputParameter"] == "pipelinechannel--gpu_tolerations"
    parameters = pipeline["root"]["inputDefinitions"]["parameters"]
    assert parameters["gpu_tolerations"]["defaultValue"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    resources = pipeline["deploymentSpec"]["executors"]["exec-train-model"]["container"]["resources"]
    assert resources["resourceCpuRequest"] == "2" and resources["resourceMemoryRequest"] == "8Gi"
    assert resources["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert resources["accelerator"]["resourceCount"] == "8"
    for name in ("exec-stage-data", "exec-validate-checkpoint", "exec-register-model"):
        assert "nodeSelector" not in _executors(platform_spec)[name]
        assert "emptyDirMounts" not in _executors(platform_spec)[name]


def test_mlflow_credentials_come_from_a_secret_only_in_the_steps_that_use_mlflow(compiled):
    """Stage-model resolves a models:/ source, train logs live metrics, validate scores the
    current champion, register writes the model and retain reads the aliases: they need MLflow. The train step also gets the secret's name, for a training
    job's pods (where rank 0 runs with a job launcher) to read the same secret."""
    pipeline, platform_spec, _ = compiled
    train_task = pipeline["components"]["comp-exit-handler-1"]["dag"]["tasks"]["train-model"]
    assert train_task["inputs"]["parameters"]["mlflow_secret_name"] == {
        "componentInputParameter": "pipelinechannel--mlflow_secret_name"
    }
    executors = _executors(platform_spec)
    for name in (
        "exec-register-model",
        "exec-retain-runs",
        "exec-stage-model",
        "exec-train-model",
        "exec-validate-checkpoint",
    ):
        (secret,) = executors[name]["secretAsEnv"]
        assert (
            secret["secretNameParameter"]["componentInputParameter"] == "pipelinechannel--mlflow_secret_name"
        )
        assert {k["envVar"] for k in secret["keyToEnv"]} == {
            "MLFLOW_TRACKING_URI",
            "MLFLOW_TRACKING_USERNAME",
            "MLFLOW_TRACKING_PASSWORD",
        }
    assert sorted(name for name, config in executors.items() if "secretAsEnv" in config) == [
        "exec-register-model",
        "exec-retain-runs",
        "exec-stage-model",
        "exec-train-model",
        "exec-validate-checkpoint",
    ]


def test_no_secret_value_or_aws_key_reaches_the_yaml(tmp_path, monkeypatch):
    # Values a careless build could read from the compiling machine's environment.
    canaries = {
        "AWS_ACCESS_KEY_ID": "AKIAABCDEFGHIJKLMNOP",
        "AWS_SECRET_ACCESS_KEY": "canary-secret-access-key-value",
        "MLFLOW_TRACKING_PASSWORD": "canary-mlflow-password",
        "MLFLOW_TRACKING_URI": "https://canary-user:canary-pass@mlflow.example.com",
    }
    for key, value in canaries.items():
        monkeypatch.setenv(key, value)
    _, _, text = _compile(tmp_path)
    for value in canaries.values():
        assert value not in text
    assert not re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", text)
    assert "AWS_ACCESS_KEY_ID" not in text and "AWS_SECRET_ACCESS_KEY" not in text
    assert "canary" not in text


def test_retries_on_stage_and_register_and_training_never_cached(compiled):
    pipeline, _, _ = compiled
    tasks = pipeline["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    register = pipeline["components"]["comp-condition-2"]["dag"]["tasks"]["register-model"]
    for task in (tasks["stage-data"], register):
        assert task["retryPolicy"]["maxRetryCount"] == 3
        assert task["retryPolicy"]["backoffFactor"] == 2.0
    assert "retryPolicy" not in tasks["train-model"]
    assert not tasks["train-model"].get("cachingOptions", {}).get("enableCache", False)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_pipeline_compiles_with_each_launcher(tmp_path, launcher):
    pipeline, platform_spec, _ = _compile(tmp_path, image="example.com/rtp:2", launcher=launcher)
    json_format.ParseDict(pipeline, pipeline_spec_pb2.PipelineSpec())
    json_format.ParseDict(platform_spec, pipeline_spec_pb2.PlatformSpec())
    assert pipeline["root"]["inputDefinitions"]["parameters"]["launcher"]["defaultValue"] == launcher
    train = pipeline["components"]["comp-exit-handler-1"]["dag"]["tasks"]["train-model"]["inputs"][
        "parameters"
    ]
    assert train["launcher"]["componentInputParameter"] == "pipelinechannel--launcher"
    assert train["job_image"]["runtimeValue"]["constant"] == "example.com/rtp:2"
    cleanup = pipeline["root"]["dag"]["tasks"]["cleanup-training-jobs"]["inputs"]["parameters"]
    assert cleanup["launcher"]["componentInputParameter"] == "launcher"


def test_bad_platform_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="must be absolute"):
        _compile(tmp_path, options=PlatformOptions(fsx_mount_path="fsx"))
    with pytest.raises(ValueError, match="image pull policy"):
        _compile(tmp_path, options=PlatformOptions(image_pull_policy="Sometimes"))


def _references(node) -> list[str]:
    if isinstance(node, dict):
        found = (
            [node["componentInputParameter"]] if isinstance(node.get("componentInputParameter"), str) else []
        )
        return found + [ref for value in node.values() for ref in _references(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _references(value)]
    return []


def test_every_parameter_reference_resolves_in_its_dag(compiled):
    # kfp 2.17.3 drops channels used only in resource requests from a sub-DAG's inputs;
    # the backend then cannot resolve them. Check every DAG's and platform entry's inputs.
    pipeline, platform_spec, _ = compiled
    dags = {"root": pipeline["root"], **pipeline["components"]}
    task_scope = {}
    for dag_name, component in dags.items():
        available = set(component.get("inputDefinitions", {}).get("parameters", {}))
        for task_name, task in component.get("dag", {}).get("tasks", {}).items():
            for ref in _references(task.get("inputs", {}).get("parameters", {})):
                assert ref in available, f"{dag_name}/{task_name} reads {ref}, which {dag_name} lacks"
            task_scope[task["componentRef"]["name"].replace("comp-", "exec-")] = available
    for executor, config in _executors(platform_spec).items():
        # The backend resolves a platform entry's parameter in the DAG that holds the task.
        for ref in _references(config):
            assert ref in task_scope[executor], (
                f"{executor}'s platform config reads {ref}, which its DAG lacks"
            )


def test_compiled_header_is_the_same_whatever_the_hash_seed():
    from pipelines.pipeline import stable_header

    one = "# Inputs:\n#    tol: list [Default: [{'key': 'k', 'effect': 'NoSchedule'}]]\n#    n: int [Default: 1.0]\ncomponents: {}\n"
    other = "# Inputs:\n#    tol: list [Default: [{'effect': 'NoSchedule', 'key': 'k'}]]\n#    n: int [Default: 1.0]\ncomponents: {}\n"
    assert stable_header(one) == stable_header(other)
    assert "[{'effect': 'NoSchedule', 'key': 'k'}]" in stable_header(one)
    assert stable_header(one).endswith("#    n: int [Default: 1.0]\ncomponents: {}\n")


JOB_PARAMETERS = {
    # pipeline parameter -> (train component input, `rtp render-job` flag destination)
    "instance_type": ("instance_type", None),
    "job_cpu_per_node": ("job_cpu_per_node", "cpu_per_node"),
    "job_memory_per_node": ("job_memory_per_node", "memory_per_node"),
    "job_shm_size": ("job_shm_size", "shm_size"),
    "job_max_restarts": ("job_max_restarts", "max_restarts"),
    "job_backoff_limit": ("job_backoff_limit", "backoff_limit"),
    "job_termination_grace_s": ("job_termination_grace_s", "termination_grace_s"),
    "job_pending_timeout_s": ("job_pending_timeout_s", None),
}


def test_job_resources_and_restarts_are_run_parameters_with_the_examples_defaults(compiled):
    """The pipeline passes cpu, memory, shm and restart settings to the job, overridable per
    run, and its defaults are `rtp render-job`'s, which rendered deploy/eks/*-example.yaml."""
    from rtp_cli.main import build_parser

    pipeline, _, _ = compiled
    root = pipeline["root"]["inputDefinitions"]["parameters"]
    train_inputs = pipeline["root"]["dag"]["tasks"]["exit-handler-1"]["inputs"]["parameters"]
    handler = pipeline["components"]["comp-exit-handler-1"]["dag"]["tasks"]["train-model"]["inputs"][
        "parameters"
    ]
    render_defaults = build_parser().parse_args(["render-job", "--mode", "pytorchjob"])
    for parameter, (component_input, render_flag) in JOB_PARAMETERS.items():
        assert root[parameter]["description"], parameter
        assert train_inputs[f"pipelinechannel--{parameter}"]["componentInputParameter"] == parameter
        assert handler[component_input]["componentInputParameter"] == f"pipelinechannel--{parameter}"
        if render_flag:
            assert root[parameter]["defaultValue"] == getattr(render_defaults, render_flag), parameter
    assert root["instance_type"]["defaultValue"] == "p5.48xlarge"


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_with_a_job_launcher_the_watching_train_pod_stays_off_the_gpu_nodes(tmp_path, launcher):
    """The train step's pod only creates and watches the job: the GPU node selector and
    tolerations go to the job's pods (as train inputs), not to the watcher's own pod."""
    pipeline, platform_spec, _ = _compile(tmp_path, launcher=launcher)
    train = _executors(platform_spec)["exec-train-model"]
    assert "nodeSelector" not in train and "tolerations" not in train
    inputs = pipeline["components"]["comp-exit-handler-1"]["dag"]["tasks"]["train-model"]["inputs"][
        "parameters"
    ]
    assert inputs["node_selector"]["componentInputParameter"] == "pipelinechannel--gpu_node_selector"
    assert inputs["tolerations"]["componentInputParameter"] == "pipelinechannel--gpu_tolerations"


def test_the_train_pod_knows_its_own_name_namespace_and_uid(compiled):
    """The train step makes its pod the owner of the job it creates (k8s_launcher.step_pod_owner):
    the downward API gives it the pod's identity, parsed strictly like the backend does."""
    from components.train.k8s_launcher import POD_NAME_ENV, POD_NAMESPACE_ENV, POD_UID_ENV

    _, platform_spec, _ = compiled
    config = json_format.ParseDict(
        _executors(platform_spec)["exec-train-model"],
        kubernetes_executor_config_pb2.KubernetesExecutorConfig(),
    )
    assert {env.name: env.field_path for env in config.field_path_as_env} == {
        POD_NAME_ENV: "metadata.name",
        POD_NAMESPACE_ENV: "metadata.namespace",
        POD_UID_ENV: "metadata.uid",
    }


def test_steps_and_job_pods_treat_the_mlflow_secret_alike(compiled):
    """Required everywhere: register needs MLflow, so a missing secret must stop the first pod
    that reads it (a step, or a job pod at CreateContainerConfigError), not the end of a run."""
    from components.train.jobs import mlflow_secret_env

    _, platform_spec, _ = compiled
    steps = {
        name: json_format.ParseDict(config, kubernetes_executor_config_pb2.KubernetesExecutorConfig())
        for name, config in _executors(platform_spec).items()
        if "secretAsEnv" in config
    }
    in_steps = {secret.optional for config in steps.values() for secret in config.secret_as_env}
    in_jobs = {
        item["valueFrom"]["secretKeyRef"]["optional"] for item in mlflow_secret_env("mlflow-credentials")
    }
    assert in_steps == in_jobs == {False}


def test_the_preset_help_lists_every_preset_of_the_trainer(compiled):
    from trainer.config import PRESETS

    pipeline, _, _ = compiled
    help_text = pipeline["root"]["inputDefinitions"]["parameters"]["preset"]["description"]
    assert "gpu-1b" in PRESETS
    assert all(name in help_text for name in PRESETS), help_text
    component = pipeline["components"]["comp-train-model"]["inputDefinitions"]["parameters"]["preset"]
    assert all(name in component["description"] for name in PRESETS), component


def _memory(pipeline: dict, executor: str) -> tuple[str, str]:
    resources = pipeline["deploymentSpec"]["executors"][executor]["container"]["resources"]
    return resources["resourceMemoryRequest"], resources["resourceMemoryLimit"]


def test_validate_and_register_pods_are_sized_for_the_model(tmp_path, compiled):
    """No memory request used to let an 8B validate or register land on any node; the size
    comes from `--model-params` by the documented formula (request = limit)."""
    pipeline, _, _ = compiled  # the CPU presets
    assert _memory(pipeline, "exec-validate-checkpoint") == ("3Gi", "3Gi")
    assert _memory(pipeline, "exec-register-model") == ("2Gi", "2Gi")
    large, _, _ = _compile(tmp_path, options=PlatformOptions(model_params=8e9))
    # validate: 2 + 2 x 0.25 + 3 x min(4, 29.8) GiB; register: 2 + 3 x 4 B x 0.08 x 8e9.
    assert _memory(large, "exec-validate-checkpoint") == ("15Gi", "15Gi")
    assert _memory(large, "exec-register-model") == ("10Gi", "10Gi")
    with pytest.raises(ValueError, match="model parameters must be 0 or more"):
        PlatformOptions(model_params=-1).check()
