"""`rtp local`: its flags and handler (the run itself is rtp_cli/local_run.py).

The training flags are the pipeline's training parameters, generated from the trainer's
config (trainer/arguments.py), so they match the Kubeflow UI's parameters one for one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rtp_cli.errors import UserError
from rtp_cli.local_run import LocalOptions
from trainer.arguments import PIPELINE_SETTINGS, add_named_arguments, add_preset_argument, named_from_args


def add_local_parser(sub: argparse._SubParsersAction) -> None:
    defaults = LocalOptions()
    p = sub.add_parser(
        "local",
        help="run the whole pipeline on this machine with kfp.local",
        description="Compile the pipeline and run it with kfp.local: stage (embedded S3 seeded with "
        "a demo corpus unless --source; with --model-source a Hugging Face model folder or a registered version, and the demo corpus in its tokens), train (FSDP, gloo on CPU), validate, register (MLflow sqlite "
        "file in the work dir unless --mlflow-uri). Writes <workdir>/summary.json.",
    )
    p.add_argument("--workdir", default=defaults.workdir, help="all outputs go here (default: %(default)s)")
    p.add_argument(
        "--nproc", type=int, default=defaults.nproc, help="training processes (default: %(default)s)"
    )
    add_preset_argument(p)
    add_named_arguments(p, PIPELINE_SETTINGS)
    p.add_argument(
        "--overrides", default="", help="extra trainer config, e.g. 'optimizer.lr=1e-3 model.n_layers=3'"
    )
    p.add_argument(
        "--source",
        default="",
        help="s3://bucket/prefix to stage instead of the embedded demo corpus; "
        "credentials come from the standard AWS chain",
    )
    p.add_argument("--s3-endpoint-url", default="", help="S3-compatible endpoint for --source (default: AWS)")
    p.add_argument(
        "--stage-workers",
        type=int,
        default=defaults.stage_workers,
        help="fetch the dataset in this many parts at once (here: processes), then commit it: the "
        "pipeline's stage_workers (default: %(default)s, fetched in the stage step)",
    )
    p.add_argument(
        "--model-source",
        default="",
        metavar="DIR|s3://…|models:/NAME@ALIAS",
        help="a Hugging Face model folder to train instead of the built-in byte LM. A local folder is "
        "uploaded into the embedded S3 and the demo corpus is tokenized with its tokenizer; s3://bucket/"
        "prefix/<model>/ is staged as given and needs --source data tokenized for it "
        "(rtp prepare-data --tokenizer). Try `rtp make-tiny-model DIR`. models:/NAME@ALIAS (or "
        "models:/NAME/VERSION) continues from a version registered in this work dir's MLflow (or "
        "--mlflow-uri), e.g. models:/rtp-model@champion after a first run, and registers the new version "
        "under NAME with the parent in its tags",
    )
    p.add_argument(
        "--mlflow-uri", default="", help="MLflow tracking URI (default: sqlite:///<workdir>/mlflow.db)"
    )
    p.add_argument(
        "--model-name",
        default="",
        help=f"registered model name (default: {defaults.model_name}, or rtp-<model> with --model-source)",
    )
    p.add_argument(
        "--max-loss",
        type=float,
        default=defaults.max_loss,
        help="highest holdout loss to register (default: %(default)s)",
    )
    p.add_argument(
        "--run-name",
        default="",
        help="run folder name; reuse one to resume its checkpoints, or to train it further with more --steps "
        "(a finished one is refused otherwise) (default: local-<time>)",
    )
    p.add_argument(
        "--chat-data",
        default="",
        metavar="PATH",
        help="fine-tune --model-source (a local Hugging Face folder with a chat template) on your "
        'conversations: a .jsonl file or a folder of them ({"messages": [...]} or {"prompt", '
        '"completion"} per line), rendered into example shards and trained on the assistant\'s '
        "tokens only (data_format examples; docs/fine-tuning.md)",
    )
    p.add_argument(
        "--sft",
        action="store_true",
        help="the fine-tuning demo: without --chat-data, conversations made offline from the standard "
        "library's docstrings; without --model-source, a tiny tied Llama with a ChatML template; "
        "LoRA unless --method full",
    )
    p.add_argument(
        "--method",
        dest="training_method",
        choices=("full", "lora"),
        help="short for --training-method: full (every weight) or lora (low-rank adapters on a frozen "
        "base) (default: full; lora with --sft)",
    )
    p.add_argument(
        "--verbose",
        dest="show_kfp_output",  # not `verbose`: `rtp -v` (debug logging) owns that name
        action="store_true",
        help="also show kfp.local's executor output (task outputs and artifact listings)",
    )
    p.set_defaults(handler=_cmd_local)


def _cmd_local(args: argparse.Namespace) -> int:
    from rtp_cli.local_run import format_summary, run_local

    if args.source and not args.source.startswith("s3://"):
        raise UserError(f"--source {args.source!r} must look like s3://bucket/prefix")
    chat_data = _chat_inputs(args)
    model_name = args.model_name or LocalOptions().model_name
    model_dir = ""
    if args.model_source:
        from rtp_cli.local_model import plan_model_run

        plan = plan_model_run(args.model_source, args.source)
        # Continual training registers the new version under the parent's registered name.
        model_name = args.model_name or (plan.name if plan.registry else f"rtp-{plan.name}")
        model_dir = str(plan.folder or "")
    if args.sft and args.training_method is None:
        args.training_method = "lora"  # the demo fine-tunes as teams usually do: adapters on a frozen base
    training = named_from_args(args, PIPELINE_SETTINGS)
    if chat_data:
        training["data_format"] = "examples"
    options = LocalOptions(
        workdir=args.workdir,
        nproc=args.nproc,
        preset=args.preset,
        overrides=args.overrides,
        training=training,
        chat_data=chat_data,
        source=args.source,
        s3_endpoint_url=args.s3_endpoint_url,
        stage_workers=args.stage_workers,
        mlflow_uri=args.mlflow_uri,
        model_name=model_name,
        max_loss=args.max_loss,
        run_name=args.run_name,
        model_source=args.model_source,
        verbose=args.show_kfp_output,
    )
    _check_training_options(options, model_dir)
    summary = run_local(options)
    print(format_summary(summary, args.workdir))
    return 0


def _chat_inputs(args: argparse.Namespace) -> str:
    """The conversations to fine-tune on ("" for none); with --sft, the demo's model and
    conversations are made in the work dir where not given (args.model_source is set)."""
    if not (args.sft or args.chat_data):
        return ""
    if args.source:
        raise UserError(
            "--chat-data/--sft fine-tune on conversations put into the embedded S3; with --source, prepare "
            "them with `rtp prepare-data --format chat --tokenizer MODEL_DIR --dest s3://…` and pass "
            "--data-format examples"
        )
    demo = Path(args.workdir) / "sft-demo"
    if not args.model_source:
        if not args.sft:
            raise UserError(
                "--chat-data needs --model-source: a local Hugging Face model folder with a chat template"
            )
        from rtp_support.demo_chat import write_demo_chat_model

        folder = demo / "tiny-chat-llama"
        if not (folder / "config.json").is_file():
            write_demo_chat_model(folder)
            print(f"rtp local: made a tiny tied Llama with a ChatML template in {folder}", flush=True)
        args.model_source = str(folder)
        if "model.seq_len=" not in args.overrides:  # whole conversations: the tiny model's 128 positions
            args.overrides = " ".join(p for p in (args.overrides, "model.seq_len=127") if p)
    elif args.model_source.startswith("s3://"):
        raise UserError(
            f"--chat-data fine-tunes a local model folder or a registered version; for {args.model_source}, "
            "prepare the conversations with `rtp prepare-data --format chat` and stage them with --source"
        )
    if args.chat_data:
        if not Path(args.chat_data).exists():
            raise UserError(f"--chat-data {args.chat_data}: no such file or folder")
        return str(Path(args.chat_data).resolve())
    from rtp_support.demo_chat import write_demo_chat

    path = write_demo_chat(demo / "conversations.jsonl")
    print(f"rtp local: wrote demo conversations (standard-library docstrings) to {path}", flush=True)
    return str(path.resolve())


def _check_training_options(options: LocalOptions, model_dir: str = "") -> None:
    """Fail on bad training input before any step starts (the train step would, later);
    `model_dir` is a local model folder (an s3:// one is checked when staged)."""
    from components.check_run.parameters import RunParameterError, check_run_parameters
    from components.layout import run_dir
    from components.train.train import FinishedRun, TrainRequest, refuse_finished_run

    if options.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {options.nproc}")
    try:  # the check the pipeline's first step makes, here before anything starts
        check_run_parameters(
            {
                "run_name": options.run_name,
                "dataset_name": options.dataset_name,
                "model_name": options.model_name,
                "nproc": options.nproc,
                "stage_workers": options.stage_workers,
            }
        )
    except RunParameterError as exc:
        raise UserError(str(exc)) from None
    config = TrainRequest(
        dataset_dir="<staged>",
        run_folder=Path(options.workdir),
        # A registered version is staged by the pipeline: checked as the check step checks it.
        model_dir=model_dir or ("<staged model>" if options.model_source else ""),
        preset=options.preset,
        overrides=options.overrides,
        settings=options.training,
    ).config()
    if options.run_name:  # every `rtp local` is a new pipeline run: a finished name is another run's
        try:
            refuse_finished_run(
                run_dir(Path(options.workdir) / "fsx", options.run_name), "", config.run.steps
            )
        except FinishedRun as exc:
            raise UserError(str(exc)) from None
