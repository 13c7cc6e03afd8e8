"""Run summaries: rtp local's, built from each step's record, and the checkpoint efficiency figure
of the trainer's summary."""

import pytest

from components.layout import record_step, run_dir
from rtp_cli.local_run import LocalOptions, build_summary, format_summary


def test_summary_collects_each_step_record(tmp_path):
    import time

    folder = run_dir(tmp_path, "r1")
    start = time.time()
    record_step(folder, "stage", start, snapshot_dir="/snap")
    record_step(folder, "train", start, steps=12, final_loss=2.5, checkpoint="/ck/step_12", model_sha256="ab")
    record_step(folder, "validate", start, holdout_loss=2.4, decision="champion", step=12)
    record_step(
        folder, "register", start, model_name="m", version="3", alias="champion", model_uri="models:/m/3"
    )
    summary = build_summary(LocalOptions(), folder, "sqlite:///x.db", "s3://b/p/", 9.5)
    assert summary["steps"] == 12 and summary["checkpoint"] == "/ck/step_12"
    assert summary["mlflow"]["version"] == "3" and summary["decision"] == "champion"
    assert set(summary["elapsed_s"]) == {"stage", "train", "validate", "register"}
    text = format_summary(summary, str(tmp_path))
    assert "m version 3" in text and "mlflow ui --backend-store-uri sqlite:///x.db" in text


def test_summary_of_a_lora_run_names_the_adapter_and_how_to_serve_the_model(tmp_path):
    import time

    folder = run_dir(tmp_path, "r3")
    adapter = "file:///w/mlartifacts/1/run/artifacts/adapter"
    record_step(
        folder,
        "register",
        time.time(),
        model_name="rtp-tiny-chat-llama",
        version="1",
        alias="champion",
        model_uri="models:/rtp-tiny-chat-llama/1",
        model_kind="hf",
        adapter_uri=adapter,
    )
    summary = build_summary(LocalOptions(), folder, "sqlite:///w/mlflow.db", "s3://b/", 1.0)
    text = format_summary(summary, str(tmp_path))
    assert f"LoRA adapter     : {adapter}" in text
    assert (
        "MLFLOW_TRACKING_URI=sqlite:///w/mlflow.db mlflow models serve -m models:/rtp-tiny-chat-llama@champion"
        in text
    )


def test_summary_of_a_rejected_run_says_so(tmp_path):
    import time

    folder = run_dir(tmp_path, "r2")
    record_step(folder, "train", time.time(), steps=2, final_loss=5.0, checkpoint="/c", model_sha256="x")
    record_step(folder, "validate", time.time(), holdout_loss=5.0, decision="reject", step=2)
    summary = build_summary(LocalOptions(), folder, "http://mlflow", "s3://b/", 1.0)
    assert summary["mlflow"]["version"] is None
    assert "not registered" in format_summary(summary, str(tmp_path))


def test_efficiency_follows_the_aws_definition():
    from trainer.checkpointing import efficiency_pct

    assert efficiency_pct(0.0, 10.0) == 100.0
    assert efficiency_pct(1.0, 10.0) == pytest.approx(90.0)
    assert efficiency_pct(0.0, 0.0) == 100.0
