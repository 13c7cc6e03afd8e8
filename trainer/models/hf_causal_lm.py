"""Hugging Face causal LMs (registry entry "hf") from a local model folder, never from a hub.

The folder holds config.json, tokenizer files and, for `model.init=pretrained`, the
weights as *.safetensors (one file or several with an index). Training builds the model on
the meta device, shards it, then fills each rank's shards: pretrained weights are read
slice by slice through torch DCP's HuggingFaceStorageReader (no rank materializes the whole
model), and random weights are drawn module by module from a generator seeded by
(seed, module name), so they do not depend on the number of ranks. Non-persistent buffers
(rotary frequencies) are recomputed by transformers' own `_init_weights`. A resume fills
neither (`init_for_resume`): its checkpoint overwrites the trained parameters, and only a
LoRA run's frozen base, which its checkpoints do not hold, is read from the folder.

FSDP units are the decoder layers whatever the architecture calls them: the members of the
largest `nn.ModuleList` of same-class blocks, preferring classes the model lists in
`_no_split_modules`. Embeddings, the final norm and the output head stay in the root unit
(a tied head shares its weight with the embedding there).

Export writes config.json + model.safetensors + generation_config.json + the tokenizer files,
so `AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)` work.
transformers is imported inside functions: importing the registry stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer import lora, waiting
from trainer.config import ModelConfig
from trainer.models.spec import (
    ModelError,
    ModelSpec,
    chunked_cross_entropy,
    copy_full_into,
    files_sha256,
    next_token_cross_entropy,
    published_folder,
    require_training_memory,
    run_as_forward,
)

KIND = "hf"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
)
# config.json keys that do not change the architecture (written differently by each
# transformers version or by save_pretrained): left out of the architecture identity.
_NON_ARCHITECTURE_KEYS = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache")
# Old checkpoints store rotary frequencies that transformers now recomputes; not an error.
_IGNORED_STORED_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


# --- the model folder -------------------------------------------------------------------


def model_folder(config: ModelConfig) -> Path:
    folder = Path(config.model_dir)
    if not config.model_dir or not folder.is_dir():
        raise ModelError(
            f"model.model_dir {config.model_dir!r} is not a folder: point it at a Hugging Face model "
            "folder (config.json, tokenizer files, optional *.safetensors)"
        )
    return folder


def read_hf_config(folder: Path) -> Any:
    """The folder's transformers config; ModelError when it is missing or not a known causal LM."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ModelError(
            f"{folder} has no {CONFIG_FILE}: a model folder holds config.json, tokenizer files and "
            "(for model.init=pretrained) *.safetensors weights"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(
            f"{path}: model_type {model_type!r} is not a causal LM architecture transformers "
            f"{transformers.__version__} knows (e.g. llama, qwen2, mistral, gpt_neox); custom code is not run"
        )
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ModelError(f"{path} cannot be read by transformers {transformers.__version__}: {exc}") from None


def architecture(config: ModelConfig) -> dict[str, Any]:
    hf_config = read_hf_config(model_folder(config)).to_dict()
    for key in _NON_ARCHITECTURE_KEYS:
        hf_config.pop(key, None)
    blob = json.dumps(hf_config, sort_keys=True, default=str).encode()
    return {"kind": KIND, "seq_len": config.seq_len, "config_sha256": hashlib.sha256(blob).hexdigest()}


# --- building and initializing ----------------------------------------------------------


def _meta_model(hf_config: Any) -> Any:  # a transformers PreTrainedModel
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        # fp32 master weights whatever the folder's dtype: training here is full precision.
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def build(config: ModelConfig, device: torch.device) -> nn.Module:
    """On the meta device: shapes only. Elsewhere: the starting weights, pretrained or random
    seeded by `torch.initial_seed()` (what the caller's `torch.manual_seed` set)."""
    model = _meta_model(read_hf_config(model_folder(config)))
    if device.type != "meta":
        init_weights(model, config, device, torch.initial_seed())
    return model


def init_weights(model: nn.Module, config: ModelConfig, device: torch.device, seed: int) -> None:
    """Allocate the (sharded or plain) parameters on `device` and fill them, then the buffers."""
    folder = model_folder(config)
    require_training_memory(model, fsdp_units(model), device)  # before allocating anything
    model.to_empty(device=device)
    _fill_base(model, config, folder, seed)
    if lora.has_adapters(model):  # training.method=lora: peft's layers were injected before sharding
        lora.init_adapters(model, seed)
    _init_buffers(model)
    hf_model: Any = model
    hf_model.tie_weights()


def init_for_resume(model: nn.Module, config: ModelConfig, device: torch.device, seed: int) -> None:
    """`init_weights` less the trained parameters, which the resume loads: no read of the
    folder's weights and no random init for full training; a LoRA run's frozen base (not in
    its checkpoints) is filled as `init_weights` fills it, its adapters are not."""
    folder = model_folder(config)
    require_training_memory(model, fsdp_units(model), device)  # before allocating anything
    model.to_empty(device=device)
    hf_model: Any = model
    hf_model.tie_weights()  # before any fill: the head and the embedding are one tensor from here on
    if lora.has_adapters(model):
        _fill_base(model, config, folder, seed)
    _init_buffers(model)


def init_trained(model: nn.Module, config: ModelConfig, device: torch.device, seed: int) -> None:
    """After `init_for_resume`, when nothing was resumed: the trained parameters as
    `init_weights` fills them (the same values: each is filled by name, not in sequence)."""
    if lora.has_adapters(model):
        lora.init_adapters(model, seed)
    else:
        _fill_base(model, config, model_folder(config), seed)


def _fill_base(model: nn.Module, config: ModelConfig, folder: Path, seed: int) -> None:
    if config.init == "pretrained":
        load_pretrained(model, folder)
    else:
        random_init(model, seed)


def _module_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big") % (2**63)


@torch.no_grad()
def random_init(model: nn.Module, seed: int) -> None:
    """transformers' own init per module, on full-size CPU tensors, copied into each rank's shard.

    One module's parameters exist in full at a time; the values depend on (seed, module
    name) only, so 1 rank and N ranks start from the same weights."""
    done: set[int] = set()
    for name, module in model.named_modules():
        originals = dict(module.named_parameters(recurse=False))
        if not originals or lora.is_adapter(name):  # adapters: `lora.init_adapters`
            continue
        full = {
            key: nn.Parameter(torch.full(tuple(p.shape), float("nan"), dtype=p.dtype), requires_grad=False)
            for key, p in originals.items()
        }
        with torch.random.fork_rng(devices=[]):
            # A LoRA-wrapped layer's base weight is seeded as the unwrapped layer's.
            torch.manual_seed(_module_seed(seed, lora.base_name(name)))
            for key, tensor in full.items():
                module._parameters[key] = tensor
            try:
                model._init_weights(module)  # type: ignore[operator]
            finally:
                for key, param in originals.items():
                    module._parameters[key] = param
        for key, param in originals.items():
            if id(param) in done:  # a tied weight: initialized where it was first seen
                continue
            done.add(id(param))
            if torch.isnan(full[key]).any():
                raise ModelError(
                    f"transformers does not initialize {name}.{key} ({type(module).__name__}); "
                    "train this architecture from its weights (model.init=pretrained)"
                )
            copy_full_into(param, full[key])


@torch.no_grad()
def _init_buffers(model: nn.Module) -> None:
    """Recompute buffers (rotary frequencies) that to_empty left as garbage; refuse any left NaN."""
    for module in model.modules():
        buffers = [b for b in module.buffers(recurse=False) if b is not None]
        if not buffers or any(True for _ in module.parameters(recurse=False)):
            continue
        for buffer in buffers:
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
        model._init_weights(module)  # type: ignore[operator]
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point() and torch.isnan(buffer).any():
            raise ModelError(
                f"transformers does not initialize the buffer {name}; this architecture is not supported"
            )


def stored_weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the folder's *.safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except Exception as exc:  # safetensors raises its own error types for a torn header
            raise ModelError(f"{path} is not a readable safetensors file: {exc}") from None
    return shapes


def weight_problems(
    stored: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], tied: Iterable[str]
) -> list[str]:
    """Why the stored weights do not fit the model built from config.json (empty: they fit)."""
    tied = set(tied)
    problems = [
        f"{key} is {tuple(stored[key])} in the weights but {shape} by config.json"
        for key, shape in expected.items()
        if key in stored and tuple(stored[key]) != tuple(shape)
    ]
    missing = sorted(key for key in expected if key not in stored and key not in tied)
    unexpected = sorted(key for key in stored if key not in expected and not _IGNORED_STORED_KEYS.search(key))
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from the weights, e.g. {', '.join(missing[:3])}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} tensor(s) the config has no place for, e.g. {', '.join(unexpected[:3])}"
        )
    return problems


def stored_names(model: nn.Module, stored: Iterable[str], expected: Mapping[str, Any]) -> dict[str, str]:
    """Model parameter name -> name in the safetensors files, through transformers' own key
    renamings (GPT-NeoX stores `embed_out` for `lm_head`; base-model files lack the prefix).

    Uses transformers 5.23's conversion-mapping internals (pinned), the same rules its
    from_pretrained applies; weights that need tensor conversion (fused MoE experts) are
    refused: they cannot be read slice by slice."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None
    names: dict[str, str] = {}
    for key in stored:
        renamed, converter = rename_source_key(key, renamings, converters, prefix, dict(expected))
        if converter is not None:
            raise ModelError(
                f"weight {key} needs transformers' tensor conversion ({converter}) to load; "
                "sharded loading supports renamed weights only"
            )
        names[renamed] = key
    return names


def load_pretrained(model: nn.Module, folder: Path) -> None:
    """Read the folder's safetensors into the model's (sharded) parameters, each rank its slices."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    stored_shapes = stored_weight_shapes(folder)
    if not stored_shapes:
        raise ModelError(
            f"model.init=pretrained but {folder} holds no *.safetensors weights: add them or use model.init=random"
        )
    # By the folder's names: a LoRA-wrapped layer's weight is `<layer>.base_layer.weight` here,
    # and the adapters are not in the folder (`lora.init_adapters` fills them).
    state = {
        lora.base_name(key): value for key, value in model.state_dict().items() if not lora.is_adapter(key)
    }
    expected = {key: tuple(value.shape) for key, value in state.items()}
    # The renaming rules come from an unsharded twin on the meta device: transformers looks
    # them up by class, and fully_shard has swapped the model's class for an FSDP subclass.
    twin = _meta_model(read_hf_config(folder))
    names = stored_names(twin, stored_shapes, expected)  # model name -> stored name
    stored = {model_key: stored_shapes[stored_key] for model_key, stored_key in names.items()}
    tied = getattr(model, "all_tied_weights_keys", {}) or {}
    problems = weight_problems(stored, expected, tied)
    if problems:
        raise ModelError(f"the weights in {folder} do not match its config.json: {'; '.join(problems)}")
    # Keyed by the stored names (what the reader looks up), valued by the model's tensors.
    to_load = {names[key]: value for key, value in state.items() if key in names}
    # Collective when a process group exists: each rank reads only the slices of its shards.
    # In a thread: its collectives wait inside C for the slowest rank's read (trainer/waiting.py).
    waiting.off_main_thread(
        "rtp-weights-load",
        dcp.load,
        to_load,
        storage_reader=HuggingFaceStorageReader(str(folder)),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        process_group=torch.distributed.group.WORLD,  # bound now: see storage's load
    )


# --- FSDP units, loss, tokenizer --------------------------------------------------------


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the largest ModuleList of same-class blocks (by parameter count),
    preferring a class named in the model's `_no_split_modules`."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    candidates = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            params = sum(p.numel() for p in module.parameters())
            candidates.append((type(module[0]).__name__ in no_split, params, module))
    if not candidates:
        raise ModelError(
            f"{type(model).__name__} has no list of decoder layers to shard (nn.ModuleList of blocks)"
        )
    _, _, layers = max(candidates, key=lambda c: (c[0], c[1]))
    return list(layers)


CHUNKED_HEAD_MODEL_TYPES = frozenset(
    {"gemma", "gpt_neox", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3", "smollm3", "starcoder2"}
)
"""Architectures whose causal-LM forward is the output head on the base model's last hidden
state, nothing after it (Gemma 2's soft-capping, Cohere's and Granite's logit scaling are):
their loss runs the head chunk by chunk. tests/unit/test_chunked_loss.py checks each against
transformers' forward; any other architecture's loss takes transformers' whole logits."""


def causal_lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if getattr(model.config, "model_type", None) in CHUNKED_HEAD_MODEL_TYPES:
        return run_as_forward(model, _chunked_causal_lm_loss, batch)
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return next_token_cross_entropy(logits, batch)


def _chunked_causal_lm_loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
    hidden = model.base_model(input_ids=batch[:, :-1], use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    return chunked_cross_entropy(hidden, head, batch[:, 1:], vocab_size=head.out_features)


def tokenizer_files(folder: Path) -> list[Path]:
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


def tokenizer_identity(folder: Path) -> str:
    """SHA-256 over the folder's tokenizer files (names and contents)."""
    files = tokenizer_files(folder)
    if not files:
        raise ModelError(f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
    return files_sha256(files)


class HFTokenizer:
    """A model folder's tokenizer (transformers AutoTokenizer, local files only)."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self.identity = tokenizer_identity(folder)
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelError(f"the tokenizer in {folder} cannot be loaded: {exc}") from None
        eos = self._tokenizer.eos_token_id
        if eos is None:
            raise ModelError(f"the tokenizer in {folder} has no eos_token: set it in tokenizer_config.json")
        self.eos_id = int(eos)
        self.vocab_size = len(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))


def tokenizer(config: ModelConfig) -> HFTokenizer:
    return HFTokenizer(model_folder(config))


# --- export -----------------------------------------------------------------------------


def export(state: Mapping[str, torch.Tensor], config: ModelConfig, folder: Path) -> Path:
    """config.json + model.safetensors + generation_config.json + tokenizer files in `folder`."""
    source = model_folder(config)
    hf_config = read_hf_config(source)
    model = _meta_model(hf_config)
    model.to_empty(device="cpu")
    _init_buffers(model)
    result = model.load_state_dict(
        {key: value.detach().to("cpu") for key, value in state.items()}, strict=False
    )
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [key for key in result.missing_keys if key not in tied]
    if missing or result.unexpected_keys:
        raise ModelError(
            f"the state dict does not fit {source / CONFIG_FILE}: missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )
    model.tie_weights()
    with published_folder(Path(folder)) as staging:
        model.save_pretrained(str(staging))
        if (source / GENERATION_CONFIG_FILE).is_file():  # keep the author's generation defaults
            shutil.copyfile(source / GENERATION_CONFIG_FILE, staging / GENERATION_CONFIG_FILE)
        for path in tokenizer_files(source):
            shutil.copyfile(path, staging / path.name)
    return Path(folder)


def load_exported(folder: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    read_hf_config(folder)  # the same clear errors as at training time
    return AutoModelForCausalLM.from_pretrained(
        str(folder), local_files_only=True, dtype=torch.float32
    ).eval()


SPEC = ModelSpec(
    kind=KIND,
    build=build,
    init_after_sharding=True,
    init_weights=init_weights,
    init_for_resume=init_for_resume,
    init_trained=init_trained,
    fsdp_units=fsdp_units,
    loss=causal_lm_loss,
    tokenizer=tokenizer,
    architecture=architecture,
    export=export,
    load_exported=load_exported,
)
