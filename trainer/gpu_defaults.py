"""What every GPU run gets, whatever launches it (in-pod, PyTorchJob, TrainJob, `rtp train-local`).

One timeout table (`GPU_RESILIENCE`, `GPU_LAUNCHER`) and the environment NVRx's in-process
restart needs on NCCL (`NCCL_ENV`). Which layer catches what on a GPU:

- a hang (no step, no checkpoint progress): the in-process soft timeout aborts the NCCL
  communicators and restarts training in the same processes; a rank that does not react is
  killed at the hard timeout and ft_launcher restarts the worker group. Both are learned from
  the run's step times (trainer/timeouts.py) between a floor of 120 s and a ceiling of 1800 s
  (a 70B step with a large global batch takes minutes; a small model's hang is seen in two);
- the NCCL watchdog (the process group's timeout, 900 s) must outlast the in-process wrapper's
  own hard timeout (twice the floor, what a main thread blocked in one C call meets): when it
  fires it ends the process, which would pre-empt the in-process layer (NVRx's usage guide,
  "Requirements for the execution environment");
- ft_launcher's heartbeat timeouts (1200 s before the first, 900 s after) outlast both, so it
  acts on dead or wedged processes only;
- blocking checkpoint work keeps the watchdog and heartbeats alive for at most
  `blocking_work_limit_s` (an 8B final save to FSx takes minutes; a hung file system does not
  hide forever).

On CPU (gloo) the trainer's own defaults apply (trainer/config_sections.py): a gloo collective cannot
be aborted, so there the collective timeout stays below the hard timeout instead.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

from trainer.config import ConfigError, ResilienceConfig

if TYPE_CHECKING:
    from trainer.launch import LauncherSettings

GPU_RESILIENCE: dict[str, float] = {
    "collective_timeout_s": 900.0,
    "timeout_floor_s": 120.0,
    "timeout_ceiling_s": 1800.0,
    "heartbeat_floor_s": 120.0,
    "blocking_work_limit_s": 3600.0,
    "allreduce_check_mib": 256.0,
}
"""`resilience.*` for GPU runs (a user's override still wins)."""

GPU_LAUNCHER: dict[str, float] = {
    "initial_heartbeat_timeout_s": 1200.0,
    "heartbeat_timeout_s": 900.0,
    "workers_stop_timeout_s": 30.0,
    "monitor_interval_s": 5.0,
}
"""ft_launcher's monitoring for GPU runs (AWS's EKS NVRx test case uses the same heartbeats)."""

NCCL_ENV: dict[str, str] = {
    # NVRx's usage guide asks for it. What it changes (torch's ProcessGroupNCCL.cpp, the
    # watchdog thread's run()): an exception that ends the NCCL watchdog thread's loop (a
    # CUDA error seen while polling a collective's events) is logged and the thread ends,
    # instead of being rethrown in that thread, which terminates the process. A message that
    # begins with "CUDA Error" is rethrown all the same (torch tests `!what.find("CUDA Error")`).
    # It does not touch timed-out or failed collectives: TORCH_NCCL_ASYNC_ERROR_HANDLING (3,
    # SkipCleanUp, by default) still ends the process when the collective timeout fires, which
    # is why that timeout must outlast the in-process hard timeout (check_timeouts). Once the
    # thread has ended, the group's collectives go unwatched until the in-process restart
    # destroys the group.
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    # NVLink SHARP communicators cannot be aborted and re-created in-process: NVRx known issue.
    "NCCL_NVLS_ENABLE": "0",
    # The wrapper's store waits time out by design; torch warns at each one.
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    # Segments that grow instead of new fixed blocks: less fragmentation as activations and
    # evaluation rows vary. Read when CUDA initializes, so set in the pod and the launcher's
    # environment (a rank setting it after torch.cuda.set_device is too late).
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}
"""Environment every GPU rank trains with; a value already set (by the user) is kept."""


def resilience_overrides() -> list[str]:
    """`GPU_RESILIENCE` as `resilience.<field>=value` overrides, to go before a user's own."""
    return [f"resilience.{name}={value:g}" for name, value in GPU_RESILIENCE.items()]


def apply_nccl_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set `NCCL_ENV` where not set yet (before NCCL initializes); returns what was set."""
    environ = os.environ if environ is None else environ
    added = {key: value for key, value in NCCL_ENV.items() if key not in environ}
    environ.update(added)
    return added


def check_timeouts(resilience: ResilienceConfig, device_type: str) -> None:
    """The ordering of the collective timeout against the in-process hard timeout that the
    device's backend needs; fails in one line before training starts."""
    from trainer.timeouts import watchdog_timeouts

    r = resilience
    if not r.inprocess_restarts:
        return
    # What a main thread blocked in one collective meets: the wrapper's own hard timeout.
    _, hard_s = watchdog_timeouts(r)
    hard = (
        "resilience.hard_timeout_s"
        if r.hard_timeout_s != "auto"
        else "resilience.soft_timeout_s + timeout_floor_s"
        if r.soft_timeout_s != "auto"
        else "twice resilience.timeout_floor_s"
    )
    if device_type == "cuda" and r.collective_timeout_s <= hard_s:
        raise ConfigError(
            f"resilience.collective_timeout_s ({r.collective_timeout_s:g}) must exceed "
            f"{hard} ({hard_s:g}) on GPUs: the NCCL watchdog ends the "
            "process when it fires, before the in-process restart can act; "
            f"the GPU default is {GPU_RESILIENCE['collective_timeout_s']:g}"
        )
    if device_type != "cuda" and r.collective_timeout_s >= hard_s:
        raise ConfigError(
            f"resilience.collective_timeout_s ({r.collective_timeout_s:g}) must be below "
            f"{hard} ({hard_s:g}) on CPU: a rank waiting in a gloo "
            "collective on a failed peer is only released by that timeout"
        )


def launcher_settings(max_restarts: int) -> LauncherSettings:
    """ft_launcher's settings for a GPU run with `max_restarts` worker-group restarts."""
    import dataclasses

    from trainer.launch import LauncherSettings

    return dataclasses.replace(LauncherSettings(max_restarts=max_restarts), **GPU_LAUNCHER)  # type: ignore[arg-type]
