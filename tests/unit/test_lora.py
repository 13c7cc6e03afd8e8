"""LoRA (`training.method=lora`) through the real `Trainer`, in this process on one gloo rank:
the base stays bit for bit the model folder's, only the adapters train and are checkpointed,
a checkpoint is refused against another base, and the export loads with peft and transformers.
The multi-rank recovery paths are tests/distributed/test_lora.py's."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from trainer.checkpointing import storage
from trainer.config import ConfigError, build_config
from trainer.loop import Trainer
from trainer.lora import base_name, base_weights_sha256, is_adapter

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("single_rank_group")]

LORA = ["training.method=lora", "training.lora_rank=4", "optimizer.lr=1e-2"]


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A tied tiny Llama, another base of the same architecture, and tokens for them."""
    from tests.hf_tiny import write_corpus, write_tiny_model, write_token_snapshot

    root = tmp_path_factory.mktemp("lora")
    model_dir = write_tiny_model(root / "model", "llama", tie=True)
    other_base = write_tiny_model(root / "other", "llama", tie=True, seed=1)
    snapshot = write_token_snapshot(write_corpus(root / "corpus", documents=60), model_dir, root / "tokens")
    return model_dir, other_base, snapshot


def _config(snapshot: Path, model_dir: Path, workdir: Path, *overrides: str):
    return build_config(
        "tiny-cpu",
        [
            f"data.dataset_dir={snapshot}",
            f"model.model_dir={model_dir}",
            f"run.workdir={workdir}",
            "model.seq_len=32",
            "run.steps=4",
            "run.seed=3",
            "checkpoint.mode=sync",
            "checkpoint.every_steps=2",
            "checkpoint.local_every_steps=0",
            "data.eval_windows=0",
            "resilience.prefork_workers=false",
            *LORA,
            *overrides,
        ],
    )


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters(remove_duplicate=False)
    }


@pytest.fixture(scope="module")
def lora_run(tiny_inputs, tmp_path_factory):
    """4 LoRA steps in this process: (config, summary, the model's full parameters after them)."""
    import torch.distributed as dist

    model_dir, _, snapshot = tiny_inputs
    workdir = tmp_path_factory.mktemp("lora-run")
    config = _config(snapshot, model_dir, workdir)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("MLFLOW_TRACKING_URI", raising=False)  # no live metrics from a test
            trainer = Trainer(config)
        with trainer:
            summary = trainer.train()
            after = _full_state(trainer.model)
            tied = trainer.model.get_output_embeddings().weight is trainer.model.get_input_embeddings().weight
            optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
            optimized_names = [n for n, p in trainer.model.named_parameters() if id(p) in optimized]
    finally:
        dist.destroy_process_group()
        gc.unfreeze()  # the Trainer froze what it built
    return config, summary, after, tied, optimized_names


def test_lora_leaves_every_base_parameter_bit_identical(tiny_inputs, lora_run):
    from safetensors.torch import load_file

    model_dir, _, _ = tiny_inputs
    _, summary, after, tied, _ = lora_run
    stored = load_file(str(model_dir / "model.safetensors"))
    base = {name: value for name, value in after.items() if not is_adapter(name)}
    assert summary.completed and len(base) > 0
    for name, value in base.items():
        stored_name = base_name(name) if base_name(name) in stored else "model.embed_tokens.weight"
        assert torch.equal(value, stored[stored_name]), f"{name} changed in training"
    assert tied  # the head still shares the (frozen) embedding


def test_only_the_adapters_train(lora_run):
    _, summary, after, _, optimized_names = lora_run
    adapters = {name: value for name, value in after.items() if is_adapter(name)}
    assert adapters and sorted(optimized_names) == sorted(adapters)
    # peft's initialization sets every B to zero: training moved them.
    assert all(value.abs().sum() > 0 for name, value in adapters.items() if ".lora_B." in name)
    assert summary.losses[-1]["loss"] < summary.losses[0]["loss"]


def test_a_lora_checkpoint_holds_only_the_adapters_and_their_adamw_state(tiny_inputs, lora_run):
    from components.validate_checkpoint.validate import stored_tensor_shapes

    model_dir, _, _ = tiny_inputs
    config, summary, after, _, _ = lora_run
    checkpoint = Path(summary.checkpoint)
    keys = stored_tensor_shapes(checkpoint)
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model_keys == {name for name in after if is_adapter(name)}
    optimizer_params = {
        k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")
    }
    assert optimizer_params == model_keys
    # The adapters and their two AdamW moments (and step counts), where a full run's checkpoint
    # holds every weight and its moments: 8% of this tiny model's parameters are adapters.
    adapter_numel = sum(v.numel() for name, v in after.items() if is_adapter(name))
    full_numel = sum(v.numel() for v in after.values())
    stored_numel = sum(torch.Size(shape).numel() for shape in keys.values())
    assert stored_numel == 3 * adapter_numel + len(model_keys)
    assert stored_numel < 0.1 * 3 * full_numel
    meta = storage.read_meta(checkpoint)
    assert meta["adapters"]["base_weights_sha256"] == base_weights_sha256(model_dir)
    assert summary.model_sha256  # what validation compares: the adapters' hash
    from components.validate_checkpoint.validate import validate_checkpoint

    result = validate_checkpoint(
        str(checkpoint), config.data.dataset_dir, max_loss=100.0, require_optimizer_state=True, eval_record=""
    )
    assert result.weights_sha256 == summary.model_sha256
    assert any("LoRA adapters on the base model" in line for line in result.checks)


def test_a_lora_checkpoint_is_refused_against_another_base_in_one_line(tiny_inputs, lora_run, tmp_path):
    import shutil

    _, other_base, snapshot = tiny_inputs
    config, *_ = lora_run
    shutil.copytree(Path(config.run.workdir) / "checkpoints", tmp_path / "checkpoints")
    other = _config(snapshot, other_base, tmp_path)
    with pytest.raises(storage.CheckpointError) as refused:
        Trainer(other)
    message = str(refused.value)
    assert "\n" not in message
    assert "its LoRA adapters belong to a base model with weights" in message
    assert "give the base the adapters were trained on" in message


def test_lora_is_refused_for_the_byte_lm_in_one_line():
    with pytest.raises(ConfigError, match=r"^training.method=lora needs a Hugging Face model .*method=full$"):
        build_config("tiny-cpu", ["training.method=lora"])


def test_the_adapter_loads_with_peft_and_the_merged_model_with_transformers(tiny_inputs, lora_run, tmp_path):
    """The checkpoint's adapters in PEFT's format, and merged into the base, give the logits of
    the trained model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.lora import build_model, export_adapter, export_merged

    model_dir, _, _ = tiny_inputs
    config, summary, _, _, _ = lora_run
    trained = build_model(config, torch.device("cpu"))
    storage.load_model_weights(summary.checkpoint, trained)
    x = torch.arange(20).reshape(1, 20) % 300
    expected = trained.eval()(x).logits

    adapter = export_adapter(trained.state_dict(), config, tmp_path / "adapter")
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(adapter)).eval()
    torch.testing.assert_close(with_adapter(x).logits, expected, rtol=0, atol=1e-5)

    merged = export_merged(trained.state_dict(), config, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(
        str(merged), local_files_only=True, dtype=torch.float32
    ).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(loaded(x).logits, expected, rtol=0, atol=1e-5)


def test_lora_is_refused_on_random_weights_in_one_line(tiny_inputs):
    model_dir, _, _ = tiny_inputs
    with pytest.raises(
        ConfigError, match=r"^training.method=lora adapts a pretrained model's weights.*method=full$"
    ):
        build_config("tiny-cpu", [f"model.model_dir={model_dir}", "model.init=random", *LORA])
