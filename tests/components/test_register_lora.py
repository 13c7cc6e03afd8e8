"""Registering a LoRA checkpoint against a real `mlflow server`: the adapter in PEFT's format
loads with peft on its base and gives the checkpoint's logits, the merged version (exported
streamed in the base's bf16) loads with `from_pretrained` and equals peft's own merge, the
served merged version answers a chat request, and with `register_merged=false` the version is
the adapter on its base folder.

The checkpoint comes from the real `Trainer` in this process (one gloo rank, 3 LoRA steps) on a
tied tiny Llama stored in bf16 with a ChatML template."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import mlflow
import pytest
import torch

from components.mlflow_access import RetryPolicy
from components.register_model import lora_export, streamed_export
from components.register_model.register import register_checkpoint
from trainer.checkpointing import storage

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

FAST_RETRY = RetryPolicy(attempts=4, first_delay_s=0.2, max_delay_s=1.0)
PROMPT = torch.arange(20).reshape(1, 20) % 300


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """(config, checkpoint folder, base folder) of 3 LoRA steps on a bf16 tied tiny Llama."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rtp_support.demo_chat import CHATML_TEMPLATE
    from tests.hf_tiny import write_corpus, write_tiny_model, write_token_snapshot
    from trainer.config import build_config
    from trainer.loop import Trainer

    root = tmp_path_factory.mktemp("lora-register")
    fp32 = write_tiny_model(root / "fp32", "llama", tie=True)
    model_dir = root / "model"
    AutoModelForCausalLM.from_pretrained(str(fp32), dtype=torch.bfloat16).save_pretrained(str(model_dir))
    for tokenizer_file in fp32.glob("tokenizer*"):
        (model_dir / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    (model_dir / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    snapshot = write_token_snapshot(write_corpus(root / "corpus", documents=60), model_dir, root / "tokens")
    config = build_config(
        "tiny-cpu",
        [
            f"data.dataset_dir={snapshot}",
            f"model.model_dir={model_dir}",
            f"run.workdir={root / 'run'}",
            "model.seq_len=32",
            "run.steps=3",
            "run.seed=5",
            "checkpoint.mode=sync",
            "checkpoint.every_steps=3",
            "checkpoint.local_every_steps=0",
            "data.eval_windows=0",
            "resilience.prefork_workers=false",
            "training.method=lora",
            "training.lora_rank=4",
            "optimizer.lr=2e-2",
        ],
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("MLFLOW_TRACKING_URI", raising=False)  # no live metrics from a test
            trainer = Trainer(config)
        with trainer:
            summary = trainer.train()
    finally:
        dist.destroy_process_group()
        gc.unfreeze()  # the Trainer froze what it built
    assert summary.completed
    return config, Path(summary.checkpoint), model_dir


def _trained_logits(config, checkpoint: Path) -> torch.Tensor:
    """The trained model's logits: the fp32 base with the checkpoint's adapters, as trained."""
    from trainer.lora import build_model

    model = build_model(config, torch.device("cpu"))
    storage.load_model_weights(checkpoint, model)
    with torch.no_grad():
        return model.eval()(PROMPT).logits


@pytest.fixture(scope="module")
def tracking(mlflow_server):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        patch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
        patch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        mlflow.set_tracking_uri(mlflow_server)
        yield mlflow.MlflowClient(mlflow_server)


@pytest.fixture(scope="module")
def merged_version(tracking, lora_checkpoint):
    _, checkpoint, _ = lora_checkpoint
    result = register_checkpoint(str(checkpoint), "rtp-test-lora", "champion", retry=FAST_RETRY)
    return result, tracking.get_model_version(result.model_name, result.version)


def test_the_merged_export_is_peft_merge_in_the_source_dtype(lora_checkpoint, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config, checkpoint, _ = lora_checkpoint
    result = streamed_export.export_checkpoint(
        checkpoint,
        config.model,
        "test",
        tmp_path / "merged",
        tensors_from=lora_export.merged_source(config),
        max_shard_size=40_000,  # several files: the index too
    )
    assert result.dtype == "bfloat16" and len(result.files) > 1
    names = []
    for file_name in result.files:
        with safe_open(str(result.folder / file_name), framework="pt") as handle:
            in_file = list(handle.keys())
            assert {handle.get_tensor(name).dtype for name in in_file} == {torch.bfloat16}
        names += in_file
    assert "lm_head.weight" not in names and not any("lora_" in name for name in names)
    loaded = AutoModelForCausalLM.from_pretrained(str(result.folder), local_files_only=True).eval()
    assert loaded.dtype == torch.bfloat16 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    expected = lora_export.merged_reference(checkpoint, config, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT).logits, expected(PROMPT).logits)


def test_the_registered_adapter_loads_with_peft_on_its_base(lora_checkpoint, merged_version, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config, checkpoint, model_dir = lora_checkpoint
    result, version = merged_version
    meta = storage.read_meta(checkpoint)
    assert version.tags["rtp.lora.base_weights_sha256"] == meta["adapters"]["base_weights_sha256"]
    assert version.tags["rtp.lora.base_model_dir"] == str(model_dir)
    assert version.tags[lora_export.HOLDS_TAG] == "merged"
    folder = Path(mlflow.artifacts.download_artifacts(result.adapter_uri, dst_path=str(tmp_path)))
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        model_dir
    )
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        logits = PeftModel.from_pretrained(base, str(folder)).eval()(PROMPT).logits
    torch.testing.assert_close(logits, _trained_logits(config, checkpoint), rtol=0, atol=1e-5)


def test_the_merged_version_loads_with_from_pretrained(lora_checkpoint, merged_version, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, checkpoint, _ = lora_checkpoint
    result, _ = merged_version
    assert (result.alias, result.model_kind) == ("champion", "hf")
    root = Path(mlflow.artifacts.download_artifacts(result.model_uri, dst_path=str(tmp_path)))
    loaded = AutoModelForCausalLM.from_pretrained(str(root / "model"), local_files_only=True).eval()
    assert loaded.dtype == torch.bfloat16
    with torch.no_grad():
        logits = loaded(PROMPT).logits
    expected = lora_export.merged_reference(checkpoint, config, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(logits, expected(PROMPT).logits)
    # the merge itself is the trained model's (bf16 rounding apart)
    torch.testing.assert_close(logits.float(), _trained_logits(config, checkpoint), rtol=0, atol=0.1)
    assert AutoTokenizer.from_pretrained(str(root / "components" / "tokenizer")).chat_template


def test_the_served_merged_version_answers_a_chat_request(merged_version, mlflow_server, tmp_path):
    from tests.components.serving import served_chat_reply

    result, _ = merged_version
    request = {"messages": [{"role": "user", "content": "What does lzma.open do?"}], "max_tokens": 8}
    answer = served_chat_reply(f"models:/{result.model_name}@champion", mlflow_server, tmp_path, request)
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert answer["usage"]["completion_tokens"] <= 8


def test_without_register_merged_the_version_is_the_adapter_on_its_base(tracking, lora_checkpoint):
    from components.stage_data.errors import StageError
    from components.stage_model.registry_source import Reference, origin_from_version

    _, checkpoint, _ = lora_checkpoint
    result = register_checkpoint(
        str(checkpoint), "rtp-test-lora-adapter", "champion", retry=FAST_RETRY, register_merged=False
    )
    version = tracking.get_model_version(result.model_name, result.version)
    assert version.tags[lora_export.HOLDS_TAG] == "adapter"
    listing = mlflow.artifacts.list_artifacts(artifact_uri=f"{result.model_uri}/{lora_export.PEFT_FOLDER}")
    assert lora_export.has_adapter(listing)
    reply = mlflow.pyfunc.load_model(result.model_uri).predict(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )
    answer = reply[0] if isinstance(reply, list) else reply
    assert answer["choices"][0]["message"]["role"] == "assistant"
    with pytest.raises(StageError, match="LoRA adapter registered without its merged model"):
        origin_from_version(version, Reference(result.model_name, alias="champion"))
