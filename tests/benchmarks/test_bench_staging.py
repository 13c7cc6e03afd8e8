"""`rtp bench staging` at toy size against moto: every contender runs twice and reports the JSON the
issue documents (no timing asserts: a shared machine makes them noise; the docs hold the measurement)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)


@pytest.mark.bench
def test_bench_staging_reports_every_contender(tmp_path):
    from moto.server import ThreadedMotoServer

    from benchmarks.staging import aws_executable

    try:
        aws_executable()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "rtp_cli.main", "bench", "staging", "--endpoint-url", f"http://{host}:{port}",
               "--objects", "12", "--object-kib", "2", "--big-objects", "1", "--big-mib", "9", "--json", str(out)]  # fmt: skip
    try:
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL
        )
    finally:
        server.stop()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == {"rtp", "rtp_2_parts", "rclone", "awscli", "boto3_sequential"}
    expected_bytes = sum(2048 - i % 7 + 8 for i in range(12)) + 9 * 2**20
    for name, row in data.items():
        if name == "rclone" and "skipped" in row:  # scripts/install-rclone.sh could not install it
            assert row == {"skipped": "rclone not installed: run scripts/install-rclone.sh"}
            assert "rclone             skipped: rclone not installed" in result.stdout
            continue
        assert set(row) == {"full_s", "full_cpu_s", "nochange_s", "bytes", "objects"}, name
        assert (row["objects"], row["bytes"]) == (13, expected_bytes), name
        assert row["full_s"] > 0 and row["nochange_s"] > 0 and row["full_cpu_s"] > 0, name
    assert "rtp" in result.stdout and "than aws s3 sync" in result.stdout
    assert ("than rclone copy" in result.stdout) == ("skipped" not in data["rclone"])


def test_rounds_give_medians_and_every_rounds_times():
    from benchmarks.staging import combined, format_table

    rows = [
        {"full_s": t, "full_cpu_s": 2 * t, "nochange_s": t / 10, "bytes": 2**20, "objects": 1}
        for t in (3, 1, 2)
    ]
    merged = combined(rows)
    assert (merged["full_s"], merged["full_cpu_s"], merged["nochange_s"]) == (2, 4, 0.2)
    assert [r["full_s"] for r in merged["rounds"]] == [3, 1, 2]
    assert "range over 3 rounds: full 1.00-3.00 s, no-change 0.10-0.30 s" in format_table({"rtp": merged})
    assert "rounds" not in combined(rows[:1]) and combined([{"skipped": "why"}]) == {"skipped": "why"}


def test_the_table_says_slower_when_rtp_is_slower():
    from benchmarks.staging import format_table

    row = {"nochange_s": 0.1, "bytes": 2**20, "objects": 1}
    slower = format_table({"rtp": {**row, "full_s": 5.0}, "awscli": {**row, "full_s": 4.0}})
    assert slower.splitlines()[-1] == "rtp full stage is 1.25x slower than aws s3 sync"
    faster = format_table({"rtp": {**row, "full_s": 2.0}, "awscli": {**row, "full_s": 4.0}})
    assert faster.splitlines()[-1] == "rtp full stage is 2.00x faster than aws s3 sync"
    both = format_table(
        {
            "rtp": {**row, "full_s": 2.0, "full_cpu_s": 3.0},
            "rclone": {**row, "full_s": 3.0},
            "awscli": {**row, "full_s": 4.0},
        }
    )
    assert both.splitlines()[-2:] == [
        "rtp full stage is 1.50x faster than rclone copy",
        "rtp full stage is 2.00x faster than aws s3 sync",
    ]
    assert "   3072.00 " in both.splitlines()[1]  # 3 CPU seconds for 1 MiB, per GiB
