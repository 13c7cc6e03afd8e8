"""The default async writer, one rank, through the manager's four calls: a save step copies
the state to host once (the fast tier's capture, lent to the save), the lent slot is not
overwritten until the save has written it, and what is written equals the state saved."""

from __future__ import annotations

import pytest
import torch

from tests.unit.checkpoint_helpers import _heads, _manager, _resumed_at, _step, _trained_model
from trainer.checkpointing import slot_refs, storage
from trainer.models.byte_lm import next_token_loss

pytestmark = pytest.mark.usefixtures("single_rank_group")


def _run_async(tmp_path, monkeypatch, local_every: int):
    """Six steps, saves at 3 and 6 (the last); returns (manager, params after step 3, refs sent)."""
    sent: list[int] = []
    by_reference = slot_refs.by_reference

    def counting(buckets, slot):
        rewritten = by_reference(buckets, slot)
        sent.append(sum(isinstance(v, slot_refs.SlotRef) for _, _, (_, data) in rewritten for _, v in data))
        return rewritten

    monkeypatch.setattr(slot_refs, "by_reference", counting)
    model, optimizer = _trained_model()
    manager = _manager(
        tmp_path, "async", model, optimizer, extra=[f"checkpoint.local_every_steps={local_every}"]
    )
    manager.load()
    at_3 = None
    try:
        for step in range(1, 7):  # as the loop runs a step
            next_token_loss(model, torch.randint(0, 256, (2, 17))).backward()
            manager.maybe_wait_for_staging()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            manager.save(step, last_step=step == 6, loss=1.0)
            if step == 3:
                at_3 = [p.detach().clone() for p in model.parameters()]
        manager.close()
    except BaseException:
        manager.abandon()
        raise
    return manager, at_3, sent


def _saved_params(tmp_path, step):
    model, optimizer = _trained_model(seed=5)
    storage.load_checkpoint(tmp_path / "checkpoints" / f"step_{step}", model, optimizer)
    return list(model.parameters())


def test_a_save_step_writes_from_the_fast_tiers_capture_without_a_copy_of_its_own(tmp_path, monkeypatch):
    # Interval 5: step 3 is no capture step, so the save's capture is taken for it.
    manager, at_3, sent = _run_async(tmp_path, monkeypatch, local_every=5)
    assert len(sent) == 1 and sent[0] > 0  # step 3's tensors went to the writer as slot references
    assert manager.writer.host_bytes == 0  # no snapshot buffers were made
    copies = manager.summary(1.0)["checkpoint_host_copies"]
    assert 2.0 <= copies < 2.1  # the two slots (and their RNG states), nothing else
    for expected, saved in zip(at_3, _saved_params(tmp_path, 3), strict=True):
        assert torch.equal(expected, saved)


def test_without_the_fast_tier_saves_are_captured_into_one_slot_that_publishes_nothing(tmp_path, monkeypatch):
    """Tier off: the same engine captures the save steps only, into one slot, with no header,
    no cache entry for a restart and no files left after the run."""
    from trainer.checkpointing.local_tier import LocalTier

    published: list[int] = []
    write_head = LocalTier._write_head
    monkeypatch.setattr(
        LocalTier, "_write_head", lambda self, slot, *a: published.append(slot) or write_head(self, slot, *a)
    )
    manager, at_3, sent = _run_async(tmp_path, monkeypatch, local_every=0)
    assert len(sent) == 1 and sent[0] > 0  # step 3 went to the writer as slot references
    assert manager.writer.host_bytes == 0 and published == []
    assert manager.summary(1.0)["checkpoint_host_copies"] == pytest.approx(1.0, abs=0.05)
    assert manager.local.captures == 1  # step 3 (the last save is written from the live state on a CPU)
    assert manager.local.cache.get(manager.local.key) is None
    assert not manager.local.folder.exists() or list(manager.local.folder.iterdir()) == []
    for expected, saved in zip(at_3, _saved_params(tmp_path, 3), strict=True):
        assert torch.equal(expected, saved)


def test_a_lent_slot_is_not_overwritten_until_released_and_stays_the_fallback(tmp_path, monkeypatch):
    """While a save holds its slot, every capture goes to the other one: a rank killed
    mid-copy there still has the lent capture, with its header, to resume from."""
    from trainer.checkpointing.local_tier import LocalTier, forget_run

    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer, extra=["checkpoint.local_every_steps=1"])
    tier = manager.local
    try:
        _step(model, optimizer)
        assert tier.capture(1, 0)
        _step(model, optimizer)
        lease = tier.capture_for_save(2, 0)
        assert lease is not None and lease.wait() is tier.slot(lease.slot)
        at_2 = [p.detach().clone() for p in model.parameters()]
        assert tier.capture_for_save(3, 0) is None  # one lent slot at a time
        for step in (3, 4):
            _step(model, optimizer)
            assert tier.capture(step, 0)
            tier.wait_copy()
        held = lease.slot
        assert _heads(tier.folder) == [
            f"rank_0_step_2_slot_{held}.head",
            f"rank_0_step_4_slot_{1 - held}.head",
        ]

        def killed_mid_copy(self, target, sources, step_done):
            target.tensors[0].fill_(7.0)
            raise RuntimeError("killed")

        monkeypatch.setattr(LocalTier, "_copy_into", killed_mid_copy)
        _step(model, optimizer)
        assert tier.capture(5, 0)
        with pytest.raises(RuntimeError, match="killed"):
            tier.wait_copy()
        monkeypatch.undo()
        assert _heads(tier.folder) == [f"rank_0_step_2_slot_{held}.head"]
        assert tier.cache.get(tier.key)["step"] == 2  # in memory too: the lent capture
        manager.abandon()
        _resumed_at(tmp_path, 2, at_2)[0].abandon()  # a new process: only the files

        lease.release()
    finally:
        forget_run("", tmp_path / "checkpoints")


def test_slot_references_resolve_to_the_slot_files_bytes_and_leave_other_tensors(tmp_path):
    from trainer.checkpointing import tier_format as fmt
    from trainer.checkpointing.tier_slots import Slot

    sources = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([1, 2], dtype=torch.int64)]
    layout = fmt.layout_of(sources)
    slot = Slot(tmp_path / "slot.data", layout, fmt.aligned(layout[-1][2] + layout[-1][3]))
    torch._foreach_copy_(slot.tensors, sources)
    outside = torch.ones(3)
    buckets = [
        ("f", "n", ([("bytes-item", b"x")], [("a", slot.tensors[0]), ("b", slot.tensors[1]), ("c", outside)]))
    ]
    sent = slot_refs.by_reference(buckets, slot)
    values = [v for _, v in sent[0][2][1]]
    assert [type(v) for v in values] == [slot_refs.SlotRef, slot_refs.SlotRef, torch.Tensor]
    assert values[2] is outside and sent[0][2][0] == [("bytes-item", b"x")]
    resolved = [v for _, v in slot_refs.resolve(sent)[0][2][1]]
    for source, value in zip([*sources, outside], resolved, strict=True):
        assert torch.equal(source, value) and source.dtype == value.dtype
    memory_only = Slot(None, layout, slot.size)
    assert slot_refs.by_reference(buckets, memory_only) is buckets  # nothing another process could map


def test_the_last_saves_shard_is_hashed_as_written_not_read_back(tmp_path, monkeypatch):
    # Step 6 (the last) is written in this process, through storage.ShardWriter.
    read_back: list[str] = []
    sha256_file = storage.sha256_file
    monkeypatch.setattr(
        storage, "sha256_file", lambda path, *a: read_back.append(path.name) or sha256_file(path, *a)
    )
    _run_async(tmp_path, monkeypatch, local_every=1)
    assert [name for name in read_back if name.endswith(".distcp")] == []
    for step in (3, 6):  # the worker's shards and this process's: the manifests hold their real hashes
        storage.verify_checkpoint(tmp_path / "checkpoints" / f"step_{step}", verify_hashes=True)


def test_the_writer_process_is_set_up_for_shards_once_at_its_first_save(monkeypatch):
    import gc

    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    from trainer.checkpointing import nvrx_compat

    monkeypatch.setattr(nvrx_compat, "_shard_writer_prepared", False)
    monkeypatch.delattr(filesystem_async, "open", raising=False)
    crc = torch.serialization.get_crc32_options()
    try:
        nvrx_compat.prepare_shard_writer_process()
        assert filesystem_async.open is storage.ShardWriter  # shards hashed as written
        assert torch.serialization.get_crc32_options() is False
        frozen = gc.get_freeze_count()
        assert frozen > 0
        # A later save: nothing again. Counted by calls: the frozen count itself drops when
        # another thread frees a frozen object (seen in a fresh-clone run: 2 fewer).
        freezes = []
        monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
        nvrx_compat.prepare_shard_writer_process()
        assert freezes == []
    finally:
        gc.unfreeze()
        torch.serialization.set_crc32_options(crc)
        monkeypatch.delattr(filesystem_async, "open", raising=False)


def test_a_saves_capture_is_taken_while_measuring_when_the_sender_reads_and_behind_a_slot_being_made(
    tmp_path, monkeypatch
):
    """A save is never left without its capture: not at an off-step of the budget's
    measuring, not while the replica sender reads the slot due (the newer slot goes), not
    while large slots are still being made (the capture queues behind them)."""
    import threading

    from tests.unit.checkpoint_helpers import hold_slot_preparation
    from trainer.checkpointing.local_tier import forget_run

    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer, extra=["checkpoint.local_every_steps=budget"])
    tier = manager.local
    try:
        _step(model, optimizer)
        assert tier.schedule.measuring and tier.capture(1, 0)  # the window's first step: captured
        _step(model, optimizer)
        assert not tier.capture(2, 0)  # an off-step of the measuring window
        _step(model, optimizer)
        assert tier.capture(3, 0)
        _step(model, optimizer)
        at_4 = tier.capture_for_save(4, 0)  # an off-step: taken all the same, and published
        assert at_4 is not None and at_4.wait().step == 4
        at_4.release()
        tier.wait_copy()

        due, reading = tier.next_slot, tier.sender.reading
        # The sender reads the slot the next capture would take.
        monkeypatch.setattr(tier.sender, "reading", lambda slot: slot == due or reading(slot))
        _step(model, optimizer)
        lease = tier.capture_for_save(5, 0)
        assert lease.slot == 1 - due == at_4.slot
        monkeypatch.setattr(tier.sender, "reading", reading)
        at_4.release()  # again: a no-op, not a release of step 5's hold on the same slot
        assert tier.capture_for_save(6, 0) is None  # one lent slot at a time
        lease.release()
        tier.wait_copy()
    finally:
        manager.abandon()
        forget_run("", tmp_path / "checkpoints")

    release = hold_slot_preparation(monkeypatch)
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "async", model, optimizer, extra=["checkpoint.local_every_steps=0"])
    try:
        _step(model, optimizer)
        manager.local.prepare_for_saves()  # the slot is made ahead, in the copy thread
        assert manager.local.slot(0) is None  # made ahead in the copy thread, not here
        threading.Timer(0.3, release.set).start()
        _step(model, optimizer)
        lease = manager.local.capture_for_save(2, 0)  # waits for the slot, not skipped
        assert lease.wait() is manager.local.slot(0) and manager.local.slot(1) is None
        lease.release()
    finally:
        release.set()
        manager.abandon()


def test_a_state_over_a_capture_copies_what_the_capture_lacks_and_planning_errors_reach_the_loop(
    tmp_path, monkeypatch
):
    from trainer.checkpointing import nvrx_writer

    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer, extra=["checkpoint.local_every_steps=0"])
    try:
        _step(model, optimizer)
        lease = manager.local.capture_for_save(1, 0)
        extra = torch.arange(4.0)
        state = {"model": dict(model.state_dict()), "extra": extra, "lr": 0.5}
        over = lease.state_over(state)
        weight = next(iter(model.state_dict()))
        assert torch.equal(over["model"][weight], model.state_dict()[weight])
        assert over["model"][weight].data_ptr() != model.state_dict()[weight].data_ptr()  # the slot's copy
        assert lease.serving is manager.local.slot(lease.slot)
        assert torch.equal(over["extra"], extra) and over["extra"].data_ptr() != extra.data_ptr()
        assert over["lr"] == 0.5
        lease.release()
    finally:
        manager.abandon()

    planner = nvrx_writer.Planner()
    assert planner.submit(lambda: threading_name()).result(timeout=10) == "rtp-ckpt-plan"
    failed = planner.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=10)
    planner.close()


def threading_name() -> str:
    import threading

    return threading.current_thread().name


def test_a_restarted_attempt_reads_its_own_write_results_after_a_manager_call_was_cut_in_half(tmp_path):
    """NVRx's in-process restart raises into the main thread again and again: one raise
    between a Manager call's request and its reply leaves the main thread's connection a
    reply behind, and a save the restart abandoned may have posted its results already.
    The next attempt's writer still warms up in the background and finalizes its own."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    from trainer import waiting
    from trainer.checkpointing import nvrx_compat
    from trainer.checkpointing.nvrx_writer import NvrxAsyncWriter

    nvrx_compat.new_calls_queue()  # the abandoned attempt's
    stale = filesystem_async._results_queue
    waiting.off_main_thread("killed-save", stale.put, RuntimeError("an abandoned save's results"))
    stale.qsize()  # the main thread's connection to the Manager
    stale._tls.connection.send((stale._id, "qsize", (), {}))  # its reply is never read
    writer = NvrxAsyncWriter(tmp_path, 1, 0, lambda record: None)
    try:
        writer.open(background=True)
        writer.wait("committed")  # the warm-up's
        assert not (tmp_path / ".warm-up").exists()  # finalized, then removed
    finally:
        writer.close()
        stale._tls.connection.recv()  # in step again, for the tests after this one


def test_a_save_abandoned_while_it_is_planned_never_plans_on_the_training_group(tmp_path, monkeypatch):
    """An in-process restart abandons the writer while its planner thread may still be planning
    the previous step's save. What the planner runs after that must stay on the writer's own
    group: a collective on the training group (what a plan on no group is) meets the peers'
    next-step FSDP all-gathers, and gloo aborts the rank ("op.preamble.length <= op.nbytes",
    seen under load in `rtp bench finetune`'s exception run)."""
    import threading
    import time

    from trainer.checkpointing import nvrx_writer

    staging, release, groups = threading.Event(), threading.Event(), []
    prepare_staging, plan = storage.prepare_staging, nvrx_writer.save_state_dict_async_plan

    def slow_prepare(root, step, state, group=None):
        staging.set()
        release.wait(30)  # the restart abandons the writer meanwhile
        return prepare_staging(root, step, state, group=group)

    def recording_plan(*args, process_group=None, **kwargs):
        groups.append(process_group)
        return plan(*args, process_group=process_group, **kwargs)

    monkeypatch.setattr(storage, "prepare_staging", slow_prepare)
    monkeypatch.setattr(nvrx_writer, "save_state_dict_async_plan", recording_plan)
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "async", model, optimizer, extra=["checkpoint.local_every_steps=0"])
    manager.load()
    try:
        for step in (1, 2, 3):  # the save is at step 3
            _step(model, optimizer)
            manager.save(step, last_step=False, loss=1.0)
        assert staging.wait(30)
    finally:
        manager.abandon()
        release.set()
    deadline = time.monotonic() + 30
    while not groups and time.monotonic() < deadline:
        time.sleep(0.01)
    for thread in threading.enumerate():
        if thread.name == "rtp-ckpt-plan":
            thread.join(30)  # abandoned: it ends after this job
    assert groups and all(group is not None for group in groups)


@pytest.mark.parametrize("background", [False, True])
def test_the_warm_up_save_is_planned_and_finalized_on_the_writers_group(tmp_path, monkeypatch, background):
    """The warm-up's finalize gathers the ranks' results; on no group it would gather on the
    training group (what `group=None` resolves to when it runs), which after an in-process
    restart is the next attempt's, where the peers run the loop's collectives."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import state_dict_saver

    groups = []
    plan = state_dict_saver.save_state_dict_async_plan

    def recording_plan(*args, process_group=None, **kwargs):
        groups.append(process_group)
        return plan(*args, process_group=process_group, **kwargs)

    monkeypatch.setattr(state_dict_saver, "save_state_dict_async_plan", recording_plan)
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "async", model, optimizer, extra=["checkpoint.local_every_steps=0"])
    manager.load(background=background)
    try:
        for step in (1, 2, 3):  # the save at step 3 finalizes the warm-up first
            _step(model, optimizer)
            manager.save(step, last_step=step == 3, loss=1.0)
        manager.close()
    except BaseException:
        manager.abandon()
        raise
    assert (tmp_path / "checkpoints" / "step_3").is_dir() and not manager.writer.warming_up
    assert groups and all(group is not None for group in groups)
