"""KFP interface of the validate step: checkpoint -> metrics, report, decision."""

from kfp.dsl import Dataset, Input, Markdown, Metrics, Model, Output


def validate_checkpoint(
    model: Input[Model],
    dataset: Input[Dataset],
    fsx_mount_path: str,
    run_name: str,
    run_id: str,
    max_loss: float,
    metrics: Output[Metrics],
    report: Output[Markdown],
) -> str:
    """Check the checkpoint is complete, intact, loadable and finite; score it on the holdout split.

    Args:
        model: the train step's checkpoint.
        dataset: the staged snapshot (the holdout split comes from its manifest).
        fsx_mount_path: where the FSx PVC is mounted in the pod.
        run_name: run folder name; empty uses the KFP run id.
        run_id: the KFP run id (filled in by the pipeline).
        max_loss: highest acceptable holdout loss (nats per byte).
        metrics: holdout loss and perplexity.
        report: what was checked, the numbers and the decision.

    Returns:
        The decision, champion or reject, read by dsl.If (a single output: kfp.local 2.17.3
        cannot resolve a named NamedTuple output inside a dsl.If condition).
    """
    import time

    from components.layout import record_step, run_dir
    from components.validate_checkpoint.validate import report_markdown
    from components.validate_checkpoint.validate import validate_checkpoint as validate

    started = time.time()
    result = validate(model.metadata["checkpoint_dir"], dataset.metadata["snapshot_dir"], max_loss)
    metrics.log_metric("holdout_loss", round(result.holdout_loss, 6))
    metrics.log_metric("perplexity", round(result.perplexity, 4))
    with open(report.path, "w") as handle:
        handle.write(report_markdown(result))
    record_step(run_dir(fsx_mount_path, run_name, run_id), "validate", started, **result.as_dict())
    return result.decision
