"""`python -m trainer.health [checks] -- COMMAND...`: check this node, then run COMMAND.

A job's pod runs it in front of ft_launcher, so a node that cannot train is caught before
any rank starts (and again whenever the container restarts, after a fault): its GPUs, the
fast tier's folder, the shared volume and its EFA devices. An unhealthy node exits with
EXIT_UNHEALTHY_NODE and one line per failed check, writes the report to
`<workdir>/node-health/<host>.json` and to the pod's termination message; a healthy one
replaces itself with COMMAND (exec: same pid, the kubelet's signals reach the launcher).

The workdir and fast-tier folder come from COMMAND's `--config=` (the trainer's inline
config, as job pods get it); without one those two checks are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EXIT_UNHEALTHY_NODE = 3
"""Distinct from a user error (2) and a SIGTERM stop (143): this node, not the run, is at fault."""

TERMINATION_LOG = Path("/dev/termination-log")
"""Kubernetes' default terminationMessagePath: its text shows in the pod's status."""

PROBE_BYTES = 1 << 20


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


def _timed(name: str, probe: Callable[[], tuple[bool, str]]) -> Check:
    started = time.monotonic()
    try:
        ok, detail = probe()
    except Exception as exc:  # a probe that raised failed: the node cannot do this
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    return Check(name, ok, detail, round(time.monotonic() - started, 3))


def volume_writable(folder: Path, limit_s: float) -> Check:
    """The shared volume takes a 1 MiB write, fsync and read back within `limit_s`."""

    def probe() -> tuple[bool, str]:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f".health-{socket.gethostname()}-{os.getpid()}"
        payload = os.urandom(PROBE_BYTES)
        started = time.monotonic()
        try:
            with path.open("wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            same = path.read_bytes() == payload
        finally:
            path.unlink(missing_ok=True)
        took = time.monotonic() - started
        if not same:
            return False, f"{folder}: a 1 MiB file read back different bytes"
        if took > limit_s:
            return False, f"{folder}: a 1 MiB write, fsync and read took {took:.2f} s (limit {limit_s:g} s)"
        return True, f"{folder}: 1 MiB written, synced and read back in {took:.3f} s"

    return _timed("volume", probe)


def fast_tier_room(folder: Path, min_free_gib: float) -> Check:
    """The fast tier's node-local folder is writable and has `min_free_gib` free."""

    def probe() -> tuple[bool, str]:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f".health-{os.getpid()}"
        path.write_bytes(b"\0" * 4096)
        path.unlink()
        stats = os.statvfs(folder)
        free_gib = stats.f_bavail * stats.f_frsize / 2**30
        if free_gib < min_free_gib:
            return False, (
                f"{folder}: {free_gib:.2f} GiB free, {min_free_gib:g} GiB needed "
                "(give the pod a larger /dev/shm, or set checkpoint.local_dir)"
            )
        return True, f"{folder}: writable, {free_gib:.2f} GiB free"

    return _timed("fast_tier", probe)


def efa_devices(expected: int, sysfs: Path = Path("/sys/class/infiniband")) -> Check:
    """At least `expected` EFA devices (`rdmap*` under /sys/class/infiniband)."""

    def probe() -> tuple[bool, str]:
        found = sorted(p.name for p in sysfs.glob("*")) if sysfs.is_dir() else []
        if len(found) < expected:
            return (
                False,
                f"{len(found)} EFA devices under {sysfs} ({', '.join(found) or 'none'}), {expected} expected",
            )
        return True, f"{len(found)} EFA devices: {', '.join(found)}"

    return _timed("efa", probe)


def gpus_compute(
    expected: int,
    visible: Callable[[], int] | None = None,
    matmul_on: Callable[[int, Any, Any], Any] | None = None,
) -> Check:
    """`expected` visible GPUs, each computing a small matmul equal to the host's result
    (`visible` and `matmul_on` default to CUDA's; tests pass stand-ins)."""

    def probe() -> tuple[bool, str]:
        import torch

        count = (visible or _visible_gpus)()
        if count < expected:
            return (
                False,
                f"{count} GPUs visible, {expected} expected (CUDA_VISIBLE_DEVICES, the device plugin)",
            )
        generator = torch.Generator().manual_seed(0)
        a, b = torch.randn(64, 64, generator=generator), torch.randn(64, 64, generator=generator)
        reference = a @ b
        for index in range(expected):
            result = (matmul_on or _matmul_on)(index, a, b)
            if not torch.allclose(result, reference, rtol=1e-2, atol=1e-2):
                error = float((result - reference).abs().max())
                return False, f"GPU {index} computed a wrong matmul (largest error {error:.3g})"
        return True, f"{count} GPUs visible, a matmul on each of {expected} matches the host's"

    return _timed("gpus", probe)


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _matmul_on(index: int, a: Any, b: Any) -> Any:
    import torch

    device = torch.device("cuda", index)
    result = (a.to(device) @ b.to(device)).cpu()
    torch.cuda.synchronize(device)
    return result


def _nvml(nvml: Any) -> Any:
    """`nvml` (a test's stand-in) or the `pynvml` module; None where it is not installed."""
    if nvml is not None:
        return nvml
    try:
        import warnings

        with warnings.catch_warnings():  # the pynvml shim's deprecation notice
            warnings.simplefilter("ignore", FutureWarning)
            import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    return pynvml


def gpu_memory_errors(expected: int, nvml: Any = None) -> Check:
    """No GPU reports uncorrected (volatile) ECC errors or a failed or pending row remapping,
    read through NVML (`pynvml`) where it is installed; skipped, and passing, where it is not."""

    def probe() -> tuple[bool, str]:
        module = _nvml(nvml)
        if module is None:
            return True, "skipped: pynvml is not installed"
        module.nvmlInit()
        try:
            bad = []
            for index in range(expected):
                handle = module.nvmlDeviceGetHandleByIndex(index)
                try:
                    errors = module.nvmlDeviceGetTotalEccErrors(
                        handle, module.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, module.NVML_VOLATILE_ECC
                    )
                except module.NVMLError:  # ECC off or not supported on this GPU
                    errors = 0
                if errors:
                    bad.append(f"GPU {index}: {errors} uncorrected ECC errors")
                try:  # Ampere and later replace bad memory rows; before that, NotSupported
                    _, _, pending, failed = module.nvmlDeviceGetRemappedRows(handle)
                except module.NVMLError:
                    continue
                if failed:
                    bad.append(f"GPU {index}: a memory row remapping failed (the GPU needs replacing)")
                elif pending:
                    bad.append(f"GPU {index}: a memory row remapping is pending (the GPU needs a reset)")
        finally:
            module.nvmlShutdown()
        if bad:
            return False, "; ".join(bad)
        return True, f"no uncorrected ECC errors or row remapping faults on {expected} GPUs"

    return _timed("gpu_memory", probe)


class XidWatch:
    """Critical Xid events (NVML's XidCriticalError: a GPU fault the driver logged) raised on
    the GPUs while the `with` block runs, e.g. the compute check's kernels. NVML only reports
    events that happen after registering, so past Xids stay in the kernel log.

    `check` holds the result once the block has ended."""

    def __init__(self, expected: int, nvml: Any = None, drain_ms: int = 200) -> None:
        self.expected, self.drain_ms = expected, drain_ms
        self.module = _nvml(nvml)
        self.event_set: Any = None
        self.watched: list[int] = []
        self.started = 0.0
        self.check = Check("gpu_xid", True, "not run")

    def __enter__(self) -> XidWatch:
        self.started = time.monotonic()
        if self.module is None:
            return self
        try:
            self.module.nvmlInit()
            self.event_set = self.module.nvmlEventSetCreate()
            for index in range(self.expected):
                handle = self.module.nvmlDeviceGetHandleByIndex(index)
                try:
                    self.module.nvmlDeviceRegisterEvents(
                        handle, self.module.nvmlEventTypeXidCriticalError, self.event_set
                    )
                    self.watched.append(index)
                except self.module.NVMLError:  # this GPU cannot report Xid events
                    continue
        except Exception as exc:  # NVML unusable: the other GPU checks say why
            self.check = Check(
                "gpu_xid", True, f"skipped: NVML events unavailable ({type(exc).__name__}: {exc})"
            )
            self._close()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.module is None:
            self.check = Check("gpu_xid", True, "skipped: pynvml is not installed")
            return
        if self.event_set is None:
            return
        raised = []
        try:
            while True:  # every event queued during the block, then none for drain_ms
                try:
                    event = self.module.nvmlEventSetWait_v2(self.event_set, self.drain_ms)
                except self.module.NVMLError:  # NVML_ERROR_TIMEOUT: no further event
                    break
                raised.append(f"Xid {event.eventData} on {self._gpu_of(event.device)}")
        finally:
            self._close()
        seconds = round(time.monotonic() - self.started, 3)
        if raised:
            detail = "; ".join(raised) + " (a GPU fault: see NVIDIA's Xid catalogue; drain the node)"
            self.check = Check("gpu_xid", False, detail, seconds)
        else:
            watched = ", ".join(map(str, self.watched)) or "none"
            self.check = Check("gpu_xid", True, f"no critical Xid events on GPUs {watched}", seconds)

    def _gpu_of(self, device: Any) -> str:
        try:
            return f"GPU {self.module.nvmlDeviceGetIndex(device)}"
        except self.module.NVMLError:
            return "a GPU"

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            if self.event_set is not None:
                self.module.nvmlEventSetFree(self.event_set)
        self.event_set = None
        with contextlib.suppress(Exception):
            self.module.nvmlShutdown()


def check_node(
    *,
    gpus: int,
    efa: int,
    workdir: Path | None,
    fast_tier: Path | None,
    min_free_gib: float,
    volume_limit_s: float,
) -> list[Check]:
    checks = []
    if gpus:
        with XidWatch(gpus) as xid:  # registered before the compute check's kernels
            checks.append(gpus_compute(gpus))
        checks += [xid.check, gpu_memory_errors(gpus)]
    if fast_tier is not None:
        checks.append(fast_tier_room(fast_tier, min_free_gib))
    if workdir is not None:
        checks.append(volume_writable(workdir, volume_limit_s))
    if efa:
        checks.append(efa_devices(efa))
    return checks


def config_in(command: Sequence[str]) -> dict[str, Any] | None:
    """The trainer's inline config in `command` (`--config={...}`), if any."""
    for argument in command:
        if argument.startswith("--config="):
            value = argument.split("=", 1)[1]
            if value.lstrip().startswith("{"):
                return json.loads(value)
    return None


def folders(config: dict[str, Any] | None) -> tuple[Path | None, Path | None]:
    """The run's workdir and the fast tier's node-local folder, from a config dict."""
    if config is None:
        return None, None
    from trainer.checkpointing import default_local_root

    local_dir = config.get("checkpoint", {}).get("local_dir", "")
    return Path(config["run"]["workdir"]), (Path(local_dir) if local_dir else default_local_root())


def report(checks: list[Check], workdir: Path | None) -> str:
    """Write the report where a user looks (the run folder, the pod's status); its failures, one per line."""
    failed = [c for c in checks if not c.ok]
    lines = [f"node {socket.gethostname()} is unhealthy: {c.name}: {c.detail}" for c in failed]
    if workdir is not None:
        from trainer.events import EventLog, write_json_atomic

        with contextlib.suppress(OSError):  # best effort: an unwritable volume is what the report says
            write_json_atomic(
                workdir / "node-health" / f"{socket.gethostname()}.json",
                {"time": time.time(), "healthy": not failed, "checks": [asdict(c) for c in checks]},
            )
            if failed:  # one line appended to the run's event log, beside the ranks' events
                EventLog(workdir, enabled=True).emit(
                    "node_unhealthy", host=socket.gethostname(), failed={c.name: c.detail for c in failed}
                )
    if failed:
        with contextlib.suppress(OSError):
            TERMINATION_LOG.write_text("\n".join(lines)[:4096])  # the kubelet keeps 4 KiB
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m trainer.health",
        description="Check this node (GPUs, the fast tier's folder, the shared volume, EFA), then "
        "exec COMMAND. Exits with 3 and one line per failed check on an unhealthy node.",
        usage="%(prog)s [options] [-- COMMAND...]",
    )
    parser.add_argument(
        "--gpus", type=int, default=0, help="GPUs this pod must see and compute on (0: no GPU checks)"
    )
    parser.add_argument("--efa", type=int, default=0, help="EFA devices this pod must see (0: no check)")
    parser.add_argument(
        "--min-fast-tier-gib",
        type=float,
        default=1.0,
        help="free space the fast tier's folder needs (default 1)",
    )
    parser.add_argument(
        "--volume-limit-s",
        type=float,
        default=10.0,
        help="the longest a 1 MiB write, fsync and read on the workdir's volume may take (default 10)",
    )
    args = parser.parse_args(own)
    workdir, fast_tier = folders(config_in(command))
    checks = check_node(
        gpus=args.gpus,
        efa=args.efa,
        workdir=workdir,
        fast_tier=fast_tier,
        min_free_gib=args.min_fast_tier_gib,
        volume_limit_s=args.volume_limit_s,
    )
    for check in checks:
        print(f"health: {check.name}: {'ok' if check.ok else 'FAILED'}: {check.detail}", file=sys.stderr)
    failures = report(checks, workdir)
    if failures:
        print(failures, file=sys.stderr)
        return EXIT_UNHEALTHY_NODE
    if command:
        sys.stderr.flush()
        os.execvp(command[0], command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
