"""`rtp bench throughput`: the rtp training stack against a bare FSDP loop, side by side.

Both train the same model (a preset, or a Hugging Face folder with `--model-source`) on the
same batches for the same steps, with the same `training` settings (mixed precision,
activation checkpointing, compile; `--override training.mixed_precision=bf16`):

- rtp: the real trainer through `trainer.launch.run_local_training` — ft_launcher with its
  rank monitors, the NVRx in-process restart wrapper, async (NVRx) checkpoints every
  `--every` steps, the event log and the per-step loss all-reduce;
- bare: `benchmarks/bare_fsdp.py` under torchrun — registry model, `fully_shard`, AdamW,
  nothing else.

Reported for each side: tokens/s (all ranks), wall_s (the training loop from its first step,
plus for rtp the wait for its last checkpoint to commit), step_s_median (the loop's own
step time; for rtp it ends at the loss all-reduce), iteration_s_median (step start to next
step start, so for rtp it also holds the per-step events, heartbeats and checkpoint polls;
the bare loop has nothing outside its step), peak_mem_bytes (rank 0; CUDA: allocated, CPU:
resident set), startup_s (process launch to the first step: launcher, rank monitors,
stores, imports, model build, checkpoint writer warm-up), total_s (launch to exit) and, on
CUDA, mfu_pct: 6 x N x tokens per median iteration against the GPUs' peak dense bf16 FLOP/s.
N is `flop_params`: the parameters outside embedding lookups (an `nn.Embedding` table is read,
not multiplied; a head tied to it is a matmul and counts). The median iteration leaves the
first steps and the save steps out; the 6N rule leaves out attention's score FLOPs, so it
understates long-context MFU.

The steady state, without set-up: with `--warmup-steps W` each side is also timed from the end
of step W to the end of its last step (`window_s`, `window_tokens_per_s`): the first steps'
warm-up and rtp's last save's commit are outside it, the periodic saves inside. On CUDA each
side records `peak_mem_bytes_by_phase` (`torch.cuda.max_memory_allocated`: rtp's train,
fingerprint and evaluation, the bare loop's train), and `--memory-plan` puts the memory plan's
estimate for the same config beside it (`memory`: trainer/memory_plan.py, traced on fake
tensors in this process).

`tax` is rtp wall / bare wall: what resilience and checkpointing cost while training (the
last save's commit included; start-up is apart, in startup_s). `step_tax` is rtp
iteration_s_median / bare iteration_s_median, the steady-state per-step cost;
`beyond_median_s` (each side) is wall_s less steps x iteration_s_median: what the run spent
beyond its typical step (the first steps' warm-up, the save steps, rtp's last commit), a
cost per run and per save that weighs less the longer the run. With
`--repeats N` the two sides run N times each, alternating which goes first (a shared
machine's load drifts), and every side's field is the median over the repeats; `runs`
holds each repeat.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from trainer.config import TrainConfig, build_config
from trainer.launch import launch_tempdir, run_local_training

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


def flop_parameters(model: Any) -> int:
    """N of the 6N rule: parameters outside embedding lookups; one shared with a matmul (a
    tied head) counts, once."""
    import torch

    lookups = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    multiplied = {
        id(p)
        for m in model.modules()
        if not isinstance(m, torch.nn.Embedding)
        for p in m.parameters(recurse=False)
    }
    return sum(p.numel() for p in model.parameters() if id(p) not in lookups or id(p) in multiplied)


def steady_window(step_ends: dict[int, float], warmup_steps: int, tokens_per_step: int) -> dict[str, Any]:
    """The loop from the end of step `warmup_steps` to the end of its last step."""
    last = max(step_ends)
    first = warmup_steps if warmup_steps in step_ends else min(step_ends)
    if first >= last:
        raise ValueError(f"--warmup-steps {warmup_steps} leaves no step to time in a run of {last} steps")
    window_s = step_ends[last] - step_ends[first]
    return {
        "window_s": window_s,
        "window_steps": last - first,
        "window_tokens_per_s": tokens_per_step * (last - first) / window_s if window_s > 0 else 0.0,
    }


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
    from rtp_support.demo_data import write_local_dataset

    if not model_source:
        return write_local_dataset(root / "dataset", budget_bytes=500_000)
    import shutil

    from rtp_support.demo_data import demo_corpus, write_local_manifest
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


def run_rtp(config: TrainConfig, nproc: int, tokens_per_step: int, warmup_steps: int = 0) -> dict[str, Any]:
    launched = time.time()
    summary = run_local_training(nproc, config, echo=False)
    ended = time.time()
    events = [
        json.loads(line) for line in (Path(config.run.workdir) / "events.jsonl").read_text().splitlines()
    ]
    steps = [event for event in events if event.get("kind") == "step"]
    step_s = [event["duration_s"] for event in steps]
    # Consecutive step events are one whole iteration apart: the step and all the loop does
    # around it (event log, progress, checkpoint policy and polls, heartbeats).
    iteration_s = [b["time"] - a["time"] for a, b in itertools.pairwise(steps)] or step_s
    loop_started_at = next(event["time"] for event in events if event.get("kind") == "resumed")
    wall_s = summary.loop_wall_s + summary.final_drain_s
    iteration_median = statistics.median(iteration_s)
    ends = {event["step"]: event["time"] for event in steps}
    return {
        **steady_window(ends, warmup_steps, tokens_per_step),
        "tokens_per_s": tokens_per_step * summary.steps_run / wall_s,
        "wall_s": wall_s,
        "step_s_median": statistics.median(step_s),
        "iteration_s_median": iteration_median,
        "beyond_median_s": wall_s - summary.steps_run * iteration_median,
        "peak_mem_bytes": summary.peak_mem_bytes,
        "peak_mem_bytes_by_phase": summary.peak_mem_bytes_by_phase,
        "startup_s": loop_started_at - launched,
        "total_s": ended - launched,
        "loop_wall_s": summary.loop_wall_s,
        "final_drain_s": summary.final_drain_s,
        "checkpoint_blocked_s": summary.checkpoint_blocked_s,
        "checkpoint_efficiency_pct": summary.efficiency_pct,
        "saves": len(summary.checkpoint_saves),
        "final_loss": summary.final_loss,
    }


def run_bare(config: TrainConfig, nproc: int, tokens_per_step: int, warmup_steps: int = 0) -> dict[str, Any]:
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
    env = _rank_env()
    with launch_tempdir(env):
        launched = time.time()
        result = subprocess.run(
            command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, check=False
        )
        ended = time.time()
    if result.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the bare FSDP loop failed ({result.returncode}):\n{result.stderr[-3000:]}")
    raw = json.loads(out.read_text())
    ends = {step: end for step, end in enumerate(raw["step_ends_s"], start=1)}
    return {
        **steady_window(ends, warmup_steps, tokens_per_step),
        "tokens_per_s": tokens_per_step * raw["steps"] / raw["wall_s"],
        "wall_s": raw["wall_s"],
        "step_s_median": raw["step_s_median"],
        "iteration_s_median": raw["step_s_median"],  # nothing runs between its steps
        "beyond_median_s": raw["wall_s"] - raw["steps"] * raw["step_s_median"],
        "peak_mem_bytes": raw["peak_mem_bytes"],
        "peak_mem_bytes_by_phase": raw["peak_mem_bytes_by_phase"],
        "startup_s": raw["loop_started_at"] - launched,
        "total_s": ended - launched,
        "final_loss": raw["final_loss"],
    }


def _median_side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric field's median over the repeats (the first repeat's value otherwise)."""
    merged: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [run[key] for run in runs]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        merged[key] = statistics.median(values) if numeric else value
    return merged


def run_benchmark(
    *,
    preset: str,
    model_source: str = "",
    steps: int,
    every: int,
    nproc: int,
    overrides: list[str],
    repeats: int = 1,
    workdir: Path | None = None,
    warmup_steps: int = 0,
    memory_plan: bool = False,
) -> dict[str, Any]:
    import torch

    from trainer.models import model_spec
    from trainer.parallelize import compute_dtype

    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="rtp-bench-throughput-") as tmp:
        root = workdir or Path(tmp)
        dataset = write_dataset(root, model_source)
        rtp_config = bench_config(preset, model_source, dataset, root / "rtp", steps, every, overrides)
        meta_model = model_spec(rtp_config.model.kind).build(rtp_config.model, torch.device("meta"))
        params = sum(p.numel() for p in meta_model.parameters())
        flop_params = flop_parameters(meta_model)
        tokens_per_step = (
            rtp_config.data.global_batch or rtp_config.data.batch_size * nproc
        ) * rtp_config.model.seq_len
        for index in range(repeats):
            run_root = root if repeats == 1 else root / f"repeat{index}"
            rtp_config = bench_config(
                preset, model_source, dataset, run_root / "rtp", steps, every, overrides
            )
            bare_config = bench_config(
                preset, model_source, dataset, run_root / "bare", steps, every, overrides
            )
            run: dict[str, Any] = {"order": "bare,rtp" if index % 2 == 0 else "rtp,bare"}
            for side in run["order"].split(","):
                if side == "bare":
                    run["bare"] = run_bare(bare_config, nproc, tokens_per_step, warmup_steps)
                else:
                    run["rtp"] = run_rtp(rtp_config, nproc, tokens_per_step, warmup_steps)
            run["tax"] = run["rtp"]["wall_s"] / run["bare"]["wall_s"]
            runs.append(run)
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = peak_bf16_flops(device_name) if cuda else None
    for run in runs:
        for side in (run["rtp"], run["bare"]):
            # The median iteration's rate: neither the first steps nor the save steps.
            side["mfu_pct"] = mfu_pct(flop_params, tokens_per_step / side["iteration_s_median"], peak, nproc)
    rtp = _median_side([run["rtp"] for run in runs])
    bare = _median_side([run["bare"] for run in runs])
    memory = memory_beside_plan(rtp_config, nproc, rtp, bare) if memory_plan else None
    return {
        "rtp": rtp,
        "bare": bare,
        "tax": rtp["wall_s"] / bare["wall_s"],
        "step_tax": rtp["iteration_s_median"] / bare["iteration_s_median"],
        "repeats": repeats,
        "runs": runs,
        "load_avg_1m": [load_before[0], os.getloadavg()[0]],
        "cpu_count": os.cpu_count(),
        "model_params": params,
        "flop_params": flop_params,
        "mfu_basis": "6 x flop_params (parameters outside embedding lookups) x tokens per median iteration",
        "warmup_steps": warmup_steps,
        "memory": memory,
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


def memory_beside_plan(
    config: TrainConfig, nproc: int, rtp: dict[str, Any], bare: dict[str, Any]
) -> dict[str, Any]:
    """The memory plan of `config` on `nproc` GPUs of this machine (trainer/memory_plan.py)
    beside each side's measured peaks per phase, in GiB; measured / planned per phase."""
    import torch

    from trainer.memory_plan import GIB, H100_GPU_GIB, Job, plan_memory

    gpu_gib = (
        torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else H100_GPU_GIB
    )
    try:
        plan = plan_memory(Job(config=config, gpus_per_node=nproc, gpu_memory_gib=gpu_gib), find_fix=False)
    except Exception as exc:  # the measurement stands without it
        return {"plan_error": f"{type(exc).__name__}: {exc}"}
    planned = {
        "train_step": plan.train_step_gib,
        "evaluation": plan.evaluation_gib,
    }  # as phases_gib, unrounded
    measured = {
        side: {phase: nbytes / GIB for phase, nbytes in row.get("peak_mem_bytes_by_phase", {}).items()}
        for side, row in (("rtp", rtp), ("bare", bare))
    }
    pairs = {"train": "train_step", "evaluation": "evaluation"}
    return {
        "plan_gib": planned,
        "plan_peak_gib": round(plan.peak_gib, 2),
        "plan_fits": plan.fits,
        "measured_gib": measured,
        "rtp_measured_over_plan": {
            phase: measured["rtp"][phase] / planned[key]
            for phase, key in pairs.items()
            if phase in measured["rtp"] and planned.get(key)
        },
    }


def format_table(result: dict[str, Any]) -> str:
    repeats = result["repeats"]
    lines = [
        f"{result['model_params'] / 1e6:.1f}M params, {result['steps']} steps x {result['tokens_per_step']} "
        f"tokens, {result['nproc']} ranks on {result['device']}, {result['compute_dtype']}; rtp saves every "
        f"{result['checkpoint.every_steps']} steps"
        + (f"; medians of {repeats} repeats" if repeats > 1 else ""),
        f"{'stack':<6} {'tokens/s':>10} {'wall':>8} {'step med':>9} {'iter med':>9} {'peak mem MB':>12} "
        f"{'MFU':>7} {'startup':>8}",
    ]
    for name in ("rtp", "bare"):
        row = result[name]
        mfu = f"{row['mfu_pct']:.1f}%" if row["mfu_pct"] is not None else "-"
        lines.append(
            f"{name:<6} {row['tokens_per_s']:>10.0f} {row['wall_s']:>7.2f}s {row['step_s_median']:>8.4f}s "
            f"{row['iteration_s_median']:>8.4f}s {row['peak_mem_bytes'] / 1e6:>12.0f} {mfu:>7} "
            f"{row['startup_s']:>7.1f}s"
        )
    rtp = result["rtp"]
    lines.append(
        f"tax (rtp wall / bare wall): {result['tax']:.3f}x; per step (iteration medians): "
        f"{result['step_tax']:.3f}x; rtp's wall: loop {rtp['loop_wall_s']:.2f}s (blocked on {rtp['saves']:g} "
        f"saves {rtp['checkpoint_blocked_s']:.2f}s) + last save's commit {rtp['final_drain_s']:.2f}s"
    )
    lines.append(
        f"beyond steps x iteration median (first steps, save steps, last commit): rtp "
        f"{rtp['beyond_median_s']:.2f}s, bare {result['bare']['beyond_median_s']:.2f}s"
    )
    bare = result["bare"]
    lines.append(
        f"steady state (end of step {result.get('warmup_steps', 0)} to the last): rtp "
        f"{rtp['window_tokens_per_s']:.0f} tokens/s, bare {bare['window_tokens_per_s']:.0f} tokens/s; "
        f"MFU from the median iteration, 6 x {result['flop_params'] / 1e6:.1f}M non-embedding parameters"
    )
    memory = result.get("memory") or {}
    if "plan_gib" in memory:
        measured = memory["measured_gib"]["rtp"]
        lines.append(
            "memory per phase, GiB (rtp measured / plan): "
            + ", ".join(
                f"{phase} {measured.get(phase, float('nan')):.1f} / {memory['plan_gib'][key]:.1f}"
                for phase, key in (("train", "train_step"), ("evaluation", "evaluation"))
            )
        )
    elif "plan_error" in memory:
        lines.append(f"memory plan: {memory['plan_error']}")
    if repeats > 1:
        lines.append("tax per repeat: " + ", ".join(f"{run['tax']:.3f}x" for run in result["runs"]))
    low, high = result["load_avg_1m"]
    lines.append(f"load average (1 min) before/after: {low:.2f}/{high:.2f} on {result['cpu_count']} CPUs")
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
        "--steps",
        type=int,
        default=300,
        help="training steps per side (default: %(default)s; rtp's costs per run, such as its "
        "last save's commit and the first steps' warm-up, weigh more in shorter runs: see "
        "beyond_median_s)",
    )
    parser.add_argument(
        "--every", type=int, default=20, help="rtp's checkpoint interval in steps (default: %(default)s)"
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks per side (default: %(default)s)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run both sides this many times, alternating which goes first, and report medians "
        "(a shared machine's load drifts; default: %(default)s)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for both sides, e.g. training.mixed_precision=bf16 (repeatable)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        help="time the steady state from the end of this step (window_s, window_tokens_per_s; "
        "default: %(default)s, from the first step's end)",
    )
    parser.add_argument(
        "--memory-plan",
        action="store_true",
        help="put the memory plan's estimate beside the measured peaks per phase (a CUDA run measures them)",
    )
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON to this file")


def main(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.nproc < 1 or args.repeats < 1:
        raise ValueError("--steps, --nproc and --repeats must be at least 1")
    if not 0 <= args.warmup_steps < args.steps:
        raise ValueError(f"--warmup-steps must be at least 0 and below --steps ({args.steps})")
    preset = args.preset if not args.model_source else "tiny-cpu"
    result = run_benchmark(
        preset=preset,
        model_source=args.model_source,
        steps=args.steps,
        every=args.every,
        nproc=args.nproc,
        overrides=args.override,
        repeats=args.repeats,
        warmup_steps=args.warmup_steps,
        memory_plan=args.memory_plan,
    )
    return report(result, args.json_path, format_table)
