"""Token shards made with a model folder's tokenizer: the data a Hugging Face model trains on.

`write_token_shards` reads a corpus — plain text files (one document each), JSON Lines
(the `text` field of each line) and Parquet (the `text` column) — tokenizes the documents
with the tokenizer in a model folder, ends each with the tokenizer's EOS, and packs them in
corpus order into `shard-NNNNN.bin` files of at most `shard_bytes` bytes (a document is
never split across shards). Ids are stored little-endian as uint16 when the vocabulary
fits, else uint32. `index.json` uses the byte format's layout (docs/data.md) with
`tokenizer` set to the tokenizer's identity (SHA-256 over its files), so training can
refuse shards made with another tokenizer (`trainer.data.check_tokenizer`). Files are
tokenized in parallel threads (the tokenizers library releases the GIL); the output is the
same whatever the number of workers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import SHARD_INDEX_NAME, DataError

FORMAT = "rtp-token-shards"
FORMAT_VERSION = 2  # 1: byte shards (uint8, newline-separated); 2: tokenizer ids
DEFAULT_SHARD_BYTES = 64 * 2**20  # as for byte shards (`rtp prepare-data --shard-mib`)
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".csv", ".html", ".xml", ".json", "")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def corpus_files(source: Path) -> list[Path]:
    """Every text, JSON Lines and Parquet file under `source` (or `source` itself), sorted."""
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise DataError(
            f"corpus {source} does not exist: give a file or a folder of text, .jsonl or .parquet files"
        )
    files = [
        p
        for p in sorted(source.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.suffix.lower() in suffixes
    ]
    if not files:
        raise DataError(f"corpus folder {source} holds no text, .jsonl or .parquet files")
    return files


def read_documents(path: Path) -> list[str]:
    """The documents of one corpus file; DataError names the file and the line at fault."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq  # lazily: only Parquet corpora need it

        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise DataError(f"{path} has no 'text' column (columns: {', '.join(table.column_names)})")
        return [str(value) for value in table.column("text").to_pylist() if value]
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc}); convert it or leave it out") from None
    if suffix not in JSONL_SUFFIXES:
        return [content] if content else []
    documents = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number} is not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{path}:{number} has no string 'text' field")
        if record["text"]:
            documents.append(record["text"])
    return documents


def _pack(
    encoded_files: Iterator[list[list[int]]], eos_id: int, shard_tokens: int
) -> Iterator[tuple[list[int], int]]:
    buffer: list[int] = []
    count = 0
    for documents in encoded_files:
        for ids in documents:
            record = [*ids, eos_id]
            if buffer and len(buffer) + len(record) > shard_tokens:
                yield buffer, count
                buffer, count = [], 0
            buffer.extend(record)  # a document longer than a shard gets a shard of its own
            count += 1
    if buffer:
        yield buffer, count


def write_token_shards(
    source: Path,
    out_dir: Path,
    tokenizer_dir: Path,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    workers: int = 4,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Tokenize `source` with the tokenizer in `tokenizer_dir` into `out_dir`; returns the index.

    `progress(files_done, files_total)` is called as files finish (for a progress bar)."""
    return tokenize_files(
        corpus_files(Path(source)), out_dir, tokenizer_dir, shard_bytes, workers=workers, progress=progress
    )


def tokenize_files(
    files: list[Path],
    out_dir: Path,
    tokenizer_dir: Path,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    workers: int = 4,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """`write_token_shards` for a given list of corpus files, packed in that order."""
    from trainer.models.hf_causal_lm import HFTokenizer

    tokenizer = HFTokenizer(Path(tokenizer_dir))
    dtype = token_dtype(tokenizer.vocab_size)
    shard_tokens = shard_bytes // dtype.itemsize
    if shard_tokens < 1:
        raise DataError(f"shard size {shard_bytes} bytes holds no {dtype.name} token: make it larger")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # An index left by an earlier run would vouch for shards this run is about to replace.
    (out_dir / SHARD_INDEX_NAME).unlink(missing_ok=True)

    def encode(path: Path) -> list[list[int]]:
        documents = read_documents(path)
        return tokenizer.encode_batch(documents) if documents else []

    shards: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:

        def encoded_in_order() -> Iterator[list[list[int]]]:
            for done, documents in enumerate(pool.map(encode, files), start=1):
                if progress is not None:
                    progress(done, len(files))
                yield documents

        for number, (ids, count) in enumerate(_pack(encoded_in_order(), tokenizer.eos_id, shard_tokens)):
            data = np.asarray(ids, dtype=dtype).tobytes()
            name = f"shard-{number:05d}.bin"
            (out_dir / name).write_bytes(data)
            shards.append(
                {
                    "name": name,
                    "tokens": len(ids),
                    "documents": count,
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            )
    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": tokenizer.identity,
        "tokenizer_dir": str(tokenizer_dir),
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "document_separator": tokenizer.eos_id,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "shards": shards,
    }
    # Written last: a reader that sees the index finds every shard.
    (out_dir / SHARD_INDEX_NAME).write_text(json.dumps(index, indent=1))
    return index
