"""KFP interface of the check-run step: the run's parameters, checked before anything runs.

Each parameter is its own input: KFP fills a parameter nested in a dict input by pasting
its text into JSON, which breaks on a value with a quote (and kfp.local fails on lists).
The pipeline passes the parameters of this signature by name (pipelines/pipeline.py).
"""

from kfp.dsl import Markdown, Output


def check_run(
    source: str,
    model_source: str,
    dataset_name: str,
    stage_workers: int,
    run_name: str,
    steps: int,
    checkpoint_every: int,
    checkpoint_mode: str,
    seed: int,
    preset: str,
    overrides: str,
    faults: str,
    model_init: str,
    data_format: str,
    training_method: str,
    model_name: str,
    keep_runs: int,
    launcher: str,
    nproc: int,
    nnodes: int,
    gpus_per_node: int,
    efa_per_node: int,
    job_timeout_s: int,
    gpu_node_selector: dict,
    gpu_tolerations: list,
    mlflow_secret_name: str,
    report: Output[Markdown],
    validate_memory: str = "",
    register_memory: str = "",
) -> None:
    """Check every run parameter (names, numbers, choices, S3 URIs, node selector and tolerations, the MLflow secret's name, the training config) before any staging.

    Args:
        source: the pipeline's source parameter.
        model_source: the pipeline's model_source parameter.
        dataset_name: the pipeline's dataset_name parameter.
        stage_workers: the pipeline's stage_workers parameter.
        run_name: the pipeline's run_name parameter.
        steps: the pipeline's steps parameter.
        checkpoint_every: the pipeline's checkpoint_every parameter.
        checkpoint_mode: the pipeline's checkpoint_mode parameter.
        seed: the pipeline's seed parameter.
        preset: the pipeline's preset parameter.
        overrides: the pipeline's overrides parameter.
        faults: the pipeline's faults parameter.
        model_init: the pipeline's model_init parameter.
        data_format: the pipeline's data_format parameter.
        training_method: the pipeline's training_method parameter.
        model_name: the pipeline's model_name parameter.
        keep_runs: the pipeline's keep_runs parameter.
        launcher: the pipeline's launcher parameter.
        nproc: the pipeline's nproc parameter.
        nnodes: the pipeline's nnodes parameter.
        gpus_per_node: the pipeline's gpus_per_node parameter.
        efa_per_node: the pipeline's efa_per_node parameter.
        job_timeout_s: the pipeline's job_timeout_s parameter.
        gpu_node_selector: the pipeline's gpu_node_selector parameter.
        gpu_tolerations: the pipeline's gpu_tolerations parameter.
        mlflow_secret_name: the pipeline's mlflow_secret_name parameter.
        report: what was checked, or the list of wrong parameters.
        validate_memory: the memory the compiled pipeline gives the validate pod (its size for the model, not a run parameter); empty: not checked.
        register_memory: the memory the compiled pipeline gives the register pod; empty: not checked.
    """
    parameters = {name: value for name, value in locals().items() if name != "report"}
    from components.check_run.memory_fit import check_memory_fits
    from components.check_run.parameters import RunParameterError, check_run_parameters, normalized

    try:
        check_run_parameters(parameters)
        memory_plan = check_memory_fits(parameters)  # GPU runs: refuse a job that cannot fit
    except RunParameterError as exc:
        with open(report.path, "w") as handle:
            handle.write(f"# The run's parameters are wrong\n\n{exc}\n")
        raise SystemExit(f"check-run: error: {exc}") from None
    checked = normalized(parameters)
    with open(report.path, "w") as handle:
        handle.write("# The run's parameters are valid\n\n| parameter | value |\n|---|---|\n")
        handle.writelines(f"| {name} | `{checked[name]!r}` |\n" for name in sorted(checked))
        handle.write(f"\n{memory_plan}\n")
