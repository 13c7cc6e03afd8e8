"""`rtp bench finetune`: full fine-tuning and LoRA side by side — the table and the JSON, each
round's LoRA figures paired with that round's full ones, and a recovery that ends with other
weights failing the bench. The fast tests put a stand-in in place of the launcher (no process
starts); the smoke run at the end launches for real. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.benchmarks import run_bench
from tests.hf_tiny import write_tiny_model
from tests.unit.test_examples_data import CHATML, CONVERSATIONS

pytestmark = pytest.mark.timeout(180)

STEP_S = {
    ("full", 0): 0.1,
    ("full", 1): 0.2,
    ("full", 2): 0.4,
    ("lora", 0): 0.3,
    ("lora", 1): 0.1,
    ("lora", 2): 0.2,
}
"""The stand-in's step time by (method, round): LoRA over full is 3.0, 0.5, 0.5 round by round
(median 0.5), while the medians' ratio is 0.2 / 0.2 = 1.0."""
CHECKPOINT_BYTES = {"full": 4000, "lora": 1000}


@pytest.fixture(scope="module")
def user_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny tied Llama with a ChatML template and a few conversations: `--model-dir --chat-data`."""
    root = tmp_path_factory.mktemp("bench-finetune")
    model_dir = write_tiny_model(root / "model", "llama", tie=True)
    (model_dir / "chat_template.jinja").write_text(CHATML)
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return model_dir, chat


class StandInLauncher:
    """Stands in for `trainer.launch.run_local_training`: starts no process, writes what a run
    leaves that the bench reads (step events, a committed step folder) and returns the
    summary's fields. A run with faults recovers once; for a method in `inexact` it ends with
    other weights than its fault-free run's."""

    def __init__(self, inexact: tuple[str, ...] = ()):
        self.inexact = inexact
        self.runs: list[SimpleNamespace] = []

    def __call__(self, nproc, config, echo=True, settings=None):
        method, work = config.training.method, Path(config.run.workdir)
        round_ = int(work.parent.name.rsplit("-", 1)[1])
        self.runs.append(
            SimpleNamespace(method=method, round=round_, run=work.name, config=config, nproc=nproc)
        )
        steps = config.run.steps
        work.mkdir(parents=True)
        with (work / "events.jsonl").open("w") as events:
            for step in range(1, steps + 1):
                warmup = step <= 2  # slow first steps: --warmup-steps 2 leaves them out
                seconds = 9.0 if warmup else STEP_S[method, round_]
                events.write(
                    json.dumps({"kind": "step", "step": step, "duration_s": seconds, "time": step}) + "\n"
                )
        folder = work / "checkpoints" / f"step_{steps}"
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "shard.distcp").write_bytes(b"x" * (CHECKPOINT_BYTES[method] - 10))
        (folder / ".committed").write_bytes(b"x" * 10)
        faulty = bool(config.run.faults)
        weights = f"{method}-weights" + ("-other" if faulty and method in self.inexact else "")
        restart = {"downtime_s": 2.0, "shutdown_s": 0.5, "startup_s": 1.5, "mechanism": "inprocess"}
        return SimpleNamespace(
            checkpoint_saves=[{"blocked_s": 0.01}, {"blocked_s": 0.03 if method == "full" else 0.02}],
            local_tier_captures=steps,
            local_tier_s=0.001 * steps,
            peak_mem_bytes=2**30 if method == "full" else 2**29,
            checkpoint=str(folder),
            model_sha256=weights,
            restarts=[restart] if faulty else [],
            lost_steps=0,
            final_loss=1.0,
            device="cpu",
        )


def bench(monkeypatch, tmp_path, inputs, launcher, *args: str) -> int:
    """`rtp bench finetune --model-dir --chat-data ARGS --json` in this process, with `launcher`."""
    from benchmarks import finetune
    from rtp_cli.main import main

    monkeypatch.setattr(finetune, "run_local_training", launcher)
    model_dir, chat = inputs
    common = ["--model-dir", str(model_dir), "--chat-data", str(chat), "--steps", "4", "--every", "2"]
    return main(["bench", "finetune", *common, "--fault-step", "3", "--warmup-steps", "2", *args,
                 "--json", str(tmp_path / "bench.json")])  # fmt: skip


def test_bench_finetune_reports_both_methods_side_by_side(monkeypatch, tmp_path, user_inputs, capsys):
    assert bench(monkeypatch, tmp_path, user_inputs, StandInLauncher(), "--rounds", "1") == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    figures = {"step_s_median", "peak_mem_bytes", "checkpoint_bytes", "blocked_s_per_save_median",
               "fault_to_resumed_s", "exact", "model_sha256"}  # fmt: skip
    for method in ("full", "lora"):
        assert figures <= set(data["methods"][method]), method
        assert data["methods"][method]["exact"] is True
    full, lora = data["methods"]["full"], data["methods"]["lora"]
    assert (full["step_s_median"], lora["step_s_median"]) == (0.1, 0.3)  # the warm-up steps left out
    assert (full["checkpoint_bytes"], lora["checkpoint_bytes"]) == (4000, 1000)  # the step folder's files
    assert full["blocked_s_per_save_median"] == pytest.approx(0.02)
    assert full["fault_to_resumed_s"] == 2.0
    assert data["lora_vs_full"]["checkpoint_bytes"] == 0.25
    assert data["lora_vs_full"]["peak_mem_bytes"] == 0.5
    # LoRA trains a fraction of the model's parameters; full trains them all.
    params = data["methods_params"]
    assert params["full"]["trained_params"] == params["full"]["params"] > params["lora"]["trained_params"] > 0
    assert data["data"]["conversations"] == len(CONVERSATIONS)
    table = capsys.readouterr().out.split("\n}\n", 1)[1]
    assert "lora/full" in table.splitlines()[1]
    assert "checkpoint on disk" in table
    assert any(
        line.startswith("step time (median)") and line.endswith("3.00x") for line in table.splitlines()
    )
    assert any(
        line.startswith("exact after recovery") and line.split()[-2:] == ["yes", "yes"]
        for line in table.splitlines()
    )


def test_bench_finetune_pairs_each_rounds_lora_run_with_that_rounds_full_run(
    monkeypatch, tmp_path, user_inputs, capsys
):
    launcher = StandInLauncher()
    assert bench(monkeypatch, tmp_path, user_inputs, launcher, "--rounds", "3") == 0
    # Each round starts with the other method; each method's exception run follows its fault-free run.
    assert [(r.round, r.method, r.run) for r in launcher.runs][:8] == [
        (0, "full", "fault-free"), (0, "full", "exception"), (0, "lora", "fault-free"), (0, "lora", "exception"),
        (1, "lora", "fault-free"), (1, "lora", "exception"), (1, "full", "fault-free"), (1, "full", "exception"),
    ]  # fmt: skip
    model_dir, _ = user_inputs
    for run in launcher.runs:  # the same model, data and ranks; only the method and the fault differ
        assert run.nproc == 2 and run.config.data.format == "examples"
        assert run.config.model.model_dir == str(model_dir)
        assert run.config.run.faults == ("exception@3:1" if run.run == "exception" else "")
    assert len({run.config.data.dataset_dir for run in launcher.runs}) == 1
    data = json.loads((tmp_path / "bench.json").read_text())
    # The median of each round's ratio (3.0, 0.5, 0.5), not the ratio of the medians (1.0).
    assert data["lora_vs_full_rounds"]["step_s_median"] == pytest.approx([3.0, 0.5, 0.5])
    assert data["lora_vs_full"]["step_s_median"] == pytest.approx(0.5)
    assert data["methods"]["full"]["step_s_rounds"] == [0.1, 0.2, 0.4]
    assert "medians of 3 rounds" in capsys.readouterr().out


def test_bench_finetune_fails_when_a_recovered_run_ends_with_other_weights(
    monkeypatch, tmp_path, user_inputs, capsys
):
    assert bench(monkeypatch, tmp_path, user_inputs, StandInLauncher(inexact=("lora",)), "--rounds", "1") == 1
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["methods"]["lora"]["exact"] is False and data["methods"]["full"]["exact"] is True
    printed = capsys.readouterr()
    assert "FAILED: lora" in printed.err
    assert any(
        line.startswith("exact after recovery") and line.split()[-2:] == ["yes", "NO"]
        for line in printed.out.splitlines()
    )


@pytest.mark.bench
@pytest.mark.launches
@pytest.mark.timeout(900)
def test_bench_finetune_smoke_trains_both_methods_through_the_launcher(tmp_path):
    data, printed = run_bench(
        "finetune", tmp_path / "bench.json", "--steps", "4", "--every", "2", "--fault-step", "3",
        "--warmup-steps", "1", "--rounds", "1",
    )  # fmt: skip
    for method in ("full", "lora"):
        row = data["methods"][method]
        assert row["exact"] is True and row["mechanisms_seen"] == ["inprocess"], method
        assert row["saves"] == 2 and row["checkpoint_bytes"] > 0, method
    assert data["lora_vs_full"]["checkpoint_bytes"] < 1  # the adapters and their moments only
    assert "lora/full" in printed
