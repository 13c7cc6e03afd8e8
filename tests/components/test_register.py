"""Registration against a real `mlflow server` on loopback."""

import mlflow
import pandas as pd
import pytest

from components.register_model.register import register_checkpoint

pytestmark = pytest.mark.integration


@pytest.fixture
def tracking(mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    return mlflow.MlflowClient(mlflow_server)


def test_register_creates_a_servable_version_with_alias_and_lineage(tracking, trained_run):
    result = register_checkpoint(
        trained_run["checkpoint"], "rtp-test-register", "champion", lineage={"rtp.kfp_run_id": "run-123"}
    )
    assert result.created and result.version == "1" and result.alias == "champion"
    version = tracking.get_model_version_by_alias("rtp-test-register", "champion")
    assert version.version == "1"
    assert version.tags["rtp.kfp_run_id"] == "run-123"
    assert version.tags["rtp.checkpoint_step"] == "20"
    model = mlflow.pyfunc.load_model("models:/rtp-test-register@champion")
    texts = model.predict(pd.DataFrame({"prompt": ["def ", "import "]}), params={"max_new_tokens": 12})
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


def test_registering_the_same_checkpoint_again_returns_the_existing_version(tracking, trained_run):
    first = register_checkpoint(trained_run["checkpoint"], "rtp-test-idempotent", "challenger")
    second = register_checkpoint(trained_run["checkpoint"], "rtp-test-idempotent", "champion")
    assert first.created and not second.created
    assert second.version == first.version
    assert len(tracking.search_model_versions("name = 'rtp-test-idempotent'")) == 1
    assert tracking.get_model_version_by_alias("rtp-test-idempotent", "champion").version == first.version
    other = register_checkpoint(
        trained_run["checkpoint"].replace("step_20", "step_10"), "rtp-test-idempotent", "challenger"
    )
    assert other.created and other.version == "2"


def test_reject_cannot_be_registered(tracking, trained_run):
    with pytest.raises(ValueError, match="cannot be registered"):
        register_checkpoint(trained_run["checkpoint"], "rtp-test-reject", "reject")
