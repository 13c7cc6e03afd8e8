"""KFP interface of the train step: FSDP training with committed DCP checkpoints."""

from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from components.train.job_parameters import with_job_docs
from trainer.config import PRESETS


def train_model(
    dataset: Input[Dataset],
    base_model: Input[Model],
    fsx_mount_path: str,
    run_name: str,
    run_id: str,
    steps: int,
    nproc: int,
    checkpoint_every: int,
    checkpoint_mode: str,
    seed: int,
    preset: str,
    overrides: str,
    faults: str,
    model_init: str,
    model: Output[Model],
    metrics: Output[Metrics],
    goodput_report: Output[HTML],
    launcher: str = "inpod",
    data_format: str = "tokens",
    training_method: str = "full",
    nnodes: int = 1,
    gpus_per_node: int = 0,
    efa_per_node: int = 0,
    job_image: str = "",
    job_namespace: str = "",
    training_runtime: str = "torch-distributed",
    job_timeout_s: int = 86400,
    fsx_pvc_name: str = "fsx-claim",
    node_selector: dict = {},  # noqa: B006 (KFP reads the literal as the default; never mutated)
    tolerations: list = [],  # noqa: B006
    image_pull_secrets: list = [],  # noqa: B006
    instance_type: str = "p5.48xlarge",
    job_cpu_per_node: str = "auto",
    job_memory_per_node: str = "auto",
    job_shm_size: str = "auto",
    job_queue_name: str = "",
    job_priority_class: str = "",
    job_max_restarts: int = -1,
    job_backoff_limit: int = -1,
    job_termination_grace_s: int = -1,
    job_pending_timeout_s: int = 900,
    mlflow_secret_name: str = "mlflow-credentials",
    pipeline_version: str = "",
    model_name: str = "",
) -> None:
    """Train the language model with FSDP, in this pod or as a multi-node job; resume from the last checkpoint.

    Args:
        dataset: the staged snapshot (its metadata holds the snapshot path).
        base_model: the staged Hugging Face model folder (metadata model_dir; empty = the built-in byte-level model).
        fsx_mount_path: where the FSx PVC is mounted in the pod.
        run_name: run folder name; empty uses the KFP run id (a retried task resumes). A name whose training finished in another run is refused unless steps is higher (it then continues).
        run_id: the KFP run id (filled in by the pipeline).
        steps: total optimizer steps.
        nproc: training processes in this pod (GPUs, or CPU processes).
        checkpoint_every: save a checkpoint every N steps.
        checkpoint_mode: async (NVRx), sync or off.
        seed: random seed.
        preset: model/optimizer preset ({presets}).
        overrides: extra config as 'section.field=value' items separated by spaces.
        faults: injected faults for a drill ('KIND@STEP[:RANK]', comma-separated) or 'none'.
        model_init: pretrained (the folder's weights) or random (from its config.json), for a Hugging Face model.
        model: the committed checkpoint: metadata holds its path, step and model config.
        metrics: final loss, steps, training seconds, checkpoint efficiency, goodput, restarts.
        goodput_report: timeline of steps, saves, faults and restarts, with the numbers.
        launcher: inpod (ranks in this pod), pytorchjob (Kubeflow Training Operator) or trainjob (Kubeflow Trainer v2).
        data_format: tokens (a token stream) or examples (conversations: the assistant's tokens only).
        training_method: full (every weight trains) or lora (LoRA adapters on the frozen Hugging Face model).
        job_image: image of the job's pods (the pipeline passes its own image).
        fsx_pvc_name: the FSx PVC the job's pods mount at fsx_mount_path.
        node_selector: node labels the job's pods must match.
        tolerations: tolerations of the job's pods (Kubernetes toleration objects).
        image_pull_secrets: names of the image pull secrets of the job's pods.
        mlflow_secret_name: secret (keys tracking_uri, username, password) the job's pods read as MLFLOW_TRACKING_* by reference, required like in this pod (the check step refuses an empty name).
        pipeline_version: version of the pipeline definition (a tag of the run's MLflow run).
        model_name: registered model whose MLflow champion the training ranks score beside the model (data.eval_champion); empty = none.

    With MLFLOW_TRACKING_URI set, rank 0 logs live metrics to one MLflow run per run folder
    (experiment: the pipeline's name); validate and register log into the same run. This pod
    gets it from the pipeline (the secret mlflow_secret_name); a job's pods, where rank 0 runs
    then, read the same secret themselves. A job is owned by this pod (ownerReference, same
    namespace only), so Kubernetes deletes it with the pod when a run is terminated.
    """
    job = dict(locals())  # the job's parameters are read from here (components/train/job_parameters.py)
    import json
    import shutil
    import time

    from components.layout import PIPELINE_NAME, record_step, run_dir
    from components.train.train import TrainRequest, refuse_finished_run, train_in_pod

    started = time.time()
    folder = run_dir(fsx_mount_path, run_name, run_id)
    refuse_finished_run(folder, run_id, steps)
    request = TrainRequest(
        dataset_dir=dataset.metadata["snapshot_dir"],
        run_folder=folder,
        model_dir=base_model.metadata.get("model_dir", ""),
        preset=preset,
        # Before the user's overrides, so `data.eval_champion=` there still turns it off.
        overrides=" ".join(
            p for p in (f"data.eval_champion={model_name}" if model_name else "", overrides) if p
        ),
        mlflow_experiment=PIPELINE_NAME,
        mlflow_tags={"rtp.kfp_run_id": run_id, "rtp.pipeline_version": pipeline_version},
        settings={
            "steps": steps,
            "checkpoint_every": checkpoint_every,
            "checkpoint_mode": checkpoint_mode,
            "seed": seed,
            "faults": faults,
            "model_init": model_init,
            "data_format": data_format,
            "training_method": training_method,
        },
    )
    if launcher == "inpod":
        result = train_in_pod(request, nproc=nproc)
    else:
        from components.train.job_parameters import job_keywords
        from components.train.job_train import train_with_job

        result = train_with_job(
            launcher,
            request,
            run_id=run_id,
            image=job_image,
            nproc_per_node=nproc,
            pvc_name=fsx_pvc_name,
            mount_path=fsx_mount_path,
            node_selector=node_selector,
            tolerations=tolerations,
            image_pull_secrets=image_pull_secrets,
            mlflow_secret_name=mlflow_secret_name,
            **job_keywords(job),
        )
    summary = result.summary
    from trainer.checkpointing.storage import manifest_sha256

    model.metadata.update(
        {
            "checkpoint_dir": summary.checkpoint,
            # validate and register check the checkpoint against this before loading it
            "checkpoint_manifest_sha256": manifest_sha256(summary.checkpoint) if summary.checkpoint else "",
            "step": summary.steps,
            "model_config": result.model_config,
            "model_sha256": summary.model_sha256,
            "config_sha256": result.config_sha256,
            "dataset_snapshot_id": dataset.metadata.get("snapshot_id", ""),
            "goodput_pct": summary.goodput_pct,
            "efficiency_pct": summary.efficiency_pct,
            "restarts": len(summary.restarts),
            "goodput_report": summary.goodput_report,
            # validate and register log into the MLflow run that holds the training metrics
            "mlflow_run_id": summary.mlflow_run_id,
        }
    )
    with open(model.path, "w") as handle:
        json.dump({"checkpoint_dir": summary.checkpoint, "step": summary.steps}, handle)
    if summary.final_loss is not None:
        metrics.log_metric("final_loss", summary.final_loss)
    metrics.log_metric("steps", summary.steps)
    metrics.log_metric("train_seconds", round(summary.train_seconds, 3))
    metrics.log_metric("checkpoint_efficiency_pct", round(summary.efficiency_pct, 2))
    metrics.log_metric("goodput_pct", summary.goodput_pct)
    metrics.log_metric("restarts", len(summary.restarts))
    metrics.log_metric("steps_redone", summary.lost_steps)
    shutil.copyfile(summary.goodput_report, goodput_report.path)
    record_step(
        folder,
        "train",
        started,
        steps=summary.steps,
        final_loss=summary.final_loss,
        checkpoint=summary.checkpoint,
        model_sha256=summary.model_sha256,
        mlflow_run_id=summary.mlflow_run_id,
        kfp_run_id=run_id,  # a later run of the same name is refused once this one finished
    )


# The preset list comes from the trainer's table (a lightweight component's source keeps the placeholder).
train_model.__doc__ = with_job_docs((train_model.__doc__ or "").replace("{presets}", ", ".join(PRESETS)))
