"""The fast tier's restore rule as a pure function of the ranks' reports (no process group)."""

from trainer.checkpointing.tier_restore import replica_holders, restorable_steps


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
