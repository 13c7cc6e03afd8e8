"""Registering a LoRA checkpoint (`training.method=lora`): its adapter in PEFT's format, and the
base with the adapter merged in, exported streamed.

A LoRA checkpoint holds the adapters (and their AdamW state) only; the base's weights are the
folder `model.model_dir` (the staged base), named in meta.json by `base_weights_sha256`.
- `check_base`: the folder still holds the base the adapters were trained on (one line if not).
- `adapter_state`: the adapters read from the checkpoint (no base weight is read).
- `write_adapter`: PEFT's format (`trainer.lora.export_adapter`: adapter_config.json naming the
  base folder + adapter_model.safetensors), which `PeftModel.from_pretrained(base, folder)` loads.
- `merged_source`: what the streamed export (`streamed_export.export_checkpoint`) writes for
  the merged model: every tensor save_pretrained would write, read from the base folder's
  safetensors a group at a time; where an adapter applies, peft's delta (`B A · alpha / r`) is
  added in the adapter's dtype (fp32), as peft's merge adds it to the trained model's fp32
  weight, and the export casts the sum to the source dtype. Peak memory: the adapters and one
  read group, not the model.
- `merged_reference`: the same merge done by peft on the model in memory (`merge_and_unload`),
  against which the export's logits are checked at small sizes.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from components.register_model.lineage import LORA_REGISTERED_TAG
from components.register_model.streamed_export import (
    SAFETENSORS_DTYPES,
    ExportError,
    ExportTensor,
    Reader,
    TensorSource,
    model_with_state,
    read_safetensors_header,
    saved_tensors,
)
from trainer.checkpointing.storage import CheckpointError
from trainer.config import ModelConfig, TrainConfig

_STORED_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_FOLDER = "adapter"
"""Where the adapter (PEFT's format) sits among the MLflow run's artifacts."""
PEFT_FOLDER = "peft"
"""Where MLflow's transformers flavor puts a PEFT model's adapter inside the logged model."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
HOLDS_TAG = LORA_REGISTERED_TAG
ADAPTER_URI_TAG = "rtp.lora.adapter_uri"


@dataclass(frozen=True, slots=True)
class AdapterFacts:
    """What a registered LoRA model records of its adapter and the base it applies to."""

    base_model_dir: str
    """The staged base folder (what adapter_config.json names as the base)."""
    base_weights_sha256: str
    base_source: str
    """The registered version the base was staged from (models:/NAME/N), else the folder."""
    rank: int
    alpha: int | float
    target_modules: str

    def tags(self) -> dict[str, str]:
        return {
            "rtp.training_method": "lora",
            "rtp.lora.base_model_dir": self.base_model_dir,
            "rtp.lora.base_weights_sha256": self.base_weights_sha256,
            "rtp.lora.base_source": self.base_source,
            "rtp.lora.rank": str(self.rank),
            "rtp.lora.alpha": str(self.alpha),
            "rtp.lora.target_modules": self.target_modules,
        }


def check_base(checkpoint_dir: str | Path, config: TrainConfig, meta: dict[str, Any]) -> AdapterFacts:
    """The adapters' facts; CheckpointError when model.model_dir no longer holds their base."""
    from components.stage_model.registry_source import origin_of
    from trainer.lora import adapter_identity, adapter_problem

    current = adapter_identity(config)
    problem = adapter_problem(meta.get("adapters"), current, config.model)
    if problem or current is None:
        raise CheckpointError(f"{checkpoint_dir} cannot be registered: {problem}")
    origin = origin_of(config.model.model_dir)
    return AdapterFacts(
        base_model_dir=str(config.model.model_dir),
        base_weights_sha256=current["base_weights_sha256"],
        base_source=f"models:/{origin.model_name}/{origin.version}"
        if origin
        else str(config.model.model_dir),
        rank=config.training.lora_rank,
        alpha=config.training.lora_alpha,
        target_modules=config.training.lora_target_modules,
    )


def adapter_state(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The adapters of a LoRA checkpoint by their names in the model (`<module>.lora_A.default.weight`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainer.lora import is_adapter

    stored = FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    state = {
        fqn.removeprefix("model."): torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for fqn, entry in stored.items()
        if fqn.startswith("model.") and isinstance(entry, TensorStorageMetadata) and is_adapter(fqn)
    }
    if not state:
        raise CheckpointError(f"{checkpoint_dir} holds no LoRA adapters")
    try:
        dcp.load({"model": state}, storage_reader=FileSystemReader(str(checkpoint_dir)), no_dist=True)
    except Exception as exc:  # DCP raises a bare CheckpointException listing rank errors
        raise CheckpointError(f"cannot read the adapters of {checkpoint_dir}: {exc}") from exc
    for name, tensor in state.items():
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"adapter {name!r} in {checkpoint_dir} holds NaN or Inf values")
    return state


@contextmanager
def written_adapter(checkpoint_dir: str | Path, config: TrainConfig, base_reference: str) -> Iterator[Path]:
    """A temporary folder with the checkpoint's adapter in PEFT's format, `base_reference` named
    as its base in adapter_config.json (small: the adapters only)."""
    from trainer.lora import export_adapter

    with tempfile.TemporaryDirectory(prefix="rtp-adapter-") as tmp:
        yield export_adapter(adapter_state(checkpoint_dir), config, Path(tmp) / "adapter", base_reference)


def has_adapter(listing: list[Any]) -> bool:
    """A listing of a logged model's `peft/` folder holds the adapter's weights."""
    return any(Path(item.path).name == ADAPTER_WEIGHTS for item in listing)


# --- the merged model, streamed ------------------------------------------------------------


def base_tensors(folder: Path) -> dict[str, tuple[Path, torch.dtype, tuple[int, ...]]]:
    """Each tensor of a model folder's safetensors: (its file, dtype, shape), from the headers only."""
    index = folder / INDEX_FILE
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    found: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]] = {}
    for path in files:
        for name, entry in read_safetensors_header(path).items():
            if name.startswith("__"):
                continue
            dtype = _STORED_DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise ExportError(
                    f"{name} in {path} is {entry.get('dtype')}, which cannot be merged and exported"
                )
            found[name] = (path, dtype, tuple(entry["shape"]))
    return found


def merged_source(config: TrainConfig) -> TensorSource:
    """The streamed export's source for the base of `config` with a checkpoint's adapters merged in."""

    def plan(checkpoint_dir: str | Path, model_config: ModelConfig, dtype: torch.dtype) -> list[ExportTensor]:
        from trainer.lora import build_model, is_adapter
        from trainer.models.hf_causal_lm import model_folder

        folder = model_folder(model_config)
        stored = base_tensors(folder)
        tensors, problems = [], []
        for key, saved_name, shape in saved_tensors(model_config):
            entry = stored.get(saved_name)
            if entry is None or entry[2] != shape:
                problems.append(
                    f"{saved_name} is not in {folder}"
                    if entry is None
                    else f"{saved_name} is {list(entry[2])} in {folder}, {list(shape)} by config.json"
                )
                continue
            tensors.append(ExportTensor(saved_name, key, shape, entry[1], dtype))
        if problems:
            raise ExportError(f"the base in {folder} does not fit its config.json: {'; '.join(problems[:3])}")
        written = {t.fqn for t in tensors}
        adapted = {
            name.split(".lora_A.")[0] + ".weight"
            for name, _ in build_model(config, torch.device("meta")).named_parameters()
            if is_adapter(name) and ".lora_A." in name
        }
        if adapted - written:  # a tied weight (left out) would be merged into one copy only
            raise ExportError(
                f"the adapters of {checkpoint_dir} adapt {sorted(adapted - written)[:3]}, tied to another "
                "weight: the merged model cannot keep the tie; register it with register_merged=false"
            )
        return tensors

    def reader(checkpoint_dir: str | Path) -> Reader:
        from safetensors import safe_open

        from trainer.lora import adapted_layers, delta_weight
        from trainer.models.hf_causal_lm import model_folder

        layers = adapted_layers(adapter_state(checkpoint_dir), config)
        files = {name: entry[0] for name, entry in base_tensors(model_folder(config.model)).items()}

        def read(group: list[ExportTensor]) -> dict[str, torch.Tensor]:
            by_file: dict[Path, list[ExportTensor]] = defaultdict(list)
            for tensor in group:
                by_file[files[tensor.name]].append(tensor)
            values = {}
            for path, tensors in by_file.items():
                with safe_open(str(path), framework="pt") as handle:
                    for tensor in tensors:
                        value = handle.get_tensor(tensor.name)
                        layer = layers.get(tensor.fqn)
                        if layer is not None:  # the trained model's weight: the base in fp32 + the delta
                            delta = delta_weight(layer)
                            value = value.to(delta.dtype) + delta
                        values[tensor.fqn] = value
            return values

        return read

    return TensorSource(plan, reader)


def merged_reference(checkpoint_dir: str | Path, config: TrainConfig, dtype: torch.dtype) -> Any:
    """peft's merge of the checkpoint's adapters into the base, in memory, cast to `dtype`."""
    from trainer.lora import merged_model

    merged = merged_model(adapter_state(checkpoint_dir), config)
    return model_with_state(merged.state_dict(), config.model, dtype)
