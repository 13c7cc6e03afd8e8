"""Conversations made into example shards: token ids and an assistant-only loss mask.

`write_example_shards` reads JSON Lines conversations — `{"messages": [{"role", "content"},
...]}` or `{"prompt": ..., "completion": ...}` — renders each with the model's own chat
template (`apply_chat_template`, or a template given as a file when the tokenizer has none)
and writes, per side of the split, `<side>-NNNNN.bin` (token ids, uint16 or uint32),
`<side>-NNNNN.mask` (one uint8 per token: 1 on assistant tokens, the only ones trained on)
and `<side>-NNNNN.offsets` (int64: where each example starts, then the end), with an
`index.json` of format `rtp-example-shards` written last (docs/fine-tuning.md).

Which tokens are the assistant's: the template's `{% generation %}` markers when it has
them (transformers' `return_assistant_tokens_mask`), else the spans found by rendering
prefixes: the text between `messages[:i]` rendered with the generation prompt and
`messages[:i + 1]` rendered is assistant message i's (its content and the template's end
of turn). The text is tokenized segment by segment, so the mask is exact at every boundary.

The split is by conversation (a hash of its canonical JSON, `trainer.data.DocumentSplit`), so a
conversation keeps its side when the data grows. An example longer than `max_tokens` is cut to
its first `max_tokens` tokens (`overlong="truncate"`) or left out (`"drop"`); one that has no
assistant token left is left out; both are counted in the index. Conversations are read and
written one file at a time, line by line: memory does not grow with the data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import SHARD_INDEX_NAME, DataError, DocumentSplit, document_digest

FORMAT = "rtp-example-shards"
FORMAT_VERSION = 1
DEFAULT_SHARD_BYTES = 64 * 2**20
OVERLONG_RULES = ("truncate", "drop")
OFFSETS_DTYPE = np.dtype("<i8")
MASK_DTYPE = np.dtype("u1")
ROLES = ("system", "user", "assistant", "tool")


def conversation_files(source: Path) -> list[Path]:
    """`source` itself, or every `.jsonl` file under it, sorted."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise DataError(f"chat data {source} does not exist: give a .jsonl file or a folder of them")
    files = [p for p in sorted(source.rglob("*.jsonl")) if p.is_file() and not p.is_symlink()]
    if not files:
        raise DataError(f"chat data folder {source} holds no .jsonl files")
    return files


def conversation(record: Any, where: str) -> list[dict[str, str]]:
    """The messages of one JSON Lines record; DataError says what is wrong and where."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        for number, message in enumerate(messages):
            if (
                not isinstance(message, dict)
                or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)
            ):
                raise DataError(
                    f"{where}: message {number} must be {{'role': one of {', '.join(ROLES)}, "
                    f"'content': a string}}, got {json.dumps(message)[:120]}"
                )
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: the conversation has no assistant message: nothing to train on")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if (
        isinstance(record, dict)
        and isinstance(record.get("prompt"), str)
        and isinstance(record.get("completion"), str)
    ):
        return [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
    raise DataError(
        f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}} or '
        '{"prompt": ..., "completion": ...}'
    )


def read_conversations(path: Path) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(where, messages) of each non-blank line of a JSON Lines file, read line by line."""
    with path.open("r", encoding="utf-8") as handle:
        try:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where} is not JSON ({exc.msg})") from None
                yield where, conversation(record, where)
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 ({exc})") from None


class ChatRenderer:
    """A tokenizer with its chat template: messages -> (ids, assistant mask)."""

    def __init__(self, tokenizer_dir: Path, chat_template: str | None = None) -> None:
        from trainer.models.hf_causal_lm import HFTokenizer

        self.tokenizer = HFTokenizer(Path(tokenizer_dir))
        self._hf = self.tokenizer._tokenizer  # the transformers tokenizer
        template = chat_template or getattr(self._hf, "chat_template", None)
        if not template:
            raise DataError(
                f"the tokenizer in {tokenizer_dir} has no chat template: give one with --chat-template "
                "FILE (a Jinja template, as in a model's chat_template.jinja)"
            )
        self.template = str(template)
        self.template_sha256 = hashlib.sha256(self.template.encode()).hexdigest()
        self.uses_generation_markers = (
            "{% generation %}" in self.template or "{%- generation %}" in self.template
        )

    def _text(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return str(
            self._hf.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def segments(self, messages: list[dict[str, str]], where: str = "") -> list[tuple[str, bool]]:
        """The rendered conversation as (text, is the assistant's) pieces, in order."""
        full = self._text(messages, generation_prompt=False)
        pieces: list[tuple[str, bool]] = []
        done = 0
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._text(messages[:index], generation_prompt=True) if index else ""
            through = self._text(messages[: index + 1], generation_prompt=False)
            if not (full.startswith(through) and through.startswith(before) and len(before) >= done):
                raise DataError(
                    f"{where}: the chat template does not render this conversation incrementally (the text "
                    f"up to assistant message {index} is not a prefix of the whole), so its assistant tokens "
                    "cannot be found: use a template with {% generation %} markers or one that renders turns "
                    "in order"
                )
            pieces.append((full[done : len(before)], False))
            pieces.append((full[len(before) : len(through)], True))
            done = len(through)
        pieces.append((full[done:], False))
        return [(text, assistant) for text, assistant in pieces if text]

    def render(self, messages: list[dict[str, str]], where: str = "") -> tuple[list[int], list[int]]:
        """(token ids, mask): mask is 1 on the tokens of the assistant's turns."""
        if self.uses_generation_markers:
            out: Any = self._hf.apply_chat_template(
                messages,
                chat_template=self.template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            return list(out["input_ids"]), [int(bool(m)) for m in out["assistant_masks"]]
        ids: list[int] = []
        mask: list[int] = []
        for text, assistant in self.segments(messages, where):
            piece = self.tokenizer.encode(text)
            ids.extend(piece)
            mask.extend([int(assistant)] * len(piece))
        return ids, mask


@dataclass(slots=True)
class _SideWriter:
    """One side's shards: ids, mask and offsets files of at most `shard_bytes` of ids."""

    out_dir: Path
    side: str
    shard_bytes: int
    dtype: np.dtype
    ids: bytearray = field(default_factory=bytearray)
    mask: bytearray = field(default_factory=bytearray)
    offsets: list[int] = field(default_factory=lambda: [0])
    assistant_tokens: int = 0
    shards: list[dict[str, Any]] = field(default_factory=list)

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if len(self.offsets) > 1 and len(self.ids) + ids.nbytes > self.shard_bytes:
            self.flush()
        self.ids += ids.astype(self.dtype).tobytes()
        self.mask += mask.astype(MASK_DTYPE).tobytes()
        self.offsets.append(self.offsets[-1] + int(ids.size))
        self.assistant_tokens += int(mask.sum())

    def flush(self) -> None:
        if len(self.offsets) == 1:
            return
        stem = f"{self.side}-{len(self.shards):05d}"
        files = {
            f"{stem}.bin": bytes(self.ids),
            f"{stem}.mask": bytes(self.mask),
            f"{stem}.offsets": np.asarray(self.offsets, dtype=OFFSETS_DTYPE).tobytes(),
        }
        for name, data in files.items():
            (self.out_dir / name).write_bytes(data)
        self.shards.append(
            {
                "name": f"{stem}.bin",
                "mask": f"{stem}.mask",
                "offsets": f"{stem}.offsets",
                "examples": len(self.offsets) - 1,
                "tokens": self.offsets[-1],
                "assistant_tokens": self.assistant_tokens,
                "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
                "split": self.side,
            }
        )
        self.ids, self.mask, self.offsets, self.assistant_tokens = bytearray(), bytearray(), [0], 0


def write_example_shards(
    source: Path,
    out_dir: Path,
    tokenizer_dir: Path,
    *,
    chat_template: str | None = None,
    max_tokens: int = 0,
    overlong: str = "truncate",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    holdout_fraction: float = 0.1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Render the conversations under `source` into example shards in `out_dir`; returns the index.

    `max_tokens` (0: no limit) bounds an example's length by the `overlong` rule."""
    if overlong not in OVERLONG_RULES:
        raise DataError(f"overlong rule {overlong!r}: choose one of {', '.join(OVERLONG_RULES)}")
    if max_tokens < 0:
        raise DataError(f"max_tokens must be 0 (no limit) or positive, got {max_tokens}")
    files = conversation_files(Path(source))
    renderer = ChatRenderer(Path(tokenizer_dir), chat_template)
    dtype = np.dtype("<u2") if renderer.tokenizer.vocab_size <= 2**16 else np.dtype("<u4")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SHARD_INDEX_NAME).unlink(missing_ok=True)  # never vouch for shards being replaced
    itemsize = dtype.itemsize
    per_shard = max(itemsize, shard_bytes // itemsize * itemsize)

    def write(split: DocumentSplit, report: bool) -> tuple[dict[str, _SideWriter], dict[str, int]]:
        writers = {side: _SideWriter(out_dir, side, per_shard, dtype) for side in ("train", "holdout")}
        counts = {"conversations": 0, "truncated": 0, "dropped_overlong": 0, "dropped_no_assistant_tokens": 0}
        for done, path in enumerate(files, start=1):
            for where, messages in read_conversations(path):
                counts["conversations"] += 1
                ids, mask = renderer.render(messages, where)
                if max_tokens and len(ids) > max_tokens:
                    if overlong == "drop":
                        counts["dropped_overlong"] += 1
                        continue
                    ids, mask = ids[:max_tokens], mask[:max_tokens]
                    counts["truncated"] += 1
                # A token is a target from position 1 on: an example whose only assistant
                # token is its first has nothing to learn.
                if not any(mask[1:]):
                    counts["dropped_no_assistant_tokens"] += 1
                    continue
                canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()
                side = "holdout" if split.side_of(document_digest(canonical)) else "train"
                writers[side].add(np.asarray(ids), np.asarray(mask))
            if progress is not None and report:
                progress(done, len(files))
        for writer in writers.values():
            writer.flush()
        return writers, counts

    split = DocumentSplit(holdout_fraction)
    writers, counts = write(split, report=True)
    if not writers["holdout"].shards and split.documents >= 2:
        # A small set where no conversation fell below the fraction: hold out the one with the
        # smallest digest (growing the set can only move it to train), as for token shards.
        _remove(out_dir, writers["train"].shards)
        split = DocumentSplit(holdout_fraction, split.smallest)
        writers, counts = write(split, report=False)  # the bar already stands at the end
    shards = writers["train"].shards + writers["holdout"].shards
    held = sum(s["examples"] for s in writers["holdout"].shards)
    kept = sum(s["examples"] for s in shards)
    if not writers["train"].shards or not held:
        _remove(out_dir, shards)
        raise DataError(
            f"{kept} example(s) kept of {counts['conversations']} conversation(s) leave "
            f"{'no holdout' if kept and not held else 'no train'} example at holdout fraction "
            f"{holdout_fraction}: add conversations or change --holdout-fraction"
        )
    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": renderer.tokenizer.identity,
        "tokenizer_dir": str(tokenizer_dir),
        "chat_template_sha256": renderer.template_sha256,
        "mask_rule": "generation markers"
        if renderer.uses_generation_markers
        else "assistant spans by prefix",
        "vocab_size": renderer.tokenizer.vocab_size,
        "dtype": dtype.name,
        "examples": kept,
        "tokens": sum(s["tokens"] for s in shards),
        "assistant_tokens": sum(s["assistant_tokens"] for s in shards),
        "max_tokens": max_tokens,
        "overlong": overlong,
        **counts,
        "split": {
            "rule": "sha256(canonical conversation JSON) < holdout_fraction",
            "holdout_fraction": holdout_fraction,
        },
        "shards": shards,
    }
    (out_dir / SHARD_INDEX_NAME).write_text(json.dumps(index, indent=1))  # last: it vouches for the shards
    return index


def _remove(out_dir: Path, shards: list[dict[str, Any]]) -> None:
    for shard in shards:
        for name in (shard["name"], shard["mask"], shard["offsets"]):
            (out_dir / name).unlink(missing_ok=True)
