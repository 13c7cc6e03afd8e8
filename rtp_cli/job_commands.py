"""`rtp render-job`: print the PyTorchJob or TrainJob manifest the train step would create.

The manifest is built by the same pure function the step calls
(`components.train.jobs.job_manifest`), for review or a manual `kubectl apply`; nothing is
sent to a cluster. Nothing heavy is imported until the handler runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from components.train.job_parameters import add_render_flags, render_keywords
from components.train.jobs import JOB_LAUNCHERS
from pipelines.platform import (
    DEFAULT_GPU_TOLERATIONS,
    DEFAULT_MLFLOW_SECRET,
    DEFAULT_PVC_NAME,
    MLFLOW_SECRET_KEYS,
    PlatformOptions,
)
from trainer.arguments import PIPELINE_SETTINGS, add_named_arguments, add_preset_argument, named_from_args


def add_render_job_parser(sub: argparse._SubParsersAction) -> None:
    from components import DEFAULT_IMAGE

    p = sub.add_parser(
        "render-job",
        help="print the PyTorchJob or TrainJob manifest the train step would create",
        description="Print, as YAML, the training job the train step creates with launcher pytorchjob or "
        "trainjob: each pod runs ft_launcher with a c10d rendezvous, mounts the FSx PVC and a memory-backed "
        "/dev/shm, and reads MLflow's settings from a secret. Nothing is sent to a cluster.",
    )
    p.add_argument("--mode", required=True, choices=JOB_LAUNCHERS, help="which job to render")
    p.add_argument("-o", "--output", default="-", help="output file; - is stdout (default: %(default)s)")
    p.add_argument("--run-id", default="manual", help="KFP run id the job is named and labelled after")
    p.add_argument("--run-name", default="", help="run folder under <mount>/rtp/runs (default: the run id)")
    p.add_argument("--namespace", default="kubeflow-user", help="namespace (default: %(default)s)")
    p.add_argument("--image", default=DEFAULT_IMAGE, help="image of the pods (default: %(default)s)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per pod (default: %(default)s)")
    add_render_flags(p)  # --nnodes, --gpus-per-node, ... : the train step's job parameters
    p.add_argument("--pvc-name", default=DEFAULT_PVC_NAME, help="FSx PVC (default: %(default)s)")
    p.add_argument(
        "--fsx-mount-path", default=PlatformOptions().fsx_mount_path, help="(default: %(default)s)"
    )
    p.add_argument(
        "--node-selector",
        default="{}",
        help='node labels as JSON, e.g. \'{"node.kubernetes.io/instance-type": "p5.48xlarge"}\'',
    )
    p.add_argument(
        "--tolerations",
        default=json.dumps(DEFAULT_GPU_TOLERATIONS),
        help="tolerations as a JSON list (default: %(default)s)",
    )
    p.add_argument(
        "--service-account", default="", help="service account of the pods (default: namespace default)"
    )
    p.add_argument("--image-pull-secret", action="append", default=[], metavar="NAME", help="(repeatable)")
    p.add_argument(
        "--mlflow-secret-name",
        default=DEFAULT_MLFLOW_SECRET,
        metavar="NAME",
        help="secret in the namespace whose keys the pods read as "
        f"{_key_to_env_help()} (by reference, optional), so rank 0 logs live metrics to MLflow; "
        "'' = no MLflow (default: %(default)s)",
    )
    p.add_argument(
        "--deadline-s", type=int, default=86400, help="activeDeadlineSeconds (default: %(default)s)"
    )
    p.add_argument("--dataset-name", default="demo-corpus", help="dataset under <mount>/rtp/datasets")
    add_preset_argument(p)
    add_named_arguments(p, PIPELINE_SETTINGS)
    p.add_argument("--overrides", default="", help="extra trainer config, 'section.field=value ...'")
    p.set_defaults(handler=_cmd_render_job)


def _key_to_env_help() -> str:
    """`tracking_uri -> MLFLOW_TRACKING_URI, ...`, from the one mapping the pods get, so the
    help cannot drift from the manifest."""
    return ", ".join(f"{key} -> {variable}" for key, variable in MLFLOW_SECRET_KEYS.items())


def _json_arg(flag: str, text: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not valid JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{flag} must be a JSON {'object' if kind is dict else 'list'}, got {text!r}")
    return value


def render_job(args: argparse.Namespace) -> dict[str, Any]:
    from components.layout import dataset_root, run_dir
    from components.train.job_train import job_settings_for_run
    from components.train.jobs import job_manifest
    from components.train.train import TrainRequest

    request = TrainRequest(
        dataset_dir=str(dataset_root(args.fsx_mount_path, args.dataset_name) / "current"),
        run_folder=run_dir(args.fsx_mount_path, args.run_name, args.run_id),
        preset=args.preset,
        overrides=args.overrides,
        settings=named_from_args(args, PIPELINE_SETTINGS),
    )
    settings = job_settings_for_run(
        request,
        run_id=args.run_id,
        # Never deleted by a pipeline's exit handler: a person applies this one.
        managed_by="rtp-render-job",
        namespace=args.namespace,
        image=args.image,
        nproc_per_node=args.nproc_per_node,
        pvc_name=args.pvc_name,
        mount_path=args.fsx_mount_path,
        node_selector=_json_arg("--node-selector", args.node_selector, dict),
        tolerations=_json_arg("--tolerations", args.tolerations, list),
        service_account=args.service_account,
        image_pull_secrets=list(args.image_pull_secret),
        mlflow_secret_name=args.mlflow_secret_name,
        deadline_s=args.deadline_s,
        **render_keywords(args),
    )
    return job_manifest(args.mode, settings)


def _cmd_render_job(args: argparse.Namespace) -> int:
    import yaml

    text = yaml.safe_dump(render_job(args), sort_keys=False, width=120)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as handle:
            handle.write(text)
        print(f"wrote {args.output} ({args.mode})")
    return 0
