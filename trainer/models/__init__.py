"""The model registry: `model.kind` -> the ModelSpec that builds, shards, trains and exports it.

    byte-lm   the built-in byte-level transformer (trainer/models/byte_lm.py), the default
    hf        a Hugging Face causal LM from a local model folder (trainer/models/hf_causal_lm.py)

An entry's module is imported when its spec is first asked for, so checking a config
(`require_kind`) imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainer.config import MODEL_RULES, ConfigError

if TYPE_CHECKING:
    from trainer.config import ModelConfig
    from trainer.models.spec import ModelSpec

__all__ = ["REGISTRY", "ModelError", "architecture", "model_spec", "require_kind"]

REGISTRY: dict[str, str] = {"byte-lm": "trainer.models.byte_lm", "hf": "trainer.models.hf_causal_lm"}
"""kind -> the module whose `SPEC` it is. A new architecture adds its module and one line here."""


class ModelError(ConfigError):
    """A model folder or model setting cannot be used; the message says what to fix. A
    ConfigError: no restart can fix it, so the trainer stops at once with this one line."""


def require_kind(kind: str) -> str:
    if kind not in REGISTRY:
        raise ModelError(f"unknown model.kind {kind!r}: choose one of {', '.join(sorted(REGISTRY))}")
    return kind


def model_spec(kind: str) -> ModelSpec:
    """The registry entry for `kind`; ModelError lists the known kinds."""
    spec: ModelSpec = importlib.import_module(REGISTRY[require_kind(kind)]).SPEC
    return spec


def architecture(config: ModelConfig) -> dict[str, Any]:
    """What identifies `config`'s architecture (hashed into model_hash), as its kind's entry says."""
    return model_spec(config.kind).architecture(config)


MODEL_RULES.update(require_kind=require_kind, architecture=architecture)
