"""`rtp bench checkpoint`: the same training run under every checkpoint mode, side by side.

The modes are the trainer's (`off`, `sync`, `async`) and `torch-async`, torch's
`dcp.async_save`, which benchmarks/torch_async.py plugs in as `sync`'s writer. Each mode
trains the same model (preset `bench-cpu`: ~25M parameters, ~300 MB of model +
AdamW state) for the same steps with the same checkpoint interval, through the real
launcher (N ranks over gloo on CPU, NCCL on GPU). Reported per mode, from the run's own
summary.json:

- blocked seconds per save (median, max): the time the loop waited for checkpointing;
- efficiency %: 100 - 100 * sum(blocked) / loop wall time (AWS's definition);
- wall seconds: loop wall time plus the wait for the last save to commit (both also
  reported alone: `loop_wall_s`, `final_drain_s`), and its ratio to `off` (efficiency ignores how much a background write slows training; this does
  not). One-time costs per process are reported beside it, not in it: `startup_s`
  (creating the writer and warming it up) and `teardown_s` (stopping it);
- saves and checkpoint bytes;
- the fast checkpoint tier's cost (`checkpoint.local_every_steps`, every step by default;
  `--local-every` to change): its copies are part of the blocked time and efficiency of
  every mode but `off`, which runs without it and so is the baseline of `wall_vs_off`;
  `local_tier_ms_per_copy` is one copy's mean;
- host: the host memory checkpointing held at most (the host-state engine's slots: two
  with the fast tier on, one with it off, for `async` saves), in copies of a rank's state.

The steady state, without set-up: with `--warmup-steps W` every mode is also timed from the
end of step W to the end of its last step (`window_s`, from the run's step events): the first
steps (allocator and kernel warm-up, the first capture's slot preparation, a budget tier's
calibration) and the last save's commit are outside it, and every save from step W on that is
not the last is inside, overlapping the steps after it. `window_vs_off` is its ratio to `off`'s
window; `window_blocked_s` the loop's blocked time on those saves; `window_efficiency_pct`
AWS's efficiency over the window. Pin the fast tier's interval (`--local-every`) where modes are
compared: `auto` on CUDA calibrates it per run.

With `--rounds N` the modes run N times in turn, each round starting one mode further on.
Every figure is then the median over the rounds, and `wall_vs_off` is the median of each
round's ratio to that round's `off` run (each round's in `wall_vs_off_rounds`, its wall
in `wall_s_rounds`), so a slow minute on a shared machine moves one pair, not the comparison.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from trainer.config import CHECKPOINT_MODES, build_config
from trainer.launch import run_local_training

TORCH_ASYNC = "torch-async"
"""torch's `dcp.async_save`, the peer NVRx's `async` is compared with: a writer plugged in
(benchmarks/torch_async.py, imported by the ranks only: it imports torch)."""
MODES = (*CHECKPOINT_MODES, TORCH_ASYNC)


def mode_overrides(mode: str) -> list[str]:
    """The trainer settings (`key=value` overrides) of a benchmark's checkpoint mode."""
    if mode == TORCH_ASYNC:
        return ["checkpoint.mode=sync", "checkpoint.writer=benchmarks.torch_async:TorchAsyncWriter"]
    return [f"checkpoint.mode={mode}"]


def run_mode(
    mode: str,
    dataset_dir: Path,
    workdir: Path,
    *,
    nproc: int,
    steps: int,
    every: int,
    preset: str,
    local_every: int | None = None,
    overrides: Sequence[str] = (),
    warmup_steps: int = 0,
) -> dict[str, Any]:
    tier = []
    if mode == "off":
        tier = ["checkpoint.local_every_steps=0"]  # the baseline: no checkpointing at all
    elif local_every is not None:
        tier = [f"checkpoint.local_every_steps={local_every}"]
    config = build_config(
        preset,
        [
            f"data.dataset_dir={dataset_dir}",
            f"run.workdir={workdir}",
            f"run.steps={steps}",
            f"checkpoint.every_steps={every}",
            *mode_overrides(mode),
            "run.seed=1",
            "checkpoint.keep_last=2",
            "run.log_every_steps=1000",
            *tier,
            *overrides,
        ],
    )
    summary = run_local_training(nproc, config, echo=False).to_dict()
    copies = summary.get("local_tier_captures", 0)
    saves = summary["checkpoint_saves"]
    blocked = [save["blocked_s"] for save in saves]
    window = timed_window(_step_times(workdir), saves, warmup_steps)
    return {
        **window,
        "blocked_s_per_save_median": statistics.median(blocked) if blocked else 0.0,
        "blocked_s_per_save_max": max(blocked) if blocked else 0.0,
        "write_s_per_save_median": statistics.median(s["write_s"] for s in saves) if saves else 0.0,
        "efficiency_pct": summary["efficiency_pct"],
        "wall_s": summary["loop_wall_s"] + summary["final_drain_s"],
        "loop_wall_s": summary["loop_wall_s"],
        "final_drain_s": summary["final_drain_s"],
        "startup_s": summary["checkpointer_start_s"],
        "teardown_s": summary["checkpointer_teardown_s"],
        "saves": len(blocked),
        "local_tier_copies": copies,
        "local_tier_s": summary.get("local_tier_s", 0.0),
        "local_tier_ms_per_copy": 1000 * summary.get("local_tier_s", 0.0) / copies if copies else 0.0,
        "checkpoint_bytes": summary["checkpoint_saves"][-1]["bytes_total"] if blocked else 0,
        "host_copies": summary.get("checkpoint_host_copies", 0.0),
        "final_loss": summary["final_loss"],
        "model_sha256": summary["model_sha256"],
    }


def _step_times(workdir: Path) -> dict[int, float]:
    """Each step's end (its `step` event's time; the save of that step comes after it)."""
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines() if line]
    return {event["step"]: event["time"] for event in events if event.get("kind") == "step"}


def timed_window(
    step_times: dict[int, float], saves: list[dict[str, Any]], warmup_steps: int
) -> dict[str, Any]:
    """The loop from the end of step `warmup_steps` (0: the first step's) to the end of the last
    step, and the saves inside it: those begun at steps `warmup_steps` .. last - 1 (a save runs
    after its step's event; the last step's save commits after the window)."""
    if not step_times:
        return {"window_s": 0.0, "window_steps": 0, "window_saves": 0, "window_blocked_s": 0.0,
                "window_efficiency_pct": 100.0}  # fmt: skip
    last = max(step_times)
    first = warmup_steps if warmup_steps in step_times else min(step_times)
    if first >= last:
        raise ValueError(
            f"--warmup-steps {warmup_steps} leaves no step to time in a run of {last} steps: "
            "train more steps or warm up fewer"
        )
    window_s = step_times[last] - step_times[first]
    inside = [save for save in saves if first <= save["step"] < last]
    blocked_s = sum(save["blocked_s"] for save in inside)
    return {
        "window_s": window_s,
        "window_steps": last - first,
        "window_saves": len(inside),
        "window_blocked_s": blocked_s,
        "window_efficiency_pct": 100.0 - 100.0 * blocked_s / window_s if window_s > 0 else 100.0,
    }


def run_benchmark(
    *,
    modes: list[str],
    nproc: int,
    steps: int,
    every: int,
    preset: str,
    local_every: int | None = None,
    overrides: Sequence[str] = (),
    workdir: Path | None = None,
    rounds: int = 1,
    warmup_steps: int = 0,
) -> dict[str, Any]:
    import torch

    from rtp_support.demo_data import write_local_dataset
    from trainer.models import model_spec

    config = build_config(preset)
    # Counts parameters without allocating them (gpu-1b: 4 GB).
    meta_model = model_spec(config.model.kind).build(config.model, torch.device("meta"))
    params = sum(p.numel() for p in meta_model.parameters())
    with tempfile.TemporaryDirectory(prefix="rtp-bench-ckpt-") as tmp:
        root = workdir or Path(tmp)
        dataset = write_local_dataset(root / "dataset", budget_bytes=500_000)
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for round_ in range(rounds):
            shift = round_ % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                folder = root / f"{mode}-{round_}"
                runs[mode].append(
                    run_mode(
                        mode,
                        dataset,
                        folder,
                        nproc=nproc,
                        steps=steps,
                        every=every,
                        preset=preset,
                        local_every=local_every,
                        overrides=overrides,
                        warmup_steps=warmup_steps,
                    )
                )
                # The next run must not find its disk full of this one's checkpoints (gpu-1b: 12 GB each).
                shutil.rmtree(folder, ignore_errors=True)
    results = combine_rounds(runs)
    return {
        "modes": results,
        "model_params": params,
        "interval_steps": every,
        "steps": steps,
        "nproc": nproc,
        "preset": preset,
        "overrides": list(overrides),
        "local_every_steps": build_config(preset).checkpoint.local_every_steps
        if local_every is None
        else local_every,
        "rounds": rounds,
        "warmup_steps": warmup_steps,
    }


def combine_rounds(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each mode's median over its rounds; `wall_vs_off` pairs every round with that round's `off`."""
    results: dict[str, dict[str, Any]] = {}
    for mode, rows in runs.items():
        results[mode] = {
            key: statistics.median(row[key] for row in rows)
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            else value
            for key, value in rows[-1].items()
        }
        results[mode]["wall_s_rounds"] = [row["wall_s"] for row in rows]
        if len({row["model_sha256"] for row in rows}) != 1:
            raise RuntimeError(f"mode {mode} trained different weights in different rounds")
    if "off" in runs:
        for mode, rows in runs.items():
            ratios = [row["wall_s"] / off["wall_s"] for row, off in zip(rows, runs["off"], strict=True)]
            results[mode]["wall_vs_off"] = statistics.median(ratios)
            results[mode]["wall_vs_off_rounds"] = ratios
            windows = [
                row["window_s"] / off["window_s"]
                for row, off in zip(rows, runs["off"], strict=True)
                if row.get("window_s") and off.get("window_s")
            ]
            if windows:
                results[mode]["window_vs_off"] = statistics.median(windows)
    return results


def format_table(result: dict[str, Any]) -> str:
    header = (
        f"{'mode':<12} {'blocked/save med':>16} {'max':>8} {'write/save':>10} {'efficiency':>10} "
        f"{'wall':>8} {'vs off':>7} {'saves':>5} {'ckpt MB':>8} {'tier/copy':>10} {'host':>5}"
    )
    rounds = result.get("rounds", 1)
    lines = [
        f"model {result['model_params'] / 1e6:.1f}M params, {result['steps']} steps, save every "
        f"{result['interval_steps']}, {result['nproc']} ranks, fast tier every {result['local_every_steps']} "
        "(off: none)" + (f", medians of {rounds} rounds" if rounds > 1 else ""),
        header,
    ]
    for mode, r in result["modes"].items():
        vs_off = f"{r['wall_vs_off']:.2f}x" if "wall_vs_off" in r else "-"
        lines.append(
            f"{mode:<12} {r['blocked_s_per_save_median']:>15.3f}s {r['blocked_s_per_save_max']:>7.3f}s "
            f"{r['write_s_per_save_median']:>9.3f}s {r['efficiency_pct']:>9.1f}% {r['wall_s']:>7.1f}s {vs_off:>7} "
            f"{r['saves']:>5} {r['checkpoint_bytes'] / 1e6:>8.1f} {r['local_tier_ms_per_copy']:>8.1f}ms {r['host_copies']:>4.1f}x"
        )
    if rounds > 1 and "off" in result["modes"]:
        spreads = ", ".join(
            f"{mode} " + ", ".join(f"{ratio:.2f}x" for ratio in r["wall_vs_off_rounds"])
            for mode, r in result["modes"].items()
            if mode != "off"
        )
        lines.append(f"wall vs off, round by round: {spreads}")
    if any(r.get("window_steps") for r in result["modes"].values()):
        lines.append(
            f"steady state (end of step {result.get('warmup_steps', 0)} to the last step; its saves, not the last):"
        )
        for mode, r in result["modes"].items():
            vs_off = f"{r['window_vs_off']:.3f}x" if "window_vs_off" in r else "-"
            lines.append(
                f"  {mode:<12} {r['window_s']:>7.2f}s over {r['window_steps']:g} steps, vs off {vs_off:>7}, "
                f"{r['window_saves']:g} saves blocked {r['window_blocked_s']:.3f}s, "
                f"efficiency {r['window_efficiency_pct']:.1f}%"
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated modes to compare (default: %(default)s)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="training ranks (default: %(default)s: on a 2-core machine a second rank leaves no core for the background writer)",
    )
    parser.add_argument(
        "--steps", type=int, default=32, help="training steps per mode (default: %(default)s)"
    )
    parser.add_argument(
        "--every", type=int, default=4, help="checkpoint interval in steps (default: %(default)s)"
    )
    parser.add_argument("--preset", default="bench-cpu", help="model preset (default: %(default)s)")
    parser.add_argument(
        "--local-every",
        type=int,
        default=None,
        help="fast checkpoint tier interval in steps for every mode but off, 0 = none (default: the trainer's)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every mode, e.g. resilience.soft_timeout_s=300 (repeatable)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the modes this many times in turn and report medians (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        help="time the steady state from the end of this step (window_s, window_vs_off; default: "
        "%(default)s, from the first step's end)",
    )
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON to this file")


def main(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if not 0 <= args.warmup_steps < args.steps:
        raise ValueError(
            f"--warmup-steps must be at least 0 and below --steps ({args.steps}), got {args.warmup_steps}"
        )
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"unknown checkpoint mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    result = run_benchmark(
        modes=modes,
        nproc=args.nproc,
        steps=args.steps,
        every=args.every,
        preset=args.preset,
        local_every=args.local_every,
        overrides=args.override,
        rounds=args.rounds,
        warmup_steps=args.warmup_steps,
    )
    return report(result, args.json_path, format_table)
