"""`rtp bench checkpoint | finetune | recovery | scale | scaling | staging | throughput`: the side-by-side benchmarks on the command line.

Each benchmark lives in `benchmarks/` and brings its own flags (`add_arguments`), its
description (the module docstring) and its handler (`main`); this module only lists them
under `rtp bench`, each with its one-line help.
"""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from benchmarks import checkpoint, finetune, recovery, scale, scaling, staging, throughput

    p = sub.add_parser(
        "bench",
        help="side-by-side benchmarks (JSON + table)",
        description="Benchmarks that compare alternatives in one run and print JSON and a table.",
    )
    kinds = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module, help_text in (
        ("checkpoint", checkpoint, "the same training under every checkpoint mode"),
        ("finetune", finetune, "full fine-tuning vs LoRA on the same model and conversations"),
        ("recovery", recovery, "the same soft fault under in-process, ft_launcher and cold restart"),
        ("scale", scale, "data, validate and register at two sizes each: what their memory grows with"),
        ("scaling", scaling, "the same training as FSDP over every rank and as HSDP (replicate x shard)"),
        (
            "staging",
            staging,
            "rtp stage vs rclone vs aws s3 sync vs a boto3 loop on a real S3 server (wall, CPU s per GiB)",
        ),
        ("throughput", throughput, "the rtp training stack vs a bare FSDP loop: tokens/s, MFU, the tax"),
    ):
        bench = kinds.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(bench)
        bench.set_defaults(handler=module.main)
