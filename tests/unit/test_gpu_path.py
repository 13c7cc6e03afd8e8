"""The GPU and cluster path's CPU-checkable parts: the process group's backends, the GPU
timeout table every launcher applies, NCCL's environment, and the keep-alive that feeds the
in-process watchdog and ft_launcher during blocking checkpoint work."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from components.train.job_scale import GPU_SCALE, trainer_overrides
from trainer import gpu_defaults, resilience
from trainer.config import ConfigError, ResilienceConfig, build_config
from trainer.gpu_defaults import GPU_RESILIENCE, NCCL_ENV, apply_nccl_environment, check_timeouts
from trainer.hooks import StepResult
from trainer.launch import LauncherSettings
from trainer.parallelize import process_group_backend
from trainer.timeouts import watchdog_timeouts


def test_a_gpu_process_group_serves_host_tensors_too():
    # NCCL has no CPU backend: flags, counts and object collectives need gloo beside it.
    assert process_group_backend(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_the_gpu_table_is_coherent_for_in_process_restart():
    config = build_config("gpu-125m", gpu_defaults.resilience_overrides())
    r = config.resilience
    assert r.collective_timeout_s == GPU_RESILIENCE["collective_timeout_s"]
    # NCCL's watchdog ends the process: it must outlast the wrapper's hard timeout (NVRx usage guide).
    soft_s, hard_s = watchdog_timeouts(r)
    assert soft_s < hard_s < r.collective_timeout_s
    assert r.timeout_floor_s == GPU_RESILIENCE["timeout_floor_s"] and (
        r.soft_timeout_s,
        r.hard_timeout_s,
    ) == (
        "auto",
        "auto",
    )
    launcher = gpu_defaults.launcher_settings(max_restarts=10)
    assert launcher.heartbeat_timeout_s > hard_s  # ft_launcher acts on dead ranks only
    assert launcher.initial_heartbeat_timeout_s >= launcher.heartbeat_timeout_s
    check_timeouts(r, "cuda")  # accepted
    # Job pods and in-pod runs take the same table.
    assert trainer_overrides(8) == gpu_defaults.resilience_overrides()
    assert GPU_SCALE.collective_timeout_s == r.collective_timeout_s


def test_timeouts_in_the_wrong_order_for_the_device_are_refused():
    gpu_like = ResilienceConfig(collective_timeout_s=120, soft_timeout_s=300, hard_timeout_s=600)
    with pytest.raises(ConfigError, match=r"must exceed resilience\.hard_timeout_s \(600\) on GPUs"):
        check_timeouts(gpu_like, "cuda")
    cpu_wrong = ResilienceConfig(collective_timeout_s=60, soft_timeout_s=30, hard_timeout_s=45)
    with pytest.raises(ConfigError, match=r"below resilience\.hard_timeout_s \(45\) on CPU"):
        check_timeouts(cpu_wrong, "cpu")
    check_timeouts(ResilienceConfig(), "cpu")
    check_timeouts(ResilienceConfig(collective_timeout_s=60, inprocess_restarts=0), "cpu")  # no wrapper


def test_nccl_environment_is_set_once_and_a_users_value_wins():
    environ = {"NCCL_NVLS_ENABLE": "1"}
    added = apply_nccl_environment(environ)
    assert environ["NCCL_NVLS_ENABLE"] == "1" and "NCCL_NVLS_ENABLE" not in added
    assert environ["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0" == NCCL_ENV["TORCH_NCCL_RETHROW_CUDA_ERRORS"]
    assert apply_nccl_environment(environ) == {}


class _Wrapper:
    def __init__(self) -> None:
        self.pings: list[float] = []
        self.iteration = 0

    def ping(self) -> None:
        self.pings.append(time.monotonic())


class _Monitor:
    """ft_launcher's RankMonitorClient as the launcher client uses it."""

    is_initialized = True

    def __init__(self) -> None:
        self.beats: list[float] = []

    def send_heartbeat(self) -> None:
        self.beats.append(time.monotonic())


_STEP_1 = StepResult(step=1, loss=1.0, lr=1e-3, duration_s=0.01, grad_norm=None, stop_requested=False)


def _hooks(limit_s: float = 60.0) -> tuple[resilience._Hooks, _Wrapper, _Monitor]:
    launcher = resilience._LauncherClient(floor_s=15.0)
    monitor = _Monitor()
    launcher.client = monitor
    wrapper = _Wrapper()
    # Explicit timeouts: the pings here are keepalive()'s alone (no learned-timeout gate).
    resilience_config = ResilienceConfig(
        blocking_work_limit_s=limit_s, soft_timeout_s=30.0, hard_timeout_s=45.0
    )
    config = SimpleNamespace(resilience=resilience_config)
    return resilience._Hooks(config, launcher, wrapper, 0, None), wrapper, monitor


def test_blocking_work_keeps_the_watchdog_and_the_launcher_alive(monkeypatch):
    monkeypatch.setattr(resilience, "KEEPALIVE_INTERVAL_S", 0.05)
    monkeypatch.setattr(resilience, "HEARTBEAT_INTERVAL_S", 0.1)
    hooks, wrapper, monitor = _hooks()
    hooks.on_step_end(_STEP_1)  # the attempt's first ping starts the watchdog's manual timeout
    pinged, beaten = len(wrapper.pings), len(monitor.beats)
    with hooks.keepalive(), hooks.keepalive():  # nested work shares the outer thread
        time.sleep(0.6)
    assert len(wrapper.pings) - pinged >= 5
    assert len(monitor.beats) - beaten >= 3
    # Only while the work lasts.
    after = len(wrapper.pings)
    time.sleep(0.2)
    assert len(wrapper.pings) == after


def test_no_ping_before_the_attempts_first_step_and_none_past_the_limit(monkeypatch):
    monkeypatch.setattr(resilience, "KEEPALIVE_INTERVAL_S", 0.05)
    monkeypatch.setattr(resilience, "HEARTBEAT_INTERVAL_S", 0.05)
    hooks, wrapper, monitor = _hooks(limit_s=0.3)
    with hooks.keepalive():  # a resume before any step: heartbeats only
        time.sleep(0.2)
    assert wrapper.pings == [] and monitor.beats
    hooks.on_step_end(_STEP_1)
    with hooks.keepalive():
        time.sleep(0.8)  # a hung file system: signals stop at the limit
    last = wrapper.pings[-1]
    assert last - wrapper.pings[0] < 0.5


def _captured_in_pod_run(monkeypatch, tmp_path, gpus: int, overrides: str = ""):
    """(config, launcher settings) an in-pod train step hands to the launcher."""
    from components.train import train as train_step

    seen = {}

    def fake_run(nproc, config, echo=True, settings=None):
        seen.update(config=config, settings=settings)
        raise RuntimeError("stop here")

    monkeypatch.setattr(train_step, "run_local_training", fake_run)
    request = train_step.TrainRequest(
        dataset_dir=str(tmp_path), run_folder=tmp_path / "run", preset="gpu-125m", overrides=overrides
    )
    with pytest.raises(RuntimeError, match="stop here"):
        train_step.train_in_pod(request, nproc=8, gpus=gpus)
    return seen["config"], seen["settings"]


def test_an_in_pod_gpu_run_gets_the_gpu_table_like_a_job(monkeypatch, tmp_path):
    config, settings = _captured_in_pod_run(monkeypatch, tmp_path, gpus=8)
    assert config.resilience.timeout_floor_s == GPU_RESILIENCE["timeout_floor_s"] == 120
    assert config.resilience.soft_timeout_s == "auto"  # learned from step times
    assert config.resilience.collective_timeout_s == GPU_RESILIENCE["collective_timeout_s"]
    assert settings.initial_heartbeat_timeout_s == gpu_defaults.GPU_LAUNCHER["initial_heartbeat_timeout_s"]
    assert settings.max_restarts == GPU_SCALE.max_restarts
    # A user's override still wins; a CPU pod keeps the trainer's own defaults.
    kept, _ = _captured_in_pod_run(monkeypatch, tmp_path, gpus=8, overrides="resilience.soft_timeout_s=200")
    assert kept.resilience.soft_timeout_s == 200
    cpu, cpu_settings = _captured_in_pod_run(monkeypatch, tmp_path, gpus=0)
    assert cpu.resilience == ResilienceConfig() and cpu_settings == LauncherSettings(
        rank_module="rtp_prefork"
    )


def test_train_local_on_a_gpu_machine_gets_the_gpu_table(monkeypatch, tmp_path):
    from rtp_cli import train_commands
    from trainer import launch

    seen = {}

    def fake_run(nproc, config, echo=True, settings=None):
        seen.update(config=config, settings=settings)
        raise RuntimeError("stop here")

    monkeypatch.setattr(launch, "run_local_training", fake_run)
    monkeypatch.setattr(train_commands, "torch_sees_gpus", lambda: True)
    parser = __import__("argparse").ArgumentParser()
    sub = parser.add_subparsers()
    train_commands.add_train_local_parser(sub)
    args = parser.parse_args(
        ["train-local", "--dataset-dir", str(tmp_path), "--workdir", str(tmp_path / "w")]
    )
    with pytest.raises(RuntimeError, match="stop here"):
        args.handler(args)
    assert seen["config"].resilience.timeout_ceiling_s == GPU_RESILIENCE["timeout_ceiling_s"]
    assert seen["settings"].heartbeat_timeout_s == gpu_defaults.GPU_LAUNCHER["heartbeat_timeout_s"]
