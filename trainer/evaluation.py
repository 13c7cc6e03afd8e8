"""Holdout scores of a model, and the eval record the training ranks write after the last step.

A model is scored on fixed, evenly spaced windows of the dataset's holdout split (never
trained on): the summed next-token loss, the tokens predicted and the UTF-8 bytes they decode
to, so models with different tokenizers compare in bits per byte (`HoldoutScore`).

At the end of training every rank scores the sharded model where it already is
(`write_eval_record`, collective: each rank runs the same forwards on all windows, so the
score does not depend on the world size), and rank 0 writes `<workdir>/eval.json` bound to
the weights it scored (`model_sha256`), the step and the holdout's identity (its files and a
digest of the scored windows). The validate step then decides from that record instead of
loading the whole model into one process (components/validate_checkpoint/validate.py).

With `data.eval_champion` (a registered model name), the ranks also score that model's MLflow
`champion` on the same windows: rank 0 resolves the alias and downloads the version's Hugging
Face files next to the run, every rank loads them sharded as `model.init=pretrained` loads a
base model, and the record gains the champion's score, version, run id and files' SHA-256.
A champion the training cannot score (no MLflow, no champion, a byte LM, a failed download)
is recorded with the reason; the validate step then scores it itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.models.spec import Tokenizer

log = logging.getLogger(__name__)

__all__ = [
    "CHAMPION_ALIAS",
    "EVAL_RECORD",
    "ChampionFiles",
    "HoldoutScore",
    "champion_windows",
    "decoded_bytes",
    "eval_rows_per_forward",
    "fetch_champion",
    "holdout_identity",
    "read_eval_record",
    "retokenized_windows",
    "score_champion",
    "score_windows",
    "write_eval_record",
]

EVAL_RECORD = "eval.json"
BYTES_IDENTITY = "bytes"
RECORD_VERSION = 1
CHAMPION_ALIAS = "champion"
CHAMPION_DIR = "champion"
"""Folder under the run's workdir the champion's files are downloaded to (shared volume)."""
# Tags the register step writes on a version (components/register_model/lineage.py).
KIND_TAG, SEQ_LEN_TAG, TOKENIZER_TAG = "rtp.model_kind", "rtp.model_seq_len", "rtp.tokenizer"
CHAMPION_WAIT_S = 4 * 3600.0
"""How long the other ranks wait for rank 0's download of the champion (a few GB per billion parameters)."""


@dataclass(frozen=True, slots=True)
class HoldoutScore:
    nats_total: float
    """Summed next-token cross-entropy over every predicted token."""
    tokens: int
    """Tokens predicted (each window's targets)."""
    bytes: int
    """UTF-8 bytes those tokens decode to."""

    @property
    def nats_per_token(self) -> float:
        return self.nats_total / max(1, self.tokens)

    @property
    def bits_per_byte(self) -> float:
        return self.nats_total / math.log(2) / max(1, self.bytes)

    @property
    def nats_per_byte(self) -> float:
        """bits_per_byte * ln 2: the unit of `max_loss` and `min_improvement`."""
        return self.nats_total / max(1, self.bytes)


def decoded_bytes(tokenizer: Tokenizer, ids: Sequence[int]) -> int:
    """UTF-8 bytes of `ids`: one per token for the byte tokenizer; otherwise the length of
    their decoded text, EOS (a document separator, not text) left out."""
    if tokenizer.identity == BYTES_IDENTITY:
        return len(ids)
    eos = tokenizer.eos_id
    return len(tokenizer.decode([i for i in ids if i != eos]).encode("utf-8"))


def eval_rows_per_forward(config: Any) -> int:
    """Rows the training ranks score in one forward: a training micro-batch (`data.batch_size`),
    which the training's own forward, with its gradients, is known to fit."""
    return int(config.data.batch_size)


@torch.no_grad()
def score_windows(
    model: nn.Module,
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    batches: Sequence[torch.Tensor],
    tokenizer: Tokenizer,
    device: torch.device | None = None,
    rows_per_forward: int = 0,
) -> HoldoutScore:
    """Score `batches` of (rows, window) token ids: `loss` is the spec's mean next-token loss.
    A forward scores at most `rows_per_forward` rows (0: a whole batch); the training ranks
    pass their micro-batch, the rows their training forward is known to fit.
    The model is left in eval mode (the caller restores training mode when it trains on)."""
    model.eval()
    nats, tokens, byte_count = 0.0, 0, 0
    for batch in batches:
        for rows in batch.split(rows_per_forward or batch.shape[0]):
            targets = rows[:, 1:]
            nats += loss(model, rows if device is None else rows.to(device)).item() * targets.numel()
            tokens += targets.numel()
            byte_count += sum(decoded_bytes(tokenizer, row.tolist()) for row in targets)
    return HoldoutScore(nats_total=nats, tokens=tokens, bytes=byte_count)


def _documents(ids: list[int], tokenizer: Tokenizer) -> list[str]:
    """The text of a window; split at EOS for a tokenizer whose EOS is not text itself."""
    if tokenizer.identity == BYTES_IDENTITY:  # its EOS is the newline: part of the text
        return [tokenizer.decode(ids)]
    parts: list[list[int]] = [[]]
    for token in ids:
        if token == tokenizer.eos_id:
            parts.append([])
        else:
            parts[-1].append(token)
    return [tokenizer.decode(part) for part in parts]


def retokenized_windows(
    batches: Sequence[torch.Tensor], source: Tokenizer, target: Tokenizer, seq_len: int
) -> list[torch.Tensor]:
    """The text of every window in `batches` (tokens of `source`) as `target`'s tokens, in
    windows of at most seq_len + 1 tokens (one row each: their lengths differ)."""
    windows = []
    for batch in batches:
        for row in batch.tolist():
            ids: list[int] = []
            for index, document in enumerate(_documents(row, source)):
                if index:
                    ids.append(target.eos_id)
                ids.extend(target.encode(document))
            for start in range(0, max(0, len(ids) - 1), seq_len):
                chunk = ids[start : start + seq_len + 1]
                if len(chunk) >= 2:
                    windows.append(torch.tensor([chunk], dtype=torch.long))
    return windows


def champion_windows(
    batches: Sequence[torch.Tensor],
    candidate: Tokenizer,
    champion: Tokenizer,
    champion_identity: str,
    champion_seq_len: int,
    candidate_seq_len: int,
) -> Sequence[torch.Tensor]:
    """The candidate's holdout windows as the champion scores them: the same tokens when it has
    the same tokenizer and window length, else their text encoded with its own tokenizer."""
    if champion_identity != candidate.identity or champion_seq_len != candidate_seq_len:
        return retokenized_windows(batches, candidate, champion, champion_seq_len)
    return batches


def holdout_identity(files: Sequence[Any], batches: Sequence[torch.Tensor], seq_len: int) -> dict[str, Any]:
    """What a score was computed on: the holdout files (key, size, dtype), the windows scored and
    a digest of their token ids, so a record is used only for exactly the same windows."""
    keys = hashlib.sha256()
    for f in files:
        keys.update(f"{f.key}\t{f.size}\t{f.dtype}\n".encode())
    windows = hashlib.sha256()
    for batch in batches:
        windows.update(batch.to(torch.int64).contiguous().numpy().tobytes())
    return {
        "files": len(files),
        "files_sha256": keys.hexdigest(),
        "windows": sum(int(b.shape[0]) for b in batches),
        "windows_sha256": windows.hexdigest(),
        "seq_len": seq_len,
    }


@dataclass(frozen=True, slots=True)
class ChampionFiles:
    """A champion version's Hugging Face files, downloaded by rank 0 onto the shared volume."""

    model_name: str
    version: str
    run_id: str
    model_dir: str
    tokenizer_dir: str
    seq_len: int | None
    """Its training window (the rtp.model_seq_len tag); None: the candidate's."""
    tokenizer_identity: str
    """Its tokenizer's identity (the rtp.tokenizer tag); empty: read from its tokenizer files."""
    files_sha256: str
    """SHA-256 over the model folder's files (trainer.models.spec.files_sha256)."""


def fetch_champion(model_name: str, workdir: str | Path) -> ChampionFiles | str:
    """Rank 0: resolve `models:/<model_name>@champion` and download a Hugging Face version's
    files to `<workdir>/champion/v<version>` (kept: a resumed run reuses them). Returns the
    files, or why the training does not score this champion (validate then does)."""
    from trainer import env
    from trainer.models.spec import files_sha256

    if not env.mlflow_tracking_uri():
        return f"MLflow is not configured ({env.MLFLOW_TRACKING_URI} is empty)"
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        version = mlflow.MlflowClient().get_model_version_by_alias(model_name, CHAMPION_ALIAS)
    except MlflowException as exc:  # no such model or alias; validate tells them apart
        return f"no {CHAMPION_ALIAS} of {model_name} in MLflow ({exc.error_code})"
    tags = dict(version.tags or {})
    label = f"{model_name} v{version.version}"
    if tags.get(KIND_TAG, "byte-lm") != "hf":  # versions without the tag are byte LMs
        return f"{CHAMPION_ALIAS} {label} is a byte LM (small: validate scores it in its process)"
    target = Path(workdir) / CHAMPION_DIR / f"v{version.version}"
    if not (target / "model" / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".v{version.version}-", dir=target.parent))
        try:
            local = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=f"models:/{model_name}/{version.version}", dst_path=str(staging)
                )
            )
            if not (local / "model" / "config.json").is_file():
                return (
                    f"{CHAMPION_ALIAS} {label} holds no model/config.json (not a Hugging Face version of rtp)"
                )
            shutil.rmtree(target, ignore_errors=True)
            os.replace(local, target)  # complete or absent: a half download is never reused
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    model_dir = target / "model"
    tokenizer_dir = target / "components" / "tokenizer"
    seq_len = tags.get(SEQ_LEN_TAG, "")
    return ChampionFiles(
        model_name=model_name,
        version=str(version.version),
        run_id=str(version.run_id or ""),
        model_dir=str(model_dir),
        tokenizer_dir=str(tokenizer_dir if tokenizer_dir.is_dir() else model_dir),
        seq_len=int(seq_len) if seq_len.isdigit() else None,
        tokenizer_identity=tags.get(TOKENIZER_TAG, ""),
        files_sha256=files_sha256(p for p in model_dir.iterdir() if p.is_file()),
    )


def _mesh_of(model: nn.Module, device: torch.device) -> Any:
    """The device mesh the candidate is sharded over (a new 1-D mesh if it is not sharded)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    param = next(model.parameters())
    if isinstance(param, DTensor):
        return param.device_mesh
    return init_device_mesh(device.type, (dist.get_world_size(),))


def score_champion(
    files: ChampionFiles,
    candidate: nn.Module,
    config: Any,
    batches: Sequence[torch.Tensor],
    device: torch.device,
) -> HoldoutScore:
    """Collective: load the champion sharded over the candidate's mesh (each rank reads its
    slices of the safetensors) and score it on the candidate's windows `batches`, in its own
    tokenization."""
    from trainer.config import ModelConfig
    from trainer.models import hf_causal_lm, model_spec
    from trainer.parallelize import apply_fsdp, compute_dtype

    seq_len = files.seq_len or config.model.seq_len
    champion_config = ModelConfig(kind="hf", model_dir=files.model_dir, init="pretrained", seq_len=seq_len)
    spec = model_spec("hf")
    model = spec.build(champion_config, torch.device("meta"))
    apply_fsdp(
        model, _mesh_of(candidate, device), spec.fsdp_units(model), compute_dtype(config.training, device)
    )
    spec.init_weights(model, champion_config, device, 0)
    tokenizer = hf_causal_lm.HFTokenizer(Path(files.tokenizer_dir))
    windows = champion_windows(
        batches,
        model_spec(config.model.kind).tokenizer(config.model),
        tokenizer,
        files.tokenizer_identity or tokenizer.identity,
        seq_len,
        config.model.seq_len,
    )
    try:
        return score_windows(
            model, spec.loss, windows, tokenizer, device, rows_per_forward=eval_rows_per_forward(config)
        )
    finally:
        del model


def _champion_entry(
    model: nn.Module, config: Any, batches: Sequence[torch.Tensor], rank: int, device: torch.device
) -> dict[str, Any]:
    """Collective: the record's `champion` entry (its score, or why there is none)."""
    import torch.distributed as dist

    from trainer.parallelize import set_collective_timeout

    name = config.data.eval_champion
    fetched: list[Any] = [None]
    if rank == 0:
        try:
            fetched[0] = fetch_champion(name, config.run.workdir)
        except Exception as exc:  # the training's result stands; validate scores the champion then
            fetched[0] = f"could not fetch the {CHAMPION_ALIAS} of {name}: {type(exc).__name__}: {exc}"
    set_collective_timeout(max(CHAMPION_WAIT_S, config.resilience.collective_timeout_s))
    try:  # the other ranks wait here while rank 0 downloads
        dist.broadcast_object_list(fetched, src=0)
    finally:
        set_collective_timeout(config.resilience.collective_timeout_s)
    files = fetched[0]
    if isinstance(files, str):
        if rank == 0:
            log.info("no %s scored in training: %s", CHAMPION_ALIAS, files)
        return {"scored": False, "model_name": name, "reason": files}
    try:
        score = score_champion(files, model, config, batches, device)
    except Exception as exc:  # same: validate scores it in its process (or refuses a large one)
        log.warning("could not score the %s %s v%s in training: %s", CHAMPION_ALIAS, name, files.version, exc)
        return {"scored": False, "model_name": name, "reason": f"{type(exc).__name__}: {exc}"}
    return {
        "scored": True,
        "model_name": files.model_name,
        "version": files.version,
        "run_id": files.run_id,
        "files_sha256": files.files_sha256,
        "kind": "hf",
        "seq_len": files.seq_len,
        "tokenizer": files.tokenizer_identity,
        "loss": score.nats_per_token,
        "bits_per_byte": score.bits_per_byte,
        "nats_total": score.nats_total,
        "tokens": score.tokens,
        "bytes": score.bytes,
    }


class PeriodicEval:
    """Callback, the validation pass: every `config.data.eval_every_steps` steps score the
    (sharded) model on the run's holdout windows on every rank, the same forwards on each
    as FSDP's gathers require, and hand the score to `on_score(step, score)`."""

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        device: torch.device,
        on_score: Callable[[int, HoldoutScore], None],
        keepalive: Callable[[], Any],
    ) -> None:
        from trainer.models import model_spec

        self.model, self.config, self.device = model, config, device
        self.on_score, self.keepalive = on_score, keepalive
        self.spec = model_spec(config.model.kind)
        self.tokenizer = self.spec.tokenizer(config.model)
        self.batches: list[torch.Tensor] | None = None  # read at the first pass
        self.held: Any = None  # the same, for data.format=examples

    def on_step_end(self, result: Any) -> None:
        if result.step % self.config.data.eval_every_steps:
            return
        if self.config.data.format == "examples":
            self._score_examples(result.step)
            return
        if self.batches is None:
            from trainer.data import holdout_batches, load_tokens, split_files

            _, holdout = split_files(self.config.data.dataset_dir, self.config.data.holdout_fraction)
            windows = self.config.data.eval_windows
            self.batches = list(
                holdout_batches(load_tokens(holdout), self.config.model.seq_len, max_windows=windows)
            )
        with self.keepalive():
            try:
                score = score_windows(
                    self.model,
                    self.spec.loss,
                    self.batches,
                    self.tokenizer,
                    self.device,
                    rows_per_forward=eval_rows_per_forward(self.config),
                )
            finally:
                self.model.train(True)
        self.on_score(result.step, score)

    def _score_examples(self, step: int) -> None:
        from trainer.examples_eval import example_holdout, score_examples

        if self.held is None:
            data = self.config.data
            self.held = example_holdout(
                data.dataset_dir, self.config.model.seq_len, data.eval_windows, self.tokenizer.eos_id
            )
        with self.keepalive():
            try:
                score = score_examples(
                    self.model, self.held, self.tokenizer, self.device, eval_rows_per_forward(self.config)
                )
            finally:
                self.model.train(True)
        self.on_score(step, score)


def write_eval_record(
    model: nn.Module, config: Any, model_sha256: str, step: int, rank: int, device: torch.device
) -> Path | None:
    """Collective: score the (sharded) model on `config.data.eval_windows` holdout windows on
    every rank (and the champion of `config.data.eval_champion`, when set), then rank 0 writes
    `<workdir>/eval.json` atomically. Returns its path (None on other ranks). Every rank runs
    the same forwards, as FSDP's gathers require."""
    from trainer.data import holdout_batches, load_tokens, split_files
    from trainer.models import model_spec

    spec = model_spec(config.model.kind)
    tokenizer = spec.tokenizer(config.model)
    was_training = model.training
    champion: dict[str, Any] | None = None
    if config.data.format == "examples":  # the assistant tokens of holdout conversations
        from trainer.examples_eval import example_holdout, score_examples

        held = example_holdout(
            config.data.dataset_dir, config.model.seq_len, config.data.eval_windows, tokenizer.eos_id
        )
        try:
            score = score_examples(
                model, held, tokenizer, device, rows_per_forward=eval_rows_per_forward(config)
            )
        finally:
            model.train(was_training)
        holdout_entry = {**held.identity(config.model.seq_len), "tokens": held.tokens}
        if config.data.eval_champion:
            champion = {
                "scored": False,
                "model_name": config.data.eval_champion,
                "reason": "data.format=examples: the validate step scores the champion on the same conversations",
            }
    else:
        _, holdout = split_files(config.data.dataset_dir, config.data.holdout_fraction)
        tokens = load_tokens(holdout)
        batches = holdout_batches(tokens, config.model.seq_len, max_windows=config.data.eval_windows)
        try:
            score = score_windows(
                model, spec.loss, batches, tokenizer, device, rows_per_forward=eval_rows_per_forward(config)
            )
        finally:
            model.train(was_training)
        holdout_entry = {**holdout_identity(holdout, batches, config.model.seq_len), "tokens": tokens.numel()}
        if config.data.eval_champion:
            champion = _champion_entry(model, config, batches, rank, device)
    if rank != 0:
        return None
    record = {
        "version": RECORD_VERSION,
        "model_sha256": model_sha256,
        "step": step,
        "model_kind": config.model.kind,
        "holdout": holdout_entry,
        "loss": score.nats_per_token,
        "bits_per_byte": score.bits_per_byte,
        "nats_total": score.nats_total,
        "tokens": score.tokens,
        "bytes": score.bytes,
        "device": device.type,
    }
    if champion is not None:
        record["champion"] = champion
    path = Path(config.run.workdir) / EVAL_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{EVAL_RECORD}.tmp")
    with staging.open("w") as handle:
        json.dump(record, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)  # readers see the old record or the new one, never half of one
    return path


def read_eval_record(path: str | Path) -> dict[str, Any] | None:
    """The eval record at `path`, or None when there is none or it is not a readable record."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        return None
    return record


def step_callback(context: Any) -> PeriodicEval | None:
    """trainer/step_callbacks.py's factory: on when `data.eval_every_steps` > 0; each score
    goes to the event log (`eval`), the log and MLflow."""
    if not context.config.data.eval_every_steps:
        return None

    def scored(step: int, score: HoldoutScore) -> None:
        context.events.emit(
            "eval",
            step=step,
            loss=score.nats_per_token,
            bits_per_byte=score.bits_per_byte,
            tokens=score.tokens,
        )
        context.progress.on_eval(step, score.nats_per_token, score.bits_per_byte)

    return PeriodicEval(context.model, context.config, context.device, scored, context.keepalive)
