"""`training.deterministic`: what a rank sets so that its GPU training is bit-reproducible.

fp32 training on CPU is deterministic already (the exactness tests compare SHA-256 of the
weights there). On CUDA three sources of run-to-run difference remain, and the switch turns
each off, in the rank, before the process group and the model are built:

- kernels that accumulate in an unspecified order (atomic adds): `torch.use_deterministic_algorithms(True)`
  picks deterministic variants where torch has them (Flash and memory-efficient attention
  backward among them; cuDNN attention is then never chosen) and raises, naming the op, where
  it has none; cuDNN's own switch and no benchmarking keep its algorithm choice fixed;
- cuBLAS's split reductions: `CUBLAS_WORKSPACE_CONFIG` must name a fixed workspace before the
  first cuBLAS call (torch refuses deterministic matmuls without it);
- NCCL choosing its algorithm and protocol per message size and topology: `NCCL_ALGO` and
  `NCCL_PROTO` are read when a communicator is created.

A value a user already put in the environment is kept. Switched off, torch's flags return to
their defaults (a new `Trainer` in the same process starts from the config, not from
the previous attempt); environment variables, read once by the libraries, stay.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

from trainer.config import TrainingConfig

CUBLAS_ENV: dict[str, str] = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""cuBLAS's reproducible workspace setting (cuBLAS docs, "Results reproducibility")."""

NCCL_DETERMINISTIC_ENV: dict[str, str] = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
"""One algorithm and protocol for every message size: the same reduction order on every run
of the same world size and topology."""


def apply_determinism(
    training: TrainingConfig, *, cuda: bool, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set torch's flags to `training.deterministic` and, when on, the environment it needs
    (NCCL's only with `cuda`); returns the variables it set. Call before the first CUDA
    matmul and before the process group is made."""
    environ = os.environ if environ is None else environ
    on = training.deterministic
    if torch.are_deterministic_algorithms_enabled() != on or (
        on and torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        # Only on a change: the call imports torch._inductor's config, a slow import at a rank's start.
        torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    if not on:
        return {}
    torch.backends.cudnn.benchmark = False
    wanted = {**CUBLAS_ENV, **(NCCL_DETERMINISTIC_ENV if cuda else {})}
    added = {key: value for key, value in wanted.items() if key not in environ}
    environ.update(added)
    return added
