"""`rtp plan`: will a training job fit its GPUs? Per-rank peak memory, proven on CPU.

Calls `trainer.memory_plan.plan_memory`, which traces rtp's own model build, sharding and
training step on fake tensors (no GPU, nothing allocated), and prints the peak by category,
whether it fits with the stated margin and, when it does not, the cheapest change that does.
"""

from __future__ import annotations

import argparse
import json

from rtp_cli.errors import UserError

DESCRIPTION = """\
Trace one training step (forward, loss, backward, gradient clipping, AdamW) and one evaluation
forward of rank 0 of the job, with rtp's own model build, FSDP2/HSDP sharding and loop code,
under torch's FSDPMemTracker on fake tensors with a fake process group: one CPU process, no GPU,
nothing allocated (Llama-3.1-8B on 8 ranks: about 20 s). Prints the per-GPU peak in GiB by
category (parameters, gradients, optimizer state, activations, temporaries, evaluation) and the
host memory the fast checkpoint tier's slots take, then whether it fits the GPU less a margin
(2 GiB for the CUDA context and NCCL buffers + 10% of the GPU for allocator fragmentation and
kernel workspace, which the trace cannot see). When it does not fit, the plan is re-run with
activation checkpointing, a smaller micro-batch, fewer HSDP replica groups and more nodes, in
that order, and the first change that fits is named.

Exit status: 0 when the job fits, 1 when it does not, 2 for bad input."""

EPILOG = """\
examples:
  rtp plan --model-config benchmarks/model_configs/llama-3.1-8b.json --seq-len 8192
  rtp plan --model-config benchmarks/model_configs/llama-3.1-70b.json --nnodes 4 --dp-replicate 2 --json
  rtp plan --preset gpu-1b --gpus-per-node 1 --gpu-memory-gib 140.4"""


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from trainer.config import PRESETS
    from trainer.memory_plan import H100_GPU_GIB

    p = sub.add_parser(
        "plan",
        help="will a training job fit its GPUs? per-rank peak memory by category, traced on CPU",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--model-config",
        metavar="CONFIG",
        help="a Hugging Face config.json (or a model folder holding one), or a byte LM config.json",
    )
    model.add_argument("--preset", choices=list(PRESETS), help="a built-in byte LM preset, e.g. gpu-1b")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (default: %(default)s)")
    p.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node (default: %(default)s)"
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=H100_GPU_GIB,
        help="one GPU's memory as CUDA reports it, GiB (default: %(default)s, an 80 GB H100; H200: 140.4)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence (default: 4096 with --model-config, else the preset's)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="sequences per rank per forward, the micro-batch (default: 1 with --model-config, else the preset's)",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        help="sequences per optimizer step over all ranks, a multiple of batch size x ranks "
        "(default: batch size x ranks, no accumulation)",
    )
    p.add_argument(
        "--activation-checkpointing",
        choices=("none", "full", "auto"),
        default="none",
        help="recompute each decoder layer's activations in backward; auto: only when the job does not "
        "fit without (default: %(default)s)",
    )
    p.add_argument(
        "--dp-replicate",
        type=int,
        help="HSDP replica groups (1: FSDP over every rank; default: rtp's auto rule, one per node when "
        "a node's share of the state fits half a GPU)",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other training config setting, e.g. data.eval_windows=16 or checkpoint.local_replicas=1 (repeatable)",
    )
    p.add_argument(
        "--no-fix", action="store_true", help="do not look for a change that fits (one trace only)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(handler=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    import contextlib

    from trainer.config import resolve_config
    from trainer.memory_plan import Job, model_settings, plan_memory

    for flag in ("nnodes", "gpus_per_node", "seq_len", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.gpu_memory_gib <= 0:
        raise UserError(f"--gpu-memory-gib must be positive, got {args.gpu_memory_gib}")
    with contextlib.ExitStack() as stack:
        named: dict[str, str] = {}
        overrides: list[str] = []
        if args.model_config:
            named, overrides = stack.enter_context(model_settings(args.model_config))
            overrides += [f"model.seq_len={args.seq_len or 4096}", f"data.batch_size={args.batch_size or 1}"]
        else:
            overrides += [f"model.seq_len={args.seq_len}"] if args.seq_len else []
            overrides += [f"data.batch_size={args.batch_size}"] if args.batch_size else []
        if args.global_batch is not None:
            overrides.append(f"data.global_batch={args.global_batch}")
        if args.dp_replicate is not None:
            overrides.append(f"parallelism.dp_replicate={args.dp_replicate}")
        if args.activation_checkpointing != "auto":  # auto is the plan's to decide
            overrides.append(f"training.activation_checkpointing={args.activation_checkpointing}")
        config = resolve_config(
            preset=args.preset or "tiny-cpu", named=named, overrides=[*overrides, *args.override]
        )
        if args.activation_checkpointing == "auto":
            config.training.activation_checkpointing = "auto"  # type: ignore[assignment]
        job = Job(
            config=config,
            nnodes=args.nnodes,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_gib=args.gpu_memory_gib,
        )
        plan = plan_memory(job, find_fix=not args.no_fix)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(render(plan.to_dict()))
    return 0 if plan.fits else 1


CATEGORY_NAMES = {
    "parameters": "parameters (sharded + gathered)",
    "gradients": "gradients",
    "optimizer_state": "optimizer state (AdamW)",
    "activations": "activations",
    "temporaries": "temporaries (incl. comm buffers)",
}


def render(plan: dict) -> str:
    """The plan as a short table and a verdict line."""
    job, by = plan["job"], plan["by_category"]
    mesh = "x".join(map(str, job["mesh"]))
    layout = f"HSDP {mesh} (replicate x shard)" if len(job["mesh"]) == 2 else f"FSDP over {mesh}"
    lines = [
        f"rtp plan: {job['model']} model, {job['parameters'] / 1e9:.2f}B parameters, "
        f"{job['nnodes']} node(s) x {job['gpus_per_node']} GPU(s), {layout}",
        f"  seq {job['seq_len']}, micro-batch {job['batch_size']} x {job['micro_batches']} per step "
        f"(global batch {job['global_batch']}), activation checkpointing {job['activation_checkpointing']}, "
        f"{job['mixed_precision']} compute",
        "",
        "per-GPU peak of the training step, GiB",
    ]
    lines += [f"  {label:<36} {by[key]:8.2f}" for key, label in CATEGORY_NAMES.items()]
    phases = plan["phases_gib"]
    lines += [
        f"  {'training step':<36} {phases['train_step']:8.2f}",
        f"  {'evaluation forward (' + str(job['eval_rows']) + ' rows)':<36} {phases['evaluation']:8.2f}"
        f"   (+{by['evaluation']:.2f} above the resident state)",
        f"  {'peak':<36} {plan['peak_gib']:8.2f}",
        f"host memory (fast-tier slots): {plan['host']['per_rank_gib']:.2f} GiB per rank "
        f"({plan['host']['slots']} x {plan['host']['capture_gib']:.2f}), {plan['host']['per_node_gib']:.2f} per node",
        "",
    ]
    usable = (
        f"{plan['peak_gib']:.1f} GiB of {plan['usable_gib']:.1f} usable ({plan['gpu_memory_gib']:g} GiB GPU "
        f"less {plan['margin_gib']:.1f}: 2 GiB CUDA context and NCCL buffers + 10% fragmentation and workspace)"
    )
    if plan["fits"]:
        lines.append(f"fits: {usable}")
    elif plan["fix"]:
        fix = plan["fix"]
        settings = " ".join(f"{key}={value}" for key, value in fix["changes"].items())
        lines.append(f"does not fit: {usable}")
        lines.append(
            f"cheapest change that fits: {fix['description']} -> {fix['peak_gib']:.1f} GiB ({settings})"
        )
    else:
        tried = "; ".join(plan["tried"]) or "none (--no-fix)"
        lines.append(f"does not fit: {usable}")
        lines.append(
            f"no change tried fits (tried: {tried}): a smaller model, a shorter sequence or larger GPUs"
        )
    lines.append(f"(traced in {plan['elapsed_s']:.0f} s)")
    return "\n".join(lines)
