"""trainer/diagnostics.py's flight recorder dumps: which recorder lands in the file torch's
analyzer reads (NCCL's on a GPU rank, gloo's beside it; gloo's on CPU), with torch's functions
stood in for where CUDA is needed, and gloo's real recorder on one rank."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from trainer import diagnostics

pytestmark = pytest.mark.timeout(60)
C10D = torch._C._distributed_c10d


def _trace(*names: str) -> bytes:
    return pickle.dumps(
        {"entries": [{"profiling_name": n} for n in names], "pg_config": {"0": {"name": "0", "ranks": "[0]"}}}
    )


def _names(path) -> list[str]:
    return [e["profiling_name"] for e in pickle.loads(path.read_bytes())["entries"]]


def test_a_gpu_rank_leaves_the_nccl_recorder_for_the_analyzer_with_gloos_beside_it(tmp_path, monkeypatch):
    # A CPU build of torch has no `_dump_nccl_trace`: stood in, as on a CUDA build.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(C10D, "_dump_nccl_trace", lambda: _trace("nccl:all_reduce"), raising=False)
    monkeypatch.setattr(C10D, "_dump_fr_trace", lambda: _trace("gloo:all_gather"), raising=False)
    assert diagnostics.dump_flight_recorder(tmp_path, rank=3)
    assert _names(tmp_path / "fr_rank_3") == ["nccl:all_reduce"]
    assert _names(tmp_path / "fr_gloo_rank_3") == ["gloo:all_gather"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fr_gloo_rank_3", "fr_rank_3"]  # no partial files


def test_a_cpu_rank_leaves_the_gloo_recorder_for_the_analyzer(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # A CUDA build's NCCL recorder is not what a CPU rank trained with.
    monkeypatch.setattr(C10D, "_dump_nccl_trace", lambda: _trace("nccl:unused"), raising=False)
    monkeypatch.setattr(C10D, "_dump_fr_trace", lambda: _trace("gloo:all_reduce"), raising=False)
    assert diagnostics.dump_flight_recorder(tmp_path, rank=0)
    assert [p.name for p in tmp_path.iterdir()] == ["fr_rank_0"]
    assert _names(tmp_path / "fr_rank_0") == ["gloo:all_reduce"]


def test_a_torch_without_the_recorders_leaves_no_dump_and_no_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delattr(C10D, "_dump_nccl_trace", raising=False)
    monkeypatch.delattr(C10D, "_dump_fr_trace", raising=False)
    assert not diagnostics.dump_flight_recorder(tmp_path, rank=0)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_a_recorder_that_fails_leaves_the_other(tmp_path, monkeypatch):
    def not_recording():
        raise RuntimeError("flight recorder disabled")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(C10D, "_dump_nccl_trace", lambda: _trace("nccl:all_reduce"), raising=False)
    monkeypatch.setattr(C10D, "_dump_fr_trace", not_recording, raising=False)
    assert diagnostics.dump_flight_recorder(tmp_path, rank=1)
    assert [p.name for p in tmp_path.iterdir()] == ["fr_rank_1"]


def test_the_real_gloo_recorder_holds_a_cpu_ranks_collectives(tmp_path, monkeypatch):
    monkeypatch.setenv(diagnostics.FLIGHT_RECORDER_ENV, "100")  # read when the group is made
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(2))
        assert diagnostics.dump_flight_recorder(tmp_path, rank=0)
    finally:
        dist.destroy_process_group()
    assert any(name.startswith("gloo:all_reduce") for name in _names(tmp_path / "fr_rank_0"))
