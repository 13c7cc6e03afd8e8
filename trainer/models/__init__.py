"""The model registry: `model.kind` -> the ModelSpec that builds, shards, trains and exports it.

    byte-lm   the built-in byte-level transformer (trainer/models/byte_lm.py), the default
    hf        a Hugging Face causal LM from a local model folder (trainer/models/hf_causal_lm.py)

Nothing here imports transformers: the HF entry imports it when it builds something.
"""

from __future__ import annotations

from trainer.models import byte_lm, hf_causal_lm
from trainer.models.spec import ModelError, ModelSpec, Tokenizer

__all__ = ["REGISTRY", "ModelError", "ModelSpec", "Tokenizer", "model_spec"]

REGISTRY: dict[str, ModelSpec] = {spec.kind: spec for spec in (byte_lm.SPEC, hf_causal_lm.SPEC)}


def model_spec(kind: str) -> ModelSpec:
    """The registry entry for `kind`; ModelError lists the known kinds."""
    try:
        return REGISTRY[kind]
    except KeyError:
        raise ModelError(
            f"unknown model.kind {kind!r}: choose one of {', '.join(sorted(REGISTRY))}"
        ) from None
