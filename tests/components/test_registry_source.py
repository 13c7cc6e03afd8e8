"""A registered version as the model source (continual training), against a real `mlflow server`
on loopback: staged verified and once, resolved once while the alias moves, a tampered file
refused, the parent in the child's tags and a three-version chain walked back, and one line
for each bad reference.

The byte LM checkpoints are the session's one-rank run (`trained_run`, steps 10 and 20); the
children are one-rank checkpoints of a model built from the staged parent folder, saved
with `benchmarks.make_checkpoint.save_checkpoint` (the trainer's on-disk format)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import pytest
import torch

from benchmarks.make_checkpoint import save_checkpoint
from components.mlflow_access import RetryPolicy
from components.register_model.file_manifest import FILES_TAG, MANIFEST_FILE
from components.register_model.lineage import Lineage, walk_lineage
from components.register_model.register import register_checkpoint
from components.stage_data.errors import StageError
from components.stage_model.registry_source import origin_of, stage_registered_model
from components.validate_checkpoint.validate import load_validated_model, validate_checkpoint
from trainer.config import resolve_config
from trainer.models import model_spec

pytestmark = pytest.mark.integration

FAST_RETRY = RetryPolicy(attempts=3, first_delay_s=0.2, max_delay_s=1.0)


@pytest.fixture
def tracking(mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    return mlflow.MlflowClient(mlflow_server)


def _checkpoints(trained_run) -> tuple[str, str]:
    late = trained_run["checkpoint"]
    return late.replace("step_20", "step_10"), late


def _child_checkpoint(parent_dir: str, dataset_dir, root: Path, steps: int = 2) -> str:
    """A one-rank checkpoint of a byte LM that started from the staged `parent_dir` (pretrained)."""
    config = resolve_config(named={"model_dir": parent_dir, "dataset_dir": str(dataset_dir)})
    assert config.model.kind == "byte-lm" and config.model.init == "pretrained"
    model = model_spec("byte-lm").build(config.model, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randint(0, 256, (2, 8))).float().pow(2).mean().backward()
        optimizer.step()
    save_checkpoint(root, steps, model, optimizer, meta={"config": config.to_dict()}, rank_extra={})
    return str(root / f"step_{steps}")


def test_a_registered_byte_lm_is_staged_verified_once_and_warm_starts(tracking, trained_run, tmp_path):
    name = "rtp-test-source"
    early, _ = _checkpoints(trained_run)
    register_checkpoint(early, name, "champion", retry=FAST_RETRY)
    assert tracking.get_model_version(name, "1").tags[FILES_TAG]

    staged = stage_registered_model(f"models:/{name}@champion", tmp_path, FAST_RETRY)
    folder = Path(staged["model_dir"])
    assert folder == tmp_path / "rtp/models" / name / "versions/1"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["weights.safetensors", "config.json", "tokenizer.json", MANIFEST_FILE]
    )
    assert staged["model_kind"] == "byte-lm" and staged["bytes_downloaded"] > 0
    assert staged["registry"]["version"] == "1" and staged["registry"]["alias"] == "champion"
    assert origin_of(folder).version == "1"
    # The same version again: nothing downloaded.
    assert stage_registered_model(f"models:/{name}/1", tmp_path, FAST_RETRY)["bytes_downloaded"] == 0

    # Training from the folder starts from the registered weights, with their architecture.
    config = resolve_config(named={"model_dir": str(folder)})
    warm = model_spec(config.model.kind).build(config.model, torch.device("cpu"))
    registered, _, _ = load_validated_model(early)
    for key, tensor in registered.state_dict().items():
        assert torch.equal(warm.state_dict()[key], tensor), key
    random_config = resolve_config(named={"model_dir": str(folder), "model_init": "random"})
    cold = model_spec("byte-lm").build(random_config.model, torch.device("cpu"))
    assert not torch.equal(cold.state_dict()["tok_emb.weight"], registered.state_dict()["tok_emb.weight"])


def test_the_alias_is_resolved_once_and_three_versions_chain(
    tracking, trained_run, dataset_dir, tmp_path, single_rank_group
):
    name = "rtp-test-parent-chain"
    early, late = _checkpoints(trained_run)
    register_checkpoint(
        early, name, "champion", Lineage(dataset_snapshot_id="snapshot-of-v1"), retry=FAST_RETRY
    )
    parent = stage_registered_model(f"models:/{name}@champion", tmp_path / "fsx", FAST_RETRY)
    # The alias moves while the run trains: the run keeps the version it resolved.
    register_checkpoint(late, name, "champion", retry=FAST_RETRY)  # v2
    child = _child_checkpoint(parent["model_dir"], dataset_dir, tmp_path / "child")

    result = validate_checkpoint(child, str(dataset_dir), 10.0, champion_model_name=name, retry=FAST_RETRY)
    assert result.parent_version == "1"
    assert f"started from {name} v1 (champion)" in result.started_from
    assert "the champion is v2 now" in result.started_from

    v3 = register_checkpoint(child, name, "challenger", retry=FAST_RETRY)
    tags = tracking.get_model_version(name, v3.version).tags
    assert (tags["rtp.parent.model_name"], tags["rtp.parent.version"], tags["rtp.parent.alias"]) == (
        name,
        "1",
        "champion",
    )
    assert tags["rtp.parent.run_id"] == tracking.get_model_version(name, "1").run_id
    assert tags["rtp.parent.dataset_snapshot_id"] == "snapshot-of-v1"

    grandparent = stage_registered_model(f"models:/{name}/{v3.version}", tmp_path / "fsx", FAST_RETRY)
    grandchild = _child_checkpoint(grandparent["model_dir"], dataset_dir, tmp_path / "grandchild", steps=3)
    v4 = register_checkpoint(grandchild, name, "challenger", retry=FAST_RETRY)
    chain = walk_lineage(tracking, name, v4.version)
    assert [v.version for v in chain] == [v4.version, v3.version, "1"]
    assert "rtp.parent.version" not in chain[-1].tags


def _logged_model_store(client, name: str, version: str) -> str:
    source = client.get_model_version(name, version).source  # models:/m-<id>
    return client.get_logged_model(source.removeprefix("models:/")).artifact_location


def test_a_tampered_file_in_the_artifact_store_is_refused(tracking, trained_run, tmp_path):
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    name = "rtp-test-tampered"
    early, _ = _checkpoints(trained_run)
    register_checkpoint(early, name, "champion", retry=FAST_RETRY)
    # Overwrite the weights in the store with other bytes of the same size.
    local = Path(
        mlflow.artifacts.download_artifacts(f"models:/{name}/1/artifacts", dst_path=str(tmp_path / "dl"))
    )
    weights = local / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    tampered = tmp_path / "tampered" / "weights.safetensors"
    tampered.parent.mkdir()
    tampered.write_bytes(bytes(data))
    get_artifact_repository(_logged_model_store(tracking, name, "1")).log_artifact(str(tampered), "artifacts")

    with pytest.raises(StageError, match=r"v1 \(champion\) refused: weights.safetensors has SHA-256"):
        stage_registered_model(f"models:/{name}@champion", tmp_path / "fsx", FAST_RETRY)
    versions = tmp_path / "fsx/rtp/models" / name / "versions"
    assert not (versions / "1").exists() and not list(versions.glob(".incoming-*"))


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("models:/rtp-test-absent@champion", "MLflow has no registered model 'rtp-test-absent'"),
        ("models:/rtp-test-bad@gold", "rtp-test-bad has no alias 'gold' (its aliases: champion -> v1)"),
        ("models:/rtp-test-bad/7", "rtp-test-bad has no version 7"),
        ("models:/rtp-test-bad/1", "rtp-test-bad v1 is not an rtp export"),
        ("models:/rtp-test-bad", "is not a registry reference: write models:/<name>@<alias>"),
    ],
)
def test_a_bad_reference_gets_one_line(reference, expected, tracking, tmp_path):
    if not tracking.search_registered_models(filter_string="name = 'rtp-test-bad'"):
        # A version another tool registered: no rtp tags, no file manifest.
        with mlflow.start_run() as run:
            mlflow.log_text("not an rtp model", "model/README.txt")
        tracking.create_registered_model("rtp-test-bad")
        tracking.create_model_version(
            "rtp-test-bad", f"runs:/{run.info.run_id}/model", run_id=run.info.run_id
        )
        tracking.set_registered_model_alias("rtp-test-bad", "champion", "1")
    with pytest.raises(StageError) as caught:
        stage_registered_model(reference, tmp_path, FAST_RETRY)
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "rtp").exists()


def test_a_registry_reference_without_mlflow_names_the_setting(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", None)
    with pytest.raises(StageError, match="no MLflow is configured: set MLFLOW_TRACKING_URI"):
        stage_registered_model("models:/rtp-model@champion", tmp_path)


def test_a_staged_version_that_lost_a_file_is_downloaded_again_not_trusted(tracking, trained_run, tmp_path):
    name = "rtp-test-restage"
    early, _ = _checkpoints(trained_run)
    register_checkpoint(early, name, "champion", retry=FAST_RETRY)
    folder = Path(stage_registered_model(f"models:/{name}@champion", tmp_path, FAST_RETRY)["model_dir"])
    (folder / "weights.safetensors").unlink()
    with pytest.raises(StageError, match=r"is damaged .*weights.safetensors is missing.*delete that folder"):
        stage_registered_model(f"models:/{name}@champion", tmp_path, FAST_RETRY)
    shutil.rmtree(folder)
    again = stage_registered_model(f"models:/{name}@champion", tmp_path, FAST_RETRY)
    assert again["bytes_downloaded"] > 0 and (folder / "weights.safetensors").is_file()


def test_warm_start_parent_takes_the_parents_adamw_moments_when_its_checkpoint_is_there(
    tracking, trained_run, dataset_dir, tmp_path
):
    """optimizer.warm_start=parent: the train step finds the checkpoint the version came from
    on the volume (checked by its manifest), and the run starts with its weights and moments
    but its own learning-rate schedule; a checkpoint that is gone or changed means fresh."""
    import json

    from components.train.train import TrainRequest
    from tests.distributed.conftest import run_training

    name, fsx = "rtp-test-warm-optimizer", tmp_path / "fsx"
    parent_checkpoint = fsx / "rtp/runs/parent-run/checkpoints/step_20"
    shutil.copytree(trained_run["checkpoint"], parent_checkpoint)
    register_checkpoint(str(parent_checkpoint), name, "champion", retry=FAST_RETRY)
    staged = stage_registered_model(f"models:/{name}@champion", fsx, FAST_RETRY)["model_dir"]

    def request(run: str) -> TrainRequest:
        return TrainRequest(
            dataset_dir=str(dataset_dir),
            run_folder=fsx / "rtp/runs" / run,
            model_dir=staged,
            overrides="optimizer.warm_start=parent",
            settings={"steps": 2, "checkpoint_every": 2, "checkpoint_mode": "sync"},
        )

    config = request("child").config()
    assert config.optimizer.initial_state_dir == str(parent_checkpoint)
    summary = run_training(1, config)
    assert summary["completed"] and summary["steps"] == 2
    log = [json.loads(line) for line in (fsx / "rtp/runs/child/train/events.jsonl").read_text().splitlines()]
    assert [e["checkpoint"] for e in log if e["kind"] == "warm_start"] == [str(parent_checkpoint)]
    assert (fsx / "rtp/runs/child/checkpoints/step_2/COMMITTED").is_file()

    # A changed parent checkpoint (here: its manifest) is not used: fresh moments.
    manifest = parent_checkpoint / "manifest.json"
    manifest.write_text(manifest.read_text() + " ")
    assert request("other").config().optimizer.initial_state_dir == ""
    shutil.rmtree(parent_checkpoint)
    assert request("third").config().optimizer.initial_state_dir == ""


def test_load_parent_state_keeps_this_runs_hyperparameters(trained_run, dataset_dir, single_rank_group):
    from trainer.checkpointing.storage import load_checkpoint, load_parent_state

    config = resolve_config(named={"dataset_dir": str(dataset_dir)})
    spec = model_spec(config.model.kind)

    def fresh(lr: float):
        torch.manual_seed(0)
        model = spec.build(config.model, torch.device("cpu"))
        return model, torch.optim.AdamW(model.parameters(), lr=lr)

    resumed_model, resumed = fresh(3e-3)
    load_checkpoint(trained_run["checkpoint"], resumed_model, resumed)
    warm_model, warm = fresh(1e-4)
    load_parent_state(trained_run["checkpoint"], warm_model, warm)
    assert warm.param_groups[0]["lr"] == 1e-4  # this run's, not the parent's last
    for (key, a), b in zip(warm_model.state_dict().items(), resumed_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    for p_warm, p_resumed in zip(warm_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(warm.state[p_warm]["exp_avg_sq"], resumed.state[p_resumed]["exp_avg_sq"])
        assert float(warm.state[p_warm]["step"]) == float(resumed.state[p_resumed]["step"]) == 20
