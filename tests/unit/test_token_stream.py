"""The memory-mapped token stream gives exactly the batches of the loader it replaced.

The reference is the old whole-file loader (`benchmarks.scale_data.legacy_*`, kept verbatim):
every exactness and resume test compares runs with each other, so a sampler that drew other
windows, or the same windows from a different sequence, would silently change every run's data.
A step's global batch is the old loader's rank-0 batch of `global_batch` rows, so one-rank runs
keep their data; on more ranks each rank takes its slice of it.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.scale_data import LegacyStepSampler, legacy_holdout_batches, legacy_load_tokens
from rtp_support.demo_data import write_local_manifest
from trainer.data import DataError, StepSampler, TokenStream, holdout_batches, load_tokens, split_files

pytestmark = pytest.mark.timeout(120)


def snapshot(folder: Path, contents: dict[str, bytes], dtype: str | None = None) -> Path:
    """A snapshot of `contents` (name -> bytes); with `dtype`, an index.json of token shards."""
    (folder / "files").mkdir(parents=True)
    for name, data in contents.items():
        (folder / "files" / name).write_bytes(data)
    if dtype:
        index = {"format": "rtp-token-shards", "version": 2, "tokenizer": "t", "dtype": dtype}
        (folder / "files" / "index.json").write_text(json.dumps(index))
    return write_local_manifest(folder, key_prefix="data/", snapshot_id="test")


def byte_files(count: int = 14) -> dict[str, bytes]:
    rng = np.random.default_rng(7)  # sizes 1..40: many windows of 17 span two or more files
    return {f"f{i:02d}.txt": rng.integers(32, 127, size=int(rng.integers(1, 41)), dtype=np.uint8).tobytes()
            for i in range(count)}  # fmt: skip


def token_files(dtype: str, count: int = 14) -> dict[str, bytes]:
    rng = np.random.default_rng(11)  # ids below 2**31: the old int32 cast kept them
    high = min(np.iinfo(dtype).max, 2**31 - 1)
    return {f"shard-{i:05d}.bin": rng.integers(0, high, size=int(rng.integers(1, 30)), dtype=np.int64)
            .astype(np.dtype(dtype).newbyteorder("<")).tobytes() for i in range(count)}  # fmt: skip


def crosses_a_boundary(files, starts: list[int], window: int, separator: bool) -> bool:
    ends = np.cumsum([f.size // np.dtype(f.dtype).itemsize + separator for f in files])
    return any(np.searchsorted(ends, s, side="right") != np.searchsorted(ends, s + window - 1, side="right")
               for s in starts)  # fmt: skip


@pytest.mark.parametrize("kind", ["bytes", "uint16", "uint32"])
def test_batches_equal_the_whole_file_loader_for_every_seed_step_and_world_size(tmp_path, kind):
    contents = byte_files() if kind == "bytes" else token_files(kind)
    root = snapshot(tmp_path, contents, None if kind == "bytes" else kind)
    train, holdout = split_files(root, 0.2)
    stream, legacy = load_tokens(train), legacy_load_tokens(train)
    assert stream.numel() == legacy.numel() == len(stream)
    # the virtual stream is the old concatenation token for token, separators included
    assert torch.equal(stream.gather([0], stream.numel())[0], legacy.long())
    crossed = False
    for seed in (0, 3):
        # the global batch is the old loader's rank-0 batch of all 12 rows; ranks take slices of it
        old = LegacyStepSampler(legacy, seq_len=16, batch_size=12, seed=seed, rank=0)
        samplers = [StepSampler(stream, 16, 2, seed, rank, world, global_batch=12) for world in (1, 2, 3)
                    for rank in range(world)]  # fmt: skip
        for step in range(30):
            expected = old.batch(step)
            for new in samplers:
                rows = 12 // new.world_size
                batch = new.batch(step)
                assert batch.dtype == torch.int64
                assert torch.equal(batch, expected[new.rank * rows : (new.rank + 1) * rows])
            starts = samplers[0].global_starts(step)
            assert torch.equal(stream.gather(starts, 17), expected)
            crossed |= crosses_a_boundary(train, starts, 17, kind == "bytes")
    assert crossed, "no window spanned two files: the test does not exercise the boundary"
    for seq_len in (4, 16):
        expected = legacy_holdout_batches(legacy_load_tokens(holdout), seq_len, max_windows=9, batch_size=4)
        got = holdout_batches(load_tokens(holdout), seq_len, max_windows=9, batch_size=4)
        assert len(got) == len(expected) and all(map(torch.equal, got, expected))


def test_a_holdout_shorter_than_one_window_is_one_short_row_as_before():
    tokens = torch.arange(7, dtype=torch.uint8)
    expected = legacy_holdout_batches(tokens, seq_len=16)
    got = holdout_batches(TokenStream.from_array(tokens), seq_len=16)
    assert got[0].shape == (1, 7) and all(map(torch.equal, got, expected))


def test_a_file_that_differs_from_the_manifest_is_named_with_the_fix(tmp_path):
    root = snapshot(tmp_path, byte_files())
    train, _ = split_files(root, 0.2)
    with train[3].path.open("ab") as handle:
        handle.write(b"appended after staging")
    with pytest.raises(
        DataError, match=rf"{train[3].path} is \d+ bytes but manifest.json says \d+.*rtp stage"
    ):
        load_tokens(train)


def test_a_token_file_of_a_partial_token_is_named_with_the_fix(tmp_path):
    root = snapshot(
        tmp_path / "a", {"shard-00000.bin": b"\x01\x00" * 40, "shard-00001.bin": b"\x01" * 41}, "uint16"
    )
    files = split_files(root, 0.0)[0] + split_files(root, 0.0)[1]
    with pytest.raises(
        DataError, match=r"shard-00001.bin is 41 bytes, not a whole number of 2-byte uint16.*rtp prepare-data"
    ):
        load_tokens(files)


def test_open_files_stay_bounded_however_many_files_are_read(tmp_path, monkeypatch):
    import trainer.data

    monkeypatch.setattr(trainer.data, "MAX_OPEN_FILES", 3)
    root = snapshot(tmp_path, token_files("uint16", count=40), "uint16")
    train, _ = split_files(root, 0.1)
    descriptors = len(os.listdir("/proc/self/fd"))
    new = StepSampler(load_tokens(train), seq_len=16, batch_size=8, seed=0, rank=0)
    old = LegacyStepSampler(legacy_load_tokens(train), seq_len=16, batch_size=8, seed=0, rank=0)
    for step in range(40):
        assert torch.equal(new.batch(step), old.batch(step))
        assert len(os.listdir("/proc/self/fd")) <= descriptors + 3


def _rss_mib() -> float:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024


def test_memory_does_not_grow_with_the_data(tmp_path):
    """512 MiB of (sparse) uint16 shards: the old loader held them as 512 MiB of int32 after reading them."""
    files = tmp_path / "files"
    files.mkdir()
    for name in ("shard-00000.bin", "shard-00001.bin", "shard-00002.bin"):
        with (files / name).open("wb") as handle:
            handle.truncate(256 * 2**20)
    (files / "index.json").write_text(json.dumps({"dtype": "uint16", "tokenizer": "t"}))
    entries = [{"key": f"d/{p.name}", "size": p.stat().st_size, "etag": "", "path": f"files/{p.name}"}
               for p in sorted(files.iterdir())]  # fmt: skip
    (tmp_path / "manifest.json").write_text(json.dumps({"files": entries}))
    train, _ = split_files(tmp_path, 0.1)
    before = _rss_mib()
    sampler = StepSampler(load_tokens(train), seq_len=2048, batch_size=8, seed=0, rank=0)
    for step in range(20):
        assert sampler.batch(step).shape == (8, 2049)
    assert _rss_mib() - before < 48
