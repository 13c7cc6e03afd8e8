import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from trainer.checkpointing import state_dict_sha256, storage
from trainer.checkpointing.storage import (
    COMMIT_MARKER,
    CheckpointError,
    apply_retention,
    latest_committed_checkpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
    verify_checkpoint,
)
from trainer.config import ModelConfig
from trainer.models import model_spec
from trainer.models.byte_lm import next_token_loss

pytestmark = pytest.mark.usefixtures("single_rank_group")


def _trained_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = model_spec("byte-lm").build(
        ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=16), torch.device("cpu")
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    next_token_loss(model, torch.randint(0, 256, (2, 17))).backward()
    optimizer.step()
    return model, optimizer


def _save(root, step, model, optimizer):
    return save_checkpoint(root, step, model, optimizer, meta={"note": "test"}, rank_extra={"position": step})


def test_commit_leaves_only_the_final_folder_with_marker_and_manifest(tmp_path):
    model, optimizer = _trained_model()
    result = _save(tmp_path, 3, model, optimizer)
    assert result.path == tmp_path / "step_3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]
    for name in (COMMIT_MARKER, ".metadata", "manifest.json", "meta.json", "rank_state/rank_0.pt"):
        assert (result.path / name).is_file(), name
    verify_checkpoint(result.path, verify_hashes=True)
    assert storage.read_meta(result.path)["step"] == 3


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
        storage.prepare_staging(tmp_path, 3, {})  # a re-save of step 3 replaces it
    monkeypatch.undo()
    for _, folder in storage.committed_steps(tmp_path):
        verify_checkpoint(folder, verify_hashes=True)
    apply_retention(tmp_path, keep_last=1)  # and the next retention clears what was cut short
    assert not list(tmp_path.glob("*.deleting"))


def test_manifest_takes_shard_hashes_from_sidecars_and_drops_them(tmp_path):
    model, optimizer = _trained_model()
    staging, final = storage.prepare_staging(tmp_path, 1, {})
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


def test_every_checkpoint_mode_has_one_writer_class():
    from trainer.checkpointing import WRITERS
    from trainer.config import CHECKPOINT_MODES

    assert tuple(WRITERS) == CHECKPOINT_MODES
    assert {cls.mode for cls in WRITERS.values()} == set(CHECKPOINT_MODES)


def test_importing_checkpointing_does_not_import_nvrx():
    import subprocess
    import sys

    code = "import sys, trainer.checkpointing; assert 'nvidia_resiliency_ext' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _manager(tmp_path, mode, model, optimizer, events=None, hooks=None, extra=(), states=None):
    from trainer.checkpointing import CheckpointManager
    from trainer.config import build_config
    from trainer.data import StepSampler
    from trainer.events import EventLog
    from trainer.hooks import TrainHooks

    config = build_config(
        "tiny-cpu",
        [f"run.workdir={tmp_path}", f"checkpoint.mode={mode}", "checkpoint.every_steps=3", *extra],
    )
    config.model = model.cfg  # the checkpoint's model hash must match the model saved
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    sampler = StepSampler(torch.zeros(64, dtype=torch.uint8), 16, 2, 0, 0)
    return CheckpointManager(
        config,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        hooks=hooks or TrainHooks(),
        events=events or EventLog(tmp_path, enabled=True),
        states=states,
    )


@pytest.mark.parametrize("mode", ["sync", "torch-async"])
def test_manager_saves_at_every_nth_and_final_step_and_resumes_from_the_latest(tmp_path, mode):
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, mode, model, optimizer)
    assert manager.load() == 0
    saved = []
    for step in range(1, 6):
        manager.maybe_wait_for_staging()
        if manager.save(step, last_step=step == 5, loss=1.0) is not None:
            saved.append(step)
    manager.close()
    assert saved == [3, 5]
    summary = manager.summary(loop_wall_s=10.0)
    assert [save["step"] for save in summary["checkpoint_saves"]] == [3, 5]
    assert summary["checkpoint"] == str(tmp_path / "checkpoints" / "step_5")
    assert storage.read_meta(tmp_path / "checkpoints" / "step_5")["loss"] == 1.0

    other_model, other_optimizer = _trained_model(seed=1)
    resumed = _manager(tmp_path, mode, other_model, other_optimizer)
    assert resumed.load() == 5
    assert torch.equal(other_model.blocks[0].qkv.weight, model.blocks[0].qkv.weight)
    assert resumed.summary(loop_wall_s=1.0)["resumed_from"] == str(tmp_path / "checkpoints" / "step_5")
    resumed.close()


def test_the_default_async_writer_saves_each_steps_weights_while_training_moves_on_and_resumes(tmp_path):
    """`async` (the default) behind the manager's four calls, in one process: step 3's save is
    written in the background while steps 4 and 5 change the weights, yet holds step 3's; the
    last save holds step 5's; a new manager resumes from it, optimizer state included."""
    from trainer.checkpointing import load_model_weights, state_dict_sha256

    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "async", model, optimizer, extra=["checkpoint.local_every_steps=0"])
    assert manager.load() == 0
    at_step = {}
    try:
        for step in range(1, 6):  # in the loop's order
            next_token_loss(model, torch.randint(0, 256, (2, 17))).backward()
            manager.maybe_wait_for_staging()  # the previous save's copy is done: weights may change
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            manager.save(step, last_step=step == 5, loss=float(step))
            at_step[step] = state_dict_sha256(model.state_dict())
        manager.close()
    except BaseException:
        manager.abandon()
        raise
    summary = manager.summary(loop_wall_s=10.0)
    assert [(save["step"], save["mode"]) for save in summary["checkpoint_saves"]] == [
        (3, "async"),
        (5, "async"),
    ]
    assert at_step[3] != at_step[5]
    for step in (3, 5):
        folder = tmp_path / "checkpoints" / f"step_{step}"
        storage.verify_checkpoint(folder, verify_hashes=True)
        assert storage.read_meta(folder)["loss"] == float(step)
        written, _ = _trained_model(seed=2)
        load_model_weights(folder, written)
        assert state_dict_sha256(written.state_dict()) == at_step[step], f"step {step} holds other weights"

    other_model, other_optimizer = _trained_model(seed=1)
    # Loading is the same in every mode; a sync manager starts no writer process.
    resumed = _manager(
        tmp_path, "sync", other_model, other_optimizer, extra=["checkpoint.local_every_steps=0"]
    )
    try:
        assert resumed.load() == 5
        assert state_dict_sha256(other_model.state_dict()) == at_step[5]
        assert torch.equal(
            other_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
        )
    finally:
        resumed.close()


def test_manager_in_off_mode_never_saves(tmp_path):
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer, extra=["checkpoint.local_every_steps=0"])
    manager.load()
    assert manager.save(3, last_step=True, loss=1.0) is None
    manager.close()
    assert not (tmp_path / "checkpoints").exists()
    assert manager.summary(loop_wall_s=1.0)["efficiency_pct"] == 100.0


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (Path.touch, (Path(os.environ["RTP_TEST_PWNED"]),))


def test_a_rank_state_file_that_would_run_code_is_refused(tmp_path, monkeypatch):
    """The shared volume is writable by any pod: loading a checkpoint never unpickles objects."""
    model, optimizer = _trained_model()
    saved = _save(tmp_path, 1, model, optimizer)
    marker = tmp_path / "pwned"
    monkeypatch.setenv("RTP_TEST_PWNED", str(marker))
    torch.save(
        {"torch_rng": torch.get_rng_state(), "x": _RunsCodeWhenUnpickled()},
        saved.path / "rank_state/rank_0.pt",
    )
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(saved.path, *_trained_model(seed=1))
    assert not marker.exists()


def test_the_launchers_learned_timeouts_are_stored_in_checkpoints_and_restored(tmp_path):
    learned = {"current_timeouts": {"heartbeat": {"initial": 120.0, "subsequent": 17.5}}}

    class Launcher:
        restored: dict | None = None

        def state_dict(self):
            return learned

        def load_state_dict(self, state):
            Launcher.restored = state

    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "sync", model, optimizer, states={"launcher": Launcher()})
    manager.load()
    manager.maybe_wait_for_staging()
    manager.save(3, last_step=True, loss=1.0)
    manager.close()
    assert storage.read_meta(tmp_path / "checkpoints" / "step_3")["launcher"] == learned
    _manager(tmp_path, "sync", *_trained_model(seed=1), states={"launcher": Launcher()}).load()
    assert Launcher.restored == learned


def test_learned_heartbeat_timeouts_never_go_below_the_floor(monkeypatch):
    from trainer import resilience

    class RankMonitor:  # what RankMonitorClient offers the client (NVRx 0.4.1)
        CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"
        is_initialized = True

        def __init__(self):
            self.state = {}
            self.beats = 0

        def send_heartbeat(self):
            self.beats += 1

        def calculate_and_set_hb_timeouts(self, skip_if_not_ready=True):
            # a fast machine: 8 quick steps teach a 2 s timeout
            self.state = {"current_timeouts": {"heartbeat": {"initial": 3.0, "subsequent": 2.0}}}

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            self.state = state

    client = resilience._LauncherClient(floor_s=15.0)
    client.client = RankMonitor()
    for _ in range(8):
        client.heartbeat()
    assert client.state_dict()["current_timeouts"]["heartbeat"] == {"initial": 15.0, "subsequent": 15.0}
    client.load_state_dict({"current_timeouts": {"heartbeat": {"initial": 40.0, "subsequent": 30.0}}})
    assert client.state_dict()["current_timeouts"]["heartbeat"]["subsequent"] == 30.0


def test_a_checkpoint_is_verified_against_its_published_manifest_before_loading(tmp_path):
    from trainer.checkpointing.storage import manifest_sha256, verify_published

    model, optimizer = _trained_model()
    saved = _save(tmp_path, 1, model, optimizer).path
    published = manifest_sha256(saved)
    verify_published(saved, published)
    other = _save(tmp_path / "other", 1, *_trained_model(seed=5)).path
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


def _step(model, optimizer) -> None:
    next_token_loss(model, torch.randint(0, 256, (2, 17))).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _train_and_capture(manager, model, optimizer, steps) -> None:
    """Steps as the loop runs them, each offered to the fast tier; its last copy waited for."""
    for step in steps:
        _step(model, optimizer)
        manager.maybe_wait_for_staging()
        manager.save(step, last_step=False, loss=1.0)
    manager.local.wait_copy()


def _heads(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("*.head"))


def _resumed_at(tmp_path, step, expected, hooks=None):
    """A new attempt's manager (a fresh model, mode off) that resumed at `step` with the
    parameters `expected`; returns it with its model and optimizer. `hooks`: the process's
    (an in-process restart shares its fast-tier cache); None: a new process."""
    model, optimizer = _trained_model(seed=1)
    resumed = _manager(tmp_path, "off", model, optimizer, hooks=hooks)
    assert resumed.load() == step
    for saved, restored in zip(expected, model.parameters(), strict=True):
        assert torch.equal(saved, restored)
    return resumed, model, optimizer


def test_a_restarted_attempt_resumes_from_the_fast_tier_newer_than_the_durable_checkpoint(tmp_path):
    from trainer.checkpointing.local_tier import forget_run
    from trainer.hooks import TrainHooks

    process = TrainHooks()  # one process: its attempts share the fast tier's cache
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "sync", model, optimizer, hooks=process)
    manager.load()
    for step in range(1, 5):  # durable at 3, fast tier at every step
        _step(model, optimizer)
        manager.maybe_wait_for_staging()
        manager.save(step, last_step=False, loss=1.0)
    manager.local.close()  # the newest capture's header is written
    manager.abandon()  # a fault: no final save; the copy of step 4 lives on in this process
    try:
        other_model, other_optimizer = _trained_model(seed=1)
        aside = manager.local.folder.with_name(manager.local.folder.name + "-aside")
        manager.local.folder.rename(aside)  # the copy in memory is all there is
        resumed = _manager(tmp_path, "sync", other_model, other_optimizer, hooks=process)
        assert resumed.load() == 4
        assert resumed.summary(loop_wall_s=1.0)["resumed_from"] == "local:4"
        for mine, theirs in zip(model.parameters(), other_model.parameters(), strict=True):
            assert torch.equal(mine, theirs)
            for key, value in optimizer.state[mine].items():
                assert torch.equal(other_optimizer.state[theirs][key], value)
        assert other_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]

        # The same copies on disk (what a restarted worker group finds), after a model change:
        # another architecture's copy is never loaded; the durable checkpoint is refused too.
        shutil.rmtree(resumed.local.folder, ignore_errors=True)
        aside.rename(resumed.local.folder)
        # A new process (its own cache) finds the files.
        # Two slots, each with the header of the capture it holds: steps 3 and 4.
        heads = sorted(p.name for p in resumed.local.folder.glob("rank_0_step_*.head"))
        assert heads == ["rank_0_step_3_slot_0.head", "rank_0_step_4_slot_1.head"], heads
        assert len(list(resumed.local.folder.glob("rank_0_slot_*.data"))) == 2
        third_model, third_optimizer = _trained_model(seed=2)
        from_files = _manager(tmp_path, "sync", third_model, third_optimizer)
        assert from_files.load() == 4
        for mine, theirs in zip(model.parameters(), third_model.parameters(), strict=True):
            assert torch.equal(mine, theirs)
    finally:
        forget_run("", tmp_path / "checkpoints")


def test_a_periodic_save_is_skipped_while_a_restarted_writer_starts_but_a_final_one_waits(
    tmp_path, monkeypatch
):
    from trainer.checkpointing.torch_writers import SyncWriter

    starting = {"now": False}
    monkeypatch.setattr(SyncWriter, "warming_up", property(lambda self: starting["now"]))
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "sync", model, optimizer)
    manager.load(background=True)
    starting["now"] = True
    assert manager.save(3, last_step=False, loss=1.0) is not None  # no durable checkpoint yet: never skipped
    assert manager.save(6, last_step=False, loss=1.0) is None  # skipped: the writer is starting
    assert manager.save(9, last_step=False, loss=1.0) is not None  # never two in a row
    assert manager.save(10, last_step=True, loss=1.0) is not None  # a final save always waits
    manager.close()
    assert manager.deferred_saves == [6]
    assert sorted(c.name for c in (tmp_path / "checkpoints").iterdir()) == ["step_10", "step_3", "step_9"]
    logged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if e["kind"] == "checkpoint_deferred"] == [6]


def test_a_finished_rank_deletes_only_its_own_copies_even_when_the_folder_is_gone(tmp_path):
    """At the end of a run every rank deletes its fast-tier files at the same time and the
    last one out removes the folder: a rank that finds the folder gone must not fail (that
    turned a finished run into an in-process restart once)."""
    from trainer.checkpointing.local_tier import forget_run
    from trainer.checkpointing.replicas import replica_name

    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer)
    folder = manager.local.folder
    folder.mkdir(parents=True)
    try:
        others = [
            folder / "rank_1_step_3_slot_0.head",
            folder / "rank_1_slot_0.data",
            folder / replica_name(0, 3, 1),
        ]
        mine = [
            folder / "rank_0_step_3_slot_1.head",
            folder / "rank_0_slot_1.data",
            folder / replica_name(1, 3, 0),
        ]
        for path in [*others, *mine]:
            path.write_bytes(b"x")
        manager.local.close(discard=True)
        assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in others)
        forget_run("", tmp_path / "checkpoints")  # what the other rank's exit leaves: no folder
        manager.local.close(discard=True)
        assert not folder.exists()
    finally:
        forget_run("", tmp_path / "checkpoints")


def test_a_rank_killed_while_capturing_still_has_the_previous_capture(tmp_path, monkeypatch):
    """A capture copies into the older of two slot files: that slot's header is gone before
    the first byte is overwritten, so what a rank killed mid-copy leaves is the other slot's
    capture with its header; a slot file of another size than its header says is refused."""
    from trainer.checkpointing.local_tier import LocalTier, forget_run

    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer)
    folder = manager.local.folder
    try:
        _train_and_capture(manager, model, optimizer, (1, 2, 3))
        assert _heads(folder) == ["rank_0_step_2_slot_1.head", "rank_0_step_3_slot_0.head"]
        expected = [p.detach().clone() for p in model.parameters()]
        heads_while_copying: list[list[str]] = []

        def killed_mid_copy(self, target, sources, step_done):
            heads_while_copying.append(sorted(p.name for p in folder.glob("*.head")))
            target.tensors[0].fill_(7.0)  # half a copy
            raise RuntimeError("killed")

        monkeypatch.setattr(LocalTier, "_copy_into", killed_mid_copy)
        _step(model, optimizer)
        manager.maybe_wait_for_staging()
        manager.save(4, last_step=False, loss=1.0)
        with pytest.raises(RuntimeError, match="killed"):
            manager.local.wait_copy()
        assert heads_while_copying == [["rank_0_step_3_slot_0.head"]]
        manager.abandon()
        monkeypatch.undo()

        # A new manager has a new cache: a new process, only the files.
        _resumed_at(tmp_path, 3, expected)[0].abandon()

        with (folder / "rank_0_slot_0.data").open("ab") as handle:
            handle.write(b"\0" * 64)  # not what the header describes
        third = _manager(tmp_path, "off", *_trained_model(seed=2))
        assert third.load() == 0  # nothing usable, no durable checkpoint
        third.abandon()
    finally:
        forget_run("", tmp_path / "checkpoints")


def test_large_slots_are_made_ahead_without_the_loop_waiting_and_keep_an_earlier_capture(
    tmp_path, monkeypatch
):
    """Slots of PREPARE_AHEAD_BYTES or more are made by the copy thread while the loop goes
    on: captures are skipped (never waited for) until both exist. Made again by a new
    attempt, they keep the capture an earlier attempt left, header included, until the slot
    is overwritten."""
    import threading

    from trainer.checkpointing import local_tier
    from trainer.checkpointing.local_tier import LocalTier, forget_run

    monkeypatch.setattr(local_tier, "PREPARE_AHEAD_BYTES", 0)  # this tiny state counts as large
    release = threading.Event()
    prepared = LocalTier._prepare_slots

    def held(self, plan):
        assert release.wait(timeout=30)
        prepared(self, plan)

    monkeypatch.setattr(LocalTier, "_prepare_slots", held)
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer)
    folder = manager.local.folder
    try:
        _step(model, optimizer)
        manager.save(1, last_step=False, loss=1.0)  # starts the preparation, captures nothing
        _step(model, optimizer)
        assert manager.local.before_optimizer_step() == 0.0  # nothing to wait for
        manager.save(2, last_step=False, loss=1.0)  # still preparing: skipped too
        assert manager.local.captures == 0 and not list(folder.glob("*.head"))
        release.set()
        manager.local._preparing.result(timeout=30)
        _train_and_capture(manager, model, optimizer, (3, 4, 5))
        assert _heads(folder) == ["rank_0_step_4_slot_1.head", "rank_0_step_5_slot_0.head"]
        expected = [p.detach().clone() for p in model.parameters()]
        manager.abandon()

        # A new process (a new manager's cache) finds the files; its slots are prepared again while it trains on.
        release.clear()
        resumed, other_model, other_optimizer = _resumed_at(tmp_path, 5, expected)
        _step(other_model, other_optimizer)
        resumed.save(6, last_step=False, loss=1.0)  # preparing
        release.set()
        resumed.local._preparing.result(timeout=30)
        # Mapped again, nothing overwritten yet: both captures and their headers stand.
        assert _heads(folder) == ["rank_0_step_4_slot_1.head", "rank_0_step_5_slot_0.head"]
        _train_and_capture(resumed, other_model, other_optimizer, (7,))  # into the older slot (1)
        assert _heads(folder) == ["rank_0_step_5_slot_0.head", "rank_0_step_7_slot_1.head"]
        resumed.abandon()
    finally:
        forget_run("", tmp_path / "checkpoints")


def test_a_slot_file_that_does_not_fit_keeps_the_captures_in_memory_and_says_what_to_do(
    tmp_path, monkeypatch, caplog
):
    """A full /dev/shm: the slots live in process memory (an in-process restart still
    resumes from them), nothing half-made is left in the folder, and the warning names the
    size needed, the space free and the remedy, once."""
    import errno

    from trainer.checkpointing.local_tier import forget_run

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    from trainer.hooks import TrainHooks

    monkeypatch.setattr("trainer.checkpointing.local_tier.os.posix_fallocate", full)
    process = TrainHooks()
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer, hooks=process)
    try:
        with caplog.at_level(logging.WARNING, logger="trainer.checkpointing.local_tier"):
            _train_and_capture(manager, model, optimizer, (1, 2, 3))
        warnings = [r.getMessage() for r in caplog.records if "fast checkpoint tier" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "No space left on device" in warnings[0] and "free there" in warnings[0]
        assert "GiB for two slots" in warnings[0] and "sizeLimit" in warnings[0]
        assert "checkpoint.local_dir" in warnings[0]
        assert manager.local.captures == 3
        assert not list(manager.local.folder.glob("*.data")) and not list(manager.local.folder.glob("*.head"))
        expected = [p.detach().clone() for p in model.parameters()]
        manager.abandon()  # an in-process restart: the same process, a new attempt

        _resumed_at(tmp_path, 3, expected, hooks=process)[0].abandon()
    finally:
        forget_run("", tmp_path / "checkpoints")


def test_a_fast_tier_file_holds_its_snapshot_exactly_and_a_torn_or_foreign_one_is_refused(
    tmp_path, monkeypatch
):
    from trainer.checkpointing.tier_format import load_bytes, read_bytes, write_snapshot_file

    snapshot = {
        "step": 3,
        "identity": {"model": "m", "world": 2},
        "groups": [{"lr": 0.1, "betas": (0.9, 0.95), "weight_decay": 0.0}],
        "scheduler": {"last_epoch": 3, "lr_lambdas": [None]},
        "torch_rng": torch.get_rng_state(),
        "params": [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.zeros(0)],
        "optim": [{"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 5)}, {}, {"step": 2}],
    }
    path = tmp_path / "rank_0_step_3.pt"
    write_snapshot_file(path, snapshot)
    loaded, problem = load_bytes(read_bytes(path), str(path))
    assert problem is None and loaded is not None
    assert loaded["groups"][0]["betas"] == (0.9, 0.95) and loaded["scheduler"] == snapshot["scheduler"]
    for saved, back in zip(
        [
            snapshot["torch_rng"],
            *snapshot["params"],
            snapshot["optim"][0]["step"],
            snapshot["optim"][0]["exp_avg"],
        ],
        [loaded["torch_rng"], *loaded["params"], loaded["optim"][0]["step"], loaded["optim"][0]["exp_avg"]],
        strict=True,
    ):
        assert back.dtype == saved.dtype and back.shape == saved.shape and torch.equal(back, saved)
    assert loaded["optim"][1:] == [{}, {"step": 2}]

    payload = path.read_bytes()
    torn, problem = load_bytes(payload[:-1], "torn")
    assert torn is None and "torn" in problem
    foreign, problem = load_bytes(b"not a snapshot at all", "foreign")
    assert foreign is None and "not a fast-tier file" in problem
    # The header is read with weights_only: a file that would run code when loaded is refused.
    marker = tmp_path / "pwned"
    monkeypatch.setenv("RTP_TEST_PWNED", str(marker))
    evil = tmp_path / "evil.pt"
    write_snapshot_file(evil, {"x": _RunsCodeWhenUnpickled()})
    refused, problem = load_bytes(read_bytes(evil), "evil")
    assert refused is None and problem and not marker.exists()


def test_an_async_save_whose_writer_process_died_fails_instead_of_waiting_forever(tmp_path):
    """The finisher waits for the writer process to report the write; a dead writer is an
    error the loop sees at the next finalize (NVRx's own check would have waited forever)."""
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "async", model, optimizer, extra=["checkpoint.local_every_steps=0"])
    manager.load()
    try:
        worker = manager.writer._calls.persistent_caller.process
        worker.kill()
        worker.join(timeout=30)
        for step in (1, 2, 3):  # the save is at step 3
            _step(model, optimizer)
            manager.maybe_wait_for_staging()
            manager.save(step, last_step=False, loss=1.0)
        manager.maybe_wait_for_staging()  # hands the save to its finisher
        with pytest.raises(CheckpointError, match="writer process died"):
            manager.writer.finalize()
        assert not list((tmp_path / "checkpoints").glob("step_*[0-9]"))  # nothing committed
    finally:
        manager.abandon()


def test_a_capture_after_the_optimizer_state_was_replaced_copies_the_new_tensors(tmp_path):
    """The tier reuses its list of tensors while they are the same objects; state loaded
    into the optimizer (new tensor objects) must be what the next capture holds."""
    from trainer.checkpointing.local_tier import forget_run

    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer)
    try:
        for step in (1, 2):
            _step(model, optimizer)
            manager.maybe_wait_for_staging()
            manager.save(step, last_step=False, loss=1.0)
        manager.local.wait_copy()
        first = next(iter(optimizer.state.values()))
        first["exp_avg"] = torch.full_like(first["exp_avg"], 3.0)  # a new object, new values
        manager.save(3, last_step=False, loss=1.0)
        manager.local.wait_copy()
        manager.abandon()
        # A new manager, a new cache: from the files.
        other_model, other_optimizer = _trained_model(seed=1)
        resumed = _manager(tmp_path, "off", other_model, other_optimizer)
        assert resumed.load() == 3
        restored = next(iter(other_optimizer.state.values()))
        assert torch.equal(restored["exp_avg"], first["exp_avg"])
        resumed.abandon()
    finally:
        forget_run("", tmp_path / "checkpoints")


def _two_rank_saves(rank: int, store_path: str, root: str, out_dir: str) -> None:
    """One rank of a 2-rank gloo group: a `sync` save (step 1) and a `save_checkpoint`
    (step 2) of a sharded model; records the files each rank hashed in each save."""
    import time

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.checkpointing import model_sha256
    from trainer.checkpointing.torch_writers import SyncWriter
    from trainer.checkpointing.writer import PendingSave, SaveRecord
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
            writer.start(background=False)
            staging, final = storage.prepare_staging(root, 1, {"position": 1})
            now = time.perf_counter()
            record = SaveRecord(step=1, mode="sync", blocked_s=0.0)
            pending = PendingSave(
                record=record, staging=staging, final=final, meta={}, started_at=now, queued_at=now
            )
            model_state, optim_state = get_state_dict(model, optimizer)
            writer.start_save({"model": model_state, "optim": optim_state}, pending)
            writer.close()
            in_sync = list(hashed)
            hashed.clear()
            _save(root, 2, model, optimizer)
        result = {"sync": in_sync, "save_checkpoint": hashed, "model_sha256": model_sha256(model)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_sync_save_hashes_each_ranks_shards_on_that_rank_and_its_manifest_is_unchanged(tmp_path):
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
    for save in ("sync", "save_checkpoint"):
        assert rank1[save] == ["__1_0.distcp"], save  # its own shard, nothing else
        assert rank0[save].count("__0_0.distcp") == 1, save  # its sidecar, not hashed again
        assert not [name for name in rank0[save] if name.startswith("__1_")], save  # not rank 1's shard
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
