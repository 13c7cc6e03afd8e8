"""KFP interface of the train step: FSDP training with committed DCP checkpoints."""

from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output


def train_model(
    dataset: Input[Dataset],
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
    model: Output[Model],
    metrics: Output[Metrics],
    goodput_report: Output[HTML],
) -> None:
    """Train the language model with FSDP on this pod's ranks; resume from the run's last checkpoint.

    Args:
        dataset: the staged snapshot (its metadata holds the snapshot path).
        fsx_mount_path: where the FSx PVC is mounted in the pod.
        run_name: run folder name; empty uses the KFP run id (a retried task resumes).
        run_id: the KFP run id (filled in by the pipeline).
        steps: total optimizer steps.
        nproc: training processes in this pod (GPUs, or CPU processes).
        checkpoint_every: save a checkpoint every N steps.
        checkpoint_mode: async (NVRx), torch-async, sync or off.
        seed: random seed.
        preset: model/optimizer preset (tiny-cpu, small-cpu, gpu-125m).
        overrides: extra config as 'section.field=value' items separated by spaces.
        faults: injected faults for a drill ('KIND@STEP[:RANK]', comma-separated) or 'none'.
        model: the committed checkpoint: metadata holds its path, step and model config.
        metrics: final loss, steps, training seconds, checkpoint efficiency, goodput, restarts.
        goodput_report: timeline of steps, saves, faults and restarts, with the numbers.
    """
    import json
    import shutil
    import time

    from components.layout import record_step, run_dir
    from components.train.train import train_in_pod

    started = time.time()
    folder = run_dir(fsx_mount_path, run_name, run_id)
    summary = train_in_pod(
        dataset_dir=dataset.metadata["snapshot_dir"],
        run_folder=folder,
        steps=steps,
        nproc=nproc,
        checkpoint_every=checkpoint_every,
        checkpoint_mode=checkpoint_mode,
        seed=seed,
        preset=preset,
        overrides=overrides,
        faults=faults,
    )
    model.metadata.update(
        {
            "checkpoint_dir": summary["checkpoint"],
            "step": summary["steps"],
            "model_config": summary["model_config"],
            "model_sha256": summary["model_sha256"],
            "config_sha256": summary["config_sha256"],
            "dataset_snapshot_id": dataset.metadata.get("snapshot_id", ""),
            "goodput_pct": summary.get("goodput_pct"),
            "efficiency_pct": summary.get("efficiency_pct"),
            "restarts": len(summary.get("restarts", [])),
            "goodput_report": summary.get("goodput_report", ""),
        }
    )
    with open(model.path, "w") as handle:
        json.dump({"checkpoint_dir": summary["checkpoint"], "step": summary["steps"]}, handle)
    if summary["final_loss"] is not None:
        metrics.log_metric("final_loss", summary["final_loss"])
    metrics.log_metric("steps", summary["steps"])
    metrics.log_metric("train_seconds", round(summary["train_seconds"], 3))
    metrics.log_metric("checkpoint_efficiency_pct", round(summary["efficiency_pct"], 2))
    metrics.log_metric("goodput_pct", summary["goodput_pct"])
    metrics.log_metric("restarts", len(summary["restarts"]))
    metrics.log_metric("steps_redone", summary["lost_steps"])
    shutil.copyfile(summary["goodput_report"], goodput_report.path)
    record_step(
        folder,
        "train",
        started,
        steps=summary["steps"],
        final_loss=summary["final_loss"],
        checkpoint=summary["checkpoint"],
        model_sha256=summary["model_sha256"],
    )
