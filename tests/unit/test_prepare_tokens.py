"""`rtp prepare-data --tokenizer` on the command line: text, JSON Lines and Parquet inputs,
the token dtype the vocabulary decides, EOS between documents, the tokenizer identity in the
index, uploads to S3 (a moto server), the unchanged byte format, and the one-line errors for
bad input; plus `rtp local --model-source`'s checks, made before any server starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from rtp_cli.errors import UserError
from rtp_cli.local_model import plan_model_run
from rtp_cli.main import main
from tests.hf_tiny import CORPUS, write_corpus, write_tiny_model
from trainer.data import DocumentSplit
from trainer.models.hf_causal_lm import HFTokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


def prepare(*args: str) -> int:
    return main(["prepare-data", *args])


def read_index(folder: Path) -> dict:
    return json.loads((folder / "index.json").read_text())


def documents_of(ids: np.ndarray, eos_id: int) -> list[list[int]]:
    """Split a shard's ids at EOS; every document must end with one."""
    assert ids[-1] == eos_id, "the last document ends with EOS"
    ends = np.flatnonzero(ids == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ids[s:e].tolist() for s, e in zip(starts, ends, strict=True)]


def test_text_jsonl_and_parquet_become_eos_separated_uint16_ids(tiny_llama, tmp_path, s3_endpoint):
    corpus = write_corpus(tmp_path / "corpus", documents=40)
    out = tmp_path / "shards"
    args = ["--corpus", str(corpus), "--out-dir", str(out), "--tokenizer", str(tiny_llama)]
    dest = ["--dest", "s3://tokens/corpus/", "--endpoint-url", s3_endpoint, "--shard-mib", "0.001"]
    from components.stage_data.s3_clients import s3_client

    s3_client(s3_endpoint).create_bucket(Bucket="tokens")  # prepare-data never creates buckets
    assert prepare(*args, *dest, "--workers", "3") == 0

    tokenizer = HFTokenizer(tiny_llama)
    index = read_index(out)
    assert index["tokenizer"] == tokenizer.identity and index["version"] == 2
    assert index["dtype"] == "uint16" and index["vocab_size"] == tokenizer.vocab_size
    assert index["document_separator"] == tokenizer.eos_id
    assert index["documents"] == 40 and len(index["shards"]) > 1
    decoded: dict[str, list[str]] = {"train": [], "holdout": []}
    for shard in index["shards"]:
        ids = np.frombuffer((out / shard["name"]).read_bytes(), dtype="<u2")
        assert len(ids) == shard["tokens"]
        assert 2 * len(ids) <= int(2**20 * 0.001) or shard["documents"] == 1, "shards keep to --shard-mib"
        documents = documents_of(ids, tokenizer.eos_id)
        assert len(documents) == shard["documents"]
        decoded[shard["split"]] += [tokenizer.decode(doc) for doc in documents]
    # text files (one document each), then the .jsonl lines, then the .parquet rows: corpus
    # order within each side, and each document on the side its content hashes to
    texts = [f"{CORPUS[i % len(CORPUS)]}document {i}\n" for i in range(40)]
    split = DocumentSplit(index["split"]["holdout_fraction"])
    held = [split.in_holdout(text.encode()) for text in texts]
    assert decoded["holdout"] == [t for t, h in zip(texts, held, strict=True) if h] and decoded["holdout"]
    assert decoded["train"] == [t for t, h in zip(texts, held, strict=True) if not h]

    listing = s3_client(s3_endpoint).list_objects_v2(Bucket="tokens", Prefix="corpus/")
    keys = sorted(obj["Key"].removeprefix("corpus/") for obj in listing["Contents"])
    assert keys == sorted(["index.json", *(s["name"] for s in index["shards"])])


def test_the_same_corpus_gives_the_same_shards_whatever_the_workers(tiny_llama, tmp_path):
    corpus = write_corpus(tmp_path / "corpus", documents=12)
    for workers in ("1", "4"):
        args = ["--corpus", str(corpus), "--out-dir", str(tmp_path / workers), "--tokenizer", str(tiny_llama)]
        assert prepare(*args, "--workers", workers) == 0
    assert read_index(tmp_path / "1")["shards"] == read_index(tmp_path / "4")["shards"]


def test_a_vocabulary_over_65536_tokens_stores_uint32_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 70_000)}}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir = tmp_path / "big-vocab"
    PreTrainedTokenizerFast(
        tokenizer_object=word_level, eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(str(model_dir))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("w69999 w5 w65537")
    (corpus / "b.jsonl").write_text(json.dumps({"text": "w2 w65536"}) + "\n")
    out = tmp_path / "shards"
    assert prepare("--corpus", str(corpus), "--out-dir", str(out), "--tokenizer", str(model_dir)) == 0

    index = read_index(out)
    assert index["dtype"] == "uint32" and index["vocab_size"] == 70_000
    shards = [np.frombuffer((out / s["name"]).read_bytes(), dtype="<u4").tolist() for s in index["shards"]]
    assert sorted(shards) == [[2, 65536, 0], [69999, 5, 65537, 0]]  # ids above 65535 survive


def test_without_a_tokenizer_the_byte_format_is_unchanged(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("first")
    (corpus / "b.py").write_text("second = 2\n")
    out = tmp_path / "shards"
    assert prepare("--corpus", str(corpus), "--out-dir", str(out)) == 0
    index = read_index(out)
    assert (index["version"], index["tokenizer"], index["dtype"]) == (1, "bytes", "uint8")
    shards = sorted((out / s["name"]).read_bytes() for s in index["shards"])
    assert shards == [b"first\n", b"second = 2\n\n"]  # two documents: one on each side


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing-folder", r"--tokenizer .*missing-folder: no such folder"),
        ("no-tokenizer-files", r"--tokenizer .*no-tokenizer-files holds no tokenizer files"),
        ("bad-jsonl", r"bad\.jsonl:2 is not JSON"),
        ("jsonl-without-text", r"notext\.jsonl:1 has no string 'text' field"),
        ("missing-corpus", r"corpus .*nowhere does not exist"),
    ],
)
def test_bad_input_gets_one_line(case, expected, tiny_llama, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "fine.txt").write_text("fine")
    tokenizer_dir = tiny_llama
    if case == "missing-folder":
        tokenizer_dir = tmp_path / "missing-folder"
    elif case == "no-tokenizer-files":
        tokenizer_dir = tmp_path / "no-tokenizer-files"
        tokenizer_dir.mkdir()
        (tokenizer_dir / "config.json").write_text("{}")
    elif case == "bad-jsonl":
        (corpus / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    elif case == "jsonl-without-text":
        (corpus / "notext.jsonl").write_text('{"body": "no text"}\n')
    elif case == "missing-corpus":
        corpus = tmp_path / "nowhere"
    code = prepare(
        "--corpus", str(corpus), "--out-dir", str(tmp_path / "out"), "--tokenizer", str(tokenizer_dir)
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("rtp prepare-data: error: ")
    assert re.search(expected, err[-1]), err[-1]
    assert not (tmp_path / "out" / "index.json").exists()


def test_a_failed_run_leaves_no_index_vouching_for_its_shards(tiny_llama, tmp_path):
    corpus = write_corpus(tmp_path / "corpus", documents=6)
    out = tmp_path / "shards"
    args = ["--corpus", str(corpus), "--out-dir", str(out), "--tokenizer", str(tiny_llama)]
    assert prepare(*args) == 0 and (out / "index.json").is_file()
    (corpus / "zz-bad.jsonl").write_text("{oops\n")
    assert prepare(*args) == 2
    assert not (out / "index.json").exists(), "the earlier index must not describe this run's shards"


# --- rtp local --model-source: which combinations work ------------------------------------


def test_model_source_plans(tiny_llama, tmp_path):
    local = plan_model_run(str(tiny_llama), "")
    assert (local.name, local.folder) == ("tiny-llama", tiny_llama.resolve())
    remote = plan_model_run("s3://bucket/models/my-llama/", "s3://bucket/tokens/")
    assert (remote.name, remote.folder) == ("my-llama", None)

    with pytest.raises(UserError, match=r"needs --source s3://… with data tokenized by its tokenizer"):
        plan_model_run("s3://bucket/models/my-llama/", "")
    with pytest.raises(UserError, match=r"with --source, upload the model folder to S3 too"):
        plan_model_run(str(tiny_llama), "s3://bucket/tokens/")
    with pytest.raises(UserError, match=r"no such folder"):
        plan_model_run(str(tmp_path / "absent"), "")
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    with pytest.raises(UserError, match=r"has no config\.json"):
        plan_model_run(str(no_config), "")


def test_a_tiny_models_vocabulary_is_the_tokenizers_rounded_up(tmp_path):
    from rtp_support.tiny_models import write_tiny_model as write_model

    folder = write_model(tmp_path / "tiny-qwen2", "qwen2", texts=CORPUS, tokenizer_vocab_size=300)
    config = json.loads((folder / "config.json").read_text())
    tokenizer = HFTokenizer(folder)
    assert config["model_type"] == "qwen2" and tokenizer.vocab_size == 300
    assert config["vocab_size"] == 320  # 300 rounded up to a multiple of 64
    with pytest.raises(ValueError, match="smaller than the tokenizer's 300 tokens"):
        write_model(tmp_path / "too-small", "llama", texts=CORPUS, tokenizer_vocab_size=300, vocab_size=256)
