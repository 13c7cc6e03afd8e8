"""The interconnect check before training: every rank times an all-reduce over the world.

The node check (trainer/health.py) runs before the process group exists, so it cannot see
a slow link (EFA falling back to TCP, a degraded NIC, a bad switch port). Once the ranks
have joined, a first attempt of each process times `resilience.allreduce_check_mib` MiB of
all-reduce (one warm-up, then the best of `REPEATS`, each the slowest rank's time) and
reports the bus bandwidth as nccl-tests defines it (2(n-1)/n x bytes / time: what each link
carried, comparable across world sizes). Below `resilience.min_allreduce_gbps` the attempt
ends with `SlowInterconnect`; in-process restarts would measure the same links, so they
stop, and the launcher's restart of the worker group measures again (a replaced pod may
bring a healthy node).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

REPEATS = 3


class SlowInterconnect(RuntimeError):
    """The all-reduce's bus bandwidth is below `resilience.min_allreduce_gbps`."""


@dataclass(frozen=True)
class LinkCheck:
    world_size: int
    bytes: int
    seconds: float
    """The best repeat's time on the slowest rank."""
    busbw_gbps: float
    """Bus bandwidth, GB/s (10^9 bytes): 2(n-1)/n x bytes / seconds."""
    floor_gbps: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def too_slow(self) -> bool:
        return self.floor_gbps > 0 and self.busbw_gbps < self.floor_gbps

    def refusal(self) -> str:
        return (
            f"{self.line()} is below resilience.min_allreduce_gbps: a link between the nodes is "
            "slow or not the one expected (with EFA, NCCL_DEBUG=INFO names NET/OFI, not "
            "NET/Socket; fi_info -p efa lists the devices). The launcher's restart measures again"
        )

    def line(self) -> str:
        floor = f" (floor {self.floor_gbps:g} GB/s)" if self.floor_gbps > 0 else ""
        return (
            f"all-reduce of {self.bytes / 2**20:g} MiB over {self.world_size} ranks: "
            f"{self.seconds * 1e3:.2f} ms, bus bandwidth {self.busbw_gbps:.3g} GB/s{floor}"
        )


def bus_bandwidth_gbps(nbytes: int, seconds: float, world_size: int) -> float:
    """nccl-tests' busbw for an all-reduce: each link carries 2(n-1)/n of the buffer."""
    return 2 * (world_size - 1) / world_size * nbytes / seconds / 1e9


def measure_allreduce(mib: float, device: torch.device, floor_gbps: float = 0.0) -> LinkCheck:
    """Collective: time an all-reduce of `mib` MiB of fp32 on `device` over the world."""
    world = dist.get_world_size()
    buffer = torch.ones(max(1, int(mib * 2**20) // 4), dtype=torch.float32, device=device)
    timings = []
    for repeat in range(REPEATS + 1):
        _synchronize(device)
        started = time.perf_counter()
        dist.all_reduce(buffer)
        _synchronize(device)
        took = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the collective ends when the slowest rank does
        if repeat:  # the first one sets the connections up
            timings.append(float(took.item()))
    nbytes = buffer.numel() * buffer.element_size()
    seconds = min(timings)
    return LinkCheck(world, nbytes, seconds, bus_bandwidth_gbps(nbytes, seconds, world), floor_gbps)


def check_links(mib: float, floor_gbps: float, device: torch.device) -> LinkCheck | None:
    """Collective: the measured check, None when there is nothing to check (off, one rank)."""
    if mib <= 0 or dist.get_world_size() < 2:
        return None
    return measure_allreduce(mib, device, floor_gbps)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
