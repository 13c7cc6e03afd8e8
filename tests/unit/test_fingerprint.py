"""`model_sha256` streams the model one full tensor at a time and keeps its value.

The reference is the function as it was before it streamed (`_gathered_model_sha256`: the
whole model gathered on every rank, then hashed): for the same weights the streamed value
must be bit-equal to it (old run summaries still compare), whatever the world size, sharded
or not, on every rank; and no more than one gathered tensor may be alive at once.
"""

from __future__ import annotations

import gc
import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from tests.weights import state_dict_sha256
from trainer.checkpointing import model_sha256
from trainer.config import ModelConfig
from trainer.models import model_spec

pytestmark = pytest.mark.timeout(300)

TIED_NAMES = ("lm_head.weight", "model.embed_tokens.weight")
ROTARY_BUFFER = "model.rotary_emb.inv_freq"  # non-persistent: in no state dict
LAYERS, WIDTH = 8, 128


def _gathered_model_sha256(model: nn.Module) -> tuple[str, list[str]]:
    """The reference: model_sha256 before it streamed (its digest and the keys it hashed)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    digest = hashlib.sha256()
    for key in sorted(full):
        digest.update(key.encode())
        digest.update(full[key].detach().to("cpu").contiguous().numpy().tobytes())
    return digest.hexdigest(), sorted(full)


class _Stack(nn.Module):
    """Equal-size layers (so the whole model is LAYERS times its largest tensor) and a
    persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))
        self.register_buffer("seen", torch.arange(5))
        self.register_buffer("scratch", torch.ones(3), persistent=False)


def _byte_lm() -> nn.Module:
    torch.manual_seed(3)
    return model_spec("byte-lm").build(
        ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16), torch.device("cpu")
    )


def _hf_tied(model_dir: str) -> nn.Module:
    config = ModelConfig(kind="hf", model_dir=model_dir, init="pretrained")
    return model_spec("hf").build(config, torch.device("cpu"))


def _stack() -> nn.Module:
    torch.manual_seed(4)
    return _Stack()


def _sharded(model: nn.Module, units: list[nn.Module]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallelize import apply_fsdp

    return apply_fsdp(model, init_device_mesh("cpu", (dist.get_world_size(),)), units)


def _units(name: str, model: nn.Module) -> list[nn.Module]:
    if name == "stack":
        return list(model.layers)
    return model_spec("hf" if name == "hf-tied" else "byte-lm").fsdp_units(model)


MODELS = ("byte-lm", "hf-tied", "stack")


def _build(name: str, model_dir: str) -> nn.Module:
    return _hf_tied(model_dir) if name == "hf-tied" else _byte_lm() if name == "byte-lm" else _stack()


def _live_tensor_bytes() -> int:
    """Bytes of every distinct storage a plain tensor object alive now refers to."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _extra_bytes_while_gathering(fn, model: nn.Module) -> int:
    """Most bytes of plain tensors alive, beyond those alive before `fn(model)`, measured each
    time a DTensor is gathered (every full state dict and `full_tensor` redistributes)."""
    gc.collect()
    before = _live_tensor_bytes()
    peak = [0]
    redistribute = DTensor.redistribute

    def measured(self, *args, **kwargs):
        out = redistribute(self, *args, **kwargs)
        peak[0] = max(peak[0], _live_tensor_bytes() - before)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DTensor, "redistribute", measured)
        fn(model)
    return peak[0]


def _rank(rank: int, world: int, store_path: str, model_dir: str, out_dir: str) -> None:
    """One rank of a gloo group: every model sharded and unsharded, hashed both ways."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        result = {}
        for name in MODELS:
            model = _build(name, model_dir)
            result[f"{name}/unsharded"] = model_sha256(model)
            sharded = _sharded(model, _units(name, model))
            reference, keys = _gathered_model_sha256(sharded)
            result[f"{name}/sharded"] = model_sha256(sharded)
            result[f"{name}/reference"] = reference
            result[f"{name}/keys"] = keys
        stack = _sharded(_stack(), [])
        result["memory/streamed"] = _extra_bytes_while_gathering(model_sha256, stack)
        result["memory/gathered"] = _extra_bytes_while_gathering(_gathered_model_sha256, stack)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> str:
    from tests.hf_tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("fingerprint") / "model", "llama", tie=True))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tied_model_dir) -> list[dict]:
    """Both ranks' results of `_rank` in one 2-rank gloo group."""
    root = tmp_path_factory.mktemp("fingerprint-two-ranks")
    mp.start_processes(
        _rank,
        args=(2, str(root / "store"), tied_model_dir, str(root)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tied_model_dir) -> dict:
    """`_rank`'s results in a group of one, in this process."""
    root = tmp_path_factory.mktemp("fingerprint-one-rank")
    _rank(0, 1, str(root / "store"), tied_model_dir, str(root))
    return json.loads((root / "rank0.json").read_text())


@pytest.mark.parametrize("name", MODELS)
def test_the_streamed_fingerprint_equals_the_gathered_one_on_any_world_size(name, one_rank, two_ranks):
    rank0, rank1 = two_ranks
    expected = rank0[f"{name}/reference"]
    assert one_rank[f"{name}/reference"] == expected  # the reference itself does not depend on sharding
    for result in (one_rank, rank0, rank1):
        assert result[f"{name}/sharded"] == expected
        assert result[f"{name}/unsharded"] == expected


@pytest.mark.parametrize("name", MODELS)
def test_a_plain_modules_fingerprint_is_its_state_dicts(name, tied_model_dir):
    model = _build(name, tied_model_dir)
    assert model_sha256(model) == state_dict_sha256(model.state_dict())  # no process group needed


def test_tied_weights_count_under_both_names_and_non_persistent_buffers_not_at_all(two_ranks, tied_model_dir):
    keys = two_ranks[0]["hf-tied/keys"]
    model = _hf_tied(tied_model_dir)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert set(TIED_NAMES) <= set(keys)
    assert ROTARY_BUFFER in dict(model.named_buffers()) and ROTARY_BUFFER not in keys
    assert "seen" in two_ranks[0]["stack/keys"] and "scratch" not in two_ranks[0]["stack/keys"]


def test_only_one_gathered_tensor_is_alive_at_a_time(two_ranks):
    layer_bytes = WIDTH * WIDTH * 4
    for result in two_ranks:
        # The measurement sees a whole model gathered at once: LAYERS full layers.
        assert result["memory/gathered"] >= LAYERS * layer_bytes
        assert result["memory/streamed"] < 2 * layer_bytes  # one gathered layer at a time
