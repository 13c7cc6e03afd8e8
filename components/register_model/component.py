"""KFP interface of the register step: a validated checkpoint -> an MLflow model version."""

from typing import NamedTuple

from kfp.dsl import Dataset, Input, Markdown, Metrics, Model, Output


def register_model(
    model: Input[Model],
    dataset: Input[Dataset],
    decision: str,
    model_name: str,
    fsx_mount_path: str,
    run_name: str,
    run_id: str,
    pipeline_version: str,
    metrics: Output[Metrics],
    report: Output[Markdown],
    register_merged: bool = True,
) -> NamedTuple("Outputs", [("model_uri", str), ("version", str)]):  # type: ignore[valid-type]  # the form KFP reads
    """Log the checkpoint to MLflow as a servable model, register a version, and set its alias.

    The tracking server and credentials come from MLflow's environment variables
    (MLFLOW_TRACKING_URI, ...; a Kubernetes secret on a cluster). A retried task for the same
    checkpoint returns the version already registered.

    Args:
        model: the train step's checkpoint.
        dataset: the staged snapshot (recorded as lineage).
        decision: the validate step's decision, champion or challenger; it becomes the version's alias.
        model_name: registered model name in MLflow.
        fsx_mount_path: where the FSx PVC is mounted in the pod.
        run_name: run folder name; empty uses the KFP run id.
        run_id: the KFP run id (filled in by the pipeline).
        pipeline_version: version of the pipeline definition (recorded as lineage).
        metrics: the registered version number, and whether this task created it (0 on a retry).
        report: the model URI, version, alias and how to load it.
        register_merged: a LoRA checkpoint: the version is the base with the adapter merged in (the adapter logged beside it in PEFT's format); false: the version is the adapter on its staged base folder.

    Returns:
        model_uri: models:/<name>/<version>; version: the registered version.
    """
    import logging
    import time
    from collections import namedtuple

    from components.layout import record_step, run_dir
    from components.register_model.lineage import Lineage, training_figures, validation_figures
    from components.register_model.register import register_checkpoint

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.time()
    folder = run_dir(fsx_mount_path, run_name, run_id)
    lineage = Lineage(
        kfp_run_id=run_id,
        pipeline_version=pipeline_version,
        dataset_snapshot_id=str(dataset.metadata.get("snapshot_id", "")),
        dataset_manifest_sha256=str(dataset.metadata.get("manifest_sha256", "")),
        training_figures=training_figures(folder / "train" / "summary.json"),
        training_report=str(folder / "train" / "goodput.html"),
        validation_figures=validation_figures(folder / "steps" / "validate.json"),
    )
    result = register_checkpoint(
        model.metadata["checkpoint_dir"],
        model_name,
        decision,
        lineage,
        published_manifest_sha256=model.metadata.get("checkpoint_manifest_sha256", ""),
        training_run_id=str(model.metadata.get("mlflow_run_id", "")),
        register_merged=register_merged,
    )
    record_step(folder, "register", started, **result.as_dict())
    metrics.log_metric("registered_version", int(result.version))
    metrics.log_metric("created", int(result.created))
    with open(report.path, "w") as handle:
        handle.write(
            f"# Registered {result.model_name} version {result.version}\n\n"
            f"| | |\n|---|---|\n| model URI | `{result.model_uri}` |\n| alias | `{result.alias}` |\n"
            f"| new version | {'yes' if result.created else 'no (this checkpoint was registered before)'} |\n\n"
            f'Load it with `mlflow.pyfunc.load_model("models:/{result.model_name}@{result.alias}")`'
            + (
                f' or `mlflow.transformers.load_model("models:/{result.model_name}@{result.alias}")`; '
                "its `model/` folder loads with `AutoModelForCausalLM.from_pretrained`.\n"
                if result.model_kind == "hf"
                else ".\n"
            )
            + (
                f"\nThe LoRA adapter (PEFT's format: `PeftModel.from_pretrained(base, folder)`) is at `{result.adapter_uri}`.\n"
                if result.adapter_uri
                else ""
            )
        )
    Outputs = namedtuple("Outputs", ["model_uri", "version"])
    return Outputs(result.model_uri, result.version)
