"""KFP interface of the validate step: checkpoint -> metrics, report, decision."""

from kfp.dsl import Dataset, Input, Markdown, Metrics, Model, Output


def validate_checkpoint(
    model: Input[Model],
    dataset: Input[Dataset],
    fsx_mount_path: str,
    run_name: str,
    run_id: str,
    max_loss: float,
    min_improvement: float,
    model_name: str,
    require_optimizer_state: bool,
    metrics: Output[Metrics],
    report: Output[Markdown],
) -> str:
    """Check the checkpoint (complete, loadable, sane); score it on the holdout split against the champion.

    The current champion comes from MLflow (MLFLOW_TRACKING_URI, a Kubernetes secret on a
    cluster); with no tracking server configured the comparison is skipped.

    Args:
        model: the train step's checkpoint.
        dataset: the staged snapshot (the holdout split comes from its manifest).
        fsx_mount_path: where the FSx PVC is mounted in the pod.
        run_name: run folder name; empty uses the KFP run id.
        run_id: the KFP run id (filled in by the pipeline).
        max_loss: highest acceptable holdout loss (nats per byte = bits per byte x ln 2).
        min_improvement: how much lower than the champion's the holdout loss (nats per byte) must be to replace it.
        model_name: registered model whose champion the checkpoint is compared with.
        require_optimizer_state: fail when the checkpoint cannot be resumed (no optimizer state).
        metrics: holdout_loss (nats per token), perplexity, holdout_bits_per_byte, and (when
            there is a champion) champion_loss, champion_bits_per_byte, delta_bits_per_byte and
            delta (champion - candidate in nats per byte, positive when the candidate is better).
        report: what was checked, the numbers, the decision and why.

    Returns:
        The decision, champion, challenger or reject, read by dsl.If (a single output:
        kfp.local 2.17.3 cannot resolve a named NamedTuple output inside a dsl.If condition).
    """
    import time

    from components.layout import record_step, run_dir
    from components.mlflow_access import tracking_uri_is_configured
    from components.validate_checkpoint.validate import report_markdown
    from components.validate_checkpoint.validate import validate_checkpoint as validate

    started = time.time()
    result = validate(
        model.metadata["checkpoint_dir"],
        dataset.metadata["snapshot_dir"],
        max_loss,
        min_improvement=min_improvement,
        champion_model_name=model_name if tracking_uri_is_configured() else "",
        require_optimizer_state=require_optimizer_state,
        published_manifest_sha256=model.metadata.get("checkpoint_manifest_sha256", ""),
    )
    metrics.log_metric("holdout_loss", round(result.holdout_loss, 6))
    metrics.log_metric("perplexity", round(result.perplexity, 4))
    metrics.log_metric("holdout_bits_per_byte", round(result.holdout_bits_per_byte, 6))
    if result.champion_loss is not None and result.champion_bits_per_byte is not None:
        metrics.log_metric("champion_loss", round(result.champion_loss, 6))
        metrics.log_metric("champion_bits_per_byte", round(result.champion_bits_per_byte, 6))
        metrics.log_metric("delta_bits_per_byte", round(result.delta_bits_per_byte or 0.0, 6))
        metrics.log_metric("delta", round(result.delta or 0.0, 6))
    training_run_id = str(model.metadata.get("mlflow_run_id", ""))
    if training_run_id and tracking_uri_is_configured():
        from components.validate_checkpoint.validate import log_to_training_run

        log_to_training_run(training_run_id, result, step=int(model.metadata.get("step", 0)))
    with open(report.path, "w") as handle:
        handle.write(report_markdown(result))
    record_step(run_dir(fsx_mount_path, run_name, run_id), "validate", started, **result.as_dict())
    return result.decision
