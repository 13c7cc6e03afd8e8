"""Checkpoint policy for the training loop: resume, when to save, what a save holds.

`CheckpointManager` is all the loop sees of checkpointing, four calls: `load()` resumes
from the latest committed checkpoint (or the fast tier) and starts the writer;
`maybe_wait_for_staging()`, right before every `optimizer.step()`, lets an asynchronous
save finish copying the weights before they change; `save(step, last_step, loss)`, after
every step, saves at every `checkpoint.every_steps`-th step and at an attempt's last step,
with the metadata a resume needs (config, model hash, scheduler, loss, the registered
`states`) and each rank's loader position, and commits finished saves; `close()` makes
the last save durable and stops the writer (`abandon()` instead, when the process group
is gone). `summary` reports what saving cost. How a save is written is the
`checkpoint.mode`'s writer class, picked from `WRITERS` (or `checkpoint.writer`); the events `resume`,
`checkpoint_queued`, `checkpoint_deferred` and `checkpoint_committed` are emitted here.
"""

from __future__ import annotations

import functools
import importlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from trainer import waiting
from trainer.checkpointing import storage
from trainer.checkpointing import tier_slots as slots
from trainer.checkpointing.fingerprint import model_sha256
from trainer.checkpointing.local_tier import LocalTier
from trainer.checkpointing.replicas import REPLICA_FILE, folder_names
from trainer.checkpointing.slot_refs import Lease
from trainer.checkpointing.writer import CheckpointWriter, PendingSave, SaveRecord
from trainer.config import ConfigError, TrainConfig
from trainer.data import DataSampler
from trainer.events import EventLog
from trainer.lora import adapter_identity, adapter_problem

if TYPE_CHECKING:
    from trainer.hooks import Stateful, TrainHooks

log = logging.getLogger(__name__)

WRITERS: dict[str, str] = {
    "off": "trainer.checkpointing.writer:NoCheckpoints",
    "sync": "trainer.checkpointing.writer:SyncWriter",
    "async": "trainer.checkpointing.nvrx_writer:NvrxAsyncWriter",
}
"""`checkpoint.mode` -> the class that writes its saves, imported when used (NVRx: `async` only)."""


def writer_class(spec: str) -> type[CheckpointWriter]:
    """The writer class of a mode, or of a `checkpoint.writer` plug-in ("module:Class"); a
    ConfigError (no restart retries it) where that names no CheckpointWriter subclass."""
    module, name = WRITERS.get(spec, spec).split(":")
    try:
        writer = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"checkpoint.writer {spec!r} cannot be loaded on this rank: {exc}") from exc
    if not (isinstance(writer, type) and issubclass(writer, CheckpointWriter)):
        raise ConfigError(f"checkpoint.writer {spec!r} is not a CheckpointWriter subclass")
    return writer


_META_KEYS = frozenset({"config", "model_hash", "adapters", "scheduler", "loss", "sampler", "step"})
"""What a save's metadata holds already: not a name for `states`."""


class CheckpointManager:
    """Collective object: every rank creates one per attempt and calls it at the same steps.

    `states`: more state saved in every durable checkpoint's metadata under its name and
    restored on resume (anything with `state_dict()`/`load_state_dict()`). `on_queued`:
    called with a save's step once the writer has it (the fault drills' hook).
    `during_save`: called with the step inside every save's write, where the writer writes
    (a drill's slow file system)."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        sampler: DataSampler,
        hooks: TrainHooks,
        events: EventLog,
        states: Mapping[str, Stateful] | None = None,
        on_queued: Callable[[int], None] = lambda step: None,
        during_save: Callable[[int], None] = lambda step: None,
    ) -> None:
        settings = config.checkpoint
        if settings.mode not in WRITERS:
            raise ValueError(f"checkpoint mode {settings.mode!r} is not one of {', '.join(WRITERS)}")
        self.states = dict(states or {})
        if clashing := sorted(self.states.keys() & _META_KEYS):
            raise ValueError(f"checkpoint states {clashing} clash with the metadata's own keys; rename them")
        self.config = config
        self.settings = settings
        self.root = Path(config.checkpoint_dir())
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.hooks = hooks
        self.events = events
        self.on_queued = on_queued
        self.during_save = during_save
        self.rank = dist.get_rank()
        # A LoRA run's adapters and the base they apply to (None: full training), once per attempt.
        self.adapters = adapter_identity(config)
        self._queued: list[SaveRecord] = []  # queued by the writer, not yet told to `on_queued`
        self.records: list[SaveRecord] = []
        # The newest committed durable checkpoint this attempt knows of, and the one it resumed with.
        self.durable_step = self.resumed_durable_step = 0
        self.deferred_saves: list[int] = []
        # The run is the tier's folder's name (its checkpoint folder, hashed); what must match too:
        identity = {"model_hash": config.model_hash(), "adapters": self.adapters}
        self.local = LocalTier(
            settings, self.root, identity, model, optimizer, scheduler, hooks.capture_cache()
        )
        self.writer = writer_class(settings.writer or settings.mode)(
            self.root,
            settings.keep_last,
            settings.keep_every_steps,
            self._on_commit,
            on_queued=self._queued.append,
            keepalive=hooks.keepalive,
            prepare_captures=self.local.prepare_for_saves,
        )
        self._last_step = 0  # the step of the latest `save()` call
        self.resumed_from: str | None = None
        self.local_tier_s = self.load_s = self.start_s = self.final_drain_s = self.teardown_s = 0.0

    def load(self, background: bool = False, init_trained: Callable[[], None] | None = None) -> int:
        """Collective, before the first step: restore model, optimizer, scheduler, RNG and
        `states` from the latest committed checkpoint (or a newer fast-tier capture), then
        start the writer (its worker, group, warm-up); returns the step resumed at (0 when
        there is none).

        `background`: let the writer warm up while training runs (a restart needs its first
        step soon). `init_trained`: the model was built for a resume (`resume_expected`) and
        its trained parameters hold no values yet; called when nothing is restored after all,
        before the run starts fresh."""
        started = time.perf_counter()
        # The load, and starting NVRx's writer process on a busy node, can outlast a heartbeat timeout.
        with self.hooks.keepalive():
            step = self._load_latest(init_trained)
            self.load_s = time.perf_counter() - started
            self.hooks.track(self)  # from here on a restart must abandon it
            started = time.perf_counter()
            self.writer.open(background)
        self.start_s = time.perf_counter() - started
        return step

    def _load_latest(self, init_trained: Callable[[], None] | None) -> int:
        latest = storage.latest_committed_checkpoint(self.root, self.settings.verify_hashes)
        meta = storage.read_meta(latest) if latest is not None else {}  # what `load_checkpoint` reads too
        self.durable_step = self.resumed_durable_step = int(meta.get("step", 0))
        step = self.local.restore(self.durable_step)
        if step is None:
            if latest is None:
                if init_trained is not None:  # the build expected a resume: no weights yet
                    if self.rank == 0:
                        log.warning("nothing to resume from after all: initializing the weights now")
                    init_trained()
                self._warm_start_optimizer()
                return 0
            # Before reading tensors that may not fit:
            self._refuse_other_model(meta, str(latest), "use a new checkpoint dir to train this model")
            storage.load_checkpoint(latest, self.model, self.optimizer)
            self.sampler.check_resumable(meta.get("sampler", {}), str(latest))  # the same data, or refused
            self.scheduler.load_state_dict(meta["scheduler"])
            step, self.resumed_from, fields = int(meta["step"]), str(latest), {}
            message = f"resumed from {latest} at step {step}"
        else:
            self.resumed_from = f"local:{step}"
            # Ranks whose state came from a peer's replica: {rank: the peer that held it}.
            from_peers = {str(owner): peer for owner, peer in self.local.restored_from.items()}
            fields = {"tier": "local", "replicas": from_peers}
            message = (
                f"resumed from the fast tier at step {step} (durable checkpoint: step {self.durable_step})"
            )
        # The registered states (the launcher's learned timeouts) travel with the durable checkpoint only.
        for name, state in self.states.items():
            state.load_state_dict(meta.get(name, {}))
        self.events.emit("resume", step=step, checkpoint=self.resumed_from, **fields)
        if self.rank == 0:
            log.info(message)
        return step

    def _refuse_other_model(self, meta: dict[str, Any], what: str, remedy: str) -> None:
        """A checkpoint of another architecture, or with adapters for another base, is refused."""
        problem = (
            "it holds another model architecture than this run's model config"
            if meta.get("model_hash") != self.config.model_hash()
            else adapter_problem(meta.get("adapters"), self.adapters, self.config.model)
        )
        if problem:
            raise storage.CheckpointError(f"{what} cannot be used by this run: {problem}; {remedy}")

    def _warm_start_optimizer(self) -> None:
        """A new run with optimizer.warm_start=parent: the parent checkpoint's weights and AdamW
        moments, once its manifest is the one the registered version names."""
        source = self.config.optimizer.initial_state_dir
        if not source:
            return
        # The registry vouches for the manifest; sizes are checked as on a resume.
        if storage.manifest_sha256(source) != self.config.optimizer.initial_state_sha256:
            raise storage.CheckpointError(
                f"{source} is not the checkpoint the parent version was exported from (its manifest "
                "changed): set optimizer.warm_start=fresh"
            )
        storage.verify_checkpoint(source)
        what = f"{source} (the parent's checkpoint)"
        self._refuse_other_model(storage.read_meta(source), what, "set optimizer.warm_start=fresh")
        storage.load_parent_state(source, self.model, self.optimizer)
        self.events.emit("warm_start", checkpoint=source)
        if self.rank == 0:
            log.info("started from the weights and AdamW moments of %s", source)

    def maybe_wait_for_staging(self) -> None:
        """Collective; call right before every `optimizer.step()`: an async save's snapshot
        copy (and the fast tier's) ran beside forward and backward and must be complete
        before the optimizer changes the weights in place."""
        self.local_tier_s += self.local.before_optimizer_step()
        self.writer.wait("staged")
        self._report_queued()

    def save(self, step: int, last_step: bool, loss: float) -> SaveRecord | None:
        """Collective, after every step `step`: capture it in the fast tier, save it if it
        is a checkpoint step or `last_step` (the attempt's last step, or a stop was
        requested), and commit a finished save as soon as all ranks agree. Returns the
        record of a save begun now, else None."""
        self._last_step = step
        record = self._maybe_save(step, loss, last_step)
        self.writer.wait("step")
        return record

    def _maybe_save(self, step: int, loss_value: float, final: bool) -> SaveRecord | None:
        if not (final or step % self.settings.every_steps == 0):
            self._capture(step, for_save=False)
            return None
        previous = max(self.resumed_durable_step, self.records[-1].step if self.records else 0)
        meta = {
            "config": self.config.to_dict(),
            "model_hash": self.config.model_hash(),
            "adapters": self.adapters,
            "scheduler": self.scheduler.state_dict(),
            "loss": loss_value,
            **{name: state.state_dict() for name, state in self.states.items()},
            "sampler": self.sampler.state_dict(next_step=step + 1),  # read by every rank's resume
        }
        staging, final_dir = storage.staging_paths(self.root, step)
        record = SaveRecord(step=step, mode=self.writer.mode, blocked_s=0.0, path=str(final_dir))
        pending = PendingSave(
            record,
            staging,
            final_dir,
            meta,
            # RNG and loader state, taken on the training thread at the save's step.
            rank_state=storage.rank_state({"sampler": self.sampler.state_dict(next_step=step + 1)}),
            started_at=time.perf_counter(),
            last=final,
            deferrable=not final and previous > 0 and step - previous <= self.settings.every_steps,
            during_write=functools.partial(self.during_save, step),
        )
        pending.lend = functools.partial(self._lend, pending)
        # Waits for the previous write, writes a sync save whole: the progress signals go on.
        with self.hooks.keepalive():
            outcome = self.writer.save(storage.training_state_dict(self.model, self.optimizer), pending)
            if pending.lease is None:  # the writer did not write from the fast tier's capture
                self._capture(step, for_save=False)
            if outcome != "queued":
                if outcome == "deferred":
                    self.deferred_saves.append(step)
                    self.events.emit("checkpoint_deferred", step=step, reason="writer starting")
                return None
            self.records.append(record)
            fields = (
                {"weights_sha256": model_sha256(self.model)} if self.settings.record_weight_hashes else {}
            )
        self.events.emit(
            "checkpoint_queued", step=step, mode=record.mode, blocked_s=record.blocked_s, **fields
        )
        self._report_queued()
        return record

    def _capture(self, step: int, for_save: bool) -> Lease | None:
        """The fast tier's capture of step `step`; `for_save`: whatever the interval, lent
        to the save of this step, which then writes from that copy instead of its own."""
        started = time.perf_counter()
        lease = self.local.capture_for_save(step, self.durable_step) if for_save else None
        if lease is not None or self.local.capture(step, self.durable_step):
            self.local_tier_s += time.perf_counter() - started
        return lease

    def _lend(self, pending: PendingSave) -> None:
        """`PendingSave.lend`: the capture's time is the tier's (`local_tier_s`), not the save's."""
        started = time.perf_counter()
        pending.lease = self._capture(pending.record.step, for_save=True)
        pending.started_at += time.perf_counter() - started

    def _report_queued(self) -> None:
        """Tells `on_queued` of the saves the writer queued, after their event is logged."""
        while self._queued:  # the writer holds the list's `append`
            self.on_queued(self._queued.pop(0).step)

    def close(self) -> None:
        """Collective, at the end of the loop: the last checkpoint is committed (the run's
        result is durable), then the writer is stopped."""
        started = time.perf_counter()
        with self.hooks.keepalive():  # the attempt's last save is written here
            self.writer.wait("committed")
            self.final_drain_s = time.perf_counter() - started
            # A durable checkpoint of the last step leaves the fast tier of no more use.
            self.local.close(discard=self.durable_step == self._last_step > 0)
            self.writer.close()
            self.hooks.untrack(self)
        self.teardown_s = time.perf_counter() - started - self.final_drain_s

    def abandon(self) -> None:
        """Not collective, the error path instead of `close()`: drop pending work (its
        process group is gone, e.g. before an in-process restart); the save in progress is
        never committed. Safe to call again if interrupted."""
        self.local.close(flush=False)
        self.writer.close(commit=False)
        self.hooks.untrack(self)

    def summary(self, loop_wall_s: float) -> dict[str, Any]:
        """The summary's checkpoint fields (rank 0 writes them to summary.json)."""
        latest = storage.latest_committed_checkpoint(self.root)
        blocked_total = sum(record.blocked_s for record in self.records) + self.local_tier_s
        return {
            "local_tier_s": self.local_tier_s,
            "local_tier_captures": self.local.captures,
            "local_tier_checksum_s": self.local.checksum_s,
            "local_replicas_sent": self.local.sender.sent,
            **self.local.schedule.summary(),  # the interval: what it is, why, on what
            "checkpoint": str(latest) if latest else None,
            "checkpoint_mode": self.writer.mode,
            "resumed_from": self.resumed_from,
            "checkpoint_saves": [asdict(record) for record in self.records],
            "checkpoint_blocked_s": blocked_total,
            "efficiency_pct": efficiency_pct(blocked_total, loop_wall_s),
            "final_drain_s": self.final_drain_s,
            "checkpointer_start_s": self.start_s,
            "checkpointer_teardown_s": self.teardown_s,
            # Host memory for checkpointing, as copies of this rank's state (slots + the writer's own).
            "checkpoint_host_copies": (self.local.host_bytes + self.writer.host_bytes)
            / max(self._state_bytes(), 1),
        }

    def _state_bytes(self) -> int:
        """This rank's trained parameters and their optimizer state, in bytes (its shards under
        FSDP): the tensors a capture copies."""
        return sum(t.nbytes for t in slots.plan_state(self.local.params, self.optimizer, {}, None)[0].sources)

    def _on_commit(self, record: SaveRecord) -> None:
        self.durable_step = max(self.durable_step, record.step)
        self.events.emit("checkpoint_committed", **asdict(record))
        if self.rank == 0:
            log.info(
                "checkpoint step %d committed (blocked %.3fs, write %.3fs)",
                record.step,
                record.blocked_s,
                record.write_s or 0.0,
            )


def resume_expected(config: TrainConfig, cache: slots.CaptureCache) -> bool:
    """Collective, before the model's weights exist: whether `CheckpointManager.load()` is
    to restore the training state, so that the build may leave the trained parameters to it
    (`ModelSpec.init_for_resume`) instead of reading or drawing weights the load overwrites.

    True when a committed checkpoint is there (sizes checked, not hashes), or any rank holds
    a fast-tier capture or a peer's replica of this run, in memory (`cache`) or in its
    node-local folder. A guess that `load()` settles, given `init_trained`: when nothing it
    finds is usable it initializes the weights then. The ranks agree on the guess (an
    initialization that reads the model folder is collective)."""
    root = Path(config.checkpoint_dir())
    folder = slots.local_folder(config.checkpoint.local_dir, root)
    held = (
        storage.latest_committed_checkpoint(root) is not None
        or cache.get(slots.run_key(root)) is not None
        or any(slots.HEAD_FILE.match(name) or REPLICA_FILE.match(name) for name in folder_names(folder))
    )
    flag = torch.tensor([int(held)])
    waiting.wait_polled(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
    return bool(flag.item())


def efficiency_pct(blocked_s_total: float, wall_s: float) -> float:
    """AWS's definition: 100 - 100 * (time the loop was blocked by checkpointing) / wall time."""
    return 100.0 - 100.0 * blocked_s_total / wall_s if wall_s > 0 else 100.0
