"""The `rtp upload | run | schedule | runs` subcommands: operate the pipeline on Kubeflow.

Each handler checks everything it can offline first (parameters against the compiled
pipeline, cron and interval syntax, concurrency range), so bad input is rejected before
any request; then it connects with `rtp_cli.kfp_api`, refuses a Kubeflow Pipelines backend
older than the pipeline needs (before uploading or starting anything), and prints one line
per outcome.
Every command is safe to repeat: upload of an existing version and schedule with an
unchanged definition do nothing and say so.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from rtp_cli import kfp_checks
from rtp_cli.kfp_checks import KfpError

DEFAULT_EXPERIMENT = "rtp"
_MIN_BACKEND = ".".join(map(str, kfp_checks.MIN_BACKEND_VERSION))


def add_kfp_parsers(sub: argparse._SubParsersAction) -> None:
    for add in (_add_upload, _add_run, _add_schedule, _add_runs):
        add(sub)


def _connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host",
        default=None,
        help=f"KFP API URL, e.g. http://127.0.0.1:8888 after a port-forward (default: ${kfp_checks.ENDPOINT_ENV})",
    )
    p.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help=f"file holding the bearer token for multi-user Kubeflow (default: ${kfp_checks.TOKEN_ENV}, else "
        f"the file at ${kfp_checks.TOKEN_PATH_ENV} or {kfp_checks.DEFAULT_TOKEN_PATH})",
    )
    # A token value on the command line is visible to every user of the machine (ps, shell
    # history): the old flag is refused with what to do instead.
    p.add_argument("--token", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow sending the token over plain http to a host other than 127.0.0.1",
    )
    p.add_argument(
        "--namespace",
        default=None,
        help=f"profile namespace in multi-user Kubeflow (default: ${kfp_checks.NAMESPACE_ENV}, else the pod's own)",
    )
    p.add_argument("--ui-host", default=None, help="Kubeflow UI URL for printed links (default: --host)")


def _package_arguments(p: argparse.ArgumentParser) -> None:
    from components import DEFAULT_IMAGE

    p.add_argument(
        "--package", default=None, help="a compiled pipeline YAML to use instead of compiling this checkout"
    )
    p.add_argument(
        "--image", default=DEFAULT_IMAGE, help="component image when compiling (default: %(default)s)"
    )


def _params_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a pipeline parameter, repeatable (e.g. --param steps=200 --param checkpoint_mode=sync)",
    )


def _local_package(args: argparse.Namespace, folder: Path) -> Any:
    from rtp_cli.kfp_api import compile_package, load_package

    return load_package(args.package) if args.package else compile_package(folder, args.image)


def _connect(args: argparse.Namespace, submitted: dict[str, Any] | None) -> Any:
    """Connect; when the command submits a pipeline (`submitted`, its compiled spec), refuse a
    backend too old to run it, and warn when its version cannot be read or when it would drop
    the retries of the spec's tasks inside sub-DAGs."""
    from rtp_cli.kfp_api import api_server_image, connect

    if args.token is not None:
        raise kfp_checks.KfpError(
            "--token is refused (a token in argv is visible in ps and shell history): put it in "
            f"${kfp_checks.TOKEN_ENV} or a file named by --token-file"
        )
    conn = connect(
        args.host,
        token_file=args.token_file,
        namespace=args.namespace,
        ui_host=args.ui_host,
        insecure=args.insecure,
    )
    if submitted is None:
        return conn
    evidence = kfp_checks.BackendEvidence(conn.backend_tag)
    if kfp_checks.release_version(conn.backend_tag) is None:
        image, problem = api_server_image()
        evidence = kfp_checks.BackendEvidence(conn.backend_tag, image, problem)
    warning = kfp_checks.check_backend_version(
        conn.host, evidence, kfp_checks.retried_sub_dag_tasks(submitted)
    )
    if warning:
        print(f"rtp {args.command}: warning: {warning}", file=sys.stderr)
    return conn


def _pipeline_name(package: Any, flag: str | None) -> str:
    return flag or str(package.spec.get("pipelineInfo", {}).get("name") or "rtp-resilient-training")


# --- upload ---------------------------------------------------------------------------------


def _add_upload(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "upload",
        help="upload the compiled pipeline to Kubeflow as a new version",
        description="Compile the pipeline (or take --package) and upload it: creates the pipeline the "
        "first time, adds a version after that. The default version name is <package version>-<git "
        "commit> (plus the spec's hash when the checkout has uncommitted changes). Uploading a version "
        "that is already there with the same spec does nothing. A Kubeflow Pipelines backend older than "
        f"{_MIN_BACKEND} is refused (its driver cannot run the pipeline's platform settings).",
    )
    _connection_arguments(p)
    _package_arguments(p)
    p.add_argument(
        "--name", default=None, help="pipeline name in Kubeflow (default: the compiled pipeline's name)"
    )
    p.add_argument("--version", default=None, help="version name (default: <package version>-<git commit>)")
    p.set_defaults(handler=_cmd_upload)


def _cmd_upload(args: argparse.Namespace) -> int:
    from components.versioning import source_identity
    from rtp_cli.kfp_api import upload

    with tempfile.TemporaryDirectory(prefix="rtp-upload-") as folder:
        package = _local_package(args, Path(folder))
        package_version, commit, dirty = source_identity()
        version = args.version or kfp_checks.default_version_name(
            package_version, commit, dirty, package.sha256
        )
        name = _pipeline_name(package, args.name)
        conn = _connect(args, package.spec)
        result = upload(
            conn,
            package,
            name,
            version,
            kfp_checks.version_description(package_version, commit, package.sha256),
        )
    link = f"{conn.ui_host}/#/pipelines/details/{result.pipeline_id}/version/{result.version_id}"
    if result.action == "unchanged":
        print(f"pipeline {name!r} already has version {version!r} with this spec; nothing uploaded: {link}")
    elif result.action == "created":
        print(f"created pipeline {name!r} with version {version!r}: {link}")
    else:
        print(f"uploaded version {version!r} of pipeline {name!r}: {link}")
    return 0


# --- run ------------------------------------------------------------------------------------


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="start a run on Kubeflow and print its link",
        description="Start a run of an uploaded pipeline version (--version NAME, or latest), or of this "
        "checkout's pipeline compiled now (no --version). Parameters are checked against the pipeline "
        "before anything is sent. --wait follows the run and exits 1 unless it succeeds. A Kubeflow Pipelines "
        f"backend older than {_MIN_BACKEND} is refused.",
    )
    _connection_arguments(p)
    _package_arguments(p)
    _params_argument(p)
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="experiment name (default: %(default)s)")
    p.add_argument(
        "--name", default=None, help="pipeline name for --version (default: the compiled pipeline's name)"
    )
    p.add_argument("--version", default=None, help="an uploaded version's name, or 'latest'")
    p.add_argument(
        "--display-name", default=None, help="the run's name in the UI (default: pipeline, version and time)"
    )
    p.add_argument(
        "--wait", action="store_true", help="follow the run to the end; exit 1 unless it succeeded"
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=24 * 3600,
        help="give up waiting after this long (default: %(default)s)",
    )
    p.add_argument(
        "--poll-s", type=float, default=10.0, help="seconds between checks with --wait (default: %(default)s)"
    )
    p.set_defaults(handler=_cmd_run)


def _resolve_version(conn: Any, name: str, version: str) -> tuple[str, dict[str, Any]]:
    from rtp_cli.kfp_api import find_pipeline, find_version

    pipeline = find_pipeline(conn, name)
    if pipeline is None:
        raise KfpError(f"no pipeline named {name!r} at {conn.host}; upload it first with `rtp upload`")
    found = find_version(conn, pipeline["pipeline_id"], version)
    if found is None:
        raise KfpError(f"pipeline {name!r} has no version {version!r}; see them with the UI or `rtp upload`")
    return pipeline["pipeline_id"], found


def _cmd_run(args: argparse.Namespace) -> int:
    from rtp_cli.kfp_api import ensure_experiment, start_run, utc_now, version_spec, wait_for_run

    if args.poll_s <= 0 or args.timeout_s <= 0:
        raise KfpError("--poll-s and --timeout-s must be positive")
    with tempfile.TemporaryDirectory(prefix="rtp-run-") as folder:
        package = _local_package(args, Path(folder))
        parameters = kfp_checks.parse_parameter_arguments(
            args.param, kfp_checks.pipeline_parameters(package.spec)
        )
        name = _pipeline_name(package, args.name)
        conn = _connect(args, package.spec)
        stamp = utc_now().strftime("%Y-%m-%d %H:%M:%S")
        if args.version:
            pipeline_id, version = _resolve_version(conn, name, args.version)
            # The uploaded version may predate this checkout: check against its own spec too.
            kfp_checks.parse_parameter_arguments(
                args.param, kfp_checks.pipeline_parameters(version_spec(version))
            )
            display_name = args.display_name or f"{name} {version['display_name'] or version['name']} {stamp}"
            experiment_id = ensure_experiment(conn, args.experiment)
            run_id = start_run(
                conn,
                experiment_id,
                display_name,
                parameters,
                pipeline_id=pipeline_id,
                version_id=version["pipeline_version_id"],
            )
        else:
            display_name = args.display_name or f"{name} (local package) {stamp}"
            experiment_id = ensure_experiment(conn, args.experiment)
            run_id = start_run(conn, experiment_id, display_name, parameters, package=package)
    print(f"started run {display_name!r}: {kfp_checks.run_link(conn.ui_host, run_id)}")
    if not args.wait:
        return 0
    run = wait_for_run(
        conn,
        run_id,
        args.timeout_s,
        args.poll_s,
        on_state=lambda state: print(f"run {run_id}: {state}", flush=True),
    )
    if run.get("state") == "SUCCEEDED":
        return 0
    error = (run.get("error") or {}).get("message")
    print(
        f"rtp run: run {run_id} ended {run.get('state')}"
        + (f": {error}" if error else "")
        + f"; see {kfp_checks.run_link(conn.ui_host, run_id)}",
        file=sys.stderr,
    )
    return 1


# --- schedule -------------------------------------------------------------------------------


def _add_schedule(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "schedule",
        help="create, update, enable, disable or delete a recurring run by name",
        description="Make the recurring run NAME exist as described, whatever was there before: creates "
        "it, leaves it alone when it already matches, or replaces it when it differs (the KFP API has no "
        "update call). Runs an uploaded version (--version, default the newest). One run at a time and no "
        "catch-up of missed runs unless asked. Cron takes 5 fields (minute first, converted) or KFP's 6 "
        f"(seconds first). Creating or replacing one refuses a Kubeflow Pipelines backend older than {_MIN_BACKEND}.",
    )
    _connection_arguments(p)
    _package_arguments(p)
    _params_argument(p)
    p.add_argument("--name", required=True, help="the recurring run's name (its identity)")
    p.add_argument(
        "--pipeline", default=None, help="uploaded pipeline name (default: the compiled pipeline's name)"
    )
    p.add_argument(
        "--version", default="latest", help="uploaded version name (default: %(default)s, pinned now)"
    )
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="experiment name (default: %(default)s)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--cron", default=None, help="e.g. '0 3 * * *' (03:00 daily) or '0 0 3 * * *'")
    when.add_argument("--interval", default=None, help="time between runs, e.g. 6h, 30m, 1d")
    p.add_argument(
        "--max-concurrency", type=int, default=1, help="runs allowed at once, 1-10 (default: %(default)s)"
    )
    p.add_argument("--catchup", action="store_true", help="start the runs missed while disabled or behind")
    state = p.add_mutually_exclusive_group()
    state.add_argument(
        "--enable", action="store_true", help="enable it (creating it needs --cron/--interval)"
    )
    state.add_argument(
        "--disable", action="store_true", help="disable it (creating it needs --cron/--interval)"
    )
    state.add_argument("--delete", action="store_true", help="delete it; nothing to do when it is absent")
    p.set_defaults(handler=_cmd_schedule)


def _cmd_schedule(args: argparse.Namespace) -> int:
    from rtp_cli import kfp_api as kc

    cron = kfp_checks.kfp_cron(args.cron) if args.cron else None
    interval_s = kfp_checks.interval_seconds(args.interval) if args.interval else None
    kfp_checks.check_max_concurrency(args.max_concurrency)
    if args.delete and (cron or interval_s or args.param):
        raise KfpError("--delete takes no --cron, --interval or --param")
    defines = cron is not None or interval_s is not None
    if not defines and not (args.enable or args.disable or args.delete):
        raise KfpError("give --cron or --interval to create or update, or one of --enable/--disable/--delete")
    with tempfile.TemporaryDirectory(prefix="rtp-schedule-") as folder:
        package = _local_package(args, Path(folder))
        parameters = kfp_checks.parse_parameter_arguments(
            args.param, kfp_checks.pipeline_parameters(package.spec)
        )
    pipeline_name = _pipeline_name(package, args.pipeline)
    conn = _connect(
        args, package.spec if defines else None
    )  # enabling, disabling or deleting submits nothing

    if not defines:  # only change the state of an existing one
        experiment_id = kc.find_experiment(conn, args.experiment)
        existing = kc.find_recurring_runs(conn, experiment_id, args.name) if experiment_id else []
        if not existing:
            if args.delete:
                print(
                    f"no recurring run named {args.name!r} in experiment {args.experiment!r}; nothing to delete"
                )
                return 0
            raise KfpError(
                f"no recurring run named {args.name!r} in experiment {args.experiment!r}; "
                "create it with --cron or --interval"
            )
        for item in existing:
            if args.delete:
                kc.delete_recurring_run(conn, item["recurring_run_id"])
            else:
                kc.set_recurring_run_enabled(conn, item["recurring_run_id"], args.enable)
        verb = "deleted" if args.delete else ("enabled" if args.enable else "disabled")
        print(f"{verb} recurring run {args.name!r} ({', '.join(i['recurring_run_id'] for i in existing)})")
        return 0

    pipeline_id, version = _resolve_version(conn, pipeline_name, args.version)
    kfp_checks.parse_parameter_arguments(args.param, kfp_checks.pipeline_parameters(kc.version_spec(version)))
    experiment_id = kc.ensure_experiment(conn, args.experiment)
    wanted = kc.Schedule(
        name=args.name,
        experiment_id=experiment_id,
        pipeline_id=pipeline_id,
        version_id=version["pipeline_version_id"],
        parameters=parameters,
        cron=cron,
        interval_s=interval_s,
        max_concurrency=args.max_concurrency,
        no_catchup=not args.catchup,
        description=f"rtp schedule of {pipeline_name} version {version['name']}",
    )
    existing = kc.find_recurring_runs(conn, experiment_id, args.name)
    when = f"cron '{cron}'" if cron else f"every {interval_s} s"
    if len(existing) == 1 and kc.same_schedule(existing[0], wanted):
        current = existing[0]
        enabled_now = current.get("status") != "DISABLED"
        if (args.enable and not enabled_now) or (args.disable and enabled_now):
            kc.set_recurring_run_enabled(conn, current["recurring_run_id"], args.enable)
            print(
                f"recurring run {args.name!r} unchanged ({when}); {'enabled' if args.enable else 'disabled'} it"
            )
        else:
            print(
                f"recurring run {args.name!r} already matches ({when}, version {version['name']}); nothing changed"
            )
        return 0
    # Keep a disabled schedule disabled when it is redefined, unless told otherwise.
    enabled = args.enable or (not args.disable and all(i.get("status") != "DISABLED" for i in existing))
    for item in existing:
        kc.delete_recurring_run(conn, item["recurring_run_id"])
    recurring_run_id = kc.create_recurring_run(conn, wanted, enabled)
    verb = "replaced" if existing else "created"
    print(
        f"{verb} recurring run {args.name!r} ({recurring_run_id}): {when}, version {version['name']}, "
        f"max concurrency {args.max_concurrency}, {'catch-up' if args.catchup else 'no catch-up'}, "
        f"{'enabled' if enabled else 'disabled'}"
    )
    return 0


# --- runs -----------------------------------------------------------------------------------


def _add_runs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "runs",
        help="list recent runs with state, duration and key metrics",
        description="List recent runs, newest first. The KFP API does not return metric values (they live "
        "in ML Metadata), so with --fsx-mount-path the metrics columns come from the step records each run "
        "wrote on the shared volume.",
    )
    _connection_arguments(p)
    p.add_argument(
        "--experiment", default=None, help="only this experiment's runs (default: all in the namespace)"
    )
    p.add_argument("--limit", type=int, default=10, help="how many runs (default: %(default)s)")
    p.add_argument(
        "--fsx-mount-path",
        default=None,
        help="the shared volume, mounted here, to read each run's metrics from",
    )
    p.set_defaults(handler=_cmd_runs)


def _cmd_runs(args: argparse.Namespace) -> int:
    from rtp_cli import kfp_api as kc

    if not 1 <= args.limit <= 1000:
        raise KfpError(f"--limit {args.limit} must be within 1-1000")
    conn = _connect(args, None)
    experiment_id = None
    if args.experiment:
        experiment_id = kc.find_experiment(conn, args.experiment)
        if experiment_id is None:
            raise KfpError(f"no experiment named {args.experiment!r}")
    runs = kc.recent_runs(conn, experiment_id, args.limit)
    metrics = {}
    if args.fsx_mount_path:
        metrics = {
            r["run_id"]: kfp_checks.metrics_from_step_records(kc.step_records(args.fsx_mount_path, r))
            for r in runs
        }
    print(kfp_checks.format_runs_table(runs, kc.utc_now(), metrics))
    return 0
