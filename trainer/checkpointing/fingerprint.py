"""The SHA-256 fingerprint of model weights: equal exactly when the weights are equal.

What the exactness checks compare: the summary's `model_sha256` (a resumed run must end
with the weights of one that never stopped) and, with `checkpoint.record_weight_hashes`,
the weights at every save (a saved checkpoint must hold exactly those: never torn).

It hashes each tensor's key, then its values as they lie in host memory, in sorted key
order, over what a checkpoint holds of the model: its trained parameters (a LoRA run's
adapters; the frozen base is named by the checkpoint's `adapters` record instead). `model_sha256` streams a sharded model one full tensor at a time, so its memory
is the largest tensor, not the model, and its value does not depend on the world size.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from trainer.checkpointing.storage import trained_model_state, trained_state_options


def model_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the full (unsharded) model state a checkpoint holds (frozen parameters left
    out: a LoRA run's adapters), the same string on every rank; the tests' plain-state-dict
    fingerprint (tests/weights.py) gives the same string for the same weights.

    Collective: every rank gathers the same tensor at the same time, in sorted key order, and
    drops it once rank 0 hashed it; rank 0's digest is then broadcast."""
    # The sharded state dict has the full one's keys (FQNs, tied weights under each name,
    # no non-persistent buffers) and its values are the parameters themselves, not copies.
    local = trained_model_state(get_model_state_dict(model, options=trained_state_options(model)), model)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    hashes_here = not distributed or dist.get_rank() == 0
    digest = hashlib.sha256()
    device = torch.device("cpu")
    for key, value in sorted(local.items()):
        assert isinstance(value, torch.Tensor), key
        device = value.device
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if hashes_here:
            digest.update(key.encode())
            digest.update(full.detach().to("cpu").contiguous().numpy().data)  # no copy, unlike tobytes()
        del full  # only one gathered tensor is alive at a time
    if not distributed:
        return digest.hexdigest()
    # On the model's device: the process group has a backend for it (NCCL may be the only one).
    raw = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8).to(device)
    dist.broadcast(raw, src=0)
    return bytes(raw.cpu().tolist()).hex()
