"""Token shards made with a model folder's tokenizer: the data a Hugging Face model trains on.

`write_token_shards` reads a corpus — plain text files (one document each), JSON Lines
(the `text` field of each line) and Parquet (the `text` column) — tokenizes the documents
with the tokenizer in a model folder, ends each with the tokenizer's EOS, and packs them in
corpus order into `train-NNNNN.bin` and `holdout-NNNNN.bin` files of at most `shard_bytes`
bytes (a document is never split across shards; its side is `trainer.data.DocumentSplit`'s,
by its content, and `ShardWriter` packs each side). Ids are stored little-endian as uint16 when the vocabulary
fits, else uint32. `index.json` uses the byte format's layout (docs/data.md) with
`tokenizer` set to the tokenizer's identity (SHA-256 over its files), so training can
refuse shards made with another tokenizer (`trainer.data.check_tokenizer`). Files are
tokenized in parallel threads (the tokenizers library releases the GIL); the output is the
same whatever the number of workers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import DataConfig
from trainer.data import SHARD_INDEX_NAME, DataError, DocumentSplit, document_digest

FORMAT = "rtp-token-shards"
FORMAT_VERSION = 2  # 1: byte shards (uint8, newline-separated); 2: tokenizer ids
DEFAULT_SHARD_BYTES = 64 * 2**20  # as for byte shards (`rtp prepare-data --shard-mib`)
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".csv", ".html", ".xml", ".json", "")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
HOLDOUT_FRACTION = DataConfig().holdout_fraction  # of documents; the trainer's default


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


class ShardWriter:
    """Packs documents, in the order given, into `<side>-NNNNN.bin` shards of at most
    `shard_bytes` (a longer document gets a shard of its own), one series per side."""

    def __init__(self, out_dir: Path, shard_bytes: int, itemsize: int = 1) -> None:
        self.out_dir = Path(out_dir)
        self.shard_bytes = shard_bytes
        self.itemsize = itemsize
        self._open: dict[str, tuple[bytearray, list[int]]] = {}  # side -> (buffer, [documents])
        self._written = {"train": 0, "holdout": 0}  # shards per side, for the next name
        self.shards: list[dict[str, Any]] = []

    def add(self, record: bytes, holdout: bool) -> None:
        side = "holdout" if holdout else "train"
        buffer, count = self._open.setdefault(side, (bytearray(), [0]))
        if buffer and len(buffer) + len(record) > self.shard_bytes:
            self._write(side)
            buffer, count = self._open.setdefault(side, (bytearray(), [0]))
        buffer += record
        count[0] += 1

    def _write(self, side: str) -> None:
        buffer, count = self._open.pop(side)
        name = f"{side}-{self._written[side]:05d}.bin"
        self._written[side] += 1
        data = bytes(buffer)
        (self.out_dir / name).write_bytes(data)
        self.shards.append(
            {
                "name": name,
                "tokens": len(data) // self.itemsize,
                "documents": count[0],
                "sha256": hashlib.sha256(data).hexdigest(),
                "split": side,
            }
        )

    def close(self) -> list[dict[str, Any]]:
        for side in sorted(self._open):
            self._write(side)
        return self.shards

    def remove(self) -> None:
        """Delete what was written (a preparation started again)."""
        for shard in self.shards:
            (self.out_dir / shard["name"]).unlink(missing_ok=True)
        self.shards, self._open, self._written = [], {}, {"train": 0, "holdout": 0}


def split_and_pack(
    write: Callable[[ShardWriter, DocumentSplit], None],
    out_dir: Path,
    shard_bytes: int,
    holdout_fraction: float,
    itemsize: int = 1,
) -> tuple[list[dict[str, Any]], DocumentSplit]:
    """Shards of both sides; `write(writer, split)` adds every document. When no document
    fell in the holdout (a small corpus), the one with the smallest digest is held out and
    the corpus written again; DataError when one side would still be empty."""
    writer, split = ShardWriter(out_dir, shard_bytes, itemsize), DocumentSplit(holdout_fraction)
    write(writer, split)
    if split.holdout_documents == 0 and split.documents >= 2:
        writer.remove()
        writer, split = (
            ShardWriter(out_dir, shard_bytes, itemsize),
            DocumentSplit(holdout_fraction, split.smallest),
        )
        write(writer, split)
    shards = writer.close()
    if split.holdout_documents == 0 or split.holdout_documents == split.documents:
        writer.remove()
        raise DataError(
            f"the corpus's {split.documents} document(s) leave no {'train' if split.holdout_documents else 'holdout'} "
            f"document at holdout fraction {holdout_fraction}: add documents (at least 2) or change --holdout-fraction"
        )
    return shards, split


def write_token_shards(
    source: Path,
    out_dir: Path,
    tokenizer_dir: Path,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    workers: int = 4,
    progress: Callable[[int, int], None] | None = None,
    holdout_fraction: float = HOLDOUT_FRACTION,
) -> dict[str, Any]:
    """Tokenize `source` with the tokenizer in `tokenizer_dir` into `out_dir`; returns the index.

    `progress(files_done, files_total)` is called as files finish (for a progress bar)."""
    return tokenize_files(
        corpus_files(Path(source)),
        out_dir,
        tokenizer_dir,
        shard_bytes,
        workers=workers,
        progress=progress,
        holdout_fraction=holdout_fraction,
    )


def tokenize_files(
    files: list[Path],
    out_dir: Path,
    tokenizer_dir: Path,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    workers: int = 4,
    progress: Callable[[int, int], None] | None = None,
    holdout_fraction: float = HOLDOUT_FRACTION,
) -> dict[str, Any]:
    """`write_token_shards` for a given list of corpus files, packed in that order."""
    from trainer.models.hf_causal_lm import HFTokenizer

    tokenizer = HFTokenizer(Path(tokenizer_dir))
    dtype = token_dtype(tokenizer.vocab_size)
    if shard_bytes // dtype.itemsize < 1:
        raise DataError(f"shard size {shard_bytes} bytes holds no {dtype.name} token: make it larger")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # An index left by an earlier run would vouch for shards this run is about to replace.
    (out_dir / SHARD_INDEX_NAME).unlink(missing_ok=True)

    def encode(path: Path) -> list[tuple[bytes, list[int]]]:
        """(content digest, ids) per document: hashed here, in the pool, beside tokenizing."""
        documents = read_documents(path)
        ids = tokenizer.encode_batch(documents) if documents else []
        return [
            (document_digest(text.encode("utf-8")), doc_ids)
            for text, doc_ids in zip(documents, ids, strict=True)
        ]

    def write(writer: ShardWriter, split: DocumentSplit) -> None:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for done, documents in enumerate(pool.map(encode, files), start=1):
                if progress is not None:
                    progress(done, len(files))
                for digest, ids in documents:
                    writer.add(
                        np.asarray([*ids, tokenizer.eos_id], dtype=dtype).tobytes(), split.side_of(digest)
                    )

    shards, split = split_and_pack(
        write, out_dir, (shard_bytes // dtype.itemsize) * dtype.itemsize, holdout_fraction, dtype.itemsize
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
        "split": split.index_entry(),
        "shards": shards,
    }
    # Written last: a reader that sees the index finds every shard.
    (out_dir / SHARD_INDEX_NAME).write_text(json.dumps(index, indent=1))
    return index
