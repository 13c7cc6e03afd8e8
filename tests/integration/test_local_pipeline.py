"""End to end: `rtp local` runs stage -> train -> validate -> register through kfp.local,
with the embedded S3 endpoint and a real MLflow server, and its summary tells the truth."""

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, mlflow_server):
    workdir = tmp_path_factory.mktemp("rtp-local")
    command = [
        sys.executable,
        "-m",
        "rtp_cli.main",
        "local",
        "--workdir",
        str(workdir),
        "--steps",
        "12",
        "--checkpoint-every",
        "6",
        "--mlflow-uri",
        mlflow_server,
        "--model-name",
        "rtp-e2e",
        "--max-loss",
        "5.0",
        "--run-name",
        "e2e",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=800, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return workdir, result.stdout, json.loads((workdir / "summary.json").read_text())


def test_summary_is_consistent_with_the_files(local_run):
    workdir, stdout, summary = local_run
    assert summary["steps"] == 12
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint == workdir / "fsx/rtp/runs/e2e/checkpoints/step_12"
    assert (checkpoint / "COMMITTED").is_file()
    assert summary["final_loss"] < 5.55 and summary["holdout_loss"] < 5.0
    assert summary["decision"] == "champion"
    assert set(summary["elapsed_s"]) == {"stage", "train", "validate", "register"}
    assert all(seconds > 0 for seconds in summary["elapsed_s"].values())
    snapshot = Path(summary["dataset_snapshot"])
    assert (snapshot / "manifest.json").is_file()
    assert "pipeline finished" in stdout and "rtp-e2e version" in stdout


def test_model_version_exists_in_mlflow(local_run, mlflow_server):
    _, _, summary = local_run
    client = mlflow.MlflowClient(mlflow_server)
    version = client.get_model_version_by_alias("rtp-e2e", "champion")
    assert version.version == summary["mlflow"]["version"]
    assert version.tags["rtp.checkpoint_uri"] == Path(summary["checkpoint"]).resolve().as_uri()
    assert version.tags["rtp.train.goodput_pct"], "the trainer's goodput travels with the model"
    reports = [a.path for a in client.list_artifacts(version.run_id, "reports")]
    assert reports == ["reports/goodput.html"], "the goodput report is logged with the model"
    assert version.tags["rtp.dataset_snapshot_id"] == Path(summary["dataset_snapshot"]).name
    assert summary["mlflow"]["model_uri"] == f"models:/rtp-e2e/{version.version}"
