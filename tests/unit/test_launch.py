"""The local launcher (trainer/launch.py): the ft_launcher command, a temporary folder per launch,
the root cause picked from a failed launch's log."""

from pathlib import Path

import pytest

from trainer.launch import LauncherSettings, build_launch_command, launch_tempdir, trainer_arguments


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
