"""`rtp gc`: remove old run folders from the shared volume, keeping what the registry needs.

A dry run by default: it prints what would go and how much space that frees; `--apply`
removes it. The rule is components/retention.py's (docs/operations.md, "Retention").
"""

from __future__ import annotations

import argparse
import json
import time

from rtp_cli.errors import UserError

GIB = 2**30


def add_gc_parser(sub: argparse._SubParsersAction) -> None:
    from components.retention import DEFAULT_ACTIVE_WITHIN_S, DEFAULT_KEEP_NEWEST

    p = sub.add_parser(
        "gc",
        help="remove old run folders (<mount>/rtp/runs/*) from the shared volume; a dry run unless --apply",
        description="Remove old run folders, oldest first, keeping: every run a registered model version "
        "with an alias (champion, challenger) came from (asked of MLflow: MLFLOW_TRACKING_URI), the newest "
        "--keep runs, and every run changed within --active-within-hours (it may still be going). Without "
        "--apply nothing is removed: the report says what would go and what it frees.",
    )
    p.add_argument("--fsx-mount-path", required=True, help="where the shared volume is mounted here")
    p.add_argument(
        "--keep", type=int, default=DEFAULT_KEEP_NEWEST, help="newest runs always kept (default: %(default)s)"
    )
    p.add_argument(
        "--active-within-hours",
        type=float,
        default=DEFAULT_ACTIVE_WITHIN_S / 3600,
        help="runs changed more recently are kept: they may still be going (default: %(default)s)",
    )
    p.add_argument("--mlflow-uri", default="", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI)")
    p.add_argument(
        "--without-registry",
        action="store_true",
        help="do not ask MLflow which runs registered versions came from (only with no MLflow: their "
        "checkpoints are then not protected)",
    )
    p.add_argument("--apply", action="store_true", help="remove what the report lists (default: a dry run)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=_cmd_gc)


def _cmd_gc(args: argparse.Namespace) -> int:
    from components import retention
    from components.mlflow_access import tracking_uri_is_configured

    root = retention.runs_root(args.fsx_mount_path)
    if not root.is_dir():
        raise UserError(f"{root} does not exist: is the shared volume mounted at --fsx-mount-path?")
    protected: dict[str, str] = {}
    if args.mlflow_uri:
        import mlflow

        mlflow.set_tracking_uri(args.mlflow_uri)
    if not args.without_registry:
        if not tracking_uri_is_configured():
            raise UserError(
                "MLFLOW_TRACKING_URI is not set: rtp gc asks MLflow which runs registered versions came "
                "from, to keep them; set it, or pass --without-registry to keep only the newest runs"
            )
        import mlflow

        protected = retention.aliased_runs(mlflow.MlflowClient())
    plan, removed = retention.collect(
        args.fsx_mount_path,
        protected,
        keep_newest=args.keep,
        active_within_s=args.active_within_hours * 3600,
        apply=args.apply,
    )
    if args.json:
        print(json.dumps({**plan.as_dict(), "applied": args.apply, "removed": removed}, indent=2))
        return 0
    for run, why in plan.keep:
        print(f"keep    {run.name}: {why}")
    for run in plan.remove:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(run.changed_at))
        print(
            f"{'removed' if args.apply else 'remove '} {run.name}: last changed {when} UTC, {run.bytes / GIB:.2f} GiB"
        )
    verb = "freed" if args.apply else "would free"
    print(
        f"rtp gc: {len(plan.remove)} of {len(plan.remove) + len(plan.keep)} run(s) {'removed' if args.apply else 'to remove'}, "
        f"{verb} {plan.frees_bytes / GIB:.2f} GiB"
        + ("" if args.apply else "; run again with --apply to remove them")
    )
    return 0
