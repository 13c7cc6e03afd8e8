"""Validate + register against a real `mlflow server` on loopback: champion promotion, the
challenger path, idempotent retries, a server that is down and comes back, 5xx answers,
and checkpoints that must never be registered."""

import shutil
import threading
import time

import mlflow
import pandas as pd
import pytest
import torch

from benchmarks.make_checkpoint import save_checkpoint
from components.mlflow_access import RegistryUnavailable, RetryPolicy
from components.register_model.lineage import Lineage
from components.register_model.register import SHA_TAG, checkpoint_sha256, register_checkpoint
from components.validate_checkpoint.champion import load_champion
from components.validate_checkpoint.validate import load_validated_model, validate_checkpoint
from tests.components.mlflow_server import FlakyProxy, RestartableMlflowServer
from trainer.checkpointing.storage import CheckpointError
from trainer.config import build_config
from trainer.models import model_spec

pytestmark = pytest.mark.integration

FAST_RETRY = RetryPolicy(attempts=4, first_delay_s=0.2, max_delay_s=1.0)


@pytest.fixture
def fast_mlflow_client(monkeypatch):
    # MLflow's own HTTP retries (7, backoff factor 2) would hide the project's retry layer and
    # make every failure take minutes: off here, so the tests exercise call_with_retries.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


@pytest.fixture
def tracking(mlflow_server, monkeypatch, fast_mlflow_client):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    return mlflow.MlflowClient(mlflow_server)


def _point_at(monkeypatch, url):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    mlflow.set_tracking_uri(url)
    return mlflow.MlflowClient(url)


def _versions(client, name):
    return client.search_model_versions(f"name = '{name}'")


def _validate_and_register(checkpoint_dir, dataset_dir, name, **kwargs):
    result = validate_checkpoint(
        checkpoint_dir, str(dataset_dir), 10.0, champion_model_name=name, retry=FAST_RETRY, **kwargs
    )
    registered = register_checkpoint(checkpoint_dir, name, result.decision, retry=FAST_RETRY)
    return result, registered


def test_better_model_becomes_champion_and_worse_one_challenger(tracking, trained_run, dataset_dir, tmp_path):
    name = "rtp-test-promotion"
    early = trained_run["checkpoint"].replace("step_20", "step_10")
    first, v1 = _validate_and_register(early, dataset_dir, name)
    assert first.decision == "champion" and first.champion_loss is None
    assert (v1.version, v1.alias, v1.created) == ("1", "champion", True)

    second, v2 = _validate_and_register(trained_run["checkpoint"], dataset_dir, name)
    # the champion (step 10) was scored on the same holdout by the same code
    assert second.champion_version == "1"
    assert second.champion_loss == pytest.approx(first.holdout_loss, abs=1e-6)
    assert second.delta is not None and second.delta > 0
    assert (second.decision, v2.version, v2.alias) == ("champion", "2", "champion")
    assert tracking.get_model_version_by_alias(name, "champion").version == "2"

    # step 10 again, under a new name in the registry's eyes? No: same checkpoint -> same version 1,
    # which does not beat the champion and so becomes the challenger.
    third, v1_again = _validate_and_register(early, dataset_dir, name)
    assert third.decision == "challenger" and third.delta is not None and third.delta < 0
    assert (v1_again.version, v1_again.alias, v1_again.created) == ("1", "challenger", False)
    assert tracking.get_model_version_by_alias(name, "champion").version == "2"
    assert tracking.get_model_version_by_alias(name, "challenger").version == "1"
    assert len(_versions(tracking, name)) == 2

    # the registered champion loads as a pyfunc and generates text with the step-20 weights
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion", dst_path=str(tmp_path))  # not /tmp
    texts = model.predict(pd.DataFrame({"prompt": ["def ", "import "]}), params={"max_new_tokens": 12})
    assert len(texts) == 2 and all(isinstance(t, str) and len(t) >= 4 for t in texts)
    champion = load_champion(name, FAST_RETRY)
    expected, _, _ = load_validated_model(trained_run["checkpoint"])
    for key, tensor in expected.state_dict().items():
        assert torch.equal(champion.model.state_dict()[key], tensor), key


def test_min_improvement_keeps_the_champion(tracking, trained_run, dataset_dir):
    name = "rtp-test-min-improvement"
    early = trained_run["checkpoint"].replace("step_20", "step_10")
    _validate_and_register(early, dataset_dir, name)
    result, registered = _validate_and_register(
        trained_run["checkpoint"], dataset_dir, name, min_improvement=100.0
    )
    assert result.delta is not None and result.delta > 0  # better, but not better enough
    assert (result.decision, registered.alias) == ("challenger", "challenger")
    assert tracking.get_model_version_by_alias(name, "champion").version == "1"


def test_version_carries_artifacts_signature_and_lineage(tracking, trained_run, dataset_dir, tmp_path):
    name = "rtp-test-lineage"
    lineage = Lineage(
        kfp_run_id="run-123",
        pipeline_version="rtp-resilient-training-0.1.0",
        dataset_snapshot_id="snap-1",
        dataset_manifest_sha256="ab" * 32,
        training_figures={"goodput_pct": 96.5, "efficiency_pct": 99.25, "restarts": 1},
    )
    result = register_checkpoint(trained_run["checkpoint"], name, "champion", lineage, retry=FAST_RETRY)
    tags = tracking.get_model_version(name, result.version).tags
    assert tags["rtp.kfp_run_id"] == "run-123"
    assert tags["rtp.pipeline_version"] == "rtp-resilient-training-0.1.0"
    assert tags["rtp.dataset_snapshot_id"] == "snap-1"
    assert tags["rtp.dataset_manifest_sha256"] == "ab" * 32
    assert tags["rtp.checkpoint_step"] == "20"
    assert tags["rtp.checkpoint_uri"].startswith("file:///") and tags["rtp.checkpoint_uri"].endswith(
        "step_20"
    )
    assert tags[SHA_TAG] == checkpoint_sha256(trained_run["checkpoint"])
    assert len(tags["rtp.training_config_sha256"]) == 64
    assert tags["rtp.train.goodput_pct"] == "96.5" and tags["rtp.train.restarts"] == "1"
    assert tags["rtp.code_version"].startswith("0.1.0")
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/{name}/{result.version}", dst_path=str(tmp_path)
    )
    info = mlflow.models.Model.load(local)  # get_model_info would download it again, into /tmp
    assert info.signature.inputs.input_names() == ["prompt"]
    assert {p.name for p in info.signature.params.params} == {"max_new_tokens", "temperature"}
    assert info.saved_input_example_info is not None
    artifacts = {p.name for p in tmp_path.rglob("*") if p.parent.name == "artifacts"}
    assert {"weights.safetensors", "config.json", "tokenizer.json"} <= artifacts, local


def test_retried_register_returns_the_existing_version(tracking, trained_run):
    name = "rtp-test-idempotent"
    first = register_checkpoint(trained_run["checkpoint"], name, "challenger", retry=FAST_RETRY)
    second = register_checkpoint(trained_run["checkpoint"], name, "champion", retry=FAST_RETRY)
    assert first.created and not second.created
    assert second.version == first.version
    assert len(_versions(tracking, name)) == 1
    assert tracking.get_model_version_by_alias(name, "champion").version == first.version


def test_half_registered_version_is_replaced(tracking, trained_run):
    """A version of this checkpoint without artifacts (a crashed earlier attempt) is not returned."""
    name = "rtp-test-half-registered"
    sha = checkpoint_sha256(trained_run["checkpoint"])
    tracking.create_registered_model(name)
    with mlflow.start_run() as run:  # a run whose model upload never happened
        pass
    broken = tracking.create_model_version(
        name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id, tags={SHA_TAG: sha}
    )
    result = register_checkpoint(trained_run["checkpoint"], name, "champion", retry=FAST_RETRY)
    assert result.created and result.version != broken.version
    assert [v.version for v in _versions(tracking, name)] == [result.version]
    assert tracking.get_model_version_by_alias(name, "champion").version == result.version


def _corrupt_copy(source, tmp_path, how):
    copy = tmp_path / "step_20"
    shutil.copytree(source, copy)
    shard = next(copy.glob("*.distcp"))
    if how == "flip a byte":
        data = bytearray(shard.read_bytes())
        data[200] ^= 0x40
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()
    return str(copy), shard.name


@pytest.mark.parametrize("how", ["flip a byte", "delete a shard"])
def test_damaged_checkpoint_is_never_registered(tracking, trained_run, dataset_dir, tmp_path, how):
    name = "rtp-test-damaged"
    checkpoint_dir, shard = _corrupt_copy(trained_run["checkpoint"], tmp_path, how)
    with pytest.raises(CheckpointError, match=shard):
        validate_checkpoint(checkpoint_dir, str(dataset_dir), 10.0, champion_model_name=name)
    with pytest.raises(CheckpointError, match=shard):
        register_checkpoint(checkpoint_dir, name, "champion", retry=FAST_RETRY)
    assert not tracking.search_registered_models(filter_string=f"name = '{name}'") or not _versions(
        tracking, name
    )


def test_nan_weights_are_never_registered(tracking, single_rank_group, dataset_dir, tmp_path):
    name = "rtp-test-nan"
    config = build_config("tiny-cpu")
    model = model_spec("byte-lm").build(config.model, torch.device("cpu"))
    with torch.no_grad():
        model.ln_out.weight[3] = float("inf")
    save_checkpoint(
        tmp_path, 1, model, torch.optim.AdamW(model.parameters()), {"config": config.to_dict()}, {}
    )
    with pytest.raises(CheckpointError, match=r"'ln_out\.weight'.*NaN or Inf"):
        validate_checkpoint(str(tmp_path / "step_1"), str(dataset_dir), 10.0, champion_model_name=name)
    with pytest.raises(CheckpointError, match=r"'ln_out\.weight'"):
        register_checkpoint(str(tmp_path / "step_1"), name, "champion", retry=FAST_RETRY)
    assert not tracking.search_registered_models(filter_string=f"name = '{name}'")


def test_server_down_fails_clearly_after_retries(monkeypatch, fast_mlflow_client, trained_run):
    from rtp_support.embedded_s3 import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    _point_at(monkeypatch, url)
    started = time.monotonic()
    with pytest.raises(RegistryUnavailable, match=rf"MLflow at {url} failed to .* after 3 attempts") as info:
        register_checkpoint(
            trained_run["checkpoint"], "rtp-test-down", "champion", retry=RetryPolicy(3, 0.1, 0.2)
        )
    assert "MLFLOW_TRACKING_URI" in str(info.value)
    assert time.monotonic() - started < 60


def test_server_down_then_up_registers_once(monkeypatch, fast_mlflow_client, trained_run, tmp_path):
    server = RestartableMlflowServer(tmp_path)
    client = _point_at(monkeypatch, server.url)
    outcome = {}

    def register() -> None:
        try:
            outcome["result"] = register_checkpoint(
                trained_run["checkpoint"],
                "rtp-test-down-up",
                "champion",
                retry=RetryPolicy(attempts=60, first_delay_s=0.5, max_delay_s=2.0),
            )
        except Exception as exc:  # reported by the assertion below
            outcome["error"] = exc

    worker = threading.Thread(target=register)
    worker.start()
    try:
        time.sleep(2.0)  # the first attempts find nothing listening
        assert worker.is_alive(), outcome
        server.start()
        worker.join(timeout=180)
        assert not worker.is_alive(), "register did not finish after the server came up"
        assert "error" not in outcome, outcome.get("error")
        assert outcome["result"].created and outcome["result"].version == "1"
        assert len(_versions(client, "rtp-test-down-up")) == 1
        # and the server going away and coming back does not duplicate on a retried task
        server.stop()
        server.start()
        again = register_checkpoint(
            trained_run["checkpoint"], "rtp-test-down-up", "champion", retry=FAST_RETRY
        )
        assert (again.version, again.created) == ("1", False)
    finally:
        worker.join(timeout=5)
        server.stop()


def test_5xx_answers_are_retried(monkeypatch, fast_mlflow_client, mlflow_server, trained_run):
    upstream_port = int(mlflow_server.rsplit(":", 1)[1])
    with FlakyProxy(upstream_port, failures=3) as proxy:
        client = _point_at(monkeypatch, proxy.url)
        result = register_checkpoint(trained_run["checkpoint"], "rtp-test-5xx", "champion", retry=FAST_RETRY)
        assert proxy.failed == 3
        assert result.created
        assert len(_versions(client, "rtp-test-5xx")) == 1


def test_failure_after_the_version_exists_removes_it(tracking, trained_run, monkeypatch):
    """Never a version without its alias: if the alias cannot be set, the new version goes away."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED

    name = "rtp-test-cleanup"

    def refuse(self, model_name, alias, version):  # stand-in for a server that refuses the alias
        raise MlflowException("PERMISSION_DENIED: aliases are locked", error_code=PERMISSION_DENIED)

    monkeypatch.setattr(mlflow.MlflowClient, "set_registered_model_alias", refuse)
    with pytest.raises(MlflowException, match="aliases are locked"):
        register_checkpoint(trained_run["checkpoint"], name, "champion", retry=FAST_RETRY)
    assert _versions(tracking, name) == []


def test_a_lost_answer_to_the_registration_still_registers_once(
    monkeypatch, fast_mlflow_client, mlflow_server, trained_run
):
    """The server creates the version but its answer is lost: the retry finds it, no duplicate."""
    name = "rtp-test-lost-answer"
    upstream_port = int(mlflow_server.rsplit(":", 1)[1])
    with FlakyProxy(upstream_port, failures=0, drop_answers_to="/model-versions/create") as proxy:
        client = _point_at(monkeypatch, proxy.url)
        result = register_checkpoint(trained_run["checkpoint"], name, "challenger", retry=FAST_RETRY)
        assert proxy.dropped == 1, "the answer to the version's creation was dropped"
        assert [v.version for v in _versions(client, name)] == [result.version] == ["1"]
        assert client.get_model_version_by_alias(name, "challenger").version == "1"
        # the model exists with a challenger but no champion: no champion, not an error
        assert load_champion(name, FAST_RETRY) is None


def test_a_concurrent_pending_version_is_waited_for_not_deleted(tracking, trained_run, monkeypatch):
    """Another task is registering the same checkpoint (its version PENDING_REGISTRATION):
    this one waits for it and uses it, and never deletes it."""
    name = "rtp-test-concurrent"
    first = register_checkpoint(trained_run["checkpoint"], name, "challenger", retry=FAST_RETRY)
    pending_reads = {"left": 3}
    real_search, real_get = mlflow.MlflowClient.search_model_versions, mlflow.MlflowClient.get_model_version

    def as_pending(version):  # stand-in for the other task's registration still under way
        if pending_reads["left"] > 0:
            pending_reads["left"] -= 1
            version._status = "PENDING_REGISTRATION"
        return version

    monkeypatch.setattr(
        mlflow.MlflowClient,
        "search_model_versions",
        lambda self, *a, **k: [as_pending(v) for v in real_search(self, *a, **k)],
    )
    monkeypatch.setattr(
        mlflow.MlflowClient, "get_model_version", lambda self, *a, **k: as_pending(real_get(self, *a, **k))
    )
    again = register_checkpoint(trained_run["checkpoint"], name, "champion", retry=FAST_RETRY)
    assert pending_reads["left"] == 0, "the version was seen pending"
    assert (again.version, again.created) == (first.version, False)
    assert [v.version for v in _versions(tracking, name)] == [first.version]
    assert tracking.get_model_version_by_alias(name, "champion").version == first.version
