"""The checkpoint manager and its writers: when saves happen, what they hold, and how they fail."""

import json
import multiprocessing

import pytest
import torch

from tests.unit.checkpoint_helpers import (
    _manager,
    _step,
    _trained_model,
)
from tests.weights import state_dict_sha256
from trainer.checkpointing import storage
from trainer.checkpointing.storage import (
    CheckpointError,
)
from trainer.models.byte_lm import next_token_loss

pytestmark = pytest.mark.usefixtures("single_rank_group")


def test_every_checkpoint_mode_has_one_writer_class():
    from trainer.checkpointing import WRITERS
    from trainer.checkpointing.manager import writer_class
    from trainer.config import CHECKPOINT_MODES, ConfigError

    assert tuple(WRITERS) == CHECKPOINT_MODES
    assert [writer_class(mode).mode for mode in WRITERS] == list(CHECKPOINT_MODES)
    # checkpoint.writer plugs in a class by its path: a CheckpointWriter, or refused.
    assert writer_class("benchmarks.torch_async:TorchAsyncWriter").mode == "torch-async"
    with pytest.raises(ConfigError, match="not a CheckpointWriter"):
        writer_class("json:dumps")
    with pytest.raises(
        ConfigError, match=r"cannot be loaded on this rank: No module named 'benchmarks\.nosuch'"
    ):
        writer_class("benchmarks.nosuch:Writer")  # an error no restart retries


def test_importing_checkpointing_does_not_import_nvrx():
    import subprocess
    import sys

    code = "import sys, trainer.checkpointing; assert 'nvidia_resiliency_ext' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


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
    assert summary["checkpoint_mode"] == mode  # torch-async: the plug-in writer's name
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
    from trainer.checkpointing import load_model_weights

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


@pytest.mark.parametrize("mode", ["sync", "torch-async"])
def test_the_configured_retention_keeps_the_last_k_and_every_mth_of_a_runs_saves(tmp_path, mode):
    """checkpoint.keep_last / keep_every_steps reach the writer, which applies them after each
    commit (the rule itself: test_checkpoint_storage's retention tests)."""
    model, optimizer = _trained_model()
    retention = ["checkpoint.every_steps=2", "checkpoint.keep_last=2", "checkpoint.keep_every_steps=4"]
    manager = _manager(tmp_path, mode, model, optimizer, extra=retention)
    assert manager.load() == 0
    for step in range(1, 13):
        manager.maybe_wait_for_staging()
        manager.save(step, last_step=step == 12, loss=1.0)
    manager.close()
    root = tmp_path / "checkpoints"
    assert [step for step, _ in storage.committed_steps(root)] == [12, 10, 8, 4]
    assert not list(root.glob("*.tmp"))


def test_manager_in_off_mode_never_saves(tmp_path):
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer, extra=["checkpoint.local_every_steps=0"])
    manager.load()
    assert manager.save(3, last_step=True, loss=1.0) is None
    manager.close()
    assert not (tmp_path / "checkpoints").exists()
    assert manager.summary(loop_wall_s=1.0)["efficiency_pct"] == 100.0


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


def test_a_periodic_save_is_skipped_while_a_restarted_writer_starts_but_a_final_one_waits(
    tmp_path, monkeypatch
):
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "sync", model, optimizer)
    manager.load(background=True)
    manager.writer.warming_up = True  # as a writer opened in the background says until it is ready
    assert manager.save(3, last_step=False, loss=1.0) is not None  # no durable checkpoint yet: never skipped
    assert manager.save(6, last_step=False, loss=1.0) is None  # skipped: the writer is starting
    assert manager.save(9, last_step=False, loss=1.0) is not None  # never two in a row
    assert manager.save(10, last_step=True, loss=1.0) is not None  # a final save always waits
    manager.close()
    assert manager.deferred_saves == [6]
    assert sorted(c.name for c in (tmp_path / "checkpoints").iterdir()) == ["step_10", "step_3", "step_9"]
    logged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if e["kind"] == "checkpoint_deferred"] == [6]


def test_an_async_save_whose_writer_process_died_fails_instead_of_waiting_forever(tmp_path):
    """The finisher waits for the writer process to report the write; a dead writer is an
    error the loop sees at the next finalize (NVRx's own check would have waited forever)."""
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "async", model, optimizer, extra=["checkpoint.local_every_steps=0"])
    manager.load()
    try:
        (worker,) = [p for p in multiprocessing.active_children() if p.name == "rtp-ckpt-writer"]
        worker.kill()
        worker.join(timeout=30)
        for step in (1, 2, 3):  # the save is at step 3
            _step(model, optimizer)
            manager.maybe_wait_for_staging()
            manager.save(step, last_step=False, loss=1.0)
        manager.maybe_wait_for_staging()  # hands the save to its finisher
        with pytest.raises(CheckpointError, match="writer process died"):
            manager.writer.wait("committed")
        assert not list((tmp_path / "checkpoints").glob("step_*[0-9]"))  # nothing committed
    finally:
        manager.abandon()


def test_a_checkpoint_of_another_architecture_is_refused_before_a_tensor_is_read(tmp_path):
    from trainer.config import ModelConfig
    from trainer.models import model_spec

    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "sync", model, optimizer, extra=["checkpoint.local_every_steps=0"])
    manager.load()
    manager.save(1, last_step=True, loss=1.0)
    manager.close()
    wider = model_spec("byte-lm").build(
        ModelConfig(d_model=48, n_layers=1, n_heads=2, seq_len=16), torch.device("cpu")
    )
    other = _manager(tmp_path, "sync", wider, torch.optim.AdamW(wider.parameters()))
    with pytest.raises(storage.CheckpointError) as refused:
        other.load()
    assert str(refused.value) == (
        f"{tmp_path / 'checkpoints' / 'step_1'} cannot be used by this run: it holds another model "
        "architecture than this run's model config; use a new checkpoint dir to train this model"
    )


def test_a_restarted_async_writer_defers_a_periodic_save_until_every_ranks_warm_up_is_written(tmp_path):
    """After a restart the writer warms up in the background: a periodic save is deferred
    while any rank's warm-up write is not done (the ranks agree at the save), and taken once
    it is."""
    from concurrent.futures import Future

    extra = ["checkpoint.local_every_steps=0", "checkpoint.every_steps=2"]
    model, optimizer = _trained_model()
    first = _manager(tmp_path, "async", model, optimizer, extra=extra)
    first.load()
    first.save(2, last_step=True, loss=1.0)
    first.close()
    restarted = _manager(tmp_path, "async", model, optimizer, extra=extra)
    assert restarted.load(background=True) == 2
    try:
        writer = restarted.writer
        started = writer._warm_up
        writer._warm_up = not_yet = Future()  # as a rank whose worker is still starting
        for step in (3, 4):
            _step(model, optimizer)
            restarted.maybe_wait_for_staging()
            restarted.save(step, last_step=False, loss=1.0)
        assert restarted.deferred_saves == [4] and writer.warming_up
        not_yet.set_result(started.result(timeout=60))  # the real warm-up write, then "done"
        for step in (5, 6):
            _step(model, optimizer)
            restarted.maybe_wait_for_staging()
            restarted.save(step, last_step=False, loss=1.0)
        restarted.maybe_wait_for_staging()
        restarted.close()
    except BaseException:
        restarted.abandon()
        raise
    assert restarted.deferred_saves == [4] and not writer.warming_up
    assert not (tmp_path / "checkpoints" / ".warm-up").exists()
    assert sorted(c.name for c in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_6"]
    again = _manager(tmp_path, "async", model, optimizer, extra=extra)
    assert again.load(background=True) == 6
    try:
        again.writer._warm_up.result(timeout=60)  # every rank's warm-up is written by the save
        for step in (7, 8):
            _step(model, optimizer)
            again.maybe_wait_for_staging()
            again.save(step, last_step=False, loss=1.0)
        assert again.deferred_saves == [] and not again.writer.warming_up
        again.maybe_wait_for_staging()
        again.close()
    except BaseException:
        again.abandon()
        raise
    assert (tmp_path / "checkpoints" / "step_8").is_dir()
