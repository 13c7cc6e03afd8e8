"""Conversations into example shards (trainer/chat_data.py) and training on them
(trainer/examples_data.py): the mask covers the assistant's tokens only, packed rows never
attend across examples, and the loss is the mean over the global batch's assistant tokens
whatever the micro-batch split, the world size or the packing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.hf_tiny import write_tiny_model
from trainer.chat_data import ChatRenderer, conversation, write_example_shards
from trainer.data import DataError
from trainer.examples_data import (
    ExampleSampler,
    ExampleSet,
    build_rows,
    load_examples,
    masked_loss,
    pack_rows,
    permute,
    stream_examples,
)

# A ChatML-style template (the layout SmolLM2 and Qwen2.5 use), written here: the tiny test
# tokenizer has none, as many base models' tokenizers have none.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"{i}+{i}?"}, {"role": "assistant", "content": f"{2 * i}"}]}
    for i in range(30)
] + [
    {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a fox."},
            {"role": "assistant", "content": "The quick brown fox."},
            {"role": "user", "content": "And a dog?"},
            {"role": "assistant", "content": "The lazy dog."},
        ]
    },
    {"prompt": "def add(a, b):", "completion": "    return a + b"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("chat") / "model", "llama", tie=True)


@pytest.fixture(scope="module")
def renderer(model_dir) -> ChatRenderer:
    return ChatRenderer(model_dir, CHATML)


def write_chat(folder: Path, records=CONVERSATIONS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def snapshot(out: Path) -> Path:
    """A prepared folder as the stage step lays it out: manifest.json listing every file."""
    files = [
        {"key": f"chat/{p.name}", "path": p.name, "size": p.stat().st_size}
        for p in sorted(out.iterdir())
        if p.is_file() and p.name != "manifest.json"
    ]
    (out / "manifest.json").write_text(json.dumps({"files": files}))
    return out


def test_the_mask_covers_exactly_the_assistants_turns(renderer):
    messages = conversation(CONVERSATIONS[30], "x")
    ids, mask = renderer.render(messages)
    assert len(ids) == len(mask)
    assistant = renderer.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert assistant == "The quick brown fox.<|im_end|>\nThe lazy dog.<|im_end|>\n"
    rest = renderer.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert "Name a fox." in rest and "Answer briefly." in rest and "quick brown" not in rest
    # tokenized piece by piece, the ids are still those of the whole rendered text
    whole = renderer.tokenizer.encode(renderer._text(messages, generation_prompt=False))
    assert ids == whole


def test_prompt_completion_records_and_bad_records(tmp_path):
    assert conversation({"prompt": "a", "completion": "b"}, "x")[1] == {"role": "assistant", "content": "b"}
    with pytest.raises(DataError, match=r"f\.jsonl:3: the conversation has no assistant message"):
        conversation({"messages": [{"role": "user", "content": "hi"}]}, "f.jsonl:3")
    with pytest.raises(DataError, match=r"message 0 must be"):
        conversation({"messages": [{"role": "robot", "content": "hi"}]}, "f.jsonl:1")
    with pytest.raises(DataError, match=r"expected \{\"messages\""):
        conversation({"text": "plain"}, "f.jsonl:1")


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line(model_dir):
    with pytest.raises(DataError, match=r"has no chat template: give one with --chat-template FILE"):
        ChatRenderer(model_dir)


def test_shards_index_split_and_overlong_rules(model_dir, tmp_path):
    source = write_chat(tmp_path / "in")
    index = write_example_shards(source, tmp_path / "out", model_dir, chat_template=CHATML)
    assert index["format"] == "rtp-example-shards" and index["conversations"] == len(CONVERSATIONS)
    assert index["examples"] == len(CONVERSATIONS) and index["truncated"] == 0
    train, holdout, _ = load_examples(snapshot(tmp_path / "out"))
    assert len(train) + len(holdout) == len(CONVERSATIONS) and len(holdout) >= 1
    # the split is by conversation: preparing a grown set keeps every conversation's side
    grown = write_chat(tmp_path / "grown", [*CONVERSATIONS, {"prompt": "more", "completion": "data"}])
    again = write_example_shards(grown, tmp_path / "out2", model_dir, chat_template=CHATML)
    sides = {s["split"]: s["examples"] for s in again["shards"]}
    assert sides["holdout"] >= len(holdout)
    # the tokens and mask files agree with the render
    renderer = ChatRenderer(model_dir, CHATML)
    seen = {tuple(train.example(i)[0].tolist()) for i in range(len(train))}
    seen |= {tuple(holdout.example(i)[0].tolist()) for i in range(len(holdout))}
    for record in CONVERSATIONS:
        assert tuple(renderer.render(conversation(record, "x"))[0]) in seen
    longest = max(len(renderer.render(conversation(r, "x"))[0]) for r in CONVERSATIONS)
    cut = write_example_shards(
        source, tmp_path / "cut", model_dir, chat_template=CHATML, max_tokens=longest - 1
    )
    assert cut["truncated"] >= 1 and cut["examples"] == len(CONVERSATIONS)
    dropped = write_example_shards(
        source, tmp_path / "drop", model_dir, chat_template=CHATML, max_tokens=longest - 1, overlong="drop"
    )
    assert dropped["dropped_overlong"] == cut["truncated"]
    assert dropped["examples"] == len(CONVERSATIONS) - cut["truncated"]


def test_epochs_are_permutations_and_a_pure_function_of_the_seed():
    for n in (1, 2, 7, 64, 1000):
        order = permute(np.arange(n), n, key=5)
        assert sorted(order.tolist()) == list(range(n))
    assert permute(np.arange(1000), 1000, 5).tolist() != list(range(1000))
    stream = stream_examples(np.arange(30), 10, seed=3)
    assert [sorted(stream[e * 10 : (e + 1) * 10].tolist()) for e in range(3)] == [list(range(10))] * 3
    assert stream[:10].tolist() != stream[10:20].tolist()  # each epoch its own order
    assert stream_examples(np.arange(12, 17), 10, seed=3).tolist() == stream[12:17].tolist()


def test_rows_pack_in_order_and_pad_to_the_ranks():
    assert pack_rows([3, 3, 5, 2], window=8, packing=True) == [[0, 1], [2, 3]]
    assert pack_rows([3, 3, 5, 2], window=8, packing=False) == [[0], [1], [2], [3]]
    examples = [(np.arange(1, 4), np.array([0, 1, 1])), (np.arange(4, 8), np.array([0, 0, 1, 1]))]
    ids, positions, targets, total = build_rows(examples, window=8, packing=True, pad_id=0, rows_multiple=2)
    assert ids.shape == (2, 8) and ids[1].eq(0).all()  # one row of data, one empty row
    assert positions[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    # targets: 2 and 3 from the first example, 6 and 7 from the second; never the second's first token
    assert targets[0].tolist() == [1, 1, 0, 0, 1, 1, 0] and total == 4


@pytest.fixture(scope="module")
def tiny_model(model_dir):
    from trainer.config import ModelConfig
    from trainer.models import model_spec

    torch.manual_seed(0)
    return model_spec("hf").build(
        ModelConfig(kind="hf", model_dir=str(model_dir), init="pretrained"), torch.device("cpu")
    )


def _examples(renderer, records):
    out = []
    for record in records:
        ids, mask = renderer.render(conversation(record, "x"))
        out.append((np.asarray(ids), np.asarray(mask, dtype=np.uint8)))
    return out


def test_a_packed_row_scores_each_example_as_if_alone(tiny_model, renderer):
    examples = _examples(renderer, CONVERSATIONS[:4])
    window = 128  # the tiny model's max_position_embeddings
    packed = build_rows(examples, window, packing=True, pad_id=0, rows_multiple=1)
    alone = build_rows(examples, window, packing=False, pad_id=0, rows_multiple=1)
    assert packed[0].shape[0] < alone[0].shape[0]  # several examples share a row
    from trainer.examples_data import ExampleBatch

    with torch.no_grad():
        loss_packed = masked_loss(tiny_model, ExampleBatch(packed[0], packed[1], packed[2], 1.0))
        loss_alone = masked_loss(tiny_model, ExampleBatch(alone[0], alone[1], alone[2], 1.0))
        # the packed example's logits equal those of the example run alone
        first, second = examples[0][0], examples[1][0]
        both = torch.from_numpy(np.concatenate([first, second]))[None]
        positions = torch.cat([torch.arange(len(first)), torch.arange(len(second))])[None]
        logits_packed = tiny_model(input_ids=both, position_ids=positions, use_cache=False).logits[
            0, len(first) :
        ]
        logits_alone = tiny_model(input_ids=torch.from_numpy(second)[None], use_cache=False).logits[0]
    assert packed[3] == alone[3]
    torch.testing.assert_close(logits_packed, logits_alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_packed, loss_alone, rtol=1e-5, atol=1e-5)
    # and a packed row without positions restarting would let the second example see the first
    with torch.no_grad():
        leaked = tiny_model(input_ids=both, use_cache=False).logits[0, len(first) :]
    assert not torch.allclose(leaked, logits_alone, atol=1e-3)


class _Memory(ExampleSet):
    """In-memory examples for sampler tests."""

    def __init__(self, examples):
        self._examples = examples

    def __len__(self):
        return len(self._examples)

    def example(self, index):
        return self._examples[index]


def _step_loss_and_grads(model, sampler_args, world, batch_size, packing):
    """Run one step's micro-batches of every rank (in one process) and combine as FSDP does:
    the reported loss is the ranks' sum / world, gradients the ranks' mean."""
    model.zero_grad()
    reported = 0.0
    for rank in range(world):
        sampler = ExampleSampler(
            **sampler_args, batch_size=batch_size, rank=rank, world_size=world, packing=packing
        )
        rank_loss = 0.0
        for micro in sampler.micro_batches(step=1):
            loss = masked_loss(model, micro) / world  # FSDP's mean over ranks
            loss.backward()
            rank_loss += float(loss) * world
        reported += rank_loss
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return reported / world, grads


def test_the_loss_is_the_global_mean_whatever_the_split_world_or_packing(tiny_model, renderer):
    examples = _Memory(_examples(renderer, CONVERSATIONS))
    args = {"examples": examples, "seq_len": 127, "seed": 11, "global_batch": 8, "pad_id": 0}
    reference_loss, reference_grads = _step_loss_and_grads(
        tiny_model, args, world=1, batch_size=8, packing=False
    )
    # the reference is the plain mean over the global batch's assistant tokens
    sampler = ExampleSampler(**args, batch_size=8, rank=0, world_size=1, packing=False)
    ids, positions, targets, _total = sampler.step_rows(1)
    with torch.no_grad():
        logits = tiny_model(input_ids=ids[:, :-1], position_ids=positions[:, :-1], use_cache=False).logits
    chosen = targets.bool()
    plain = torch.nn.functional.cross_entropy(logits[chosen], ids[:, 1:][chosen])
    assert reference_loss == pytest.approx(float(plain), rel=1e-5)
    for world, batch_size, packing in [(1, 1, False), (2, 1, False), (2, 2, True), (1, 3, True)]:
        loss, grads = _step_loss_and_grads(tiny_model, args, world, batch_size, packing)
        assert loss == pytest.approx(reference_loss, rel=1e-5), (world, batch_size, packing)
        for name, grad in reference_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_masked_tokens_never_reach_the_loss_or_its_gradient(tiny_model, renderer):
    from trainer.examples_data import ExampleBatch

    examples = _examples(renderer, CONVERSATIONS[30:31])
    ids, positions, targets, total = build_rows(examples, 128, True, 0, 1)
    batch = ExampleBatch(ids, positions, targets, 1.0 / total)
    embeddings = tiny_model.get_input_embeddings()
    captured = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured["logits"] = output

    # The final norm's output at position t reaches the loss only through the head at t.
    handle = tiny_model.model.norm.register_forward_hook(keep)
    try:
        tiny_model.zero_grad()
        masked_loss(tiny_model, batch).backward()
    finally:
        handle.remove()
    grad = captured["logits"].grad[0]
    not_targets = ~targets[0].bool()
    assert grad.shape[0] == targets.shape[1]
    assert grad[not_targets].abs().max() == 0  # no gradient from a non-assistant position
    assert grad[targets[0].bool()].abs().max() > 0
    # changing a label where the mask is 0 (a user token) leaves the loss unchanged
    user_position = int(torch.nonzero(not_targets)[5])
    changed = ids.clone()
    changed[0, user_position + 1] = (changed[0, user_position + 1] + 1) % 200
    with torch.no_grad():
        before = masked_loss(tiny_model, batch)
        labels_only = ExampleBatch(ids, positions, targets, batch.scale)
        out = tiny_model(input_ids=ids[:, :-1], position_ids=positions[:, :-1], use_cache=False).logits
        after = (
            torch.nn.functional.cross_entropy(
                out[targets.bool()].float(), changed[:, 1:][targets.bool()], reduction="sum"
            )
            * batch.scale
        )
    assert float(before) == pytest.approx(float(after), rel=1e-6)
    assert embeddings is tiny_model.get_input_embeddings() and labels_only.scale == batch.scale


def test_a_token_snapshot_is_not_example_shards(tmp_path, model_dir):
    from tests.hf_tiny import write_corpus, write_token_snapshot

    snapshot = write_token_snapshot(
        write_corpus(tmp_path / "corpus", documents=12), model_dir, tmp_path / "snap"
    )
    with pytest.raises(DataError, match=r"holds no example shards .* `rtp prepare-data --format chat"):
        load_examples(snapshot)


def test_many_shards_are_read_with_a_bounded_number_mapped(model_dir, tmp_path, monkeypatch):
    """A large corpus has thousands of shards: reading examples from all of them keeps at most
    MAX_MAPPED_SHARDS mapped (three descriptors each), and every example reads the same as
    when each shard was mapped on its own."""
    import os

    from trainer import examples_data

    monkeypatch.setattr(examples_data, "MAX_MAPPED_SHARDS", 3)
    records = [
        {
            "messages": [
                {"role": "user", "content": f"{i} times two?"},
                {"role": "assistant", "content": f"{2 * i}"},
            ]
        }
        for i in range(60)
    ]
    index = write_example_shards(
        write_chat(tmp_path / "in", records),
        tmp_path / "out",
        model_dir,
        chat_template=CHATML,
        shard_bytes=64,
    )
    train, _, _ = load_examples(snapshot(tmp_path / "out"))
    shards = len([s for s in index["shards"] if s["split"] == "train"])
    assert shards > 10, index["shards"]  # many more shards than may be mapped
    descriptors = len(os.listdir("/proc/self/fd"))
    read = [train.example(i) for i in range(len(train))] + [
        train.example(i) for i in reversed(range(len(train)))
    ]
    assert train.open_shards() <= 3
    assert len(os.listdir("/proc/self/fd")) <= descriptors + 3 * 3
    # The same tokens and masks as a set that maps every shard afresh (copies, not views of
    # mappings that were since dropped).
    alone = [load_examples(tmp_path / "out")[0].example(i) for i in range(len(train))]
    for (ids, mask), (ids_alone, mask_alone) in zip(read, alone + alone[::-1], strict=True):
        assert ids.tolist() == ids_alone.tolist() and mask.tolist() == mask_alone.tolist()
