"""The fast tier's restore rule as a pure function of the ranks' reports (no process group)."""

import pytest
import torch

from trainer.checkpointing.tier_restore import replica_holders, restorable_steps, twin_holders, twins_of
from trainer.checkpointing.tier_slots import forget_rank, non_finite


def report(own=(), held=None) -> dict:
    return {"own": list(own), "held": {owner: list(steps) for owner, steps in (held or {}).items()}}


def test_only_steps_every_rank_holds_and_newer_than_the_durable_checkpoint_are_restorable():
    gathered = [report(own=[4, 5, 6]), report(own=[4, 5])]  # rank 1 died before capturing 6
    assert restorable_steps(gathered, durable_step=0) == [5, 4]  # newest first
    assert restorable_steps(gathered, durable_step=4) == [5]
    assert restorable_steps(gathered, durable_step=5) == []  # the durable checkpoint is as new


def test_a_rank_that_lost_its_copies_is_covered_by_a_peers_replica():
    # rank 1's node was replaced (nothing of its own); rank 0 holds rank 1's step 6 and 5
    gathered = [report(own=[5, 6], held={1: [5, 6]}), report()]
    assert restorable_steps(gathered, durable_step=4) == [6, 5]
    assert replica_holders(gathered, owner=1, step=6) == [0]
    assert replica_holders(gathered, owner=0, step=6) == []


def test_a_replica_of_one_rank_does_not_stand_in_for_another():
    gathered = [report(own=[6], held={2: [6]}), report(), report(own=[6])]  # rank 1: no copy anywhere
    assert restorable_steps(gathered, durable_step=0) == []


def test_the_lowest_holder_is_named_first():
    gathered = [report(), report(held={0: [3]}), report(held={0: [3]}), report(own=[3])]
    gathered[1]["own"] = gathered[2]["own"] = [3]
    assert replica_holders(gathered, owner=0, step=3) == [1, 2]
    assert restorable_steps(gathered, durable_step=2) == [3]


def test_hsdp_twins_are_the_same_shard_in_the_other_replica_groups():
    assert twins_of([[0, 1], [2, 3]]) == {0: [2], 1: [3], 2: [0], 3: [1]}
    assert twins_of([[0, 1, 2], [3, 4, 5], [6, 7, 8]])[4] == [1, 7]
    assert twins_of([[0], [1]]) == {0: [1], 1: [0]}  # 2 x 1: every rank holds the whole state


def test_a_rank_that_lost_its_node_is_covered_by_its_twins_own_capture():
    # 2 x 2 HSDP; rank 1's node was replaced: nothing of its own, no replicas anywhere.
    gathered = [report(own=[5, 6]), report(), report(own=[5, 6]), report(own=[5])]
    twins = twins_of([[0, 1], [2, 3]])
    assert restorable_steps(gathered, durable_step=4) == []  # FSDP's rule: nobody holds rank 1's
    assert restorable_steps(gathered, durable_step=4, twins=twins) == [5]  # rank 3 has only 5
    assert twin_holders(gathered, owner=1, step=5, twins=twins) == [3]
    assert twin_holders(gathered, owner=1, step=6, twins=twins) == []


def test_a_copy_with_nan_or_inf_is_named_and_a_finite_one_passes():
    clean = {"params": [torch.ones(3)], "optim": [{"exp_avg": torch.zeros(3), "step": torch.tensor(4.0)}]}
    assert non_finite(clean) is None
    poisoned = {"params": [torch.ones(3)], "optim": [{"exp_avg": torch.tensor([0.0, float("nan"), 1.0])}]}
    assert non_finite(poisoned) == "optim tensor 0 holds NaN or Inf"
    assert (
        non_finite({"params": [torch.tensor([float("inf")])], "optim": [{}]})
        == "params tensor 0 holds NaN or Inf"
    )


def test_node_loss_removes_only_what_that_rank_keeps(tmp_path):
    names = [
        "rank_1_step_6_slot_0.head",
        "rank_1_slot_0.data",
        "replica_rank_0_step_6_on_1.pt",  # rank 0's replica held on rank 1
        "rank_11_slot_0.data",
        "rank_0_slot_0.data",
        "replica_rank_1_step_6_on_0.pt",  # rank 1's replica held on rank 0: on another node
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    forget_rank(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[3:])


def test_node_loss_is_a_hard_fault_that_forgets_before_the_kill(tmp_path, monkeypatch):
    from trainer import faults

    [spec] = faults.parse_faults("node-loss@3:1")
    assert spec.kind in faults.HARD_FAULTS
    order = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: order.append(("kill", sig)))
    injector = faults.FaultInjector(
        [spec], tmp_path, rank=1, world_size=2, lose_node=lambda: order.append("lost")
    )
    injector.at_step(3)
    assert order == ["lost", ("kill", faults.signal.SIGKILL)]
    injector.at_step(3)  # a redone step after the restart does not fire again
    assert len(order) == 2
    with pytest.raises(faults.FaultSpecError):
        faults.FaultInjector([spec], tmp_path, rank=0, world_size=1)
