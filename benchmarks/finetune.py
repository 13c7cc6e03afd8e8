"""`rtp bench finetune`: full fine-tuning against LoRA on the same model and conversations, side by side.

Both methods (`training.method=full` and `training.method=lora`, trainer/lora.py) train the
same Hugging Face model on the same example shards (`data.format=examples`) for the same
steps, with the same checkpoint interval, through the real launcher (N ranks over gloo on
CPU, NCCL on GPU). By default the model is the `rtp local --sft` demo's tiny tied Llama with
a ChatML template and the 400 conversations it makes from the standard library's docstrings
(rtp_support/demo_chat.py); `--model-dir DIR` and `--chat-data PATH` (a JSONL file or a
folder of them) put a user's model and conversations in their place.

Each method trains twice per round: fault-free, then with an exception on rank 1 (rank 0
with one rank) at `--fault-step` (`run.faults=exception@N:1`: an NVRx in-process restart).
Reported per method, from the runs' own records:

- `step_s_median`: the fault-free run's median step time (its `step` events' duration)
  after the first `--warmup-steps` steps;
- `peak_mem_bytes`: peak memory per rank, the summary's (rank 0's; FSDP2 gives every rank an
  equal shard, up to padding) — CUDA: allocated; CPU: resident set, the interpreter and libraries included;
- `checkpoint_bytes`: the last committed step folder's bytes on disk; `blocked_s_per_save_median`
  (and `_max`): what the loop waited per save, as `rtp bench checkpoint` reports it;
  `local_tier_ms_per_copy`: one copy of the fast checkpoint tier (a cost per step, not per save);
- `fault_to_resumed_s`: the exception run's fault to its first step after the restart, as
  `rtp bench recovery` measures it (trainer/goodput.py's `downtime_s`), with `steps_redone`;
- `exact`: the exception run ends with the fault-free run's `model_sha256` (for LoRA: the
  adapters'). Where bit-identical weights are guaranteed (CPU; CUDA with
  `training.deterministic`) a recovered run that differs fails the bench (exit status 1, the
  table still printed); on CUDA without it, `exact` is null.

`lora_vs_full` is LoRA's figure over full's. With `--rounds N` the methods run N times in turn,
each round starting with the other method; every figure is the median over the rounds, and
each ratio the median of each round's ratio (`lora_vs_full_rounds`), so a slow minute on a
shared machine moves one pair, not the comparison.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import rtp_prefork
from benchmarks import report
from benchmarks.recovery import bitwise_expected
from trainer.config import TrainConfig, build_config
from trainer.launch import LauncherSettings, run_local_training

METHODS = ("full", "lora")
RATIO_FIGURES = (
    "step_s_median",
    "peak_mem_bytes",
    "checkpoint_bytes",
    "blocked_s_per_save_median",
    "fault_to_resumed_s",
)
"""The figures `lora_vs_full` sets side by side."""
DEFAULT_SETTINGS = ("model.seq_len=127", "data.batch_size=2", "data.global_batch=8")
"""8 conversations a step, packed into rows of 128 tokens (the demo model's context)."""


def prepare_inputs(root: Path, model_dir: str = "", chat_data: str = "") -> tuple[Path, Path, dict[str, Any]]:
    """The model folder and a dataset snapshot of example shards for it (the demo's where a
    path is not given); returns (model folder, snapshot, the shards' index)."""
    from rtp_support.demo_chat import write_demo_chat, write_demo_chat_model
    from rtp_support.demo_data import write_local_manifest
    from trainer.chat_data import write_example_shards

    model = Path(model_dir) if model_dir else write_demo_chat_model(root / "model")
    conversations = Path(chat_data) if chat_data else write_demo_chat(root / "conversations.jsonl")
    snapshot = root / "snapshot"
    index = write_example_shards(conversations, snapshot / "files", model)
    write_local_manifest(snapshot, key_prefix="chat/", snapshot_id="bench-finetune")
    return model, snapshot, index


def method_config(
    method: str,
    model_dir: Path,
    snapshot: Path,
    workdir: Path,
    *,
    steps: int,
    every: int,
    faults: Sequence[str] = (),
    overrides: Sequence[str] = (),
) -> TrainConfig:
    """The one config both methods train, but for `training.method` (and the faults)."""
    return build_config(
        "tiny-cpu",
        [
            f"model.model_dir={model_dir}",
            "model.init=pretrained",
            f"data.dataset_dir={snapshot}",
            "data.format=examples",
            f"training.method={method}",
            f"run.workdir={workdir}",
            # The fast tier's files beside the run, not in the machine's shared /dev/shm.
            f"checkpoint.local_dir={workdir / 'local-tier'}",
            f"run.steps={steps}",
            f"checkpoint.every_steps={every}",
            "checkpoint.keep_last=2",
            "run.seed=1",
            f"run.faults={','.join(faults)}",
            "run.log_every_steps=1000",
            *DEFAULT_SETTINGS,
            *overrides,
        ],
    )


def folder_bytes(folder: str | Path) -> int:
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())


def step_durations(workdir: Path) -> dict[int, float]:
    """Each step's own time (its `step` event's `duration_s`), by step."""
    lines = (workdir / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines if line]
    return {event["step"]: event["duration_s"] for event in events if event.get("kind") == "step"}


def run_method(
    method: str,
    model_dir: Path,
    snapshot: Path,
    workdir: Path,
    *,
    nproc: int,
    steps: int,
    every: int,
    fault_step: int,
    warmup_steps: int,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """One method's fault-free run and its run with an exception; their figures."""

    def config(run: str, faults: Sequence[str] = ()) -> TrainConfig:
        return method_config(
            method,
            model_dir,
            snapshot,
            workdir / run,
            steps=steps,
            every=every,
            faults=faults,
            overrides=overrides,
        )

    clean = config("fault-free")
    summary = run_local_training(nproc, clean, echo=False)
    durations = step_durations(workdir / "fault-free")
    timed = [seconds for step, seconds in durations.items() if step > warmup_steps]
    if not timed:
        raise ValueError(f"--warmup-steps {warmup_steps} leaves no step to time in a run of {steps} steps")
    saves = summary.checkpoint_saves
    blocked = [save["blocked_s"] for save in saves]
    copies = summary.local_tier_captures
    fault = f"exception@{fault_step}:{min(1, nproc - 1)}"
    faulty = config("exception", [fault])
    recovered = run_local_training(
        nproc,
        faulty,
        echo=False,
        settings=rtp_prefork.launcher_settings(faulty, LauncherSettings(max_restarts=3)),
    )
    restarts = [r for r in recovered.restarts if r["downtime_s"] is not None]
    if not restarts:
        raise RuntimeError(
            f"{method}: the exception at step {fault_step} was not recovered from (no restart "
            f"record); see {workdir / 'exception' / 'logs' / 'train.log'}"
        )
    guaranteed = bitwise_expected(summary.device, clean.training.deterministic)
    return {
        "step_s_median": statistics.median(timed),
        "peak_mem_bytes": summary.peak_mem_bytes,
        "checkpoint_bytes": folder_bytes(summary.checkpoint) if summary.checkpoint else 0,
        "blocked_s_per_save_median": statistics.median(blocked) if blocked else 0.0,
        "blocked_s_per_save_max": max(blocked) if blocked else 0.0,
        "saves": len(saves),
        "blocked_s_per_save": blocked,
        "local_tier_ms_per_copy": 1000 * summary.local_tier_s / copies if copies else 0.0,
        "fault_to_resumed_s": statistics.median(r["downtime_s"] for r in restarts),
        "shutdown_s": statistics.median(r["shutdown_s"] for r in restarts),
        "startup_s": statistics.median(r["startup_s"] for r in restarts),
        "mechanisms_seen": sorted({r["mechanism"] for r in recovered.restarts}),
        "steps_redone": recovered.lost_steps,
        "final_loss": summary.final_loss,
        "model_sha256": summary.model_sha256,
        "recovered_model_sha256": recovered.model_sha256,
        "exact": recovered.model_sha256 == summary.model_sha256 if guaranteed else None,
        "device": summary.device,
    }


def trained_parameters(config: TrainConfig) -> dict[str, int]:
    """The model's parameters and, under the config's method, those that train (counted on
    the meta device: nothing is allocated)."""
    import torch

    from trainer.lora import build_model

    model = build_model(config, torch.device("meta"))
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def run_benchmark(
    *,
    nproc: int,
    steps: int,
    every: int,
    fault_step: int,
    warmup_steps: int,
    rounds: int = 1,
    model_dir: str = "",
    chat_data: str = "",
    overrides: Sequence[str] = (),
    workdir: Path | None = None,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rtp-bench-finetune-") as tmp:
        root = workdir or Path(tmp)
        model, snapshot, index = prepare_inputs(root / "inputs", model_dir, chat_data)
        counts = {
            method: trained_parameters(
                method_config(
                    method, model, snapshot, root / "count", steps=steps, every=every, overrides=overrides
                )
            )
            for method in METHODS
        }
        runs: dict[str, list[dict[str, Any]]] = {method: [] for method in METHODS}
        for round_ in range(rounds):
            order = METHODS if round_ % 2 == 0 else METHODS[::-1]
            for method in order:
                folder = root / f"{method}-{round_}"
                runs[method].append(
                    run_method(
                        method,
                        model,
                        snapshot,
                        folder,
                        nproc=nproc,
                        steps=steps,
                        every=every,
                        fault_step=fault_step,
                        warmup_steps=warmup_steps,
                        overrides=overrides,
                    )
                )
                shutil.rmtree(folder, ignore_errors=True)  # a real model's checkpoints fill a disk
    return {
        **combine_rounds(runs),
        "methods_params": counts,
        "model_dir": model_dir or "the demo's tiny tied Llama (rtp_support/demo_chat.py)",
        "chat_data": chat_data or "the demo's conversations (rtp_support/demo_chat.py)",
        "data": {key: index[key] for key in ("conversations", "examples", "tokens", "assistant_tokens")},
        "settings": {
            "nproc": nproc,
            "steps": steps,
            "checkpoint.every_steps": every,
            "fault": f"exception@{fault_step}:{min(1, nproc - 1)}",
            "warmup_steps": warmup_steps,
            "rounds": rounds,
            "overrides": [*DEFAULT_SETTINGS, *overrides],
        },
    }


def combine_rounds(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each method's medians over its rounds, and LoRA over full paired round by round."""
    methods: dict[str, dict[str, Any]] = {}
    for method, rows in runs.items():
        verdicts = [row["exact"] for row in rows]
        # Where equal runs must give equal weights (CPU; CUDA with training.deterministic).
        if None not in verdicts and len({row["model_sha256"] for row in rows}) != 1:
            raise RuntimeError(f"{method} trained different weights in different rounds")
        combined = {
            key: statistics.median(row[key] for row in rows)
            if isinstance(value, int | float) and not isinstance(value, bool)
            else value
            for key, value in rows[-1].items()
        }
        combined["exact"] = None if None in verdicts else all(verdicts)
        combined["exact_rounds"] = verdicts
        combined["step_s_rounds"] = [row["step_s_median"] for row in rows]
        combined["fault_to_resumed_s_rounds"] = [row["fault_to_resumed_s"] for row in rows]
        combined["blocked_s_per_save"] = [row["blocked_s_per_save"] for row in rows]  # round by round
        methods[method] = combined
    # A figure that is 0 for full (no save in the run) has no ratio.
    ratios: dict[str, list[float] | None] = {}
    for figure in RATIO_FIGURES:
        pairs = list(zip(runs["full"], runs["lora"], strict=True))
        ratios[figure] = (
            [lora[figure] / full[figure] for full, lora in pairs]
            if all(full[figure] for full, _ in pairs)
            else None
        )
    return {
        "methods": methods,
        "lora_vs_full": {
            figure: statistics.median(values) if values else None for figure, values in ratios.items()
        },
        "lora_vs_full_rounds": ratios,
    }


def inexact_methods(result: dict[str, Any]) -> list[str]:
    """The methods whose recovered run ended with other weights than their fault-free run's."""
    return [method for method, row in result["methods"].items() if row["exact"] is False]


def format_table(result: dict[str, Any]) -> str:
    s = result["settings"]
    full, lora = result["methods"]["full"], result["methods"]["lora"]
    ratio = result["lora_vs_full"]

    def times(value: float | None) -> str:
        return f"{value:.2f}x" if value is not None else "-"

    def exact(row: dict[str, Any]) -> str:
        return "-" if row["exact"] is None else ("yes" if row["exact"] else "NO")

    counts = result["methods_params"]
    rows = [
        ("trained params", f"{counts['full']['trained_params']:,}", f"{counts['lora']['trained_params']:,}",
         times(counts["lora"]["trained_params"] / counts["full"]["trained_params"])),
        ("step time (median)", f"{full['step_s_median'] * 1000:.1f} ms", f"{lora['step_s_median'] * 1000:.1f} ms",
         times(ratio["step_s_median"])),
        ("peak memory per rank", f"{full['peak_mem_bytes'] / 2**20:.0f} MiB", f"{lora['peak_mem_bytes'] / 2**20:.0f} MiB",
         times(ratio["peak_mem_bytes"])),
        ("checkpoint on disk", f"{full['checkpoint_bytes'] / 1e6:.2f} MB", f"{lora['checkpoint_bytes'] / 1e6:.2f} MB",
         times(ratio["checkpoint_bytes"])),
        ("blocked per save (median)", f"{full['blocked_s_per_save_median'] * 1000:.1f} ms",
         f"{lora['blocked_s_per_save_median'] * 1000:.1f} ms", times(ratio["blocked_s_per_save_median"])),
        ("fast tier per copy", f"{full['local_tier_ms_per_copy']:.1f} ms", f"{lora['local_tier_ms_per_copy']:.1f} ms", ""),
        ("exception: fault->resumed", f"{full['fault_to_resumed_s']:.2f} s", f"{lora['fault_to_resumed_s']:.2f} s",
         times(ratio["fault_to_resumed_s"])),
        ("steps redone", f"{full['steps_redone']:g}", f"{lora['steps_redone']:g}", ""),
        ("exact after recovery", exact(full), exact(lora), ""),
    ]  # fmt: skip
    rounds = s["rounds"]
    lines = [
        f"{s['nproc']} ranks on {full['device']}, {s['steps']} steps, checkpoint every "
        f"{s['checkpoint.every_steps']}, fault {s['fault']}, step time after step {s['warmup_steps']}"
        + (f", medians of {rounds} rounds" if rounds > 1 else ""),
        f"{'':<26} {'full':>14} {'lora':>14} {'lora/full':>10}",
        *(f"{name:<26} {a:>14} {b:>14} {c:>10}" for name, a, b, c in rows),
    ]
    if rounds > 1:
        steps_by_round = ", ".join(f"{v:.2f}x" for v in result["lora_vs_full_rounds"]["step_s_median"])
        lines.append(f"step time lora/full, round by round: {steps_by_round}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="training ranks (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (default: %(default)s)")
    parser.add_argument(
        "--every", type=int, default=4, help="checkpoint interval in steps (default: %(default)s)"
    )
    parser.add_argument(
        "--fault-step",
        type=int,
        default=6,
        help="step at which rank 1 raises an exception in the recovery run (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="steps left out of the median step time (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="run the methods this many times in turn and report medians (default: %(default)s)",
    )
    parser.add_argument(
        "--model-dir",
        default="",
        help="a local Hugging Face model folder with a chat template (default: the demo's tiny tied Llama)",
    )
    parser.add_argument(
        "--chat-data",
        default="",
        help="conversations, a JSONL file or a folder of them (default: the demo's, from the standard library)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for both methods, e.g. training.lora_rank=8 (repeatable)",
    )
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON to this file")


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    if not 0 <= args.warmup_steps < args.steps:
        raise ValueError(
            f"--warmup-steps must be at least 0 and below --steps ({args.steps}), got {args.warmup_steps}"
        )
    if not 1 <= args.fault_step <= args.steps:
        raise ValueError(f"--fault-step must be a step of the run (1 to {args.steps}), got {args.fault_step}")
    for flag, path in (("--model-dir", args.model_dir), ("--chat-data", args.chat_data)):
        if path and not Path(path).exists():
            raise ValueError(f"{flag} {path}: no such file or folder")
    if any(item.partition("=")[0].strip() == "training.method" for item in args.override):
        raise ValueError("--override training.method=... is refused: the benchmark runs both methods")
    result = run_benchmark(
        nproc=args.nproc,
        steps=args.steps,
        every=args.every,
        fault_step=args.fault_step,
        warmup_steps=args.warmup_steps,
        rounds=args.rounds,
        model_dir=args.model_dir,
        chat_data=args.chat_data,
        overrides=args.override,
    )
    report(result, args.json_path, format_table)
    inexact = inexact_methods(result)
    if inexact:
        print(
            f"rtp bench finetune: FAILED: {', '.join(inexact)} ended its exception run with other weights than "
            "its fault-free run's (model_sha256): recovery is not exact",
            file=sys.stderr,
        )
        return 1
    return 0
