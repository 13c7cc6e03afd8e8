import torch

from trainer.nvrx_compat import SnapshotBuffers


def test_snapshot_copies_tensors_into_reused_shared_buffers_and_keeps_fresh_scalars():
    weights = torch.arange(6.0).reshape(2, 3)
    state = {"model": {"w": weights}, "optim": {"param_groups": [{"lr": 0.1}]}}
    buffers = SnapshotBuffers()

    first = buffers.snapshot(state)
    assert torch.equal(first["model"]["w"], weights)
    assert first["model"]["w"].is_shared()
    weights.add_(100)  # training goes on: the snapshot must not change
    assert first["model"]["w"][0, 0] == 0

    state["optim"]["param_groups"][0]["lr"] = 0.05
    second = buffers.snapshot(state)
    assert second["model"]["w"] is first["model"]["w"]  # same shared buffer, new contents
    assert torch.equal(second["model"]["w"], weights)
    assert second["optim"]["param_groups"][0]["lr"] == 0.05  # not the value of the first save


def test_snapshot_rebuilds_buffers_when_the_layout_changes():
    buffers = SnapshotBuffers()
    first = buffers.snapshot({"w": torch.zeros(2)})
    second = buffers.snapshot({"w": torch.zeros(3)})
    assert second["w"].shape == (3,) and second["w"] is not first["w"]
