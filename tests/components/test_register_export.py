"""The streamed Hugging Face export (components/register_model/streamed_export.py): a bf16
source exports bf16 tensors, in several files with an index when over max_shard_size, that
from_pretrained loads with the checkpoint's exact logits; an fp32 export likewise; tied
weights left out as save_pretrained leaves them out; memory bounded by one read group; the
header check catching damaged exports; an export reused on a retry, published atomically;
and the benchmark's JSON shape at a tiny size. Checkpoints are one-rank DCP checkpoints
written with `benchmarks.make_checkpoint.save_checkpoint`, as tests/components/test_register_hf.py does."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from benchmarks.make_checkpoint import save_checkpoint
from components.register_model import streamed_export
from components.register_model.register import checkpoint_sha256
from components.register_model.streamed_export import (
    ExportError,
    ExportTensor,
    check_export_headers,
    export_checkpoint,
    export_folder,
    parse_max_shard_size,
    plan_files,
)
from tests.hf_tiny import write_tiny_model
from trainer.checkpointing import load_model_weights
from trainer.checkpointing.storage import CheckpointError
from trainer.config import resolve_config
from trainer.models import model_spec

pytestmark = pytest.mark.timeout(300)

TOKENS = torch.tensor([[5, 17, 42, 99, 123, 7, 250, 3]])


def _checkpoint(root: Path, *, tie: bool, dtype: str | None, poison: bool = False) -> dict:
    """A committed one-rank checkpoint (model + AdamW state after one step) of a tiny Llama
    whose config.json declares `dtype`."""
    import torch.distributed as dist

    model_dir = write_tiny_model(root / "model", "llama", tie=tie)
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("torch_dtype", None)
    raw.pop("dtype", None)
    if dtype is not None:
        raw["dtype"] = dtype
    (model_dir / "config.json").write_text(json.dumps(raw))
    config = resolve_config(
        named={"model_dir": str(model_dir), "model_init": "random"}, overrides=["model.seq_len=16"]
    )
    spec = model_spec("hf")
    torch.manual_seed(0)
    model = spec.build(config.model, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    spec.loss(model, torch.randint(0, 300, (2, 17))).backward()
    optimizer.step()
    if poison:
        with torch.no_grad():
            model.get_parameter("model.layers.1.mlp.up_proj.weight")[0, 0] = float("nan")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        save_checkpoint(
            root / "checkpoints", 1, model, optimizer, meta={"config": config.to_dict()}, rank_extra={}
        )
    finally:
        dist.destroy_process_group()
    checkpoint = root / "checkpoints" / "step_1"
    return {"config": config, "checkpoint": checkpoint, "sha": checkpoint_sha256(checkpoint)}


@pytest.fixture(scope="module")
def bf16_tied(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("bf16-tied"), tie=True, dtype="bfloat16")


def _checkpoint_logits(case: dict, dtype: torch.dtype) -> torch.Tensor:
    """fp32: the checkpoint's own model; otherwise its weights cast, in transformers' model of that dtype."""
    if dtype == torch.float32:
        model = model_spec("hf").build(case["config"].model, torch.device("cpu"))
        load_model_weights(case["checkpoint"], model)
    else:
        model = streamed_export.reference_model(case["checkpoint"], case["config"].model, dtype)
    with torch.no_grad():
        return model.eval()(input_ids=TOKENS).logits


def _loaded_logits(folder: Path) -> tuple[torch.Tensor, torch.dtype]:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        return loaded(input_ids=TOKENS).logits, loaded.dtype


def test_a_bf16_source_exports_bf16_shards_that_from_pretrained_loads(bf16_tied, tmp_path):
    from safetensors import safe_open

    result = export_checkpoint(
        bf16_tied["checkpoint"],
        bf16_tied["config"].model,
        bf16_tied["sha"],
        tmp_path / "out",
        max_shard_size="40KB",
    )
    folder = tmp_path / "out"
    assert result.dtype == "bfloat16" and not result.reused
    assert len(result.files) > 2
    assert result.files[0] == f"model-00001-of-{len(result.files):05d}.safetensors"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(result.files)
    names, total = set(), 0
    for name in result.files:
        path = folder / name
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                tensor = handle.get_tensor(key)
                assert tensor.dtype == torch.bfloat16, key
                names.add(key)
                total += tensor.numel() * tensor.element_size()
        # a tensor over the limit gets a file of its own; otherwise files stay under it
        data_bytes = path.stat().st_size - streamed_export.read_safetensors_header(path)["__header_bytes__"]
        assert data_bytes <= 40_000 or len([v for v in index["weight_map"].values() if v == name]) == 1
    assert index["metadata"]["total_size"] == total == result.total_bytes
    assert names == set(index["weight_map"])
    # the tied head is left out, as save_pretrained leaves it out
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert (folder / "tokenizer.json").is_file()

    logits, dtype = _loaded_logits(folder)
    assert dtype == torch.bfloat16
    assert torch.equal(logits, _checkpoint_logits(bf16_tied, torch.bfloat16))
    streamed_export.check_export_loads(
        folder, bf16_tied["checkpoint"], bf16_tied["config"].model, torch.bfloat16
    )


def test_an_fp32_export_has_exactly_the_checkpoints_logits(bf16_tied, tmp_path):
    result = export_checkpoint(
        bf16_tied["checkpoint"],
        bf16_tied["config"].model,
        bf16_tied["sha"],
        tmp_path / "out",
        export_dtype="fp32",
    )
    assert result.dtype == "float32" and result.files == ("model.safetensors",)
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    logits, dtype = _loaded_logits(tmp_path / "out")
    assert dtype == torch.float32
    assert torch.equal(logits, _checkpoint_logits(bf16_tied, torch.float32))


def test_an_untied_source_without_dtype_exports_fp32_with_its_head(tmp_path):
    case = _checkpoint(tmp_path, tie=False, dtype=None)
    result = export_checkpoint(case["checkpoint"], case["config"].model, case["sha"])
    assert result.folder == tmp_path / "export" / "step_1" == export_folder(case["checkpoint"])
    assert result.dtype == "float32"
    header = streamed_export.read_safetensors_header(result.folder / "model.safetensors")
    assert header["lm_head.weight"]["dtype"] == "F32"
    logits, _ = _loaded_logits(result.folder)
    assert torch.equal(logits, _checkpoint_logits(case, torch.float32))


def test_reads_are_bounded_by_the_group_budget_not_the_model(bf16_tied, tmp_path, monkeypatch):
    budget = 20_000
    monkeypatch.setattr(streamed_export, "READ_GROUP_BYTES", budget)
    groups = []
    original = streamed_export._dcp_reader

    def spying_reader(checkpoint_dir):
        read = original(checkpoint_dir)

        def spy(group):
            groups.append(group)
            return read(group)

        return spy

    monkeypatch.setattr(streamed_export, "_dcp_reader", spying_reader)
    result = export_checkpoint(
        bf16_tied["checkpoint"], bf16_tied["config"].model, bf16_tied["sha"], tmp_path / "o"
    )
    stored = result.parameters * 4
    assert stored > 10 * budget and len(groups) > 5
    for group in groups:
        assert len(group) == 1 or sum(t.stored_nbytes for t in group) <= budget


def test_a_damaged_export_fails_the_header_check(bf16_tied, tmp_path):
    folder = tmp_path / "out"
    export_checkpoint(
        bf16_tied["checkpoint"], bf16_tied["config"].model, bf16_tied["sha"], folder, max_shard_size="40KB"
    )
    tensors = streamed_export.export_plan(bf16_tied["checkpoint"], bf16_tied["config"].model, torch.bfloat16)
    check_export_headers(folder, tensors)
    # expected as fp32: the bf16 files do not match
    as_fp32 = streamed_export.export_plan(bf16_tied["checkpoint"], bf16_tied["config"].model, torch.float32)
    with pytest.raises(ExportError, match="expected F32"):
        check_export_headers(folder, as_fp32)
    # a truncated file
    last = folder / "model-00002-of-{:05d}.safetensors".format(len(list(folder.glob("model-*"))))
    data = last.read_bytes()
    last.write_bytes(data[:-2])
    with pytest.raises(ExportError, match="bytes, its header describes"):
        check_export_headers(folder, tensors)
    last.write_bytes(data)
    # an index whose total_size is wrong
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"]["total_size"] += 2
    index_path.write_text(json.dumps(index))
    with pytest.raises(ExportError, match="total_size"):
        check_export_headers(folder, tensors)
    # a tensor missing from the files and the index
    index["metadata"]["total_size"] -= 2
    gone = index["weight_map"].pop("model.norm.weight")
    index_path.write_text(json.dumps(index))
    with pytest.raises(ExportError, match=r"model\.norm\.weight"):
        check_export_headers(folder, tensors)
    assert gone


def test_an_export_is_reused_on_a_retry_and_replaced_for_other_settings(bf16_tied, tmp_path):
    folder = tmp_path / "out"
    args = (bf16_tied["checkpoint"], bf16_tied["config"].model, bf16_tied["sha"], folder)
    first = export_checkpoint(*args)
    written = (folder / "model.safetensors").stat().st_mtime_ns
    again = export_checkpoint(*args)
    assert again.reused and (folder / "model.safetensors").stat().st_mtime_ns == written
    other = export_checkpoint(*args, export_dtype="fp32")
    assert not other.reused and other.dtype == "float32" and first.dtype == "bfloat16"
    assert (
        streamed_export.read_safetensors_header(folder / "model.safetensors")["model.norm.weight"]["dtype"]
        == "F32"
    )
    # a folder without the completion marker (torn by hand) is not reused
    (folder / streamed_export.MARKER_FILE).unlink()
    assert not export_checkpoint(*args, export_dtype="fp32").reused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folders left
    # a killed export's staging folder is removed once stale, a recent one (maybe live) kept
    stale, live = tmp_path / ".out.partial-1-dead", tmp_path / ".out.partial-2-live"
    for folder_ in (stale, live):
        folder_.mkdir()
    old = time.time() - streamed_export.STALE_STAGING_S - 60
    os.utime(stale, (old, old))
    export_checkpoint(*args, export_dtype="bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "out"]


def test_a_non_finite_tensor_fails_the_export_and_leaves_no_folder(tmp_path):
    case = _checkpoint(tmp_path, tie=True, dtype="bfloat16", poison=True)
    with pytest.raises(CheckpointError, match=r"up_proj\.weight.*NaN or Inf"):
        export_checkpoint(case["checkpoint"], case["config"].model, case["sha"])
    assert not (tmp_path / "export").exists() or not any((tmp_path / "export").iterdir())


def test_max_shard_size_and_file_plan():
    assert parse_max_shard_size("5GB") == 5 * 10**9
    assert parse_max_shard_size("512MiB") == 512 << 20
    assert parse_max_shard_size(1000) == 1000
    for bad in ("five", "0", "-3GB", "5 parsecs"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_max_shard_size(bad)

    def tensor(name, numel):
        return ExportTensor(name, "model." + name, (numel,), torch.float32, torch.bfloat16)

    files = plan_files([tensor("a", 10), tensor("b", 10), tensor("big", 100), tensor("c", 5)], 45)
    assert {name: [t.name for t in group] for name, group in files.items()} == {
        "model-00001-of-00003.safetensors": ["a", "b"],
        "model-00002-of-00003.safetensors": ["big"],
        "model-00003-of-00003.safetensors": ["c"],
    }
    assert list(plan_files([tensor("a", 10)], 45)) == ["model.safetensors"]


def test_export_dtype_follows_the_source_config():
    resolve = streamed_export.resolve_export_dtype
    assert resolve("auto", {"dtype": "bfloat16"}) == torch.bfloat16
    assert resolve("auto", {"torch_dtype": "float16"}) == torch.float16
    assert resolve("auto", {}) == torch.float32
    assert resolve("fp32", {"dtype": "bfloat16"}) == torch.float32
    with pytest.raises(ValueError, match="export_dtype 'int8'"):
        resolve("int8", {})
    with pytest.raises(ExportError, match="set export_dtype"):
        resolve("auto", {"dtype": "float8_e4m3fn"})


@pytest.mark.bench  # the smoke run of benchmarks/scale_register.py (make test-slow)
def test_the_benchmark_reports_both_paths_at_two_sizes(tmp_path):
    from benchmarks import scale_register

    report = scale_register.run(tmp_path, layers=(1, 2), hidden=64, intermediate=128, vocab=512)
    assert [size["parameters"] for size in report["sizes"]] == sorted(
        size["parameters"] for size in report["sizes"]
    )
    for size in report["sizes"]:
        assert set(size) >= {"layers", "parameters", "fp32_bytes", "old", "new"}
        assert size["old"]["peak_rss_bytes"] > 0 and size["new"]["peak_rss_bytes"] > 0
        assert size["old"]["dtype"] == "float32" and size["new"]["dtype"] == "bfloat16"
        assert size["new"]["files"] >= 1
    growth = report["growth_per_fp32_byte"]
    assert set(growth) == {"old", "new"} and all(math.isfinite(v) for v in growth.values())
    assert "peak RSS" in scale_register.table(report)


@pytest.mark.integration
def test_a_large_model_is_registered_without_loading_it(bf16_tied, mlflow_server, monkeypatch, tmp_path):
    """Above the load-back bound nothing calls from_pretrained: not the checks, not MLflow's
    logging of the folder; the version's model/ holds the bf16 shards and the index."""
    import mlflow
    from transformers import AutoModelForCausalLM

    from components.mlflow_access import RetryPolicy
    from components.register_model.register import register_checkpoint

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    monkeypatch.setattr(streamed_export, "LOAD_CHECK_MAX_PARAMETERS", 0)

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded during registration")

    with monkeypatch.context() as patched:
        patched.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
        result = register_checkpoint(
            str(bf16_tied["checkpoint"]),
            "rtp-test-streamed",
            "champion",
            retry=RetryPolicy(attempts=3, first_delay_s=0.2, max_delay_s=1.0),
            max_shard_size="40KB",
        )
    assert (result.version, result.created, result.model_kind) == ("1", True, "hf")
    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri="models:/rtp-test-streamed@champion", dst_path=str(tmp_path)
        )
    )
    files = {p.name for p in (local / "model").iterdir()}
    assert "model.safetensors.index.json" in files and "model-00001-of-" in " ".join(files)
    logits, dtype = _loaded_logits(local / "model")
    assert dtype == torch.bfloat16
    assert torch.equal(logits, _checkpoint_logits(bf16_tied, torch.bfloat16))
    (tmp_path / "c").mkdir()
    components = mlflow.transformers.load_model(
        "models:/rtp-test-streamed@champion", return_type="components", dst_path=str(tmp_path / "c")
    )
    assert components["model"].dtype == torch.bfloat16
