"""`rtp gc` and its rule (components/retention.py): which run folders go, and how."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlflow
import pytest

from components import retention
from components.retention import RunFolder, plan_retention, run_of_checkpoint
from rtp_cli.main import main

HOUR = 3600.0
NOW = 1_800_000_000.0


def _run(name: str, hours_ago: float, size: int = 0) -> RunFolder:
    return RunFolder(name, Path("/fsx/rtp/runs") / name, NOW - hours_ago * HOUR, size)


def test_the_rule_keeps_aliased_newest_and_recent_runs_and_removes_the_rest_oldest_first():
    runs = [
        _run("n1", 24 * 10),
        _run("n2", 24 * 9),
        _run("n3", 24 * 8),
        _run("n4", 24 * 7),
        _run("n5", 24 * 6),
        _run("live", 30),  # older than the newest two, but within the 48 h a run may take
    ]
    plan = plan_retention(runs, {"n2": "m v2 (champion)"}, keep_newest=2, active_within_s=48 * HOUR, now=NOW)
    kept = {run.name: why for run, why in plan.keep}
    assert set(kept) == {"n2", "live", "n5"}
    assert (
        "m v2 (champion)" in kept["n2"] and "may still be going" in kept["live"] and "newest 2" in kept["n5"]
    )
    assert [run.name for run in plan.remove] == ["n1", "n3", "n4"]  # oldest first
    # The newest N count every run, kept for another reason or not.
    assert [r.name for r in plan_retention(runs, {}, keep_newest=0, active_within_s=0, now=NOW).remove][
        -1
    ] == "live"
    with pytest.raises(retention.RetentionError):
        plan_retention(runs, {}, keep_newest=-1)


@pytest.mark.parametrize(
    ("uri", "run"),
    [
        ("file:///fsx/rtp/runs/nightly-3/checkpoints/step_400", "nightly-3"),
        ("file:///mnt/other/rtp/runs/a%20b/checkpoints/step_1", "a b"),  # mounted elsewhere here
        ("/fsx/rtp/runs/plain/checkpoints/step_2", "plain"),
        ("file:///fsx/elsewhere/step_2", ""),
        ("", ""),
    ],
)
def test_a_checkpoint_uri_names_its_run_wherever_the_volume_is_mounted(uri, run):
    assert run_of_checkpoint(uri) == run


def _make_run(mount: Path, name: str, hours_ago: float, payload: int = 1000) -> Path:
    folder = mount / "rtp" / "runs" / name
    (folder / "checkpoints" / "step_1").mkdir(parents=True)
    (folder / "checkpoints" / "step_1" / "shard.distcp").write_bytes(b"x" * payload)
    (folder / "steps").mkdir()
    (folder / "steps" / "train.json").write_text("{}")
    return _age(folder, hours_ago)


def _age(folder: Path, hours_ago: float) -> Path:
    """Everything in `folder` last changed `hours_ago` (a new file changes its folder too)."""
    stamp = time.time() - hours_ago * HOUR
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (stamp, stamp))
    return folder


def test_scan_measures_what_removing_frees_and_remove_finishes_an_interrupted_removal(tmp_path):
    mount = tmp_path / "fsx"
    old = _make_run(mount, "old", 24 * 30, payload=5000)
    _make_run(mount, "new", 1)
    os.link(old / "checkpoints" / "step_1" / "shard.distcp", tmp_path / "elsewhere")  # frees nothing
    (old / "steps" / "big.bin").write_bytes(b"y" * 700)
    _age(old, 24 * 30)
    leftover = mount / "rtp" / "runs" / ".removing-earlier"
    leftover.mkdir()
    runs = {run.name: run for run in retention.scan_runs(mount)}
    assert set(runs) == {"old", "new"}  # not the one being removed
    assert runs["old"].bytes == 700 + 2  # the hard-linked shard is not counted; train.json is
    assert time.time() - runs["new"].changed_at < 2 * HOUR
    plan = plan_retention(list(runs.values()), {}, keep_newest=1)
    assert [run.name for run in plan.remove] == ["old"]
    assert retention.remove(plan, mount) == ["old"]
    assert sorted(p.name for p in (mount / "rtp" / "runs").iterdir()) == ["new"]
    assert (tmp_path / "elsewhere").read_bytes() == b"x" * 5000


def test_rtp_gc_keeps_the_champions_run_and_removes_only_with_apply(
    tmp_path, mlflow_server, monkeypatch, capsys
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    mount = tmp_path / "fsx"
    for index, name in enumerate(["night-1", "night-2", "night-3", "night-4"]):
        _make_run(mount, name, 24 * (10 - index))
    client = mlflow.MlflowClient(mlflow_server)
    model = f"gc-model-{time.time_ns()}"
    client.create_registered_model(model)
    versions = []
    for name in ("night-1", "night-2"):
        with mlflow.start_run() as run:
            mlflow.log_text("weights", "model/weights.txt")
        version = client.create_model_version(
            model,
            f"runs:/{run.info.run_id}/model",
            run_id=run.info.run_id,
            # Registered where the volume was mounted at /fsx, not where rtp gc runs.
            tags={"rtp.checkpoint_uri": f"file:///fsx/rtp/runs/{name}/checkpoints/step_1"},
        )
        versions.append(version.version)
    client.set_registered_model_alias(model, "champion", versions[0])  # night-2's version has none
    capsys.readouterr()  # what MLflow printed about its runs

    args = ["gc", "--fsx-mount-path", str(mount), "--keep", "1", "--active-within-hours", "2"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {entry["run"] for entry in report["keep"]} == {"night-1", "night-4"}
    assert [entry["run"] for entry in report["remove"]] == ["night-2", "night-3"]
    assert not report["applied"] and report["frees_bytes"] == 2 * (1000 + 2)
    assert len(list((mount / "rtp" / "runs").iterdir())) == 4  # a dry run removes nothing

    assert main([*args, "--apply"]) == 0
    out = capsys.readouterr().out
    assert f"keep    night-1: registered as {model} v{versions[0]} (champion)" in out
    assert sorted(p.name for p in (mount / "rtp" / "runs").iterdir()) == ["night-1", "night-4"]


def test_rtp_gc_without_mlflow_says_how_to_go_on(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr("components.mlflow_access.tracking_uri_is_configured", lambda: False)
    _make_run(tmp_path / "fsx", "night-1", 100)
    assert main(["gc", "--fsx-mount-path", str(tmp_path / "fsx")]) == 2
    assert "--without-registry" in capsys.readouterr().err
    assert main(["gc", "--fsx-mount-path", str(tmp_path / "fsx"), "--without-registry", "--keep", "0"]) == 0
    assert "1 of 1 run(s) to remove" in capsys.readouterr().out
    assert main(["gc", "--fsx-mount-path", str(tmp_path / "nothing")]) == 2
    assert "is the shared volume mounted" in capsys.readouterr().err


def test_the_pipeline_step_keeps_its_own_run_and_does_nothing_at_keep_runs_0(
    tmp_path, mlflow_server, monkeypatch
):
    from types import SimpleNamespace

    from components.retain_runs.component import retain_runs

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    mount = tmp_path / "fsx"
    for index, name in enumerate(["old-1", "old-2", "tonight"]):
        _make_run(mount, name, 24 * (10 - index))  # tonight's folder looks old: it is kept as this run
    report = SimpleNamespace(path=str(tmp_path / "report.md"))
    retain_runs(str(mount), "tonight", "kfp-run-1", 0, report)
    assert "Retention is off" in Path(report.path).read_text()
    assert len(list((mount / "rtp" / "runs").iterdir())) == 3

    retain_runs(str(mount), "tonight", "kfp-run-1", 1, report)  # the newest run is tonight's
    assert sorted(p.name for p in (mount / "rtp" / "runs").iterdir()) == ["tonight"]
    text = Path(report.path).read_text()
    assert "| tonight | this run |" in text and "old-1, old-2" in text
    record = json.loads((mount / "rtp" / "runs" / "tonight" / "steps" / "retain_runs.json").read_text())
    assert record["removed"] == ["old-1", "old-2"] and record["freed_bytes"] == 2 * (1000 + 2)
