"""The `rtp` command line: every subcommand is listed and documents its flags, the console
script points at the entry point, and bad input ends in one line with exit code 2."""

import configparser
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from rtp_cli.main import build_parser, main

SUBCOMMANDS = {
    "local": [
        "--workdir",
        "--steps",
        "--nproc",
        "--checkpoint-every",
        "--checkpoint-mode",
        "--source",
        "--s3-endpoint-url",
        "--mlflow-uri",
        "--model-source",
        "--model-init",
    ],
    "compile": ["--output", "--image"],
    "train-local": [
        "--nproc",
        "--steps",
        "--checkpoint-every",
        "--checkpoint-mode",
        "--seed",
        "--workdir",
        "--dataset-dir",
    ],
    "stage": ["--source", "--fsx-mount-path"],
    "prepare-data": [
        "--corpus",
        "--out-dir",
        "--dest",
        "--shard-mib",
        "--tokenizer",
        "--workers",
        "--holdout-fraction",
    ],
    "make-tiny-model": ["OUT_DIR", "--arch", "--vocab-size", "--seed"],
    "validate": ["--checkpoint", "--dataset-dir", "--max-loss"],
    "register": ["--checkpoint", "--model-name", "--alias"],
    "bench": ["checkpoint"],
    "upload": ["--host", "--token", "--namespace", "--name", "--version", "--package", "--image"],
    "run": ["--host", "--experiment", "--param", "--version", "--wait", "--timeout-s"],
    "schedule": [
        "--name",
        "--cron",
        "--interval",
        "--max-concurrency",
        "--catchup",
        "--enable",
        "--disable",
        "--delete",
    ],
    "runs": ["--host", "--experiment", "--limit", "--fsx-mount-path"],
    "gc": [
        "--fsx-mount-path",
        "--keep",
        "--active-within-hours",
        "--apply",
        "--without-registry",
        "--mlflow-uri",
    ],
}


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        # a long name gets a line of its own, its help on the next
        assert f"    {name} " in out or f"    {name}\n" in out, f"rtp --help does not list {name}"


@pytest.mark.parametrize(("command", "flags"), SUBCOMMANDS.items())
def test_subcommand_help_documents_its_flags(command, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in flags:
        assert flag in out, f"{command} --help does not mention {flag}"


def test_installed_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "rtp_cli.main", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert "rtp local" in result.stdout


def test_console_script_is_the_entry_point():
    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    name, target = setup["options.entry_points"]["console_scripts"].strip().split(" = ")
    module, attribute = target.split(":")
    assert name == "rtp"
    assert getattr(importlib.import_module(module), attribute) is main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["local", "--overrides", "optimizer.nope=1"], "optimizer has"),
        (["local", "--nproc", "0"], "--nproc must be at least 1"),
        (["local", "--source", "/data"], "s3://bucket/prefix"),
        (["local", "--model-source", "s3://b/models/m/"], "needs --source s3://"),
        (["local", "--model-source", "/no/such/model"], "no such folder"),
        (["make-tiny-model", "--arch", "llama", "/"], "not an empty folder"),
        (["train-local", "--dataset-dir", "x", "--override", "model.n_heads=3"], "divisible"),
        (["local", "--overrides", "model.n_heads=0"], "at least 1"),
        (["local", "--run-name", "nightly\n"], "run_name"),
        (["local", "--model-name", "a' or name != '"], "model_name"),
        (["local", "--overrides", "checkpoint.dir=/fsx/rtp/runs/nightly/checkpoints"], "is refused"),
        (["render-job", "--mode", "pytorchjob", "--tolerations", "[1]"], "toleration objects"),
        (["render-job", "--mode", "pytorchjob", "-o", "/nonexistent-rtp/dir/job.yaml"], "No such file"),
        (["compile", "-o", "/nonexistent-rtp/pipeline.yaml"], "No such file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_the_error_handler_imports_nothing_heavy():
    """A broken torch or mlflow must not turn every one-line error into an ImportError."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['mlflow'] = None\n"
        "from rtp_cli.main import main\n"
        "sys.exit(main(['render-job', '--mode', 'pytorchjob', '--tolerations', '[1]']))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "toleration objects" in result.stderr and "Traceback" not in result.stderr


def test_compile_writes_the_requested_image(tmp_path, capsys):
    target = tmp_path / "out.yaml"
    assert main(["compile", "-o", str(target), "--image", "registry.example/rtp:1"]) == 0
    assert "image: registry.example/rtp:1" in target.read_text()


@pytest.mark.parametrize("command", [["validate", "--dataset-dir", "unused"], ["register"]])
def test_a_folder_without_a_checkpoint_is_one_line_and_exit_2(command, tmp_path, capsys):
    assert main([*command, "--checkpoint", str(tmp_path / "no-run")]) == 2
    err = capsys.readouterr().err
    assert f"no committed checkpoint under {tmp_path / 'no-run'}" in err
    assert "Traceback" not in err
