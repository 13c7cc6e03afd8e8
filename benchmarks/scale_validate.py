"""Peak memory of `rtp validate` at two model sizes: deciding from the training's eval record vs
consolidating the model in one process.

One invocation writes, into a temporary folder, a Llama config (transformers) at two sizes
(default ~20M and ~120M parameters) with a BPE tokenizer trained on a small corpus, the corpus
tokenized into a staged snapshot, and for each size a committed one-rank DCP checkpoint of the
randomly initialised model plus the eval record the training ranks write after the last step
(`trainer.evaluation.write_eval_record`, in `<workdir>/eval.json`). Then, for each size, two
fresh processes run `rtp validate` on the checkpoint: `record` (the default: tensors streamed
from the shards for integrity and finiteness, the score read from the record) and `in-process`
(the record not used, `validate_checkpoint(eval_record="")`: the model consolidated and scored
in one process, as before the record existed). Each reports its peak RSS (VmHWM) and wall time;
the growth of the peak between the sizes is divided by the growth of the fp32 model bytes.
Target: record's ratio <= 0.25. Run it as `python -m benchmarks.scale_validate`; it prints a
table and `--json PATH` writes the results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 2**20
RATIO_TARGET = 0.25
SIZES = {  # (hidden, layers, intermediate, heads): ~20M and ~120M parameters with an 8192 vocabulary
    "small": (512, 4, 1536, 8),
    "large": (768, 15, 2048, 12),
}
VOCAB = 8192
SEQ_LEN = 64

CHILD = """
import json, sys, time
start = time.perf_counter()
mode, checkpoint, dataset = sys.argv[1:4]
from components.validate_checkpoint.validate import validate_checkpoint
# `record`: what `rtp validate` calls (the training's eval record found); else scored here.
result = validate_checkpoint(checkpoint, dataset, 100.0, eval_record=None if mode == "record" else "")
code = 0 if result.decision != "reject" else 1
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"peak_rss_mib": hwm / 1024, "wall_s": time.perf_counter() - start, "rc": code,
                  "scored_by": result.scored_by}))
"""


def _corpus(folder: Path) -> list[str]:
    texts = [
        f"document {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 13}.\n" for i in range(400)
    ]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(texts), 20):
        (folder / f"part-{i:04d}.txt").write_text("".join(texts[i : i + 20]))
    return texts


def build_inputs(root: Path) -> dict[str, Any]:
    """The tokenizer, snapshot and, per size, a checkpoint with its eval record."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from benchmarks.make_checkpoint import save_checkpoint
    from rtp_support.demo_data import write_local_manifest
    from rtp_support.tiny_models import train_bpe_tokenizer
    from trainer.checkpointing import model_sha256
    from trainer.config import resolve_config
    from trainer.evaluation import write_eval_record
    from trainer.models import model_spec
    from trainer.tokenized_data import write_token_shards

    texts = _corpus(root / "corpus")
    tokenizer_dir = root / "tokenizer"
    train_bpe_tokenizer(tokenizer_dir, texts, 300)
    snapshot = root / "snapshot"
    write_token_shards(root / "corpus", snapshot / "files", tokenizer_dir, shard_bytes=4096, workers=1)
    write_local_manifest(snapshot, key_prefix="tokens/", snapshot_id="scale-validate")
    out: dict[str, Any] = {"snapshot": str(snapshot), "sizes": {}}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name, (hidden, layers, intermediate, heads) in SIZES.items():
            model_dir = root / f"model-{name}"
            model_dir.mkdir()
            for item in tokenizer_dir.iterdir():
                (model_dir / item.name).write_bytes(item.read_bytes())
            AutoConfig.for_model(
                "llama",
                vocab_size=VOCAB,
                hidden_size=hidden,
                intermediate_size=intermediate,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=heads,
                max_position_embeddings=SEQ_LEN * 2,
            ).save_pretrained(str(model_dir))
            workdir = root / f"run-{name}"
            config = resolve_config(
                named={
                    "model_dir": str(model_dir),
                    "model_init": "random",
                    "dataset_dir": str(snapshot),
                    "workdir": str(workdir),
                },
                overrides=[f"model.seq_len={SEQ_LEN}"],
            )
            spec = model_spec(config.model.kind)
            torch.manual_seed(0)
            model = spec.build(config.model, torch.device("cpu"))
            optimizer = torch.optim.AdamW(model.parameters())
            save_checkpoint(
                Path(config.checkpoint_dir()),
                1,
                model,
                optimizer,
                meta={"config": config.to_dict()},
                rank_extra={},
            )
            write_eval_record(model, config, model_sha256(model), 1, rank=0, device=torch.device("cpu"))
            params = sum(p.numel() for p in model.parameters())
            out["sizes"][name] = {
                "checkpoint": str(Path(config.checkpoint_dir()) / "step_1"),
                "parameters": params,
                "fp32_mib": params * 4 / MIB,
            }
            del model, optimizer
    finally:
        dist.destroy_process_group()
    return out


def measure(mode: str, checkpoint: str, snapshot: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, checkpoint, snapshot], capture_output=True, text=True, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} validate of {checkpoint} failed: {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rtp-scale-validate-") as tmp:
        inputs = build_inputs(Path(tmp))
        rows = []
        for name, size in inputs["sizes"].items():
            for mode in ("in-process", "record"):
                rows.append(
                    {
                        "size": name,
                        "mode": mode,
                        **size,
                        **measure(mode, size["checkpoint"], inputs["snapshot"]),
                    }
                )
    small, large = inputs["sizes"]["small"], inputs["sizes"]["large"]
    growth = large["fp32_mib"] - small["fp32_mib"]
    ratios = {}
    for mode in ("in-process", "record"):
        peak = {r["size"]: r["peak_rss_mib"] for r in rows if r["mode"] == mode}
        ratios[mode] = (peak["large"] - peak["small"]) / growth
    for row in rows:
        row.pop("checkpoint")
    return {
        "rows": rows,
        "fp32_growth_mib": growth,
        "peak_growth_per_fp32_byte": ratios,
        "target": RATIO_TARGET,
        "meets_target": ratios["record"] <= RATIO_TARGET,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| size | params | fp32 MiB | mode | peak RSS MiB | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['size']} | {r['parameters'] / 1e6:.1f}M | {r['fp32_mib']:.0f} | {r['mode']} | "
            f"{r['peak_rss_mib']:.0f} | {r['wall_s']:.1f} |"
        )
    ratios = result["peak_growth_per_fp32_byte"]
    lines.append("")
    lines.append(
        f"peak RSS growth per fp32 byte of growth ({result['fp32_growth_mib']:.0f} MiB): "
        f"in-process {ratios['in-process']:.2f}x, record {ratios['record']:.2f}x (target <= {RATIO_TARGET})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="", help="also write the results to this file")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = run()
    result["bench_wall_s"] = time.perf_counter() - started
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
