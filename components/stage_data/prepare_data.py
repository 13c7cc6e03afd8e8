"""`rtp prepare-data`: turn a text corpus into the token shards the trainer reads, and upload them.

The trainer's model is byte-level, so a token is one byte (vocabulary 256, dtype uint8)
and tokenizing is encoding the text as UTF-8. Each document (one per input file) goes to
the train or the holdout side by a hash of its content (`trainer.data.DocumentSplit`: a
document keeps its side when the corpus grows), and is packed in sorted path order into
that side's shards (`train-NNNNN.bin`, `holdout-NNNNN.bin`) of at most `shard_bytes`
tokens, followed by one newline token, never split across shards. Next to the shards,
`index.json` names the format and the split rule and lists every shard with its side,
token count, document count and SHA-256; the stage step copies both, and the trainer reads
the shards the index lists (it skips `index.json`). The format is described in docs/data.md.

With a model folder's tokenizer (`tokenizer_dir`, `rtp prepare-data --tokenizer`) the
shards hold that tokenizer's ids instead (format version 2, written by
trainer/tokenized_data.py): text, JSON Lines and Parquet inputs, tokenized in parallel
across files with a progress bar, documents ending with the tokenizer's EOS.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where shards are written: `rtp --help` loads this module
    from trainer.data import DocumentSplit
    from trainer.tokenized_data import ShardWriter

SHARD_INDEX_NAME = "index.json"
FORMAT = "rtp-token-shards"
FORMAT_VERSION = 1
DEFAULT_SHARD_BYTES = 64 * 2**20
HOLDOUT_FRACTION = 0.1
"""Share of documents held out by default: `data.holdout_fraction`'s default (a test checks)."""
TEXT_SUFFIXES = (".txt", ".md", ".py", ".json", ".jsonl", ".rst", ".csv", ".html", ".xml", "")


class PrepareError(ValueError):
    """The corpus or the destination cannot be used; the message says what to do."""


def corpus_documents(source: Path) -> list[tuple[str, Path]]:
    """(name, file) of every regular text file under `source` (or `source` itself), sorted."""
    if source.is_file():
        return [(source.name, source)]
    if not source.is_dir():
        raise PrepareError(f"corpus {source} does not exist: give a text file or a folder of text files")
    files = [
        (p.relative_to(source).as_posix(), p)
        for p in sorted(source.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.suffix.lower() in TEXT_SUFFIXES
    ]
    if not files:
        raise PrepareError(
            f"corpus folder {source} holds no text files ({', '.join(s for s in TEXT_SUFFIXES if s)})"
        )
    return files


def write_shards(
    source: Path,
    out_dir: Path,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    holdout_fraction: float = HOLDOUT_FRACTION,
) -> dict[str, Any]:
    """Write train-/holdout-NNNNN.bin files and index.json into `out_dir`; returns the index."""
    return write_document_shards(corpus_documents(source), out_dir, shard_bytes, holdout_fraction)


def write_document_shards(
    docs: list[tuple[str, Path]], out_dir: Path, shard_bytes: int, holdout_fraction: float = HOLDOUT_FRACTION
) -> dict[str, Any]:
    from trainer.data import DataError
    from trainer.tokenized_data import split_and_pack

    if shard_bytes < 1:
        raise PrepareError("--shard-mib must be positive")
    out_dir.mkdir(parents=True, exist_ok=True)
    # An index left by an earlier run would vouch for shards this run is about to replace.
    (out_dir / SHARD_INDEX_NAME).unlink(missing_ok=True)

    def write(writer: ShardWriter, split: DocumentSplit) -> None:
        for name, path in docs:
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PrepareError(f"{name} is not UTF-8 text ({exc}); convert it or leave it out") from exc
            writer.add(data + b"\n", split.in_holdout(data))

    try:
        shards, split = split_and_pack(write, out_dir, shard_bytes, holdout_fraction)
    except DataError as exc:
        raise PrepareError(str(exc)) from None
    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": "bytes",
        "vocab_size": 256,
        "dtype": "uint8",
        "document_separator": 10,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "split": split.index_entry(),
        "shards": shards,
    }
    (out_dir / SHARD_INDEX_NAME).write_text(json.dumps(index, indent=1))
    return index


def upload_shards(
    client: Any, folder: Path, bucket: str, prefix: str, max_workers: int = 16, *, create_bucket: bool = True
) -> int:
    """Upload the shards, then index.json last (a reader that sees the index finds every shard).

    `create_bucket` is for rtp's own demo S3 server only; `rtp prepare-data --dest` passes
    False: a user's bucket must already exist (`check_destination_bucket`).
    """
    if create_bucket:
        _create_own_bucket(client, bucket)
    else:
        check_destination_bucket(client, bucket)
    index = json.loads((folder / SHARD_INDEX_NAME).read_text())
    prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
    # A token shard is one file; an example shard (format rtp-example-shards) three.
    names = [s[key] for s in index["shards"] for key in ("name", "mask", "offsets") if key in s]
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        futures = [
            pool.submit(client.upload_file, str(folder / name), bucket, f"{prefix}{name}") for name in names
        ]
        for future in futures:
            future.result()
    client.upload_file(str(folder / SHARD_INDEX_NAME), bucket, f"{prefix}{SHARD_INDEX_NAME}")
    return len(names) + 1


def _create_own_bucket(client: Any, bucket: str) -> None:
    from botocore.exceptions import ClientError

    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        if code == "BucketAlreadyExists":  # the name is taken by another account
            raise PrepareError(
                f"bucket {bucket!r} belongs to someone else (BucketAlreadyExists): pick another name"
            ) from exc
        if code != "BucketAlreadyOwnedByYou":
            raise PrepareError(f"cannot use bucket {bucket!r}: {exc}") from exc


def check_destination_bucket(client: Any, bucket: str) -> None:
    """PrepareError unless `bucket` exists and is readable: never create a user's bucket implicitly."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchBucket"):
            raise PrepareError(
                f"bucket {bucket!r} does not exist: create it first (e.g. `aws s3 mb s3://{bucket}`) "
                "with the encryption and lifecycle rules you want, then run again"
            ) from exc
        if code in ("403", "AccessDenied"):
            raise PrepareError(
                f"access to bucket {bucket!r} denied: it may belong to another account; give your AWS "
                "profile s3:ListBucket and s3:PutObject on it, or pick a bucket of your own"
            ) from exc
        raise PrepareError(f"cannot use bucket {bucket!r}: {exc}") from exc
    except NoCredentialsError as exc:
        raise PrepareError("no AWS credentials found: set AWS_PROFILE or AWS_ACCESS_KEY_ID") from exc
    except EndpointConnectionError as exc:
        raise PrepareError(f"cannot reach the S3 endpoint: {exc}; check --endpoint-url") from exc


def check_tokenizer_dir(tokenizer_dir: Path) -> None:
    """PrepareError, in one line, unless `tokenizer_dir` is a folder holding tokenizer files."""
    from trainer.models.hf_causal_lm import TOKENIZER_FILES, tokenizer_files

    if not tokenizer_dir.is_dir():
        raise PrepareError(
            f"--tokenizer {tokenizer_dir}: no such folder; give a model folder (what save_pretrained "
            "writes, or `rtp make-tiny-model`)"
        )
    if not tokenizer_files(tokenizer_dir):
        raise PrepareError(
            f"--tokenizer {tokenizer_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): "
            "give the model folder its tokenizer was saved in (tokenizer.save_pretrained(folder))"
        )


def write_tokenizer_shards(
    source: Path,
    out_dir: Path,
    tokenizer_dir: Path,
    shard_bytes: int,
    workers: int = 0,
    holdout_fraction: float = HOLDOUT_FRACTION,
) -> dict[str, Any]:
    """Shards of the tokenizer's ids (trainer/tokenized_data.py), with a progress bar on stderr."""
    import os

    from components.stage_data.progress import Progress
    from trainer.tokenized_data import corpus_files, tokenize_files

    check_tokenizer_dir(tokenizer_dir)
    files = corpus_files(source)
    sizes = [path.stat().st_size for path in files]
    progress = Progress(sum(sizes), len(files), label="tokenizing")

    def file_done(done: int, total: int) -> None:
        progress.add_bytes(sizes[done - 1])  # files finish in corpus order
        progress.add_file()

    try:
        return tokenize_files(
            files,
            out_dir,
            tokenizer_dir,
            shard_bytes,
            workers=workers or min(8, os.cpu_count() or 1),
            progress=file_done,
            holdout_fraction=holdout_fraction,
        )
    finally:
        progress.close()


def write_chat_shards(
    source: Path,
    out_dir: Path,
    tokenizer_dir: Path,
    shard_bytes: int,
    holdout_fraction: float = HOLDOUT_FRACTION,
    chat_template_file: str = "",
    max_tokens: int = 0,
    overlong: str = "truncate",
) -> dict[str, Any]:
    """Example shards of conversations (trainer/chat_data.py), with a progress bar on stderr."""
    from components.stage_data.progress import Progress
    from trainer.chat_data import conversation_files, write_example_shards
    from trainer.data import DataError

    check_tokenizer_dir(tokenizer_dir)
    template = None
    if chat_template_file:
        try:
            template = Path(chat_template_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise PrepareError(f"--chat-template {chat_template_file}: {exc.strerror}") from None
    try:
        files = conversation_files(source)
    except DataError as exc:
        raise PrepareError(str(exc)) from None
    sizes = [path.stat().st_size for path in files]
    progress = Progress(sum(sizes), len(files), label="rendering")

    def file_done(done: int, total: int) -> None:
        progress.add_bytes(sizes[done - 1])
        progress.add_file()

    try:
        return write_example_shards(
            source,
            out_dir,
            tokenizer_dir,
            chat_template=template,
            max_tokens=max_tokens,
            overlong=overlong,
            shard_bytes=shard_bytes,
            holdout_fraction=holdout_fraction,
            progress=file_done,
        )
    except DataError as exc:
        raise PrepareError(str(exc)) from None
    finally:
        progress.close()


DATA_FORMATS = ("text", "chat")


def prepare_data(
    source: str,
    out_dir: str,
    destination: str = "",
    endpoint_url: str | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer_dir: str = "",
    workers: int = 0,
    holdout_fraction: float = HOLDOUT_FRACTION,
    data_format: str = "text",
    chat_template_file: str = "",
    max_tokens: int = 0,
    overlong: str = "truncate",
) -> dict[str, Any]:
    """Shard `source` (bytes, or the ids of the tokenizer in `tokenizer_dir`; with
    `data_format="chat"`, conversations as example shards) into `out_dir` and upload the
    shards to `destination` when given; returns a summary."""
    if data_format not in DATA_FORMATS:
        raise PrepareError(f"--format {data_format!r}: choose one of {', '.join(DATA_FORMATS)}")
    if data_format == "chat" and not tokenizer_dir:
        raise PrepareError(
            "--format chat needs --tokenizer MODEL_DIR: conversations are rendered with the model's chat template"
        )
    if data_format != "chat" and (chat_template_file or max_tokens):
        raise PrepareError("--chat-template and --max-tokens apply to --format chat only")
    if shard_bytes < 1 or workers < 0:
        raise PrepareError("--shard-mib must be positive and --workers at least 0")
    if not 0.0 < holdout_fraction < 1.0:
        raise PrepareError(f"--holdout-fraction must be between 0 and 1 (exclusive), got {holdout_fraction}")
    client, bucket, prefix = None, "", ""
    if destination:  # before the corpus is read: a missing bucket must not cost a tokenization
        from components.stage_data.s3_clients import s3_client
        from components.stage_data.source import parse_s3_uri

        bucket, prefix = parse_s3_uri(destination)
        client = s3_client(endpoint_url)
        check_destination_bucket(client, bucket)
    if data_format == "chat":
        index = write_chat_shards(
            Path(source),
            Path(out_dir),
            Path(tokenizer_dir),
            shard_bytes,
            holdout_fraction,
            chat_template_file,
            max_tokens,
            overlong,
        )
        uploaded = _upload(client, out_dir, bucket, prefix)
        return {
            "out_dir": out_dir,
            "destination": destination,
            "format": "chat",
            "shards": len(index["shards"]),
            "examples": index["examples"],
            "holdout_examples": sum(s["examples"] for s in index["shards"] if s["split"] == "holdout"),
            "conversations": index["conversations"],
            "truncated": index["truncated"],
            "dropped_overlong": index["dropped_overlong"],
            "dropped_no_assistant_tokens": index["dropped_no_assistant_tokens"],
            "tokens": index["tokens"],
            "assistant_tokens": index["assistant_tokens"],
            "tokenizer": index["tokenizer"],
            "mask_rule": index["mask_rule"],
            "objects_uploaded": uploaded,
        }
    if tokenizer_dir:
        index = write_tokenizer_shards(
            Path(source), Path(out_dir), Path(tokenizer_dir), shard_bytes, workers, holdout_fraction
        )
    else:
        index = write_shards(Path(source), Path(out_dir), shard_bytes, holdout_fraction)
    uploaded = _upload(client, out_dir, bucket, prefix)
    return {
        "out_dir": out_dir,
        "destination": destination,
        "shards": len(index["shards"]),
        "documents": index["documents"],
        "holdout_documents": sum(s["documents"] for s in index["shards"] if s["split"] == "holdout"),
        "tokens": index["tokens"],
        "tokenizer": index["tokenizer"],
        "dtype": index["dtype"],
        "vocab_size": index["vocab_size"],
        "objects_uploaded": uploaded,
    }


def _upload(client: Any, out_dir: str, bucket: str, prefix: str) -> int:
    """Objects uploaded to the user's bucket (`--dest`), or 0 without one."""
    if client is None:
        return 0
    return upload_shards(client, Path(out_dir), bucket, prefix, create_bucket=False)
