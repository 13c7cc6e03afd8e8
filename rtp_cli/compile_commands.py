"""`rtp compile`: write the pipeline's KFP IR YAML, with the platform flags it takes.

`add_platform_arguments` adds the flags of `rtp compile` that cannot be pipeline
parameters (the launcher default, the FSx mount path, pull policy and secrets, the train
pod's requests); `platform_options_from_args` turns them into the `PlatformOptions` that
`pipelines.pipeline.compile_pipeline` applies. Nothing heavy is imported until a handler runs.
"""

from __future__ import annotations

import argparse

from components.train.jobs import DEFAULT_LAUNCHER, LAUNCHERS
from pipelines.platform import IMAGE_PULL_POLICIES, PlatformOptions


def add_compile_parser(sub: argparse._SubParsersAction) -> None:
    from components import DEFAULT_IMAGE

    p = sub.add_parser(
        "compile",
        help="write the pipeline's KFP IR YAML",
        description="Compile the pipeline to KFP IR YAML for upload to Kubeflow Pipelines.",
    )
    p.add_argument("-o", "--output", default="pipeline.yaml", help="output file (default: %(default)s)")
    p.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help="component image built from the Dockerfile (default: %(default)s)",
    )
    add_platform_arguments(p)
    p.set_defaults(handler=_cmd_compile)


def _cmd_compile(args: argparse.Namespace) -> int:
    from pipelines.pipeline import compile_pipeline

    options = platform_options_from_args(args)
    path = compile_pipeline(args.output, image=args.image, launcher=args.launcher, options=options)
    print(f"wrote {path} (image {args.image}, launcher {args.launcher})")
    return 0


def add_platform_arguments(p: argparse.ArgumentParser) -> None:
    defaults = PlatformOptions()
    p.add_argument(
        "--launcher",
        default=DEFAULT_LAUNCHER,
        choices=LAUNCHERS,
        help="default of the pipeline's launcher parameter (default: %(default)s)",
    )
    p.add_argument(
        "--fsx-mount-path",
        default=defaults.fsx_mount_path,
        help="where every step mounts the FSx PVC, compiled in: no run parameter changes it (default: %(default)s)",
    )
    p.add_argument(
        "--image-pull-policy",
        default=defaults.image_pull_policy,
        choices=IMAGE_PULL_POLICIES,
        help="pull policy of every step (default: %(default)s)",
    )
    p.add_argument(
        "--image-pull-secret",
        action="append",
        default=[],
        metavar="NAME",
        help="image pull secret of every step and training job pod (repeatable)",
    )
    p.add_argument(
        "--train-pod-cpu",
        default=defaults.train_pod_cpu,
        help="CPU request of the train pod (default: %(default)s)",
    )
    p.add_argument(
        "--train-pod-memory",
        default=defaults.train_pod_memory,
        help="memory request of the train pod (default: %(default)s)",
    )
    p.add_argument(
        "--train-pod-gpus",
        type=int,
        default=defaults.train_pod_gpus,
        help="GPUs of the train pod, for launcher inpod (default: %(default)s)",
    )
    p.add_argument("--shm-size", default="", help="size limit of the trainer's /dev/shm (default: none)")
    p.add_argument(
        "--model-params",
        type=float,
        default=defaults.model_params,
        help="parameters of the largest model trained, e.g. 8e9: sizes the validate and register "
        "pods' memory (docs/eks.md, Pod sizes; default: sized for the CPU presets)",
    )


def platform_options_from_args(args: argparse.Namespace) -> PlatformOptions:
    return PlatformOptions(
        fsx_mount_path=args.fsx_mount_path,
        image_pull_policy=args.image_pull_policy,
        image_pull_secrets=list(args.image_pull_secret),
        train_pod_cpu=args.train_pod_cpu,
        train_pod_memory=args.train_pod_memory,
        train_pod_gpus=args.train_pod_gpus,
        shm_size=args.shm_size,
        model_params=args.model_params,
    ).check()
