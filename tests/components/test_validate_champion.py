"""The champion scored by the training ranks (`data.eval_champion`), against a real `mlflow
server` on loopback: a Hugging Face champion (a tiny Llama with its own BPE tokenizer) is
loaded sharded over two training ranks of a byte-LM candidate and scored on the candidate's
holdout windows in bits per byte; validate decides from the record without downloading it,
with the same score as loading it whole; a moved alias falls back to today's path, or is
refused above the in-process bound."""

from __future__ import annotations

import json

import pytest

from components.register_model.register import register_checkpoint
from components.validate_checkpoint import champion as registry
from components.validate_checkpoint.validate import validate_checkpoint
from tests.components.test_register_hf import (  # noqa: F401 (fixtures)
    FAST_RETRY,
    _lineage_from,
    _validate,
    hf_checkpoints,
    tracking,
)
from trainer.checkpointing.storage import CheckpointError

pytestmark = [pytest.mark.integration, pytest.mark.launches, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def registered(hf_checkpoints, mlflow_server, tmp_path_factory):  # noqa: F811
    """`hf-champ`: v1 (6 steps) is the champion, v2 (1 step) a challenger."""
    import mlflow

    name = "hf-champ"
    mlflow.set_tracking_uri(mlflow_server)
    tmp = tmp_path_factory.mktemp("registered")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        for step, alias in ((6, "champion"), (1, "challenger")):
            validation = _validate(hf_checkpoints, step)
            register_checkpoint(
                hf_checkpoints[step], name, alias, _lineage_from(validation, tmp), retry=FAST_RETRY
            )
    return name


def _train(dataset_dir, workdir, name, nproc):
    from tests.distributed.conftest import run_training
    from trainer.config import resolve_config

    config = resolve_config(
        named={
            "dataset_dir": str(dataset_dir),
            "workdir": str(workdir),
            "steps": 2,
            "seed": 3,
            "checkpoint_mode": "sync",
        },  # the record, not the writer, is tested here
        overrides=["data.eval_windows=6", f"data.eval_champion={name}"],
    )
    return run_training(nproc, config)


def _no_download(*args, **kwargs):
    raise AssertionError("validate downloaded the champion")


def test_the_training_ranks_score_the_champion_and_validate_decides_without_downloading_it(
    tracking,  # noqa: F811 (the fixture)
    registered,
    dataset_dir,
    tmp_path,
    monkeypatch,
):
    summary = _train(dataset_dir, tmp_path, registered, nproc=2)
    record = json.loads((tmp_path / "eval.json").read_text())
    entry = record["champion"]
    assert entry["scored"] and (entry["model_name"], entry["version"]) == (registered, "1")
    assert entry["run_id"] == tracking.get_model_version(registered, "1").run_id
    assert len(entry["files_sha256"]) == 64 and entry["kind"] == "hf"
    # the files lie next to the run, on the shared volume
    assert (tmp_path / "champion" / "v1" / "model" / "config.json").is_file()

    with monkeypatch.context() as patch:
        patch.setattr(registry, "download_champion", _no_download)
        patch.setattr("mlflow.artifacts.download_artifacts", _no_download)
        result = validate_checkpoint(
            summary["checkpoint"], str(dataset_dir), 100.0, champion_model_name=registered, retry=FAST_RETRY
        )
    assert result.scored_by == "training" and result.champion_scored_by == "training"
    assert result.champion_version == "1"
    assert result.champion_bits_per_byte == pytest.approx(entry["bits_per_byte"], rel=1e-12)
    assert any(
        "scored by the training ranks" in check and "not downloaded here" in check for check in result.checks
    )

    # today's path (the champion loaded whole here, retokenized the same way) gives the same score
    here = validate_checkpoint(
        summary["checkpoint"],
        str(dataset_dir),
        100.0,
        champion_model_name=registered,
        retry=FAST_RETRY,
        eval_record="",
    )
    assert here.champion_scored_by == "validate" and here.champion_version == "1"
    # a byte-LM candidate against a BPE champion: other tokens, the same bytes of text
    assert entry["tokens"] != record["tokens"] and entry["bytes"] == record["bytes"]
    assert here.champion_bits_per_byte == pytest.approx(result.champion_bits_per_byte, rel=1e-6)
    assert here.champion_loss == pytest.approx(result.champion_loss, rel=1e-6)
    assert here.decision == result.decision

    # the alias moved to v2 since training: the record's score is not v2's
    tracking.set_registered_model_alias(registered, "champion", "2")
    try:
        moved = validate_checkpoint(
            summary["checkpoint"], str(dataset_dir), 100.0, champion_model_name=registered, retry=FAST_RETRY
        )
        assert moved.scored_by == "training" and moved.champion_scored_by == "validate"
        assert moved.champion_version == "2"
        assert moved.champion_bits_per_byte != pytest.approx(result.champion_bits_per_byte, rel=1e-6)
        assert any("but the hf-champ champion is v2 now" in check for check in moved.checks)
        # above the in-process bound the moved champion is refused in one line
        with pytest.raises(CheckpointError, match=r"data.eval_champion=hf-champ") as refused:
            validate_checkpoint(
                summary["checkpoint"],
                str(dataset_dir),
                100.0,
                champion_model_name=registered,
                retry=FAST_RETRY,
                max_in_process_bytes=1024,
            )
        assert "\n" not in str(refused.value) and "v2" in str(refused.value)
    finally:
        tracking.set_registered_model_alias(registered, "champion", "1")


def test_without_mlflow_or_a_champion_the_record_says_why_and_validate_scores_it(
    dataset_dir, tmp_path, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    summary = _train(dataset_dir, tmp_path, "anything", nproc=1)
    entry = json.loads((tmp_path / "eval.json").read_text())["champion"]
    assert entry == {
        "scored": False,
        "model_name": "anything",
        "reason": "MLflow is not configured (MLFLOW_TRACKING_URI is empty)",
    }
    assert summary["completed"]
