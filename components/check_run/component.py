"""KFP interface of the check-run step: the run's parameters, checked before anything runs."""

from kfp.dsl import Markdown, Output


def check_run(parameters: dict, report: Output[Markdown]) -> None:
    """Check every run parameter (names, numbers, choices, S3 URIs, the training config) before any staging.

    Args:
        parameters: the pipeline run's parameters, by name.
        report: what was checked, or the list of wrong parameters.
    """
    from components.check_run.parameters import RunParameterError, check_run_parameters, normalized

    try:
        check_run_parameters(parameters)
    except RunParameterError as exc:
        with open(report.path, "w") as handle:
            handle.write(f"# The run's parameters are wrong\n\n{exc}\n")
        raise SystemExit(f"check-run: error: {exc}") from None
    checked = normalized(parameters)
    with open(report.path, "w") as handle:
        handle.write("# The run's parameters are valid\n\n| parameter | value |\n|---|---|\n")
        handle.writelines(f"| {name} | `{checked[name]!r}` |\n" for name in sorted(checked))
