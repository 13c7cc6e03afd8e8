"""The node check a job's pod runs before ft_launcher: each unhealthy condition, simulated."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from trainer import health
from trainer.config import resolve_config


def test_a_writable_volume_and_fast_tier_pass(tmp_path):
    assert health.volume_writable(tmp_path / "work", limit_s=30).ok
    room = health.fast_tier_room(tmp_path / "shm", min_free_gib=0.0)
    assert room.ok and "GiB free" in room.detail
    assert not list((tmp_path / "work").iterdir()), "the probe file is removed"


def test_an_unwritable_volume_fails_with_its_error(tmp_path):
    (tmp_path / "file").write_text("")
    check = health.volume_writable(tmp_path / "file" / "work", limit_s=30)
    assert not check.ok and check.detail.startswith("NotADirectoryError"), check


def test_a_volume_slower_than_its_limit_fails(tmp_path):
    check = health.volume_writable(tmp_path, limit_s=0.0)
    assert not check.ok and "limit 0 s" in check.detail, check


def test_a_fast_tier_without_room_names_the_fix(tmp_path):
    check = health.fast_tier_room(tmp_path, min_free_gib=1e9)
    assert not check.ok and "1e+09 GiB needed" in check.detail and "checkpoint.local_dir" in check.detail


def test_missing_efa_devices_are_counted(tmp_path):
    (tmp_path / "rdmap16s27").mkdir()
    check = health.efa_devices(2, sysfs=tmp_path)
    assert not check.ok and check.detail.startswith("1 EFA devices") and "rdmap16s27" in check.detail
    (tmp_path / "rdmap32s27").mkdir()
    assert health.efa_devices(2, sysfs=tmp_path).ok
    assert not health.efa_devices(1, sysfs=tmp_path / "absent").ok


def test_missing_or_miscomputing_gpus_fail():
    def right(index, a, b):
        return a @ b

    assert health.gpus_compute(2, visible=lambda: 2, matmul_on=right).ok
    fewer = health.gpus_compute(2, visible=lambda: 1, matmul_on=right)
    assert not fewer.ok and "1 GPUs visible, 2 expected" in fewer.detail

    def wrong_on_gpu_1(index, a, b):
        return a @ b if index == 0 else (a @ b) * 0

    wrong = health.gpus_compute(2, visible=lambda: 2, matmul_on=wrong_on_gpu_1)
    assert not wrong.ok and wrong.detail.startswith("GPU 1 computed a wrong matmul")


class _NVMLError(Exception):
    pass


def _nvml(errors=(0, 0), rows=((0, 0, False, False), (0, 0, False, False)), xids=(), **extra):
    """An NVML stand-in: ECC counts and remapped rows per GPU, and the Xid events (GPU, Xid)
    queued once events are registered."""
    queue = []

    def register(handle, kind, event_set):
        assert kind == 8 and event_set == "set"
        queue.extend(SimpleNamespace(device=gpu, eventData=xid) for gpu, xid in xids if gpu == handle)

    def wait(event_set, timeout_ms):
        if not queue:
            raise _NVMLError("Timeout")
        return queue.pop(0)

    def remapped(handle):
        if rows[handle] is None:
            raise _NVMLError("Not Supported")
        return rows[handle]

    functions = dict(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetIndex=lambda handle: handle,
        nvmlDeviceGetTotalEccErrors=lambda handle, kind, counter: errors[handle],
        nvmlDeviceGetRemappedRows=remapped,
        nvmlEventSetCreate=lambda: "set",
        nvmlEventSetFree=lambda event_set: None,
        nvmlDeviceRegisterEvents=register,
        nvmlEventSetWait_v2=wait,
        nvmlEventTypeXidCriticalError=8,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        NVMLError=_NVMLError,
    )
    return SimpleNamespace(**{**functions, **extra})


def test_uncorrected_ecc_errors_fail():
    assert health.gpu_memory_errors(2, nvml=_nvml()).ok
    bad = health.gpu_memory_errors(2, nvml=_nvml(errors=[0, 3]))
    assert not bad.ok and bad.detail == "GPU 1: 3 uncorrected ECC errors"


def test_failed_or_pending_row_remapping_fails():
    older_gpu = health.gpu_memory_errors(2, nvml=_nvml(rows=[None, None]))
    assert older_gpu.ok, "a GPU without row remapping (NotSupported) passes"
    failed = health.gpu_memory_errors(2, nvml=_nvml(rows=[(0, 0, False, False), (0, 4, True, True)]))
    assert not failed.ok and failed.detail == "GPU 1: a memory row remapping failed (the GPU needs replacing)"
    pending = health.gpu_memory_errors(2, nvml=_nvml(rows=[(2, 1, True, False), (0, 0, False, False)]))
    assert (
        not pending.ok
        and pending.detail == "GPU 0: a memory row remapping is pending (the GPU needs a reset)"
    )


def test_an_xid_raised_while_the_gpus_compute_fails_the_node():
    with health.XidWatch(2, nvml=_nvml(), drain_ms=1) as quiet:
        pass
    assert quiet.check.ok and quiet.check.detail == "no critical Xid events on GPUs 0, 1"
    with health.XidWatch(2, nvml=_nvml(xids=[(1, 79)]), drain_ms=1) as faulty:
        pass
    assert not faulty.check.ok and faulty.check.detail.startswith("Xid 79 on GPU 1 "), faulty.check

    def refuse(handle, kind, event_set):
        raise _NVMLError("Not Supported")

    with health.XidWatch(1, nvml=_nvml(nvmlDeviceRegisterEvents=refuse), drain_ms=1) as unsupported:
        pass
    assert unsupported.check.ok and unsupported.check.detail == "no critical Xid events on GPUs none"


def _inline_config(tmp_path, **named) -> str:
    config = resolve_config(
        named={"dataset_dir": str(tmp_path / "data"), "workdir": str(tmp_path / "work"), **named}
    )
    return "--config=" + config.to_compact_json()


def test_an_unhealthy_node_exits_3_reports_and_never_runs_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(health, "TERMINATION_LOG", tmp_path / "termination-log")
    marker = tmp_path / "ran"
    command = ["touch", str(marker), _inline_config(tmp_path, checkpoint_local_dir=str(tmp_path / "shm"))]
    code = health.main(["--efa", "4", "--min-fast-tier-gib", "1e9", "--", *command])
    assert code == health.EXIT_UNHEALTHY_NODE and not marker.exists()
    lines = capsys.readouterr().err.splitlines()
    failed = [line for line in lines if "is unhealthy" in line]
    assert [line.split(": ")[1] for line in failed] == ["fast_tier", "efa"], lines
    assert (tmp_path / "termination-log").read_text().splitlines() == failed
    [written] = (tmp_path / "work" / "node-health").glob("*.json")
    report = json.loads(written.read_text())
    assert report["healthy"] is False
    assert {c["name"]: c["ok"] for c in report["checks"]} == {
        "fast_tier": False,
        "volume": True,
        "efa": False,
    }
    [event] = [json.loads(line) for line in (tmp_path / "work" / "events.jsonl").read_text().splitlines()]
    assert event["kind"] == "node_unhealthy" and sorted(event["failed"]) == ["efa", "fast_tier"]


def test_a_healthy_node_becomes_the_command(tmp_path):
    shm = tmp_path / "shm"
    script = "import sys, os; print('launcher', os.getpid(), sys.argv[1][:9])"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; from trainer.health import main; print('health', os.getpid(), flush=True); "
            "sys.exit(main(sys.argv[1:]))",
            "--min-fast-tier-gib",
            "0",
            "--",
            sys.executable,
            "-c",
            script,
            _inline_config(tmp_path, checkpoint_local_dir=str(shm)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    [ours, theirs] = done.stdout.split("\n")[:2]
    assert theirs.startswith("launcher") and theirs.endswith("--config=")
    assert ours.split()[1] == theirs.split()[1], "exec: the command keeps the pid"
    assert "health: volume: ok" in done.stderr and "health: fast_tier: ok" in done.stderr
    assert json.loads(next((tmp_path / "work" / "node-health").glob("*.json")).read_text())["healthy"]


def test_help_names_the_exit_code(capsys):
    with pytest.raises(SystemExit):
        health.main(["--help"])
    assert "Exits with 3" in capsys.readouterr().out
