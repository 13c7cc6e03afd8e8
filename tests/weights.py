"""The tests' own fingerprint of a plain state dict: what `trainer.checkpointing.model_sha256`
must equal for the same weights (each tensor's key, then its values as they lie in host
memory, in sorted key order), written here apart from the code it checks."""

from __future__ import annotations

import hashlib

import torch


def state_dict_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over tensors in sorted key order: equal exactly when the weights are equal."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().to("cpu").contiguous().numpy().data)
    return digest.hexdigest()
