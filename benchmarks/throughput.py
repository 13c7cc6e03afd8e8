"""`rtp bench throughput`: the rtp training stack against a bare FSDP loop, side by side.

Both train the same model (a preset, or a Hugging Face folder with `--model-source`) on the
same batches for the same steps, with the same `training` settings (mixed precision,
activation checkpointing, compile; `--override training.mixed_precision=bf16`):

- rtp: the real trainer through `trainer.launch.run_local_training` — ft_launcher with its
  rank monitors, the NVRx in-process restart wrapper, async (NVRx) checkpoints every
  `--every` steps, the event log and the per-step loss all-reduce;
- bare: `benchmarks/bare_fsdp.py` under torchrun — registry model, `fully_shard`, AdamW,
  nothing else.

Reported for each: tokens/s (all ranks), wall_s (the training loop, plus for rtp the wait
for its last checkpoint to commit; process start-up is reported apart as startup_s),
step_s_median, peak_mem_bytes (rank 0; CUDA: allocated, CPU: resident set) and, on CUDA,
mfu_pct: 6 x parameters x tokens/s against the GPUs' peak dense bf16 FLOP/s (the 6N rule
leaves out attention's FLOPs, so it slightly understates long-context MFU). `tax` is rtp
wall / bare wall: what resilience and checkpointing cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import report
from trainer.config import TrainConfig, build_config
from trainer.launch import run_local_training

PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    # (substring of torch.cuda.get_device_name(), dense bf16 FLOP/s), most specific first.
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)
"""Vendor datasheet peaks without sparsity; a device not listed gets no MFU."""


def peak_bf16_flops(device_name: str) -> float | None:
    for fragment, flops in PEAK_BF16_FLOPS:
        if fragment in device_name:
            return flops
    return None


def mfu_pct(
    params: int, tokens_per_s: float, peak_flops_per_device: float | None, devices: int
) -> float | None:
    """Model FLOPs utilisation in percent (6N FLOPs per trained token), None without a peak."""
    if not peak_flops_per_device:
        return None
    return 100.0 * 6 * params * tokens_per_s / (peak_flops_per_device * devices)


def bench_config(
    preset: str, model_source: str, dataset: Path, workdir: Path, steps: int, every: int, overrides: list[str]
) -> TrainConfig:
    """The one config both sides train."""
    model = [f"model.model_dir={model_source}", "model.init=pretrained"] if model_source else []
    return build_config(
        preset,
        [
            *model,
            f"data.dataset_dir={dataset}",
            f"run.workdir={workdir}",
            f"run.steps={steps}",
            f"checkpoint.every_steps={every}",
            "checkpoint.mode=async",
            "checkpoint.keep_last=2",
            "run.seed=1",
            "run.log_every_steps=1000",
            *overrides,
        ],
    )


def write_dataset(root: Path, model_source: str) -> Path:
    """The demo corpus as a dataset snapshot: bytes for the byte LM, token shards made with
    the model folder's tokenizer for a Hugging Face model."""
    from rtp_cli.demo_data import write_local_dataset

    if not model_source:
        return write_local_dataset(root / "dataset", budget_bytes=500_000)
    import shutil

    from rtp_cli.demo_data import demo_corpus, write_local_manifest
    from trainer.tokenized_data import write_token_shards

    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for name, source in demo_corpus(500_000):
        shutil.copyfile(source, corpus / f"{name}.txt")
    snapshot = root / "dataset"
    write_token_shards(corpus, snapshot / "files", Path(model_source), shard_bytes=64 * 1024, workers=2)
    return write_local_manifest(snapshot, key_prefix="tokens/", snapshot_id="bench-tokens")


def _rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # as trainer.launch gives the ranks
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_rtp(config: TrainConfig, nproc: int, tokens_per_step: int) -> dict[str, Any]:
    summary = run_local_training(nproc, config, echo=False)
    events = [
        json.loads(line) for line in (Path(config.run.workdir) / "events.jsonl").read_text().splitlines()
    ]
    step_s = [event["duration_s"] for event in events if event.get("kind") == "step"]
    wall_s = summary.loop_wall_s + summary.final_drain_s
    return {
        "tokens_per_s": tokens_per_step * summary.steps_run / wall_s,
        "wall_s": wall_s,
        "step_s_median": statistics.median(step_s),
        "peak_mem_bytes": summary.peak_mem_bytes,
        "startup_s": summary.wall_seconds - summary.loop_wall_s - summary.final_drain_s,
        "loop_wall_s": summary.loop_wall_s,
        "final_drain_s": summary.final_drain_s,
        "checkpoint_blocked_s": summary.checkpoint_blocked_s,
        "checkpoint_efficiency_pct": summary.efficiency_pct,
        "saves": len(summary.checkpoint_saves),
        "final_loss": summary.final_loss,
    }


def run_bare(config: TrainConfig, nproc: int, tokens_per_step: int) -> dict[str, Any]:
    work = Path(config.run.workdir)
    work.mkdir(parents=True, exist_ok=True)
    config_path = config.write(work / "config.json")
    out = work / "bare.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "benchmarks.bare_fsdp",
        str(config_path),
        str(out),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, env=_rank_env(), stdin=subprocess.DEVNULL, check=False
    )
    if result.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the bare FSDP loop failed ({result.returncode}):\n{result.stderr[-3000:]}")
    raw = json.loads(out.read_text())
    return {
        "tokens_per_s": tokens_per_step * raw["steps"] / raw["wall_s"],
        "wall_s": raw["wall_s"],
        "step_s_median": raw["step_s_median"],
        "peak_mem_bytes": raw["peak_mem_bytes"],
        "startup_s": raw["startup_s"],
        "final_loss": raw["final_loss"],
    }


def run_benchmark(
    *,
    preset: str,
    model_source: str = "",
    steps: int,
    every: int,
    nproc: int,
    overrides: list[str],
    workdir: Path | None = None,
) -> dict[str, Any]:
    import torch

    from trainer.models import model_spec
    from trainer.parallelize import compute_dtype

    with tempfile.TemporaryDirectory(prefix="rtp-bench-throughput-") as tmp:
        root = workdir or Path(tmp)
        dataset = write_dataset(root, model_source)
        rtp_config = bench_config(preset, model_source, dataset, root / "rtp", steps, every, overrides)
        bare_config = bench_config(preset, model_source, dataset, root / "bare", steps, every, overrides)
        meta_model = model_spec(rtp_config.model.kind).build(rtp_config.model, torch.device("meta"))
        params = sum(p.numel() for p in meta_model.parameters())
        tokens_per_step = rtp_config.data.batch_size * rtp_config.model.seq_len * nproc
        bare = run_bare(bare_config, nproc, tokens_per_step)
        rtp = run_rtp(rtp_config, nproc, tokens_per_step)
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = peak_bf16_flops(device_name) if cuda else None
    for side in (rtp, bare):
        side["mfu_pct"] = mfu_pct(params, side["tokens_per_s"], peak, nproc)
    return {
        "rtp": rtp,
        "bare": bare,
        "tax": rtp["wall_s"] / bare["wall_s"],
        "model_params": params,
        "tokens_per_step": tokens_per_step,
        "steps": steps,
        "checkpoint.every_steps": every,
        "nproc": nproc,
        "preset": preset,
        "model_source": model_source,
        "device": device_name,
        "compute_dtype": str(compute_dtype(rtp_config.training, torch.device("cuda" if cuda else "cpu"))),
        "peak_bf16_flops": peak,
        "overrides": overrides,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model_params'] / 1e6:.1f}M params, {result['steps']} steps x {result['tokens_per_step']} "
        f"tokens, {result['nproc']} ranks on {result['device']}, {result['compute_dtype']}; rtp saves every "
        f"{result['checkpoint.every_steps']} steps",
        f"{'stack':<6} {'tokens/s':>10} {'wall':>8} {'step med':>9} {'peak mem MB':>12} {'MFU':>7} {'startup':>8}",
    ]
    for name in ("rtp", "bare"):
        row = result[name]
        mfu = f"{row['mfu_pct']:.1f}%" if row["mfu_pct"] is not None else "-"
        lines.append(
            f"{name:<6} {row['tokens_per_s']:>10.0f} {row['wall_s']:>7.2f}s {row['step_s_median']:>8.4f}s "
            f"{row['peak_mem_bytes'] / 1e6:>12.0f} {mfu:>7} {row['startup_s']:>7.1f}s"
        )
    rtp = result["rtp"]
    lines.append(
        f"tax (rtp wall / bare wall): {result['tax']:.3f}x; rtp's wall: loop {rtp['loop_wall_s']:.2f}s "
        f"(blocked on {rtp['saves']} saves {rtp['checkpoint_blocked_s']:.2f}s) + last save's commit "
        f"{rtp['final_drain_s']:.2f}s"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="small-cpu", help="model preset (default: %(default)s)")
    source.add_argument(
        "--model-source",
        default="",
        metavar="DIR",
        help="a Hugging Face model folder to train instead of a preset's byte-level model "
        "(the demo corpus is tokenized with its tokenizer)",
    )
    parser.add_argument(
        "--steps", type=int, default=30, help="training steps per side (default: %(default)s)"
    )
    parser.add_argument(
        "--every", type=int, default=10, help="rtp's checkpoint interval in steps (default: %(default)s)"
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks per side (default: %(default)s)")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for both sides, e.g. training.mixed_precision=bf16 (repeatable)",
    )
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON to this file")


def main(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.nproc < 1:
        raise ValueError("--steps and --nproc must be at least 1")
    preset = args.preset if not args.model_source else "tiny-cpu"
    result = run_benchmark(
        preset=preset,
        model_source=args.model_source,
        steps=args.steps,
        every=args.every,
        nproc=args.nproc,
        overrides=args.override,
    )
    return report(result, args.json_path, format_table)
