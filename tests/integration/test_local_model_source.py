"""End to end with a Hugging Face model: `rtp make-tiny-model` writes a tiny Llama folder
offline (its output head tied to the embeddings, as in SmolLM and Llama-3.2-1B), and `rtp local --model-source FOLDER` uploads it into the embedded S3, tokenizes
the demo corpus with its tokenizer, and runs stage -> stage model -> train -> validate
through kfp.local. What each step produced is checked against the files it left.

Kept cheap: the pipeline's process start-ups (kfp tasks, the launcher, each rank, MLflow's
first sqlite migration) are most of its cost, so the run trains with one rank and
synchronous saves (NVRx's asynchronous writer spawns two more processes per rank).
Sharding an HF model over two ranks, resharding and asynchronous saves are covered by
tests/distributed/test_hf_models.py and the checkpoint tests."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rtp_cli.main import main

# make test-slow: test_local_pipeline is the `rtp local` of `make test`; what this run adds (a
# model folder staged, its tokenizer, the transformers flavor) the component tests prove too.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.launches,
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(600),
]


def rtp(*args: str, timeout_s: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rtp_cli.main", *args]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def model_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rtp-local-hf")
    model_dir = root / "tiny-llama"
    # In this process (torch and transformers are loaded already): the command's handler,
    # as `rtp make-tiny-model --arch llama DIR` runs it, without a fresh interpreter.
    assert main(["make-tiny-model", "--arch", "llama", "--tie-embeddings", str(model_dir)]) == 0
    workdir = root / "work"
    # max_loss is in nats per byte: a few steps of a random 512-token model pass 10, so the
    # run registers the model in MLflow (transformers flavor).
    result = rtp(
        "local",
        "--model-source",
        str(model_dir),
        "--workdir",
        str(workdir),
        "--nproc",
        "1",
        "--checkpoint-mode",
        "sync",
        "--steps",
        "6",
        "--checkpoint-every",
        "3",
        "--max-loss",
        "10",
        "--run-name",
        "hf-e2e",
        timeout_s=500,
    )
    return model_dir, workdir, result.stdout, json.loads((workdir / "summary.json").read_text())


def test_the_model_folder_is_staged_from_s3(model_run):
    model_dir, workdir, stdout, summary = model_run
    staged = Path(summary["model_dir"])
    assert staged.parent == workdir / "fsx/rtp/models/tiny-llama/snapshots"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (staged / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert "uploaded model folder" in stdout and "s3://rtp-demo/models/tiny-llama/" in stdout


def test_the_data_is_the_demo_corpus_in_the_models_tokens(model_run):
    from trainer.models.hf_causal_lm import tokenizer_identity

    model_dir, workdir, stdout, summary = model_run
    snapshot = Path(summary["dataset_snapshot"])
    assert snapshot.parent == workdir / "fsx/rtp/datasets/demo-corpus-tiny-llama/snapshots"
    index = json.loads((snapshot / "index.json").read_text())
    assert index["tokenizer"] == tokenizer_identity(model_dir) and index["dtype"] == "uint16"
    assert "tokenized the demo corpus with tiny-llama's tokenizer" in stdout


def test_the_model_trains_and_validation_decides(model_run):
    _, workdir, stdout, summary = model_run
    assert summary["steps"] == 6
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint == workdir / "fsx/rtp/runs/hf-e2e/checkpoints/step_6"
    assert (checkpoint / "COMMITTED").is_file()
    config = json.loads((workdir / "fsx/rtp/runs/hf-e2e/train/config.json").read_text())
    assert config["model"]["kind"] == "hf" and config["model"]["init"] == "pretrained"
    assert config["model"]["model_dir"] == summary["model_dir"]
    # A random 512-token model starts near ln(512) = 6.2 nats per token; a few steps move it.
    assert 0 < summary["final_loss"] < 7 and 0 < summary["holdout_loss"] < 7
    assert summary["decision"] == "champion" and summary["mlflow"]["version"] == "1"
    assert set(summary["elapsed_s"]) == {"stage", "train", "validate", "register"}
    assert "pipeline finished" in stdout and "model            : " + summary["model_dir"] in stdout


def test_the_registered_model_loads_with_the_transformers_flavor(model_run, tmp_path, monkeypatch):
    import mlflow

    _, _, _, summary = model_run
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where MLflow fetches the MLmodel file first
    mlflow.set_tracking_uri(summary["mlflow"]["tracking_uri"])
    components = mlflow.transformers.load_model(
        f"models:/{summary['mlflow']['model_name']}@champion",
        return_type="components",
        dst_path=str(tmp_path),  # MLflow's default is a new folder in /tmp, never removed
    )
    assert type(components["model"]).__name__ == "LlamaForCausalLM"
    # the tie survives the export and the registry: one weight, kept in config.json
    model = components["model"]
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert components["tokenizer"]("def add").input_ids


def test_a_registered_versions_tokenizer_is_found_for_continual_training(model_run, tmp_path, monkeypatch):
    """`rtp local --model-source models:/NAME@champion` tokenizes the demo corpus with the
    version's tokenizer: its files are found where MLflow downloads them."""
    import mlflow

    from rtp_cli.local_model import download_tokenizer_files
    from trainer.models.hf_causal_lm import tokenizer_identity

    model_dir, _, _, summary = model_run
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mlflow.set_tracking_uri(summary["mlflow"]["tracking_uri"])
    kind, folder = download_tokenizer_files(
        f"models:/{summary['mlflow']['model_name']}@champion", tmp_path / "tok"
    )
    assert kind == "hf" and folder is not None
    assert tokenizer_identity(folder) == tokenizer_identity(model_dir)
    assert (folder / "config.json").is_file() and not list(folder.glob("*.safetensors"))
