"""What benchmarks/gpu_check.sh runs on a stock CUDA machine imports neither kfp nor mlflow
(they are not installed there): checked in a fresh interpreter in which importing either fails."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

CHECKED = (
    "trainer.launch",
    "trainer.loop",
    "trainer.resilience",
    "trainer.__main__",
    "benchmarks.throughput",
    "benchmarks.bare_fsdp",
    "benchmarks.checkpoint",
    "benchmarks.recovery",
    "rtp_cli.main",
)


def test_trainer_and_gpu_benchmarks_import_without_kfp_or_mlflow():
    script = textwrap.dedent(
        f"""
        import importlib, importlib.abc, sys

        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("kfp", "mlflow"):
                    raise ImportError(f"{{name}} is not installed on the GPU machine")
                return None

        sys.meta_path.insert(0, Absent())
        for module in {CHECKED!r}:
            importlib.import_module(module)
        # The `rtp bench` parser (what gpu_check.sh calls) builds without them too.
        sys.modules["rtp_cli.main"].build_parser().parse_args(["bench", "throughput", "--steps", "1"])
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("kfp", "mlflow")))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_gpu_check_dry_run_passes_on_cpu(tmp_path):
    """The script's checks before the benchmarks (torch, missing wheels, imports, flags)."""
    import os
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(script), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "missing runtime packages: none" in result.stdout
    assert "imports without kfp/mlflow and benchmark flags: ok" in result.stdout
    bad = subprocess.run(
        ["bash", str(script), "--bogus"], capture_output=True, text=True, timeout=30, env=env
    )
    assert bad.returncode == 2 and "usage" in bad.stderr
