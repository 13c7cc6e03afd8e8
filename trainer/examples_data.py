"""Training on example shards (`data.format=examples`): which examples a step trains on, how
they are packed into rows, and the masked loss over the assistant tokens of the global batch.

**Order.** The examples are read in epochs, each a permutation of all of them seeded by (seed,
epoch) and computed on the fly (a Feistel network with cycle walking: O(1) memory whatever the
number of examples), without replacement within an epoch. Step `step` trains on stream
positions `[step * E, (step + 1) * E)` (E = `data.global_batch` examples): a pure function of
(seed, step), so a resumed or resharded run trains on exactly what an uninterrupted one would.

**Rows.** Each example is cut to `seq_len + 1` tokens. Without packing each is one row; with
packing (the default) the step's examples are laid in order into rows of `seq_len + 1` tokens,
a new row when the next one does not fit. Positions restart at 0 for every example, which is
how transformers (5.x `masking_utils`) builds a block-diagonal causal mask when no attention
mask is passed: packed examples never attend to each other. The row count is padded to a
multiple of world size x `data.batch_size` with empty rows, so every rank runs as many
micro-batches as the others; rank r takes its contiguous share of the rows.

**Loss.** A target is token t + 1 of an example where the mask is 1 (the assistant's), never
the first token of an example (nothing of its own precedes it). A micro-batch's loss is the sum
of its targets' cross-entropy divided by the step's number of targets over all ranks, times the
world size (FSDP averages gradients over ranks): the step's loss and gradient are those of the
mean over every assistant token of the global batch, whatever the micro-batch split, the
world size or the packing.
"""

from __future__ import annotations

import json
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.data import MAX_OPEN_FILES, SHARD_INDEX_NAME, DataError, read_manifest, unmap_pages

FORMAT = "rtp-example-shards"
_MIX = np.uint64(0x9E3779B97F4A7C15)


# --- the example shards of a snapshot ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Shard:
    ids: Path
    mask: Path
    offsets: Path
    examples: int
    dtype: np.dtype


MAX_MAPPED_SHARDS = MAX_OPEN_FILES // 3
"""Shards mapped at once (three files each): a 300 GB corpus has thousands, past the usual
limit of 1,024 open descriptors; the least recently read is unmapped first."""


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    with path.open("rb") as handle:  # mmap keeps its own descriptor
        if path.stat().st_size == 0:
            return np.empty(0, dtype=dtype)
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mapped, dtype=dtype)


def _copied(array: np.ndarray, begin: int, end: int) -> np.ndarray:
    """`array[begin:end]` copied out of its mapping, whose pages around it are then dropped from
    this process (they stay in the page cache): a rank's memory does not grow with the examples read."""
    out = np.array(array[begin:end])
    if isinstance(array.base, mmap.mmap) and end > begin:
        unmap_pages(array.base, begin * array.itemsize, (end - begin) * array.itemsize)
    return out


class ExampleSet:
    """The examples of one side of an example-shard snapshot, memory-mapped (never read whole):
    at most `MAX_MAPPED_SHARDS` shards mapped at once, each example copied out."""

    def __init__(self, shards: list[_Shard]) -> None:
        if not shards:
            raise DataError("no example shards on this side of the split")
        self._shards = shards
        self._starts = np.cumsum([0] + [s.examples for s in shards], dtype=np.int64)
        self._maps: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _mapped(self, shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if shard in self._maps:
            self._maps.move_to_end(shard)
            return self._maps[shard]
        s = self._shards[shard]
        offsets = _map(s.offsets, np.dtype("<i8"))
        if offsets.size != s.examples + 1:
            raise DataError(f"{s.offsets} holds {offsets.size - 1} examples, index.json says {s.examples}")
        self._maps[shard] = (_map(s.ids, s.dtype), _map(s.mask, np.dtype("u1")), offsets)
        if len(self._maps) > MAX_MAPPED_SHARDS:
            self._maps.popitem(last=False)  # unmapped when the last reference goes
        return self._maps[shard]

    def open_shards(self) -> int:
        """Shards mapped now."""
        return len(self._maps)

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of example `index`, copied out of the mapped files."""
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        ids, mask, offsets = self._mapped(shard)
        local = index - int(self._starts[shard])
        begin, end = int(offsets[local]), int(offsets[local + 1])
        return _copied(ids, begin, end), _copied(mask, begin, end)


def example_index(dataset_dir: str | Path) -> dict[str, Any] | None:
    """The snapshot's index.json when it holds example shards, else None."""
    root = Path(dataset_dir)
    for entry in read_manifest(root)["files"]:
        if entry["key"].rsplit("/", 1)[-1] == SHARD_INDEX_NAME:
            try:
                index = json.loads((root / entry["path"]).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise DataError(f"{root / entry['path']} is not a readable shard index: {exc}") from None
            return index if index.get("format") == FORMAT else None
    return None


def load_examples(dataset_dir: str | Path) -> tuple[ExampleSet, ExampleSet, dict[str, Any]]:
    """(train, holdout, index) of an example-shard snapshot; DataError when it holds none."""
    root = Path(dataset_dir)
    index = example_index(root)
    if index is None:
        raise DataError(
            f"{root} holds no example shards (index.json of format {FORMAT!r}): data.format=examples "
            "trains on conversations made with `rtp prepare-data --format chat --tokenizer MODEL_DIR`"
        )
    paths = {
        e["key"].rsplit("/", 1)[-1]: (root / e["path"], int(e["size"])) for e in read_manifest(root)["files"]
    }
    dtype = np.dtype(str(index["dtype"])).newbyteorder("<")
    sides: dict[str, list[_Shard]] = {"train": [], "holdout": []}
    for shard in index["shards"]:
        files = []
        for name in (shard["name"], shard["mask"], shard["offsets"]):
            if name not in paths:
                raise DataError(
                    f"{root}: {name} is listed in index.json but not in the snapshot: stage the whole prefix"
                )
            path, size = paths[name]
            if not path.is_file() or path.stat().st_size != size:
                raise DataError(
                    f"{path} is missing or not the size manifest.json says: stage the dataset again"
                )
            files.append(path)
        ids, mask, offsets = files
        sides[shard["split"]].append(_Shard(ids, mask, offsets, examples=int(shard["examples"]), dtype=dtype))
    return ExampleSet(sides["train"]), ExampleSet(sides["holdout"]), index


# --- order: epochs of on-the-fly permutations -------------------------------------------


def _round(values: np.ndarray, key: np.uint64, half_mask: np.uint64) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (values ^ key) * _MIX
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
    return x & half_mask


def permute(positions: np.ndarray, n: int, key: int) -> np.ndarray:
    """A bijection of [0, n) keyed by `key`, applied to `positions`: a 4-round Feistel network
    over the smallest even power of two >= n, walked until the value falls below n."""
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half = np.uint64(bits // 2)
    half_mask = np.uint64((1 << (bits // 2)) - 1)
    keys = [np.uint64((key * 4 + r) * 0x2545F4914F6CDD1D % 2**64) for r in range(4)]
    values = positions.astype(np.uint64)
    todo = np.ones(values.shape, dtype=bool)
    while todo.any():
        x = values[todo]
        left, right = x >> half, x & half_mask
        for k in keys:
            left, right = right, left ^ _round(right, k, half_mask)
        values[todo] = (left << half) | right
        todo = values >= np.uint64(n)
    return values.astype(np.int64)


def stream_examples(positions: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The example at each stream position: epoch p // n is a permutation seeded by (seed, epoch)."""
    epochs, within = np.divmod(positions, n)
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        chosen = epochs == epoch
        out[chosen] = permute(within[chosen], n, seed * 1_000_003 + int(epoch))
    return out


# --- rows and micro-batches -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExampleBatch:
    """Rows of a micro-batch: ids (B, L + 1), positions (B, L + 1) restarting per example, and
    targets (B, L): 1 where token t + 1 is an assistant token of the example token t is in."""

    ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    scale: float
    """What this micro-batch's summed target loss is multiplied by: world size / the step's targets."""

    def pin_memory(self) -> ExampleBatch:
        """The rows in page-locked host memory, so that `to` a GPU does not block the host."""
        return ExampleBatch(
            self.ids.pin_memory(), self.positions.pin_memory(), self.targets.pin_memory(), self.scale
        )

    def to(self, device: torch.device) -> ExampleBatch:
        return ExampleBatch(
            self.ids.to(device, non_blocking=True),
            self.positions.to(device, non_blocking=True),
            self.targets.to(device, non_blocking=True),
            self.scale,
        )


def pack_rows(lengths: list[int], window: int, packing: bool) -> list[list[int]]:
    """The examples (their positions in `lengths`) of each row: in order, a new row when the next
    does not fit (every example alone without packing)."""
    rows: list[list[int]] = []
    used = window
    for position, length in enumerate(lengths):
        if not packing or used + length > window:
            rows.append([])
            used = 0
        rows[-1].append(position)
        used += length
    return rows


def build_rows(
    examples: list[tuple[np.ndarray, np.ndarray]], window: int, packing: bool, pad_id: int, rows_multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(ids, positions, targets, target count) of `examples` laid into rows of `window` tokens,
    the row count padded to a multiple of `rows_multiple` with empty rows."""
    cut = [(ids[:window], mask[:window]) for ids, mask in examples]
    layout = pack_rows([len(ids) for ids, _ in cut], window, packing)
    count = -(-max(1, len(layout)) // rows_multiple) * rows_multiple
    ids_out = np.full((count, window), pad_id, dtype=np.int64)
    positions = np.zeros((count, window), dtype=np.int64)
    targets = np.zeros((count, window - 1), dtype=np.uint8)
    for row, members in enumerate(layout):
        at = 0
        for member in members:
            ids, mask = cut[member]
            n = len(ids)
            ids_out[row, at : at + n] = ids
            positions[row, at : at + n] = np.arange(n)
            # target t predicts token t + 1: the example's own tokens 1..n-1, where masked
            targets[row, at : at + n - 1] = mask[1:n]
            at += n
        if at < window:  # padding: its own segment (positions from 0), never a target
            positions[row, at:] = np.arange(window - at)
    total = int(targets.sum())
    return torch.from_numpy(ids_out), torch.from_numpy(positions), torch.from_numpy(targets), total


class ExampleSampler:
    """The examples of step `step` as this rank's micro-batches (module docstring)."""

    def __init__(
        self,
        examples: ExampleSet,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int = 1,
        global_batch: int = 0,
        packing: bool = True,
        pad_id: int = 0,
    ) -> None:
        if len(examples) == 0:
            raise DataError("the dataset holds no training examples")
        self.examples = examples
        self.window = seq_len + 1
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.global_batch = global_batch or batch_size * world_size
        if self.global_batch < 1:
            raise DataError(f"data.global_batch must be positive, got {self.global_batch}")
        self.accum_steps = 1
        self.packing = packing
        self.pad_id = pad_id

    def step_examples(self, step: int) -> list[int]:
        """The example indices of step `step`'s global batch, in order (the same on every rank)."""
        positions = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        return stream_examples(positions, len(self.examples), self.seed).tolist()

    def step_rows(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Every rank's rows of step `step` (ids, positions, targets) and the step's target count."""
        chosen = [self.examples.example(i) for i in self.step_examples(step)]
        return build_rows(chosen, self.window, self.packing, self.pad_id, self.world_size * self.batch_size)

    def micro_batches(self, step: int) -> list[ExampleBatch]:
        ids, positions, targets, total = self.step_rows(step)
        share = ids.shape[0] // self.world_size
        mine = slice(self.rank * share, (self.rank + 1) * share)
        scale = self.world_size / max(1, total)
        return [
            ExampleBatch(i, p, t, scale)
            for i, p, t in zip(
                ids[mine].split(self.batch_size),
                positions[mine].split(self.batch_size),
                targets[mine].split(self.batch_size),
                strict=True,
            )
        ]

    def state_dict(self, next_step: int) -> dict[str, Any]:
        return {
            "next_step": next_step,
            "seed": self.seed,
            "rank": self.rank,
            "global_batch": self.global_batch,
            "format": "examples",
            "packing": self.packing,
        }

    def check_resumable(self, saved: dict[str, Any], source: str) -> None:
        """DataError, in one line, when a checkpoint's sampler drew other examples or rows."""
        saved_batch = int(saved.get("global_batch", self.global_batch))
        if saved.get("format", "tokens") != "examples":
            raise DataError(
                f"{source} was trained on a token stream but this run's data.format is examples: "
                "continue from a registered version (model_source models:/...) or use a new checkpoint dir"
            )
        if saved_batch != self.global_batch:
            raise DataError(
                f"{source} was trained with a global batch of {saved_batch} examples but this run's is "
                f"{self.global_batch}: its data would differ; set data.global_batch={saved_batch} "
                "or use a new checkpoint dir"
            )


def masked_loss(model: torch.nn.Module, batch: ExampleBatch) -> torch.Tensor:
    """Summed cross-entropy of the batch's targets times its scale (module docstring).

    For the architectures whose loss runs the output head chunk by chunk
    (`hf_causal_lm.CHUNKED_HEAD_MODEL_TYPES`) only the target positions' hidden states go
    through the head, in chunks, inside the root's forward: no full-vocabulary logits of the
    whole batch exist, and prompt positions cost no head matmul."""
    from trainer.models.hf_causal_lm import CHUNKED_HEAD_MODEL_TYPES
    from trainer.models.spec import run_as_forward

    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in CHUNKED_HEAD_MODEL_TYPES:
        return run_as_forward(model, _chunked_masked_loss, batch)  # type: ignore[arg-type]
    out = model(input_ids=batch.ids[:, :-1], position_ids=batch.positions[:, :-1], use_cache=False)
    logits = out.logits
    chosen = batch.targets.bool()
    if not chosen.any():
        return logits.float().sum() * 0.0  # keeps every parameter in the graph (FSDP's backward hooks)
    loss = torch.nn.functional.cross_entropy(
        logits[chosen].float(), batch.ids[:, 1:][chosen], reduction="sum"
    )
    return loss * batch.scale


def _chunked_masked_loss(model: Any, batch: ExampleBatch) -> torch.Tensor:
    from trainer.models.spec import chunked_cross_entropy

    hidden = model.base_model(
        input_ids=batch.ids[:, :-1], position_ids=batch.positions[:, :-1], use_cache=False
    ).last_hidden_state
    head = model.get_output_embeddings()
    chosen = batch.targets.bool()
    count = int(chosen.sum())
    if count == 0:  # padding rows only: zero, with the head and every layer still in the graph
        return head(hidden[:, :1]).float().sum() * 0.0
    mean = chunked_cross_entropy(hidden[chosen], head, batch.ids[:, 1:][chosen], vocab_size=head.out_features)
    return mean * (count * batch.scale)
