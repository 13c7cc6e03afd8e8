"""Two ranks over gloo with Hugging Face models: sharded initialization (random and
pretrained) gives exactly the weights one process builds, the decoder layers are the FSDP
units, and a tiny model trains through the real trainer (`python -m trainer` ranks; ft_launcher
where a rank is killed): resumed and fault-recovered runs end with the fault-free run's
weights, and the checkpoint exports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rtp_support.embedded_s3 import free_port
from tests.hf_tiny import write_tiny_model
from tests.weights import state_dict_sha256
from trainer.config import ModelConfig
from trainer.models import model_spec

pytestmark = pytest.mark.timeout(300)

# Low timeouts, as in test_faults.py: a recovery takes seconds on 2 CPU cores.
FAST = ["resilience.collective_timeout_s=5", "resilience.soft_timeout_s=8", "resilience.hard_timeout_s=30"]


SHARDED_INIT_CASES = [
    ("llama", "pretrained", False),
    ("qwen2", "random", True),
    ("gpt_neox", "pretrained", False),
]


def _shard_and_init(rank: int, world: int, port: int, cases: list[tuple[ModelConfig, str]]) -> None:
    """One rank, for each (config, out) case: build on meta, shard the spec's units, fill the
    shards, report full weights. One process group serves every case (a spawn per case
    would pay the interpreter and torch start-up again)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from trainer.parallelize import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for config, out in cases:
            spec = model_spec(config.kind)
            model = spec.build_for_training(config, torch.device("cpu"), seed=5)
            assert all(p.device.type == "meta" for p in model.parameters())  # nothing materialized yet
            units = spec.fsdp_units(model)
            apply_fsdp(model, mesh, units)
            spec.init_weights(model, config, torch.device("cpu"), 5)
            local_numel = sum(p.to_local().numel() for p in model.parameters())
            full = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
            )
            loss = spec.loss(model, torch.arange(34).reshape(2, 17) % 256).item()
            if rank == 0:
                result = {
                    "sha256": state_dict_sha256(
                        {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
                    ),
                    "sharded_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
                    "units": len(units),
                    "local_numel": local_numel,
                    "total_numel": sum(v.numel() for v in full.values()),
                    "loss": loss,
                    "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
                }
                Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_inits(tmp_path_factory) -> dict[tuple[str, str, bool], tuple[ModelConfig, dict]]:
    """Every case of SHARDED_INIT_CASES sharded over one 2-rank group: (config, rank 0's report)."""
    root = tmp_path_factory.mktemp("sharded-init")
    cases = {}
    for architecture, init, tie in SHARDED_INIT_CASES:
        name = f"{architecture}-{init}-{tie}"
        folder = write_tiny_model(root / name / "model", architecture, tie=tie)
        cases[(architecture, init, tie)] = (
            ModelConfig(kind="hf", model_dir=str(folder), init=init),
            root / name / "rank0.json",
        )
    mp.start_processes(
        _shard_and_init,
        args=(2, free_port(), [(config, str(out)) for config, out in cases.values()]),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return {key: (config, json.loads(out.read_text())) for key, (config, out) in cases.items()}


@pytest.mark.parametrize(("architecture", "init", "tie"), SHARDED_INIT_CASES)
def test_two_rank_sharded_init_equals_one_process_build(architecture, init, tie, sharded_inits):
    config, result = sharded_inits[(architecture, init, tie)]

    spec = model_spec("hf")
    torch.manual_seed(5)
    reference = spec.build(config, torch.device("cpu"))
    assert result["sha256"] == state_dict_sha256(reference.state_dict())
    assert result["units"] == 2 and result["sharded_units"] == 3  # 2 decoder layers + the root
    assert result["local_numel"] < result["total_numel"]  # each rank holds a slice
    assert result["tied"] == tie  # a tied head still shares the embedding's (sharded) weight
    expected_loss = spec.loss(reference, torch.arange(34).reshape(2, 17) % 256).item()
    assert result["loss"] == pytest.approx(expected_loss, rel=1e-5)


@pytest.fixture(scope="module")
def hf_run_inputs(tmp_path_factory):
    """A tiny pretrained Llama folder whose output head is tied to the embeddings (as in
    SmolLM, Llama-3.2-1B and the small Qwen2.5 models), and the demo-sized corpus tokenized
    with its tokenizer: every exactness test below runs on a tied model."""
    from tests.hf_tiny import write_corpus, write_token_snapshot

    root = tmp_path_factory.mktemp("hf-run")
    model_dir = write_tiny_model(root / "model", "llama", tie=True)
    snapshot = write_token_snapshot(
        write_corpus(root / "corpus", documents=120), model_dir, root / "snapshot"
    )
    named = {"model_dir": str(model_dir), "model_init": "pretrained"}
    return model_dir, snapshot, ["model.seq_len=32"], named


@pytest.fixture(scope="module")
def hf_full_workdir(tmp_path_factory) -> Path:
    """The workdir of `hf_uninterrupted`: a test that resumes from its checkpoints copies it."""
    return tmp_path_factory.mktemp("hf-full")


@pytest.fixture(scope="module")
def hf_uninterrupted(hf_run_inputs, hf_full_workdir) -> dict:
    """6 steps of the pretrained Llama on 2 ranks, async checkpoints (the default) every 3."""
    from tests.distributed.conftest import train

    _, snapshot, overrides, named = hf_run_inputs
    return train(snapshot, hf_full_workdir, steps=6, every=3, overrides=[*overrides, *FAST], **named)


@pytest.mark.launches
def test_hf_model_trains_resumes_exactly_and_exports(hf_run_inputs, hf_uninterrupted, tmp_path):
    """2 ranks train a pretrained Llama (async checkpoints); a run
    stopped at step 3 and resumed (sync checkpoints) reaches the same weights; the checkpoint
    validates, and exports to a folder that from_pretrained loads with the same logits."""
    from tests.distributed.conftest import train
    from trainer.checkpointing import load_model_weights

    model_dir, snapshot, overrides, named = hf_run_inputs
    overrides = [*overrides, *FAST]
    full = hf_uninterrupted
    assert full["checkpoint_mode"] == "async"
    assert full["completed"] and full["world_size"] == 2
    losses = [entry["loss"] for entry in full["losses"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]

    first = train(
        snapshot,
        tmp_path / "resumed",
        steps=6,
        every=3,
        overrides=overrides,
        checkpoint_mode="sync",
        stop_after=3,
        **named,
    )
    assert first["steps"] == 3
    resumed = train(
        snapshot, tmp_path / "resumed", steps=6, every=3, overrides=overrides, checkpoint_mode="sync", **named
    )
    assert resumed["resumed_from"].endswith("step_3")
    assert resumed["model_sha256"] == full["model_sha256"]

    from transformers import AutoModelForCausalLM

    spec = model_spec("hf")
    config = ModelConfig(kind="hf", model_dir=str(model_dir), init="pretrained", seq_len=32)
    model = spec.build(config, torch.device("cpu"))
    load_model_weights(full["checkpoint"], model)
    assert state_dict_sha256(model.state_dict()) == full["model_sha256"]
    from components.validate_checkpoint.validate import validate_checkpoint

    # The tied head is one parameter: its optimizer state is there once, and the run can resume.
    validation = validate_checkpoint(
        full["checkpoint"], str(snapshot), max_loss=100.0, require_optimizer_state=True
    )
    assert validation.decision == "champion" and validation.holdout_loss < 100.0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    exported = spec.export(model.state_dict(), config, tmp_path / "export")
    # The export keeps the tie in config.json and writes the shared weight once.
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(exported / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in set(handle.keys())
    loaded = AutoModelForCausalLM.from_pretrained(
        str(exported), local_files_only=True, dtype=torch.float32
    ).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    x = torch.arange(20).reshape(1, 20) % 300
    assert torch.equal(loaded(x).logits, model.eval()(x).logits)


@pytest.mark.launches
def test_training_refuses_data_made_with_another_tokenizer(hf_run_inputs, dataset_dir, tmp_path):
    from tests.distributed.conftest import train
    from trainer.launch import TrainingFailed

    _, _, overrides, named = hf_run_inputs
    with pytest.raises(TrainingFailed) as failure:
        train(dataset_dir, tmp_path, steps=2, every=2, overrides=overrides, **named)
    assert "tokenized as bytes but the model uses tokenizer" in str(failure.value)


@pytest.mark.launches
def test_faults_with_an_hf_model_recover_exactly(hf_run_inputs, hf_uninterrupted, tmp_path):
    """An exception (in-process restart) and a killed rank (ft_launcher restart) in one run
    end with the fault-free run's weights."""
    from tests.distributed.conftest import restart_story, train

    _, snapshot, overrides, named = hf_run_inputs
    summary = train(
        snapshot,
        tmp_path,
        steps=6,
        every=3,
        overrides=[*overrides, *FAST],
        faults=["exception@2:1", "sigkill@5:0"],
        **named,
    )
    assert summary["completed"]
    assert summary["model_sha256"] == hf_uninterrupted["model_sha256"]
    assert [(r["kind"], r["mechanism"]) for r in summary["restarts"]] == [
        ("exception", "inprocess"),
        ("sigkill", "launcher"),
    ], restart_story(summary, tmp_path)


@pytest.mark.launches
def test_a_folder_without_config_json_stops_training_in_one_line(hf_run_inputs, tmp_path):
    from tests.distributed.conftest import train
    from trainer.launch import TrainingFailed

    _, snapshot, _, _ = hf_run_inputs
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises(TrainingFailed) as failure:
        train(
            snapshot,
            tmp_path / "work",
            steps=2,
            every=2,
            model_dir=str(empty),
            model_init="pretrained",
        )
    first_line = str(failure.value).splitlines()[0]
    assert f"ModelError: {empty} has no config.json" in first_line
    assert "not retried" in first_line


@pytest.mark.launches
def test_hf_checkpoint_reshards_from_two_ranks_to_one(
    hf_run_inputs, hf_uninterrupted, hf_full_workdir, tmp_path
):
    """The 2-rank run's last (async) checkpoint, in a copy of its workdir, resumed by one rank."""
    import shutil

    from tests.distributed.conftest import train

    _, snapshot, overrides, named = hf_run_inputs
    saved = hf_uninterrupted
    assert saved["world_size"] == 2 and saved["checkpoint"].endswith("step_6")
    shutil.copytree(hf_full_workdir, tmp_path, dirs_exist_ok=True)
    # Resuming at the target step runs no step: the weights are exactly what was loaded.
    # The 2-rank run's global batch (8 x 2), else the resume is refused: its data would differ.
    fixed = [*overrides, *FAST, "data.global_batch=16"]
    loaded = train(snapshot, tmp_path, nproc=1, steps=6, every=3, overrides=fixed, **named)
    assert loaded["world_size"] == 1 and loaded["steps_run"] == 0
    assert loaded["resumed_from"].endswith("step_6")
    assert loaded["model_sha256"] == saved["model_sha256"]
