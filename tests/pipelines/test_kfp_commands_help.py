"""`rtp upload | run | schedule | runs --help` document their flags, and `rtp --help` lists them."""

import pytest

from rtp_cli.main import build_parser

FLAGS = {
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
}


def test_top_level_help_lists_the_kubeflow_commands(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for name in FLAGS:
        assert f"    {name} " in out


@pytest.mark.parametrize(("command", "flags"), FLAGS.items())
def test_help_documents_flags(command, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in flags:
        assert flag in out, f"{command} --help does not mention {flag}"
