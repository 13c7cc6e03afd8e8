"""End to end, the fine-tuning demo as a user runs it: `rtp local --sft` fine-tunes the tiny
tied chat Llama with LoRA on the offline conversations through the whole pipeline and prints
where the adapter and the served model are; then `rtp local --model-source
models:/rtp-tiny-chat-llama@champion --chat-data ...` continues from that merged champion,
rendering the conversations with the version's own chat template.

One rank and synchronous saves keep it cheap (as tests/integration/test_local_model_source.py);
the registered artifacts themselves are tests/components/test_register_lora.py's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.launches,
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(900),
]

NAME = "rtp-tiny-chat-llama"
CHEAP = ["--nproc", "1", "--checkpoint-mode", "sync", "--steps", "4", "--checkpoint-every", "2"]


def rtp_local(workdir, *args: str) -> tuple[str, dict]:
    command = [sys.executable, "-m", "rtp_cli.main", "local", "--workdir", str(workdir), *CHEAP, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=420, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout, json.loads((workdir / "summary.json").read_text())


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("rtp-sft")
    stdout, summary = rtp_local(workdir, "--sft", "--run-name", "sft")
    return workdir, stdout, summary


def _version_tags(summary: dict, version: str) -> dict[str, str]:
    import mlflow

    client = mlflow.MlflowClient(summary["mlflow"]["tracking_uri"])
    return dict(client.get_model_version(NAME, version).tags)


def test_sft_trains_lora_and_prints_the_adapter_and_how_to_serve_the_model(sft_run):
    _, stdout, summary = sft_run
    adapter = summary["mlflow"]["adapter_uri"]
    assert summary["mlflow"]["model_name"] == NAME and summary["mlflow"]["version"] == "1"
    assert f"LoRA adapter     : {adapter}" in stdout
    assert f"mlflow models serve -m models:/{NAME}@champion" in stdout
    folder = Path(adapter.removeprefix("file://"))
    assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == "LORA"
    tags = _version_tags(summary, "1")
    assert tags["rtp.training_method"] == "lora" and tags["rtp.lora.registered"] == "merged"


def test_continual_from_the_merged_champion_on_conversations(sft_run):
    workdir, _, _ = sft_run
    conversations = workdir / "sft-demo" / "conversations.jsonl"
    _, summary = rtp_local(
        workdir,
        "--model-source",
        f"models:/{NAME}@champion",
        "--chat-data",
        str(conversations),
        "--method",
        "lora",
        "--run-name",
        "continued",
    )
    assert summary["mlflow"]["version"] == "2"
    tags = _version_tags(summary, "2")
    assert tags["rtp.parent.version"] == "1" and tags["rtp.lora.base_source"] == f"models:/{NAME}/1"
