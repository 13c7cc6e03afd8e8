"""Training and holdout data from a staged dataset snapshot, with an exactly resumable position.

A snapshot is a folder with `manifest.json` (written by the stage step) listing the files
copied from S3. Shards of `rtp prepare-data` are split by document: each document went to a
train or a holdout shard by a hash of its content (`document_in_holdout`), recorded in
`index.json`, so a document keeps its side when the corpus grows and is prepared again.
Other files are split by a hash of their S3 key. Either way the split is deterministic,
independent of listing order, and the same in every step of the pipeline. The sampler draws the global batch of step `step` from a generator seeded by
`(seed, step)` and splits it over ranks and micro-batches: the loader's position is the step
number and the data does not depend on the world size, so resuming at step N, on any number of
ranks with the same `data.global_batch`, replays exactly the batches an uninterrupted run would
have seen.

Files are bytes (raw text, or byte shards of `rtp prepare-data`) unless the snapshot holds
an `index.json` of token shards (trainer/tokenized_data.py): then each file is an array of
token ids of the index's dtype, and `check_tokenizer` refuses a model whose tokenizer is
not the one the shards were made with.

Files are never loaded: `load_tokens` checks their sizes against the manifest and returns a
`TokenStream`, a virtual concatenation in key order of the files memory-mapped in their stored
dtype (a newline after each byte file). A batch copies its windows out of the maps (a window
may span files) and only the batch becomes int64, so a rank's memory and start-up do not grow
with the dataset (docs/data.md).
"""

from __future__ import annotations

import hashlib
import json
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from trainer.config import ConfigError

MANIFEST_NAME = "manifest.json"
SHARD_INDEX_NAME = "index.json"  # written by `rtp prepare-data` beside the shards; not training text
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
NEWLINE = 10  # added after each byte file, so documents stay apart in the stream
MAX_OPEN_FILES = 64  # files mapped at once: bounds descriptors and mapped pages, not the data read
FAULT_AROUND_BYTES = 64 * 1024  # the kernel maps up to this much beside a faulted page (fault_around_bytes)


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


def _bucket(digest: bytes) -> float:
    return int.from_bytes(digest[:4], "big") / 2**32


def is_holdout(key: str, holdout_fraction: float) -> bool:
    """The split of a file that is not a prepared shard, by its S3 key."""
    return _bucket(hashlib.sha256(key.encode()).digest()) < holdout_fraction


def document_digest(document: bytes) -> bytes:
    return hashlib.sha256(document).digest()


class DocumentSplit:
    """Which side of the split each document of a corpus goes to, by a hash of its content.

    A document's side depends on its bytes only, so a corpus that grows between two
    preparations keeps every document where it was: no holdout document of a later snapshot
    was trained on in an earlier one. `fallback` (a digest) also sends that one document to
    the holdout: what `rtp prepare-data` uses when none of a small corpus's documents fell
    below the fraction (the smallest digest, so growing the corpus can only move it to train)."""

    RULE = "sha256(document) < holdout_fraction"

    def __init__(self, holdout_fraction: float, fallback: bytes | None = None) -> None:
        if not 0.0 < holdout_fraction < 1.0:
            raise DataError(f"holdout fraction {holdout_fraction} must be between 0 and 1 (exclusive)")
        self.holdout_fraction = holdout_fraction
        self.fallback = fallback
        self.smallest: bytes | None = None  # of the documents seen, for the fallback
        self.holdout_documents = 0
        self.documents = 0

    def in_holdout(self, document: bytes) -> bool:
        return self.side_of(document_digest(document))

    def side_of(self, digest: bytes) -> bool:
        """Whether the document of `digest` (`document_digest`) is held out; counts it."""
        self.documents += 1
        if self.smallest is None or digest < self.smallest:
            self.smallest = digest
        held = _bucket(digest) < self.holdout_fraction or digest == self.fallback
        self.holdout_documents += held
        return held

    def index_entry(self) -> dict[str, Any]:
        """What index.json records of the split."""
        return {"rule": self.RULE, "holdout_fraction": self.holdout_fraction}


def split_files(
    dataset_dir: str | Path, holdout_fraction: float
) -> tuple[list[DatasetFile], list[DatasetFile]]:
    """(train, holdout) files of a snapshot; both are non-empty when it holds >= 2 files.

    Shards whose index.json records a document split keep the sides it names
    (`holdout_fraction` does not apply to them: it was chosen when they were prepared)."""
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
    if index and "split" in index:
        return _recorded_split(root, files, index)
    if len(files) < 2:
        raise DataError(f"{root} holds {len(files)} non-empty file(s); need at least 2 (train + holdout)")
    holdout = [f for f in files if is_holdout(f.key, holdout_fraction)]
    if not holdout:  # tiny datasets: still hold one file out, the same one every time
        holdout = [min(files, key=lambda f: hashlib.sha256(f.key.encode()).hexdigest())]
    if len(holdout) == len(files):
        holdout = holdout[:-1]
    held = {f.key for f in holdout}
    return [f for f in files if f.key not in held], holdout


def _recorded_split(
    root: Path, files: list[DatasetFile], index: dict[str, Any]
) -> tuple[list[DatasetFile], list[DatasetFile]]:
    """The sides index.json gives its shards; files it does not list (shards of an earlier
    preparation left under the same prefix) are not read."""
    side = {str(shard["name"]): shard.get("split") for shard in index.get("shards", [])}
    train = [f for f in files if side.get(f.key.rsplit("/", 1)[-1]) == "train"]
    holdout = [f for f in files if side.get(f.key.rsplit("/", 1)[-1]) == "holdout"]
    if not train or not holdout:
        raise DataError(
            f"{root}: index.json splits its shards by document but the snapshot holds "
            f"{len(train)} train and {len(holdout)} holdout shard(s); stage the whole prefix "
            "`rtp prepare-data` uploaded"
        )
    return train, holdout


def load_tokens(files: list[DatasetFile]) -> TokenStream:
    """The tokens of the files in key order as one memory-mapped stream, never read whole: bytes
    with a newline after each file, or token shards (whose documents already end with EOS).

    Only sizes are checked (the stage step verified the bytes): DataError names a file whose size
    on disk differs from the manifest, or is not a whole number of tokens."""
    is_bytes = all(f.dtype == "uint8" for f in files)
    segments = []
    for f in files:
        dtype = np.dtype("uint8" if is_bytes else f.dtype).newbyteorder("<")
        try:
            size = f.path.stat().st_size
        except OSError as exc:
            raise DataError(
                f"{f.path} cannot be read ({exc.strerror}): stage the dataset again (`rtp stage`)"
            ) from None
        if size != f.size:
            raise DataError(
                f"{f.path} is {size} bytes but manifest.json says {f.size}: the snapshot changed after "
                "staging; stage the dataset again (`rtp stage`)"
            )
        if size % dtype.itemsize:
            raise DataError(
                f"{f.path} is {size} bytes, not a whole number of {dtype.itemsize}-byte {dtype.name} tokens: "
                "make the shards again with `rtp prepare-data` and stage them"
            )
        segments.append(_Segment(path=f.path, array=None, dtype=dtype, count=size // dtype.itemsize))
    return TokenStream(segments, separator=NEWLINE if is_bytes else None)


@dataclass(frozen=True, slots=True)
class _Segment:
    """One file (mapped when first read) or one in-memory array of the stream."""

    path: Path | None
    array: np.ndarray | None
    dtype: np.dtype
    count: int


class TokenStream:
    """Read-only concatenation of files' tokens, mapped in their stored dtype.

    Only the per-file offset table is held; at most `MAX_OPEN_FILES` files are mapped at once, and
    the pages a window touched are unmapped after copying, so a rank's memory does not grow with
    the dataset or the number of batches drawn (the pages stay in the kernel's page cache)."""

    def __init__(self, segments: list[_Segment], separator: int | None = None) -> None:
        self._segments = segments
        self._separator = separator
        lengths = [s.count + (separator is not None) for s in segments]
        self._offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
        self._maps: OrderedDict[int, tuple[mmap.mmap, np.ndarray]] = OrderedDict()

    @classmethod
    def from_array(cls, tokens: torch.Tensor | np.ndarray) -> TokenStream:
        """An in-memory stream (tests, small tools); no separator is added."""
        array = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
        array = np.ascontiguousarray(array.reshape(-1))
        return cls([_Segment(path=None, array=array, dtype=array.dtype, count=array.size)])

    def numel(self) -> int:
        return int(self._offsets[-1])

    def __len__(self) -> int:
        return self.numel()

    @property
    def dtype(self) -> np.dtype:
        """The stored dtype of the tokens (uint8 for bytes)."""
        return self._segments[0].dtype if self._segments else np.dtype("uint8")

    def gather(self, starts: list[int], length: int) -> torch.Tensor:
        """Rows `[start, start + length)` of the stream as one int64 tensor (a row may span files)."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts):
            if start < 0 or start + length > self.numel():
                raise IndexError(f"window [{start}, {start + length}) is outside the {self.numel()} tokens")
            index = int(np.searchsorted(self._offsets, start, side="right")) - 1
            position, filled = start - int(self._offsets[index]), 0
            while filled < length:
                available = int(self._offsets[index + 1] - self._offsets[index]) - position
                take = min(length - filled, available)
                self._copy(index, position, out[row, filled : filled + take])
                filled, index, position = filled + take, index + 1, 0
        return torch.from_numpy(out)

    def _copy(self, index: int, position: int, dest: np.ndarray) -> None:
        segment = self._segments[index]
        from_data = max(0, min(dest.size, segment.count - position))
        if from_data:
            if segment.array is not None:
                dest[:from_data] = segment.array[position : position + from_data]
            else:
                mapped, array = self._mapped(index)
                dest[:from_data] = array[position : position + from_data]
                unmap_pages(mapped, position * segment.dtype.itemsize, from_data * segment.dtype.itemsize)
        if from_data < dest.size:  # the separator after a byte file: the only token past its data
            dest[from_data] = self._separator

    def _mapped(self, index: int) -> tuple[mmap.mmap, np.ndarray]:
        if index in self._maps:
            self._maps.move_to_end(index)
            return self._maps[index]
        segment = self._segments[index]
        assert segment.path is not None
        with segment.path.open("rb") as handle:  # mmap keeps its own descriptor
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._maps[index] = (mapped, np.frombuffer(mapped, dtype=segment.dtype, count=segment.count))
        if len(self._maps) > MAX_OPEN_FILES:
            self._maps.popitem(last=False)  # unmapped when the last reference goes
        return self._maps[index]


def unmap_pages(mapped: mmap.mmap, offset: int, size: int) -> None:
    """Drop the pages around `[offset, offset + size)` from this process (not from the page cache)."""
    page = mmap.PAGESIZE
    begin = max(0, (offset - FAULT_AROUND_BYTES) // page * page)
    end = min(len(mapped), offset + size + FAULT_AROUND_BYTES)
    mapped.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def as_token_stream(tokens: TokenStream | torch.Tensor | np.ndarray) -> TokenStream:
    return tokens if isinstance(tokens, TokenStream) else TokenStream.from_array(tokens)


class DataSampler(Protocol):
    """What a checkpoint records of the data order, and checks on resume (StepSampler and
    trainer.examples_data.ExampleSampler)."""

    global_batch: int

    def state_dict(self, next_step: int) -> dict[str, Any]: ...

    def check_resumable(self, saved: dict[str, Any], source: str) -> None: ...


class StepSampler:
    """Random windows of `seq_len + 1` tokens; the global batch of a step is a pure function of
    (seed, step), whatever the world size.

    Step `step` draws `global_batch` window starts from a generator seeded by (seed, step); rank
    `rank` of `world_size` takes the contiguous rows [rank * G / W, (rank + 1) * G / W) and runs
    them as `accum_steps` micro-batches of `batch_size` rows, so a run resumed on another world
    size (with the same global batch) trains on exactly the same data."""

    def __init__(
        self,
        tokens: TokenStream | torch.Tensor,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int = 1,
        global_batch: int = 0,
    ) -> None:
        tokens = as_token_stream(tokens)
        if tokens.numel() < seq_len + 2:
            raise DataError(
                f"dataset has {tokens.numel()} tokens; need more than seq_len + 1 = {seq_len + 1}"
            )
        self.global_batch = global_batch or batch_size * world_size
        self.accum_steps = accumulation_steps(self.global_batch, batch_size, world_size)
        self.tokens = tokens
        self.window = seq_len + 1
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size

    def global_starts(self, step: int) -> list[int]:
        """The window starts of step `step`'s global batch, in row order (the same on every rank)."""
        # An explicit mix (not hash()) so the stream is the same in every Python process; the
        # factor 1_009 keeps one-rank runs on the windows the per-rank sampler drew for rank 0.
        mixed = ((self.seed * 1_000_003 + step) * 1_009) % (2**63)
        generator = torch.Generator().manual_seed(mixed)
        starts = torch.randint(
            0, self.tokens.numel() - self.window, (self.global_batch,), generator=generator
        )
        return starts.tolist()

    def batch(self, step: int) -> torch.Tensor:
        """This rank's rows of step `step`'s global batch: (global_batch / world_size, seq_len + 1)."""
        rows = self.global_batch // self.world_size
        return self.tokens.gather(
            self.global_starts(step)[self.rank * rows : (self.rank + 1) * rows], self.window
        )

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        """`batch(step)` as `accum_steps` micro-batches of `batch_size` rows, in row order."""
        return list(self.batch(step).split(self.batch_size))

    def state_dict(self, next_step: int) -> dict[str, int]:
        return {
            "next_step": next_step,
            "seed": self.seed,
            "rank": self.rank,
            "global_batch": self.global_batch,
        }

    def check_resumable(self, saved: dict[str, Any], source: str) -> None:
        """DataError, in one line, when a checkpoint's sampler state drew another global batch."""
        saved_batch = int(saved.get("global_batch", self.global_batch))
        if saved_batch != self.global_batch:
            raise DataError(
                f"{source} was trained with a global batch of {saved_batch} sequences but this run's is "
                f"{self.global_batch} (data.batch_size {self.batch_size} x {self.world_size} ranks x "
                f"{self.accum_steps} accumulation steps): its data would differ; set "
                f"data.global_batch={saved_batch} or use a new checkpoint dir"
            )


def accumulation_steps(global_batch: int, batch_size: int, world_size: int) -> int:
    """Micro-batches per rank per step; ConfigError when the global batch does not split evenly."""
    per_step = batch_size * world_size
    if global_batch < 1 or global_batch % per_step:
        raise ConfigError(
            f"data.global_batch {global_batch} is not a multiple of data.batch_size {batch_size} x "
            f"{world_size} ranks = {per_step}: set data.global_batch to a multiple of {per_step} "
            "(or 0 for batch_size x world size)"
        )
    return global_batch // per_step


def holdout_batches(
    tokens: TokenStream | torch.Tensor, seq_len: int, max_windows: int = 64, batch_size: int = 16
) -> list[torch.Tensor]:
    """Evenly spaced, non-random windows over the holdout tokens: the same for every model; at
    most `max_windows` windows are read, whatever the holdout's size."""
    tokens = as_token_stream(tokens)
    window = seq_len + 1
    count = max(1, min(max_windows, (tokens.numel() - 1) // window))
    starts = np.linspace(0, tokens.numel() - window, num=count, dtype=np.int64).tolist()
    length = min(window, tokens.numel())  # a holdout shorter than one window is one short row
    return [tokens.gather(starts[i : i + batch_size], length) for i in range(0, len(starts), batch_size)]
