"""Registering a Hugging Face model (`model.kind` hf): the checkpoint in Hugging Face format,
logged with MLflow's transformers flavor.

The validated checkpoint is exported tensor by tensor (`streamed_export.py`: safetensors
in the source model's dtype, sharded with an index above `max_shard_size`, config.json,
generation_config.json, tokenizer files) onto the shared volume, and that folder is logged
by its path with `mlflow.transformers.log_model` (task text-generation): MLflow copies the
files and loads only the tokenizer, never the model. The logged model holds `model/`
(config, safetensors, generation config: `AutoModelForCausalLM.from_pretrained` reads it)
and `components/tokenizer/` (`AutoTokenizer.from_pretrained` reads it), so
`mlflow.transformers.load_model`, `mlflow.pyfunc.load_model(...).predict` and plain
transformers all load it. The byte LM's pyfunc lives in `bundle.py` / `serving_model.py`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

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


@contextlib.contextmanager
def _pipeline_classes_for_mlflow() -> Iterator[None]:
    """MLflow 3.17.2 logs a folder by path with `check_task(task)[1]["impl"].__name__`, but
    transformers 5 gives `impl` as the class's dotted name (a str: AttributeError '__name__');
    for the duration of the call `check_task` answers with the class itself."""
    from transformers import pipelines

    original = pipelines.check_task

    def check_task(task: str) -> tuple[str, dict[str, Any], Any]:
        name, meta, options = original(task)
        impl = meta.get("impl")
        if isinstance(impl, str):
            module, _, cls = impl.rpartition(".")
            meta = {**meta, "impl": getattr(importlib.import_module(module), cls)}
        return name, meta, options

    pipelines.check_task = check_task  # type: ignore[assignment]
    try:
        yield
    finally:
        pipelines.check_task = original  # type: ignore[assignment]


CHAT_TASK = "llm/v1/chat"
"""MLflow's chat task: the served model takes OpenAI-style `{"messages": [...]}` requests,
renders them with the tokenizer's chat template and answers with a chat completion."""


def has_chat_template(folder: Path) -> bool:
    """The folder's tokenizer has a chat template (chat_template.jinja, or in tokenizer_config.json)."""
    import json

    if (folder / "chat_template.jinja").is_file():
        return True
    config = folder / "tokenizer_config.json"
    try:
        return bool(config.is_file() and json.loads(config.read_text()).get("chat_template"))
    except (OSError, json.JSONDecodeError):
        return False


def log_hf_model(folder: Path, dtype: torch.dtype) -> Any:
    """Log the exported Hugging Face folder in the active MLflow run without loading its
    weights; returns the ModelInfo. `dtype` is what loaders of the logged model use.

    A tokenizer with a chat template makes it a chat model (`CHAT_TASK`, MLflow's own chat
    signature), so `mlflow models serve` answers `messages`; otherwise text in, text out."""
    import mlflow

    chat = has_chat_template(folder)
    with _pipeline_classes_for_mlflow():
        return mlflow.transformers.log_model(
            str(folder),
            name="model",
            task=CHAT_TASK if chat else TASK,
            torch_dtype=dtype,
            signature=None if chat else signature(),
            input_example=None if chat else ["def "],
            pip_requirements=pip_requirements(),
        )


def log_peft_model(adapter: Path, base: Path, dtype: torch.dtype) -> Any:
    """Log a LoRA adapter (PEFT's format) with MLflow's transformers flavor on its base folder
    by path (`base_model_path`: the base's weights are not copied, and loaders of the logged
    model read them from `base`); returns the ModelInfo. MLflow builds the pipeline it logs,
    so the base is loaded once, in `dtype`; the tokenizer (its chat template too) is the base's.
    A chat template makes it a chat model, as for `log_hf_model`."""
    import mlflow
    import peft
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, dtype=dtype)
    chat = has_chat_template(base)
    with _pipeline_classes_for_mlflow():
        return mlflow.transformers.log_model(
            {
                "model": PeftModel.from_pretrained(model, str(adapter)),
                "tokenizer": AutoTokenizer.from_pretrained(str(base), local_files_only=True),
            },
            name="model",
            task=CHAT_TASK if chat else TASK,
            torch_dtype=dtype,
            base_model_path=str(base),
            signature=None if chat else signature(),
            input_example=None if chat else ["def "],
            pip_requirements=[*pip_requirements(), f"peft=={peft.__version__}"],
        )


def has_weights(listing: list[Any]) -> bool:
    """A listing of the logged model's `model/` folder holds its safetensors."""
    return any(Path(item.path).name.endswith(WEIGHTS_SUFFIX) for item in listing)
