"""`rtp bench scaling`: the same training as FSDP over every rank and as HSDP, side by side.

Both sides are the real trainer (`trainer.launch.run_local_training`, async checkpoints
every `--every` steps) on the same model, batches and steps; only `parallelism` differs:
FSDP shards over all `--nproc` ranks (1 x N), HSDP over `--replicate` groups of N /
replicate ranks (R x N/R). With `--repeats N` each side runs N times, alternating which
goes first, and every field is the median.

Reported per side: tokens/s (all ranks), wall_s (loop plus the last save's commit),
step_s_median, iteration_s_median, peak_mem_bytes (rank 0), and the bytes each rank moves
a step by the layout's arithmetic: `in_group_bytes` (two all-gathers of the parameters in
the compute dtype, one reduce-scatter of fp32 gradients, over the shard group) and
`cross_group_bytes` (HSDP's all-reduce of the gradient shard across the groups). On one
machine every rank shares the same memory bus, so the table shows what HSDP costs in
memory and time here, not the NVLink/EFA split it exists for (docs/performance.md gives
that for p5 nodes).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.throughput import _median_side, bench_config, run_rtp, write_dataset

GRADIENT_BYTES = 4  # rtp reduces gradients in fp32 whatever the compute dtype


def traffic(params: int, param_bytes: int, replicate: int, shard: int) -> dict[str, float]:
    """Bytes one rank sends a step (ring collectives: (n - 1) / n of the data for n ranks)."""
    in_group = (2 * param_bytes + GRADIENT_BYTES) * params * (shard - 1) / shard
    shard_grad = GRADIENT_BYTES * params / shard
    cross = 2 * shard_grad * (replicate - 1) / replicate
    return {"in_group_bytes": in_group, "cross_group_bytes": cross}


def run_benchmark(
    *, preset: str, steps: int, every: int, nproc: int, replicate: int, overrides: list[str], repeats: int = 1
) -> dict[str, Any]:
    import torch

    from trainer.models import model_spec
    from trainer.parallelize import compute_dtype

    if replicate < 2 or nproc % replicate:
        raise ValueError(f"--replicate must be at least 2 and divide --nproc ({nproc}), got {replicate}")
    sides = {"fsdp": (1, nproc), "hsdp": (replicate, nproc // replicate)}
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="rtp-bench-scaling-") as tmp:
        root = Path(tmp)
        dataset = write_dataset(root, "")
        first = bench_config(preset, "", dataset, root / "probe", steps, every, overrides)
        params = sum(
            p.numel()
            for p in model_spec(first.model.kind).build(first.model, torch.device("meta")).parameters()
        )
        tokens_per_step = (first.data.global_batch or first.data.batch_size * nproc) * first.model.seq_len
        dtype = compute_dtype(first.training, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        param_bytes = torch.empty((), dtype=dtype).element_size()
        for index in range(repeats):
            order = list(sides) if index % 2 == 0 else list(reversed(sides))
            run: dict[str, Any] = {"order": ",".join(order)}
            for side in order:
                r, s = sides[side]
                config = bench_config(
                    preset,
                    "",
                    dataset,
                    root / f"repeat{index}" / side,
                    steps,
                    every,
                    [*overrides, f"parallelism.dp_replicate={r}", f"parallelism.dp_shard={s}"],
                )
                run[side] = {
                    **run_rtp(config, nproc, tokens_per_step),
                    "mesh": [r, s],
                    **traffic(params, param_bytes, r, s),
                }
            runs.append(run)
    fsdp, hsdp = (_median_side([run[side] for run in runs]) for side in sides)
    return {
        "fsdp": fsdp,
        "hsdp": hsdp,
        "hsdp_speedup": hsdp["tokens_per_s"] / fsdp["tokens_per_s"],
        "repeats": repeats,
        "runs": runs,
        "load_avg_1m": [load_before[0], os.getloadavg()[0]],
        "cpu_count": os.cpu_count(),
        "model_params": params,
        "tokens_per_step": tokens_per_step,
        "steps": steps,
        "checkpoint.every_steps": every,
        "nproc": nproc,
        "preset": preset,
        "compute_dtype": str(dtype),
        "overrides": overrides,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model_params'] / 1e6:.1f}M params, {result['steps']} steps x {result['tokens_per_step']} tokens, "
        f"{result['nproc']} ranks, {result['compute_dtype']}"
        + (f"; medians of {result['repeats']} repeats" if result["repeats"] > 1 else ""),
        f"{'layout':<12} {'tokens/s':>10} {'wall':>8} {'iter med':>9} {'peak mem MB':>12} "
        f"{'in-group MB':>12} {'cross MB':>9}",
    ]
    for name in ("fsdp", "hsdp"):
        row = result[name]
        layout = f"{name} {row['mesh'][0]}x{row['mesh'][1]}"
        lines.append(
            f"{layout:<12} {row['tokens_per_s']:>10.0f} {row['wall_s']:>7.2f}s {row['iteration_s_median']:>8.4f}s "
            f"{row['peak_mem_bytes'] / 1e6:>12.0f} {row['in_group_bytes'] / 1e6:>12.2f} "
            f"{row['cross_group_bytes'] / 1e6:>9.2f}"
        )
    lines.append(f"HSDP tokens/s / FSDP tokens/s: {result['hsdp_speedup']:.3f}x (bytes: per rank per step)")
    low, high = result["load_avg_1m"]
    lines.append(f"load average (1 min) before/after: {low:.2f}/{high:.2f} on {result['cpu_count']} CPUs")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-cpu", help="model preset (default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, default=40, help="training steps per side (default: %(default)s)"
    )
    parser.add_argument(
        "--every", type=int, default=20, help="checkpoint interval in steps (default: %(default)s)"
    )
    parser.add_argument("--nproc", type=int, default=4, help="ranks per side (default: %(default)s)")
    parser.add_argument(
        "--replicate",
        type=int,
        default=2,
        help="HSDP's replica groups; must divide --nproc (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per side, alternating the order; medians (default: %(default)s)",
    )
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="config override for both sides"
    )
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON to this file")


def main(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.nproc < 2 or args.repeats < 1:
        raise ValueError("--steps and --repeats must be at least 1 and --nproc at least 2")
    result = run_benchmark(
        preset=args.preset,
        steps=args.steps,
        every=args.every,
        nproc=args.nproc,
        replicate=args.replicate,
        overrides=args.override,
        repeats=args.repeats,
    )
    return report(result, args.json_path, format_table)
