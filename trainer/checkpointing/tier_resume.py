"""The fast tier's restore: the ranks agree on the newest step every rank's state is held
for (`tier_restore`'s rule over one all-gather), take a peer's replica (or, under HSDP, a
twin's own capture) where their own copy is missing or unreadable, and load it; and the replica transport is set up for the attempt.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from trainer.checkpointing import replicas as peer_copies
from trainer.checkpointing import tier_format as fmt
from trainer.checkpointing import tier_restore
from trainer.checkpointing import tier_slots as slots

if TYPE_CHECKING:
    from trainer.checkpointing.local_tier import LocalTier

log = logging.getLogger("trainer.checkpointing.local_tier")


def _candidates(tier: LocalTier) -> dict[int, str]:
    """step -> where this rank holds it ("memory" or a header path), matching this run."""
    found: dict[int, str] = {}
    if tier.folder.is_dir():
        for path in tier.folder.iterdir():
            match = slots.HEAD_FILE.match(path.name)
            if match and int(match.group(1)) == tier.rank:
                found[int(match.group(2))] = str(path)
    memory = tier.cache.get(tier.key)
    if memory is not None and memory["identity"] == tier.identity:
        found[int(memory["step"])] = "memory"
    return found


def restore(tier: LocalTier, durable_step: int) -> int | None:
    """Collective: if every rank's state after the same step newer than `durable_step` is
    held (by the rank itself, or as a peer's replica), load the newest such into model,
    optimizer, scheduler and RNG and return its step; else None (load the durable
    checkpoint). Also starts this attempt's replica receiver and learns its peers'."""
    mine = _candidates(tier) if tier.enabled else {}
    held = peer_copies.held_replicas(tier.folder, tier.rank, tier.holds_for)
    if tier.holds_for and tier.receiver is None:
        tier.sender.token = secrets.token_bytes(32) if tier.rank == 0 else b""
    info = {
        "own": sorted(mine),
        "held": {owner: sorted(steps) for owner, steps in held.items()},
        "token": tier.sender.token,
        "holds": bool(tier.holds_for),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, info)
    _start_replication(tier, gathered)
    world = len(gathered)
    usable = tier_restore.restorable_steps(gathered, durable_step, tier.twins)
    for step in usable:
        snapshot, problem = _read(tier, mine[step]) if step in mine else (None, None)
        ok = problem is None and snapshot is not None and _matches(tier, snapshot, durable_step)
        own_ok: list[Any] = [None] * world
        dist.all_gather_object(own_ok, bool(ok))
        # A rank whose own copy is missing or unreadable takes a peer's replica, else (HSDP)
        # a twin's own capture; either is checked before it is trained on.
        source: int | None = None
        for owner in range(world):
            if own_ok[owner]:
                continue
            replicas = tier_restore.replica_holders(gathered, owner, step)
            twins = [t for t in tier_restore.twin_holders(gathered, owner, step, tier.twins) if own_ok[t]]
            sender = replicas[0] if replicas else twins[0] if twins else None
            if sender is None:
                continue
            if tier.rank == sender:
                payload = fmt.read_bytes(held[owner][step]) if replicas else _own_payload(tier, mine[step])
                dist.send_object_list([payload], dst=owner)
            elif tier.rank == owner:
                received: list[Any] = [None]
                dist.recv_object_list(received, src=sender)
                what = f"rank {sender}'s {'replica' if replicas else 'capture (its HSDP twin)'}"
                snapshot, problem = (
                    (received[0], None)
                    if isinstance(received[0], dict)
                    else fmt.load_bytes(received[0], what)
                )
                if snapshot is not None and problem is None and (bad := slots.non_finite(snapshot)):
                    snapshot, problem = None, f"{what}: {bad}"
                ok = problem is None and snapshot is not None and _matches(tier, snapshot, durable_step)
                source = sender
        verdicts: list[Any] = [None] * world
        dist.all_gather_object(verdicts, (bool(ok), source))
        if all(good for good, _ in verdicts):
            assert snapshot is not None
            slots.load_capture(snapshot, tier.params, tier.optimizer, tier.scheduler)
            if source is not None or mine[step] != "memory":  # the cached capture stays where it is
                tier.cache.put(tier.key, snapshot, None)
            if source is None and (match := slots.HEAD_FILE.match(Path(mine[step]).name)):
                tier.next_slot = 1 - int(match.group(3))  # the first capture keeps this one
            tier.restored_from = {r: peer for r, (_, peer) in enumerate(verdicts) if peer is not None}
            return step
        if problem:
            log.warning("fast checkpoint tier: rank %d: step %d unusable: %s", tier.rank, step, problem)
    return None


def _start_replication(tier: LocalTier, gathered: list[Any]) -> None:
    """After the restore's all-gather: this attempt's receiver runs, the senders know
    where their holders listen. Not collective beyond that all-gather."""
    if not any(g["holds"] for g in gathered):  # the same on every rank
        return
    tier.sender.token = gathered[0]["token"]
    if tier.holds_for and tier.receiver is None:
        tier.receiver = peer_copies.ReplicaReceiver(
            tier.folder, tier.rank, tier.holds_for, tier.sender.token, tier.listen_host
        )
    addresses: list[Any] = [None] * len(gathered)
    dist.all_gather_object(addresses, tier.receiver.address if tier.receiver else None)
    tier.sender.holders = {
        r: tuple(a) for r, a in enumerate(addresses) if a is not None and r in tier.sends_to
    }


def _own_payload(tier: LocalTier, where: str) -> Any:
    """This rank's own capture for a twin: the file's bytes (checked on arrival like a
    replica's), or the capture itself when only memory holds it."""
    if where == "memory":
        return tier.cache.get(tier.key)
    head = Path(where)
    match = slots.HEAD_FILE.match(head.name)
    assert match is not None
    return fmt.read_bytes(head, head.with_name(slots.slot_name(tier.rank, int(match.group(3)))))


def _read(tier: LocalTier, where: str) -> tuple[dict[str, Any] | None, str | None]:
    payload = _own_payload(tier, where)
    return (payload, None) if where == "memory" else fmt.load_bytes(payload, where)


def _matches(tier: LocalTier, snapshot: dict[str, Any], durable_step: int) -> bool:
    return slots.capture_fits(snapshot, tier.identity, durable_step, tier.params)
