import threading
import time

import pytest
import torch

from trainer.checkpointing.snapshot import HostSnapshot


def test_snapshots_copy_into_reused_shared_buffers_and_keep_fresh_scalars():
    weights = torch.arange(6.0).reshape(2, 3)
    state = {"model": {"w": weights}, "optim": {"param_groups": [{"lr": 0.1}]}}
    snapshot = HostSnapshot()

    snapshot.start(state)
    first = snapshot.wait()
    assert torch.equal(first["model"]["w"], weights)
    assert first["model"]["w"].is_shared()
    weights.add_(100)  # training goes on: the snapshot must not change
    assert first["model"]["w"][0, 0] == 0

    state["optim"]["param_groups"][0]["lr"] = 0.05
    snapshot.start(state)
    second = snapshot.wait()
    assert second["model"]["w"] is first["model"]["w"]  # same shared buffer, new contents
    assert torch.equal(second["model"]["w"], weights)
    assert second["optim"]["param_groups"][0]["lr"] == 0.05  # not the value of the first save


def test_later_snapshots_copy_in_the_background_until_wait(monkeypatch):
    weights = torch.zeros(1000)
    snapshot = HostSnapshot()
    snapshot.start({"w": weights})
    snapshot.wait()
    weights.fill_(7.0)  # after the first snapshot: this copy goes into the existing buffers
    seen_threads = set()
    original_copy = torch._foreach_copy_

    def recording_copy(*args, **kwargs):
        seen_threads.add(threading.current_thread().name)
        return original_copy(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", recording_copy)
    snapshot.start({"w": weights})
    assert snapshot.in_flight
    taken = snapshot.wait()
    monkeypatch.undo()
    assert not snapshot.in_flight
    assert seen_threads == {"rtp-ckpt-snapshot"}  # not the training thread
    assert torch.equal(taken["w"], torch.full((1000,), 7.0))


def test_prepare_allocates_the_buffers_in_the_background_for_the_first_copy(monkeypatch):
    """`prepare()` makes the buffers off the training thread, before any save; the first
    copy then uses them; a new layout is still allocated by the copy itself."""
    import trainer.checkpointing.snapshot as snapshot_module

    made_in: list[str] = []
    original = snapshot_module._new_host_buffer

    def recording(value):
        made_in.append(threading.current_thread().name)
        return original(value)

    monkeypatch.setattr(snapshot_module, "_new_host_buffer", recording)
    weights, moments = torch.zeros(10), torch.ones(3, 4)
    snapshot = HostSnapshot()
    snapshot.prepare({"w": weights, "m": moments})
    deadline = time.monotonic() + 10
    while len(made_in) < 2 and time.monotonic() < deadline:  # no save has started
        time.sleep(0.01)
    assert made_in == ["rtp-ckpt-snapshot", "rtp-ckpt-snapshot"]
    snapshot.start({"w": weights, "m": moments})
    taken = snapshot.wait()
    assert len(made_in) == 2  # the first copy used them
    assert torch.equal(taken["m"], moments) and taken["w"].data_ptr() != weights.data_ptr()
    snapshot.start({"w": torch.zeros(11), "m": moments})  # another layout: allocated now
    snapshot.wait()
    assert len(made_in) == 4
    snapshot.close()


def test_a_second_start_before_wait_is_refused():
    snapshot = HostSnapshot()
    snapshot.start({"w": torch.zeros(4)})
    with pytest.raises(RuntimeError, match="wait"):
        snapshot.start({"w": torch.ones(4)})
    snapshot.discard()
    assert not snapshot.in_flight


def test_snapshot_compacts_views_and_rebuilds_buffers_when_the_layout_changes():
    snapshot = HostSnapshot()
    padded = torch.arange(10.0)
    snapshot.start({"w": padded[2:5]})  # like FSDP2's views into padded shards
    first = snapshot.wait()
    assert first["w"].untyped_storage().nbytes() == 3 * 4 and torch.equal(first["w"], padded[2:5])
    snapshot.start({"w": torch.zeros(3, 2)})
    rebuilt = snapshot.wait()
    assert rebuilt["w"].shape == (3, 2) and rebuilt["w"] is not first["w"]


def test_after_copy_runs_in_the_background_on_the_finished_copy_and_its_errors_surface():
    weights = torch.zeros(8)
    snapshot = HostSnapshot()
    snapshot.start({"w": weights})
    snapshot.wait()
    weights.fill_(3.0)

    def total_in(taken):
        return threading.current_thread().name, float(taken["w"].sum())

    snapshot.start({"w": weights}, after_copy=total_in)
    assert snapshot.wait() == ("rtp-ckpt-snapshot", 24.0)

    def fail(taken):
        raise OSError("disk gone")

    snapshot.start({"w": weights}, after_copy=fail)
    with pytest.raises(RuntimeError, match="snapshot failed") as raised:
        snapshot.wait()
    assert isinstance(raised.value.__cause__, OSError)
    assert not snapshot.in_flight
