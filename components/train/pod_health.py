"""Is a training job stuck? A pure diagnosis of its pods and their events.

The engines only mark a job Failed once a pod has failed often enough; a pod that never
starts leaves the job Running. A Pending master keeps every worker's init container
waiting for its address for the job's whole deadline (24 h by default), and a bad image
name fails nothing at all. `stuck_reason` looks at the job's pods (as the API returns
them, serialized to camelCase dicts) and the events about them, and returns a one-line
reason when waiting longer is pointless:

- a container (or init container) that cannot start: ImagePullBackOff, ErrImagePull,
  InvalidImageName, CreateContainerConfigError — at once;
- a container in CrashLoopBackOff that has restarted more than the job allows
  (`crash_restarts`, the job's backoffLimit) — the engine's own failure message would
  only say that the limit was reached;
- a pod the scheduler cannot place (PodScheduled=False, Unschedulable) for
  `pending_timeout_s`, or at once when the cluster autoscaler says no node group can take
  it (NotTriggerScaleUp); the message is the scheduler's, e.g. "0/4 nodes are available:
  4 Insufficient nvidia.com/gpu";
- a pod whose volumes do not mount: the kubelet's FailedMount (or the attach controller's
  FailedAttachVolume) events for `MOUNT_RETRY_GRACE_S` after the pod was scheduled, or
  containers still being created after `pending_timeout_s` (events may be unreadable or
  expired); the reason names the pod's PVCs and what to check (the claim, the FSx CSI
  driver, the FSx security group);
- an init container still running or waiting after `pending_timeout_s` (a worker whose
  master never came up).

`unhealthy_node` reads the node check's verdict (trainer/health.py exits EXIT_UNHEALTHY_NODE
with its reasons as the termination message) off a pod, so the launcher can move the pod
to another node instead of letting it crash-loop on this one.

Nothing here calls the API; `k8s_launcher` lists pods and events and calls this.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from trainer.health import EXIT_UNHEALTHY_NODE

FATAL_WAITING_REASONS = frozenset(
    {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError"}
)
"""Waiting reasons that no amount of waiting fixes (the image or the pod spec is wrong)."""
CRASH_LOOP = "CrashLoopBackOff"
SCALE_UP_REFUSED = "NotTriggerScaleUp"
"""cluster-autoscaler's event when no node group could run the pod."""
DEFAULT_PENDING_TIMEOUT_S = 900.0
"""How long a pod may stay unschedulable, or an init container wait: a p5 node group
scaling up from zero (launch, bootstrap, device plugins) takes several minutes."""
MOUNT_FAILURE_REASONS = frozenset({"FailedMount", "FailedAttachVolume"})
"""Events about a pod whose volume the kubelet (or the attach/detach controller) cannot mount."""
MOUNT_RETRY_GRACE_S = 300.0
"""How long mount failures may go on before the step gives up: on a node that just joined,
the CSI node plugin may register after the kubelet's first tries, which then fail."""
CREATING_REASONS = frozenset({"ContainerCreating", "PodInitializing"})
"""The kubelet's waiting reasons for a container not yet created (volumes, image pull)."""
FSX_CHECKS = (
    "the PVC is Bound (kubectl get pvc), the FSx CSI driver's node pod runs on that node, and the "
    "FSx security group admits the nodes on TCP 988 and 1018-1023"
)


def _time(text: str | None) -> datetime | None:
    if not text:
        return None
    # The API writes RFC 3339 ("...Z"); the client serializes its datetimes as "...+00:00".
    parsed = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _latest_event_message(events: list[dict[str, Any]], reasons: set[str]) -> str:
    matching = [e for e in events if e.get("reason") in reasons]
    matching.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return " ".join(str(matching[-1].get("message", "")).split()) if matching else ""


def _container_problem(pod_name: str, status: dict[str, Any], crash_restarts: int, init: bool) -> str | None:
    name = status.get("name", "?")
    what = f"{'init ' if init else ''}container {name} of pod {pod_name}"
    waiting = (status.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason", "")
    message = " ".join(str(waiting.get("message", "")).split())
    if reason in FATAL_WAITING_REASONS:
        hint = " (check the image name, its tag and the pull secret)" if "Image" in reason else ""
        if reason == "CreateContainerConfigError" and "secret" in message.lower():
            hint = (
                " (create that secret (mlflow_secret_name), keys tracking_uri, username, password, in the job's "
                "namespace: docs/eks.md, step 6)"
            )
        return f"{what} cannot start: {reason}: {message}{hint}".rstrip(": ")
    restarts = int(status.get("restartCount") or 0)
    if reason == CRASH_LOOP and restarts > crash_restarts:
        last = (status.get("lastState") or {}).get("terminated") or {}
        exit_code = last.get("exitCode", "?")
        detail = " ".join(str(last.get("message") or last.get("reason") or "").split())
        return (
            f"{what} is in CrashLoopBackOff after {restarts} restarts (the job allows {crash_restarts}); "
            f"last exit code {exit_code}{': ' + detail if detail else ''}. See its log: "
            f"kubectl logs {pod_name} -c {name} --previous"
        )
    return None


def _claims(pod: dict[str, Any]) -> list[str]:
    """The PVCs the pod mounts, as 'PVC <name>'."""
    volumes = (pod.get("spec") or {}).get("volumes") or []
    return [
        f"PVC {v['persistentVolumeClaim'].get('claimName', '?')}"
        for v in volumes
        if v.get("persistentVolumeClaim")
    ]


def _scheduled_at(pod: dict[str, Any]) -> datetime | None:
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "True":
            return _time(condition.get("lastTransitionTime"))
    return _time(status.get("startTime")) or _time((pod.get("metadata") or {}).get("creationTimestamp"))


def _mount_failure(events: list[dict[str, Any]]) -> str:
    """The latest mount failure, preferring the one that says why over the kubelet's summary
    ("Unable to attach or mount volumes: ... timed out waiting for the condition")."""
    failures = [e for e in events if e.get("reason") in MOUNT_FAILURE_REASONS]
    specific = [e for e in failures if not str(e.get("message", "")).startswith("Unable to attach or mount")]
    return _latest_event_message(specific or failures, set(MOUNT_FAILURE_REASONS))


def _volume_problem(
    pod: dict[str, Any], events: list[dict[str, Any]], now: datetime, pending_timeout_s: float
) -> str | None:
    """A scheduled pod none of whose containers could be created yet: a volume that does not
    mount (FailedMount events: after the kubelet's retries), or anything else past the timeout."""
    status = pod.get("status") or {}
    if status.get("phase") != "Pending" or not any(
        c.get("type") == "PodScheduled" and c.get("status") == "True" for c in status.get("conditions") or []
    ):
        return None
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    if any(
        ((c.get("state") or {}).get("waiting") or {}).get("reason") not in CREATING_REASONS
        for c in containers
    ):
        return None  # something runs, ran, or waits for another reason (handled above)
    since = _scheduled_at(pod)
    waited = (now - since).total_seconds() if since else 0.0
    name = pod.get("metadata", {}).get("name", "?")
    what = " and ".join(_claims(pod)) or "its volumes"
    failure = _mount_failure(events)
    if failure and waited >= min(MOUNT_RETRY_GRACE_S, pending_timeout_s):
        return f"pod {name} cannot mount {what} after {waited:.0f} s: {failure}. Check that {FSX_CHECKS}"
    if waited >= pending_timeout_s:
        latest = _latest_event_message(events, {str(e.get("reason")) for e in events})
        return (
            f"pod {name} is still creating its containers {waited:.0f} s after it was scheduled"
            f"{': ' + latest if latest else ''}. A volume that does not mount or an image that does not "
            f"pull keeps it there (kubectl describe pod {name}); for {what} check that {FSX_CHECKS}"
        )
    return None


def stuck_reason(
    pod: dict[str, Any],
    events: list[dict[str, Any]],
    *,
    now: datetime,
    pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S,
    crash_restarts: int = 0,
) -> str | None:
    """Why this pod will not get the job anywhere, or None while waiting is still worth it."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    for init, key in ((True, "initContainerStatuses"), (False, "containerStatuses")):
        for container in status.get(key) or []:
            problem = _container_problem(name, container, crash_restarts, init)
            if problem:
                return problem
    if status.get("phase") != "Pending":
        return None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            if condition.get("reason") != "Unschedulable":
                continue
            scheduler = _latest_event_message(events, {"FailedScheduling"}) or " ".join(
                str(condition.get("message", "")).split()
            )
            refused = _latest_event_message(events, {SCALE_UP_REFUSED})
            since = _time(condition.get("lastTransitionTime")) or _time(
                pod["metadata"].get("creationTimestamp")
            )
            waited = (now - since).total_seconds() if since else 0.0
            if refused:
                return f"pod {name} cannot be scheduled and no node group can be added for it: {scheduler} ({refused})"
            if waited >= pending_timeout_s:
                check = (
                    f"Check that {' and '.join(_claims(pod)) or 'its PVC'} exists in the namespace and is Bound"
                    if "PersistentVolumeClaim" in scheduler
                    else "Check the GPU node group (size, taints, labels) against gpu_node_selector, "
                    "gpu_tolerations and the job's requests"
                )
                return f"pod {name} could not be scheduled for {waited:.0f} s: {scheduler}. {check}"
    volume_problem = _volume_problem(pod, events, now, pending_timeout_s)
    if volume_problem:
        return volume_problem
    for container in status.get("initContainerStatuses") or []:
        state = container.get("state") or {}
        started = _time((state.get("running") or {}).get("startedAt")) if "running" in state else None
        if "waiting" in state:
            started = _time(status.get("startTime"))
        if started and (now - started).total_seconds() >= pending_timeout_s:
            return (
                f"init container {container.get('name', '?')} of pod {name} has not finished after "
                f"{(now - started).total_seconds():.0f} s (a worker waits there for the master pod's address: "
                "is the master pod running?)"
            )
    return None


def unhealthy_node(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(node name, the node check's reasons) when a container of the pod last exited with
    EXIT_UNHEALTHY_NODE (running again or not: the kubelet restarts it in place), else None."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        for state in ("state", "lastState"):
            terminated = (container.get(state) or {}).get("terminated") or {}
            if terminated.get("exitCode") == EXIT_UNHEALTHY_NODE:
                reasons = " ".join(str(terminated.get("message") or "no reason given").split())
                return (pod.get("spec") or {}).get("nodeName", ""), reasons
    return None
