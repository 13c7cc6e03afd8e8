"""Per-rank data memory and start-up at two dataset sizes: memory-mapped streams vs whole-file loading.

One invocation writes uint16 token shards in the v2 layout of `rtp prepare-data --tokenizer`
(random ids, `index.json`, and the stage step's `manifest.json`) into a temporary folder at
two sizes (default 64 MiB and 1 GiB), then, for each size and each implementation, starts a
fresh process that does what a training rank does with its data — `split_files`, build the
`StepSampler`, draw `--batches` batches — and reports its peak RSS (VmHWM), its RSS before
touching the data, the start-up seconds (split + sampler build) and a digest of the batches.
The implementations are `trainer.data` (the mapped `TokenStream`) and `legacy`, a copy of the
loader this one replaced (every file read into memory and cast to int32), kept below as the
reference the tests compare batches with. Targets: the new loader's peak RSS at the large size
within 64 MiB of that at the small size, and its start-up within 1 s; the batch digests of
both implementations equal. Run it as `python -m benchmarks.scale_data`; it prints a table
and `--json PATH` writes the results.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

MIB = 2**20
RSS_TARGET_MIB = 64
STARTUP_TARGET_S = 1.0


# --- the loader `trainer.data` had before memory-mapping (the reference for equal batches) ---
def legacy_load_tokens(files: list) -> torch.Tensor:
    """Every file read whole and concatenated: bytes with a newline after each file, or shards as int32."""
    if all(f.dtype == "uint8" for f in files):
        chunks = [np.frombuffer(f.path.read_bytes() + b"\n", dtype=np.uint8) for f in files]
        return torch.from_numpy(np.concatenate(chunks).copy())
    chunks = [np.frombuffer(f.path.read_bytes(), dtype=np.dtype(f.dtype).newbyteorder("<")) for f in files]
    return torch.from_numpy(np.concatenate(chunks).astype(np.int32))


class LegacyStepSampler:
    """Random windows of `seq_len + 1` tokens of an in-memory tensor, seeded by (seed, step, rank)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int, rank: int) -> None:
        self.tokens, self.window, self.batch_size, self.seed, self.rank = (
            tokens,
            seq_len + 1,
            batch_size,
            seed,
            rank,
        )

    def batch(self, step: int) -> torch.Tensor:
        mixed = ((self.seed * 1_000_003 + step) * 1_009 + self.rank) % (2**63)
        generator = torch.Generator().manual_seed(mixed)
        starts = torch.randint(0, self.tokens.numel() - self.window, (self.batch_size,), generator=generator)
        return torch.stack([self.tokens[s : s + self.window] for s in starts.tolist()]).long()


def legacy_holdout_batches(
    tokens: torch.Tensor, seq_len: int, max_windows: int = 64, batch_size: int = 16
) -> list[torch.Tensor]:
    window = seq_len + 1
    count = max(1, min(max_windows, (tokens.numel() - 1) // window))
    starts = np.linspace(0, tokens.numel() - window, num=count, dtype=np.int64).tolist()
    rows = [tokens[s : s + window].long() for s in starts]
    return [torch.stack(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]


# --- the benchmark ---
def write_token_snapshot(folder: Path, total_mib: int, shard_mib: int, vocab_size: int = 50_000) -> Path:
    """A v2 token-shard snapshot of `total_mib` MiB of random uint16 ids in `shard_mib` MiB shards."""
    files_dir = folder / "files"
    files_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    shard_tokens = shard_mib * MIB // 2
    shards, entries = [], []
    for number in range(max(2, total_mib // shard_mib)):
        name = f"shard-{number:05d}.bin"
        rng.integers(0, vocab_size, size=shard_tokens, dtype=np.uint16).astype("<u2").tofile(files_dir / name)
        shards.append({"name": name, "tokens": shard_tokens, "documents": 1, "sha256": ""})
        entries.append(
            {"key": f"tokens/{name}", "size": shard_tokens * 2, "etag": "", "path": f"files/{name}"}
        )
    index = {
        "format": "rtp-token-shards",
        "version": 2,
        "tokenizer": "bench",
        "vocab_size": vocab_size,
        "dtype": "uint16",
        "document_separator": 0,
        "documents": len(shards),
        "tokens": shard_tokens * len(shards),
        "shards": shards,
    }
    (files_dir / "index.json").write_text(json.dumps(index))
    entries.append(
        {
            "key": "tokens/index.json",
            "size": (files_dir / "index.json").stat().st_size,
            "etag": "",
            "path": "files/index.json",
        }
    )
    (folder / "manifest.json").write_text(json.dumps({"snapshot_id": "bench", "files": entries}))
    return folder


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(impl: str, dataset: Path, seq_len: int, batch_size: int, batches: int) -> dict[str, Any]:
    """What one rank does with its data, in this process: the numbers for one table row."""
    from trainer.data import StepSampler, load_tokens, split_files

    rss_before = _rss_mib("VmRSS")
    started = time.perf_counter()
    train, _ = split_files(dataset, 0.1)
    if impl == "legacy":
        sampler: Any = LegacyStepSampler(legacy_load_tokens(train), seq_len, batch_size, seed=0, rank=0)
    else:
        sampler = StepSampler(load_tokens(train), seq_len, batch_size, seed=0, rank=0)
    startup_s = time.perf_counter() - started
    digest = hashlib.sha256()
    for step in range(1, batches + 1):
        digest.update(sampler.batch(step).numpy().tobytes())
    return {
        "startup_s": round(startup_s, 4),
        "rss_before_data_mib": round(rss_before, 1),
        "peak_rss_mib": round(_rss_mib("VmHWM"), 1),
        "batches_sha256": digest.hexdigest(),
    }


def run_benchmark(
    small_mib: int, large_mib: int, shard_mib: int, seq_len: int, batch_size: int, batches: int
) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="rtp-bench-data-") as scratch:
        for size_mib in (small_mib, large_mib):
            dataset = write_token_snapshot(Path(scratch) / f"{size_mib}mib", size_mib, shard_mib)
            for impl in ("legacy", "trainer.data"):
                command = [sys.executable, "-m", "benchmarks.scale_data", "measure", impl, str(dataset),
                           str(seq_len), str(batch_size), str(batches)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
                rows.append({"implementation": impl, "data_mib": size_mib, **json.loads(done.stdout)})
    by = {(r["implementation"], r["data_mib"]): r for r in rows}
    summary = {}
    for impl in ("legacy", "trainer.data"):
        small, large = by[(impl, small_mib)], by[(impl, large_mib)]
        summary[impl] = {
            "peak_rss_growth_mib": round(large["peak_rss_mib"] - small["peak_rss_mib"], 1),
            "startup_growth_s": round(large["startup_s"] - small["startup_s"], 4),
            "max_startup_s": max(small["startup_s"], large["startup_s"]),
        }
    new = summary["trainer.data"]
    return {
        "settings": {
            "small_mib": small_mib,
            "large_mib": large_mib,
            "shard_mib": shard_mib,
            "dtype": "uint16",
            "seq_len": seq_len,
            "batch_size": batch_size,
            "batches": batches,
        },
        "rows": rows,
        "summary": summary,
        "targets": {
            "rss_growth_within_mib": RSS_TARGET_MIB,
            "rss_met": new["peak_rss_growth_mib"] <= RSS_TARGET_MIB,
            "startup_within_s": STARTUP_TARGET_S,
            "startup_met": new["max_startup_s"] <= STARTUP_TARGET_S,
            "batches_equal": all(
                by[("legacy", size)]["batches_sha256"] == by[("trainer.data", size)]["batches_sha256"]
                for size in (small_mib, large_mib)
            ),
        },
    }


def format_table(results: dict[str, Any]) -> str:
    lines = [
        "| implementation | data | peak RSS (MiB) | RSS before data (MiB) | start-up (s) |",
        "|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['implementation']} | {row['data_mib']} MiB | {row['peak_rss_mib']:.0f} | "
            f"{row['rss_before_data_mib']:.0f} | {row['startup_s']:.3f} |"
        )
    for impl, summary in results["summary"].items():
        lines.append(
            f"{impl}: peak RSS +{summary['peak_rss_growth_mib']:.0f} MiB, start-up "
            f"{summary['startup_growth_s']:+.3f} s from {results['settings']['small_mib']} to "
            f"{results['settings']['large_mib']} MiB"
        )
    targets = results["targets"]
    lines.append(
        f"targets: RSS growth <= {targets['rss_growth_within_mib']} MiB {'met' if targets['rss_met'] else 'MISSED'}; "
        f"start-up <= {targets['startup_within_s']} s {'met' if targets['startup_met'] else 'MISSED'}; "
        f"same batches as before: {'yes' if targets['batches_equal'] else 'NO'}"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--small-mib", type=int, default=64, help="the smaller dataset (default: %(default)s)"
    )
    parser.add_argument(
        "--large-mib", type=int, default=1024, help="the larger dataset (default: %(default)s)"
    )
    parser.add_argument("--shard-mib", type=int, default=16, help="size of each shard (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=2048, help="model.seq_len (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="data.batch_size (default: %(default)s)")
    parser.add_argument("--batches", type=int, default=20, help="batches drawn (default: %(default)s)")
    parser.add_argument("--json", default="", metavar="PATH", help="also write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    results = run_benchmark(
        args.small_mib, args.large_mib, args.shard_mib, args.seq_len, args.batch_size, args.batches
    )
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if results["targets"]["batches_equal"] else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:  # one measured process: IMPL DATASET SEQ_LEN BATCH_SIZE BATCHES
        impl, dataset, seq_len, batch_size, batches = sys.argv[2:7]
        print(json.dumps(measure(impl, Path(dataset), int(seq_len), int(batch_size), int(batches))))
    else:
        parser = argparse.ArgumentParser(
            prog="python -m benchmarks.scale_data", description=__doc__.split("\n")[0]
        )
        add_arguments(parser)
        sys.exit(main(parser.parse_args()))
