"""HSDP on 4 CPU ranks over gloo, warm-started: a 2 x 2 mesh (replicated over 2 groups,
sharded over 2 ranks in each) training from a byte LM folder (what the stage-model step
stages from a registered version) recovers exactly from a hang (leaving every rank's stacks and
collective trace) and from the loss of a rank's node (its fast-tier files gone: its state comes from its twin in the other replica
group), and checkpoints move between HSDP and FSDP in both directions (DCP reshards; the
weights loaded are the weights saved)."""

import json
import shutil
from pathlib import Path

import pytest

from tests.distributed.conftest import (
    PLAIN_OVERRIDES,
    PLAIN_STEPS,
    assert_diagnosable,
    assert_nothing_left,
    events,
    restart_story,
    train,
)

pytestmark = [pytest.mark.launches, pytest.mark.timeout(900)]

STEPS, EVERY = 8, 4
FAST = list(PLAIN_OVERRIDES[:3])
HSDP = "parallelism.dp_replicate=2"


def mesh_of(workdir: Path) -> list[int]:
    [layout] = {tuple(e["mesh"]) for e in events(workdir) if e["kind"] == "parallelism"}
    return list(layout)


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    """A byte LM folder, as a registered version is staged for continual training."""
    import torch

    from trainer.config_sections import ModelConfig
    from trainer.models import byte_lm

    folder = tmp_path_factory.mktemp("parent")
    torch.manual_seed(11)
    architecture = ModelConfig(seq_len=32, d_model=32, n_layers=2, n_heads=4)
    byte_lm.write_files(byte_lm.ByteLM(architecture).state_dict(), architecture, folder)
    return folder


@pytest.fixture(scope="module")
def hsdp_twin(dataset_dir, tmp_path_factory, parent) -> tuple[Path, dict]:
    """The fault-free 4-rank HSDP run from the parent folder; it also times the all-reduce
    check (which changes no weight)."""
    workdir = tmp_path_factory.mktemp("hsdp-twin")
    summary = train(
        dataset_dir,
        workdir,
        nproc=4,
        steps=STEPS,
        every=EVERY,
        overrides=[*FAST, HSDP, "resilience.allreduce_check_mib=2"],
        model_dir=str(parent),
    )
    return workdir, summary


def test_a_warm_started_hsdp_run_recovers_to_its_fault_free_twins_weights(
    dataset_dir, tmp_path, hsdp_twin, parent, run_mark
):
    """A hang on rank 3 before the first durable checkpoint (the watchdog restarts the
    attempt in-process, every rank's stacks and flight recorder dump are left for it; the
    new attempt builds from the parent's folder again, then resumes from the fast tier), an
    exception on rank 0 after the first durable checkpoint (in-process again), then rank 1's
    node lost (its captures removed, the rank SIGKILLed): rank 1 resumes from rank 3's own capture, the same
    shard in the other replica group, with no replica ever sent; the run ends with the
    fault-free weights and every attempt builds the same 2-D mesh."""
    twin_dir, twin = hsdp_twin
    assert mesh_of(twin_dir) == [2, 2]
    summary = train(
        dataset_dir,
        tmp_path,
        nproc=4,
        steps=STEPS,
        every=EVERY,
        overrides=[*FAST, HSDP],
        faults=["hang@2:3", "exception@5:0", "node-loss@7:1"],
        model_dir=str(parent),
    )
    assert [(r["kind"], r["mechanism"], r["fault_step"]) for r in summary["restarts"]] == [
        ("hang", "inprocess", 2),
        ("exception", "inprocess", 5),
        ("node-loss", "launcher", 7),
    ], restart_story(summary, tmp_path)
    assert_diagnosable(summary["restarts"][0], ranks=4, hung_rank=3)  # torch's analyzer reads all four
    assert mesh_of(tmp_path) == [2, 2]
    assert summary["completed"] and summary["model_sha256"] == twin["model_sha256"]
    resume = [e for e in events(tmp_path) if e["kind"] == "resume"][-1]
    assert resume["tier"] == "local" and resume["replicas"] == {"1": 3}, resume
    redone = summary["restarts"][2]["steps_redone"]
    assert redone <= 1, summary["restarts"][2]
    config = json.loads((twin_dir / "config.json").read_text())
    assert config["model"]["model_dir"] == str(parent) and config["model"]["seq_len"] == 32
    assert config["parallelism"] == {"dp_replicate": 2, "dp_shard": 0}
    assert_nothing_left(run_mark)


def _resume_finished(
    checkpoint: Path, dataset_dir, workdir: Path, nproc: int, steps: int, overrides, **named
) -> dict:
    """Load a finished run's last checkpoint in a new run folder and train to the same step:
    no step runs, so the weights are exactly what was loaded."""
    shutil.copytree(checkpoint, workdir / "checkpoints" / checkpoint.name)
    return train(dataset_dir, workdir, nproc=nproc, steps=steps, every=EVERY, overrides=overrides, **named)


def test_an_hsdp_checkpoint_loads_under_fsdp_and_an_fsdp_one_under_hsdp(
    dataset_dir, tmp_path, hsdp_twin, parent, plain_two_rank_run
):
    _, twin = hsdp_twin
    as_fsdp = _resume_finished(
        Path(twin["checkpoint"]), dataset_dir, tmp_path / "fsdp", 4, STEPS, FAST, model_dir=str(parent)
    )
    assert mesh_of(tmp_path / "fsdp") == [4] and as_fsdp["steps_run"] == 0
    assert as_fsdp["model_sha256"] == twin["model_sha256"]
    # The session's 2-rank FSDP run, loaded as 2 replicas of 1 shard (every rank holds it all).
    as_hsdp = _resume_finished(
        Path(plain_two_rank_run["checkpoint"]), dataset_dir, tmp_path / "hsdp", 2, PLAIN_STEPS, [*FAST, HSDP]
    )
    assert mesh_of(tmp_path / "hsdp") == [2, 1] and as_hsdp["steps_run"] == 0
    assert as_hsdp["model_sha256"] == plain_two_rank_run["model_sha256"]


def test_the_ranks_time_an_all_reduce_over_the_world_before_training(hsdp_twin):
    """Once per process start: a launcher restart of the group (which a loaded machine can
    cause) measures again, an in-process restart does not."""
    workdir, _ = hsdp_twin
    run = events(workdir)
    checks = [e for e in run if e["kind"] == "link_check"]
    group_starts = [e for e in run if e["kind"] == "attempt_start" and e["inprocess_iteration"] == 0]
    assert len(checks) == len(group_starts) >= 1, [e["kind"] for e in run]
    for check in checks:
        assert (check["world_size"], check["bytes"], check["floor_gbps"]) == (4, 2 * 2**20, 0.0)
        expected = 2 * 3 / 4 * check["bytes"] / check["seconds"] / 1e9
        assert check["busbw_gbps"] == pytest.approx(expected) and check["busbw_gbps"] > 0
    resumed = next(e for e in run if e["kind"] == "resumed")
    assert 0 < resumed["phases"]["link_check_s"] < resumed["startup_s"]
