"""The two fault-tolerance layers around `trainer.loop.Trainer`, as `python -m trainer` runs it.

Layer 1, in-process restart (NVRx `inprocess.Wrapper`): a soft fault on any rank — an
exception, or a hang the progress watchdog notices — aborts the process group on every
rank and calls the training function again in the same processes. Each call builds its
own process group on a fresh key prefix of one long-lived store, rebuilds model, optimizer
and loader, and resumes from the latest committed checkpoint; nothing distributed
survives a call (the loop abandons its checkpoint writer on the way out).

Layer 2, ft_launcher (NVRx `fault_tolerance`): a rank that dies (SIGKILL, OOM kill) or
stops heart-beating is handled by the launcher, which restarts the whole worker group. The
loop sends a heartbeat after a step, at most one per `HEARTBEAT_INTERVAL_S` (each is a
round trip to the rank monitor process: on a busy machine a wait for it to get a CPU,
every step); the timeouts ft_launcher learns from them are stored in every checkpoint
(never below `resilience.heartbeat_floor_s`) so a restarted group keeps them. The
in-process watchdog is pinged after a step, at most once per `PING_INTERVAL_S`. Blocking
checkpoint work (saves, waits for writes, loads, the end-of-run fingerprint) runs inside
`keepalive()`, whose thread goes on pinging and heart-beating, for a bounded time.

Timeouts: the in-process soft and hard timeouts are learned from step times unless set
(trainer/timeouts.py). NVRx fixes the wrapper's timeouts when it starts, so the wrapper
gets the floor, and after each step a `_ProgressGate` thread goes on pinging it until the
learned timeout less the floor has passed without another step. What ended each attempt is
noted for the restart accounting (trainer/restart_causes.py).

Ports: rank 0 hosts one store server on MASTER_PORT, the port ft_launcher found free for
the workers' store at this restart; the training store and the wrapper's store share it
(multi-tenant, disjoint keys). Ports next to it were never reserved: another process could
hold them (EADDRINUSE, seen on a busy machine).

This module does not use `from __future__ import annotations`: the wrapper finds the
parameter that receives it by its (evaluated) `CallWrapper` annotation.
"""

import contextlib
import datetime
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.inprocess import CallWrapper

from trainer import diagnostics, env, peer_abort
from trainer.checkpointing import CaptureCache
from trainer.config import TrainConfig
from trainer.env import forked_rank
from trainer.faults import record_fatal_error
from trainer.hooks import Abandonable, Attempt, Stateful, StepResult, TrainHooks
from trainer.link_check import SlowInterconnect
from trainer.loop import Trainer
from trainer.restart_causes import RestartCause, cause_of, write_note
from trainer.summary import TrainSummary
from trainer.timeouts import StepTimeouts, watchdog_timeouts

log = logging.getLogger(__name__)

LAST_CALL_WAIT_S = 0.2
MONITOR_PROCESS_INTERVAL_S = 0.25
PROGRESS_WATCHDOG_INTERVAL_S = 1.0

HEARTBEAT_INTERVAL_S = 1.0
"""Least time between two heartbeats to the launcher's rank monitor. Small against what
they are checked with: the learned timeouts are at least `resilience.heartbeat_floor_s`,
the launcher's defaults 60-120 s, and the launcher checks every 0.5 s. Slow steps send one
after every step."""
KEEPALIVE_INTERVAL_S = 0.5
"""How often the keep-alive thread signals progress during blocking checkpoint work."""
PING_INTERVAL_S = 0.5
"""Least time between two progress pings to the in-process wrapper's watchdog (each puts a
message on the monitor process's queue, whose feeder thread and the monitor process then
want the CPU the loop uses). Small against `resilience.soft_timeout_s`: a hang is noticed
at most this much earlier, never later."""
LEARN_AFTER_STEPS = 8
"""The step (of this process) after which ft_launcher's timeouts are learned: a collective,
so every rank does it at the same step."""


class _LauncherClient:
    """ft_launcher's rank-monitor client, or nothing when another launcher runs us."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self.client: Any = None
        self.process_started_at = time.time()
        self.steps_seen = 0
        self.last_beat = -math.inf
        self.timeouts: StepTimeouts | None = None  # the in-process layer's, when learned
        self.lock = threading.Lock()
        if env.under_ft_launcher():
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()

    def connect(self) -> None:
        """Once per process. In-process attempts keep the connection: the rank monitor
        treats a lost connection as the start of a restart, and a second loss before the
        next heartbeat as an abort it never leaves (NVRx 0.4.1's rank-monitor state
        machine), after which it refuses every heartbeat of this rank, even from the
        processes of later worker groups. A heartbeat right away ends the restart."""
        if self.client is None or self.client.is_initialized:
            return
        self.client.init_workload_monitoring()
        self._beat(time.monotonic())

    def _beat(self, now: float) -> None:
        with self.lock:  # the keep-alive thread beats too
            self.client.send_heartbeat()
            self.last_beat = now

    def keepalive_beat(self) -> None:
        """From the keep-alive thread, while the loop blocks on checkpoint work."""
        if self.client is not None and self.client.is_initialized:
            now = time.monotonic()
            if now - self.last_beat >= HEARTBEAT_INTERVAL_S:
                self._beat(now)

    def heartbeat(self) -> None:
        """After every step: a heartbeat if `HEARTBEAT_INTERVAL_S` passed since the last one,
        and always after the process's first step and the step the timeouts are learned at."""
        if self.client is None:
            return
        self.steps_seen += 1
        now = time.monotonic()
        learn = self.steps_seen == LEARN_AFTER_STEPS
        if learn or self.steps_seen == 1 or now - self.last_beat >= HEARTBEAT_INTERVAL_S:
            self._beat(now)
        if learn:  # enough samples of step time to learn from
            with self.lock:
                self.client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
                self._apply_floor()

    def _apply_floor(self) -> None:
        """Under `lock`."""
        state = self.client.state_dict()
        beats = state.get(self.client.CURRENT_TIMEOUTS_STATE_KEY, {}).get("heartbeat")
        if not beats:
            return
        floor_s = self.floor_s
        if self.timeouts is not None and self.timeouts.learning:
            # Learned from the same steps with the same factor: the launcher, which restarts the
            # whole group, must wait out the in-process layer's hard timeout first.
            floor_s = max(floor_s, self.timeouts.hard_s)
        floored = dict(
            beats,
            initial=max(beats["initial"], floor_s),
            subsequent=max(beats["subsequent"], floor_s),
        )
        if floored != beats:
            # load_state_dict is the client's public way to set timeouts on a live connection.
            self.client.load_state_dict({self.client.CURRENT_TIMEOUTS_STATE_KEY: {"heartbeat": floored}})

    def state_dict(self) -> dict[str, Any]:
        if self.client is None or not self.client.is_initialized:
            return {}
        with self.lock:  # one message at a time on the rank monitor's socket (keep-alive beats)
            return dict(self.client.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.client is not None and state:
            # Called on resume, under the keep-alive: a heartbeat sent meanwhile from its thread
            # interleaved with this message on the socket ("invalid load key" in the rank
            # monitor, which then heard nothing more and killed the group 60 s later).
            with self.lock:
                self.client.load_state_dict(state)

    def close(self) -> None:
        if self.client is not None and self.client.is_initialized:
            with self.lock:
                self.client.shutdown_workload_monitoring()


class _Hooks(TrainHooks):
    def __init__(
        self,
        config: TrainConfig,
        launcher: _LauncherClient,
        call_wrapper: Any,
        iteration: int,
        detected_at: float | None,
        cache: CaptureCache | None = None,
        timeouts: StepTimeouts | None = None,
        restart_cause: str = "",
    ) -> None:
        self.config = config
        self.timeouts = timeouts or StepTimeouts(config.resilience)
        self.restart_cause = restart_cause  # what ended the previous attempt, as this rank saw it
        self.progress_at: float | None = None  # monotonic time of the attempt's last step end
        self.kept_alive_until = 0.0  # ...and of the end of its last blocking checkpoint work
        self.gate: _ProgressGate | None = None
        self.cache = cache if cache is not None else CaptureCache()  # the process's, from `_attempts`
        self.launcher = launcher
        self.call_wrapper = call_wrapper
        self.iteration = iteration
        self.detected_at = detected_at
        self.pinged_at: float | None = None
        self._keepalive_depth = 0
        self.checkpoints: list[Abandonable] = []  # started, not yet closed or abandoned
        self.diagnostics = ""  # where the previous attempt's teardown left its diagnostics

    def capture_cache(self) -> CaptureCache:
        return self.cache

    def attempt(self) -> Attempt:
        return Attempt(
            inprocess_iteration=self.iteration,
            launcher_restart=env.launcher_restart(),
            inprocess_enabled=self.call_wrapper is not None,
            launcher="ft_launcher" if self.launcher.client is not None else "other",
            fault_detected_at=self.detected_at,
            process_started_at=self.launcher.process_started_at,
            preforked=forked_rank(),
            diagnostics=self.diagnostics,
            restart_cause=self.restart_cause,
        )

    def on_step_end(self, result: StepResult) -> None:
        now = time.monotonic()
        if self.progress_at is not None:  # an attempt's first step holds its start-up: not timed
            self.timeouts.observe(now - self.progress_at)
        self.progress_at = now
        if self.call_wrapper is not None:
            if self.pinged_at is None or now - self.pinged_at >= PING_INTERVAL_S:
                self.call_wrapper.ping()
                self.pinged_at = now
            if self.gate is None and self.timeouts.learning:
                self.gate = _ProgressGate(self)
        self.launcher.heartbeat()

    def close(self) -> None:
        """The attempt is over: its gate stops pinging (the wrapper's next attempt times its own)."""
        if self.gate is not None:
            self.gate.stop()

    @contextlib.contextmanager
    def keepalive(self) -> Iterator[None]:
        """Blocking work (the model build, a save, a wait for a write, a load, the run's end):
        a thread pings the watchdog and heart-beats meanwhile, for at most
        `resilience.blocking_work_limit_s`. Nested uses share the outermost thread."""
        if self._keepalive_depth:
            self._keepalive_depth += 1
            try:
                yield
            finally:
                self._keepalive_depth -= 1
            return
        self._keepalive_depth = 1
        done = threading.Event()
        thread = threading.Thread(target=self._keep_alive, args=(done,), name="rtp-keepalive", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self._keepalive_depth = 0
            self.kept_alive_until = time.monotonic()  # the gate's clock starts again here

    @property
    def in_keepalive(self) -> bool:
        return self._keepalive_depth > 0

    def _keep_alive(self, done: threading.Event) -> None:
        limit_s = self.config.resilience.blocking_work_limit_s
        deadline = time.monotonic() + limit_s
        while not done.wait(KEEPALIVE_INTERVAL_S):
            now = time.monotonic()
            if now >= deadline:
                log.warning(
                    "blocking work (a model build or checkpoint work) has blocked this rank for %.0f s "
                    "(resilience.blocking_work_limit_s): "
                    "progress signals stop, so the watchdog restarts it if it does not end",
                    limit_s,
                )
                return
            # The watchdog's manual timeout starts at an attempt's first ping: not before it.
            if self.call_wrapper is not None and self.pinged_at is not None:
                self.call_wrapper.ping()
                self.pinged_at = now
            self.launcher.keepalive_beat()

    def checkpoint_states(self) -> dict[str, Stateful]:
        return {"launcher": self.launcher}  # ft_launcher's learned timeouts

    def track(self, work: Abandonable) -> None:
        self.checkpoints.append(work)

    def untrack(self, work: Abandonable) -> None:
        if work in self.checkpoints:
            self.checkpoints.remove(work)

    def abandon_checkpoints(self) -> None:
        """Not collective: abandon the attempt's checkpoint work still live (each untracks itself)."""
        for work in list(self.checkpoints):
            work.abandon()


class _ProgressGate:
    """Keeps NVRx's step watchdog content for the learned soft timeout after each step.

    NVRx 0.4.1 gives the wrapper's monitor process its soft timeout once, when the wrapper
    is first called, and has no call to change it (`inprocess.wrap.CallWrapper.__init__`).
    With `resilience.soft_timeout_s=auto` the wrapper gets the floor (`watchdog_timeouts`),
    and this thread pings it (the public `CallWrapper.ping`) until the learned timeout less
    the floor has passed since the attempt's last step end (or checkpoint work's end): the
    watchdog then sees no progress for the learned timeout (within one ping interval) and
    restarts the rank. Checkpoint work pings through `keepalive()` meanwhile. One per attempt, from its first step end on (the
    wrapper's step watchdog starts at the first ping)."""

    def __init__(self, hooks: _Hooks) -> None:
        self.hooks = hooks
        self.floor_s, _ = watchdog_timeouts(hooks.config.resilience)
        self.interval_s = max(PING_INTERVAL_S, self.floor_s / 10)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rtp-progress-gate", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        hooks, warned_for = self.hooks, None
        while not self.stopped.wait(self.interval_s):
            if hooks.call_wrapper.iteration != hooks.iteration:
                return  # the wrapper restarted: a later attempt's steps are not this gate's
            if hooks.in_keepalive or hooks.progress_at is None:
                continue  # checkpoint work pings for itself
            progress_at = max(hooks.progress_at, hooks.kept_alive_until)
            now = time.monotonic()
            soft_s = hooks.timeouts.soft_s
            if now - progress_at < soft_s - self.floor_s:
                hooks.call_wrapper.ping()
                hooks.pinged_at = now
            elif warned_for != progress_at and now - progress_at >= self.floor_s / 2:
                warned_for = progress_at
                log.warning(
                    "rank %d: no step for %.0f s; the in-process watchdog takes it for hung after %.0f s "
                    "(resilience.soft_timeout_s: auto, learned from step times)",
                    env.rank(), now - progress_at, soft_s,
                )  # fmt: skip


def _wait_until_listening(port: int, timeout_s: float = 60.0) -> None:
    """On ranks other than 0: return once rank 0's store at MASTER_ADDR:`port` accepts
    connections (or after `timeout_s`; the store's own timeout then applies). A store client
    that connects before the server listens retries after a back-off of its own, which a
    restarted group would wait at each of rank 0's two stores; polling costs nothing."""
    if env.rank() == 0:
        return
    host = env.master_addr()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.01)


def _app_store(config: TrainConfig) -> dist.TCPStore:
    """One store for every attempt's process group; each attempt uses its own key prefix.
    Multi-tenant: the wrapper's store in this process joins the same server."""
    _wait_until_listening(env.master_port())
    return dist.TCPStore(
        host_name=env.master_addr(),
        port=env.master_port(),
        world_size=env.world_size(),
        is_master=env.rank() == 0,
        multi_tenant=True,
        wait_for_workers=True,
        timeout=datetime.timedelta(seconds=max(60.0, config.resilience.collective_timeout_s)),
    )


def _fatal_errors() -> tuple[type[BaseException], ...]:
    """Errors that recur identically after any restart: retrying them only burns time."""
    from trainer.checkpointing import CheckpointError
    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.faults import FaultSpecError

    return (DataError, ConfigError, CheckpointError, FaultSpecError, FloatingPointError)


@contextlib.contextmanager
def fault_tolerance(
    config: TrainConfig, process_started_at: float | None = None
) -> Iterator[Callable[[], TrainSummary | None]]:
    """This process's side of both layers, for the time of the block; yields the call that
    trains to the end through them and returns rank 0's summary (others: their view).

    An error no restart can fix (`_fatal_errors`) is recorded in the workdir and ends the
    in-process layer at once; worker groups the launcher restarts afterwards stop before
    importing anything (trainer/__main__.py), so the run fails fast with its message."""
    launcher = _LauncherClient(config.resilience.heartbeat_floor_s)
    launcher.process_started_at = process_started_at or time.time()
    store = _app_store(config)
    launcher.connect()
    try:
        yield _attempts(config, store, launcher)
    except Exception as exc:
        if config.resilience.inprocess_restarts == 0:  # else the wrapper's teardown noted it
            at = time.time()
            restart = env.launcher_restart()
            write_note(
                config.run.workdir,
                cause_of(exc, env.rank()),
                launcher_restart=restart,
                iteration=0,
                rank=env.rank(),
                at=at,
            )
        raise
    finally:
        launcher.close()


def _attempts(
    config: TrainConfig, store: dist.Store, launcher: _LauncherClient
) -> Callable[[], TrainSummary | None]:
    """One attempt (`resilience.inprocess_restarts` = 0) or NVRx's wrapper restarting it;
    an attempt is a `Trainer` on a fresh key prefix of `store`."""
    restarts = _Restarts()
    cache = CaptureCache()  # the fast tier's copy in memory outlives each attempt
    # What was learned of step times outlives each attempt too (and the process: timeouts.json).
    timeouts = StepTimeouts(config.resilience, config.run.workdir, write=env.rank() == 0)
    launcher.timeouts = timeouts

    def attempt(call_wrapper: CallWrapper | None = None) -> TrainSummary:
        if call_wrapper is not None and call_wrapper.iteration > 0:
            log.warning(
                "in-process restart %d: resuming from the latest committed checkpoint", call_wrapper.iteration
            )
        iteration = call_wrapper.iteration if call_wrapper is not None else 0
        previous, restarts.cause = restarts.cause, None
        hooks = _Hooks(
            config, launcher, call_wrapper, iteration, restarts.detected_at.pop("at", None), cache,
            timeouts, previous.describe() if previous is not None else "",
        )  # fmt: skip
        hooks.diagnostics, restarts.diagnostics = restarts.diagnostics, ""
        restarts.attempts.append(hooks)
        try:
            with Trainer(
                config, store=dist.PrefixStore(f"attempt{iteration}", store), hooks=hooks
            ) as trainer:
                return trainer.train()
        except BaseException as exc:
            # Noted only (the wrapper may interrupt again); the teardown writes it down.
            restarts.cause = cause_of(exc, env.rank(), hooks.timeouts.soft_s)
            raise
        finally:
            hooks.close()

    def guarded(call_wrapper: CallWrapper | None = None) -> TrainSummary:
        try:
            return attempt(call_wrapper)
        except _fatal_errors() as exc:
            message = record_fatal_error(config.run.workdir, exc)
            if call_wrapper is not None:
                from nvidia_resiliency_ext.inprocess.exception import RestartAbort

                # RestartAbort (a BaseException) is how the wrapper is told to stop restarting.
                raise RestartAbort(message) from exc
            raise
        except SlowInterconnect as exc:  # the same links in every in-process attempt
            if call_wrapper is not None:
                from nvidia_resiliency_ext.inprocess.exception import RestartAbort

                raise RestartAbort(str(exc)) from exc
            raise
        except Exception:
            # Where it was raised (NVRx logs only the message); the wrapper then restarts.
            iteration = call_wrapper.iteration if call_wrapper is not None else 0
            log.warning("attempt %d on rank %d ended with an error", iteration, env.rank(), exc_info=True)
            raise

    if config.resilience.inprocess_restarts == 0:
        return guarded
    return cast(Callable[[], TrainSummary | None], _wrapper(config, restarts)(guarded))  # None: a spare rank


class _Restarts:
    """What one attempt leaves for the next: when the fault was detected, and the hooks
    whose checkpoint work a restart may still have to abandon."""

    def __init__(self) -> None:
        self.detected_at: dict[str, float] = {}
        self.diagnostics = ""  # the folder the last teardown's stacks and collectives went to
        self.attempts: list[_Hooks] = []
        self.cause: RestartCause | None = None  # what ended the last attempt, as this rank saw it


def _wrapper(config: TrainConfig, restarts: _Restarts) -> Any:
    from nvidia_resiliency_ext import inprocess

    r = config.resilience
    soft_s, hard_s = watchdog_timeouts(r)

    class _AbortPeers(inprocess.abort.Abort):
        """NVRx's abort (destroys the process groups; aborts NCCL communicators) preceded by
        shutting down this attempt's gloo connections, which a gloo collective cannot be
        aborted without: the ranks that wait on the failed one leave their collective at
        once instead of after `collective_timeout_s` (trainer/peer_abort.py)."""

        def __call__(self, state: Any) -> Any:
            # Where each thread was, then (peers released) the collectives, before the groups go.
            folder = diagnostics.diagnostics_dir(
                config.run.workdir, f"restart{env.launcher_restart()}-attempt{state.iteration}"
            )
            wrote = diagnostics.dump_stacks(folder, env.rank())
            peer_abort.shutdown_tracked()
            if env.rank() == 0:
                diagnostics.prune(folder)
            if diagnostics.dump_flight_recorder(folder, env.rank()) or wrote:
                restarts.diagnostics = str(folder)
            return inprocess.abort.AbortTorchDistributed()(state)

    class _RecordRestart(inprocess.finalize.Finalize):
        """Runs once the wrapper has torn the failed attempt down: releases the async
        checkpoint writer and its pending saves, and notes the time (for goodput).

        A plain Finalize: NVRx's ThreadedFinalize needs CUDA."""

        def __call__(self, state: Any) -> Any:
            restarts.detected_at["at"] = time.time()
            if restarts.cause is None:  # interrupted before the attempt could note why
                restarts.cause = cause_of(state.fn_exception, env.rank())
            write_note(
                config.run.workdir,
                restarts.cause,
                launcher_restart=env.launcher_restart(),
                iteration=state.iteration,
                rank=env.rank(),
                at=restarts.detected_at["at"],
            )
            for hooks in list(restarts.attempts):
                hooks.close()  # again: the attempt's own abandon may have been cut short
                hooks.abandon_checkpoints()
                if not hooks.checkpoints:
                    restarts.attempts.remove(hooks)
            return state

    return inprocess.Wrapper(
        # The training store's server (already listening): its keys and the wrapper's differ.
        store_kwargs={"port": env.master_port(), "multi_tenant": True},
        # A rank that died (SIGKILL, OOM) is the launcher's to handle: never go on with a
        # smaller world; give up so ft_launcher restarts the whole group.
        initialize=inprocess.initialize.RetryController(
            max_iterations=r.inprocess_restarts + 1, min_world_size=env.world_size()
        ),
        abort=_AbortPeers(),
        finalize=_RecordRestart(),
        # After an abort, a rank whose CUDA context is broken (a sticky error) leaves instead of
        # burning every in-process attempt; the launcher then restarts the group.
        health_check=inprocess.health_check.CudaHealthCheck() if torch.cuda.is_available() else None,
        # Fixed for the process (NVRx 0.4.1); a learned timeout is applied by `_ProgressGate`.
        soft_timeout=datetime.timedelta(seconds=soft_s),
        hard_timeout=datetime.timedelta(seconds=hard_s),
        heartbeat_timeout=datetime.timedelta(seconds=max(30.0, hard_s)),
        barrier_timeout=datetime.timedelta(seconds=max(120.0, 2 * hard_s + 10)),
        completion_timeout=datetime.timedelta(seconds=max(120.0, 2 * hard_s + 10)),
        termination_grace_time=datetime.timedelta(seconds=2),
        # How long a rank's monitor thread waits for concurrent fault reports before it
        # aborts (NVRx's default: 1 s). With fast peer abort a restart on CPU takes about a
        # second, so the default would be most of it.
        last_call_wait=datetime.timedelta(seconds=LAST_CALL_WAIT_S),
        # NVRx 0.4.1's monitor process checks the soft and hard timeouts only when no
        # message arrived for a whole monitor interval, and the progress watchdog sends one
        # every watchdog interval: with both at 1 s (the defaults) the checks starve at
        # random: a hang is noticed seconds late or only at the hard timeout, and the rank
        # is killed and restarted by ft_launcher instead of in-process. A shorter
        # monitor interval leaves a silent gap after every watchdog message.
        monitor_process_interval=datetime.timedelta(seconds=MONITOR_PROCESS_INTERVAL_S),
        progress_watchdog_interval=datetime.timedelta(seconds=PROGRESS_WATCHDOG_INTERVAL_S),
    )
