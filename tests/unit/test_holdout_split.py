"""The holdout stays held out across preparations of a growing corpus (`rtp prepare-data`).

Nightly runs prepare a corpus that grew since last night. If a document trained on last
night landed in tonight's holdout, the champion (trained on it) would be flattered by the
gate. The split is by each document's content, so these tests grow a corpus between two
preparations, in both shard formats, and read the sides back the way the trainer and the
validate step do (`trainer.data.split_files` over a staged snapshot)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from components.stage_data.prepare_data import HOLDOUT_FRACTION, PrepareError, write_shards
from rtp_support.demo_data import write_local_manifest
from tests.hf_tiny import train_tokenizer
from trainer.config import DataConfig
from trainer.data import DataError, split_files
from trainer.tokenized_data import write_token_shards


def _documents(count: int, tag: str) -> dict[str, str]:
    """Unique one-line documents (no newline inside: the byte shards separate them by one)."""
    return {f"doc-{i:04d}{tag}.txt": f"{tag} document {i} " * (5 + i % 7) for i in range(count)}


def _prepare(corpus: dict[str, str], root: Path, tokenizer: Path | None = None) -> Path:
    """Write `corpus`, prepare it, lay the shards out as a staged snapshot; returns the snapshot."""
    source = root / "corpus"
    source.mkdir(parents=True)
    for name, text in corpus.items():
        (source / name).write_text(text)
    snapshot = root / "snapshot"
    if tokenizer is None:
        write_shards(source, snapshot / "files", shard_bytes=2048)
    else:
        write_token_shards(source, snapshot / "files", tokenizer, shard_bytes=2048, workers=2)
    return write_local_manifest(snapshot, key_prefix="tokens/", snapshot_id=root.name)


def _sides(snapshot: Path, separator: int, dtype: str) -> tuple[set[bytes], set[bytes]]:
    """(train, holdout) documents of a snapshot as split_files gives them."""

    def documents(files) -> set[bytes]:
        found: set[bytes] = set()
        for file in files:
            ids = np.fromfile(file.path, dtype=dtype)
            ends = np.flatnonzero(ids == separator)
            starts = np.concatenate([[0], ends[:-1] + 1])
            found.update(ids[start:end].tobytes() for start, end in zip(starts, ends, strict=True))
        return found

    train, holdout = split_files(snapshot, holdout_fraction=0.5)  # the recorded split wins
    return documents(train), documents(holdout)


def _assert_stable(first: tuple[set[bytes], set[bytes]], second: tuple[set[bytes], set[bytes]]) -> None:
    train_1, holdout_1 = first
    train_2, holdout_2 = second
    assert train_1 and holdout_1 and not train_1 & holdout_1
    assert not holdout_2 & train_1, "a document trained on in run 1 is in run 2's holdout"
    assert holdout_1 <= holdout_2 and train_1 <= train_2  # every document kept its side
    assert len(holdout_2) > len(holdout_1) and len(train_2) > len(train_1)  # the new ones were split too
    # About the fraction of documents (120 documents, 10%: 3-30 is a loose binomial bound).
    assert 3 <= len(holdout_2) <= 30


def test_a_growing_byte_corpus_keeps_every_document_on_its_side(tmp_path):
    corpus = _documents(60, "a")
    first = _sides(_prepare(corpus, tmp_path / "night-1"), 10, "uint8")
    # New documents sort between the old ones: every shard of night 2 holds other bytes
    # under the same name than night 1's (what a split by shard key got wrong).
    grown = {**corpus, **{name.replace("a.txt", "b.txt"): text for name, text in _documents(60, "b").items()}}
    second = _sides(_prepare(grown, tmp_path / "night-2"), 10, "uint8")
    _assert_stable(first, second)


def test_a_growing_tokenized_corpus_keeps_every_document_on_its_side(tmp_path):
    tokenizer = tmp_path / "tokenizer"
    train_tokenizer(tokenizer)
    eos = json.loads((tokenizer / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    corpus = _documents(60, "a")
    first_snapshot = _prepare(corpus, tmp_path / "night-1", tokenizer)
    index = json.loads((first_snapshot / "files" / "index.json").read_text())
    assert index["document_separator"] == eos and index["split"]["holdout_fraction"] == HOLDOUT_FRACTION
    first = _sides(first_snapshot, eos, index["dtype"])
    grown = {**corpus, **{name.replace("a.txt", "b.txt"): text for name, text in _documents(60, "b").items()}}
    second = _sides(_prepare(grown, tmp_path / "night-2", tokenizer), eos, index["dtype"])
    _assert_stable(first, second)


def test_a_small_corpus_still_holds_one_document_out_and_a_single_document_is_refused(tmp_path):
    # Two documents: whether or not one falls below the fraction, the held-out one is the
    # one with the smaller digest (the fallback when none does).
    corpus = {"one.txt": "first document", "two.txt": "second document"}
    snapshot = _prepare(corpus, tmp_path / "small")
    index = json.loads((snapshot / "files" / "index.json").read_text())
    assert sorted(s["split"] for s in index["shards"]) == ["holdout", "train"]
    held = min(corpus.values(), key=lambda text: hashlib.sha256(text.encode()).digest())
    assert _sides(snapshot, 10, "uint8") == (
        {t.encode() for t in corpus.values() if t != held},
        {held.encode()},
    )
    with pytest.raises(PrepareError, match="at least 2"):
        _prepare({"only.txt": "a single document"}, tmp_path / "single")


def test_the_recorded_split_reads_only_the_shards_its_index_lists(tmp_path):
    snapshot = _prepare(_documents(40, "a"), tmp_path / "night")
    files = snapshot / "files"
    (files / "shard-00000.bin").write_bytes(b"an earlier preparation's shard under the same prefix\n")
    write_local_manifest(snapshot, key_prefix="tokens/", snapshot_id="night")
    train, holdout = split_files(snapshot, 0.1)
    assert "tokens/shard-00000.bin" not in {f.key for f in train + holdout}
    for holdout_file in holdout:
        holdout_file.path.unlink()  # a snapshot staged without its holdout shards
    write_local_manifest(snapshot, key_prefix="tokens/", snapshot_id="night")
    with pytest.raises(DataError, match="0 holdout shard"):
        split_files(snapshot, 0.1)


def test_the_default_fraction_is_the_trainers():
    assert DataConfig().holdout_fraction == HOLDOUT_FRACTION
