"""Export a DCP checkpoint of a Hugging Face model to safetensors, streamed, in the source's dtype.

The model is never built with its weights: names and shapes come from the model built on the
meta device from the source folder's config.json and from the checkpoint's DCP `.metadata`;
tensors are read a small group at a time (`dcp.load(..., no_dist=True)`, no process group),
checked finite, cast to the export dtype and appended to the safetensors file they belong
to, whose header was written first. Peak memory is one read group (the largest tensor at
least), not the model.

The folder is what `save_pretrained` writes and `from_pretrained` reads: `model.safetensors`,
or `model-0000i-of-0000N.safetensors` files of at most `max_shard_size` bytes each (a tensor
larger than that gets a file of its own) with `model.safetensors.index.json`
(`metadata.total_size`, `weight_map`); tied weights (`all_tied_weights_keys`, e.g. a tied
`lm_head.weight`) are left out as transformers leaves them out; config.json is the source's
with `dtype` set to the export dtype; generation_config.json and the tokenizer files are
copied. `rtp_export.json` records which checkpoint and settings it came from.

The export is published atomically (a staging folder renamed when complete) and reused when
a complete export of the same checkpoint with the same settings is already there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import struct
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpointing.storage import CheckpointError
from trainer.config import ModelConfig

log = logging.getLogger(__name__)

EXPORT_DTYPES = ("auto", "fp32", "bf16", "fp16")
"""`auto`: the source model's dtype (config.json `dtype` or `torch_dtype`; fp32 when absent)."""
DEFAULT_EXPORT_DTYPE = "auto"
DEFAULT_MAX_SHARD_SIZE = "5GB"
READ_GROUP_BYTES = 64 << 20
"""At most this many stored bytes are read from the checkpoint per `dcp.load` (one tensor when larger)."""
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MARKER_FILE = "rtp_export.json"
CONFIG_FILE = "config.json"
EXPORT_FOLDER = "export"

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CONFIG_NAMES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float": torch.float32,
    "half": torch.float16,
}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


class ExportError(CheckpointError):
    """The checkpoint cannot be exported, or an export does not hold what it should; the message says why
    (a CheckpointError: `rtp register` shows it as one line)."""


@dataclass(frozen=True, slots=True)
class ExportTensor:
    name: str
    """Its name in the safetensors files (what from_pretrained looks up)."""
    fqn: str
    """Its fully qualified name in the DCP checkpoint."""
    shape: tuple[int, ...]
    stored_dtype: torch.dtype
    dtype: torch.dtype
    """The export dtype."""

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)

    @property
    def stored_nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.stored_dtype)


@dataclass(frozen=True, slots=True)
class ExportResult:
    folder: Path
    dtype: str
    files: tuple[str, ...]
    total_bytes: int
    parameters: int
    reused: bool


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as config.json spells it."""
    return str(dtype).removeprefix("torch.")


# --- settings (pure) ----------------------------------------------------------------------


def parse_max_shard_size(value: str | int) -> int:
    """Bytes from 5000000000, "5GB" (decimal, as transformers counts) or "512MiB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.fullmatch(str(value).strip())
        if not match:
            raise ValueError(f"max_shard_size {value!r} is not a size: write e.g. 5GB, 500MB or 1073741824")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if size <= 0:
        raise ValueError(f"max_shard_size {value!r} must be above 0 bytes: write e.g. 5GB")
    return size


def source_dtype(hf_config: Mapping[str, Any]) -> torch.dtype:
    """The dtype a model folder's config.json declares (`dtype`, else `torch_dtype`); fp32 when absent."""
    declared = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if declared is None:
        return torch.float32
    dtype = _CONFIG_NAMES.get(str(declared).removeprefix("torch."))
    if dtype is None:
        raise ExportError(
            f"config.json declares dtype {declared!r}, which cannot be exported: "
            "set export_dtype to fp32, bf16 or fp16"
        )
    return dtype


def resolve_export_dtype(setting: str, hf_config: Mapping[str, Any]) -> torch.dtype:
    if setting not in EXPORT_DTYPES:
        raise ValueError(f"export_dtype {setting!r} is not one of {', '.join(EXPORT_DTYPES)}")
    return source_dtype(hf_config) if setting == "auto" else _TORCH_DTYPES[setting]


def plan_files(tensors: list[ExportTensor], max_shard_bytes: int) -> dict[str, list[ExportTensor]]:
    """File name -> its tensors, in order: a file is closed when the next tensor would take it
    over `max_shard_bytes`; one file is `model.safetensors`, several `model-0000i-of-0000N`."""
    groups: list[list[ExportTensor]] = []
    size = 0
    for tensor in tensors:
        if not groups or (size + tensor.nbytes > max_shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    if len(groups) <= 1:
        return {SINGLE_FILE: groups[0] if groups else []}
    count = len(groups)
    return {f"model-{i + 1:05d}-of-{count:05d}.safetensors": group for i, group in enumerate(groups)}


def safetensors_header(tensors: list[ExportTensor], metadata: Mapping[str, str]) -> bytes:
    """The 8-byte little-endian header length and the JSON header (padded with spaces to a
    multiple of 8, so the data that follows stays aligned) of a file holding `tensors` in order."""
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for tensor in tensors:
        entries[tensor.name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    blob = json.dumps(entries, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def index_json(files: Mapping[str, list[ExportTensor]], parameters: int) -> dict[str, Any]:
    """model.safetensors.index.json as transformers writes it."""
    return {
        "metadata": {
            "total_parameters": parameters,
            "total_size": sum(t.nbytes for group in files.values() for t in group),
        },
        "weight_map": {t.name: name for name, group in files.items() for t in group},
    }


def read_groups(tensors: list[ExportTensor], budget_bytes: int | None = None) -> Iterator[list[ExportTensor]]:
    """Consecutive tensors whose stored bytes fit `budget_bytes` (default READ_GROUP_BYTES)
    together (one tensor when larger)."""
    budget_bytes = READ_GROUP_BYTES if budget_bytes is None else budget_bytes
    group: list[ExportTensor] = []
    size = 0
    for tensor in tensors:
        if group and size + tensor.stored_nbytes > budget_bytes:
            yield group
            group, size = [], 0
        group.append(tensor)
        size += tensor.stored_nbytes
    if group:
        yield group


# --- what to export: names, shapes, dtypes ------------------------------------------------

MODEL_PREFIX = "model."
"""The checkpoint stores the model's state dict under "model" (`{"model": ..., "optim": ...}`)."""


def saved_tensors(model_config: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(the model's state-dict key, the name save_pretrained writes it under, its shape) of
    every tensor save_pretrained would write for this model (tied copies left out), from the
    model built on the meta device (no tensor data)."""
    from transformers.core_model_loading import revert_weight_conversion

    from trainer.models.hf_causal_lm import _meta_model, model_folder, read_hf_config

    meta_model: Any = _meta_model(read_hf_config(model_folder(model_config)))
    meta_model.tie_weights()
    tied = set(getattr(meta_model, "all_tied_weights_keys", {}) or {})
    state = {key: value for key, value in meta_model.state_dict().items() if key not in tied}
    # Saved names as save_pretrained gives them (transformers' renamings reverted); matched
    # back to the model's keys by tensor identity: a conversion that makes new tensors
    # (fused experts) cannot be streamed.
    by_id = {id(value): key for key, value in state.items()}
    saved = revert_weight_conversion(meta_model, dict(state))
    names = {}
    for saved_name, value in saved.items():
        if id(value) not in by_id:
            raise ExportError(
                f"{saved_name} is made by transformers' weight conversion on save: "
                "this architecture cannot be exported tensor by tensor"
            )
        names[by_id[id(value)]] = saved_name
    return [(key, names[key], tuple(value.shape)) for key, value in state.items()]


def export_plan(
    checkpoint_dir: str | Path, model_config: ModelConfig, dtype: torch.dtype
) -> list[ExportTensor]:
    """Every tensor save_pretrained would write for this model, with its DCP FQN and shapes
    checked against the checkpoint's metadata (no tensor data is read)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    tensors = []
    problems = []
    for key, saved_name, shape in saved_tensors(model_config):
        fqn = MODEL_PREFIX + key
        entry = stored.get(fqn)
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(f"{fqn} is not in the checkpoint")
            continue
        if tuple(entry.size) != shape:
            problems.append(f"{fqn} is {list(entry.size)} in the checkpoint, {list(shape)} by config.json")
            continue
        tensors.append(ExportTensor(saved_name, fqn, shape, entry.properties.dtype, dtype))
    if problems:
        raise CheckpointError(
            f"{checkpoint_dir} does not fit the model of {model_config.model_dir}: {'; '.join(problems[:3])}"
            + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        )
    return tensors


# --- writing ------------------------------------------------------------------------------

Reader = Callable[[list[ExportTensor]], dict[str, torch.Tensor]]
"""Reads a group of tensors: their values by `ExportTensor.fqn`, in any dtype (cast on write)."""


@dataclass(frozen=True, slots=True)
class TensorSource:
    """What an export writes: `plan(checkpoint_dir, model_config, dtype)` lists the tensors
    (names, shapes; no data read) and `reader(checkpoint_dir)` gives their values."""

    plan: Callable[[str | Path, ModelConfig, torch.dtype], list[ExportTensor]]
    reader: Callable[[str | Path], Reader]


def _dcp_reader(checkpoint_dir: str | Path) -> Reader:
    """Reads a group of tensors from the checkpoint in one process, without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    def read(group: list[ExportTensor]) -> dict[str, torch.Tensor]:
        state = {t.fqn: torch.empty(t.shape, dtype=t.stored_dtype) for t in group}
        try:
            dcp.load(state, storage_reader=FileSystemReader(str(checkpoint_dir)), no_dist=True)
        except Exception as exc:  # DCP raises a bare CheckpointException listing rank errors
            raise CheckpointError(f"cannot read {group[0].fqn} from {checkpoint_dir}: {exc}") from exc
        return state

    return read


def write_weights(
    folder: Path,
    files: Mapping[str, list[ExportTensor]],
    read: Reader,
    checkpoint_dir: str | Path,
) -> None:
    """Each file: its header, then its tensors' bytes in header order, read group by group."""
    for file_name, tensors in files.items():
        with (folder / file_name).open("wb") as handle:
            handle.write(safetensors_header(tensors, {"format": "pt"}))
            for group in read_groups(tensors):
                values = read(group)
                for tensor in group:
                    value = values.pop(tensor.fqn)
                    # A float64 sum is NaN or Inf exactly when an element is (finite fp32 values cannot overflow it).
                    if value.is_floating_point() and not torch.isfinite(value.sum(dtype=torch.float64)):
                        bad = int((~torch.isfinite(value)).sum())
                        raise CheckpointError(
                            f"tensor {tensor.fqn!r} in {checkpoint_dir} holds {bad} NaN or Inf value(s)"
                        )
                    cast = value.to(tensor.dtype).contiguous()
                    del value
                    handle.write(cast.view(torch.uint8).numpy().data)
                    del cast
            handle.flush()
            os.fsync(handle.fileno())


def _write_config(source: Path, staging: Path, dtype: torch.dtype, architecture: str) -> None:
    """The source's config.json with the export dtype (and the class, which MLflow reads)."""
    raw = json.loads((source / CONFIG_FILE).read_text())
    raw["dtype"] = dtype_name(dtype)
    if "torch_dtype" in raw:
        raw["torch_dtype"] = dtype_name(dtype)
    if not raw.get("architectures"):
        raw["architectures"] = [architecture]
    (staging / CONFIG_FILE).write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def export_folder(checkpoint_dir: str | Path) -> Path:
    """<run>/export/step_<N>/ for <run>/checkpoints/step_<N>/: beside the run's checkpoints."""
    checkpoint = Path(checkpoint_dir).resolve()
    return checkpoint.parent.parent / EXPORT_FOLDER / checkpoint.name


def _marker(checkpoint_sha256: str, dtype: torch.dtype, max_shard_bytes: int) -> dict[str, Any]:
    return {
        "checkpoint_sha256": checkpoint_sha256,
        "dtype": dtype_name(dtype),
        "max_shard_bytes": max_shard_bytes,
    }


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((folder / MARKER_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def export_checkpoint(
    checkpoint_dir: str | Path,
    model_config: ModelConfig,
    checkpoint_sha256: str,
    folder: str | Path | None = None,
    *,
    export_dtype: str = DEFAULT_EXPORT_DTYPE,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    tensors_from: TensorSource | None = None,
) -> ExportResult:
    """Export the checkpoint's model into `folder` (default `export_folder(checkpoint_dir)`),
    or reuse the complete export of the same checkpoint and settings found there. The
    checkpoint must have been verified (manifest, hashes) by the caller. `tensors_from` says which
    tensors to write and reads them (default: the checkpoint's own, `export_plan`; a LoRA
    checkpoint's merged model: `lora_export.merged_source`)."""
    from trainer.models.hf_causal_lm import GENERATION_CONFIG_FILE, model_folder, tokenizer_files

    target = Path(folder) if folder is not None else export_folder(checkpoint_dir)
    source = model_folder(model_config)
    dtype = resolve_export_dtype(export_dtype, json.loads((source / CONFIG_FILE).read_text()))
    max_shard_bytes = parse_max_shard_size(max_shard_size)
    tensors_from = tensors_from or TensorSource(export_plan, _dcp_reader)
    tensors = tensors_from.plan(checkpoint_dir, model_config, dtype)
    files = plan_files(tensors, max_shard_bytes)
    parameters = sum(_numel(t.shape) for t in tensors)
    marker = _marker(checkpoint_sha256, dtype, max_shard_bytes)
    result = ExportResult(
        target, dtype_name(dtype), tuple(files), sum(t.nbytes for t in tensors), parameters, reused=True
    )
    if target.is_dir() and _read_marker(target) == marker:
        check_export_headers(target, tensors)
        log.info("reusing the export of this checkpoint in %s", target)
        return result

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(target)
    # Unique per attempt: pods of two concurrent registrations may share a pid.
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        write_weights(staging, files, tensors_from.reader(checkpoint_dir), checkpoint_dir)
        if len(files) > 1:
            (staging / INDEX_FILE).write_text(
                json.dumps(index_json(files, parameters), indent=2, sort_keys=True) + "\n"
            )
        from trainer.models.hf_causal_lm import _meta_model, read_hf_config

        _write_config(source, staging, dtype, type(_meta_model(read_hf_config(source))).__name__)
        if (source / GENERATION_CONFIG_FILE).is_file():  # keep the author's generation defaults
            shutil.copyfile(source / GENERATION_CONFIG_FILE, staging / GENERATION_CONFIG_FILE)
        for path in tokenizer_files(source):
            shutil.copyfile(path, staging / path.name)
        check_export_headers(staging, tensors)
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")  # last: marks it complete
        if target.is_dir() and _read_marker(target) == marker:
            # A concurrent registration published the same export first: keep it (it may be uploading it).
            shutil.rmtree(staging, ignore_errors=True)
            return result
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("exported %s as %s in %d file(s) to %s", checkpoint_dir, dtype_name(dtype), len(files), target)
    return ExportResult(
        result.folder, result.dtype, result.files, result.total_bytes, parameters, reused=False
    )


STALE_STAGING_S = 6 * 3600
"""A staging folder untouched this long belongs to an export that was killed."""


def _remove_stale_staging(target: Path) -> None:
    for leftover in target.parent.glob(f".{target.name}.partial-*"):
        with contextlib.suppress(OSError):
            if time.time() - leftover.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(leftover, ignore_errors=True)


def _publish(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; an older export there (other settings, or torn) is moved
    aside first and removed after, so `target` is never a mix of the two."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- checks -------------------------------------------------------------------------------


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file; ExportError when it is torn or not one."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100 << 20:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise ExportError(f"{path} is not a readable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise ExportError(f"{path} is not a safetensors file: its header is not an object")
    header["__header_bytes__"] = 8 + length
    return header


def check_export_headers(folder: Path, tensors: list[ExportTensor]) -> None:
    """From the headers and the index only: every expected tensor present, once, with its
    shape and dtype; each file as long as its header says; the index's total_size its sum."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        weight_map: dict[str, str] = dict(index.get("weight_map", {}))
        file_names = sorted(set(weight_map.values()))
        declared_total = index.get("metadata", {}).get("total_size")
    else:
        file_names, weight_map, declared_total = [SINGLE_FILE], {}, None
    expected = {t.name: t for t in tensors}
    found: dict[str, str] = {}
    total = 0
    for file_name in file_names:
        path = folder / file_name
        if not path.is_file():
            raise ExportError(f"{path} is missing from the export")
        header = read_safetensors_header(path)
        data_end = 0
        for name, entry in header.items():
            if name.startswith("__"):
                continue
            tensor = expected.get(name)
            if tensor is None:
                raise ExportError(f"{path} holds {name}, which the model has no place for")
            if name in found:
                raise ExportError(f"{name} is in both {found[name]} and {file_name}")
            if weight_map and weight_map.get(name) != file_name:
                raise ExportError(f"{name} is in {file_name}, the index says {weight_map.get(name)}")
            dtype, shape = entry.get("dtype"), tuple(entry.get("shape", ()))
            begin, end = entry.get("data_offsets", (0, 0))
            if (
                shape != tensor.shape
                or dtype != SAFETENSORS_DTYPES[tensor.dtype]
                or end - begin != tensor.nbytes
            ):
                raise ExportError(
                    f"{name} in {path} is {dtype} {list(shape)}, expected "
                    f"{SAFETENSORS_DTYPES[tensor.dtype]} {list(tensor.shape)}"
                )
            found[name] = file_name
            data_end = max(data_end, end)
            total += end - begin
        size = path.stat().st_size
        if size != header["__header_bytes__"] + data_end:
            raise ExportError(
                f"{path} has {size} bytes, its header describes {header['__header_bytes__'] + data_end}"
            )
    if weight_map and set(weight_map) != set(expected):
        extra = sorted(set(weight_map) - set(expected))
        raise ExportError(
            f"{index_path} maps {len(extra)} tensor(s) the model has no place for, e.g. {extra[:3]}"
        )
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ExportError(
            f"{len(missing)} tensor(s) missing from the export in {folder}, e.g. {', '.join(missing[:3])}"
        )
    if declared_total is not None and declared_total != total:
        raise ExportError(f"{index_path} says total_size {declared_total}, the files hold {total} bytes")


LOAD_CHECK_MAX_PARAMETERS = 16_000_000
"""Up to this many parameters (64 MiB in fp32) the export is also loaded back with
from_pretrained and its logits compared with the checkpoint's; above it the header check
stands alone, because loading holds the model twice."""


def reference_model(checkpoint_dir: str | Path, model_config: ModelConfig, dtype: torch.dtype) -> Any:
    """The checkpoint's weights cast to `dtype` in the model transformers builds for that dtype
    (its buffers, e.g. rotary frequencies, stay as transformers makes them)."""
    from trainer.checkpointing.storage import load_model_weights
    from trainer.models import model_spec

    checkpoint_model = model_spec("hf").build(model_config, torch.device("cpu"))
    load_model_weights(checkpoint_dir, checkpoint_model)
    return model_with_state(checkpoint_model.state_dict(), model_config, dtype)


def model_with_state(state: Mapping[str, torch.Tensor], model_config: ModelConfig, dtype: torch.dtype) -> Any:
    """The model transformers builds for `dtype` holding `state` cast to `dtype`."""
    from transformers import AutoModelForCausalLM

    from trainer.models.hf_causal_lm import model_folder, read_hf_config

    model = AutoModelForCausalLM.from_config(read_hf_config(model_folder(model_config)), dtype=dtype)
    model.load_state_dict({key: value.to(dtype) for key, value in state.items()})
    model.tie_weights()
    return model.eval()


def check_export_loads(
    folder: Path,
    checkpoint_dir: str | Path,
    model_config: ModelConfig,
    dtype: torch.dtype,
    expected: Any = None,
) -> None:
    """from_pretrained(folder) gives exactly the logits of `expected` (default: the checkpoint's
    weights cast to `dtype`, `reference_model`)."""
    from transformers import AutoModelForCausalLM

    if expected is None:
        expected = reference_model(checkpoint_dir, model_config, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=dtype).eval()
    vocab = int(loaded.config.vocab_size)
    tokens = (torch.arange(16, dtype=torch.long).reshape(1, 16) * 7919) % vocab
    with torch.no_grad():
        want = expected(input_ids=tokens).logits
        got = loaded(input_ids=tokens).logits
    if not torch.equal(want, got):
        diff = float((want.float() - got.float()).abs().max())
        raise ExportError(
            f"the export in {folder} loads with from_pretrained but its logits differ from the checkpoint's "
            f"(max difference {diff:.3g}): do not register it; report this as a bug"
        )
