"""Registering a Hugging Face model (`model.kind` hf): the checkpoint in Hugging Face format,
logged with MLflow's transformers flavor.

The validated checkpoint (already loaded into a plain module by the registry's spec) is
exported by `spec.export` as config.json + model.safetensors + generation_config.json +
the tokenizer files, loaded back with transformers, and logged with
`mlflow.transformers.log_model` (task text-generation). The logged model holds
`model/` (config, safetensors, generation config: `AutoModelForCausalLM.from_pretrained`
reads it) and `components/tokenizer/` (`AutoTokenizer.from_pretrained` reads it), so
`mlflow.transformers.load_model`, `mlflow.pyfunc.load_model(...).predict` and plain
transformers all load it. The byte LM's pyfunc lives in `bundle.py` / `serving_model.py`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from trainer.config import ModelConfig
from trainer.models import model_spec

MODEL_FOLDER = "model"
"""Where the flavor puts config.json and the safetensors inside the logged model."""
TOKENIZER_FOLDER = "components/tokenizer"
WEIGHTS_SUFFIX = ".safetensors"
TASK = "text-generation"
DEFAULT_MAX_NEW_TOKENS = 64


def pip_requirements() -> list[str]:
    """Pinned explicitly: MLflow's requirement inference fails without torchvision installed."""
    import safetensors
    import tokenizers
    import torch
    import transformers

    return [
        f"torch=={torch.__version__.split('+')[0]}",
        f"transformers=={transformers.__version__}",
        f"tokenizers=={tokenizers.__version__}",
        f"safetensors=={safetensors.__version__}",
        "numpy",
        "pandas",
    ]


def signature() -> Any:
    """Text in, text out; `max_new_tokens` declared as a param, or predict() would ignore it."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("max_new_tokens", "long", DEFAULT_MAX_NEW_TOKENS)]),
    )


def log_hf_model(model: nn.Module, config: ModelConfig) -> Any:
    """Export `model` (the checkpoint's weights in a plain module) and log it in the active
    MLflow run; returns the ModelInfo."""
    import mlflow
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="rtp-hf-export-") as tmp:
        folder = model_spec(config.kind).export(model.state_dict(), config, Path(tmp) / "model")
        # Logged as loaded components, not as the folder's path: MLflow 3.17.2's path route
        # fails with transformers 5.23 (AttributeError: 'str' object has no attribute '__name__'
        # in build_flavor_config_from_local_checkpoint). Loading the export back also proves
        # that from_pretrained reads it.
        exported = AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return mlflow.transformers.log_model(
            {"model": exported.eval(), "tokenizer": tokenizer},
            name="model",
            task=TASK,
            signature=signature(),
            input_example=["def "],
            pip_requirements=pip_requirements(),
        )


def has_weights(listing: list[Any]) -> bool:
    """A listing of the logged model's `model/` folder holds its safetensors."""
    return any(Path(item.path).name.endswith(WEIGHTS_SUFFIX) for item in listing)
