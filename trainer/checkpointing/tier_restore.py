"""The fast tier's restore rule (pure: a function of what every rank reported holding).

Each rank reports `{"own": [steps it holds itself], "held": {owner: [steps of owner's it
holds as a replica]}}`; the list of those reports, indexed by rank, is what the restore's
all-gather returns. A step can be restored when it is newer than the durable checkpoint and
every rank's state after it is held somewhere: by the rank itself, by a peer as a replica,
or (HSDP) by a twin: a rank of another replica group that holds the same shard, whose own
capture is this rank's state too.
"""

from __future__ import annotations

from typing import Any

Reports = list[dict[str, Any]]
"""Every rank's report, indexed by rank: what the restore's all-gather returns."""
Twins = dict[int, list[int]]
"""rank -> the ranks of other replica groups holding the same state (HSDP)."""


def replica_holders(gathered: Reports, owner: int, step: int) -> list[int]:
    """The ranks that hold `owner`'s state after `step` as a replica, lowest first."""
    return [rank for rank, report in enumerate(gathered) if step in report["held"].get(owner, ())]


def twins_of(grid: list[list[int]]) -> Twins:
    """rank -> the ranks holding the same state, from an HSDP mesh's (replicate, shard) grid
    of ranks: the same column in the other rows."""
    return {
        rank: [other[column] for other in grid if other is not row]
        for row in grid
        for column, rank in enumerate(row)
    }


def twin_holders(gathered: Reports, owner: int, step: int, twins: Twins) -> list[int]:
    """`owner`'s twins that hold their own state after `step`, lowest first."""
    return sorted(t for t in twins.get(owner, ()) if step in gathered[t]["own"])


def restorable_steps(gathered: Reports, durable_step: int, twins: Twins | None = None) -> list[int]:
    """The steps every rank's state can be restored from, newer than `durable_step`, newest first."""
    steps = {s for report in gathered for s in report["own"]}
    steps |= {s for report in gathered for held in report["held"].values() for s in held}

    def everyone_held(s: int) -> bool:
        return all(
            s in report["own"]
            or replica_holders(gathered, owner, s)
            or twin_holders(gathered, owner, s, twins or {})
            for owner, report in enumerate(gathered)
        )

    return sorted((s for s in steps if s > durable_step and everyone_held(s)), reverse=True)
