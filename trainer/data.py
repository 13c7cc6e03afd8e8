"""Training and holdout data from a staged dataset snapshot, with an exactly resumable position.

A snapshot is a folder with `manifest.json` (written by the stage step) listing the files
copied from S3. Files are split into train and holdout by a hash of their S3 key, so the
split is deterministic, independent of listing order, and the same in every step of the
pipeline. The sampler draws batch `step` of rank `rank` from a generator seeded by
`(seed, step, rank)`: the loader's position is the step number, so resuming at step N
replays exactly the batches an uninterrupted run would have seen.

Files are bytes (raw text, or byte shards of `rtp prepare-data`) unless the snapshot holds
an `index.json` of token shards (trainer/tokenized_data.py): then each file is an array of
token ids of the index's dtype, and `check_tokenizer` refuses a model whose tokenizer is
not the one the shards were made with.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MANIFEST_NAME = "manifest.json"
SHARD_INDEX_NAME = "index.json"  # written by `rtp prepare-data` beside the shards; not training text
TOKEN_DTYPES = ("uint8", "uint16", "uint32")


class DataError(ValueError):
    """The dataset folder is missing, empty or malformed."""


@dataclass(frozen=True, slots=True)
class DatasetFile:
    key: str
    path: Path
    size: int
    dtype: str = "uint8"
    """uint8: bytes (a newline is added after each file); uint16/uint32: token shards."""


def read_manifest(dataset_dir: str | Path) -> dict:
    manifest_path = Path(dataset_dir) / MANIFEST_NAME
    if not manifest_path.is_file():
        raise DataError(
            f"{manifest_path} not found: point data.dataset_dir at a snapshot written by "
            "`rtp stage` (a folder holding manifest.json)"
        )
    return json.loads(manifest_path.read_text())


def shard_index(dataset_dir: str | Path) -> dict | None:
    """The snapshot's token-shard index (written by `rtp prepare-data`), or None for raw files."""
    root = Path(dataset_dir)
    entries = [e for e in read_manifest(root)["files"] if e["key"].rsplit("/", 1)[-1] == SHARD_INDEX_NAME]
    if not entries:
        return None
    try:
        return json.loads((root / entries[0]["path"]).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{root / entries[0]['path']} is not a readable shard index: {exc}") from None


def dataset_tokenizer(dataset_dir: str | Path) -> str:
    """The identity of the tokenizer the snapshot was made with ("bytes" for raw or byte data)."""
    index = shard_index(dataset_dir)
    return str(index.get("tokenizer", "bytes")) if index else "bytes"


def check_tokenizer(dataset_dir: str | Path, tokenizer_identity: str) -> None:
    """DataError, in one line, when the snapshot was tokenized with another tokenizer."""
    used = dataset_tokenizer(dataset_dir)
    if used != tokenizer_identity:
        made = "as bytes" if used == "bytes" else f"with tokenizer {used[:12]}"
        wanted = "bytes" if tokenizer_identity == "bytes" else f"tokenizer {tokenizer_identity[:12]}"
        raise DataError(
            f"{dataset_dir} was tokenized {made} but the model uses {wanted}: prepare the data with the "
            "model's tokenizer (`rtp prepare-data --tokenizer MODEL_DIR`) or train the matching model"
        )


def is_holdout(key: str, holdout_fraction: float) -> bool:
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") / 2**32
    return bucket < holdout_fraction


def split_files(
    dataset_dir: str | Path, holdout_fraction: float
) -> tuple[list[DatasetFile], list[DatasetFile]]:
    """(train, holdout) files of a snapshot; both are non-empty when it holds >= 2 files."""
    root = Path(dataset_dir)
    entries = read_manifest(root)["files"]
    index = shard_index(root)
    dtype = str(index.get("dtype", "uint8")) if index else "uint8"
    if dtype not in TOKEN_DTYPES:
        raise DataError(
            f"{root}: index.json names dtype {dtype!r}; this trainer reads {', '.join(TOKEN_DTYPES)}"
        )
    files = sorted(
        (DatasetFile(key=e["key"], path=root / e["path"], size=int(e["size"]), dtype=dtype) for e in entries),
        key=lambda f: f.key,
    )
    files = [f for f in files if f.size > 0 and f.key.rsplit("/", 1)[-1] != SHARD_INDEX_NAME]
    if len(files) < 2:
        raise DataError(f"{root} holds {len(files)} non-empty file(s); need at least 2 (train + holdout)")
    holdout = [f for f in files if is_holdout(f.key, holdout_fraction)]
    if not holdout:  # tiny datasets: still hold one file out, the same one every time
        holdout = [min(files, key=lambda f: hashlib.sha256(f.key.encode()).hexdigest())]
    if len(holdout) == len(files):
        holdout = holdout[:-1]
    held = {f.key for f in holdout}
    return [f for f in files if f.key not in held], holdout


def load_tokens(files: list[DatasetFile]) -> torch.Tensor:
    """All tokens of the files in key order: bytes separated by a newline (a uint8 tensor), or
    token shards, whose documents already end with EOS (an int32 tensor)."""
    if all(f.dtype == "uint8" for f in files):
        chunks = [np.frombuffer(f.path.read_bytes() + b"\n", dtype=np.uint8) for f in files]
        return torch.from_numpy(np.concatenate(chunks).copy())
    chunks = [np.frombuffer(f.path.read_bytes(), dtype=np.dtype(f.dtype).newbyteorder("<")) for f in files]
    return torch.from_numpy(np.concatenate(chunks).astype(np.int32))


class StepSampler:
    """Random windows of `seq_len + 1` bytes; batch for (step, rank) is a pure function."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int, rank: int) -> None:
        if tokens.numel() < seq_len + 2:
            raise DataError(
                f"dataset has {tokens.numel()} tokens; need more than seq_len + 1 = {seq_len + 1}"
            )
        self.tokens = tokens
        self.window = seq_len + 1
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank

    def batch(self, step: int) -> torch.Tensor:
        # An explicit mix (not hash()) so the stream is the same in every Python process.
        mixed = ((self.seed * 1_000_003 + step) * 1_009 + self.rank) % (2**63)
        generator = torch.Generator().manual_seed(mixed)
        starts = torch.randint(0, self.tokens.numel() - self.window, (self.batch_size,), generator=generator)
        return torch.stack([self.tokens[s : s + self.window] for s in starts.tolist()]).long()

    def state_dict(self, next_step: int) -> dict[str, int]:
        return {"next_step": next_step, "seed": self.seed, "rank": self.rank}


def holdout_batches(
    tokens: torch.Tensor, seq_len: int, max_windows: int = 64, batch_size: int = 16
) -> list[torch.Tensor]:
    """Evenly spaced, non-random windows over the holdout bytes: the same for every model."""
    window = seq_len + 1
    count = max(1, min(max_windows, (tokens.numel() - 1) // window))
    starts = np.linspace(0, tokens.numel() - window, num=count, dtype=np.int64).tolist()
    rows = [tokens[s : s + window].long() for s in starts]
    return [torch.stack(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
