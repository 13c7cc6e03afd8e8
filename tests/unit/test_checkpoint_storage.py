"""Durable checkpoints on the shared volume: the commit protocol, verification, retention and loading."""

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.unit.checkpoint_helpers import (
    _RunsCodeWhenUnpickled,
    _save,
    _step,
    _trained_model,
)
from tests.weights import state_dict_sha256
from trainer.checkpointing import storage
from trainer.checkpointing.storage import (
    COMMIT_MARKER,
    CheckpointError,
    apply_retention,
    latest_committed_checkpoint,
    load_checkpoint,
    load_model_weights,
    verify_checkpoint,
)
from trainer.models import model_spec

pytestmark = pytest.mark.usefixtures("single_rank_group")


def test_commit_leaves_only_the_final_folder_with_marker_and_manifest(tmp_path):
    model, optimizer = _trained_model()
    saved = _save(tmp_path, 3, model, optimizer)
    assert saved == tmp_path / "step_3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]
    for name in (COMMIT_MARKER, ".metadata", "manifest.json", "meta.json", "rank_state/rank_0.pt"):
        assert (saved / name).is_file(), name
    verify_checkpoint(saved, verify_hashes=True)
    assert storage.read_meta(saved)["step"] == 3


def test_load_restores_weights_optimizer_and_rng(tmp_path):
    model, optimizer = _trained_model(seed=0)
    torch.manual_seed(42)
    _save(tmp_path, 1, model, optimizer)
    expected_rng_draw = torch.rand(3)

    fresh, fresh_optimizer = _trained_model(seed=1)
    assert not torch.equal(fresh.tok_emb.weight, model.tok_emb.weight)
    restored = load_checkpoint(tmp_path / "step_1", fresh, fresh_optimizer)
    assert restored["rank_state"]["position"] == 1
    assert torch.equal(torch.rand(3), expected_rng_draw)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    exp_avg = next(iter(optimizer.state.values()))["exp_avg"]
    assert torch.equal(next(iter(fresh_optimizer.state.values()))["exp_avg"], exp_avg)


def test_latest_skips_uncommitted_and_torn_checkpoints(tmp_path, caplog):
    model, optimizer = _trained_model()
    _save(tmp_path, 2, model, optimizer)
    _save(tmp_path, 4, model, optimizer)
    (tmp_path / "step_6.tmp").mkdir()  # a save that never committed
    assert latest_committed_checkpoint(tmp_path) == tmp_path / "step_4"

    shard = next((tmp_path / "step_4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # torn write
    with caplog.at_level(logging.WARNING):
        assert latest_committed_checkpoint(tmp_path) == tmp_path / "step_2"
    assert shard.name in caplog.text


def test_hash_verification_catches_same_size_corruption(tmp_path):
    model, optimizer = _trained_model()
    _save(tmp_path, 1, model, optimizer)
    shard = next((tmp_path / "step_1").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert latest_committed_checkpoint(tmp_path, verify_hashes=False) == tmp_path / "step_1"
    assert latest_committed_checkpoint(tmp_path, verify_hashes=True) is None
    with pytest.raises(CheckpointError, match=shard.name):
        verify_checkpoint(tmp_path / "step_1", verify_hashes=True)


def test_missing_marker_means_not_committed(tmp_path):
    model, optimizer = _trained_model()
    _save(tmp_path, 1, model, optimizer)
    (tmp_path / "step_1" / COMMIT_MARKER).unlink()
    assert latest_committed_checkpoint(tmp_path) is None


def test_retention_keeps_the_newest(tmp_path):
    model, optimizer = _trained_model()
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, optimizer)
    (tmp_path / "step_5.tmp").mkdir()
    removed = apply_retention(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step_1", "step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4", "step_5.tmp"]
    apply_retention(tmp_path, keep_last=0)  # never deletes the newest committed one
    assert (tmp_path / "step_4").is_dir()


def test_retention_also_keeps_every_mth_step(tmp_path):
    model, optimizer = _trained_model()
    for step in range(1, 9):
        _save(tmp_path, step, model, optimizer)
    apply_retention(tmp_path, keep_last=2, keep_every=3)
    assert sorted(int(p.name.split("_")[1]) for p in tmp_path.iterdir()) == [3, 6, 7, 8]


class _Killed(BaseException):
    """A process killed in the middle of a call."""


def test_a_deletion_cut_short_leaves_no_torn_checkpoint_that_looks_committed(tmp_path, monkeypatch):
    """Retention (and a re-save of a step) deletes whole folders; a kill halfway through
    must not leave a `step_<N>` missing files that a reader takes for committed."""
    model, optimizer = _trained_model()
    for step in (1, 2, 3):
        _save(tmp_path, step, model, optimizer)
    real_rmtree = storage.shutil.rmtree

    def killed_halfway(path, *args, **kwargs):
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        if files:
            files[0].unlink()
            raise _Killed
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(storage.shutil, "rmtree", killed_halfway)
    with pytest.raises(_Killed):
        apply_retention(tmp_path, keep_last=1)
    with pytest.raises(_Killed):
        storage.prepare_staging(tmp_path, 3, storage.rank_state({}))  # a re-save of step 3 replaces it
    monkeypatch.undo()
    for _, folder in storage.committed_steps(tmp_path):
        verify_checkpoint(folder, verify_hashes=True)
    apply_retention(tmp_path, keep_last=1)  # and the next retention clears what was cut short
    assert not list(tmp_path.glob("*.deleting"))


def test_manifest_takes_shard_hashes_from_sidecars_and_drops_them(tmp_path):
    model, optimizer = _trained_model()
    staging, final = storage.prepare_staging(tmp_path, 1, storage.rank_state({}))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(staging))
    storage.write_hash_sidecars(staging, rank=0)
    shard = next(staging.glob("*.distcp"))
    assert (staging / (shard.name + ".sha256")).read_text() == storage.sha256_file(shard)
    storage.commit(staging, final, 1, {})
    assert not list(final.glob("*.sha256"))
    verify_checkpoint(final, verify_hashes=True)  # the sidecar hash was the real one


def test_load_model_weights_into_a_plain_module(tmp_path):
    model, optimizer = _trained_model()
    _save(tmp_path, 1, model, optimizer)
    plain = model_spec("byte-lm").build(model.cfg, torch.device("cpu"))
    load_model_weights(tmp_path / "step_1", plain)
    assert torch.equal(plain.blocks[0].qkv.weight, model.blocks[0].qkv.weight)


def test_a_rank_state_file_that_would_run_code_is_refused(tmp_path, monkeypatch):
    """The shared volume is writable by any pod: loading a checkpoint never unpickles objects."""
    model, optimizer = _trained_model()
    saved = _save(tmp_path, 1, model, optimizer)
    marker = tmp_path / "pwned"
    monkeypatch.setenv("RTP_TEST_PWNED", str(marker))
    torch.save(
        {"torch_rng": torch.get_rng_state(), "x": _RunsCodeWhenUnpickled()},
        saved / "rank_state/rank_0.pt",
    )
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(saved, *_trained_model(seed=1))
    assert not marker.exists()


def test_a_checkpoint_is_verified_against_its_published_manifest_before_loading(tmp_path):
    from trainer.checkpointing.storage import manifest_sha256, verify_published

    model, optimizer = _trained_model()
    saved = _save(tmp_path, 1, model, optimizer)
    published = manifest_sha256(saved)
    verify_published(saved, published)
    other = _save(tmp_path / "other", 1, *_trained_model(seed=5))
    with pytest.raises(CheckpointError, match="not the checkpoint the train step published"):
        verify_published(other, published)
    shard = next(saved.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        verify_published(saved, published)
    with pytest.raises(CheckpointError, match="no published"):
        verify_published(saved, "")


def _two_rank_saves(rank: int, store_path: str, root: str, out_dir: str) -> None:
    """One rank of a 2-rank gloo group: a `sync` save (step 1) and a `save_checkpoint`
    (step 2) of a sharded model; records the files each rank hashed in each save."""
    import time

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.checkpointing import model_sha256
    from trainer.checkpointing.writer import PendingSave, SaveRecord, SyncWriter
    from trainer.parallelize import apply_fsdp

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        model, _ = _trained_model()
        apply_fsdp(model, init_device_mesh("cpu", (2,)), list(model.blocks))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, optimizer)
        hashed: list[str] = []
        real_sha256_file = storage.sha256_file

        def recorded_sha256_file(path: Path, *args, **kwargs) -> str:
            hashed.append(path.name)
            return real_sha256_file(path, *args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(storage, "sha256_file", recorded_sha256_file)
            writer = SyncWriter(Path(root), keep_last=5, keep_every=0, on_commit=lambda record: None)
            writer.open(background=False)
            staging, final = storage.staging_paths(root, 1)
            record = SaveRecord(step=1, mode="sync", blocked_s=0.0)
            pending = PendingSave(
                record=record,
                staging=staging,
                final=final,
                meta={},
                rank_state=storage.rank_state({"position": 1}),
                started_at=time.perf_counter(),
            )
            model_state, optim_state = get_state_dict(model, optimizer)
            writer.save({"model": model_state, "optim": optim_state}, pending)
            writer.close()
            in_sync = list(hashed)
            hashed.clear()
            _save(root, 2, model, optimizer)
        result = {"sync": in_sync, "save_checkpoint": hashed, "model_sha256": model_sha256(model)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_each_rank_hashes_only_its_own_shards_and_the_manifest_is_unchanged(tmp_path):
    import torch.multiprocessing as mp

    root = tmp_path / "checkpoints"
    mp.start_processes(
        _two_rank_saves,
        args=(str(tmp_path / "store"), str(root), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    # A sync save hashes each shard as it is written: no rank reads a shard back.
    assert [name for name in rank0["sync"] + rank1["sync"] if name.endswith(".distcp")] == []
    assert rank1["save_checkpoint"] == ["__1_0.distcp"]  # its own shard, nothing else
    assert rank0["save_checkpoint"].count("__0_0.distcp") == 1  # its sidecar, not hashed again
    assert not [name for name in rank0["save_checkpoint"] if name.startswith("__1_")]  # not rank 1's shard
    for step in (1, 2):
        folder = root / f"step_{step}"
        assert not list(folder.glob("*.sha256"))
        # The manifest is the one hashing every file on rank 0 would have written.
        assert json.loads((folder / "manifest.json").read_text()) == storage._build_manifest(folder)
        verify_checkpoint(folder, verify_hashes=True)
    assert latest_committed_checkpoint(root, verify_hashes=True) == root / "step_2"
    fresh, fresh_optimizer = _trained_model(seed=1)
    load_checkpoint(root / "step_1", fresh, fresh_optimizer)  # two ranks' save into one process
    assert state_dict_sha256(fresh.state_dict()) == rank0["model_sha256"] == rank1["model_sha256"]


def test_a_shard_writer_hashes_what_it_writes_and_leaves_the_sidecar_only_on_a_clean_close(
    tmp_path, monkeypatch
):
    shard = tmp_path / "__0_0.distcp"
    with storage.ShardWriter(shard) as stream:
        assert stream.write(b"abc") == 3
        stream.write(memoryview(b"defgh"))
        assert stream.tell() == 8
    assert shard.read_bytes() == b"abcdefgh"
    assert (tmp_path / "__0_0.distcp.sha256").read_text() == storage.sha256_file(shard)
    read_back = []
    monkeypatch.setattr(storage, "sha256_file", lambda path, *a: read_back.append(path) or "x")
    storage.write_hash_sidecars(tmp_path, rank=0)
    assert read_back == []  # its sidecar stands: the shard is not read again

    torn = tmp_path / "__0_1.distcp"
    with pytest.raises(OSError), storage.ShardWriter(torn) as stream:
        stream.write(b"half")
        raise OSError("disk full")
    assert torn.read_bytes() == b"half" and not (tmp_path / "__0_1.distcp.sha256").exists()
    storage.write_hash_sidecars(tmp_path, rank=0)
    assert read_back == [torn]  # no sidecar: the file itself is hashed
    with pytest.raises(ValueError, match="mode 'wb'"):
        storage.ShardWriter(tmp_path / "x", "ab")


def test_shard_records_skip_the_zip_crc32_that_torch_load_never_checks(tmp_path):
    import zipfile

    tensor = torch.arange(4096, dtype=torch.float32)
    before = torch.serialization.get_crc32_options()
    with storage.shard_records_without_crc32():
        torch.save(tensor, tmp_path / "no_crc.pt")
    assert torch.serialization.get_crc32_options() == before
    torch.save(tensor, tmp_path / "crc.pt")
    crcs = {
        name: {i.filename.rsplit("/", 1)[-1]: i.CRC for i in zipfile.ZipFile(tmp_path / name).infolist()}
        for name in ("no_crc.pt", "crc.pt")
    }
    assert crcs["no_crc.pt"]["0"] == 0 != crcs["crc.pt"]["0"]  # the tensor's record
    assert torch.equal(torch.load(tmp_path / "no_crc.pt"), tensor)
