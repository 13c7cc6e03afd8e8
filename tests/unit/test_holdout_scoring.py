"""Bits per byte and re-tokenizing holdout windows (components/validate_checkpoint/scoring.py),
with the byte tokenizer and a tiny BPE tokenizer trained here; no model files, no server."""

from __future__ import annotations

import json
import math

import pytest
import torch

from components.register_model.lineage import Lineage, lineage_tags, validation_figures
from components.validate_checkpoint.scoring import (
    HoldoutScore,
    champion_windows,
    decoded_bytes,
    retokenized_windows,
    score_windows,
)
from trainer.models.byte_lm import ByteTokenizer


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from tests.hf_tiny import train_tokenizer
    from trainer.models.hf_causal_lm import HFTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(folder)
    return HFTokenizer(folder)


def test_bytes_are_counted_one_per_byte_token_and_decoded_for_bpe(bpe):
    assert decoded_bytes(ByteTokenizer(), [0xC3, 0xA9, 10]) == 3  # even a split UTF-8 sequence
    ids = bpe.encode("def add(a, b): héllo")
    assert len(ids) < len("def add(a, b): héllo".encode())
    assert decoded_bytes(bpe, ids) == len("def add(a, b): héllo".encode())
    assert decoded_bytes(bpe, [*ids, bpe.eos_id]) == decoded_bytes(bpe, ids)  # EOS is no text


def test_score_sums_nats_over_predicted_tokens():
    class Constant(torch.nn.Module):  # every next byte equally likely: ln 256 nats = 8 bits per byte
        def forward(self, tokens):
            return torch.zeros(*tokens.shape, 256)

    def loss(model, batch):
        logits = model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))

    batches = [torch.randint(0, 256, (3, 9)), torch.randint(0, 256, (1, 9))]
    score = score_windows(Constant(), loss, batches, ByteTokenizer())
    assert (score.tokens, score.bytes) == (32, 32)
    assert score.bits_per_byte == pytest.approx(8.0)
    assert score.nats_per_token == pytest.approx(math.log(256))
    assert HoldoutScore(nats_total=2 * math.log(2), tokens=1, bytes=2).bits_per_byte == pytest.approx(1.0)


def test_windows_keep_their_text_under_another_tokenizer(bpe):
    text = "for step in range(steps):\n"
    source = torch.tensor([[*bpe.encode(text), bpe.eos_id, *bpe.encode("The quick")]])
    as_bytes = retokenized_windows([source], bpe, ByteTokenizer(), seq_len=8)
    joined = [int(t) for t in as_bytes[0][0]] + [int(t) for w in as_bytes[1:] for t in w[0][1:]]
    assert bytes(joined).decode() == text + "\n" + "The quick"  # EOS becomes the byte LM's newline
    assert all(w.shape[1] <= 9 for w in as_bytes)
    back = retokenized_windows([torch.tensor([list(text.encode())])], ByteTokenizer(), bpe, seq_len=64)
    assert [int(t) for t in back[0][0]] == bpe.encode(text)


def test_validation_figures_come_from_the_validate_record_at_full_precision(tmp_path):
    assert validation_figures(tmp_path / "missing.json") == {}
    record = tmp_path / "validate.json"
    record.write_text(
        json.dumps({"holdout_loss": 1.2345678901, "holdout_bits_per_byte": 0.5, "decision": "x"})
    )
    figures = validation_figures(record)
    assert figures == {"holdout_nats_per_token": 1.2345678901, "holdout_bits_per_byte": 0.5}
    tags = lineage_tags(Lineage(validation_figures=figures))
    assert float(tags["rtp.validate.holdout_nats_per_token"]) == 1.2345678901


def test_the_end_of_training_record_is_the_score_of_those_windows_bound_to_the_weights(dataset_dir, tmp_path):
    from trainer.config import build_config
    from trainer.data import holdout_batches, load_tokens, split_files
    from trainer.evaluation import holdout_identity, read_eval_record, write_eval_record
    from trainer.models import model_spec

    config = build_config("tiny-cpu", [f"data.dataset_dir={dataset_dir}", f"run.workdir={tmp_path}"])
    config.data.eval_windows = 5
    spec = model_spec(config.model.kind)
    torch.manual_seed(0)
    model = spec.build(config.model, torch.device("cpu"))
    model.train()
    assert write_eval_record(model, config, "ab" * 32, 7, rank=1, device=torch.device("cpu")) is None
    assert not (tmp_path / "eval.json").exists()  # only rank 0 writes
    path = write_eval_record(model, config, "ab" * 32, 7, rank=0, device=torch.device("cpu"))
    assert model.training  # training mode restored
    record = read_eval_record(path)
    _, holdout = split_files(dataset_dir, config.data.holdout_fraction)
    batches = holdout_batches(load_tokens(holdout), config.model.seq_len, max_windows=5)
    expected = score_windows(
        model, spec.loss, batches, ByteTokenizer(), rows_per_forward=config.data.batch_size
    )
    assert (record["model_sha256"], record["step"], record["model_kind"]) == ("ab" * 32, 7, "byte-lm")
    assert record["holdout"]["windows"] == 5
    assert {k: record["holdout"][k] for k in holdout_identity(holdout, batches, config.model.seq_len)} == (
        holdout_identity(holdout, batches, config.model.seq_len)
    )
    assert (record["nats_total"], record["tokens"], record["bytes"]) == (
        expected.nats_total,
        expected.tokens,
        expected.bytes,
    )
    assert record["bits_per_byte"] == expected.bits_per_byte
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"]  # no staging file left behind


def test_the_holdout_identity_changes_with_the_windows_and_files(dataset_dir):
    from trainer.data import holdout_batches, load_tokens, split_files
    from trainer.evaluation import holdout_identity

    _, holdout = split_files(dataset_dir, 0.1)
    tokens = load_tokens(holdout)
    base = holdout_identity(holdout, holdout_batches(tokens, 32, max_windows=8), 32)
    assert base == holdout_identity(holdout, holdout_batches(tokens, 32, max_windows=8), 32)
    fewer = holdout_identity(holdout, holdout_batches(tokens, 32, max_windows=7), 32)
    assert fewer["windows_sha256"] != base["windows_sha256"] and fewer["windows"] == 7
    longer = holdout_identity(holdout, holdout_batches(tokens, 48, max_windows=8), 48)
    assert longer["windows_sha256"] != base["windows_sha256"]
    assert holdout_identity(holdout[:-1] or holdout[:0], [], 32)["files_sha256"] != base["files_sha256"]


def test_an_unreadable_or_foreign_record_is_no_record(tmp_path):
    from trainer.evaluation import read_eval_record

    assert read_eval_record(tmp_path / "absent.json") is None
    (tmp_path / "torn.json").write_text('{"version": 1, "model_sha')
    assert read_eval_record(tmp_path / "torn.json") is None
    (tmp_path / "other.json").write_text(json.dumps({"version": 99}))
    assert read_eval_record(tmp_path / "other.json") is None


def test_a_negative_number_of_eval_windows_is_refused_in_one_line():
    from trainer.config import ConfigError, resolve_config

    with pytest.raises(ConfigError, match=r"data\.eval_windows must be >= 0"):
        resolve_config(named={"dataset_dir": "/nonexistent"}, overrides=["data.eval_windows=-1"])


def test_the_champion_scores_the_candidates_windows_retokenized_only_when_its_tokens_differ(bpe):
    byte = ByteTokenizer()
    batches = [torch.tensor([list(b"def add(a, b):\n    return a + b\n")])]
    same = champion_windows(batches, byte, byte, byte.identity, 64, 64)
    assert same is batches  # the same tokens: no re-encoding
    other = champion_windows(batches, byte, bpe, bpe.identity, 8, 64)
    assert [w.tolist() for w in other] == [w.tolist() for w in retokenized_windows(batches, byte, bpe, 8)]
    assert sum(decoded_bytes(bpe, w[0, 1:].tolist()) for w in other) < len(
        batches[0][0]
    )  # first tokens not predicted
    # the same tokenizer with another window length is re-windowed too
    assert next(w.shape[1] for w in champion_windows(batches, byte, byte, byte.identity, 8, 64)) == 9


def test_without_mlflow_the_training_scores_no_champion_and_says_why(tmp_path, monkeypatch):
    from trainer.evaluation import fetch_champion

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert fetch_champion("m", tmp_path) == "MLflow is not configured (MLFLOW_TRACKING_URI is empty)"
    assert not (tmp_path / "champion").exists()
