import itertools
import json
from pathlib import Path

import pytest

from components.layout import check_name, dataset_root, record_step, run_dir
from rtp_cli.local_run import LocalOptions, build_summary, format_summary
from trainer.events import EventLog, write_json_atomic
from trainer.launch import LauncherSettings, build_launch_command, launch_tempdir, trainer_arguments
from trainer.loop import lr_factor


def test_run_dir_prefers_run_name_then_job_id(tmp_path):
    assert run_dir(tmp_path, "nightly", "123") == tmp_path / "rtp/runs/nightly"
    assert run_dir(tmp_path, "", "123") == tmp_path / "rtp/runs/123"
    with pytest.raises(ValueError, match="run name"):
        run_dir(tmp_path, "", "")
    assert dataset_root(tmp_path, "corpus") == tmp_path / "rtp/datasets/corpus"


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "x" * 200, "nightly\n"])
def test_unsafe_folder_names_are_refused(name):
    with pytest.raises(ValueError, match="safe folder name"):
        check_name("run name", name)


def test_launch_command_runs_the_trainer_module_under_ft_launcher():
    args = trainer_arguments("w/config.json")
    command = build_launch_command(4, args, python="py", settings=LauncherSettings(max_restarts=5))
    assert command[:5] == [
        "py",
        "-m",
        "nvidia_resiliency_ext.fault_tolerance.launcher",
        "--standalone",
        "--nproc-per-node=4",
    ]
    assert "--max-restarts=5" in command and "--ft-enable-nic-monitor=false" in command
    trainer_at = command.index("trainer")
    assert command[trainer_at - 1] == "-m"
    assert command[trainer_at + 1 :] == ["--config=w/config.json"]
    assert "--ft-enable-nic-monitor=true" in build_launch_command(1, args, cpu=False)
    with pytest.raises(ValueError):
        build_launch_command(0, args)
    with pytest.raises(ValueError):
        build_launch_command(1, args, settings=LauncherSettings(max_restarts=-1))


def test_a_launch_gets_a_temporary_folder_of_its_own_that_goes_with_it(tmp_path, monkeypatch):
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="rtp-t-", dir="/tmp"))  # tmp_path is too deep, see below
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(base))
        env = {"TMPDIR": "/somewhere"}
        with launch_tempdir(env) as folder:
            assert folder.parent == base and env["TMPDIR"] == str(folder)
            (folder / "torchelastic_x").mkdir()  # what a launcher leaves
            (folder / "torchelastic_x" / "log").write_text("")
        assert env == {"TMPDIR": "/somewhere"} and list(base.iterdir()) == []
        with launch_tempdir({}) as folder:
            pass
        assert not folder.exists()
    finally:
        shutil.rmtree(base)
    # A TMPDIR so deep that the launcher's socket paths would not fit in 108 bytes: /tmp.
    deep = tmp_path / ("d" * 40)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with launch_tempdir(env) as folder:
        assert folder.parent == Path("/tmp") and len(str(folder / "_ft_launcher4194304_rmon127.socket")) < 108
    assert not folder.exists() and list(deep.iterdir()) == []


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factors = [lr_factor(step, 20, 5, 0.1) for step in range(21)]
    assert factors[0] == pytest.approx(0.2) and factors[4] == pytest.approx(1.0)
    assert factors[5] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(factors[5:]))
    assert factors[20] == pytest.approx(0.1)


def test_events_and_atomic_json(tmp_path):
    log = EventLog(tmp_path, enabled=True)
    log.emit("step", step=1, loss=2.0)
    EventLog(tmp_path / "other", enabled=False).emit("step", step=1)
    assert json.loads((tmp_path / "events.jsonl").read_text())["loss"] == 2.0
    assert not (tmp_path / "other").exists()
    write_json_atomic(tmp_path / "s.json", {"a": 1})
    assert json.loads((tmp_path / "s.json").read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_summary_collects_each_step_record(tmp_path):
    import time

    folder = run_dir(tmp_path, "r1")
    start = time.time()
    record_step(folder, "stage", start, snapshot_dir="/snap")
    record_step(folder, "train", start, steps=12, final_loss=2.5, checkpoint="/ck/step_12", model_sha256="ab")
    record_step(folder, "validate", start, holdout_loss=2.4, decision="champion", step=12)
    record_step(
        folder, "register", start, model_name="m", version="3", alias="champion", model_uri="models:/m/3"
    )
    summary = build_summary(LocalOptions(), folder, "sqlite:///x.db", "s3://b/p/", 9.5)
    assert summary["steps"] == 12 and summary["checkpoint"] == "/ck/step_12"
    assert summary["mlflow"]["version"] == "3" and summary["decision"] == "champion"
    assert set(summary["elapsed_s"]) == {"stage", "train", "validate", "register"}
    text = format_summary(summary, str(tmp_path))
    assert "m version 3" in text and "mlflow ui --backend-store-uri sqlite:///x.db" in text


def test_summary_of_a_rejected_run_says_so(tmp_path):
    import time

    folder = run_dir(tmp_path, "r2")
    record_step(folder, "train", time.time(), steps=2, final_loss=5.0, checkpoint="/c", model_sha256="x")
    record_step(folder, "validate", time.time(), holdout_loss=5.0, decision="reject", step=2)
    summary = build_summary(LocalOptions(), folder, "http://mlflow", "s3://b/", 1.0)
    assert summary["mlflow"]["version"] is None
    assert "not registered" in format_summary(summary, str(tmp_path))


def test_efficiency_follows_the_aws_definition():
    from trainer.checkpointing import efficiency_pct

    assert efficiency_pct(0.0, 10.0) == 100.0
    assert efficiency_pct(1.0, 10.0) == pytest.approx(90.0)
    assert efficiency_pct(0.0, 0.0) == 100.0


def test_root_cause_is_the_first_rank_error_without_launcher_noise():
    from trainer.launch import root_cause

    log = "\n".join(
        [
            "step 1 loss 5.0",
            "[rank1]:     raise FloatingPointError(...)",
            "[rank1]: FloatingPointError: loss became nan at step 2; lower optimizer.lr",
            "AttributeError: 'ForkAwareLocal' object has no attribute 'connection'",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        ]
    )
    assert root_cause(log) == "FloatingPointError: loss became nan at step 2; lower optimizer.lr"
    assert root_cause("trainer: error: data dir is empty") == "trainer: error: data dir is empty"
    assert root_cause("all good") is None
