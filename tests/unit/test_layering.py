"""The import layering (pyproject.toml [tool.importlinter]) and what moving code to keep it must not change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_are_kept():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_no_benchmark_imports_rtp_cli_even_in_code_it_runs_as_a_string():
    # import-linter reads import statements; a child process's source in a string is text to it.
    # Running `python -m rtp_cli.main` as a user would is fine; importing it is not.
    import re

    pattern = re.compile(r"^\s*(from rtp_cli[.\s]|import rtp_cli\b)", re.MULTILINE)
    found = [path.name for path in (ROOT / "benchmarks").glob("*.py") if pattern.search(path.read_text())]
    assert found == []


def _private_names_of_the_fast_tier() -> set[str]:
    import ast

    module = ast.parse((ROOT / "trainer/checkpointing/local_tier.py").read_text())
    tier = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "LocalTier")
    names = {n.name for n in tier.body if isinstance(n, ast.FunctionDef)}
    names |= {
        n.attr
        for n in ast.walk(tier)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_nothing_outside_the_fast_tiers_module_touches_its_private_fields():
    """The tier owns its state (issue 51): other trainer modules use its public names only.
    A private name read on anything but `self` outside local_tier.py is a finding."""
    import ast

    private = _private_names_of_the_fast_tier()
    assert {"_slots", "_held", "_lock", "_capture"} <= private  # the scan sees the tier's fields
    found = []
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        if path.name == "local_tier.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            owner = node.value if isinstance(node, ast.Attribute) else None
            if (
                owner is not None
                and node.attr in private
                and not (isinstance(owner, ast.Name) and owner.id == "self")
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_the_byte_lm_model_hash_is_pinned():
    # Checkpoints store model_hash and a resume compares it: the value must never move.
    from trainer.config import build_config

    assert build_config("tiny-cpu").model_hash() == "477aa9c49448a063"
    assert build_config("tiny-cpu", ["run.seed=9", "run.steps=3"]).model_hash() == "477aa9c49448a063"


def test_a_fresh_process_checks_and_hashes_a_config_importing_only_trainer_config():
    code = (
        "from trainer.config import ConfigError, build_config\n"
        "assert build_config('tiny-cpu').model_hash() == '477aa9c49448a063'\n"
        "try:\n"
        "    build_config('tiny-cpu', ['model.kind=nope'])\n"
        "except ConfigError as exc:\n"
        "    assert 'unknown model.kind' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('an unknown model.kind was accepted')\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_the_gpu_smoke_resolves_its_commands_as_the_rtp_parser_does(tmp_path):
    # benchmarks stay below rtp_cli, so the smoke parses train-local's trainer flags itself.
    from benchmarks import gpu_smoke
    from rtp_cli.main import build_parser
    from trainer.arguments import config_from_args

    run = gpu_smoke.SmokeRun("async-exception", "async", "exception@3")
    args = gpu_smoke.train_args(run, tmp_path, tmp_path / "data", cpu=True, deterministic=False)
    expected = config_from_args(build_parser().parse_args(args))
    assert gpu_smoke.resolve(args, cpu=True).to_dict() == expected.to_dict()


def test_the_gpu_smoke_refuses_a_flag_the_trainer_does_not_take(tmp_path):
    from benchmarks import gpu_smoke

    run = gpu_smoke.SmokeRun("async-exception", "async", "exception@3")
    args = gpu_smoke.train_args(run, tmp_path, tmp_path / "data", cpu=True, deterministic=False)
    try:
        gpu_smoke.resolve([*args, "--max-restarts=9"], cpu=True)
    except ValueError as exc:
        assert "--max-restarts=9" in str(exc)
    else:
        raise AssertionError("a launcher flag the smoke does not plan was accepted")
