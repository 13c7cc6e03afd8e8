"""LoRA fine-tuning (`training.method=lora`) through peft: the adapters, their identity and export.

`apply_method` injects peft's LoRA layers into a Hugging Face model in place, before FSDP2
shards it (peft's `inject_adapter_in_model`: the model keeps its class, so its decoder
layers, tied head and loss are found as before), and leaves only the adapters trainable.
Each adapted linear layer's weight moves to `<module>.base_layer.weight` and gains
`<module>.lora_A.default.weight` and `<module>.lora_B.default.weight`; `base_name` maps the
names back to the model folder's, `is_adapter` tells the adapters apart. `init_adapters`
draws the adapters with peft's own initialization (A Kaiming-uniform, B zero) on full-size
CPU tensors seeded by (seed, module name), and each rank keeps its slice, so the starting
adapters do not depend on the number of ranks.

A LoRA checkpoint holds the adapters and their AdamW state only (the frozen base is read from
its model folder at every start); `adapter_identity` is what its meta.json records of the
base they apply to, and a resume (or validation) against another base is refused in one line
(`require_same_adapters`). `export_adapter` writes a trained adapter in PEFT's format and
`export_merged` the base with the adapters merged in, for the register step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.config import ModelConfig, TrainConfig, TrainingConfig

ADAPTER_NAME = "default"
"""peft's name for the one adapter of a model (part of the adapters' parameter names)."""
_BASE_LAYER = ".base_layer"
_ADAPTER_PREFIX = "lora_"
STAGE_MANIFEST = "manifest.json"
"""The stage step's record of a staged model folder (components/stage_data): every file's size
and S3 checksum. Its snapshot is immutable, so the record stands for the files' contents."""
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def is_lora(config: TrainConfig) -> bool:
    return config.training.method == "lora"


def lora_config(training: TrainingConfig) -> Any:  # peft.LoraConfig
    """peft's LoraConfig for the `training.lora_*` settings."""
    from peft import LoraConfig

    targets = training.lora_target_modules.strip()
    return LoraConfig(
        r=training.lora_rank,
        lora_alpha=training.lora_alpha,
        lora_dropout=training.lora_dropout,
        # A plain string other than all-linear is a regular expression to peft: names go as a list.
        target_modules=targets
        if targets == "all-linear"
        else [name.strip() for name in targets.split(",") if name.strip()],
        bias="none",
    )


def apply_method(model: nn.Module, training: TrainingConfig) -> nn.Module:
    """`model` itself, with LoRA adapters injected and its own weights frozen when
    `training.method` is lora (unchanged for full). Call before sharding (any device)."""
    if training.method != "lora":
        return model
    from peft import inject_adapter_in_model

    from trainer.models import ModelError

    try:
        inject_adapter_in_model(lora_config(training), model, adapter_name=ADAPTER_NAME)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ModelError(
            f"training.lora_target_modules={training.lora_target_modules!r} cannot be applied to "
            f"{type(model).__name__}: {str(exc).splitlines()[0]}"
        ) from None
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))  # peft freezes the base; this states the rule
    return model


def build_model(config: TrainConfig, device: torch.device) -> nn.Module:
    """The model a checkpoint of `config` fits, on one process: the spec's build (on the meta
    device shapes only; elsewhere the starting weights, e.g. the pretrained base) with the
    training method applied (a LoRA run's adapters)."""
    from trainer.models import model_spec

    return apply_method(model_spec(config.model.kind).build(config.model, device), config.training)


def is_adapter(name: str) -> bool:
    """Whether a parameter or module name is part of a LoRA adapter."""
    return any(part.startswith(_ADAPTER_PREFIX) for part in name.split("."))


def base_name(name: str) -> str:
    """The name of a (non-adapter) parameter in the model without adapters (the folder's)."""
    return name.replace(_BASE_LAYER + ".", ".").removesuffix(_BASE_LAYER)


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in model.named_parameters())


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """peft's initialization of every adapter (its `reset_lora_parameters`), on full-size CPU
    tensors seeded by (seed, module name), copied into each rank's shard (or the plain tensor):
    the same adapters whatever the number of ranks."""
    from peft.tuners.lora import LoraLayer

    from trainer.models.hf_causal_lm import _module_seed
    from trainer.models.spec import copy_full_into

    init = model.peft_config[ADAPTER_NAME].init_lora_weights  # type: ignore[index,union-attr]
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        owned = [
            (owner, key, param)
            for adapters in (layer.lora_A, layer.lora_B)
            if ADAPTER_NAME in adapters
            for owner in adapters[ADAPTER_NAME].modules()
            for key, param in owner.named_parameters(recurse=False)
        ]
        full = [
            nn.Parameter(torch.full(tuple(p.shape), float("nan"), dtype=p.dtype), requires_grad=False)
            for _, _, p in owned
        ]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_module_seed(seed, name))
            for (owner, key, _), tensor in zip(owned, full, strict=True):
                owner._parameters[key] = tensor
            try:
                layer.reset_lora_parameters(ADAPTER_NAME, init)
            finally:
                for owner, key, param in owned:
                    owner._parameters[key] = param
        for (_, key, param), tensor in zip(owned, full, strict=True):
            if torch.isnan(tensor).any():
                raise RuntimeError(f"peft left the adapter {name}.{key} uninitialized")
            copy_full_into(param, tensor)


# --- what a checkpoint records of the base ----------------------------------------------


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


_IDENTITIES: dict[tuple[Any, ...], str] = {}


def base_weights_sha256(folder: str | Path) -> str:
    """SHA-256 naming the weights of a model folder: over the stage step's manifest entries of
    its weight files when it is a staged snapshot (immutable; no weight is read), else over
    the files' names and contents. Computed once per process and folder state."""
    folder = Path(folder)
    files = _weight_files(folder)
    manifest = folder / STAGE_MANIFEST
    state = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in [*files, manifest] if p.exists())
    key = (str(folder.resolve()), state)
    if key not in _IDENTITIES:
        _IDENTITIES[key] = _staged_identity(manifest, files) or _content_identity(files)
    return _IDENTITIES[key]


def _staged_identity(manifest: Path, files: list[Path]) -> str:
    if not manifest.is_file():
        return ""
    try:
        entries = json.loads(manifest.read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return ""
    names = {p.name for p in files}
    chosen = sorted(
        (str(e.get("path")), e.get("size"), e.get("etag"), e.get("checksum"))
        for e in entries
        if isinstance(e, dict) and Path(str(e.get("path", ""))).name in names
    )
    if len(chosen) != len(names):  # the record does not cover every weight file
        return ""
    return "manifest:" + hashlib.sha256(json.dumps(chosen).encode()).hexdigest()


def _content_identity(files: list[Path]) -> str:
    from trainer.models.spec import files_sha256

    return "files:" + files_sha256(files)


def adapter_identity(config: TrainConfig) -> dict[str, Any] | None:
    """What a checkpoint records of the adapters' shapes and the base they apply to (None for
    full training): a checkpoint resumes only into the same."""
    if not is_lora(config):
        return None
    t = config.training
    return {
        "method": "lora",
        "rank": t.lora_rank,
        "alpha": t.lora_alpha,
        "target_modules": t.lora_target_modules,
        "base_weights_sha256": base_weights_sha256(config.model.model_dir),
    }


def adapter_problem(saved: Any, current: dict[str, Any] | None, model: ModelConfig) -> str:
    """Why a checkpoint whose meta.json records `saved` as its adapters cannot be loaded into a
    model whose adapters are `current` (empty: it can)."""
    if saved == current:
        return ""
    if current is None:
        return "it holds LoRA adapters (training.method=lora), this run trains every weight (full)"
    if not saved:
        return "it holds every weight (training.method=full), this run trains LoRA adapters"
    if saved.get("base_weights_sha256") != current["base_weights_sha256"]:
        return (
            f"its LoRA adapters belong to a base model with weights {str(saved.get('base_weights_sha256'))[:24]}…, "
            f"but model.model_dir {model.model_dir} holds {current['base_weights_sha256'][:24]}…: "
            "give the base the adapters were trained on"
        )
    changed = sorted(k for k in current if saved.get(k) != current[k])
    return f"its LoRA adapters differ in {', '.join(changed)} from training.lora_* of this run"


# --- export -----------------------------------------------------------------------------


def _adapted_model(
    state: Mapping[str, torch.Tensor], config: TrainConfig, device: torch.device | None = None
) -> Any:  # peft.PeftModel
    """The base from model.model_dir wrapped by peft with the adapters of `state`: on CPU with
    the base's weights, or on the meta device the base's shapes only (the adapters real)."""
    from peft import get_peft_model

    from trainer.models import ModelError, model_spec

    device = device or torch.device("cpu")
    base = model_spec(config.model.kind).build(config.model, device)
    peft_model = get_peft_model(base, lora_config(config.training), adapter_name=ADAPTER_NAME)
    inner = peft_model.base_model.model  # the HF model with adapters: the training's names
    adapters = {k: v.detach().to("cpu") for k, v in state.items() if is_adapter(k)}
    result = inner.load_state_dict(adapters, strict=False, assign=device.type == "meta")
    missing = [k for k in result.missing_keys if is_adapter(k)]
    if missing or result.unexpected_keys:
        raise ModelError(
            f"the adapters do not fit training.lora_* on {config.model.model_dir}: missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )
    return peft_model


def export_adapter(
    state: Mapping[str, torch.Tensor], config: TrainConfig, folder: Path, base_reference: str = ""
) -> Path:
    """The adapters of `state` (a consolidated state dict of a LoRA run) in PEFT's format:
    adapter_config.json + adapter_model.safetensors, which `PeftModel.from_pretrained(base,
    folder)` loads; `base_reference` is what adapter_config.json names as the base (default:
    model.model_dir). The folder appears complete or not at all. Only the adapters are held in
    memory (the base is built on the meta device): `state` may hold the adapters alone."""
    from trainer.models.spec import published_folder

    peft_model = _adapted_model(state, config, torch.device("meta"))
    peft_model.peft_config[ADAPTER_NAME].base_model_name_or_path = base_reference or config.model.model_dir
    with published_folder(Path(folder)) as staging:
        peft_model.save_pretrained(str(staging))
    return Path(folder)


def merged_model(state: Mapping[str, torch.Tensor], config: TrainConfig) -> nn.Module:
    """The base (on CPU, in memory) with the adapters of `state` merged into its weights by
    peft (`merge_and_unload`): a plain Hugging Face model."""
    return _adapted_model(state, config).merge_and_unload()


def adapted_layers(state: Mapping[str, torch.Tensor], config: TrainConfig) -> dict[str, Any]:
    """peft's LoRA layers holding the adapters of `state` on a base built on the meta device, by
    the name of the weight each adapts in the model without adapters (`<module>.weight`):
    `delta_weight(layer)` is what merging adds to that weight. Only the adapters are in memory."""
    from peft.tuners.lora import LoraLayer

    peft_model = _adapted_model(state, config, torch.device("meta"))
    return {
        f"{name}.weight": layer
        for name, layer in peft_model.base_model.model.named_modules()
        if isinstance(layer, LoraLayer) and ADAPTER_NAME in layer.lora_A
    }


@torch.no_grad()
def delta_weight(layer: Any) -> torch.Tensor:
    """What peft's merge adds to `layer`'s base weight (its `get_delta_weight`: B A scaled by
    alpha / r, transposed where the layer stores its weight that way)."""
    return layer.get_delta_weight(ADAPTER_NAME).detach()


def export_merged(state: Mapping[str, torch.Tensor], config: TrainConfig, folder: Path) -> Path:
    """The base with the adapters of `state` merged into its weights, exported as the model
    spec exports a full state dict (config.json, safetensors, tokenizer files), so
    `AutoModelForCausalLM.from_pretrained(folder)` loads it. The model is held in memory; the
    register step streams the same merge (components/register_model/lora_export.py)."""
    from trainer.models import model_spec

    merged = merged_model(state, config)
    return model_spec(config.model.kind).export(merged.state_dict(), config.model, Path(folder))
