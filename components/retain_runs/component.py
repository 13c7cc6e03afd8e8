"""KFP interface of the retain-runs step: old run folders removed once a run registered its model."""

from kfp.dsl import Markdown, Output


def retain_runs(
    fsx_mount_path: str,
    run_name: str,
    run_id: str,
    keep_runs: int,
    report: Output[Markdown],
) -> None:
    """Remove old run folders from the FSx volume (rtp gc's rule): keep what a live MLflow alias came from, the newest keep_runs and any run that may still be going.

    Args:
        fsx_mount_path: where the FSx PVC is mounted in the pod.
        run_name: run folder name; empty uses the KFP run id.
        run_id: the KFP run id (filled in by the pipeline).
        keep_runs: newest run folders always kept; 0 removes nothing.
        report: each run kept (and why) and each removed, with the space freed.
    """
    import time

    from components.layout import record_step, run_dir

    started = time.time()
    folder = run_dir(fsx_mount_path, run_name, run_id)
    lines = ["# Run folders", ""]
    removed: list[str] = []
    frees = 0
    if keep_runs <= 0:
        lines.append("Retention is off (keep_runs = 0): nothing removed.")
    else:
        import mlflow

        from components import retention

        protected = retention.aliased_runs(mlflow.MlflowClient())
        protected[folder.name] = "this run"
        plan, removed = retention.collect(fsx_mount_path, protected, keep_newest=keep_runs, apply=True)
        frees = plan.frees_bytes
        lines += ["| run | kept because |", "|---|---|", *(f"| {r.name} | {why} |" for r, why in plan.keep)]
        lines += [
            "",
            f"Removed {len(removed)} run folder(s), {frees / 2**30:.2f} GiB: {', '.join(removed) or 'none'}.",
        ]
    print("\n".join(lines))
    with open(report.path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    record_step(folder, "retain_runs", started, keep_runs=keep_runs, removed=removed, freed_bytes=frees)
