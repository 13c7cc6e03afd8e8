"""`training.deterministic`: the config field, what a rank sets for it, that CPU training is
unchanged by it, and what `rtp bench recovery` claims as exact on each device."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from benchmarks import recovery
from trainer.config import ConfigError, TrainConfig, TrainingConfig, build_config
from trainer.determinism import CUBLAS_ENV, NCCL_DETERMINISTIC_ENV, apply_determinism


@pytest.fixture
def torch_flags() -> Iterator[None]:
    """The process-wide flags apply_determinism sets, as they were before the test."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


# ---- the config field ------------------------------------------------------------------


def test_the_field_is_off_by_default_parses_as_a_bool_and_round_trips():
    assert TrainConfig().training.deterministic is False
    assert build_config("tiny-cpu", ["training.deterministic=true"]).training.deterministic is True
    assert build_config("tiny-cpu", ["training.deterministic=off"]).training.deterministic is False
    config = build_config("tiny-cpu", ["training.deterministic=on"])
    assert TrainConfig.from_json(config.to_json()).training.deterministic is True


def test_a_value_that_is_not_a_bool_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"training\.deterministic must be bool, got 'sometimes'"):
        build_config("tiny-cpu", ["training.deterministic=sometimes"])
    with pytest.raises(ConfigError, match=r"training\.deterministic must be bool, got 1"):
        TrainConfig.from_json('{"training": {"deterministic": 1}}')


def test_the_setting_is_not_part_of_the_model_hash():
    # It changes how reproducible the numbers are, not what is trained: a checkpoint of a
    # run without it resumes with it and the other way round.
    plain = build_config("tiny-cpu")
    assert build_config("tiny-cpu", ["training.deterministic=true"]).model_hash() == plain.model_hash()


# ---- what a rank sets --------------------------------------------------------------------


@pytest.mark.usefixtures("torch_flags")
@pytest.mark.parametrize("cuda", [False, True])
def test_on_sets_torchs_flags_cublas_and_on_cuda_ncclss_environment(cuda):
    torch.backends.cudnn.benchmark = True  # a value the switch must turn off
    environ: dict[str, str] = {}
    added = apply_determinism(TrainingConfig(deterministic=True), cuda=cuda, environ=environ)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()  # warn-only keeps Flash backward racy
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    expected = {**CUBLAS_ENV, **(NCCL_DETERMINISTIC_ENV if cuda else {})}
    assert added == environ == expected
    if cuda:
        assert environ["NCCL_ALGO"] == "Ring" and environ["NCCL_PROTO"] == "Simple"
    else:
        assert "NCCL_ALGO" not in environ and "NCCL_PROTO" not in environ


@pytest.mark.usefixtures("torch_flags")
def test_a_users_environment_values_are_kept():
    environ = {"NCCL_ALGO": "Tree", "CUBLAS_WORKSPACE_CONFIG": ":16:8", "OTHER": "x"}
    added = apply_determinism(TrainingConfig(deterministic=True), cuda=True, environ=environ)
    assert environ == {
        "NCCL_ALGO": "Tree",
        "CUBLAS_WORKSPACE_CONFIG": ":16:8",
        "OTHER": "x",
        "NCCL_PROTO": "Simple",
    }
    assert added == {"NCCL_PROTO": "Simple"}


@pytest.mark.usefixtures("torch_flags")
def test_off_leaves_the_environment_alone_and_returns_torchs_flags_to_their_defaults():
    apply_determinism(TrainingConfig(deterministic=True), cuda=False, environ={})
    environ: dict[str, str] = {}
    assert apply_determinism(TrainingConfig(), cuda=True, environ=environ) == {}
    assert environ == {}
    # A restart of train() in the same process starts from its config, not from the last attempt.
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic


@pytest.mark.timeout(120)
def test_off_costs_a_new_rank_no_import_of_inductor():
    """torch.use_deterministic_algorithms imports torch._inductor's config (seconds on a loaded
    machine): a rank with the switch off, torch's default, must not pay that at its start."""
    code = (
        "import sys, torch\n"
        "from trainer.config import TrainingConfig\n"
        "from trainer.determinism import apply_determinism\n"
        "apply_determinism(TrainingConfig(), cuda=False, environ={})\n"
        "print('torch._inductor.config' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True
    )
    assert done.stdout.strip() == "False"


# ---- one rank on CPU ---------------------------------------------------------------------


def _train_one_rank(dataset_dir, workdir, deterministic: bool):
    from trainer.loop import Trainer

    config = build_config(
        "tiny-cpu",
        [
            f"data.dataset_dir={dataset_dir}",
            f"run.workdir={workdir}",
            "run.steps=3",
            "run.seed=5",
            "checkpoint.mode=off",
            "checkpoint.local_every_steps=0",
            f"training.deterministic={str(deterministic).lower()}",
        ],
    )
    with Trainer(config) as trainer:
        return trainer.train()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("single_rank_group", "torch_flags")
def test_one_rank_trains_with_it_on_cpu_to_the_same_weights_as_without(dataset_dir, tmp_path):
    before = {key: os.environ.get(key) for key in CUBLAS_ENV}
    try:
        plain = _train_one_rank(dataset_dir, tmp_path / "plain", deterministic=False)
        assert not torch.are_deterministic_algorithms_enabled()
        strict = _train_one_rank(dataset_dir, tmp_path / "deterministic", deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()  # train() applied it
    finally:
        gc.unfreeze()  # train() froze what it had built; this process goes on with other tests
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert strict.completed and strict.steps == 3 and math.isfinite(strict.final_loss)
    # fp32 on CPU is deterministic already: the switch changes no weight there.
    assert strict.model_sha256 == plain.model_sha256
    assert strict.losses == plain.losses


# ---- what the recovery bench claims --------------------------------------------------------


def _never_loaded() -> dict[str, float]:
    raise AssertionError("equal hashes need no weights loaded")


def test_on_cpu_exact_is_the_hash_comparison():
    equal = recovery.exactness(
        device="cpu", deterministic=False, model_sha256="a", baseline_sha256="a", difference=_never_loaded
    )
    assert equal == {"exact": True, "weights_max_abs_diff": 0.0, "weights_rel_diff": 0.0}
    differ = recovery.exactness(
        device="cpu",
        deterministic=False,
        model_sha256="a",
        baseline_sha256="b",
        difference=lambda: {"weights_max_abs_diff": 0.5, "weights_rel_diff": 0.01},
    )
    assert differ == {"exact": False, "weights_max_abs_diff": 0.5, "weights_rel_diff": 0.01}


def test_on_cuda_with_deterministic_exact_is_the_hash_comparison_too():
    differ = recovery.exactness(
        device="cuda",
        deterministic=True,
        model_sha256="a",
        baseline_sha256="b",
        difference=lambda: {"weights_max_abs_diff": 1e-6, "weights_rel_diff": 1e-7},
    )
    assert differ["exact"] is False  # a tiny difference is still a failure where bits must match


def test_on_cuda_without_deterministic_exact_is_not_claimed_and_the_difference_is_weighed_against_noise():
    def result(rel: float, noise: float | None) -> dict:
        return recovery.exactness(
            device="cuda",
            deterministic=False,
            model_sha256="a",
            baseline_sha256="b",
            difference=lambda: {"weights_max_abs_diff": 10 * rel, "weights_rel_diff": rel},
            noise_rel_diff=noise,
        )

    close = result(3e-4, noise=1e-4)
    assert close == {
        "exact": None,
        "weights_max_abs_diff": pytest.approx(3e-3),
        "weights_rel_diff": 3e-4,
        "within_noise": True,
    }
    assert result(2e-3, noise=1e-4)["within_noise"] is False  # beyond 10x a fault-free rerun's
    assert result(1e-6, noise=0.0)["within_noise"] is False  # reruns agree bit for bit: so must it
    # Equal hashes there are luck, not a guarantee: still no verdict, and no weights loaded.
    lucky = recovery.exactness(
        device="cuda",
        deterministic=False,
        model_sha256="a",
        baseline_sha256="a",
        difference=_never_loaded,
        noise_rel_diff=0.0,
    )
    assert lucky["exact"] is None and lucky["weights_rel_diff"] == 0.0 and lucky["within_noise"] is True


def _bench_result(device: str, deterministic: bool, rows: dict[str, dict]) -> dict:
    base = {
        "fault_to_resumed_s_median": 1.0,
        "shutdown_s_median": 0.5,
        "startup_s_median": 0.5,
        "faults": 2,
        "preforked": 0,
        "steps_redone": 0,
    }
    return {
        **{name: {**base, **row} for name, row in rows.items()},
        "settings": {
            "nproc": 2,
            "steps": 24,
            "checkpoint.every_steps": 4,
            "fault_steps": [9, 17],
            "fault_rank": 1,
            "collective_timeout_s": 15.0,
            "soft_timeout_s": 30.0,
            "local_every_steps": "auto",
            "device": device,
            "deterministic": deterministic,
            "bitwise_expected": recovery.bitwise_expected(device, deterministic),
            "noise_rel_diff": None if recovery.bitwise_expected(device, deterministic) else 1e-4,
        },
    }


def test_the_table_says_true_on_cpu_and_a_difference_on_cuda_without_deterministic():
    cpu = recovery.format_table(
        _bench_result("cpu", False, {"inprocess": {"exact": True, "weights_rel_diff": 0.0}})
    )
    assert cpu.splitlines()[0].startswith("2 ranks, 24 steps")
    assert cpu.splitlines()[-1].split()[-1] == "True" and "not claimed" not in cpu
    rows = {
        "inprocess": {"exact": None, "weights_rel_diff": 2.5e-4, "within_noise": True},
        "sigkill": {"exact": None, "weights_rel_diff": 4e-2, "within_noise": False},
    }
    gpu = recovery.format_table(_bench_result("cuda", False, rows)).splitlines()
    assert "on CUDA, training.deterministic off" in gpu[0]
    assert gpu[2].startswith("inprocess") and gpu[2].split()[-1] == "~2.5e-04"
    assert gpu[3].startswith("sigkill") and gpu[3].split()[-1] == "!4.0e-02"
    assert "True" not in " ".join(gpu[2:4]) and gpu[-1].startswith("exact: not claimed on CUDA")
    assert "differs by 1.0e-04" in gpu[-1]


def test_the_weight_difference_of_two_checkpoints(tmp_path):
    config = build_config("tiny-cpu").model
    from trainer.models import model_spec

    spec = model_spec(config.kind)
    torch.manual_seed(0)
    reference = spec.build(config, torch.device("cpu"))
    moved = spec.build(config, torch.device("cpu"))
    moved.load_state_dict(reference.state_dict())
    tensor = next(iter(moved.state_dict().values()))
    with torch.no_grad():
        tensor.view(-1)[0] += 0.25
    for module, folder in ((reference, "ref"), (moved, "moved")):
        dcp.save({"model": module.state_dict()}, checkpoint_id=str(tmp_path / folder), no_dist=True)
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in reference.state_dict().values()))
    difference = recovery.weight_difference(tmp_path / "moved", tmp_path / "ref", config)
    assert difference["weights_max_abs_diff"] == pytest.approx(0.25, rel=1e-6)
    assert difference["weights_rel_diff"] == pytest.approx(0.25 / norm, rel=1e-5)
    same = recovery.weight_difference(tmp_path / "ref", tmp_path / "ref", config)
    assert same == {"weights_max_abs_diff": 0.0, "weights_rel_diff": 0.0}


class _FakeLaunches:
    """Stands in for run_local_training (no GPU here): records each run's config and returns a
    CUDA summary whose weights differ per run, as they would without deterministic kernels."""

    def __init__(self) -> None:
        self.configs: list[TrainConfig] = []

    def __call__(self, nproc, config, **kwargs):
        from types import SimpleNamespace

        self.configs.append(config)
        name = Path(config.run.workdir).name
        return SimpleNamespace(
            device="cuda",
            model_sha256=f"sha-{name}",
            checkpoint=f"{config.run.workdir}/checkpoints/step_8",
            restarts=[{"downtime_s": 1.0, "shutdown_s": 0.4, "startup_s": 0.6, "mechanism": "inprocess"}],
            lost_steps=0,
            goodput_pct=90.0,
        )


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_bench_on_cuda_runs_every_run_with_the_switch_and_weighs_non_deterministic_runs_against_a_rerun(
    monkeypatch, tmp_path, deterministic
):
    launches = _FakeLaunches()
    monkeypatch.setattr(recovery, "run_local_training", launches)
    rel = {"fault-free-rerun": 1e-4, "inprocess": 3e-4}
    monkeypatch.setattr(
        recovery,
        "weight_difference",
        lambda checkpoint, reference, model: {
            "weights_max_abs_diff": 1e-3,
            "weights_rel_diff": rel[Path(checkpoint).parents[1].name],
        },
    )
    result = recovery.run_benchmark(
        mechanisms=["inprocess"],
        nproc=1,
        steps=8,
        every=4,
        fault_steps=[5],
        deterministic=deterministic,
        workdir=tmp_path,
    )
    runs = [Path(c.run.workdir).name for c in launches.configs]
    assert all(
        c.training.deterministic is deterministic for c in launches.configs
    )  # the fault-free run's too
    if deterministic:
        assert runs == ["fault-free", "inprocess"]
        assert result["inprocess"]["exact"] is False  # bits must match there; these differ
        assert result["settings"]["noise_rel_diff"] is None
    else:
        assert runs == ["fault-free", "fault-free-rerun", "inprocess"]
        assert result["inprocess"]["exact"] is None and result["inprocess"]["within_noise"] is True
        assert result["settings"]["noise_rel_diff"] == 1e-4
    assert result["settings"]["bitwise_expected"] is deterministic
    assert result["settings"]["device"] == "cuda"
