"""End to end: `rtp local` runs stage -> train -> validate -> register through kfp.local,
with the embedded S3 endpoint and a real MLflow server, and its summary tells the truth."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlflow
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.launches, pytest.mark.integration, pytest.mark.timeout(900)]


def _rtp(workdir, *args: str, tmpdir: Path) -> subprocess.CompletedProcess:
    """`rtp local --workdir workdir ARGS` with `tmpdir` as its TMPDIR."""
    return subprocess.run(
        [sys.executable, "-m", "rtp_cli.main", "local", "--workdir", str(workdir), *args],
        capture_output=True,
        text=True,
        timeout=800,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )


def _rtp_local(workdir, mlflow_server, steps: int, every: int, model_name: str, *extra: str, tmpdir: Path):
    """`rtp local --run-name e2e` into `workdir`, with `tmpdir` as its TMPDIR; asserts it succeeded."""
    result = _rtp(
        workdir,
        *("--steps", str(steps), "--checkpoint-every", str(every)),
        *(
            "--mlflow-uri",
            mlflow_server,
            "--model-name",
            model_name,
            "--max-loss",
            "5.0",
            "--run-name",
            "e2e",
        ),
        *extra,
        tmpdir=tmpdir,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def local_tmpdir():
    """The runs' TMPDIR: short (sockets are made below it), empty."""
    folder = Path(tempfile.mkdtemp(prefix="rtp-e2e-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, mlflow_server, local_tmpdir):
    workdir = tmp_path_factory.mktemp("rtp-local")
    # a fault drill: an in-process restart redoes steps, which MLflow must hold once
    result = _rtp_local(
        workdir, mlflow_server, 12, 6, "rtp-e2e", "--fault", "exception@8:1", tmpdir=local_tmpdir
    )
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


def test_nothing_is_left_in_the_temporary_folder(local_run, local_tmpdir):
    """The tasks' program folders, the launcher's log folder and sockets, the killed
    processes' multiprocessing folders: all in folders of their own, removed after use."""
    assert sorted(p.name for p in local_tmpdir.iterdir()) == []


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


def test_one_mlflow_run_goes_from_the_first_step_to_the_registered_version(local_run, mlflow_server):
    _, stdout, summary = local_run
    client = mlflow.MlflowClient(mlflow_server)
    run_id = summary["mlflow"]["run_id"]
    assert run_id and summary["mlflow"]["run_url"].endswith(f"/runs/{run_id}")
    assert f"MLflow run       : {summary['mlflow']['run_url']}" in stdout
    version = client.get_model_version_by_alias("rtp-e2e", "champion")
    assert version.run_id == run_id, "the registered version points at the run that trained it"
    run = client.get_run(run_id)
    assert run.info.run_name == "e2e"
    assert run.data.tags["rtp.kfp_run_id"] and run.data.tags["rtp.pipeline_version"]
    assert client.get_experiment(run.info.experiment_id).name == "rtp-resilient-training"
    loss_steps = [m.step for m in client.get_metric_history(run_id, "loss")]
    assert sorted(loss_steps) == [5, 10, 12]  # every run.log_every_steps (5) and the last, once each
    assert [m.step for m in client.get_metric_history(run_id, "holdout.loss")] == [12]
    assert run.data.metrics["restarts"] == 1


def test_validate_decided_from_the_training_ranks_record_of_the_final_weights(local_run):
    _, _, summary = local_run
    run_folder = Path(summary["checkpoint"]).parents[1]
    record = json.loads((run_folder / "train" / "eval.json").read_text())  # the train workdir
    validate = json.loads((run_folder / "steps" / "validate.json").read_text())
    train = json.loads((run_folder / "steps" / "train.json").read_text())
    assert validate["scored_by"] == "training", validate["checks"]
    assert record["model_sha256"] == validate["weights_sha256"] == train["model_sha256"]
    assert record["step"] == validate["step"] == summary["steps"] == 12
    assert validate["holdout_loss"] == record["loss"]


# make test-slow: what it proves at whole-system scale, make test proves in parts — the train
# step's resume (tests/distributed/test_resume.py), the unchanged snapshot staged again
# (tests/integration/test_stage_ceph.py), the refusal of a finished run name
# (tests/unit/test_train_contract.py).
@pytest.mark.slow
def test_the_same_run_name_again_resumes_from_its_checkpoint(local_run, mlflow_server, local_tmpdir):
    """`rtp local --run-name e2e` a second time, two steps further, resumes from the first
    run's last checkpoint instead of starting over. Last in this module: it adds two steps to
    the run the tests above read (and registers under another name)."""
    workdir, _, first = local_run
    # Synchronous saves: the resume is the point here, and they start no writer processes.
    # Staged in two parts this time (stage_workers): the snapshot exists, so the parts stop at
    # once and the stage step re-checks it.
    _rtp_local(
        workdir, mlflow_server, 14, 2, "rtp-e2e-resumed", "--checkpoint-mode", "sync", "--stage-workers", "2",
        tmpdir=local_tmpdir,
    )  # fmt: skip
    staged = json.loads((workdir / "fsx/rtp/runs/e2e/steps/stage.json").read_text())
    assert staged["files_downloaded"] == 0 and staged["snapshot_dir"] == first["dataset_snapshot"], staged
    trained = json.loads((workdir / "fsx/rtp/runs/e2e/train/summary.json").read_text())
    assert trained["resumed_from"] == first["checkpoint"]  # step_12 of the first run
    assert trained["steps"] == 14 and trained["lost_steps"] == 0
    second = json.loads((workdir / "summary.json").read_text())
    assert second["checkpoint"] == str(workdir / "fsx/rtp/runs/e2e/checkpoints/step_14")
    # The same name a third time with no more steps would train nothing and register the same
    # model again: refused in one line, before anything is staged.
    refused = _rtp(
        workdir, "--steps", "14", "--run-name", "e2e", "--mlflow-uri", mlflow_server, tmpdir=local_tmpdir
    )
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "finished training at step 14" in refused.stderr and "new run_name" in refused.stderr
    assert "embedded S3" not in refused.stdout  # nothing was started


# make test-slow: staging a registered version and warm-starting from it
# (tests/components/test_registry_source.py), a version's lineage tags
# (tests/components/test_register.py) and the champion's score beside the new one
# (tests/components/test_validate_champion.py) are in make test.
@pytest.mark.slow
def test_a_run_from_the_registered_champion_continues_its_training(local_run, mlflow_server, local_tmpdir):
    """`rtp local --model-source models:/rtp-e2e@champion --run-name second` in the same work dir
    and MLflow: the champion of the first run is staged from the registry and trained further,
    the new version names it as its parent and the report compares the two."""
    workdir, _, first = local_run
    result = _rtp(
        workdir,
        *("--model-source", "models:/rtp-e2e@champion", "--run-name", "second"),
        *("--steps", "6", "--checkpoint-every", "3", "--checkpoint-mode", "sync"),
        *("--mlflow-uri", mlflow_server, "--max-loss", "5.0"),
        tmpdir=local_tmpdir,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    second = json.loads((workdir / "summary.json").read_text())
    assert second["model_dir"] == str(workdir / "fsx/rtp/models/rtp-e2e/versions/1")
    client = mlflow.MlflowClient(mlflow_server)
    assert second["mlflow"]["model_name"] == "rtp-e2e"
    version = client.get_model_version("rtp-e2e", second["mlflow"]["version"])
    assert int(version.version) > int(first["mlflow"]["version"])
    assert version.tags["rtp.parent.version"] == first["mlflow"]["version"]
    assert version.tags["rtp.parent.run_id"] == first["mlflow"]["run_id"]
    assert version.tags["rtp.parent.dataset_snapshot_id"] == Path(first["dataset_snapshot"]).name

    # It started from trained weights: at the same step its loss is clearly below the first run's.
    def loss_at_step(run_id: str, step: int) -> float:
        (metric,) = [m for m in client.get_metric_history(run_id, "loss") if m.step == step]
        return metric.value

    cold, warm = loss_at_step(first["mlflow"]["run_id"], 5), loss_at_step(second["mlflow"]["run_id"], 5)
    assert warm < cold - 0.2, (cold, warm)

    validate = json.loads((workdir / "fsx/rtp/runs/second/steps/validate.json").read_text())
    assert validate["parent_version"] == validate["champion_version"] == first["mlflow"]["version"]
    assert validate["started_from"].startswith(
        f"started from rtp-e2e v{first['mlflow']['version']} (champion)"
    )
    assert validate["champion_bits_per_byte"] is not None and validate["delta"] is not None
