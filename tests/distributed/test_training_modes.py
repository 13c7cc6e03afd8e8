"""The `training` section in real 2-rank runs (gloo, CPU): activation
checkpointing keeps stop-and-resume bit-exact, and under bf16 compute the checkpoint still
holds fp32 weights and AdamW state.

Both compare against the session's plain 2-rank run (tests/distributed/conftest.py:
`plain_two_rank_run`, also test_live_metrics' reference), so they use its steps and
checkpoint interval."""

import json

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.distributed.conftest import PLAIN_EVERY, PLAIN_OVERRIDES, PLAIN_STEPS, events, train
from trainer.checkpointing import latest_committed_checkpoint

pytestmark = [pytest.mark.launches, pytest.mark.timeout(600)]

STEPS, EVERY = PLAIN_STEPS, PLAIN_EVERY
CHECKPOINTED = ("training.activation_checkpointing=every_n", "training.activation_checkpointing_every=1")


def test_activation_checkpointing_resumes_exactly(dataset_dir, tmp_path, plain_two_rank_run):
    """The resumed half also runs the validation pass every 2 steps, which changes no weight."""

    def run(folder: str, overrides=(), **named) -> dict:
        return train(
            dataset_dir,
            tmp_path / folder,
            steps=STEPS,
            every=EVERY,
            overrides=(*CHECKPOINTED, *overrides),
            checkpoint_mode="sync",
            **named,
        )

    first = run("split", stop_after=6)
    plain = plain_two_rank_run
    assert plain["steps"] == STEPS and plain["world_size"] == 2
    assert first["steps"] == 6 and first["model_sha256"] != plain["model_sha256"]
    resumed = run("split", overrides=["data.eval_every_steps=2", "data.eval_windows=8"])
    assert resumed["resumed_from"].endswith("step_6") and resumed["steps_run"] == STEPS - 6
    # Recomputing activations changes no number, so the resumed run ends with the weights and
    # loss of the plain run (whose restart timeouts and metrics interval change no weight either).
    assert resumed["model_sha256"] == plain["model_sha256"]
    assert resumed["final_loss"] == plain["final_loss"]
    scored = [e for e in events(tmp_path / "split") if e["kind"] == "eval"]
    assert [e["step"] for e in scored] == list(range(8, STEPS + 1, 2)), scored
    assert all(0 < e["loss"] < 10 and e["tokens"] > 0 for e in scored)
    # The last pass scores the final weights on the windows the end-of-run record scores.
    final = json.loads((tmp_path / "split" / "eval.json").read_text())
    assert final["step"] == scored[-1]["step"] and final["loss"] == pytest.approx(
        scored[-1]["loss"], rel=1e-9
    )


def test_bf16_compute_keeps_fp32_weights_and_optimizer_state_in_checkpoints(
    dataset_dir, tmp_path, plain_two_rank_run
):
    bf16 = train(
        dataset_dir,
        tmp_path / "bf16",
        steps=STEPS,
        every=EVERY,
        overrides=(*PLAIN_OVERRIDES, "training.mixed_precision=bf16"),
        checkpoint_mode="sync",
    )
    fp32 = plain_two_rank_run  # the same run in fp32 compute
    assert bf16["completed"] and bf16["final_loss"] < bf16["losses"][0]["loss"]
    assert bf16["model_sha256"] != fp32["model_sha256"]  # the compute really ran in bf16
    checkpoint = latest_committed_checkpoint(tmp_path / "bf16" / "checkpoints")
    assert checkpoint is not None and checkpoint.name == f"step_{STEPS}"
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    dtypes = {
        key: item.properties.dtype
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata) and item.size.numel() > 1
    }
    assert any(key.startswith("model.") for key in dtypes) and any(key.startswith("optim.") for key in dtypes)
    assert {str(dtype) for dtype in dtypes.values()} == {"torch.float32"}, dtypes
