"""Checkpoint policy for the training loop: resume, when to save, what a save holds.

`CheckpointManager` is all the loop sees of checkpointing. It resumes from the latest
committed checkpoint (`load_latest`), saves at every `checkpoint.every_steps`-th step and
at an attempt's last step (`maybe_save`), with the metadata a resume needs (config, model
hash, scheduler, loss, the launcher's learned timeouts) and each rank's loader position,
lets an asynchronous save finish its copy before the weights change
(`before_optimizer_step`), commits finished saves (`after_step`), and reports what saving
cost (`summary`). How a save is written is the `checkpoint.mode`'s writer class, picked
from `WRITERS`; the events `resume`, `checkpoint_queued` and `checkpoint_committed` are
emitted here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainer.checkpointing import storage
from trainer.checkpointing.fingerprint import model_sha256
from trainer.checkpointing.local_tier import LocalTier
from trainer.checkpointing.nvrx_writer import NvrxAsyncWriter
from trainer.checkpointing.torch_writers import SyncWriter, TorchAsyncWriter
from trainer.checkpointing.writer import CheckpointWriter, NoCheckpoints, PendingSave, SaveRecord
from trainer.config import TrainConfig
from trainer.data import StepSampler
from trainer.events import EventLog

if TYPE_CHECKING:
    from trainer.loop import TrainHooks

log = logging.getLogger(__name__)

WRITERS: dict[str, type[CheckpointWriter]] = {
    "off": NoCheckpoints,
    "sync": SyncWriter,
    "torch-async": TorchAsyncWriter,
    "async": NvrxAsyncWriter,
}
"""`checkpoint.mode` -> the class that writes its saves."""


class CheckpointManager:
    """Collective object: every rank creates one per attempt and calls it at the same steps."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        sampler: StepSampler,
        hooks: TrainHooks,
        events: EventLog,
        during_save: Callable[[int], None] | None = None,
    ) -> None:
        settings = config.checkpoint
        if settings.mode not in WRITERS:
            raise ValueError(f"checkpoint mode {settings.mode!r} is not one of {', '.join(WRITERS)}")
        self.config = config
        self.settings = settings
        self.root = Path(config.checkpoint_dir())
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.hooks = hooks
        self.events = events
        self.during_save = during_save  # a drill's slow file system (faults.FaultInjector)
        self.rank = dist.get_rank()
        self.writer = WRITERS[settings.mode](
            self.root, settings.keep_last, settings.keep_every_steps, self._on_commit
        )
        self.records: list[SaveRecord] = []
        self.durable_step = 0  # the newest committed durable checkpoint this attempt knows of
        self.resumed_durable_step = 0
        self.local_tier_s = 0.0
        self._prepared = False  # `after_step()` has offered the writer the state's layout
        self.deferred_saves: list[int] = []
        self.local = LocalTier(
            every_steps=settings.local_every_steps,
            local_dir=settings.local_dir,
            checkpoint_dir=self.root,
            # The run is the folder's name (its checkpoint folder, hashed); what must match too:
            identity={
                "model_hash": config.model_hash(),
                "world_size": dist.get_world_size(),
            },
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            replicas=settings.local_replicas,
        )
        self.resumed_from: str | None = None
        self.start_s = 0.0
        self.final_drain_s = 0.0
        self.teardown_s = 0.0

    def load_latest(self) -> int:
        """Collective: restore model, optimizer, scheduler, RNG and launcher state from the
        latest committed checkpoint; returns its step (0 when there is none)."""
        with self.hooks.keepalive():
            return self._load_latest()

    def _load_latest(self) -> int:
        latest = storage.latest_committed_checkpoint(self.root, self.settings.verify_hashes)
        durable_meta = storage.read_meta(latest) if latest is not None else {}
        self.durable_step = self.resumed_durable_step = int(durable_meta.get("step", 0))
        local_step = self.local.restore(self.durable_step)
        if local_step is not None:
            # The launcher's learned timeouts travel with the durable checkpoint only.
            self.hooks.restore_launcher_state(durable_meta.get("launcher", {}))
            self.resumed_from = f"local:{local_step}"
            # Ranks whose state came from a peer's replica: {rank: the peer that held it}.
            from_peers = {str(owner): peer for owner, peer in self.local.restored_from.items()}
            self.events.emit(
                "resume", step=local_step, checkpoint=self.resumed_from, tier="local", replicas=from_peers
            )
            if self.rank == 0:
                log.info(
                    "resumed from the fast tier at step %d (durable checkpoint: step %d)",
                    local_step,
                    self.durable_step,
                )
            return local_step
        if latest is None:
            return 0
        restored = storage.load_checkpoint(latest, self.model, self.optimizer)
        meta = restored["meta"]
        if meta.get("model_hash") != self.config.model_hash():
            raise storage.CheckpointError(
                f"{latest} was trained with a different model config; use a new checkpoint dir"
            )
        self.sampler.check_resumable(meta.get("sampler", {}), str(latest))  # the same data, or refused
        self.scheduler.load_state_dict(meta["scheduler"])
        self.hooks.restore_launcher_state(meta.get("launcher", {}))
        step = int(meta["step"])
        self.resumed_from = str(latest)
        self.events.emit("resume", step=step, checkpoint=self.resumed_from)
        if self.rank == 0:
            log.info("resumed from %s at step %d", latest, step)
        return step

    def start(self, background: bool) -> None:
        """Collective: start the writer (its worker, group, warm-up) before the first step.

        `background`: let it warm up while training runs (a restart needs its first step soon)."""
        _LIVE.append(self)
        started = time.perf_counter()
        self.writer.start(background)
        self.start_s = time.perf_counter() - started

    def before_optimizer_step(self) -> SaveRecord | None:
        """Collective; call right before every `optimizer.step()`. Returns the record of a save
        queued now (an async save's snapshot copy ran beside forward and backward and must be
        complete before the optimizer changes the weights in place), else None."""
        self.local_tier_s += self.local.before_optimizer_step()
        if not self.writer.awaiting_handoff:
            return self.writer.wait_before_optimizer_step()
        with self.hooks.keepalive():  # may wait for a snapshot copy of the whole state
            return self.writer.wait_before_optimizer_step()

    def maybe_save(self, step: int, loss_value: float, final: bool) -> SaveRecord | None:
        """Collective, after step `step`: save if it is a checkpoint step or `final` (the
        attempt's last step, or a stop was requested). Returns the save's record if it is
        queued with the writer now; an async save is queued by `before_optimizer_step()`."""
        started = time.perf_counter()
        due = (final or step % self.settings.every_steps == 0) and self.writer.writes_checkpoints
        if self.local.capture(step, self.durable_step):
            self.local_tier_s += time.perf_counter() - started
        if not due:
            return None
        if not final and self.writer.warming_up and self._may_defer(step):
            # A restarted attempt's writer starts in the background (1-2 s, more on a busy
            # machine); waiting for it here blocked the loop for that long and could trip the
            # in-process watchdog. The fast tier covers recovery meanwhile: this periodic
            # save is skipped and the next one is written. Never two in a row, never before
            # the run's first durable checkpoint, and a final save always waits. Every rank
            # decides alike: the warm-up ends in a collective, and the steps compared are
            # the ones every rank resumed from or queued.
            self.deferred_saves.append(step)
            self.events.emit("checkpoint_deferred", step=step, reason="writer starting")
            return None
        meta = {
            "config": self.config.to_dict(),
            "model_hash": self.config.model_hash(),
            "scheduler": self.scheduler.state_dict(),
            "loss": loss_value,
            "launcher": self.hooks.launcher_state(),
            "sampler": self.sampler.state_dict(next_step=step + 1),  # read by every rank's resume
        }
        rank_extra = {"sampler": self.sampler.state_dict(next_step=step + 1)}
        # Waits for the previous write, writes a sync save whole: the progress signals go on.
        with self.hooks.keepalive():
            record = self._save(step, meta, rank_extra, last=final)
            fields = (
                {"weights_sha256": model_sha256(self.model)} if self.settings.record_weight_hashes else {}
            )
        self.events.emit(
            "checkpoint_queued", step=step, mode=record.mode, blocked_s=record.blocked_s, **fields
        )
        return None if self.writer.awaiting_handoff else record

    def _may_defer(self, step: int) -> bool:
        """Only right after a durable save this attempt resumed from or queued: one interval."""
        last = max(self.resumed_durable_step, self.records[-1].step if self.records else 0)
        return last > 0 and step - last <= self.settings.every_steps

    def _save(self, step: int, meta: dict[str, Any], rank_extra: dict[str, Any], last: bool) -> SaveRecord:
        started = time.perf_counter()
        self.writer.finalize()  # the previous save commits first: snapshot buffers are reused
        previous_wait_s = time.perf_counter() - started
        if self.writer.stages_itself:  # its RNG state is taken now, its folder made later
            staging, final = storage.staging_paths(self.root, step)
            state_of_rank: dict[str, Any] | None = storage.rank_state(rank_extra)
        else:
            staging, final = storage.prepare_staging(self.root, step, rank_extra)
            state_of_rank = None
        state = self._state_dict()
        if self.during_save is not None:
            self.during_save(step)
        record = SaveRecord(
            step=step,
            mode=self.writer.mode,
            blocked_s=0.0,
            previous_wait_s=previous_wait_s,
            path=str(final),
        )
        pending = PendingSave(
            record,
            staging,
            final,
            meta,
            started_at=started,
            queued_at=started,
            last=last,
            rank_state=state_of_rank,
        )
        self.writer.start_save(state, pending)
        self.records.append(record)
        return record

    def after_step(self) -> None:
        """Collective, cheap, every step: commit a finished save as soon as all ranks agree.
        After the attempt's first step, also lets the writer allocate for the state ahead."""
        self.writer.poll()
        if not self._prepared:
            self._prepared = True
            self.writer.prepare(self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def finish(self) -> None:
        """Collective, at the end of the loop: the last checkpoint is committed (the run's
        result is durable), then the writer is stopped."""
        started = time.perf_counter()
        with self.hooks.keepalive():  # the attempt's last save is written here
            self.writer.finalize()
            self.final_drain_s = time.perf_counter() - started
            # The last step's durable checkpoint is committed: the fast tier is of no more use.
            self.local.close(discard=self.writer.writes_checkpoints)
            self.close()
        self.teardown_s = time.perf_counter() - started - self.final_drain_s

    def close(self) -> None:
        """Collective: commit what is pending and stop the writer (safe to call twice)."""
        self.local.close()
        self.writer.close()
        if self in _LIVE:
            _LIVE.remove(self)

    def abandon(self) -> None:
        """Not collective: drop pending work (its process group is gone, e.g. before an
        in-process restart); the save in progress is never committed."""
        self.local.close(flush=False)
        self.writer.abandon()
        if self in _LIVE:
            _LIVE.remove(self)

    def summary(self, loop_wall_s: float) -> dict[str, Any]:
        """The summary's checkpoint fields (rank 0 writes them to summary.json)."""
        latest = storage.latest_committed_checkpoint(self.root)
        blocked_total = sum(record.blocked_s for record in self.records) + self.local_tier_s
        return {
            "local_tier_s": self.local_tier_s,
            "local_tier_captures": self.local.captures,
            "local_replicas_sent": self.local.replicas_sent,
            **self.local.summary(),
            "checkpoint": str(latest) if latest else None,
            "checkpoint_mode": self.settings.mode,
            "resumed_from": self.resumed_from,
            "checkpoint_saves": [record.as_dict() for record in self.records],
            "checkpoint_blocked_s": blocked_total,
            "efficiency_pct": efficiency_pct(blocked_total, loop_wall_s),
            "final_drain_s": self.final_drain_s,
            "checkpointer_start_s": self.start_s,
            "checkpointer_teardown_s": self.teardown_s,
        }

    def _on_commit(self, record: SaveRecord) -> None:
        self.durable_step = max(self.durable_step, record.step)
        self.events.emit("checkpoint_committed", **record.as_dict())
        if self.rank == 0:
            log.info(
                "checkpoint step %d committed (blocked %.3fs, write %.3fs)",
                record.step,
                record.blocked_s,
                record.write_s or 0.0,
            )


_LIVE: list[CheckpointManager] = []
"""Started managers not yet closed: what `abandon_all` releases before a restart."""


def abandon_all() -> None:
    """Abandon every live checkpoint manager of this process (the in-process restart's Finalize)."""
    for manager in list(_LIVE):
        manager.abandon()


def efficiency_pct(blocked_s_total: float, wall_s: float) -> float:
    """AWS's definition: 100 - 100 * (time the loop was blocked by checkpointing) / wall time."""
    if wall_s <= 0:
        return 100.0
    return 100.0 - 100.0 * blocked_s_total / wall_s
