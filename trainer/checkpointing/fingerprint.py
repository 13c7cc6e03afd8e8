"""SHA-256 fingerprints of model weights: equal exactly when the weights are equal.

What the exactness checks compare: the summary's `model_sha256` (a resumed run must end
with the weights of one that never stopped) and, with `checkpoint.record_weight_hashes`,
the weights at every save (a saved checkpoint must hold exactly those: never torn).
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def state_dict_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over tensors in sorted key order: equal exactly when the weights are equal."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().to("cpu").contiguous().numpy().tobytes())
    return digest.hexdigest()


def model_sha256(model: torch.nn.Module) -> str:
    """`state_dict_sha256` of the full (unsharded) model state. Collective."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    tensors = {}
    for key, value in full.items():
        assert isinstance(value, torch.Tensor), key
        tensors[key] = value
    return state_dict_sha256(tensors)
