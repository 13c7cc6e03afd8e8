"""Staging a model folder: the dataset staging code, under <mount>/rtp/models/<name>/."""

import json

import pytest

from components.stage_data.errors import StageError
from components.stage_model.model_folder import model_name_of, stage_model_folder


def test_the_model_name_is_the_last_segment_of_the_source():
    assert model_name_of("s3://bucket/models/tiny-llama/") == "tiny-llama"
    assert model_name_of("/data/models/qwen2-tiny") == "qwen2-tiny"
    assert model_name_of("tiny-llama") == "tiny-llama"  # a folder in the working directory
    for bad in ("s3://bucket", "s3://bucket/", "s3://b/x/..bad"):
        with pytest.raises(StageError):
            model_name_of(bad)


def test_a_model_folder_becomes_an_immutable_snapshot_and_restaging_transfers_nothing(tmp_path):
    source = tmp_path / "src" / "tiny-llama"
    source.mkdir(parents=True)
    (source / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (source / "model.safetensors").write_bytes(b"\0" * 1000)
    staged = stage_model_folder(str(source), str(tmp_path / "fsx"))
    assert staged["model_name"] == "tiny-llama"
    assert staged["model_dir"].startswith(
        str(tmp_path / "fsx" / "rtp" / "models" / "tiny-llama" / "snapshots")
    )
    assert (
        json.loads((tmp_path / "fsx/rtp/models/tiny-llama/current/config.json").read_text())["model_type"]
        == "llama"
    )
    again = stage_model_folder(str(source), str(tmp_path / "fsx"))
    assert again["model_dir"] == staged["model_dir"] and again["bytes_downloaded"] == 0


def test_a_folder_without_config_json_is_refused(tmp_path):
    source = tmp_path / "weights-only"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(StageError, match=r"no config\.json"):
        stage_model_folder(str(source), str(tmp_path / "fsx"))
