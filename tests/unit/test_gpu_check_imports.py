"""What benchmarks/gpu_check.sh runs on a stock CUDA machine imports neither kfp nor mlflow
(they are not installed there): checked in a fresh interpreter in which importing either fails.

Both checks are fresh interpreters that spend their time importing torch and the trainer,
one core each: a module fixture starts them together and each test waits for its own."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
    "benchmarks.gpu_smoke",
    "rtp_cli.main",
)

IMPORT_CHECK = textwrap.dedent(
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
GPU_CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


@pytest.fixture(scope="module")
def started(tmp_path_factory) -> dict[str, tuple[subprocess.Popen, dict[str, str]]]:
    """Both checks, started at once: {name: (process, its environment)}."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path_factory.mktemp("gpu-check"))}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "stdin": subprocess.DEVNULL, "text": True}
    processes = {
        "imports": (subprocess.Popen([sys.executable, "-c", IMPORT_CHECK], **pipes), dict(os.environ)),
        "dry-run": (subprocess.Popen(["bash", str(GPU_CHECK), "--dry-run"], env=env, **pipes), env),
    }
    yield processes
    for process, _ in processes.values():
        if process.poll() is None:
            process.kill()
            process.wait()


def _finish(process: subprocess.Popen, timeout_s: float) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=timeout_s)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_trainer_and_gpu_benchmarks_import_without_kfp_or_mlflow(started):
    result = _finish(started["imports"][0], timeout_s=100)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_gpu_check_dry_run_passes_on_cpu(started):
    """The script's checks before the benchmarks (torch, missing wheels, imports, flags, and
    each part's config against the CUDA timeout ordering), async first."""
    process, env = started["dry-run"]
    result = _finish(process, timeout_s=100)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "missing runtime packages: none" in result.stdout
    assert "imports without kfp/mlflow: ok" in result.stdout
    assert (
        "every part's command line parses and its config passes the CUDA timeout check: ok" in result.stdout
    )
    parts = [line.split()[1] for line in result.stdout.splitlines() if ": rtp bench " in line]
    assert parts == ["checkpoint", "throughput", "recovery"]  # checkpoint-sync only when named
    # The modes compared run in one process; the fast tier's interval is pinned.
    checkpoint = next(line for line in result.stdout.splitlines() if "gpu_check: checkpoint (" in line)
    assert "--modes off,async,torch-async" in checkpoint or "--modes off,torch-async" in checkpoint
    assert "--local-every " in checkpoint and "--warmup-steps " in checkpoint
    # The 1B runs train with the GPU timeout table, not the CPU defaults.
    assert all(
        "--override resilience.timeout_floor_s=120" in line
        for line in result.stdout.splitlines()
        if "gpu-1b" in line
    )
    assert not list(Path(env["OUT"]).iterdir())  # a dry run writes nothing under $OUT
    bad = subprocess.run(
        ["bash", str(GPU_CHECK), "--bogus"], capture_output=True, text=True, timeout=30, env=env
    )
    assert bad.returncode == 2 and "usage" in bad.stderr
