"""Timeouts, restart budgets and pod sizes of a training job, chosen in one place by GPU count.

The trainer's resilience defaults (trainer/config_sections.py) are tuned for gloo on a shared CPU:
15 s collectives, in-process timeouts learned from step times between 20 s and 600 s. On GPUs
those turn an FSx stall or a slow NCCL start into abort-and-restart loops, and the few restarts
of a CPU run are spent on noise. `job_scale(gpus_per_node)` is the one table a job's
values come from: the CPU table keeps today's values, the GPU table holds the values
below, each with where it comes from (docs/eks.md repeats them). Every value can be
overridden: the trainer's through `overrides` (`resilience.soft_timeout_s=...`, applied
after `trainer_overrides`), the job's
through its pipeline parameter or `rtp render-job` flag. Pure; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ResilienceConfig
from trainer.gpu_defaults import GPU_RESILIENCE, resilience_overrides

AUTO = "auto"
"""A resource parameter's default: take the value from `job_scale` (a p5 share on GPUs)."""
AUTO_COUNT = -1
"""An integer parameter's default (max_restarts, backoff_limit): take the value from `job_scale`."""


@dataclass(frozen=True, slots=True)
class JobScale:
    """The values one job gets from its GPU count (see the module docstring)."""

    collective_timeout_s: float
    soft_timeout_s: float | str
    """Seconds, or auto: learned from the run's step times (trainer/timeouts.py)."""
    hard_timeout_s: float | str
    heartbeat_floor_s: float
    max_restarts: int
    """ft_launcher worker-group restarts inside each pod."""
    backoff_limit: int
    """Pod restarts the engine allows before the job is Failed (PyTorchJob runPolicy)."""
    termination_grace_s: int
    """The pods' terminationGracePeriodSeconds: time for the final checkpoint after SIGTERM
    (ft_launcher's --term-timeout is 60 s less: JobSettings.term_timeout_s)."""
    cpu_per_gpu: float = 0.0
    memory_gib_per_gpu: int = 0
    shm_gib_per_gpu: int = 0

    def resources(self, gpus_per_node: int) -> tuple[str, str, str]:
        """(cpu, memory, shm size) per pod, or empty strings where the table has none."""
        if not gpus_per_node or not self.cpu_per_gpu:
            return "", "", ""
        millicores = round(self.cpu_per_gpu * gpus_per_node * 1000)
        cpu = str(millicores // 1000) if millicores % 1000 == 0 else f"{millicores}m"
        return (
            cpu,
            f"{self.memory_gib_per_gpu * gpus_per_node}Gi",
            f"{self.shm_gib_per_gpu * gpus_per_node}Gi",
        )


_CPU_TRAINER = ResilienceConfig()
CPU_SCALE = JobScale(
    # The trainer's own defaults: tuned for gloo on a small, busy CPU machine (trainer/config_sections.py).
    collective_timeout_s=_CPU_TRAINER.collective_timeout_s,
    soft_timeout_s=_CPU_TRAINER.soft_timeout_s,
    hard_timeout_s=_CPU_TRAINER.hard_timeout_s,
    heartbeat_floor_s=_CPU_TRAINER.heartbeat_floor_s,
    max_restarts=3,
    backoff_limit=2,
    # A CPU checkpoint of the presets is written in seconds; 60 s more than Kubernetes' 30 s default.
    termination_grace_s=90,
)
GPU_SCALE = JobScale(
    # The trainer's GPU timeout table, the same for in-pod runs (trainer/gpu_defaults.py says
    # which layer catches a hang and why the NCCL watchdog outlasts the hard timeout).
    collective_timeout_s=GPU_RESILIENCE["collective_timeout_s"],
    # Learned from step times, between GPU_RESILIENCE's floor and ceiling.
    soft_timeout_s=_CPU_TRAINER.soft_timeout_s,
    hard_timeout_s=_CPU_TRAINER.hard_timeout_s,
    heartbeat_floor_s=GPU_RESILIENCE["heartbeat_floor_s"],
    # A multi-day run on dozens of GPUs sees several Xid errors, NCCL timeouts and node
    # replacements; each restart resumes from the last committed checkpoint.
    max_restarts=10,
    # A drained or reclaimed pod exits non-zero after its final save (see trainer/__main__.py),
    # and survivors whose rendezvous host went away restart too; each counts here.
    backoff_limit=10,
    # The final save after SIGTERM: an 8B-class model with AdamW state is ~130 GB across the
    # job, about 7 minutes to a PERSISTENT_2 FSx of 1.2 TiB at 250 MB/s/TiB (docs/eks.md).
    # EC2 Spot gives 2 minutes whatever is set here; a node drain honours it.
    termination_grace_s=600,
    # p5.48xlarge: 8 H100, 192 vCPU, 2048 GiB; leave 12 vCPU and ~250 GiB to the system
    # and daemon sets (180 CPU, 1800Gi per 8 GPUs). /dev/shm holds the fast tier's two slots,
    # which async saves write from, 2x a rank's state shard (12 B/parameter / GPUs): 8B on one
    # node or gpu-1b on one GPU needs ~23 GiB per GPU, plus loader buffers (docs/checkpointing.md).
    cpu_per_gpu=22.5,
    memory_gib_per_gpu=225,
    shm_gib_per_gpu=40,
)


def job_scale(gpus_per_node: int) -> JobScale:
    """The table for a job with `gpus_per_node` GPUs per pod (0: a CPU job)."""
    return GPU_SCALE if gpus_per_node > 0 else CPU_SCALE


def trainer_overrides(gpus_per_node: int) -> list[str]:
    """The trainer's GPU timeout table as `resilience.<field>=value` overrides, to go before
    the user's own (a later override wins, so a user's value is kept). None on CPU: CPU jobs
    train with the trainer's own defaults."""
    return resilience_overrides() if gpus_per_node > 0 else []
