"""`rtp bench recovery`: faults recovered by each mechanism, side by side, with default settings.

One fault-free run, then the same run with injected faults on rank 1 (rank 0 with one
rank) at fixed steps, once per mechanism:

- `inprocess`: an `exception`, NVRx in-process restart (the processes stay);
- `hang`: a `hang` (the rank stops making progress), caught by the in-process watchdog
  after `resilience.soft_timeout_s`, then an in-process restart;
- `sigkill`: the rank is killed; ft_launcher restarts the worker group, whose ranks are
  forked from the node's pre-imported process (the rtp_prefork launcher plugin);
- `sigkill-fresh`: the same with `resilience.prefork_workers=false`: every restarted rank
  is a new interpreter that imports torch and the trainer again;
- `launcher`: an `exception` with in-process restart off, so ft_launcher restarts the group;
- `cold`: an `exception` with both off: the launcher exits with the failure and the
  benchmark starts a new launcher for the same run — what a pod restart does, minus
  scheduling the pod.

Per mechanism, from the run's own restart records (trainer/goodput.py): fault→resumed
seconds (median over the faults), split into shutdown (fault → new attempt started) and
startup (→ its first step), the steps redone, and `exact`: the final `model_sha256` equals
the fault-free run's. That is the verdict where bit-identical weights are what the setup
guarantees: on CPU, and on CUDA with `training.deterministic` (`--deterministic`). On CUDA
without it kernels and NCCL may sum in another order on every run, so `exact` is null
(neither verdict) and the result says how far the final weights are from the fault-free
run's (`weights_rel_diff`: relative L2 difference; `weights_max_abs_diff`) beside what a
second fault-free run differs by (`noise_rel_diff`); `within_noise`: at most ten times
that (NOISE_FACTOR). Every setting is the default (the fast checkpoint tier every step, the 15 s
collective timeout, which fast peer abort makes a safety net only), unless
`--collective-timeout`, `--local-every` or `--deterministic` say otherwise.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import rtp_prefork
from benchmarks import report
from trainer.config import ModelConfig, TrainConfig, build_config
from trainer.launch import LauncherSettings, TrainingFailed, run_local_training

MECHANISMS = ("inprocess", "hang", "sigkill", "sigkill-fresh", "launcher", "cold")
FAULT_KIND = {
    "inprocess": "exception",
    "hang": "hang",
    "sigkill": "sigkill",
    "sigkill-fresh": "sigkill",
    "launcher": "exception",
    "cold": "exception",
}


NOISE_FACTOR = 10.0
"""Without deterministic kernels a recovered run counts as within noise when its final weights
are at most this many times further from the fault-free run's than a second fault-free run's
are: both diverge from step 1 on, so a correct recovery differs by the same order."""


def weight_difference(checkpoint: str | Path, reference: str | Path, model: ModelConfig) -> dict[str, float]:
    """How far the weights of one checkpoint are from another's (both loaded on the CPU):
    the largest element-wise difference and the L2 norm of the difference over the reference's."""
    import torch

    from trainer.checkpointing import load_model_weights
    from trainer.models import model_spec

    spec = model_spec(model.kind)
    weights = []
    for folder in (checkpoint, reference):
        module = spec.build(model, torch.device("cpu"))
        load_model_weights(folder, module)
        weights.append(module.state_dict())
    max_abs, diff_sq, ref_sq = 0.0, 0.0, 0.0
    for name, ref in weights[1].items():
        delta = weights[0][name].double() - ref.double()
        max_abs = max(max_abs, float(delta.abs().max())) if delta.numel() else max_abs
        diff_sq += float(delta.square().sum())
        ref_sq += float(ref.double().square().sum())
    return {
        "weights_max_abs_diff": max_abs,
        "weights_rel_diff": math.sqrt(diff_sq / ref_sq) if ref_sq else 0.0,
    }


def bitwise_expected(device: str, deterministic: bool) -> bool:
    """Whether equal seeds and steps must give bit-identical weights: fp32 on CPU, or CUDA with
    training.deterministic."""
    return device != "cuda" or deterministic


def exactness(
    *,
    device: str,
    deterministic: bool,
    model_sha256: str,
    baseline_sha256: str,
    difference: Callable[[], dict[str, float]],
    noise_rel_diff: float | None = None,
) -> dict[str, Any]:
    """What a recovered run's final weights say against the fault-free run's. `exact` is the
    hash comparison where bit-identity is guaranteed (`bitwise_expected`), else None: then
    `within_noise` compares the difference with a second fault-free run's (`noise_rel_diff`).
    `difference` loads the weights; called only when the hashes differ."""
    equal = model_sha256 == baseline_sha256
    diff = {"weights_max_abs_diff": 0.0, "weights_rel_diff": 0.0} if equal else difference()
    if bitwise_expected(device, deterministic):
        return {"exact": equal, **diff}
    within = None if noise_rel_diff is None else diff["weights_rel_diff"] <= NOISE_FACTOR * noise_rel_diff
    return {"exact": None, **diff, "within_noise": within}


def _config(
    dataset: Path, workdir: Path, steps: int, every: int, faults: list[str], extra: list[str]
) -> TrainConfig:
    return build_config(
        "tiny-cpu",
        [
            f"data.dataset_dir={dataset}",
            f"run.workdir={workdir}",
            f"run.steps={steps}",
            f"checkpoint.every_steps={every}",
            "run.seed=3",
            f"run.faults={','.join(faults)}",
            "run.log_every_steps=1000",
            *extra,
        ],
    )


def run_mechanism(
    mechanism: str,
    dataset: Path,
    workdir: Path,
    *,
    nproc: int,
    steps: int,
    every: int,
    fault_steps: list[int],
    extra: list[str],
) -> dict[str, Any]:
    faults = [f"{FAULT_KIND[mechanism]}@{step}:{min(1, nproc - 1)}" for step in fault_steps]
    timeouts = list(extra)
    if mechanism in ("inprocess", "hang", "sigkill", "sigkill-fresh"):
        fresh = ["resilience.prefork_workers=false"] if mechanism == "sigkill-fresh" else []
        config = _config(dataset, workdir, steps, every, faults, [*timeouts, *fresh])
        summary = run_local_training(
            nproc,
            config,
            echo=False,
            settings=rtp_prefork.launcher_settings(config, LauncherSettings(max_restarts=3)),
        )
    elif mechanism == "launcher":
        config = _config(
            dataset, workdir, steps, every, faults, [*timeouts, "resilience.inprocess_restarts=0"]
        )
        summary = run_local_training(
            nproc,
            config,
            echo=False,
            settings=rtp_prefork.launcher_settings(config, LauncherSettings(max_restarts=3)),
        )
    else:
        config = _config(
            dataset, workdir, steps, every, faults, [*timeouts, "resilience.inprocess_restarts=0"]
        )
        no_restarts = LauncherSettings(max_restarts=0)
        for launch in range(len(faults) + 1):
            try:
                summary = run_local_training(
                    nproc,
                    config,
                    echo=False,
                    settings=rtp_prefork.launcher_settings(config, no_restarts),
                    new_run=launch == 0,
                )
                break
            except TrainingFailed:
                continue  # the "pod" died: start a new launcher for the same run
        else:
            raise TrainingFailed(f"cold restarts did not finish the run; see {workdir}/logs/train.log")
    restarts = [r for r in summary.restarts if r["downtime_s"] is not None]

    def median(key: str) -> float | None:
        values = [r[key] for r in restarts if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "fault_to_resumed_s_median": median("downtime_s"),
        "shutdown_s_median": median("shutdown_s"),
        "startup_s_median": median("startup_s"),
        "faults": len(restarts),
        "preforked": sum(1 for r in restarts if r.get("preforked")),
        "mechanisms_seen": sorted({r["mechanism"] for r in summary.restarts}),
        "steps_redone": summary.lost_steps,
        "goodput_pct": summary.goodput_pct,
        "model_sha256": summary.model_sha256,
        "checkpoint": summary.checkpoint,
    }


def run_benchmark(
    *,
    mechanisms: list[str],
    nproc: int,
    steps: int,
    every: int,
    fault_steps: list[int],
    collective_timeout_s: float | None = None,
    local_every: int | None = None,
    deterministic: bool = False,
    workdir: Path | None = None,
) -> dict[str, Any]:
    from rtp_support.demo_data import write_local_dataset
    from trainer.config import TrainConfig

    extra = []
    if collective_timeout_s is not None:
        extra.append(f"resilience.collective_timeout_s={collective_timeout_s:g}")
    if local_every is not None:
        extra.append(f"checkpoint.local_every_steps={local_every}")
    common = ["training.deterministic=true"] if deterministic else []  # the fault-free run's too
    extra += common
    defaults = TrainConfig()
    with tempfile.TemporaryDirectory(prefix="rtp-bench-recovery-") as tmp:
        root = workdir or Path(tmp)
        dataset = write_local_dataset(root / "dataset", budget_bytes=300_000)
        baseline_config = _config(dataset, root / "fault-free", steps, every, [], common)
        baseline = run_local_training(nproc, baseline_config, echo=False)
        model = baseline_config.model

        def difference_from_baseline(checkpoint: str | None) -> Callable[[], dict[str, float]]:
            return lambda: weight_difference(str(checkpoint), str(baseline.checkpoint), model)

        noise_rel_diff = None
        if not bitwise_expected(baseline.device, deterministic):
            rerun_config = _config(dataset, root / "fault-free-rerun", steps, every, [], common)
            rerun = run_local_training(nproc, rerun_config, echo=False)
            same = rerun.model_sha256 == baseline.model_sha256
            noise_rel_diff = 0.0 if same else difference_from_baseline(rerun.checkpoint)()["weights_rel_diff"]
        results: dict[str, Any] = {}
        for mechanism in mechanisms:
            result = run_mechanism(
                mechanism,
                dataset,
                root / mechanism,
                nproc=nproc,
                steps=steps,
                every=every,
                fault_steps=fault_steps,
                extra=extra,
            )
            checkpoint = result.pop("checkpoint")
            result.update(
                exactness(
                    device=baseline.device,
                    deterministic=deterministic,
                    model_sha256=result.pop("model_sha256"),
                    baseline_sha256=baseline.model_sha256,
                    difference=difference_from_baseline(checkpoint),
                    noise_rel_diff=noise_rel_diff,
                )
            )
            results[mechanism] = result
    return {
        **results,
        "settings": {
            "nproc": nproc,
            "steps": steps,
            "checkpoint.every_steps": every,
            "fault_steps": fault_steps,
            "fault_rank": min(1, nproc - 1),
            "collective_timeout_s": collective_timeout_s or defaults.resilience.collective_timeout_s,
            "soft_timeout_s": defaults.resilience.soft_timeout_s,
            "local_every_steps": defaults.checkpoint.local_every_steps
            if local_every is None
            else local_every,
            "fault_free_model_sha256": baseline.model_sha256,
            "device": baseline.device,
            "deterministic": deterministic,
            "bitwise_expected": bitwise_expected(baseline.device, deterministic),
            "noise_rel_diff": noise_rel_diff,
        },
    }


def exact_cell(r: dict[str, Any]) -> str:
    """The table's `exact`: True/False, or, where bit-identity is not guaranteed, `~` and the
    relative weight difference, `!` instead of `~` when it is beyond the noise."""
    if r["exact"] is not None:
        return str(r["exact"])
    return f"{'!' if r.get('within_noise') is False else '~'}{r['weights_rel_diff']:.1e}"


def format_table(result: dict[str, Any]) -> str:
    s = result["settings"]
    where = (
        ","
        if s.get("device", "cpu") != "cuda"
        else f" on CUDA, training.deterministic {'on' if s['deterministic'] else 'off'},"
    )
    lines = [
        f"{s['nproc']} ranks{where} {s['steps']} steps, checkpoint every {s['checkpoint.every_steps']}, fast tier every "
        f"{s['local_every_steps']}, faults at steps {', '.join(map(str, s['fault_steps']))} on rank {s['fault_rank']}, "
        f"collective timeout {s['collective_timeout_s']:g}s, soft timeout {s['soft_timeout_s']}{'' if s['soft_timeout_s'] == 'auto' else 's'}",
        f"{'mechanism':<13} {'fault->resumed':>14} {'shutdown':>9} {'startup':>8} {'faults':>6} {'forked':>6} "
        f"{'redone':>6} {'exact':>8}",
    ]
    for name in MECHANISMS:
        if name not in result:
            continue
        r = result[name]
        cell = lambda v: f"{v:.2f}s" if v is not None else "-"  # noqa: E731
        lines.append(
            f"{name:<13} {cell(r['fault_to_resumed_s_median']):>14} {cell(r['shutdown_s_median']):>9} "
            f"{cell(r['startup_s_median']):>8} {r['faults']:>6} {r.get('preforked', 0):>6} {r['steps_redone']:>6} "
            f"{exact_cell(r):>8}"
        )
    if not s.get("bitwise_expected", True):
        noise = s.get("noise_rel_diff")
        lines.append(
            "exact: not claimed on CUDA without training.deterministic (kernels and NCCL may sum in another "
            "order each run); ~x: relative L2 difference of the final weights from the fault-free run's; "
            f"a second fault-free run differs by {noise:.1e}; '!': more than {NOISE_FACTOR:g}x that"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mechanisms", default=",".join(MECHANISMS), help="comma-separated (default: %(default)s)"
    )
    parser.add_argument("--nproc", type=int, default=2, help="training ranks (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default: %(default)s)")
    parser.add_argument(
        "--every", type=int, default=4, help="checkpoint interval in steps (default: %(default)s)"
    )
    parser.add_argument(
        "--fault-steps", default="9,17,25", help="steps at which rank 1 faults (default: %(default)s)"
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        help="collective timeout in seconds (default: the trainer's, resilience.collective_timeout_s)",
    )
    parser.add_argument(
        "--local-every",
        type=int,
        default=None,
        help="fast checkpoint tier interval in steps, 0 = off (default: the trainer's, checkpoint.local_every_steps)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="train every run with training.deterministic=true: on CUDA, deterministic kernels and NCCL, "
        "so `exact` compares hashes there too (without it on CUDA: exact is null and the weight "
        "difference is reported against a second fault-free run's); CPU runs are deterministic either way",
    )
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON to this file")


def main(args: argparse.Namespace) -> int:
    mechanisms = [m.strip() for m in args.mechanisms.split(",") if m.strip()]
    unknown = sorted(set(mechanisms) - set(MECHANISMS))
    if unknown:
        raise ValueError(f"unknown mechanism(s) {', '.join(unknown)}; choose from {', '.join(MECHANISMS)}")
    if args.nproc < 1:
        raise ValueError("--nproc must be at least 1")
    fault_steps = [int(v) for v in args.fault_steps.split(",") if v.strip()]
    result = run_benchmark(
        mechanisms=mechanisms,
        nproc=args.nproc,
        steps=args.steps,
        every=args.every,
        fault_steps=fault_steps,
        collective_timeout_s=args.collective_timeout,
        local_every=args.local_every,
        deterministic=args.deterministic,
    )
    return report(result, args.json_path, format_table)
