"""Fetch the model MLflow currently calls `champion`, so a candidate is scored against it.

The validate step first resolves the alias (`champion_version`): when the training ranks
already scored that version (trainer/evaluation.py, `data.eval_champion`), nothing is
downloaded. Otherwise the version is loaded whole here, for a champion within the in-process
bound (`champion_weight_bytes` reads its size from the artifact listing).

The champion's files are downloaded and loaded into a plain model with its tokenizer:
a byte LM version carries the safetensors bundle (`weights.safetensors` + `config.json`,
the registry's byte-lm), a Hugging Face version the transformers flavor's `model/` folder
and `components/tokenizer/`. The validate step then scores it with the same code on the same
holdout text as the candidate (in bits per byte, so tokenizers may differ). The version's
tags say what it was trained with (`rtp.model_kind`, `rtp.model_seq_len`, `rtp.tokenizer`)
and what it scored when it was validated (`rtp.validate.*`); versions registered before
those tags existed are byte LMs and lack them, which is reported, not an error.
Server failures are retried (`components.mlflow_access`); a registered model that does not
exist (RESOURCE_DOES_NOT_EXIST) or one without the alias means there is no champion yet.
Any other answer is an error: a lookup that fails must not pass as "no champion", or a
worse model would be promoted.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from components.mlflow_access import RetryPolicy, call_with_retries, check_model_name, step_deadline
from components.register_model.bundle import WEIGHTS_FILE, BundleError, read_bundle
from components.register_model.lineage import KIND_TAG, SEQ_LEN_TAG, TOKENIZER_TAG, VALIDATE_TAG_PREFIX
from trainer.models.spec import Tokenizer

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"
# What MLflow answers when the registered model does not exist. Not INVALID_PARAMETER_VALUE:
# it is also the answer to a malformed request, which must not read as "no champion".
_ABSENT_CODE = "RESOURCE_DOES_NOT_EXIST"
BITS_PER_BYTE_TAG = f"{VALIDATE_TAG_PREFIX}holdout_bits_per_byte"


@dataclass(slots=True)
class Champion:
    model_name: str
    version: str
    model: nn.Module
    checkpoint_sha256: str
    kind: str = "byte-lm"
    seq_len: int = 64
    """Window length (tokens) it is scored with: what it was trained with."""
    tokenizer: Tokenizer | None = None
    tokenizer_identity: str = "bytes"
    recorded_bits_per_byte: float | None = None
    """What it scored when it was validated (its own holdout); None for versions registered
    before bits per byte was recorded."""

    @property
    def label(self) -> str:
        return f"champion {self.model_name} v{self.version}"


def _float_tag(tags: dict[str, str], name: str) -> float | None:
    try:
        return float(tags[name])
    except (KeyError, ValueError):
        return None


def _load_files(local: Path, tags: dict[str, str], default_seq_len: int) -> dict[str, Any]:
    """Model, kind, seq_len and tokenizer from a downloaded version; BundleError when unreadable."""
    found = sorted(local.rglob(WEIGHTS_FILE))
    if found:  # the byte LM's bundle
        from trainer.models.byte_lm import ByteLM, ByteTokenizer

        model = read_bundle(found[0].parent)
        assert isinstance(model, ByteLM), type(model)
        tokenizer: Tokenizer = ByteTokenizer()
        return {"model": model, "kind": "byte-lm", "seq_len": model.cfg.seq_len, "tokenizer": tokenizer}
    model_dir, tokenizer_dir = local / "model", local / "components" / "tokenizer"
    if not (model_dir / "config.json").is_file():
        raise BundleError(
            f"the champion's files hold neither {WEIGHTS_FILE} (byte LM) nor model/config.json "
            "(Hugging Face): it was not registered by rtp; move or delete its alias, then retry"
        )
    from trainer.models import hf_causal_lm

    return {
        "model": hf_causal_lm.load_exported(model_dir),
        "kind": "hf",
        "seq_len": int(tags.get(SEQ_LEN_TAG) or default_seq_len),
        "tokenizer": hf_causal_lm.HFTokenizer(tokenizer_dir if tokenizer_dir.is_dir() else model_dir),
    }


def load_champion(
    model_name: str, retry: RetryPolicy | None = None, default_seq_len: int = 64
) -> Champion | None:
    """The current champion of `model_name`, or None when there is none.

    `default_seq_len` is the window length for a Hugging Face champion without the
    `rtp.model_seq_len` tag. Raises BundleError when the champion exists but carries no
    readable model.
    """
    version = champion_version(model_name, retry)
    if version is None:
        return None
    return download_champion(model_name, version, retry, default_seq_len)


def champion_version(model_name: str, retry: RetryPolicy | None = None) -> Any | None:
    """The ModelVersion the `champion` alias of `model_name` points at, None when there is none."""
    import mlflow

    check_model_name(model_name)
    client = mlflow.MlflowClient()
    with step_deadline(retry):
        version = call_with_retries(
            f"look up the {CHAMPION_ALIAS} of {model_name}",
            lambda: _champion_version(client, model_name),
            retry,
        )
    if version is None:
        log.info("%s has no %s yet", model_name, CHAMPION_ALIAS)
    return version


def champion_weight_bytes(model_name: str, version: Any, retry: RetryPolicy | None = None) -> int:
    """Bytes of a version's weight files (*.safetensors), from the artifact listing: nothing is downloaded."""
    import mlflow

    def walk(uri: str) -> int:
        total = 0
        for entry in mlflow.artifacts.list_artifacts(artifact_uri=uri):
            name = Path(entry.path).name
            if entry.is_dir:
                total += walk(f"{uri}/{name}")
            elif name.endswith(".safetensors"):
                total += int(entry.file_size or 0)
        return total

    with step_deadline(retry):
        return call_with_retries(
            f"list the files of {model_name} version {version.version}",
            lambda: walk(f"models:/{model_name}/{version.version}"),
            retry,
        )


def version_tags(version: Any) -> dict[str, Any]:
    """What a version's tags say about it: kind, tokenizer and what it scored when validated."""
    tags = dict(version.tags or {})
    return {
        "kind": tags.get(KIND_TAG, "byte-lm"),
        "tokenizer_identity": tags.get(TOKENIZER_TAG, ""),
        "recorded_bits_per_byte": _float_tag(tags, BITS_PER_BYTE_TAG),
    }


def _champion_version(client: Any, model_name: str) -> Any | None:
    """The version the alias points at, None when the model or its alias does not exist.

    The alias is read from the registered model: MLflow answers a lookup by a missing alias
    with INVALID_PARAMETER_VALUE, the same code as for a malformed request.
    """
    from mlflow.exceptions import MlflowException

    try:
        registered = client.get_registered_model(model_name)
    except MlflowException as exc:
        if exc.error_code == _ABSENT_CODE:
            return None
        raise
    aliases = dict(registered.aliases or {})
    if CHAMPION_ALIAS not in aliases:
        return None
    return client.get_model_version(model_name, str(aliases[CHAMPION_ALIAS]))


def download_champion(
    model_name: str, version: Any, retry: RetryPolicy | None = None, default_seq_len: int = 64
) -> Champion:
    """Download `version` (from `champion_version`) and load it whole into this process."""
    import mlflow

    tags = dict(version.tags or {})
    with tempfile.TemporaryDirectory(prefix="rtp-champion-") as tmp:
        local = call_with_retries(
            f"download {model_name} version {version.version}",
            lambda: mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{model_name}/{version.version}", dst_path=tmp
            ),
            retry,
        )
        loaded = _load_files(Path(local), tags, default_seq_len)
    tokenizer = loaded["tokenizer"]
    return Champion(
        model_name=model_name,
        version=str(version.version),
        model=loaded["model"],
        checkpoint_sha256=str(tags.get("rtp.checkpoint_sha256", "")),
        kind=loaded["kind"],
        seq_len=loaded["seq_len"],
        tokenizer=tokenizer,
        tokenizer_identity=tags.get(TOKENIZER_TAG) or tokenizer.identity,
        recorded_bits_per_byte=_float_tag(tags, BITS_PER_BYTE_TAG),
    )
