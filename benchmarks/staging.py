"""`rtp bench staging`: `rtp stage` (one process, and 2 parts + a finisher) vs `rclone copy` vs `aws s3 sync` vs a plain sequential boto3 loop.

One invocation starts a real S3 server on loopback (single-node Ceph RGW, unless
`--endpoint-url` names one, with credentials from the environment), uploads the same data
for every contender (`--objects` small objects of `--object-kib` KiB plus `--big-objects`
objects of `--big-mib` MiB, multipart-uploaded), and times for each: a full stage into an
empty folder, then a second run of the same command over the unchanged prefix. All run as
subprocesses, so each pays its own start-up: `rtp stage`, `rtp stage --part 0/2` and
`--part 1/2` at once then `--finish 2` (`rtp_2_parts`: what two stage pods would do, here
on the same two cores), `rclone copy` (Debian's, installed
by scripts/install-rclone.sh; skipped with the reason when absent) with the settings a user
tuning it for speed would pick, `aws s3 sync`, and a plain boto3 loop (`python -m
benchmarks.staging boto3-loop`, one GET at a time, which skips files whose size already
matches on the second run). Each full stage's CPU seconds (user + system of the process
and its children) are reported per GiB beside its wall time. With `--rounds N` every
contender runs N times in turn (each round starting with the next contender, so drift in
the machine's speed spreads over all of them); the table gives medians and ranges.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MIB = 2**20
CONTENDERS = ("rtp", "rtp_2_parts", "rclone", "awscli", "boto3_sequential")
BUCKET = "rtp-bench-staging"
PREFIX = "data/"


def seed(
    client: Any, objects: int, object_kib: int, big_objects: int, big_mib: int, scratch: Path
) -> tuple[int, int]:
    from boto3.s3.transfer import TransferConfig

    client.create_bucket(Bucket=BUCKET)
    small = os.urandom(object_kib * 1024)

    def put(i: int) -> None:
        client.put_object(
            Bucket=BUCKET, Key=f"{PREFIX}small/{i:06d}.bin", Body=small[i % 7 :] + i.to_bytes(8, "big")
        )

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(put, range(objects)))
    total = sum(len(small[i % 7 :]) + 8 for i in range(objects))
    big = scratch / "big.bin"
    with big.open("wb") as handle:
        for _ in range(big_mib):
            handle.write(os.urandom(MIB))
    config = TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=8 * MIB, max_concurrency=8)
    for i in range(big_objects):
        client.upload_file(str(big), BUCKET, f"{PREFIX}big/{i:03d}.bin", Config=config)
        total += big_mib * MIB
    big.unlink()
    return objects + big_objects, total


RCLONE_FLAGS = ("--transfers", "32", "--checkers", "32", "--multi-thread-streams", "8")
"""rclone tuned for many objects and large ones, as the comparison in issue 32 ran it."""


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system, its children included) of one command."""
    cpu = _children_cpu_s()
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed: {result.stderr[-2000:]}")
    return time.perf_counter() - started, _children_cpu_s() - cpu


def _twice(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """A full copy into an empty folder, then the same command over the unchanged prefix."""
    full, cpu = _timed(command, env)
    nochange, _ = _timed(command, env)
    return {"full_s": full, "full_cpu_s": cpu, "nochange_s": nochange}


def _folder_bytes(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json"]
    return len(files), sum(p.stat().st_size for p in files)


def _rtp_stage(endpoint: str, dest: Path, max_workers: int) -> list[str]:
    command = [
        sys.executable, "-m", "rtp_cli.main", "stage", "--source", f"s3://{BUCKET}/{PREFIX}",
        "--endpoint-url", endpoint, "--fsx-mount-path", str(dest), "--dataset-name", "bench",
    ]  # fmt: skip
    return command + (["--max-workers", str(max_workers)] if max_workers else [])


def run_rtp(endpoint: str, dest: Path, env: dict[str, str], max_workers: int) -> dict[str, Any]:
    times = _twice(_rtp_stage(endpoint, dest, max_workers), env)
    objects, size = _folder_bytes(dest / "rtp/datasets/bench/current/")
    return {**times, "bytes": size, "objects": objects}


def _timed_together(commands: list[list[str]], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of commands run at the same time, until the last one ends."""
    cpu = _children_cpu_s()
    started = time.perf_counter()
    processes = [
        subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
    errors = [p.communicate()[1] for p in processes]
    for command, process, error in zip(commands, processes, errors, strict=True):
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:4])} ... failed: {error[-2000:]}")
    return time.perf_counter() - started, _children_cpu_s() - cpu


def run_rtp_parts(
    endpoint: str, dest: Path, env: dict[str, str], max_workers: int, parts: int
) -> dict[str, Any]:
    """`rtp stage --part I/N` for every part at once (as N pods would), then `--finish N`."""
    command = _rtp_stage(endpoint, dest, max_workers)

    def stage() -> tuple[float, float]:
        wall, cpu = _timed_together([[*command, "--part", f"{i}/{parts}"] for i in range(parts)], env)
        finish_wall, finish_cpu = _timed([*command, "--finish", str(parts)], env)
        return wall + finish_wall, cpu + finish_cpu

    full, cpu = stage()
    nochange, _ = stage()
    objects, size = _folder_bytes(dest / "rtp/datasets/bench/current/")
    return {"full_s": full, "full_cpu_s": cpu, "nochange_s": nochange, "bytes": size, "objects": objects}


def aws_executable() -> str:
    beside = Path(sys.executable).parent / "aws"
    found = str(beside) if beside.exists() else shutil.which("aws")
    if not found:
        raise RuntimeError("awscli not installed: pip install the dev extra (awscli is pinned there)")
    return found


def run_awscli(endpoint: str, dest: Path, env: dict[str, str]) -> dict[str, Any]:
    command = [aws_executable(), "s3", "sync", f"s3://{BUCKET}/{PREFIX}", str(dest), "--endpoint-url", endpoint,
               "--only-show-errors"]  # fmt: skip
    times = _twice(command, env)
    objects, size = _folder_bytes(dest)
    return {**times, "bytes": size, "objects": objects}


def rclone_missing() -> str:
    """Why rclone cannot run here, or '' when it can."""
    return "" if shutil.which("rclone") else "rclone not installed: run scripts/install-rclone.sh"


def run_rclone(endpoint: str, dest: Path, env: dict[str, str], provider: str) -> dict[str, Any]:
    """`rclone copy` from a remote configured through the environment (credentials from the
    AWS variables, `env_auth`), so nothing is written to the user's rclone.conf."""
    remote = {
        "TYPE": "s3",
        "PROVIDER": provider,
        "ENV_AUTH": "true",
        "ENDPOINT": endpoint,
        "REGION": env.get("AWS_DEFAULT_REGION", "us-east-1"),
    }
    env = {**env, **{f"RCLONE_CONFIG_RTPBENCH_{key}": value for key, value in remote.items()}}
    command = ["rclone", "copy", f"rtpbench:{BUCKET}/{PREFIX}", str(dest), *RCLONE_FLAGS]
    # rclone's S3 SDK cannot load AWS_CA_BUNDLE into its own HTTP client: it takes the bundle as a flag.
    bundle = env.pop("AWS_CA_BUNDLE", "")
    if bundle and endpoint.startswith("https://"):
        command += ["--ca-cert", bundle]
    times = _twice(command, env)
    objects, size = _folder_bytes(dest)
    return {**times, "bytes": size, "objects": objects}


def boto3_loop(endpoint: str, dest: Path) -> None:
    """The plain baseline: list, then GET each object in turn unless a file of its size exists."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX):
        for item in page.get("Contents", []):
            target = dest / item["Key"][len(PREFIX) :]
            if target.is_file() and target.stat().st_size == item["Size"]:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            body = client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"]
            with target.open("wb") as handle:
                for chunk in body.iter_chunks(MIB):
                    handle.write(chunk)


def run_boto3_sequential(endpoint: str, dest: Path, env: dict[str, str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.staging", "boto3-loop", endpoint, str(dest)]
    times = _twice(command, env)
    objects, size = _folder_bytes(dest)
    return {**times, "bytes": size, "objects": objects}


def compile_rtp() -> None:
    """Byte-compile rtp's packages once, as `pip install` does for an installed package (and
    the image's Dockerfile for its source tree): where PYTHONDONTWRITEBYTECODE is set, an
    editable checkout would otherwise compile every module again in each timed process."""
    import compileall

    repository = Path(__file__).resolve().parents[1]
    for package in ("rtp_cli", "components"):
        compileall.compile_dir(repository / package, quiet=1)


def run_benchmark(
    *,
    objects: int,
    object_kib: int,
    big_objects: int,
    big_mib: int,
    endpoint_url: str = "",
    max_workers: int = 0,
    contenders: tuple[str, ...] = CONTENDERS,
    rounds: int = 1,
) -> dict[str, Any]:
    """Each contender's figures (medians over `rounds`, each round's in "rounds"); a contender
    that cannot run here is {"skipped": why}."""
    from benchmarks.ceph_rgw import CephRGW
    from components.stage_data.s3_clients import s3_client

    server = None
    with tempfile.TemporaryDirectory(prefix="rtp-bench-staging-") as tmp:
        root = Path(tmp)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
        )
        if not endpoint_url:
            missing = CephRGW.missing()
            if missing:
                raise RuntimeError(
                    f"Ceph RGW is not installed ({', '.join(missing)}): run scripts/install-ceph.sh"
                )
            server = CephRGW(root / "ceph").start()
            endpoint_url = server.endpoint_url
            env.update(server.credentials())
            os.environ.update(server.credentials())
        try:
            count, size = seed(s3_client(endpoint_url), objects, object_kib, big_objects, big_mib, root)
            compile_rtp()
            provider = "Ceph" if server is not None else "Other"
            runners = {
                "rtp": lambda dest: run_rtp(endpoint_url, dest, env, max_workers),
                "rtp_2_parts": lambda dest: run_rtp_parts(endpoint_url, dest, env, max_workers, 2),
                "rclone": lambda dest: (
                    {"skipped": rclone_missing()}
                    if rclone_missing()
                    else run_rclone(endpoint_url, dest, env, provider)
                ),
                "awscli": lambda dest: run_awscli(endpoint_url, dest, env),
                "boto3_sequential": lambda dest: run_boto3_sequential(endpoint_url, dest, env),
            }
            unknown = set(contenders) - set(runners)
            if unknown:
                raise ValueError(f"unknown contenders {sorted(unknown)}: pick from {', '.join(runners)}")
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners if name in contenders}
            for round_ in range(rounds):
                order = list(runs)
                order = (
                    order[round_ % len(order) :] + order[: round_ % len(order)]
                )  # each round starts elsewhere
                for name in order:
                    # Nothing is deleted until the end: creating files where thousands were
                    # just deleted costs some file systems (ext4) more than a fresh folder.
                    runs[name].append(runners[name](root / f"{name}-{round_}"))
            results = {name: combined(rows) for name, rows in runs.items()}
            for name, result in results.items():
                if "skipped" not in result and (result["objects"], result["bytes"]) != (count, size):
                    raise RuntimeError(f"{name} staged {result['objects']} objects / {result['bytes']} bytes, "
                                       f"expected {count} / {size}")  # fmt: skip
        finally:
            if server is not None:
                server.stop()
    return results


TOOL_NAMES = {"rclone": "rclone copy", "awscli": "aws s3 sync"}


def combined(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's rounds: the median of each time, every round's times beside them."""
    if "skipped" in rows[0]:
        return rows[0]
    timed = ("full_s", "full_cpu_s", "nochange_s")
    result = {**rows[-1], **{key: statistics.median(r[key] for r in rows) for key in timed}}
    if len(rows) > 1:
        result["rounds"] = [{key: r[key] for key in timed} for r in rows]
    return result


def _spread(r: dict[str, Any], key: str) -> str:
    values = [round_[key] for round_ in r.get("rounds", [])]
    return f"{min(values):.2f}-{max(values):.2f} s"


def format_table(results: dict[str, Any]) -> str:
    lines = [
        f"{'tool':<18} {'full s':>8} {'MiB/s':>8} {'CPU s/GiB':>10} {'no-change s':>12} {'no-change %':>12} "
        f"{'objects':>8} {'MiB':>9}"
    ]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"{name:<18} skipped: {r['skipped']}")
            continue
        cpu = f"{r['full_cpu_s'] / (r['bytes'] / 2**30):>10.2f}" if "full_cpu_s" in r else f"{'-':>10}"
        lines.append(
            f"{name:<18} {r['full_s']:>8.2f} {r['bytes'] / MIB / r['full_s']:>8.1f} {cpu} {r['nochange_s']:>12.2f} "
            f"{100 * r['nochange_s'] / r['full_s']:>11.1f}% {r['objects']:>8} {r['bytes'] / MIB:>9.1f}"
        )
        if "rounds" in r:
            lines.append(
                f"{'':<18} range over {len(r['rounds'])} rounds: full {_spread(r, 'full_s')}, "
                f"no-change {_spread(r, 'nochange_s')}"
            )
    for other, tool in TOOL_NAMES.items():
        if "rtp" in results and "full_s" in results.get(other, {}):
            lines.append(
                f"rtp full stage is {speed_comparison(results['rtp']['full_s'], results[other]['full_s'], tool)}"
            )
    return "\n".join(lines)


def speed_comparison(rtp_s: float, other_s: float, tool: str = "aws s3 sync") -> str:
    """'1.80x faster than aws s3 sync' or '1.25x slower than rclone copy': the word follows the numbers."""
    if rtp_s <= other_s:
        return f"{other_s / rtp_s:.2f}x faster than {tool}"
    return f"{rtp_s / other_s:.2f}x slower than {tool}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--objects", type=int, default=3000, help="small objects (default: %(default)s)")
    parser.add_argument(
        "--object-kib", type=int, default=16, help="size of each small object (default: %(default)s)"
    )
    parser.add_argument("--big-objects", type=int, default=2, help="large objects (default: %(default)s)")
    parser.add_argument(
        "--big-mib", type=int, default=256, help="size of each large object (default: %(default)s)"
    )
    parser.add_argument(
        "--max-workers", type=int, default=0, help="rtp stage --max-workers (default: rtp stage's own)"
    )
    parser.add_argument(
        "--endpoint-url",
        default="",
        help="use this S3 endpoint (credentials from the environment) instead of Ceph RGW",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every contender this many times, in turn, each round starting with the next one; "
        "the table shows medians and the range (default: %(default)s)",
    )
    parser.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help="comma-separated subset to run (default: %(default)s)",
    )
    parser.add_argument("--json", default="", metavar="PATH", help="also write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    results = run_benchmark(
        objects=args.objects,
        object_kib=args.object_kib,
        big_objects=args.big_objects,
        big_mib=args.big_mib,
        endpoint_url=args.endpoint_url,
        max_workers=args.max_workers,
        contenders=tuple(name.strip() for name in args.contenders.split(",") if name.strip()),
        rounds=max(1, args.rounds),
    )
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":  # `python -m benchmarks.staging boto3-loop ENDPOINT DEST`: the baseline process
    if sys.argv[1:2] != ["boto3-loop"] or len(sys.argv) != 4:
        sys.exit("usage: python -m benchmarks.staging boto3-loop ENDPOINT DEST")
    boto3_loop(sys.argv[2], Path(sys.argv[3]))
