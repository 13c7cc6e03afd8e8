"""Pure staging logic: checksum expectations, part sizes, progress text, shards, key mapping, local source."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from components.stage_data import snapshot_store, stage
from components.stage_data.checksums import (
    Expectation,
    plausible_part_sizes,
    verify_file,
    verify_file_any_part_size,
)
from components.stage_data.prepare_data import SHARD_INDEX_NAME, write_shards
from components.stage_data.progress import Progress, format_progress
from components.stage_data.settings import TransferSettings, backoff_s
from components.stage_data.snapshot_store import MANIFEST_NAME, SnapshotStore, relative_paths
from components.stage_data.stage import StageError, stage_dataset

MIB = 2**20


def _multipart_etag(data: bytes, part: int) -> str:
    digests = [hashlib.md5(data[i : i + part]).digest() for i in range(0, len(data), part)]
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def test_single_part_md5_etag(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"hello world")
    assert verify_file(path, Expectation(11, hashlib.md5(b"hello world").hexdigest())) == ""
    assert "MD5" in verify_file(path, Expectation(11, hashlib.md5(b"hello worle").hexdigest()))
    assert "size" in verify_file(path, Expectation(12, hashlib.md5(b"hello world").hexdigest()))


def test_multipart_etag_with_known_and_guessed_part_size(tmp_path):
    data = bytes(range(256)) * (13 * MIB // 256)  # 13 MiB in 8 MiB parts: 2 parts
    path = tmp_path / "f"
    path.write_bytes(data)
    etag = _multipart_etag(data, 8 * MIB)
    assert verify_file(path, Expectation(len(data), etag, part_size=8 * MIB)) == ""
    assert verify_file_any_part_size(path, Expectation(len(data), etag)) == ""  # 8 MiB is guessed
    assert verify_file_any_part_size(path, Expectation(len(data), _multipart_etag(data[::-1], 8 * MIB))) != ""
    assert 8 * MIB in plausible_part_sizes(len(data), 2) and 5 * MIB not in plausible_part_sizes(len(data), 2)


@pytest.mark.parametrize("algorithm", ["SHA256", "CRC32", "CRC32C"])
def test_additional_full_object_checksums(tmp_path, algorithm):
    data = b"some training text\n" * 1000
    path = tmp_path / "f"
    path.write_bytes(data)
    if algorithm == "SHA256":
        raw = hashlib.sha256(data).digest()
    elif algorithm == "CRC32":
        raw = zlib.crc32(data).to_bytes(4, "big")
    else:
        google_crc32c = pytest.importorskip("google_crc32c")
        raw = google_crc32c.value(data).to_bytes(4, "big")
    good = base64.b64encode(raw).decode()
    etag = hashlib.md5(data).hexdigest()
    assert verify_file(path, Expectation(len(data), etag, algorithm, good)) == ""
    bad = base64.b64encode(bytes(b ^ 1 for b in raw)).decode()
    assert algorithm in verify_file(path, Expectation(len(data), etag, algorithm, bad))


def test_composite_checksum_over_parts(tmp_path):
    data = b"x" * (6 * MIB)
    path = tmp_path / "f"
    path.write_bytes(data)
    parts = [hashlib.sha256(data[i : i + 5 * MIB]).digest() for i in range(0, len(data), 5 * MIB)]
    composite = f"{base64.b64encode(hashlib.sha256(b''.join(parts)).digest()).decode()}-2"
    exp = Expectation(len(data), _multipart_etag(data, 5 * MIB), "SHA256", composite, part_size=5 * MIB)
    assert verify_file(path, exp) == ""


def test_backoff_is_bounded_and_jittered():
    import random

    rng = random.Random(0)
    values = [backoff_s(attempt, 0.25, 2.0, rng) for attempt in range(10) for _ in range(20)]
    assert all(0 <= v <= 2.0 for v in values) and len(set(values)) > 100
    assert TransferSettings().request_attempts > 1


def test_progress_line_and_log_mode():
    line = format_progress(512 * MIB, 1024 * MIB, 3, 10, elapsed_s=2.0)
    assert "50.0%" in line and "256.0 MiB/s" in line and "ETA 0:02" in line and "3/10 files" in line
    stream = io.StringIO()  # not a terminal: reports go to the log, nothing is drawn
    progress = Progress(10, 1, stream=stream)
    progress.add_bytes(10)
    progress.close()
    assert stream.getvalue() == "" and not progress.interactive


def test_key_mapping_refusals():
    with pytest.raises(StageError, match="outside"):
        relative_paths(["p/a/../../../x"], "p/")
    with pytest.raises(StageError, match="staging uses itself"):
        relative_paths(["p/x.part"], "p/")
    with pytest.raises(StageError, match="both a file and the folder"):
        relative_paths(["p/a", "p/a/b"], "p/")


def test_key_mapping_normalizes_exactly_as_normpath_for_every_key_it_accepts():
    import itertools
    import posixpath

    # Every key of up to 5 pieces over pieces that exercise normpath's rules.
    pieces = ["a", ".", "..", "/", "b.part", ".h", "c/"]
    for n in range(1, 6):
        for combo in itertools.product(pieces, repeat=n):
            key = "p/" + "".join(combo)
            try:
                mapped = relative_paths([key], "p/")[key]
            except StageError:
                continue
            assert mapped == posixpath.normpath(key[2:]), key
    assert relative_paths(["p/a//b", "p/./c", "p/d/"], "p/") == {"p/a//b": "a/b", "p/./c": "c", "p/d/": "d"}


def test_a_snapshot_file_is_checked_with_one_lstat(tmp_path, monkeypatch):
    import os

    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "f")
    mtime = (tmp_path / "f").stat().st_mtime_ns
    calls = []
    lstat = os.lstat
    monkeypatch.setattr(snapshot_store.os, "lstat", lambda path: calls.append(path) or lstat(path))
    damage = snapshot_store.local_file_damage

    def entry(path, size=3, mtime_ns=mtime):
        return {"path": path, "size": size, "mtime_ns": mtime_ns}

    assert damage(tmp_path, entry("f"), "stat") == ""
    assert len(calls) == 1
    assert damage(tmp_path, entry("gone"), "stat") == "missing"
    assert damage(tmp_path, entry("d"), "stat") == "not a regular file"
    assert damage(tmp_path, entry("link"), "stat") == "not a regular file"
    assert damage(tmp_path, entry("f", size=4), "stat") == "size 3 != 4"
    assert (
        damage(tmp_path, entry("f", mtime_ns=mtime + 1), "stat")
        == "modified since it was staged (mtime changed)"
    )


def test_manifest_name_matches_the_trainer():
    from trainer.data import MANIFEST_NAME as TRAINER_MANIFEST
    from trainer.data import SHARD_INDEX_NAME as TRAINER_INDEX

    assert (MANIFEST_NAME, SHARD_INDEX_NAME) == (TRAINER_MANIFEST, TRAINER_INDEX)


def test_the_shard_writer_keeps_documents_whole_and_each_side_apart(tmp_path):
    from trainer.tokenized_data import ShardWriter

    writer = ShardWriter(tmp_path, shard_bytes=12)
    for record, holdout in [
        (b"aaaaa\n", False),
        (b"xx\n", True),
        (b"bbbbb\n", False),
        (b"c" * 20 + b"\n", False),
    ]:
        writer.add(record, holdout)
    writer.add(b"d\n", False)
    shards = writer.close()
    assert [(s["name"], s["documents"], s["split"]) for s in shards] == [
        ("train-00000.bin", 2, "train"),
        ("train-00001.bin", 1, "train"),
        ("holdout-00000.bin", 1, "holdout"),
        ("train-00002.bin", 1, "train"),
    ]
    assert (tmp_path / "train-00000.bin").read_bytes() == b"aaaaa\nbbbbb\n"
    assert (tmp_path / "train-00001.bin").read_bytes() == b"c" * 20 + b"\n"
    assert (tmp_path / "holdout-00000.bin").read_bytes() == b"xx\n"


def test_prepared_shards_stage_from_a_local_folder_and_train(tmp_path):
    from trainer.data import load_tokens, split_files

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 200)
    index = write_shards(corpus, tmp_path / "shards", shard_bytes=4096)
    assert index["documents"] == 30 and len(index["shards"]) > 2
    assert index["tokens"] == sum(len(f"document {i} " * 200) + 1 for i in range(30))
    (tmp_path / "shards" / "link").symlink_to("/etc/passwd")  # never followed
    result = stage_dataset(str(tmp_path / "shards"), str(tmp_path / "fsx"), "ds")
    keys = [
        e["key"]
        for e in json.loads((tmp_path / "fsx/rtp/datasets/ds/current/manifest.json").read_text())["files"]
    ]
    assert "link" not in keys and SHARD_INDEX_NAME in keys and result.files == len(index["shards"]) + 1
    train, holdout = split_files(result.snapshot_dir, 0.1)
    assert SHARD_INDEX_NAME not in {f.key for f in train + holdout}
    assert load_tokens(train + holdout).numel() == index["tokens"] + len(index["shards"])
    again = stage_dataset(str(tmp_path / "shards"), str(tmp_path / "fsx"), "ds")
    assert again.bytes_downloaded == 0


def test_snapshot_store_recheck_asks_for_exactly_the_damaged_files(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for i in range(3):
        (source / f"f{i}.txt").write_bytes(f"file {i}\n".encode() * 50)
    first = stage_dataset(str(source), str(tmp_path / "fsx"), "ds")
    store = SnapshotStore(tmp_path / "fsx/rtp/datasets/ds")
    (store.root / "current").unlink()  # recheck re-points it
    damaged = store.snapshot_dir(first.snapshot_id) / "f1.txt"
    damaged.write_bytes(b"x" * damaged.stat().st_size)  # same size, new mtime
    asked = []

    def refetch(targets):
        asked.extend((obj.key, target) for obj, target in targets)
        for obj, target in targets:
            assert not target.exists()  # a shared hard link is broken before writing
            target.write_bytes((source / obj.key).read_bytes())

    assert store.current_snapshot() is None
    repaired = store.recheck(store.start_check(first.snapshot_id, "stat", None), refetch)
    assert [o.key for o in repaired] == ["f1.txt"] and asked == [("f1.txt", damaged)]
    assert (store.root / "current").resolve() == store.snapshot_dir(first.snapshot_id)
    assert store.current_snapshot() == first.snapshot_id
    with ThreadPoolExecutor(2) as pool:
        assert store.recheck(store.start_check(first.snapshot_id, "stat", pool), refetch) == []
    assert store.start_check("0123456789abcdef", "stat", None) is None  # no such snapshot


@pytest.mark.parametrize("slow", [False, True], ids=["local-speed", "network-speed"])
def test_a_file_check_on_a_pool_finds_every_damaged_file_in_manifest_order(tmp_path, monkeypatch, slow):
    """Files as quick to check as on a local disk are checked by one pool task (more would
    only contend for the interpreter lock); slower ones (a network file system: here every
    check sleeps) in chunks spread over the pool."""
    monkeypatch.setattr(snapshot_store, "CHECK_CHUNK_FILES", 3)
    source = tmp_path / "src"
    source.mkdir()
    for i in range(10):
        (source / f"f{i}.txt").write_bytes(b"x" * (10 + i))
    staged = stage_dataset(str(source), str(tmp_path / "fsx"), "ds")
    store = SnapshotStore(tmp_path / "fsx/rtp/datasets/ds")
    folder = store.snapshot_dir(staged.snapshot_id)
    (folder / "f1.txt").unlink()
    (folder / "f5.txt").write_bytes(b"short")
    (folder / "f9.txt").write_bytes(b"y" * 19)  # same size, new mtime
    threads: set[str] = set()
    check_one = snapshot_store.local_file_damage

    def timed(folder, entry, verify_local):
        threads.add(threading.current_thread().name)
        if slow:
            time.sleep(0.05)  # far above SLOW_CHECK_S (0.2 ms)
        return check_one(folder, entry, verify_local)

    monkeypatch.setattr(snapshot_store, "local_file_damage", timed)
    if not slow:
        monkeypatch.setattr(snapshot_store, "SLOW_CHECK_S", 60.0)  # however busy the machine
    with ThreadPoolExecutor(4, thread_name_prefix="stage") as pool:
        check = store.start_check(staged.snapshot_id, "stat", pool)
        found = [(entry["path"], reason.split(" ")[0]) for entry, reason in check.damaged()]
    assert found == [("f1.txt", "missing"), ("f5.txt", "size"), ("f9.txt", "modified")]
    assert check.parallel == slow
    assert all(name.startswith("stage") for name in threads)
    assert len(threads) > 1 if slow else len(threads) == 1


def test_a_restage_checks_each_current_file_once_whether_or_not_the_source_changed(tmp_path, monkeypatch):
    """The check of `current` started before the listing serves both the no-change re-check
    and the links of a changed source; a damaged file it found is fetched, never linked."""
    source = tmp_path / "src"
    source.mkdir()
    for i in range(6):
        (source / f"f{i}.txt").write_bytes(f"file {i}\n".encode() * 20)
    first = stage_dataset(str(source), str(tmp_path / "fsx"), "ds")
    checked: list[str] = []
    check_one = snapshot_store.local_file_damage

    def counted(folder, entry, verify_local):
        checked.append(entry["path"])
        return check_one(folder, entry, verify_local)

    order: list[str] = []
    start_check, list_folder = SnapshotStore.start_check, stage.list_local_folder
    monkeypatch.setattr(snapshot_store, "local_file_damage", counted)
    monkeypatch.setattr(SnapshotStore, "start_check", lambda *a: order.append("check") or start_check(*a))
    monkeypatch.setattr(stage, "list_local_folder", lambda *a: order.append("list") or list_folder(*a))
    again = stage_dataset(str(source), str(tmp_path / "fsx"), "ds")
    assert again.snapshot_id == first.snapshot_id and again.bytes_downloaded == 0
    assert sorted(checked) == [f"f{i}.txt" for i in range(6)]
    assert order == ["check", "list"]  # the check runs while the source is listed

    checked.clear()
    old = SnapshotStore(tmp_path / "fsx/rtp/datasets/ds").snapshot_dir(first.snapshot_id)
    (old / "f2.txt").write_bytes(b"?" * (old / "f2.txt").stat().st_size)  # damaged in `current`
    (source / "f5.txt").write_bytes(b"changed\n")
    changed = stage_dataset(str(source), str(tmp_path / "fsx"), "ds")
    assert changed.snapshot_id != first.snapshot_id
    assert sorted(checked) == [f"f{i}.txt" for i in range(6)]
    assert (changed.files_downloaded, changed.files_reused) == (2, 4)
    new = Path(changed.snapshot_dir)
    assert (new / "f2.txt").read_bytes() == (source / "f2.txt").read_bytes()
    assert (new / "f0.txt").stat().st_ino == (old / "f0.txt").stat().st_ino


@pytest.mark.parametrize("slow", [False, True], ids=["local-speed", "network-speed"])
def test_files_to_keep_are_checked_and_linked_in_chunks_on_the_pool_where_slow(tmp_path, monkeypatch, slow):
    """Files quick to check and link (a local disk) are kept by the stage's own thread;
    slower ones (here every check sleeps, as a metadata round trip would) on the pool."""
    monkeypatch.setattr(snapshot_store, "CHECK_CHUNK_FILES", 3)
    monkeypatch.setattr(snapshot_store, "SLOW_CHECK_S", 0.02 if slow else 60.0)
    source = tmp_path / "src"
    source.mkdir()
    for i in range(10):
        (source / f"f{i}.txt").write_bytes(f"file {i}\n".encode() * 30)
    first = stage_dataset(str(source), str(tmp_path / "fsx"), "ds")
    threads: set[str] = set()
    finished = stage.finished_by_earlier_attempt

    def seen(target, obj):
        threads.add(threading.current_thread().name)
        if slow:
            time.sleep(0.05)
        return finished(target, obj)

    monkeypatch.setattr(stage, "finished_by_earlier_attempt", seen)
    (source / "f7.txt").write_bytes(b"changed\n")
    changed = stage_dataset(str(source), str(tmp_path / "fsx"), "ds")
    assert (changed.files_reused, changed.files_downloaded) == (9, 1)
    if slow:
        assert threading.current_thread().name in threads and any(
            name.startswith("stage") for name in threads
        )
    else:
        assert threads == {threading.current_thread().name}
    old, new = Path(first.snapshot_dir), Path(changed.snapshot_dir)
    assert all(
        (new / f"f{i}.txt").stat().st_ino == (old / f"f{i}.txt").stat().st_ino for i in range(10) if i != 7
    )
    assert (new / "f7.txt").read_bytes() == b"changed\n"


def test_the_manifest_records_each_files_mtime_in_key_order_when_read_on_the_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_store, "CHECK_CHUNK_FILES", 3)
    monkeypatch.setattr(snapshot_store, "SLOW_CHECK_S", 0.0)  # every chunk counts as slow
    threads: set[str] = set()
    entry = snapshot_store.manifest_entry

    def seen(*args):
        threads.add(threading.current_thread().name)
        return entry(*args)

    monkeypatch.setattr(snapshot_store, "manifest_entry", seen)
    source = tmp_path / "src"
    source.mkdir()
    for i in reversed(range(10)):
        (source / f"f{i}.txt").write_bytes(b"x" * i)
    staged = stage_dataset(str(source), str(tmp_path / "fsx"), "ds")
    folder = Path(staged.snapshot_dir)
    files = json.loads((folder / MANIFEST_NAME).read_text())["files"]
    assert [f["path"] for f in files] == [f"f{i}.txt" for i in range(10)]
    assert all(f["mtime_ns"] == (folder / f["path"]).stat().st_mtime_ns for f in files)
    assert any(name.startswith("stage") for name in threads)
