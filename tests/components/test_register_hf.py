"""Validate + register a Hugging Face model against a real `mlflow server` on loopback: bits
per byte beside nats per token, the champion comparison per byte (also across tokenizers),
the Hugging Face-format version loaded three ways with the checkpoint's exact logits, and
idempotent registration.

The checkpoints are one-rank DCP checkpoints of a tiny Llama (tests/hf_tiny.py), written
with `benchmarks.make_checkpoint.save_checkpoint` (the trainer's on-disk format) after a
few AdamW steps on the training split: much faster than the launcher, and the same format."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import mlflow
import pytest
import torch

from benchmarks.make_checkpoint import save_checkpoint
from components.mlflow_access import RetryPolicy
from components.register_model.lineage import Lineage, validation_figures
from components.register_model.register import register_checkpoint
from components.validate_checkpoint.validate import report_markdown, validate_checkpoint
from tests.hf_tiny import write_corpus, write_tiny_model, write_token_snapshot
from trainer.checkpointing import load_model_weights
from trainer.config import resolve_config
from trainer.data import StepSampler, load_tokens, split_files
from trainer.models import model_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

FAST_RETRY = RetryPolicy(attempts=4, first_delay_s=0.2, max_delay_s=1.0)


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """A tiny pretrained Llama, the demo corpus tokenized with its tokenizer, and committed
    one-rank checkpoints after 1 and 6 AdamW steps (the later one fits the data better)."""
    import torch.distributed as dist

    root = tmp_path_factory.mktemp("hf-register")
    model_dir = write_tiny_model(root / "model", "llama")
    snapshot = write_token_snapshot(
        write_corpus(root / "corpus", documents=120), model_dir, root / "snapshot"
    )
    config = resolve_config(
        named={"model_dir": str(model_dir), "model_init": "pretrained", "dataset_dir": str(snapshot)},
        overrides=["model.seq_len=32"],
    )
    spec = model_spec(config.model.kind)
    torch.manual_seed(0)
    model = spec.build(config.model, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_files, _ = split_files(snapshot, config.data.holdout_fraction)
    sampler = StepSampler(load_tokens(train_files), config.model.seq_len, 8, seed=0, rank=0)
    checkpoints = {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for step in range(1, 7):
            optimizer.zero_grad()
            spec.loss(model, sampler.batch(step)).backward()
            optimizer.step()
            if step in (1, 6):
                save_checkpoint(
                    root / "checkpoints",
                    step,
                    model,
                    optimizer,
                    meta={"config": config.to_dict()},
                    rank_extra={},
                )
                checkpoints[step] = str(root / "checkpoints" / f"step_{step}")
    finally:
        dist.destroy_process_group()
    return {"model_dir": model_dir, "snapshot": snapshot, "config": config, **checkpoints}


@pytest.fixture
def tracking(mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    return mlflow.MlflowClient(mlflow_server)


def _checkpoint_model(hf_checkpoints, step):
    config = hf_checkpoints["config"]
    model = model_spec("hf").build(config.model, torch.device("cpu"))
    load_model_weights(hf_checkpoints[step], model)
    return model.eval()


def _validate(hf_checkpoints, step, name=""):
    return validate_checkpoint(
        hf_checkpoints[step],
        str(hf_checkpoints["snapshot"]),
        100.0,
        champion_model_name=name,
        retry=FAST_RETRY,
    )


def _lineage_from(result, tmp_path) -> Lineage:
    """What the register component reads: the validate step's record (steps/validate.json)."""
    record = tmp_path / f"validate-{result.step}.json"
    record.write_text(json.dumps(result.as_dict()))
    return Lineage(validation_figures=validation_figures(record))


def test_bits_per_byte_counts_the_bytes_the_tokens_decode_to(hf_checkpoints):
    result = _validate(hf_checkpoints, 6)
    tokenizer = model_spec("hf").tokenizer(hf_checkpoints["config"].model)
    # BPE tokens cover several bytes each: fewer bits per byte than nats per token / ln 2
    assert result.evaluated_bytes > result.evaluated_tokens > 0
    assert result.holdout_bits_per_byte == pytest.approx(
        result.holdout_loss * result.evaluated_tokens / result.evaluated_bytes / math.log(2), rel=1e-9
    )
    assert tokenizer.identity  # the spec's tokenizer is what decoded them
    report = report_markdown(result)
    assert f"| holdout loss (bits/byte) | {result.holdout_bits_per_byte:.4f} |" in report
    assert f"| holdout loss (nats/token) | {result.holdout_loss:.4f} |" in report
    # max_loss is compared with nats per byte = bits per byte x ln 2
    just_below = result.holdout_nats_per_byte * 0.999
    rejected = validate_checkpoint(hf_checkpoints[6], str(hf_checkpoints["snapshot"]), just_below)
    assert rejected.decision == "reject"
    assert any("nats/byte" in reason and "bits/byte" in reason for reason in rejected.reasons)


def test_hf_version_loads_three_ways_with_the_checkpoints_logits(
    tracking, hf_checkpoints, dataset_dir, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = "rtp-test-hf"
    validation = _validate(hf_checkpoints, 6, name)
    assert validation.decision == "champion" and validation.champion_version is None
    first = register_checkpoint(
        hf_checkpoints[6], name, "champion", _lineage_from(validation, tmp_path), retry=FAST_RETRY
    )
    assert (first.version, first.alias, first.created, first.model_kind) == ("1", "champion", True, "hf")
    tags = tracking.get_model_version(name, "1").tags
    assert tags["rtp.model_kind"] == "hf" and tags["rtp.model_seq_len"] == "32"
    assert float(tags["rtp.validate.holdout_bits_per_byte"]) == pytest.approx(
        validation.holdout_bits_per_byte
    )
    assert float(tags["rtp.validate.holdout_nats_per_token"]) == pytest.approx(validation.holdout_loss)

    # the same checkpoint again: the same version, not a second one
    again = register_checkpoint(hf_checkpoints[6], name, "champion", retry=FAST_RETRY)
    assert (again.version, again.created, again.model_kind) == ("1", False, "hf")
    assert len(tracking.search_model_versions(f"name = '{name}'")) == 1

    expected = _checkpoint_model(hf_checkpoints, 6)
    tokens = torch.tensor([[5, 17, 42, 99, 123, 7, 250, 3]])
    with torch.no_grad():
        expected_logits = expected(input_ids=tokens).logits

    # 1. plain transformers on the downloaded artifacts
    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{name}@champion", dst_path=str(tmp_path / "dl")
        )
    )
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {
        p.name for p in (local / "model").iterdir()
    }
    loaded = AutoModelForCausalLM.from_pretrained(str(local / "model"), local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, expected_logits)
    tokenizer = AutoTokenizer.from_pretrained(str(local / "components" / "tokenizer"), local_files_only=True)
    assert tokenizer.encode("def add(a, b):") == model_spec("hf").tokenizer(
        hf_checkpoints["config"].model
    ).encode("def add(a, b):")

    # 2. MLflow's transformers flavor
    # Downloaded into tmp_path (without dst_path MLflow leaves a copy in /tmp each time; the
    # flavor's loaders also fetch the MLmodel file into a folder of their own first).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    downloads = [tmp_path / f"load-{part}" for part in ("components", "pipeline", "pyfunc")]
    for folder in downloads:
        folder.mkdir()
    components = mlflow.transformers.load_model(
        f"models:/{name}@champion", return_type="components", dst_path=str(downloads[0])
    )
    with torch.no_grad():
        assert torch.equal(components["model"].eval()(input_ids=tokens).logits, expected_logits)
    pipeline = mlflow.transformers.load_model(f"models:/{name}@champion", dst_path=str(downloads[1]))
    assert pipeline.task == "text-generation"

    # 3. pyfunc, with the generation length as a param
    pyfunc = mlflow.pyfunc.load_model(f"models:/{name}@champion", dst_path=str(downloads[2]))
    short = pyfunc.predict(["def add"], params={"max_new_tokens": 1})
    longer = pyfunc.predict(["def add"], params={"max_new_tokens": 12})
    assert len(short) == 1 and isinstance(short[0], str)
    assert len(tokenizer.encode(longer[0])) > len(tokenizer.encode(short[0]))

    # 4. as a model source (continual training): staged verified, the same tokenizer, and
    # training starts from exactly the registered weights
    from components.stage_model.registry_source import stage_registered_model
    from trainer.models.hf_causal_lm import tokenizer_identity

    staged = Path(
        stage_registered_model(f"models:/{name}@champion", tmp_path / "fsx", FAST_RETRY)["model_dir"]
    )
    assert tokenizer_identity(staged) == tags["rtp.tokenizer"]
    warm_config = resolve_config(named={"model_dir": str(staged)}, overrides=["model.seq_len=32"])
    assert (warm_config.model.kind, warm_config.model.init) == ("hf", "pretrained")
    warm = model_spec("hf").build(warm_config.model, torch.device("cpu")).eval()
    with torch.no_grad():
        assert torch.equal(warm(input_ids=tokens).logits, expected_logits)
    # The train step compares the parent's tokenizer with the dataset's before any rank starts.
    from components.train.train import TrainRequest
    from trainer.data import DataError

    def request(data) -> TrainRequest:
        return TrainRequest(
            dataset_dir=str(data), run_folder=tmp_path / "fsx/rtp/runs/warm", model_dir=str(staged)
        )

    request(hf_checkpoints["snapshot"]).config()
    with pytest.raises(
        DataError, match=r"tokenized as bytes but the model uses tokenizer .*rtp prepare-data --tokenizer"
    ):
        request(dataset_dir).config()


def test_champion_comparison_uses_bits_per_byte(tracking, hf_checkpoints, tmp_path):
    name = "rtp-test-hf-promotion"
    early = _validate(hf_checkpoints, 1, name)
    register_checkpoint(
        hf_checkpoints[1], name, early.decision, _lineage_from(early, tmp_path), retry=FAST_RETRY
    )

    late = _validate(hf_checkpoints, 6, name)
    assert late.champion_version == "1"
    # the champion is scored again on the same holdout windows, and recorded what it scored
    assert late.champion_bits_per_byte == pytest.approx(early.holdout_bits_per_byte, rel=1e-6)
    assert late.champion_recorded_bits_per_byte == pytest.approx(early.holdout_bits_per_byte, rel=1e-6)
    assert late.delta_bits_per_byte == pytest.approx(late.champion_bits_per_byte - late.holdout_bits_per_byte)
    assert late.delta == pytest.approx(late.delta_bits_per_byte * math.log(2))
    assert late.delta_bits_per_byte > 0 and late.decision == "champion"

    # a min_improvement (nats per byte) the gain does not reach keeps the champion
    held = validate_checkpoint(
        hf_checkpoints[6],
        str(hf_checkpoints["snapshot"]),
        100.0,
        min_improvement=late.delta * 1.01,
        champion_model_name=name,
        retry=FAST_RETRY,
    )
    assert held.decision == "challenger"


def test_a_byte_lm_champion_registered_by_an_older_rtp_is_compared_per_byte(
    tracking, hf_checkpoints, trained_run, tmp_path
):
    """A byte-LM champion without the rtp.validate/rtp.model_* tags (what versions registered
    before them carry) is scored on the HF candidate's holdout text, as bytes."""
    name = "rtp-test-hf-vs-bytes"
    old = register_checkpoint(trained_run["checkpoint"], name, "champion", retry=FAST_RETRY)
    for tag in ("rtp.model_kind", "rtp.model_seq_len", "rtp.tokenizer"):
        tracking.delete_model_version_tag(name, old.version, tag)

    result = _validate(hf_checkpoints, 6, name)
    assert result.champion_version == old.version
    assert result.champion_recorded_bits_per_byte is None
    assert result.champion_bits_per_byte is not None and 0 < result.champion_bits_per_byte < 8
    assert result.champion_loss == pytest.approx(result.champion_bits_per_byte * math.log(2), rel=1e-9)
    beats = result.delta_bits_per_byte is not None and result.delta_bits_per_byte > 0
    assert result.decision == ("champion" if beats else "challenger")
    assert "not recorded (registered by an older rtp)" in report_markdown(result)
