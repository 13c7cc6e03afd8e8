"""Pure rules of the validate and register steps: shapes, optimizer state, the decision,
lineage tags, trainer figures, and which MLflow failures are retried."""

import json

import pytest
import requests
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

from components.mlflow_access import RegistryUnavailable, RetryPolicy, call_with_retries, is_transient
from components.register_model.lineage import Lineage, lineage_tags, training_figures
from components.validate_checkpoint.checks import decide, optimizer_problems, parameter_names, shape_problems
from components.validate_checkpoint.validate import expected_shapes
from trainer.config import ModelConfig

EXPECTED = {"tok_emb.weight": (256, 64), "ln.bias": (64,)}


def test_matching_shapes_have_no_problems():
    stored = {"model.tok_emb.weight": (256, 64), "model.ln.bias": (64,), "optim.state.x.step": ()}
    assert shape_problems(stored, EXPECTED) == []


def test_shape_problems_name_the_tensor_and_both_shapes():
    stored = {"model.tok_emb.weight": (256, 32), "model.extra.weight": (3,)}
    problems = shape_problems(stored, EXPECTED)
    assert "tensor 'tok_emb.weight' has shape [256, 32], the model config gives [256, 64]" in problems
    assert "tensor 'ln.bias' is missing from the checkpoint" in problems
    assert "tensor 'extra.weight' in the checkpoint is not part of the configured model" in problems


def test_expected_shapes_follow_the_config():
    shapes = expected_shapes(ModelConfig(d_model=32, n_heads=4, n_layers=1, seq_len=16))
    assert shapes["tok_emb.weight"] == (256, 32)
    assert shapes["pos_emb.weight"] == (16, 32)
    assert not any(name.startswith("blocks.1.") for name in shapes)


def test_optimizer_state_must_cover_every_parameter():
    keys = ["optim.state.tok_emb.weight.exp_avg", "optim.state.tok_emb.weight.step"]
    assert optimizer_problems(keys, [("tok_emb.weight",)]) == []
    problems = optimizer_problems(keys, [("tok_emb.weight",), ("ln.bias",)])
    assert problems == ["no optimizer state for 1 parameter(s): 'ln.bias'"]
    # a parameter whose name is a prefix of another's is not covered by the other's state
    assert optimizer_problems(["optim.state.ln.bias2.step"], [("ln.bias",)])


def test_a_tied_head_is_one_parameter_whose_state_is_under_either_name(tmp_path):
    """A tied head shares the embedding's weight: torch keeps one optimizer state for both names."""
    from transformers import AutoModelForCausalLM

    from rtp_support.tiny_models import tiny_config

    with torch.device("meta"):
        tied = AutoModelForCausalLM.from_config(tiny_config("llama", 64, tie=True))
        untied = AutoModelForCausalLM.from_config(tiny_config("llama", 64, tie=False))
    groups = parameter_names(tied.named_parameters(remove_duplicate=False))
    assert ("model.embed_tokens.weight", "lm_head.weight") in groups
    assert ("lm_head.weight",) in parameter_names(untied.named_parameters(remove_duplicate=False))
    stored = [f"optim.state.{names[0]}.exp_avg" for names in groups]
    assert optimizer_problems(stored, groups) == []
    head_only = [k.replace("model.embed_tokens.weight", "lm_head.weight") for k in stored]
    assert optimizer_problems(head_only, groups) == []
    # untied, the head is its own parameter and needs its own state
    untied_groups = parameter_names(untied.named_parameters(remove_duplicate=False))
    assert optimizer_problems(stored, untied_groups) == [
        "no optimizer state for 1 parameter(s): 'lm_head.weight'"
    ]


@pytest.mark.parametrize(
    ("loss", "champion_loss", "min_improvement", "expected"),
    [
        (2.0, None, 0.0, "champion"),
        (2.0, 2.5, 0.0, "champion"),
        (2.0, 2.5, 0.5, "champion"),
        (2.0, 2.5, 0.6, "challenger"),
        (2.0, 2.0, 0.0, "challenger"),  # equal is not better
        (2.6, 2.5, 0.0, "challenger"),
        (3.1, None, 0.0, "reject"),
        (3.1, 9.0, 0.0, "reject"),
        (float("nan"), None, 0.0, "reject"),
    ],
)
def test_decision(loss, champion_loss, min_improvement, expected):
    verdict = decide(loss, 3.0, champion_loss, min_improvement, "champion m v1")
    assert verdict.decision == expected
    if champion_loss is not None and expected != "reject":
        assert any("champion m v1 scores" in reason for reason in verdict.reasons)


def test_lineage_tags_drop_unknown_values_and_prefix_figures():
    tags = lineage_tags(
        Lineage(
            kfp_run_id="run-1",
            checkpoint_step=20,
            training_figures={"goodput_pct": 97.123456789, "restarts": 2},
        )
    )
    assert tags == {
        "rtp.kfp_run_id": "run-1",
        "rtp.checkpoint_step": "20",
        "rtp.train.goodput_pct": "97.1235",
        "rtp.train.restarts": "2",
    }


def test_training_figures_tolerate_absent_fields_and_files(tmp_path):
    assert training_figures(tmp_path / "missing.json") == {}
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"efficiency_pct": 99.5, "steps": 40, "restarts": [{"at": 3}, {"at": 9}]}))
    assert training_figures(summary) == {"efficiency_pct": 99.5, "restarts": 2}


def _refused() -> MlflowException:
    return MlflowException("API request to http://127.0.0.1:1/api failed with exception Max retries exceeded")


def test_server_failures_are_transient_and_request_errors_are_not():
    assert is_transient(_refused())  # what MLflow raises for a refused connection
    assert is_transient(MlflowException("overloaded", error_code=TEMPORARILY_UNAVAILABLE))
    assert is_transient(requests.exceptions.ConnectionError("refused"))
    assert not is_transient(MlflowException("no such model", error_code=RESOURCE_DOES_NOT_EXIST))
    assert not is_transient(ValueError("bad"))
    assert MlflowException("x", error_code=INTERNAL_ERROR).error_code == "INTERNAL_ERROR"


def test_retries_back_off_then_succeed():
    calls, sleeps = [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise _refused()
        return "ok"

    policy = RetryPolicy(attempts=5, first_delay_s=1.0, max_delay_s=3.0)
    assert call_with_retries("do it", flaky, policy, sleep=sleeps.append) == "ok"
    assert sleeps == [1.0, 2.0]
    assert policy.delays_s() == [1.0, 2.0, 3.0, 3.0]


def test_retries_run_out_with_a_clear_error():
    sleeps = []

    def down() -> None:
        raise _refused()

    with pytest.raises(RegistryUnavailable, match=r"failed to do it after 3 attempts.*MLFLOW_TRACKING_URI"):
        call_with_retries("do it", down, RetryPolicy(attempts=3, first_delay_s=0.5), sleep=sleeps.append)
    assert sleeps == [0.5, 1.0]


def test_request_errors_are_not_retried():
    calls = []

    def missing() -> None:
        calls.append(1)
        raise MlflowException("no such model", error_code=RESOURCE_DOES_NOT_EXIST)

    with pytest.raises(MlflowException, match="no such model"):
        call_with_retries("look", missing, RetryPolicy(attempts=4), sleep=lambda _: None)
    assert len(calls) == 1


def test_an_eval_record_belongs_only_to_the_checkpoint_it_scored():
    from components.validate_checkpoint.checks import eval_record_problems

    holdout = {"files": 2, "files_sha256": "a" * 64, "windows": 64, "windows_sha256": "b" * 64, "seq_len": 64}
    record = {
        "model_sha256": "c" * 64,
        "step": 20,
        "model_kind": "byte-lm",
        "holdout": {**holdout, "tokens": 1000},
        "nats_total": 10.0,
        "tokens": 100,
        "bytes": 100,
    }
    assert eval_record_problems(record, "c" * 64, 20, "byte-lm", holdout) == []
    assert eval_record_problems(record, "d" * 64, 20, "byte-lm", holdout) == [
        f"it scored weights with SHA-256 {'c' * 16}…, the checkpoint holds {'d' * 16}…"
    ]
    assert eval_record_problems(record, "c" * 64, 10, "byte-lm", holdout) == [
        "it scored step 20, the checkpoint is step 10"
    ]
    assert eval_record_problems(record, "c" * 64, 20, "hf", holdout) == [
        "it scored a byte-lm model, the checkpoint holds a hf"
    ]
    other = {**holdout, "seq_len": 128, "windows_sha256": "e" * 64}
    assert eval_record_problems(record, "c" * 64, 20, "byte-lm", other) == [
        "its holdout differs in seq_len, windows_sha256"
    ]
    assert eval_record_problems({**record, "tokens": None}, "c" * 64, 20, "byte-lm", holdout) == [
        "it has no number 'tokens'"
    ]
