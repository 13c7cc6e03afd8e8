"""Training-job manifests: pure builders, checked strictly against the upstream CRD schemas.

Every shape the launcher can produce (one or many nodes, CPU or GPU, with or without EFA,
scheduling and pull secrets) must validate against tests/specs/crds with unknown
fields rejected; those tests skip with a reason when the specs are absent.
"""

from __future__ import annotations

import itertools

import pytest
import yaml

from components.train.job_scale import CPU_SCALE, GPU_SCALE, job_scale, trainer_overrides
from components.train.jobs import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    ISTIO_INJECT_ANNOTATION,
    RUN_ID_LABEL,
    JobSettings,
    JobSettingsError,
    ft_launcher_command,
    job_manifest,
    job_name,
    pytorchjob_manifest,
    run_id_label_value,
    trainjob_manifest,
)
from pipelines.platform import DEFAULT_MLFLOW_SECRET, MLFLOW_SECRET_KEYS
from tests.fakes.crd_schema import load_custom_resources
from trainer.config import ConfigError, ResilienceConfig, build_config

RUN_ID = "9b2c4f0e-1d2a-4c3b-8e7f-a1b2c3d4e5f6"


def settings(**fields) -> JobSettings:
    defaults = dict(
        name=job_name(RUN_ID), namespace="team-a", image="example.com/rtp:1",
        trainer_args=["--steps=10", "--workdir=/fsx/rtp/runs/r/train"], run_id=RUN_ID,
    )  # fmt: skip
    return JobSettings(**{**defaults, **fields})


SHAPES = {
    "cpu-1-node": dict(nnodes=1, nproc_per_node=2),
    "cpu-3-nodes": dict(nnodes=3, nproc_per_node=2, cpu_per_node="4", memory_per_node="16Gi"),
    "gpu-2-nodes-efa": dict(
        nnodes=2,
        nproc_per_node=8,
        gpus_per_node=8,
        efa_per_node=32,
        cpu_per_node="180",
        memory_per_node="1800Gi",
        shm_size="256Gi",
        node_selector={"node.kubernetes.io/instance-type": "p5.48xlarge"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        service_account="training",
        image_pull_secrets=["ecr-pull"],
        image_pull_policy="Always",
    ),
    "gpu-1-node-no-efa": dict(nnodes=1, nproc_per_node=4, gpus_per_node=4),
}


@pytest.fixture(scope="module")
def crds(upstream_specs):
    return load_custom_resources(upstream_specs / "crds")


@pytest.mark.parametrize(("launcher", "shape"), list(itertools.product(["pytorchjob", "trainjob"], SHAPES)))
def test_every_manifest_validates_strictly_against_its_crd(crds, launcher, shape):
    manifest = job_manifest(launcher, settings(**SHAPES[shape]))
    resource = crds[f"{manifest['apiVersion']}/{manifest['kind']}"]
    assert resource.errors(manifest) == []


def test_the_validator_rejects_unknown_and_mistyped_fields(crds):
    manifest = pytorchjob_manifest(settings(nnodes=2))
    resource = crds["kubeflow.org/v1/PyTorchJob"]
    master = manifest["spec"]["pytorchReplicaSpecs"]["Master"]
    master["template"]["spec"]["containers"][0]["gpus"] = 8
    master["replicas"] = "one"
    errors = resource.errors(manifest)
    assert any("'gpus' was unexpected" in e for e in errors)
    assert any("replicas" in e and "not of type 'integer'" in e for e in errors)


def test_the_validator_accepts_the_stock_torch_runtime(crds, upstream_specs):
    import yaml

    runtime = yaml.safe_load((upstream_specs / "crds" / "runtime_torch_distributed.v2.3.0.yaml").read_text())
    assert crds["trainer.kubeflow.org/v1alpha1/ClusterTrainingRuntime"].errors(runtime) == []


def test_pytorchjob_has_one_master_and_n_minus_1_workers_with_gpus_efa_and_volumes():
    manifest = pytorchjob_manifest(settings(**SHAPES["gpu-2-nodes-efa"]))
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 1
    pod = replicas["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"
    assert container["resources"]["limits"][GPU_RESOURCE] == 8
    assert container["resources"]["limits"][EFA_RESOURCE] == 32
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "256Gi"}} in pod["volumes"]
    assert {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}} in pod["volumes"]
    assert {"name": "fsx", "mountPath": "/fsx"} in container["volumeMounts"]
    env = env_values(container["env"])
    assert env["FI_PROVIDER"] == "efa" and "OMP_NUM_THREADS" not in env
    assert manifest["spec"]["runPolicy"]["activeDeadlineSeconds"] == 86400
    assert manifest["spec"]["runPolicy"]["backoffLimit"] == GPU_SCALE.backoff_limit
    assert manifest["metadata"]["labels"][RUN_ID_LABEL] == RUN_ID
    assert "Worker" not in pytorchjob_manifest(settings(nnodes=1))["spec"]["pytorchReplicaSpecs"]


def test_trainjob_puts_nodes_resources_and_pod_patches_where_trainer_v2_reads_them():
    manifest = trainjob_manifest(settings(**SHAPES["gpu-2-nodes-efa"]))
    trainer = manifest["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    assert trainer["resourcesPerNode"]["requests"][EFA_RESOURCE] == 32
    assert manifest["spec"]["runtimeRef"]["name"] == "torch-distributed"
    (patch,) = manifest["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]["spec"]
    assert replicated["name"] == "node" and pod["containers"][0]["name"] == "node"
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert pod["imagePullSecrets"] == [{"name": "ecr-pull"}]
    assert "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)" in " ".join(trainer["command"])


def test_each_pod_runs_ft_launcher_with_a_c10d_rendezvous_then_the_trainer():
    command = ft_launcher_command(
        settings(nnodes=4, nproc_per_node=8, gpus_per_node=8), "MASTER_ADDR", "MASTER_PORT"
    )
    assert command[0] == "ft_launcher"
    assert "--nnodes=4:4" in command and "--nproc-per-node=8" in command
    assert "--rdzv-backend=c10d" in command
    assert "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)" in command
    assert "--ft-enable-nic-monitor=true" in command
    assert command[command.index("-m") + 1] == "trainer"
    assert command[-2:] == ["--steps=10", "--workdir=/fsx/rtp/runs/r/train"]
    cpu = ft_launcher_command(settings(), "MASTER_ADDR", "MASTER_PORT")
    assert "--ft-enable-nic-monitor=false" in cpu


def test_ft_launcher_accepts_the_flags_we_pass():
    # The flags must parse with the installed ft_launcher (nvidia-resiliency-ext 0.4.1).
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

    command = ft_launcher_command(settings(nnodes=2, nproc_per_node=2), "MASTER_ADDR", "MASTER_PORT")
    args = get_args_parser().parse_args(command[1:])
    assert args.nnodes == "2:2" and args.rdzv_backend == "c10d" and args.max_restarts == 3
    assert args.module and args.training_script == "trainer"


def test_names_and_labels_are_valid_kubernetes_names():
    assert job_name("Run_ID/with spaces") == "rtp-train-run-id-with-spaces"
    assert len(job_name("x" * 200)) <= 63
    assert run_id_label_value("-a/b-") == "a-b"
    assert run_id_label_value("") == "manual"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(nnodes=0), "nnodes must be at least 1"),
        (dict(gpus_per_node=2, nproc_per_node=4), "one process per GPU"),
        (dict(mount_path="fsx"), "absolute"),
        (dict(name="Bad_Name"), "DNS label"),
        (dict(tolerations=[1]), "toleration objects"),
        (dict(node_selector={"pool": {"nested": "x"}}), "string values"),
    ],
)
def test_bad_settings_are_refused_with_what_to_change(fields, message):
    with pytest.raises(JobSettingsError, match=message):
        pytorchjob_manifest(settings(**fields))


def test_inpod_is_not_a_job():
    with pytest.raises(JobSettingsError, match="creates no job"):
        job_manifest("inpod", settings())


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("efa", [0, 32])
def test_job_pods_run_unprivileged(crds, launcher, efa):
    manifest = job_manifest(launcher, settings(nnodes=2, gpus_per_node=8 if efa else 0, efa_per_node=efa))
    assert crds[f"{manifest['apiVersion']}/{manifest['kind']}"].errors(manifest) == []
    if launcher == "pytorchjob":
        pods = [r["template"]["spec"] for r in manifest["spec"]["pytorchReplicaSpecs"].values()]
        assert all(pod["automountServiceAccountToken"] is False for pod in pods)
    else:
        patch = manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
        pods = [patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        [container] = pod["containers"]
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
        assert security["capabilities"].get("add", []) == (["IPC_LOCK"] if efa else [])


def pod_templates(manifest: dict) -> list[dict]:
    """Every pod template (metadata and spec) a job manifest makes its pods from."""
    if manifest["kind"] == "PyTorchJob":
        return [replica["template"] for replica in manifest["spec"]["pytorchReplicaSpecs"].values()]
    patch = manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    return [job["template"]["spec"]["template"] for job in patch["replicatedJobs"]]


def env_lists(manifest: dict) -> list[list[dict]]:
    """The env list of every training container a job manifest declares (one per replica type)."""
    if manifest["kind"] == "PyTorchJob":
        replicas = manifest["spec"]["pytorchReplicaSpecs"].values()
        return [replica["template"]["spec"]["containers"][0]["env"] for replica in replicas]
    return [manifest["spec"]["trainer"]["env"]]


def env_values(env: list[dict]) -> dict[str, str]:
    """The variables given as values; entries read from a secret (valueFrom) are left out."""
    return {item["name"]: item["value"] for item in env if "valueFrom" not in item}


def env_of(manifest: dict) -> dict[str, str]:
    return env_values(env_lists(manifest)[0])


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_pod_template_turns_istio_injection_off_and_has_a_grace_period(crds, launcher, shape):
    fields = SHAPES[shape]
    manifest = job_manifest(launcher, settings(**fields))
    templates = pod_templates(manifest)
    assert templates
    for template in templates:
        assert template["metadata"]["annotations"][ISTIO_INJECT_ANNOTATION] == "false"
        grace = template["spec"]["terminationGracePeriodSeconds"]
        assert grace == job_scale(fields.get("gpus_per_node", 0)).termination_grace_s
    command = manifest["spec"]["trainer"]["command"] if launcher == "trainjob" else (
        manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"])  # fmt: skip
    [term] = [int(arg.split("=")[1]) for arg in command if arg.startswith("--term-timeout=")]
    assert 0 < term < grace  # the launcher gives up on the final save before the kubelet kills it


def test_gpu_jobs_get_gpu_scale_restarts_and_cpu_jobs_keep_theirs():
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

    for gpus, scale in ((0, CPU_SCALE), (8, GPU_SCALE)):
        manifest = pytorchjob_manifest(settings(nnodes=2, nproc_per_node=2, gpus_per_node=gpus))
        assert manifest["spec"]["runPolicy"]["backoffLimit"] == scale.backoff_limit
        command = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
            "command"
        ]
        assert command[:3] == ["python", "-m", "trainer.health"] and f"--gpus={gpus}" in command
        args = get_args_parser().parse_args(command[command.index("--") + 2 :])  # after "-- ft_launcher"
        assert args.max_restarts == scale.max_restarts
        assert args.term_timeout == scale.termination_grace_s - 60 or gpus == 0
    assert (CPU_SCALE.max_restarts, CPU_SCALE.backoff_limit) == (3, 2)  # unchanged CPU behaviour
    assert (
        GPU_SCALE.max_restarts > CPU_SCALE.max_restarts and GPU_SCALE.backoff_limit > CPU_SCALE.backoff_limit
    )
    # Given values win over the table.
    manifest = pytorchjob_manifest(
        settings(gpus_per_node=8, nproc_per_node=8, max_restarts=1, backoff_limit=0, termination_grace_s=1200)
    )
    assert manifest["spec"]["runPolicy"]["backoffLimit"] == 0
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 1200
    assert "--max-restarts=1" in pod["containers"][0]["command"]
    assert "--term-timeout=1140" in pod["containers"][0]["command"]


def test_trainer_timeouts_are_gpu_scale_on_gpu_jobs_unless_overridden():
    scaled = build_config("gpu-125m", trainer_overrides(gpus_per_node=8))
    r = scaled.resilience
    assert (r.collective_timeout_s, r.soft_timeout_s, r.hard_timeout_s, r.heartbeat_floor_s) == (
        GPU_SCALE.collective_timeout_s, GPU_SCALE.soft_timeout_s, GPU_SCALE.hard_timeout_s,
        GPU_SCALE.heartbeat_floor_s,
    )  # fmt: skip
    assert r.collective_timeout_s >= 60 and r.heartbeat_floor_s >= 60 and r.timeout_floor_s >= 60
    assert trainer_overrides(gpus_per_node=0) == []  # CPU: the trainer's own defaults
    assert build_config("tiny-cpu").resilience == ResilienceConfig()
    assert ResilienceConfig().collective_timeout_s == CPU_SCALE.collective_timeout_s == 15
    # A user's override comes later and wins; one GPU value a user changed stays checked.
    kept = build_config("gpu-125m", [*trainer_overrides(8), "resilience.soft_timeout_s=100"]).resilience
    assert kept.soft_timeout_s == 100 and kept.hard_timeout_s == GPU_SCALE.hard_timeout_s == "auto"
    with pytest.raises(ConfigError, match=r"below resilience\.hard_timeout_s"):
        build_config(
            "gpu-125m",
            [*trainer_overrides(8), "resilience.soft_timeout_s=200", "resilience.hard_timeout_s=100"],
        )


def test_auto_resources_are_a_p5_share_on_gpus_and_none_on_cpu():
    auto = dict(cpu_per_node=None, memory_per_node=None, shm_size=None)
    manifest = pytorchjob_manifest(settings(nnodes=2, nproc_per_node=8, gpus_per_node=8, **auto))
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    requests = pod["containers"][0]["resources"]["requests"]
    assert (requests["cpu"], requests["memory"]) == ("180", "1800Gi")  # deploy/eks/*-example.yaml
    # The fast tier's two slots and the async snapshot: ~34 GiB per GPU for 8B on one node.
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "320Gi"}} in pod["volumes"]
    assert GPU_SCALE.resources(1) == ("22500m", "225Gi", "40Gi")
    cpu_pod = pytorchjob_manifest(settings(**auto))["spec"]["pytorchReplicaSpecs"]["Master"]["template"][
        "spec"
    ]
    assert "resources" not in cpu_pod["containers"][0]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in cpu_pod["volumes"]


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_efa_env_sets_device_rdma_only_on_instance_types_that_support_it(launcher):
    efa = dict(nnodes=2, nproc_per_node=8, gpus_per_node=8, efa_per_node=32)
    p5 = env_of(job_manifest(launcher, settings(**efa, instance_type="p5.48xlarge")))
    assert (
        p5["FI_PROVIDER"] == "efa" and p5["FI_EFA_USE_DEVICE_RDMA"] == "1" and p5["FI_EFA_FORK_SAFE"] == "1"
    )
    assert p5["NCCL_DEBUG"] == "INFO" and "NET" in p5["NCCL_DEBUG_SUBSYS"].split(",")  # the EFA check's lines
    g5 = env_of(job_manifest(launcher, settings(**{**efa, "efa_per_node": 1}, instance_type="g5.48xlarge")))
    assert g5["FI_PROVIDER"] == "efa" and "FI_EFA_USE_DEVICE_RDMA" not in g5
    unknown = env_of(job_manifest(launcher, settings(**efa)))  # not said: not guessed
    assert "FI_EFA_USE_DEVICE_RDMA" not in unknown
    tcp = env_of(job_manifest(launcher, settings(nnodes=2, instance_type="p5.48xlarge")))
    assert not any(name.startswith("FI_") for name in tcp) and tcp["NCCL_DEBUG"] == "WARN"


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_job_pods_read_mlflow_settings_from_the_secret_by_reference(crds, launcher, monkeypatch):
    """Rank 0 runs in a job pod: without MLFLOW_TRACKING_URI there it logs no live metrics.
    The pods name the pipeline's secret and the kubelet reads it; no value enters the job.
    The secret is required, as in the pipeline's steps: a namespace without it fails the
    pods at once (CreateContainerConfigError), not the register step after training."""
    # Credentials on the rendering machine must not leak into the manifest either.
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "canary-password-7f3a")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://canary-host.example:5000")
    manifest = job_manifest(launcher, settings(nnodes=3, mlflow_secret_name="team-mlflow"))
    assert crds[f"{manifest['apiVersion']}/{manifest['kind']}"].errors(manifest) == []
    expected = [
        {
            "name": variable,
            "valueFrom": {"secretKeyRef": {"name": "team-mlflow", "key": key, "optional": False}},
        }
        for key, variable in MLFLOW_SECRET_KEYS.items()
    ]
    assert {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} == {
        item["name"] for item in expected
    }
    for env in env_lists(manifest):
        assert [item for item in env if item["name"].startswith("MLFLOW_")] == expected
        assert all("value" not in item for item in env if "valueFrom" in item)
        assert len({item["name"] for item in env}) == len(env)  # no variable twice
    text = yaml.safe_dump(manifest)
    assert "canary" not in text


def test_the_pipelines_secret_is_the_default_and_one_mapping_serves_steps_and_jobs():
    from components import mlflow_access

    assert mlflow_access.MLFLOW_SECRET_KEYS is MLFLOW_SECRET_KEYS  # one definition, not a copy
    assert settings().mlflow_secret_name == DEFAULT_MLFLOW_SECRET
    refs = [item["valueFrom"]["secretKeyRef"] for item in env_lists(pytorchjob_manifest(settings()))[0]
            if "valueFrom" in item]  # fmt: skip
    assert {ref["name"] for ref in refs} == {DEFAULT_MLFLOW_SECRET}


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_no_mlflow_secret_gives_the_pods_no_mlflow_settings(crds, launcher):
    manifest = job_manifest(launcher, settings(nnodes=2, mlflow_secret_name=""))
    assert crds[f"{manifest['apiVersion']}/{manifest['kind']}"].errors(manifest) == []
    for env in env_lists(manifest):
        assert not any(item["name"].startswith("MLFLOW_") or "valueFrom" in item for item in env)


def test_an_explicit_mlflow_value_wins_over_the_secret_without_a_duplicate():
    manifest = pytorchjob_manifest(settings(env={"MLFLOW_TRACKING_URI": "http://mlflow.team-a:5000"}))
    (env,) = env_lists(manifest)
    assert [item for item in env if item["name"] == "MLFLOW_TRACKING_URI"] == [
        {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.team-a:5000"}
    ]
    from_secret = {item["name"] for item in env if "valueFrom" in item}
    assert from_secret == {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}


@pytest.mark.parametrize("name", ["Bad_Name", "-lead", "trail.", "a..b", "x" * 254])
def test_a_bad_mlflow_secret_name_is_refused_before_any_pod_would_fail(name):
    with pytest.raises(JobSettingsError, match=r"mlflow_secret_name .* must be a Kubernetes secret name"):
        pytorchjob_manifest(settings(mlflow_secret_name=name))
    assert pytorchjob_manifest(settings(mlflow_secret_name="mlflow.credentials-2"))


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_each_job_kind_builds_its_own_kind_and_is_found_by_it(launcher):
    from components.train.jobs import JOB_KINDS, job_kind_of

    job_kind = JOB_KINDS[launcher]
    manifest = job_manifest(launcher, settings())
    assert (manifest["kind"], manifest["apiVersion"]) == (job_kind.kind, job_kind.api_version)
    assert job_kind_of(manifest["kind"]) is job_kind and job_kind_of("MPIJob") is None
    # node 0's pod is one of the job's pods: its selector narrows the job's
    assert job_kind.rank0_pod_selector("j").startswith(job_kind.pods_selector("j") + ",")


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_a_queue_name_submits_the_job_to_kueue_and_a_bad_one_is_refused(launcher):
    from components.train.jobs import KUEUE_QUEUE_LABEL

    manifest = job_manifest(launcher, settings(queue_name="gpu-queue").check())
    assert manifest["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "gpu-queue"
    assert KUEUE_QUEUE_LABEL not in job_manifest(launcher, settings())["metadata"]["labels"]
    with pytest.raises(JobSettingsError, match="job_queue_name 'GPU queue'"):
        settings(queue_name="GPU queue").check()


def test_a_priority_class_orders_a_pytorchjobs_pods_and_gang_and_a_trainjob_refuses_it(crds):
    manifest = job_manifest("pytorchjob", settings(priority_class="training-high", nnodes=2).check())
    assert crds["kubeflow.org/v1/PyTorchJob"].errors(manifest) == []
    for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
        assert replica["template"]["spec"]["priorityClassName"] == "training-high"
    assert manifest["spec"]["runPolicy"]["schedulingPolicy"] == {"priorityClass": "training-high"}
    plain = job_manifest("pytorchjob", settings())
    assert "priorityClassName" not in plain["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert "schedulingPolicy" not in plain["spec"]["runPolicy"]
    with pytest.raises(
        JobSettingsError, match="job_priority_class 'High Priority' must be a PriorityClass name"
    ):
        settings(priority_class="High Priority").check()
    with pytest.raises(JobSettingsError, match=r"a v2\.3 TrainJob cannot set its pods' priority"):
        job_manifest("trainjob", settings(priority_class="training-high"))
