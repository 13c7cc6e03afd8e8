"""KFP interface of the stage-model step: an S3 model folder or a registered version -> a model folder on the shared volume."""

from kfp.dsl import Model, Output


def stage_model(
    model_source: str,
    s3_endpoint_url: str,
    fsx_mount_path: str,
    run_name: str,
    run_id: str,
    base_model: Output[Model],
) -> None:
    """Copy a Hugging Face model folder from S3 into an immutable, verified snapshot on the FSx volume,
    or a registered MLflow version (resolved once, checked against the files rtp registered) into
    <mount>/rtp/models/<name>/versions/<version>.

    Args:
        model_source: s3://bucket/prefix/<model>/ holding config.json, optional *.safetensors and tokenizer files; models:/<name>@<alias> or models:/<name>/<version>, a version rtp registered (continual training; MLflow from MLFLOW_TRACKING_URI); empty trains the built-in byte-level model and stages nothing.
        s3_endpoint_url: S3-compatible endpoint; empty for AWS.
        fsx_mount_path: where the FSx PVC is mounted in the pod.
        run_name: run folder name; empty uses the KFP run id.
        run_id: the KFP run id (filled in by the pipeline).
        base_model: the snapshot: its path (model_dir, empty for the byte-level model), name and counts as metadata.
    """
    import json
    import logging
    import time

    from components.layout import record_step, run_dir

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.time()
    metadata = {"model_name": "", "model_dir": ""}
    if model_source.startswith("models:/"):
        from components.stage_model.registry_source import stage_registered_model

        metadata = stage_registered_model(model_source, fsx_mount_path)
    elif model_source:
        from components.stage_model.model_folder import stage_model_folder

        metadata = stage_model_folder(model_source, fsx_mount_path, s3_endpoint_url or None)
    base_model.metadata.update(metadata)
    with open(base_model.path, "w") as handle:
        json.dump(metadata, handle)
    record_step(run_dir(fsx_mount_path, run_name, run_id), "stage_model", started, **metadata)
