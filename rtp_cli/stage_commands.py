"""`rtp stage` and `rtp prepare-data`: the stage step and the corpus-to-shards tool on the command line."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from components.stage_data.checksums import MIB
from components.stage_data.stage import MODES, S3_CLIENTS, VERIFY_LOCAL


def add_stage_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stage",
        help="copy an S3 prefix (or a local folder) into a verified dataset snapshot",
        description="Copy s3://bucket/prefix (or a local folder) into "
        "<fsx-mount-path>/rtp/datasets/<name>/snapshots/<id>/ and point <name>/current at it. "
        "Objects download in parallel (large ones in ranges), are verified against S3's checksums "
        "(MD5 ETag, multipart ETag, CRC32/CRC32C/SHA-256), written under temporary names and renamed, and "
        "synced to disk before the snapshot is committed. An unchanged prefix transfers nothing; an interrupted stage resumes. Credentials come "
        "from the standard AWS chain (IRSA, environment, profile).",
    )
    p.add_argument(
        "--source", required=True, help="s3://bucket/prefix, or an absolute path of a local folder"
    )
    p.add_argument(
        "--endpoint-url",
        "--s3-endpoint-url",
        dest="endpoint_url",
        default="",
        help="S3-compatible endpoint (default: AWS_ENDPOINT_URL, else AWS)",
    )
    p.add_argument(
        "--fsx-mount-path",
        "--dest",
        dest="fsx_mount_path",
        required=True,
        help="root of the shared volume (a local folder works)",
    )
    p.add_argument("--dataset-name", default="demo-corpus", help="dataset folder name (default: %(default)s)")
    p.add_argument(
        "--max-workers",
        type=int,
        default=0,
        help="parallel requests (default: 4 per usable CPU, 8 to 32)",
    )
    p.add_argument(
        "--multipart-threshold-mib",
        type=int,
        default=64,
        help="objects at least this big download in parallel ranges (default: %(default)s)",
    )
    p.add_argument(
        "--part-size-mib", type=int, default=16, help="range size for large objects (default: %(default)s)"
    )
    p.add_argument(
        "--verify-local",
        choices=VERIFY_LOCAL,
        default="stat",
        help="how an existing snapshot is checked on re-stage: size+mtime, or full re-hash (default: %(default)s)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="copy",
        help="copy, or repository: files already linked by an FSx data repository association are "
        "checked, pre-loaded (lfs hsm_restore) and hard-linked (default: %(default)s)",
    )
    p.add_argument(
        "--s3-client",
        choices=S3_CLIENTS,
        default="lean",
        help="lean: rtp's own SigV4 signer over a small HTTP/1.1 keep-alive pool (credentials from "
        "the environment, else botocore's chain; a fraction of botocore's CPU per request); "
        "botocore: the full botocore client (default: %(default)s)",
    )
    p.add_argument(
        "--repository-dir", default="", help="with --mode repository: the FSx folder linked to the prefix"
    )
    across = p.add_mutually_exclusive_group()
    across.add_argument(
        "--part",
        default="",
        metavar="I/N",
        help="stage only part I (0-based) of N of the snapshot, balanced by bytes, and record it; "
        "`--finish N` then commits it. Each part runs anywhere the volume is mounted (copy mode)",
    )
    across.add_argument(
        "--finish",
        type=int,
        default=0,
        metavar="N",
        help="commit the snapshot that N parts (--part I/N) staged: every part's record is required",
    )
    p.set_defaults(handler=_cmd_stage)


def _cmd_stage(args: argparse.Namespace) -> int:
    from components.stage_data.settings import default_max_workers
    from components.stage_data.stage import StageError, TransferSettings, stage_dataset

    if args.max_workers < 0 or args.part_size_mib < 1 or args.multipart_threshold_mib < 1:
        raise StageError("--max-workers and --multipart-threshold-mib must be >= 1 and --part-size-mib >= 1")
    settings = TransferSettings(
        max_workers=args.max_workers or default_max_workers(),
        multipart_threshold_bytes=args.multipart_threshold_mib * MIB,
        part_size_bytes=args.part_size_mib * MIB,
    )
    common: dict[str, Any] = {
        "endpoint_url": args.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
        "settings": settings,
        "verify_local": args.verify_local,
        "s3_client_kind": args.s3_client,
    }
    where = (args.source, args.fsx_mount_path, args.dataset_name)
    if args.part or args.finish:
        from components.stage_data.parts import finish_stage, stage_part

        if args.mode != "copy":
            raise StageError("--part and --finish stage in copy mode only")
        if args.finish:
            print(json.dumps(finish_stage(*where, args.finish, **common).as_dict(), indent=2))
            return 0
        index, _, count = args.part.partition("/")
        if not (index.isdigit() and count.isdigit()):
            raise StageError(f"--part {args.part!r}: give I/N, e.g. 0/4")
        record = stage_part(*where, int(index), int(count), **common)
        print(json.dumps({k: v for k, v in record.items() if k != "files"}, indent=2))
        return 0
    result = stage_dataset(*where, mode=args.mode, repository_dir=args.repository_dir, **common)
    print(json.dumps(result.as_dict(), indent=2))
    return 0


def add_prepare_data_parser(sub: argparse._SubParsersAction) -> None:
    from components.stage_data.prepare_data import DEFAULT_SHARD_BYTES, HOLDOUT_FRACTION

    p = sub.add_parser(
        "prepare-data",
        help="turn a text corpus into token shards (+ index.json) and upload them to S3",
        description="Tokenize a text file or folder, pack the documents into train-NNNNN.bin and "
        "holdout-NNNNN.bin files with an index.json (format in docs/data.md), and upload them to an S3 "
        "prefix that `rtp stage` then stages for training. Each document goes to train or holdout by a "
        "hash of its content, so a document keeps its side when the corpus grows and is prepared again. Without --tokenizer the tokens are UTF-8 bytes (the built-in byte LM); with "
        "--tokenizer MODEL_DIR they are that model's token ids (text, .jsonl and .parquet inputs, documents "
        "ending with its EOS, uint16 or uint32), and the index records the tokenizer's identity.",
    )
    p.add_argument(
        "--corpus",
        required=True,
        help="a file or folder: UTF-8 text files; with --tokenizer also .jsonl (a 'text' field per line) "
        "and .parquet (a 'text' column)",
    )
    p.add_argument(
        "--tokenizer",
        default="",
        metavar="MODEL_DIR",
        help="a Hugging Face model folder whose tokenizer files tokenize the corpus (default: bytes)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="files tokenized in parallel with --tokenizer (default: the CPUs, at most 8)",
    )
    p.add_argument("--out-dir", required=True, help="where the shards are written locally")
    p.add_argument("--dest", default="", help="s3://bucket/prefix to upload to (default: local only)")
    p.add_argument(
        "--endpoint-url", default="", help="S3-compatible endpoint (default: AWS_ENDPOINT_URL, else AWS)"
    )
    p.add_argument(
        "--shard-mib",
        type=float,
        default=DEFAULT_SHARD_BYTES / MIB,
        help="shard size in MiB (default: %(default)s)",
    )
    p.add_argument(
        "--holdout-fraction",
        type=float,
        default=HOLDOUT_FRACTION,
        help="share of documents held out for validation, by a hash of each document's content; the "
        "trainer and the validate step keep the split recorded here (default: %(default)s)",
    )
    p.add_argument(
        "--format",
        choices=("text", "chat"),
        default="text",
        help="text: a corpus of documents (default); chat: JSON Lines conversations "
        '({"messages": [{"role", "content"}, ...]} or {"prompt", "completion"} per line), rendered '
        "with the model's chat template into example shards whose loss mask covers the assistant's "
        "turns only (needs --tokenizer; docs/fine-tuning.md)",
    )
    p.add_argument(
        "--chat-template",
        default="",
        metavar="FILE",
        help="with --format chat: a Jinja chat template to use when the tokenizer has none (or instead of its own)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="with --format chat: the longest example kept, in tokens (0: no limit; the trainer cuts "
        "examples to model.seq_len + 1 anyway)",
    )
    p.add_argument(
        "--overlong",
        choices=("truncate", "drop"),
        default="truncate",
        help="with --format chat and --max-tokens: cut a longer example to its first tokens, or leave it "
        "out; either is counted in the summary and index.json (default: %(default)s)",
    )
    p.set_defaults(handler=_cmd_prepare_data)


def _cmd_prepare_data(args: argparse.Namespace) -> int:
    from components.stage_data.prepare_data import prepare_data

    summary = prepare_data(
        args.corpus,
        args.out_dir,
        args.dest,
        endpoint_url=args.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
        shard_bytes=int(args.shard_mib * MIB),
        tokenizer_dir=args.tokenizer,
        workers=args.workers,
        holdout_fraction=args.holdout_fraction,
        data_format=args.format,
        chat_template_file=args.chat_template,
        max_tokens=args.max_tokens,
        overlong=args.overlong,
    )
    print(json.dumps(summary, indent=2))
    return 0
