"""A resume builds the model without the weights it is about to load (`resume_expected`,
`ModelSpec.init_for_resume`), in this process on one gloo rank through the real `Trainer`.

At 8B, reading the pretrained safetensors again or drawing a random init before the
checkpoint overwrites them is minutes of an in-process restart. Here: a resume from a
committed checkpoint or a fast-tier capture reads no weights and draws none (a LoRA run
still reads its frozen base, which its checkpoints do not hold), and still ends with the
uninterrupted run's weights; a resume that was expected but finds nothing initializes the
weights as a fresh start would; the build runs under the keep-alive."""

from __future__ import annotations

import collections
import contextlib
import gc
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.make_checkpoint import save_checkpoint
from trainer import lora
from trainer.checkpointing import resume_expected
from trainer.checkpointing import tier_slots as slots
from trainer.config import build_config
from trainer.hooks import StepResult, TrainHooks
from trainer.loop import Trainer
from trainer.models import byte_lm, hf_causal_lm

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_rank_group", "quiet_process")]


@pytest.fixture
def quiet_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No MLflow; the SIGTERM handler and the garbage collector as they were."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        gc.unfreeze()  # a Trainer freezes what it built
        signal.signal(signal.SIGTERM, handler)


@pytest.fixture(scope="module")
def hf_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tied tiny Llama folder (with safetensors) and tokens for it."""
    from tests.hf_tiny import write_corpus, write_tiny_model, write_token_snapshot

    root = tmp_path_factory.mktemp("resume-build")
    model_dir = write_tiny_model(root / "model", "llama", tie=True)
    snapshot = write_token_snapshot(write_corpus(root / "corpus", documents=60), model_dir, root / "tokens")
    return model_dir, snapshot


def _hf(hf_inputs: tuple[Path, Path], *extra: str) -> list[str]:
    model_dir, snapshot = hf_inputs
    return [f"model.model_dir={model_dir}", f"data.dataset_dir={snapshot}", "model.seq_len=32", *extra]


def _byte_lm(dataset_dir: Path) -> list[str]:
    return [f"data.dataset_dir={dataset_dir}"]


LORA = ["training.method=lora", "training.lora_rank=4", "optimizer.lr=1e-2"]


def _config(workdir: Path, model: list[str], *overrides: str):
    return build_config(
        "tiny-cpu",
        [
            *model,
            f"run.workdir={workdir}",
            f"checkpoint.local_dir={workdir / 'local'}",
            "run.steps=4",
            "run.seed=3",
            "checkpoint.mode=sync",
            "checkpoint.every_steps=2",
            "checkpoint.local_every_steps=0",
            "data.eval_windows=0",
            "resilience.prefork_workers=false",
            *overrides,
        ],
    )


class _Fault(Exception):
    pass


def _fail_at_step_3(result: StepResult) -> None:
    if result.step == 3:
        raise _Fault


class _Callback:
    def __init__(self, act) -> None:
        self.act = act

    def on_step_end(self, result: StepResult) -> None:
        self.act(result)


def _train(config, hooks: TrainHooks | None = None, fail_at_step_3: bool = False):
    callbacks = [_Callback(_fail_at_step_3)] if fail_at_step_3 else []
    with Trainer(config, hooks=hooks, callbacks=callbacks) as trainer:
        return trainer.train()


class _Calls(collections.Counter):
    """How often the trained weights were read from the model folder or drawn."""


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    counted = _Calls()

    def counting(name, function):
        def wrapper(*args, **kwargs):
            counted[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        hf_causal_lm, "load_pretrained", counting("safetensors read", hf_causal_lm.load_pretrained)
    )
    monkeypatch.setattr(hf_causal_lm, "random_init", counting("random init", hf_causal_lm.random_init))
    monkeypatch.setattr(lora, "init_adapters", counting("adapter init", lora.init_adapters))
    reset = byte_lm.ByteLM.reset_parameters

    def byte_lm_reset(self):
        if not self.tok_emb.weight.is_meta:  # the constructor draws the weights on a real device
            counted["random init"] += 1
        reset(self)

    monkeypatch.setattr(byte_lm.ByteLM, "reset_parameters", byte_lm_reset)
    return counted


@pytest.fixture(scope="module")
def uninterrupted(hf_inputs, dataset_dir, tmp_path_factory) -> dict[str, str]:
    """model_sha256 of 4 uninterrupted steps, per model."""
    import torch.distributed as dist

    runs = {"hf": _hf(hf_inputs), "byte-lm": _byte_lm(dataset_dir), "lora": _hf(hf_inputs, *LORA)}
    found = {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("MLFLOW_TRACKING_URI", raising=False)
            for name, model in runs.items():
                found[name] = _train(_config(tmp_path_factory.mktemp(name), model)).model_sha256
    finally:
        dist.destroy_process_group()
        gc.unfreeze()
    return found


def test_a_resume_from_a_committed_checkpoint_reads_no_safetensors_and_draws_no_weights(
    hf_inputs, uninterrupted, tmp_path, calls
):
    config = _config(tmp_path, _hf(hf_inputs))
    _train(_config(tmp_path, _hf(hf_inputs), "run.stop_after_steps=2"))
    assert calls == {"safetensors read": 1}  # the fresh start's
    calls.clear()

    summary = _train(config)

    assert summary.resumed_from == str(tmp_path / "checkpoints" / "step_2")
    assert calls == {}
    assert summary.model_sha256 == uninterrupted["hf"]


def test_every_dcp_read_and_write_off_the_main_thread_is_bound_to_the_attempts_group(
    hf_inputs, tmp_path, monkeypatch
):
    """The pretrained weights' read, a `sync` save and a resume's load run in threads
    (trainer/waiting.py) that an in-process restart leaves running: each gets the group of
    the attempt that began it, not None, which DCP resolves to the default group when each
    collective runs, by then the next attempt's, where the peers run their own."""
    import threading

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    calls = []

    def recording(name, function):
        def wrapper(*args, process_group=None, **kwargs):
            calls.append((name, threading.current_thread().name, process_group, dist.group.WORLD))
            return function(*args, process_group=process_group, **kwargs)

        return wrapper

    monkeypatch.setattr(dcp, "load", recording("load", dcp.load))
    monkeypatch.setattr(dcp, "save", recording("save", dcp.save))
    _train(_config(tmp_path, _hf(hf_inputs), "run.stop_after_steps=2"))
    _train(_config(tmp_path, _hf(hf_inputs)))
    # The weights' read and the save of step 2; the resume's load and the save of step 4.
    assert [name for name, *_ in calls] == ["load", "save", "load", "save"]
    assert all(thread != "MainThread" for _, thread, _, _ in calls)
    assert all(group is not None and group is world for _, _, group, world in calls)


def test_a_resume_from_a_fast_tier_capture_reads_no_safetensors_and_draws_no_weights(
    hf_inputs, uninterrupted, tmp_path, calls
):
    config = _config(tmp_path, _hf(hf_inputs), "checkpoint.local_every_steps=1")
    hooks = TrainHooks()  # one capture cache for both attempts, as an in-process restart has
    with pytest.raises(_Fault):
        _train(config, hooks, fail_at_step_3=True)
    calls.clear()

    summary = _train(config, hooks)

    assert summary.resumed_from == "local:3"
    assert calls == {}
    assert summary.model_sha256 == uninterrupted["hf"]


def test_a_byte_lm_resume_draws_no_weights(dataset_dir, uninterrupted, tmp_path, calls):
    _train(_config(tmp_path, _byte_lm(dataset_dir), "run.stop_after_steps=2"))
    assert calls == {"random init": 1}
    calls.clear()

    summary = _train(_config(tmp_path, _byte_lm(dataset_dir)))

    assert summary.resumed_from is not None and calls == {}
    assert summary.model_sha256 == uninterrupted["byte-lm"]


def test_a_lora_resume_reads_the_frozen_base_and_draws_no_adapters(hf_inputs, uninterrupted, tmp_path, calls):
    _train(_config(tmp_path, _hf(hf_inputs, *LORA), "run.stop_after_steps=2"))
    calls.clear()

    summary = _train(_config(tmp_path, _hf(hf_inputs, *LORA)))

    assert summary.resumed_from is not None
    assert calls == {"safetensors read": 1}  # the base: a LoRA checkpoint holds the adapters only
    assert summary.model_sha256 == uninterrupted["lora"]


@pytest.mark.parametrize("model", ["hf", "byte-lm"])
def test_an_expected_resume_that_finds_nothing_starts_as_a_fresh_run(
    model, hf_inputs, dataset_dir, uninterrupted, tmp_path, calls, monkeypatch
):
    expected: list[bool] = []

    def wrong_guess(config, cache) -> bool:
        expected.append(True)
        return True

    monkeypatch.setattr("trainer.loop.resume_expected", wrong_guess)
    summary = _train(_config(tmp_path, _hf(hf_inputs) if model == "hf" else _byte_lm(dataset_dir)))

    assert expected == [True] and summary.resumed_from is None
    assert sum(calls.values()) == 1  # initialized once, after the load found nothing
    assert summary.model_sha256 == uninterrupted[model]


class _KeepaliveHooks(TrainHooks):
    def __init__(self) -> None:
        self.depth = 0

    @contextlib.contextmanager
    def keepalive(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


def test_the_model_build_runs_under_the_keepalive(hf_inputs, tmp_path, monkeypatch):
    hooks = _KeepaliveHooks()
    seen: list[tuple[str, bool]] = []
    for name in ("load_pretrained", "_init_buffers"):  # a fresh build's read; every build's buffers
        function = getattr(hf_causal_lm, name)

        def recording(*args, _name=name, _function=function, **kwargs):
            seen.append((_name, hooks.depth > 0))
            return _function(*args, **kwargs)

        monkeypatch.setattr(hf_causal_lm, name, recording)
    # And the loop's start: until its first step no step end heart-beats.
    from trainer import loop
    from trainer.progress import Progress

    freeze, backfill = loop._freeze_startup_objects, Progress.backfill
    monkeypatch.setattr(
        loop,
        "_freeze_startup_objects",
        lambda *a: (seen.append(("loop start", hooks.depth > 0)), freeze(*a))[1],
    )
    monkeypatch.setattr(
        Progress, "backfill", lambda *a: (seen.append(("backfill", hooks.depth > 0)), backfill(*a))[1]
    )

    publish, publishing_threads = loop._publish, []

    def publishing(*args):
        seen.append(("publish", hooks.depth > 0))
        publishing_threads.append(threading.current_thread().name)
        return publish(*args)

    monkeypatch.setattr(loop, "_publish", publishing)

    _train(_config(tmp_path, _hf(hf_inputs), "run.stop_after_steps=2"), hooks)
    _train(_config(tmp_path, _hf(hf_inputs), "run.steps=3"), hooks)  # resumed at step 2

    assert seen == [
        ("load_pretrained", True),
        ("_init_buffers", True),
        ("loop start", True),
        ("publish", True),  # rank 0's goodput report, MLflow and summary at the run's end
        ("_init_buffers", True),
        ("loop start", True),
        ("backfill", True),  # rank 0 reads the run's history before the others start stepping
        ("publish", True),
    ]
    # Not on the main thread: a call blocked in C there (a stalled MLflow server) stamps no
    # progress for NVRx's watchdog, keep-alive or not.
    assert publishing_threads == ["rtp-publish", "rtp-publish"]


def test_resume_is_expected_from_a_committed_checkpoint_a_capture_in_memory_or_a_tier_file(
    dataset_dir, tmp_path
):
    config = _config(tmp_path, _byte_lm(dataset_dir))
    root = Path(config.checkpoint_dir())
    cache = slots.CaptureCache()
    assert not resume_expected(config, cache)

    cache.put(slots.run_key(root), {"step": 3}, None)
    assert resume_expected(config, cache)

    folder = slots.local_folder(config.checkpoint.local_dir, root)
    folder.mkdir(parents=True)
    (folder / slots.slot_name(0, 0)).write_bytes(b"")  # a slot without a header holds no capture
    assert not resume_expected(config, slots.CaptureCache())
    (folder / slots.head_name(0, 3, 0)).write_bytes(b"")
    assert resume_expected(config, slots.CaptureCache())

    other = _config(tmp_path / "other", _byte_lm(dataset_dir))
    model = torch.nn.Linear(2, 2)
    save_checkpoint(other.checkpoint_dir(), 2, model, torch.optim.SGD(model.parameters()), {}, {})
    assert resume_expected(other, slots.CaptureCache())
