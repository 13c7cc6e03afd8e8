"""The fast tier's restore: the ranks agree on the newest step every rank's state is held
for (`tier_restore`'s rule over one all-gather), take a peer's replica (or, under HSDP, a
twin's own capture) where their own copy is missing or unreadable, and load it; and the replica transport is set up for the attempt.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer.checkpointing import replicas as peer_copies
from trainer.checkpointing import storage, tier_restore
from trainer.checkpointing import tier_format as fmt
from trainer.checkpointing import tier_slots as slots

if TYPE_CHECKING:
    from trainer.checkpointing.local_tier import LocalTier

log = logging.getLogger("trainer.checkpointing.local_tier")


def restore(tier: LocalTier, durable_step: int) -> int | None:
    """Collective: if every rank's state after the same step newer than `durable_step` is
    held (by the rank itself, or as a peer's replica), load the newest such into model,
    optimizer, scheduler and RNG and return its step; else None (load the durable
    checkpoint). Also starts this attempt's replica receiver and learns its peers'."""
    # Step -> the slot this rank holds it in (None: in this process's memory), matching this run.
    mine: dict[int, int | None] = dict(slots.own_heads(tier.folder, tier.rank)) if tier.enabled else {}
    memory = tier.cache.get(tier.key)
    if tier.enabled and memory is not None and memory["identity"] == tier.identity:
        mine[int(memory["step"])] = None
    held = peer_copies.held_replicas(tier.folder, tier.rank, tier.holds_for)
    info = {
        "own": sorted(mine),
        "held": {owner: sorted(steps) for owner, steps in held.items()},
        "token": secrets.token_bytes(32) if tier.rank == 0 else b"",  # the attempt's, for its replicas
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, info)
    world = len(gathered)
    if tier.holds_for:  # the same on every rank (`replicas.peers`): this attempt's replicas
        # This attempt's receiver runs, and the senders learn where their holders listen.
        tier.sender.token = gathered[0]["token"]
        tier.receiver = peer_copies.ReplicaReceiver(
            tier.folder, tier.rank, tier.holds_for, tier.sender.token, tier.listen_host
        )
        addresses: list[Any] = [None] * world
        dist.all_gather_object(addresses, tier.receiver.address)
        tier.sender.holders = {r: tuple(addresses[r]) for r in tier.sends_to if addresses[r] is not None}
    for step in tier_restore.restorable_steps(gathered, durable_step, tier.twins):
        payload, snapshot, problem = _own(tier, step, mine[step]) if step in mine else (None, None, None)
        ok = _fits(tier, snapshot, durable_step)  # None: `problem` says why
        own_ok: list[Any] = [None] * world
        dist.all_gather_object(own_ok, bool(ok))
        # A rank whose own copy is missing or unreadable takes a peer's replica, else (HSDP)
        # a twin's own capture; either is checked before it is trained on.
        source: int | None = None
        for owner in range(world):
            replicas = tier_restore.replica_holders(gathered, owner, step)
            twins = [t for t in tier_restore.twin_holders(gathered, owner, step, tier.twins) if own_ok[t]]
            if own_ok[owner] or not replicas + twins:
                continue
            sender = (replicas + twins)[0]
            if tier.rank == sender:  # a twin sends what it read its own capture from
                dist.send_object_list([fmt.read_bytes(held[owner][step]) if replicas else payload], dst=owner)
            elif tier.rank == owner:
                got: list[Any] = [None]
                dist.recv_object_list(got, src=sender)
                what = f"rank {sender}'s {'replica' if replicas else 'capture (its HSDP twin)'}"
                snapshot, problem = (
                    (got[0], None) if isinstance(got[0], dict) else fmt.load_bytes(got[0], what)
                )
                if snapshot is not None and (bad := slots.non_finite(snapshot)):
                    snapshot, problem = None, f"{what}: {bad}"
                ok = _fits(tier, snapshot, durable_step)
                source = sender
        verdicts: list[Any] = [None] * world
        dist.all_gather_object(verdicts, (bool(ok), source))
        if all(good for good, _ in verdicts):
            assert snapshot is not None
            _load(tier, snapshot)
            if source is not None or mine[step] is not None:  # the cached capture stays where it is
                tier.cache.put(tier.key, snapshot, None)
            if source is None and (slot := mine[step]) is not None:
                tier.next_slot = 1 - slot  # the first capture keeps this one
            tier.restored_from = {r: peer for r, (_, peer) in enumerate(verdicts) if peer is not None}
            return step
        if problem:
            log.warning("fast checkpoint tier: rank %d: step %d unusable: %s", tier.rank, step, problem)
    return None


def _own(tier: LocalTier, step: int, slot: int | None) -> tuple[Any, dict[str, Any] | None, str | None]:
    """This rank's own capture of `step` in `slot` (None: in memory only): what a twin is
    sent (the file's bytes, checked on arrival like a replica's, or the capture itself when
    only memory holds it), then the capture read from it, or what is wrong with it."""
    if slot is None:
        capture = tier.cache.get(tier.key)
        return capture, capture, None
    head = tier.folder / slots.head_name(tier.rank, step, slot)
    payload = fmt.read_bytes(head, head.with_name(slots.slot_name(tier.rank, slot)))
    return payload, *fmt.load_bytes(payload, str(head))


def _fits(tier: LocalTier, snapshot: dict[str, Any] | None, durable_step: int) -> bool:
    """Whether a capture (None: none could be read) belongs to this run and state: taken
    before no newer durable checkpoint than this attempt knows (else another run's), the
    identity, the shards' shapes."""
    if snapshot is None or snapshot.get("identity") != tier.identity:
        return False
    fresh = int(snapshot.get("durable_step", -1)) <= durable_step
    shapes = [tuple(t.shape) for t in snapshot["params"]]
    return fresh and shapes == [tuple(slots.local_shard(p).shape) for p in tier.params]


def _load(tier: LocalTier, snapshot: dict[str, Any]) -> None:
    """Copy a capture into the shards, the optimizer state and groups, the scheduler and the RNG."""
    from torch.distributed.tensor import DTensor

    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a copy in memory may still have been in flight
    with torch.no_grad():
        for p, saved, saved_state in zip(tier.params, snapshot["params"], snapshot["optim"], strict=True):
            shard = slots.local_shard(p)
            shard.copy_(saved)
            state: dict[str, Any] = {}
            for k, v in saved_state.items():
                if torch.is_tensor(v):
                    v = v.to(shard.device, copy=True)
                    if isinstance(p, DTensor) and v.shape == shard.shape:
                        v = DTensor.from_local(
                            v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                        )
                state[k] = v
            if state:
                tier.optimizer.state[p] = state
    for group, saved_group in zip(tier.optimizer.param_groups, snapshot["groups"], strict=True):
        group.update(saved_group)
    tier.scheduler.load_state_dict(snapshot["scheduler"])
    storage.restore_rng(snapshot)
