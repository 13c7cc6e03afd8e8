"""The model registry on one CPU process: the byte LM entry, Hugging Face causal LMs of four
architectures built offline from config objects, export -> from_pretrained, pretrained
loading, tokenized data, and the one-line errors bad input gets."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.hf_tiny import ARCHITECTURES, train_tokenizer, write_corpus, write_tiny_model, write_token_snapshot
from trainer.config import ConfigError, ModelConfig, build_config, resolve_config
from trainer.data import DataError, DocumentSplit, check_tokenizer, load_tokens, split_files
from trainer.models import ModelError, model_spec
from trainer.tokenized_data import read_documents, token_dtype

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-models")
    return {arch: write_tiny_model(root / arch, arch, tie=arch == "qwen2") for arch in ARCHITECTURES}


def hf_config(folder: Path, init: str = "pretrained") -> ModelConfig:
    return ModelConfig(kind="hf", model_dir=str(folder), init=init, seq_len=16)


def batch(seed: int = 0, vocab: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(seed))


# --- registry and byte LM -----------------------------------------------------------------


def test_unknown_kind_lists_the_registry():
    with pytest.raises(ModelError, match="byte-lm, hf"):
        model_spec("gpt-7")
    with pytest.raises(ConfigError, match=r"unknown model\.kind 'gpt-7'"):
        build_config("tiny-cpu", ["model.kind=gpt-7"])


def test_config_rules_for_hf_models():
    with pytest.raises(ConfigError, match=r"needs model\.model_dir"):
        build_config("tiny-cpu", ["model.kind=hf"])
    with pytest.raises(
        ConfigError, match=r"with model\.kind=byte-lm must hold a byte LM's weights\.safetensors"
    ):
        _byte_lm_with_dir()
    with pytest.raises(ConfigError, match="pretrained, random"):
        build_config("tiny-cpu", ["model.init=warm"])
    # A model folder alone selects the Hugging Face entry unless it is a byte LM folder.
    assert resolve_config(named={"model_dir": "/models/tiny"}).model.kind == "hf"
    assert build_config("tiny-cpu", ["model.init=random"]).model.kind == "byte-lm"


def test_a_byte_lm_folder_gives_its_kind_architecture_and_weights(tmp_path):
    from trainer.config_sections import ModelConfig
    from trainer.models import byte_lm

    saved = ModelConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)
    torch.manual_seed(5)
    original = byte_lm.ByteLM(saved)
    byte_lm.write_files(original.state_dict(), saved, tmp_path / "parent")
    # The preset's architecture differs; the folder's wins, as a Hugging Face config.json does.
    config = build_config("tiny-cpu", [f"model.model_dir={tmp_path / 'parent'}"])
    assert config.model.kind == "byte-lm"
    assert (config.model.seq_len, config.model.d_model, config.model.n_layers, config.model.n_heads) == (
        16,
        32,
        1,
        2,
    )
    warm = model_spec("byte-lm").build(config.model, torch.device("cpu"))
    assert all(torch.equal(warm.state_dict()[k], v) for k, v in original.state_dict().items())
    (tmp_path / "parent" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no readable byte LM config\.json"):
        build_config("tiny-cpu", [f"model.model_dir={tmp_path / 'parent'}"])


def _byte_lm_with_dir() -> None:
    from trainer.config import TrainConfig, validate

    config = TrainConfig()
    config.model.model_dir = "/m"
    validate(config)


def test_byte_lm_model_hash_is_what_it_was_before_the_registry():
    config = build_config("tiny-cpu")
    old_fields = {
        k: v for k, v in dataclasses.asdict(config.model).items() if k not in ("kind", "model_dir", "init")
    }
    before = hashlib.sha256(json.dumps(old_fields, sort_keys=True).encode()).hexdigest()[:16]
    assert config.model_hash() == before


def test_byte_lm_units_are_its_blocks_and_export_round_trips(tmp_path):
    spec = model_spec("byte-lm")
    config = ModelConfig(d_model=32, n_layers=3, n_heads=2, seq_len=16)
    torch.manual_seed(0)
    model = spec.build(config, torch.device("cpu"))
    assert spec.fsdp_units(model) == list(model.blocks)
    assert not spec.init_after_sharding
    spec.export(model.state_dict(), config, tmp_path / "out")
    loaded = spec.load_exported(tmp_path / "out")
    x = batch(vocab=256)
    assert torch.equal(loaded(x[:, :-1]), model.eval()(x[:, :-1]))
    with pytest.raises(ModelError, match="already holds files"):
        spec.export(model.state_dict(), config, tmp_path / "out")


# --- Hugging Face causal LMs --------------------------------------------------------------


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fsdp_units_are_the_decoder_layers(architecture, tiny_models):
    spec = model_spec("hf")
    model = spec.build(hf_config(tiny_models[architecture]), torch.device("meta"))
    units = spec.fsdp_units(model)
    assert len(units) == 2
    assert {type(unit).__name__ for unit in units} <= set(model._no_split_modules)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    # Embedding and head stay in the root unit.
    assert id(model.get_input_embeddings().weight) not in in_units
    assert id(model.get_output_embeddings().weight) not in in_units


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_pretrained_load_equals_the_saved_weights(architecture, tiny_models):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_models[architecture]), dtype=torch.float32)
    model = model_spec("hf").build(hf_config(tiny_models[architecture]), torch.device("cpu"))
    ours = model.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(ours[key], value), key
    assert torch.equal(model.eval()(batch()[:, :-1]).logits, reference.eval()(batch()[:, :-1]).logits)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(architecture, tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = model_spec("hf")
    config = hf_config(tiny_models[architecture], init="random")
    torch.manual_seed(1)
    model = spec.build(config, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):  # trained: the weights differ from any initialization
        spec.loss(model, batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    out = spec.export(model.state_dict(), config, tmp_path / "export")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32).eval()
    x = batch(9)[:, :-1]
    assert torch.equal(loaded(x).logits, model.eval()(x).logits)
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tokenizer.decode(tokenizer.encode("def add(a, b):")) == "def add(a, b):"
    assert not list(tmp_path.glob(".export.partial-*"))


def test_random_init_is_seeded_and_trains(tiny_models):
    spec = model_spec("hf")
    config = hf_config(tiny_models["llama"], init="random")

    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return spec.build(config, torch.device("cpu")).state_dict()

    a, b, c = weights(3), weights(3), weights(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(
        a["model.norm.weight"], torch.ones_like(a["model.norm.weight"])
    )  # transformers' own init


def test_architecture_hash_follows_config_json(tiny_models, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(tiny_models["mistral"], folder)
    base = build_config("tiny-cpu", ["model.kind=hf", f"model.model_dir={folder}"])
    before = base.model_hash()
    assert (
        build_config("tiny-cpu", ["model.kind=hf", f"model.model_dir={folder}", "run.seed=3"]).model_hash()
        == before
    )
    raw = json.loads((folder / "config.json").read_text())
    raw["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(raw))
    assert base.model_hash() != before


# --- bad model folders: one clear line ----------------------------------------------------


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ModelError, match=r"has no config\.json"):
        model_spec("hf").build(hf_config(tmp_path), torch.device("meta"))
    with pytest.raises(ModelError, match="is not a folder"):
        model_spec("hf").build(hf_config(tmp_path / "absent"), torch.device("meta"))


def test_unknown_architecture(tiny_models, tmp_path):
    folder = tmp_path / "alien"
    shutil.copytree(tiny_models["llama"], folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["model_type"] = "llama-from-mars"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="'llama-from-mars' is not a causal LM architecture transformers"):
        model_spec("hf").build(hf_config(folder), torch.device("meta"))


def test_weights_not_matching_the_config(tiny_models, tmp_path):
    folder = tmp_path / "mismatch"
    shutil.copytree(tiny_models["qwen2"], folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["vocab_size"] = 400
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ModelError, match=r"do not match its config\.json: model\.embed_tokens\.weight is \(320, 64\)"
    ):
        model_spec("hf").build(hf_config(folder), torch.device("cpu"))
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"holds no \*\.safetensors weights"):
        model_spec("hf").build(hf_config(folder), torch.device("cpu"))


# --- tokenized data -----------------------------------------------------------------------


def test_token_shards_record_the_tokenizer_and_train_the_model(tiny_models, tmp_path):
    model_dir = tiny_models["gpt_neox"]
    corpus = write_corpus(tmp_path / "corpus")
    snapshot = write_token_snapshot(corpus, model_dir, tmp_path / "snapshot", shard_bytes=600)
    index = json.loads((snapshot / "files" / "index.json").read_text())
    tokenizer = model_spec("hf").tokenizer(hf_config(model_dir))
    assert index["tokenizer"] == tokenizer.identity and index["dtype"] == "uint16"
    assert index["documents"] == 40 and len(index["shards"]) >= 3
    first_text = (corpus / "doc-000.txt").read_text()
    side = (
        "holdout"
        if DocumentSplit(index["split"]["holdout_fraction"]).in_holdout(first_text.encode())
        else "train"
    )
    shard = np.frombuffer((snapshot / "files" / f"{side}-00000.bin").read_bytes(), dtype="<u2")
    first_document = shard[: list(shard).index(tokenizer.eos_id)]
    assert tokenizer.decode(first_document.tolist()) == first_text  # the first of its side

    check_tokenizer(snapshot, tokenizer.identity)  # the same tokenizer: accepted
    train, _ = split_files(snapshot, 0.2)
    tokens = load_tokens(train)
    assert (
        tokens.dtype == np.dtype("<u2")
        and int(tokens.gather([0], tokens.numel()).max()) < tokenizer.vocab_size
    )
    assert sum(f.size for f in train) == 2 * tokens.numel()

    other = tmp_path / "other-tokenizer"
    train_tokenizer(other, vocab_size=280)
    with pytest.raises(
        DataError,
        match=r"was tokenized with tokenizer .* but the model uses tokenizer .*rtp prepare-data --tokenizer",
    ):
        check_tokenizer(snapshot, model_spec("hf").tokenizer(hf_config(other)).identity)
    with pytest.raises(DataError, match="but the model uses bytes"):
        check_tokenizer(snapshot, model_spec("byte-lm").tokenizer(ModelConfig()).identity)


def test_byte_data_is_refused_for_a_tokenizer_model(tiny_models, dataset_dir):
    identity = model_spec("hf").tokenizer(hf_config(tiny_models["llama"])).identity
    with pytest.raises(DataError, match="tokenized as bytes"):
        check_tokenizer(dataset_dir, identity)
    check_tokenizer(dataset_dir, "bytes")


def test_vocabulary_decides_the_token_dtype():
    assert token_dtype(32_000).itemsize == 2 and token_dtype(65_536).itemsize == 2
    assert token_dtype(128_256).itemsize == 4  # Llama 3


def test_bad_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2 has no string 'text' field"):
        read_documents(path)


def test_bf16_weights_load_into_fp32_parameters(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_tiny_model(tmp_path / "bf16", "qwen2")
    AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).save_pretrained(str(folder))
    model = model_spec("hf").build(hf_config(folder), torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ours = model.state_dict()
    assert all(torch.equal(ours[key], value) for key, value in reference.state_dict().items())


def test_a_model_too_large_for_the_rank_is_refused_before_allocation(tiny_models, tmp_path):
    from transformers import AutoConfig

    from trainer.models.spec import require_training_memory

    folder = tmp_path / "llama-70b-shape"
    folder.mkdir()
    AutoConfig.for_model(
        "llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128_256,
    ).save_pretrained(str(folder))  # fmt: skip
    spec = model_spec("hf")
    config = hf_config(folder, init="random")
    huge = spec.build(config, torch.device("meta"))
    with pytest.raises(ModelError, match=r"needs at least 1\d\d\d\.\d GiB per rank .* use more ranks"):
        require_training_memory(huge, spec.fsdp_units(huge), torch.device("cpu"))
    small = spec.build(hf_config(tiny_models["llama"]), torch.device("meta"))
    assert require_training_memory(small, spec.fsdp_units(small), torch.device("cpu")) < 2**30
