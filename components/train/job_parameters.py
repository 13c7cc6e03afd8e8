"""The training job's run parameters, declared once.

Each `JobParameter` is one parameter of the pipeline and of the train step that only the
training job reads: its name, type, default, description and the `train_with_job` keyword
it sets (a `JobSettings` field, or the watch's `timeout_s`/`pending_timeout_s`). From this
table come the pipeline's signature and docstring for them (`with_job_parameters`), the
train step's docstring, `rtp render-job`'s flags, and the one conversion into keywords
(`job_keywords`), where "unset" has one spelling: the interface's `auto` (a string) or -1
(a number; KFP parameters are typed) becomes None, which `JobSettings.resolved` fills from
the GPU count (`job_scale`). The train step's own signature is the one literal copy KFP
needs (it ships the function's source to the pod); a unit test checks it against this table.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from components.train.job_scale import AUTO, AUTO_COUNT
from components.train.jobs import DEFAULT_TRAINING_RUNTIME
from components.train.pod_health import DEFAULT_PENDING_TIMEOUT_S

DEFAULT_GPU_INSTANCE_TYPE = "p5.48xlarge"


@dataclass(frozen=True)
class JobParameter:
    name: str
    """The pipeline's and the train step's parameter."""
    keyword: str
    """The `train_with_job` keyword it sets: a JobSettings field unless it is the watch's."""
    kind: type
    default: Any
    """In the interface's spelling: AUTO or AUTO_COUNT for a value taken from the GPU count."""
    help: str
    render_flag: bool = True
    """Also an `rtp render-job` flag (`--<keyword>`): only the manifest's settings are."""

    @property
    def flag(self) -> str:
        return "--" + self.keyword.replace("_", "-")

    def value(self, given: Any) -> Any:
        """What `train_with_job` gets for the parameter's value: None for unset."""
        return None if self.default in (AUTO, AUTO_COUNT) and given in (AUTO, AUTO_COUNT) else given


JOB_PARAMETERS: tuple[JobParameter, ...] = (
    JobParameter(
        "nnodes", "nnodes", int, 1, "Nodes (pods) of a pytorchjob or trainjob, each running nproc processes."
    ),
    JobParameter(
        "gpus_per_node",
        "gpus_per_node",
        int,
        0,
        "GPUs each pytorchjob/trainjob pod requests; 0 trains on CPU.",
    ),
    JobParameter(
        "efa_per_node",
        "efa_per_node",
        int,
        0,
        "EFA interfaces (vpc.amazonaws.com/efa) each job pod requests; 0 for none.",
    ),
    JobParameter(
        "job_namespace",
        "namespace",
        str,
        "",
        "Namespace of the training job; empty is the pipeline's namespace.",
        render_flag=False,
    ),
    JobParameter(
        "training_runtime",
        "training_runtime",
        str,
        DEFAULT_TRAINING_RUNTIME,
        "ClusterTrainingRuntime a trainjob runs on.",
    ),
    JobParameter(
        "job_timeout_s",
        "timeout_s",
        int,
        86400,
        "Seconds after which the training job is deleted and the step fails.",
        render_flag=False,
    ),
    JobParameter(
        "instance_type",
        "instance_type",
        str,
        DEFAULT_GPU_INSTANCE_TYPE,
        "EC2 instance type of the training job's nodes (match gpu_node_selector); with EFA it decides whether "
        "GPUDirect RDMA is on (p4d, p4de, p5, p5e, p5en).",
    ),
    JobParameter(
        "job_cpu_per_node",
        "cpu_per_node",
        str,
        AUTO,
        "CPU request of each training job pod; auto = a share of a p5.48xlarge (22.5 per GPU: 180 for 8 GPUs), "
        "none on CPU; empty = none.",
    ),
    JobParameter(
        "job_memory_per_node",
        "memory_per_node",
        str,
        AUTO,
        "Memory request of each training job pod; auto = 225Gi per GPU (1800Gi for 8), none on CPU; empty = none.",
    ),
    JobParameter(
        "job_shm_size",
        "shm_size",
        str,
        AUTO,
        "Size limit of each training job pod's /dev/shm; auto = 40Gi per GPU (320Gi for 8), unbounded on CPU.",
    ),
    JobParameter(
        "job_queue_name",
        "queue_name",
        str,
        "",
        "Kueue LocalQueue of the training job (label kueue.x-k8s.io/queue-name): Kueue admits all of its pods "
        "at once, when the queue's quota has room, so a job never holds some nodes while waiting for the rest; "
        "empty = no queue (docs/eks.md, Gang scheduling).",
    ),
    JobParameter(
        "job_priority_class",
        "priority_class",
        str,
        "",
        "PriorityClass of a pytorchjob's pods (priorityClassName; also the gang scheduler's priority): with "
        "preemption on, a job of a higher class takes nodes from lower-priority pods; empty = the cluster's "
        "default. A trainjob takes its runtime's.",
    ),
    JobParameter(
        "job_max_restarts",
        "max_restarts",
        int,
        AUTO_COUNT,
        "ft_launcher worker-group restarts in each job pod; -1 = by GPU count (10 on GPUs, 3 on CPU).",
    ),
    JobParameter(
        "job_backoff_limit",
        "backoff_limit",
        int,
        AUTO_COUNT,
        "Pod restarts before a PyTorchJob is Failed (a trainjob: the crash-loop restarts the train step tolerates "
        "before deleting it); -1 = by GPU count (10 on GPUs, 2 on CPU).",
    ),
    JobParameter(
        "job_termination_grace_s",
        "termination_grace_s",
        int,
        AUTO_COUNT,
        "Seconds a job pod gets after SIGTERM for its final checkpoint (ft_launcher waits 60 s less); -1 = by GPU "
        "count (600 on GPUs, 90 on CPU).",
    ),
    JobParameter(
        "job_pending_timeout_s",
        "pending_timeout_s",
        int,
        int(DEFAULT_PENDING_TIMEOUT_S),
        "The train step fails when a job pod stays unschedulable, still creating its containers, or an init "
        "container waits, this many seconds (a volume that keeps failing to mount fails it sooner).",
        render_flag=False,
    ),
)
JOB_PARAMETER_NAMES = tuple(p.name for p in JOB_PARAMETERS)


def job_keywords(values: Mapping[str, Any]) -> dict[str, Any]:
    """The `train_with_job` keywords for the job parameters in `values` (by parameter name)."""
    return {p.keyword: p.value(values[p.name]) for p in JOB_PARAMETERS}


def with_job_docs(doc: str) -> str:
    """`doc`, a Google-style docstring, with the job parameters' lines at the end of its Args."""
    head, marker, rest = doc.partition("Args:\n")
    assert marker, "the docstring has no Args section"
    args, blank, tail = rest.partition("\n\n")
    indent = args[: len(args) - len(args.lstrip())]
    lines = "".join(f"\n{indent}{p.name}: {p.help}" for p in JOB_PARAMETERS)
    return (
        f"{head}{marker}{args.rstrip()}{lines}{blank}{tail}"
        if blank
        else f"{head}{marker}{args.rstrip()}{lines}\n"
    )


def add_render_flags(parser: argparse.ArgumentParser) -> None:
    """The job parameters that shape the manifest, as `rtp render-job` flags."""
    for p in JOB_PARAMETERS:
        if p.render_flag:
            parser.add_argument(
                p.flag, type=p.kind, default=p.default, help=f"{p.help} (default: %(default)s)"
            )


def render_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The `train_with_job` keywords `rtp render-job`'s flags set."""
    return {p.keyword: p.value(getattr(args, p.keyword)) for p in JOB_PARAMETERS if p.render_flag}


def with_job_parameters(pipeline: Callable[..., Any]) -> Callable[..., Any]:
    """`pipeline(general parameters..., **job)` as KFP reads a pipeline: every job parameter
    a named, typed parameter with its default, described in the docstring's Args."""
    own = [p for p in inspect.signature(pipeline).parameters.values() if p.kind is not p.VAR_KEYWORD]
    job = [
        inspect.Parameter(
            p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=p.default, annotation=p.kind
        )
        for p in JOB_PARAMETERS
    ]
    names = [p.name for p in own]

    def compiled(*values: Any) -> Any:  # KFP passes every parameter, in signature order
        given = dict(zip([*names, *JOB_PARAMETER_NAMES], values, strict=True))
        return pipeline(**{n: given[n] for n in names}, **{n: given[n] for n in JOB_PARAMETER_NAMES})

    compiled.__doc__ = with_job_docs(pipeline.__doc__ or "")
    compiled.__signature__ = inspect.Signature([*own, *job], return_annotation=None)  # type: ignore[attr-defined]
    compiled.__name__ = pipeline.__name__
    compiled.__qualname__ = pipeline.__qualname__
    compiled.__module__ = pipeline.__module__
    return compiled
