"""Peak memory of the register step's Hugging Face export at two model sizes, old way and new, side by side.

For two Llama models of the same width and vocabulary but different depth (about 20M and
120M parameters by default), whose config.json declares bf16 as Llama-3's does, a one-rank
DCP checkpoint is written as the trainer writes it. Then each export runs in a fresh
subprocess whose peak RSS (ru_maxrss) is reported:

- old: the checkpoint loaded into a whole fp32 model, `save_pretrained` into one fp32
  model.safetensors, loaded back with from_pretrained (what register did before);
- new: the checkpoint's hashes verified, the streamed export (bf16, safetensors files of at
  most `max_shard_size`) and its checks, as `register_checkpoint` runs them.

MLflow's part (copying the folder and uploading it) is left out of both: it holds files,
not the model. The growth of each path's peak between the two sizes is divided by the growth
of the fp32 weights' bytes. Peak RSS is each subprocess's VmHWM. Prints a table, then the JSON.

    python -m benchmarks.scale_register [--layers 4 35] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.\n"] * 20


def write_model_folder(folder: Path, layers: int, hidden: int, intermediate: int, vocab: int) -> Path:
    """config.json (bf16, untied) + tokenizer files of a Llama; no weights (model.init=random)."""
    from transformers import AutoConfig

    from rtp_support.tiny_models import train_bpe_tokenizer

    train_bpe_tokenizer(folder, TEXTS, 300)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(str(folder))
    raw = json.loads((folder / "config.json").read_text())
    raw["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


def write_checkpoint(root: Path, model_dir: Path) -> tuple[Path, int]:
    """A committed one-rank DCP checkpoint of the model with random weights; its parameter count."""
    import torch
    import torch.distributed as dist

    from benchmarks.make_checkpoint import save_checkpoint
    from trainer.config import resolve_config
    from trainer.models import model_spec

    config = resolve_config(
        named={"model_dir": str(model_dir), "model_init": "random"}, overrides=["model.seq_len=16"]
    )
    torch.manual_seed(0)
    model = model_spec("hf").build(config.model, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        save_checkpoint(root, 1, model, optimizer, meta={"config": config.to_dict()}, rank_extra={})
    finally:
        dist.destroy_process_group()
    return root / "step_1", sum(p.numel() for p in model.parameters())


def _old_export(checkpoint: Path, out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.checkpointing.storage import load_model_weights, read_meta, verify_checkpoint
    from trainer.config import TrainConfig
    from trainer.models import model_spec

    verify_checkpoint(checkpoint, verify_hashes=True)
    config = TrainConfig.from_dict(read_meta(checkpoint)["config"])
    spec = model_spec("hf")
    model = spec.build(config.model, torch.device("cpu"))
    load_model_weights(checkpoint, model)
    assert all(bool(torch.isfinite(t).all()) for t in model.state_dict().values())
    folder = spec.export(model.state_dict(), config.model, out)
    AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    return {"dtype": "float32", "files": len(list(folder.glob("*.safetensors")))}


def _new_export(checkpoint: Path, out: Path, max_shard_size: str) -> dict[str, Any]:
    import torch

    from components.register_model import streamed_export
    from trainer.checkpointing.storage import manifest_sha256, read_meta, verify_checkpoint
    from trainer.config import TrainConfig

    verify_checkpoint(checkpoint, verify_hashes=True)
    config = TrainConfig.from_dict(read_meta(checkpoint)["config"])
    result = streamed_export.export_checkpoint(
        checkpoint, config.model, manifest_sha256(checkpoint), out, max_shard_size=max_shard_size
    )
    loaded_back = result.parameters <= streamed_export.LOAD_CHECK_MAX_PARAMETERS
    if loaded_back:
        streamed_export.check_export_loads(out, checkpoint, config.model, getattr(torch, result.dtype))
    return {"dtype": result.dtype, "files": len(result.files), "loaded_back": loaded_back}


def peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM belongs to its own address space (ru_maxrss would
    carry over the parent's peak, which survives fork and exec on Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: KiB there too


def _child(mode: str, checkpoint: str, out: str, max_shard_size: str) -> None:
    started = time.perf_counter()
    if mode == "old":
        facts = _old_export(Path(checkpoint), Path(out))
    else:
        facts = _new_export(Path(checkpoint), Path(out), max_shard_size)
    facts["seconds"] = round(time.perf_counter() - started, 2)
    facts["peak_rss_bytes"] = peak_rss_bytes()
    print(json.dumps(facts))


def _measure(mode: str, checkpoint: Path, out: Path, max_shard_size: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.scale_register", "--child", mode, str(checkpoint), str(out)]
    done = subprocess.run(
        [*command, "--max-shard-size", max_shard_size],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} export of {checkpoint} failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def run(
    workdir: Path,
    layers: tuple[int, int] = (4, 35),
    hidden: int = 512,
    intermediate: int = 1408,
    vocab: int = 8192,
    max_shard_size: str = "5GB",
) -> dict[str, Any]:
    sizes: list[dict[str, Any]] = []
    for depth in layers:
        root = workdir / f"layers-{depth}"
        model_dir = write_model_folder(root / "model", depth, hidden, intermediate, vocab)
        checkpoint, parameters = write_checkpoint(root / "checkpoints", model_dir)
        sizes.append(
            {
                "layers": depth,
                "parameters": parameters,
                "fp32_bytes": parameters * 4,
                "old": _measure("old", checkpoint, root / "export-old", max_shard_size),
                "new": _measure("new", checkpoint, root / "export-new", max_shard_size),
            }
        )
    small, large = sizes
    fp32_growth = large["fp32_bytes"] - small["fp32_bytes"]
    growth = {
        mode: round((large[mode]["peak_rss_bytes"] - small[mode]["peak_rss_bytes"]) / fp32_growth, 3)
        for mode in ("old", "new")
    }
    return {"sizes": sizes, "growth_per_fp32_byte": growth, "max_shard_size": max_shard_size, "target": 0.25}


def table(report: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        "| parameters | fp32 MiB | old peak RSS MiB | old s | new peak RSS MiB | new s | new dtype | new files |",
        "|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for size in report["sizes"]:
        old, new = size["old"], size["new"]
        lines.append(
            f"| {size['parameters']:,} | {size['fp32_bytes'] / mib:,.0f} | {old['peak_rss_bytes'] / mib:,.0f} | "
            f"{old['seconds']} | {new['peak_rss_bytes'] / mib:,.0f} | {new['seconds']} | {new['dtype']} | {new['files']} |"
        )
    growth = report["growth_per_fp32_byte"]
    lines.append(
        f"\npeak RSS growth per fp32 byte of growth: old {growth['old']}x, new {growth['new']}x "
        f"(target at most {report['target']}x)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=2, default=(4, 35), help="depths of the two models")
    parser.add_argument("--max-shard-size", default="5GB", help="the new export's file size limit")
    parser.add_argument(
        "--workdir", default="", help="where models and checkpoints go (default: a temp folder)"
    )
    parser.add_argument("--child", nargs=3, metavar=("MODE", "CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, checkpoint, out = args.child
        _child(mode, checkpoint, out, args.max_shard_size)
        return 0
    with tempfile.TemporaryDirectory(prefix="rtp-scale-register-") as tmp:
        report = run(Path(args.workdir or tmp), tuple(args.layers), max_shard_size=args.max_shard_size)
    print(table(report))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
