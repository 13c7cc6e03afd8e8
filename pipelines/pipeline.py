"""The rtp pipeline: stage -> train -> validate -> (if good enough) register.

Components are built for a given image at call time, so `rtp compile --image` can point
every step at the image a user pushed. Parameter names match the `rtp` flags and the
trainer's config fields; the docstring's Args become the descriptions in the Kubeflow UI.
"""

# No `from __future__ import annotations`: kfp reads the pipeline signature's real types.

import ast
import inspect
import re
from pathlib import Path
from typing import Any

from kfp import dsl

from components import DEFAULT_IMAGE, as_component
from components.check_run.component import check_run
from components.check_run.parameters import COMPILED_MEMORY
from components.cleanup_jobs.component import cleanup_training_jobs
from components.layout import PIPELINE_NAME
from components.register_model.component import register_model
from components.retain_runs.component import retain_runs
from components.stage_data.component import stage_data
from components.stage_model.component import stage_model
from components.step_memory import model_step_memory
from components.train.component import train_model
from components.train.job_parameters import with_job_parameters
from components.train.jobs import DEFAULT_LAUNCHER, JOB_LAUNCHERS
from components.train.k8s_launcher import POD_NAME_ENV, POD_NAMESPACE_ENV, POD_UID_ENV
from components.validate_checkpoint.component import validate_checkpoint
from pipelines import platform
from pipelines.platform import PlatformOptions
from trainer.config import DEFAULT_PRESET, PRESETS, named_settings

CHECKED_PARAMETERS = tuple(
    name
    for name in inspect.signature(check_run).parameters
    if name != "report" and name not in COMPILED_MEMORY.values()
)
DEFAULT_SOURCE = "s3://rtp-demo/corpus/"
DEFAULT_MODEL_NAME = "rtp-byte-lm"


def _default(param: str) -> Any:
    """A training parameter's default: the trainer config's, declared once there."""
    return named_settings()[param].default


def pipeline_version() -> str:
    """The pipeline definition's version, recorded on every registered model version."""
    from components.versioning import package_version

    return f"{PIPELINE_NAME}-{package_version(default='unknown')}"


def build_pipeline(
    image: str = DEFAULT_IMAGE, launcher: str = DEFAULT_LAUNCHER, options: PlatformOptions | None = None
) -> Any:
    """The pipeline for `image`; `launcher` is the default of its launcher parameter."""
    options = (options or PlatformOptions()).check()
    if launcher in JOB_LAUNCHERS and options.train_pod_gpus:
        raise ValueError(
            f"with launcher {launcher} the train step's pod only creates and watches the job: compile without "
            f"--train-pod-gpus (got {options.train_pod_gpus}), or that pod holds GPUs the job's pods need"
        )
    # With a job launcher as the default the train step's pod only creates and watches the job:
    # it gets no GPU node selector or tolerations, only the job's pods belong on GPU nodes
    # (kfp-kubernetes cannot tie a pod's scheduling to the launcher a run picks).
    train_pod_trains = launcher not in JOB_LAUNCHERS
    cleanup_op = as_component(cleanup_training_jobs, image)
    check_op = as_component(check_run, image)
    stage_op = as_component(stage_data, image)
    stage_model_op = as_component(stage_model, image)
    train_op = as_component(train_model, image)
    validate_op = as_component(validate_checkpoint, image)
    register_op = as_component(register_model, image)
    retain_op = as_component(retain_runs, image)

    def rtp_pipeline(
        source: str = DEFAULT_SOURCE,
        s3_endpoint_url: str = "",
        dataset_name: str = "demo-corpus",
        stage_workers: int = 1,
        model_source: str = "",
        model_init: str = _default("model_init"),
        data_format: str = _default("data_format"),
        training_method: str = _default("training_method"),
        run_name: str = "",
        steps: int = _default("steps"),
        nproc: int = 2,
        checkpoint_every: int = _default("checkpoint_every"),
        checkpoint_mode: str = _default("checkpoint_mode"),
        seed: int = _default("seed"),
        preset: str = DEFAULT_PRESET,
        overrides: str = "",
        faults: str = "none",
        max_loss: float = 4.0,
        min_improvement: float = 0.0,
        model_name: str = DEFAULT_MODEL_NAME,
        register_merged: bool = True,
        keep_runs: int = 0,
        launcher: str = launcher,
        fsx_pvc_name: str = platform.DEFAULT_PVC_NAME,
        gpu_node_selector: dict = {},  # noqa: B006 (KFP reads the literal as the default)
        gpu_tolerations: list = platform.DEFAULT_GPU_TOLERATIONS,
        mlflow_secret_name: str = platform.DEFAULT_MLFLOW_SECRET,
        **job: Any,  # the training job's parameters: components/train/job_parameters.py
    ) -> None:
        """Resilient training: stage, train, validate, register.

        Args:
            source: S3 prefix holding the training text, as s3://bucket/prefix.
            s3_endpoint_url: S3-compatible endpoint URL; leave empty for AWS S3.
            dataset_name: Dataset folder name under <mount>/rtp/datasets.
            stage_workers: Pods that fetch the dataset's objects, a share each balanced by bytes (a Kubernetes Indexed Job the stage step creates; each part is retried alone), before the stage step commits the snapshot; 1 fetches them in the stage step.
            model_source: S3 prefix of a Hugging Face model folder (config.json, *.safetensors, tokenizer files) to train, as s3://bucket/prefix/<model>/, staged under <mount>/rtp/models/<model>; or a version rtp registered, models:/<name>@<alias> (e.g. models:/rtp-model@champion: continue from the champion) or models:/<name>/<version>, resolved once, verified and staged under <mount>/rtp/models/<name>/versions. Empty trains a new built-in byte-level model. The dataset must be tokenized with this model's tokenizer (rtp prepare-data --tokenizer).
            model_init: How the Hugging Face model starts: pretrained (its weights) or random (from its config.json, for pretraining).
            data_format: What the dataset holds: tokens (text or token shards, every token trained on) or examples (conversations of rtp prepare-data --format chat, trained on the assistant's tokens only; needs a Hugging Face model_source).
            training_method: What trains: full (every weight) or lora (LoRA adapters on the frozen Hugging Face model_source: small checkpoints, the adapters' optimizer state only; the register step logs the adapter in PEFT's format and, with register_merged, the merged model as the version).
            run_name: Run folder name under <mount>/rtp/runs; empty uses the KFP run id (what a recurring run needs). Reuse a name to resume its checkpoints or, with more steps, train it further; a finished one is refused otherwise.
            steps: Total training steps.
            nproc: Training processes in the train pod (GPUs per node, or CPU processes).
            checkpoint_every: Save a checkpoint every N steps.
            checkpoint_mode: How checkpoints are written: async (NVRx, overlaps the write with training), sync, or off.
            seed: Random seed for weights and data order.
            preset: Model size preset: {presets}.
            overrides: Extra trainer config as 'section.field=value' items separated by spaces, e.g. 'optimizer.lr=1e-3'.
            faults: Faults to inject for a chaos drill, 'KIND@STEP[:RANK]' separated by commas (KIND: exception, hang, sigkill, sigkill-during-save, node-loss, slow-save; slow@STEP:RANK:MS makes a rank a straggler); 'none' for a normal run.
            max_loss: Highest holdout loss (nats per byte) a model may have to be registered.
            min_improvement: How much lower than the current champion's holdout loss a model's must be to become champion; otherwise it is registered as challenger.
            keep_runs: After registering, remove old run folders from the volume but the newest keep_runs, those a registered version with an alias came from and those changed in the last 48 h (rtp gc's rule); 0 removes nothing. Set it on a schedule.
            model_name: Registered model name in MLflow.
            register_merged: training_method lora only: register the base with the adapter merged in (exported tensor by tensor in the base's dtype; servable anywhere, e.g. mlflow models serve) as the version, the adapter logged beside it; false registers the adapter alone on its staged base folder (small; serving it needs that folder).
            launcher: Where the ranks run: inpod (in the train step's pod), pytorchjob (a Kubeflow Training Operator PyTorchJob) or trainjob (a Kubeflow Trainer v2 TrainJob).
            fsx_pvc_name: Name of the FSx for Lustre PersistentVolumeClaim mounted in every step.
            gpu_node_selector: Node labels the training pods must match, e.g. {"node.kubernetes.io/instance-type": "p5.48xlarge"}: the train step's pod (launcher inpod) or the job's pods.
            gpu_tolerations: Tolerations of the training pods (Kubernetes toleration objects) for tainted GPU nodes: the train step's pod (launcher inpod) or the job's pods.
            mlflow_secret_name: Kubernetes secret with keys tracking_uri, username, password for the stage-model (a models:/ source), train (live metrics; also a training job's pods, which read it from the job's namespace), validate and register steps; required by each, since register needs MLflow: a missing secret fails the first pod that reads it.
        """
        # The parameters the check step takes, by name (its signature lists them).
        parameters = {
            name: value for name, value in {**locals(), **job}.items() if name in CHECKED_PARAMETERS
        }
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        # The exit task runs whatever happens inside the handler; it deletes a training job
        # a failed or terminated run would otherwise leave running on GPU nodes.
        cleanup = cleanup_op(launcher=launcher, run_id=run_id, job_namespace=job["job_namespace"])
        cleanup.set_display_name("Delete the run's training job if the run did not succeed")
        cleanup.set_caching_options(False)
        platform.apply_common(cleanup, options)
        # Every step finds the run's folder on the shared volume the same way. The mount path
        # is compiled in, not a run parameter: it must be where the volume is mounted
        # (`platform.mount_fsx`, a compile-time constant), and a run could set another.
        run_folder = {"fsx_mount_path": options.fsx_mount_path, "run_name": run_name, "run_id": run_id}
        with dsl.ExitHandler(cleanup, name="Stage the data then train, validate and register the model"):
            # The check step compares the run's model with the memory compiled into validate and register.
            compiled_memory = {
                name: model_step_memory(step, options.model_params) for step, name in COMPILED_MEMORY.items()
            }
            check = check_op(**parameters, **compiled_memory).set_display_name(
                "Check the run's parameters first"
            )
            check.set_caching_options(False)
            platform.apply_common(check, options)
            stage = stage_op(
                source=source,
                s3_endpoint_url=s3_endpoint_url,
                dataset_name=dataset_name,
                **run_folder,
                stage_workers=stage_workers,
            ).set_display_name("Stage the dataset from S3 onto FSx")
            stage.after(check)
            _expose_pod_identity(stage)  # its part pods copy this pod's spec and are owned by it
            base_model = stage_model_op(
                model_source=model_source, s3_endpoint_url=s3_endpoint_url, **run_folder
            ).set_display_name("Stage the model folder from S3 onto FSx")
            base_model.after(check)
            # A registry reference (models:/<name>@<alias>) is resolved and downloaded here.
            platform.use_mlflow_secret(base_model, mlflow_secret_name)
            train = train_op(
                dataset=stage.outputs["dataset"],
                base_model=base_model.outputs["base_model"],
                **run_folder,
                steps=steps,
                nproc=nproc,
                checkpoint_every=checkpoint_every,
                checkpoint_mode=checkpoint_mode,
                seed=seed,
                preset=preset,
                overrides=overrides,
                faults=faults,
                model_init=model_init,
                data_format=data_format,
                training_method=training_method,
                launcher=launcher,
                **job,
                job_image=image,
                fsx_pvc_name=fsx_pvc_name,
                node_selector=gpu_node_selector,
                tolerations=gpu_tolerations,
                image_pull_secrets=list(options.image_pull_secrets),
                pipeline_version=pipeline_version(),
                # A training job's pods read the same secret (by name: its values stay in it).
                mlflow_secret_name=mlflow_secret_name,
                # The training ranks score this model's champion sharded, so validate need not load it.
                model_name=model_name,
            ).set_display_name("Train the model with FSDP and checkpoints")
            # Rank 0 logs live metrics to MLflow: in this pod with launcher inpod, else in a job pod.
            platform.use_mlflow_secret(train, mlflow_secret_name)
            platform.configure_train_pod(
                train,
                options=options,
                node_selector=gpu_node_selector if train_pod_trains else None,
                tolerations=gpu_tolerations if train_pod_trains else None,
            )
            _expose_pod_identity(train)
            validate = validate_op(
                model=train.outputs["model"],
                dataset=stage.outputs["dataset"],
                **run_folder,
                max_loss=max_loss,
                min_improvement=min_improvement,
                model_name=model_name,
                # Every checkpoint the train step commits is a resume point: it must hold optimizer state.
                require_optimizer_state=True,
            ).set_display_name("Validate the checkpoint on held-out data")
            for task in (stage, base_model, train, validate):
                # Each step writes to the shared volume: a cached result could point at a
                # folder another run has since changed. Staging needs no KFP cache: it is
                # keyed by the snapshot id (a hash of the S3 listing) and re-staging an
                # unchanged prefix transfers nothing. Training is never cached.
                task.set_caching_options(False)
            # S3 and MLflow hiccups are worth retrying; a failed training run is not retried
            # blindly here (its own launcher restarts ranks and resumes from checkpoints).
            _retry_with_backoff(stage)
            _retry_with_backoff(base_model)
            with dsl.If(validate.outputs["Output"] != "reject", name="If validation accepted the model"):
                register = (
                    register_op(
                        model=train.outputs["model"],
                        dataset=stage.outputs["dataset"],
                        decision=validate.outputs["Output"],
                        model_name=model_name,
                        register_merged=register_merged,
                        **run_folder,
                        pipeline_version=pipeline_version(),
                    )
                    .set_display_name("Register the model in MLflow")
                    .set_caching_options(False)
                )
                _retry_with_backoff(register)
                platform.use_mlflow_secret(register, mlflow_secret_name)
                # Last: once the new version's alias is set, its run is one a live alias came from.
                retain = retain_op(**run_folder, keep_runs=keep_runs).set_display_name(
                    "Remove old run folders from FSx"
                )
                retain.after(register)
                retain.set_caching_options(False)
                platform.use_mlflow_secret(retain, mlflow_secret_name)
            # Validate scores the current champion from MLflow: it needs the same credentials.
            platform.use_mlflow_secret(validate, mlflow_secret_name)
            platform.size_model_step(validate, "validate", options)
            platform.size_model_step(register, "register", options)
            for task in (stage, base_model, train, validate, register, retain):
                platform.mount_fsx(task, fsx_pvc_name, options)
                platform.apply_common(task, options)

    rtp_pipeline.__doc__ = (rtp_pipeline.__doc__ or "").replace("{presets}", preset_list())
    return dsl.pipeline(
        name=PIPELINE_NAME,
        description="Stage data from S3 to FSx, train with FSDP and "
        "resilient checkpoints, validate the checkpoint, register the model in MLflow.",
    )(with_job_parameters(rtp_pipeline))


def preset_list() -> str:
    """Every preset of the trainer's table, for the parameter's help: 'a, b or c'."""
    names = list(PRESETS)
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def _expose_pod_identity(task: Any) -> None:
    """The pod's name, namespace and uid in its environment (downward API): the train step
    makes its pod the owner of the job it creates, so deleting the pod deletes the job."""
    from kfp import kubernetes

    for env, field_path in (
        (POD_NAME_ENV, "metadata.name"),
        (POD_NAMESPACE_ENV, "metadata.namespace"),
        (POD_UID_ENV, "metadata.uid"),
    ):
        kubernetes.use_field_path_as_env(task, env_name=env, field_path=field_path)


def _retry_with_backoff(task: Any) -> None:
    """S3 and MLflow hiccups are worth retrying: 3 times, 30 s doubling up to 10 minutes."""
    task.set_retry(num_retries=3, backoff_duration="30s", backoff_factor=2, backoff_max_duration="600s")


def compile_pipeline(
    output_path: str,
    image: str = DEFAULT_IMAGE,
    launcher: str = DEFAULT_LAUNCHER,
    options: PlatformOptions | None = None,
) -> str:
    from kfp import compiler

    compiler.Compiler().compile(build_pipeline(image, launcher, options), package_path=output_path)
    path = Path(output_path)
    path.write_text(stable_header(path.read_text()))
    return output_path


_HEADER_DEFAULT = re.compile(r"^(#\s+\w+: \w+ \[Default: )(.*)(\])$")


def stable_header(text: str) -> str:
    """The compiled YAML with its header's default values printed with sorted keys.

    kfp 2.17.3 prints a dict default nested in a list (gpu_tolerations) in an order that
    changes with Python's hash seed; sorting makes `rtp compile` reproducible.
    """
    lines = text.splitlines(keepends=True)
    for index, line in enumerate(lines):
        if not line.startswith("#"):
            break
        match = _HEADER_DEFAULT.match(line.rstrip("\n"))
        if match:
            try:
                value = ast.literal_eval(match.group(2))
            except (ValueError, SyntaxError):
                continue
            lines[index] = f"{match.group(1)}{_sorted_repr(value)}{match.group(3)}\n"
    return "".join(lines)


def _sorted_repr(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_sorted_repr(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_sorted_repr(item) for item in value) + "]"
    return repr(value)
