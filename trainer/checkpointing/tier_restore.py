"""The fast tier's restore rule (pure: a function of what every rank reported holding).

Each rank reports `{"own": [steps it holds itself], "held": {owner: [steps of owner's it
holds as a replica]}}`; the list of those reports, indexed by rank, is what the restore's
all-gather returns. A step can be restored when it is newer than the durable checkpoint and
every rank's state after it is held somewhere: by the rank itself or by a peer.
"""

from __future__ import annotations

from typing import Any


def replica_holders(gathered: list[dict[str, Any]], owner: int, step: int) -> list[int]:
    """The ranks that hold `owner`'s state after `step` as a replica, lowest first."""
    return [rank for rank, report in enumerate(gathered) if step in report["held"].get(owner, ())]


def restorable_steps(gathered: list[dict[str, Any]], durable_step: int) -> list[int]:
    """The steps every rank's state can be restored from, newer than `durable_step`, newest first."""
    steps = {s for report in gathered for s in report["own"]}
    steps |= {s for report in gathered for held in report["held"].values() for s in held}
    return sorted(
        (
            s
            for s in steps
            if s > durable_step
            and all(
                s in report["own"] or replica_holders(gathered, owner, s)
                for owner, report in enumerate(gathered)
            )
        ),
        reverse=True,
    )
