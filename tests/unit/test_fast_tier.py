"""The fast checkpoint tier: captures in memory and node-local files, and resuming from them."""

import logging
import shutil

import pytest
import torch

from tests.unit.checkpoint_helpers import (
    _heads,
    _manager,
    _resumed_at,
    _RunsCodeWhenUnpickled,
    _step,
    _train_and_capture,
    _trained_model,
    hold_slot_preparation,
)

pytestmark = pytest.mark.usefixtures("single_rank_group")


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

    from trainer.checkpointing.local_tier import forget_run

    release = hold_slot_preparation(monkeypatch)
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
        manager.local.wait_prepared(timeout=30)
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
        resumed.local.wait_prepared(timeout=30)
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


def write_snapshot_file(path, snapshot):
    """A snapshot as one fast-tier file (header, then tensor bytes), as a slot and its header read joined."""
    from trainer.checkpointing.tier_format import (
        TENSOR_KEY,
        aligned,
        checksums,
        header_bytes,
        layout_of,
        static_section,
    )

    tensors = []

    def strip(value):
        if torch.is_tensor(value):
            tensors.append(value.detach().contiguous())
            return {TENSOR_KEY: len(tensors) - 1}
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value

    skeleton = strip(snapshot)
    layout = layout_of(tensors)
    size = aligned(layout[-1][2] + layout[-1][3]) if layout else 0
    body = bytearray(size)
    for tensor, (_, _, place, nbytes) in zip(tensors, layout, strict=True):
        if nbytes:
            body[place : place + nbytes] = tensor.reshape(-1).view(torch.uint8).numpy().data
    header = header_bytes(static_section(skeleton, layout, size), {"checksums": checksums(body)})
    with path.open("wb", buffering=0) as handle:
        handle.write(header)
        handle.write(body)


def test_a_fast_tier_file_holds_its_snapshot_exactly_and_a_torn_flipped_or_foreign_one_is_refused(
    tmp_path, monkeypatch
):
    from trainer.checkpointing.tier_format import load_bytes, read_bytes

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
    # One flipped low mantissa bit of a weight: still finite, the same length; the checksum
    # taken at capture names it.
    flipped = bytearray(payload)
    flipped[payload.rindex(snapshot["params"][0].numpy().tobytes()[:8])] ^= 1  # its first byte
    corrupted, problem = load_bytes(flipped, "flipped")
    assert corrupted is None and "do not match the checksums" in problem, problem
    foreign, problem = load_bytes(b"not a snapshot at all", "foreign")
    assert foreign is None and "not a fast-tier file" in problem
    # The header is read with weights_only: a file that would run code when loaded is refused.
    marker = tmp_path / "pwned"
    monkeypatch.setenv("RTP_TEST_PWNED", str(marker))
    evil = tmp_path / "evil.pt"
    write_snapshot_file(evil, {"x": _RunsCodeWhenUnpickled()})
    refused, problem = load_bytes(read_bytes(evil), "evil")
    assert refused is None and problem and not marker.exists()


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


def _resident_bytes(address: int) -> int:
    """Rss of this process's mapping that starts at `address`, from /proc/self/smaps."""
    from pathlib import Path

    lines = Path("/proc/self/smaps").read_text().splitlines()
    for index, line in enumerate(lines):
        start, dash, _ = line.partition(" ")[0].partition("-")
        if dash and int(start, 16) == address:
            for field in lines[index + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_a_new_slot_is_faulted_in_when_made_and_a_remapped_one_keeps_its_capture(tmp_path):
    from trainer.checkpointing import tier_format as fmt
    from trainer.checkpointing.tier_slots import Slot

    values = torch.randn(1 << 20)
    layout = fmt.layout_of([values])
    size = fmt.aligned(layout[-1][2] + layout[-1][3])
    slot = Slot(tmp_path / "rank_0_slot_0.data", layout, size)
    # Every page is in before the first capture's copy, which the loop would wait for.
    assert _resident_bytes(slot.address()) >= size
    slot.tensors[0].copy_(values)
    again = Slot(tmp_path / "rank_0_slot_0.data", layout, size)
    assert torch.equal(again.tensors[0], values)  # faulting in never changes what a slot holds
