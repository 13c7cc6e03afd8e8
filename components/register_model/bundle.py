"""The consolidated model bundle: the files a registered version carries besides its code.

    weights.safetensors   the full state dict in one file (no pickle, loadable anywhere)
    config.json           the ModelConfig the weights belong to
    tokenizer.json        what a token is (a byte) and how text becomes tokens

The register step writes the bundle and logs it as the pyfunc's artifacts; the validate
step reads the champion's bundle back to score it on the same holdout as a candidate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from trainer.config import ModelConfig
from trainer.model import ByteLM

WEIGHTS_FILE = "weights.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
BUNDLE_FILES = {"weights": WEIGHTS_FILE, "config": CONFIG_FILE, "tokenizer": TOKENIZER_FILE}


class BundleError(RuntimeError):
    """A model bundle is missing a file or does not fit its config; the message names it."""


def tokenizer_description(config: ModelConfig) -> dict[str, Any]:
    return {
        "type": "byte",
        "vocab_size": config.vocab_size,
        "encode": "the UTF-8 bytes of the text; token id = byte value",
        "decode": "bytes(token ids) decoded as UTF-8, invalid sequences replaced",
        "special_tokens": {},
        "max_context_tokens": config.seq_len,
    }


def write_bundle(model: ByteLM, folder: str | Path, metadata: dict[str, str] | None = None) -> dict[str, str]:
    """Write the three files into `folder`; returns {artifact name: path} for log_model."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    # Contiguous copies: safetensors refuses views and shared storage.
    state = {name: tensor.detach().contiguous().clone() for name, tensor in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata=metadata or {})
    config = model.cfg
    (out / CONFIG_FILE).write_text(json.dumps(_config_dict(config), indent=2, sort_keys=True))
    (out / TOKENIZER_FILE).write_text(json.dumps(tokenizer_description(config), indent=2, sort_keys=True))
    return {name: str(out / file_name) for name, file_name in BUNDLE_FILES.items()}


def read_bundle(folder: str | Path) -> ByteLM:
    """A ByteLM with the bundle's weights, in eval mode; BundleError names what is wrong."""
    from safetensors.torch import load_file

    root = Path(folder)
    for file_name in (WEIGHTS_FILE, CONFIG_FILE):
        if not (root / file_name).is_file():
            raise BundleError(
                f"{root / file_name} is missing: the model was not logged with a weights bundle"
            )
    config = ModelConfig(**json.loads((root / CONFIG_FILE).read_text()))
    model = ByteLM(config)
    state = load_file(str(root / WEIGHTS_FILE))
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise BundleError(f"{root / WEIGHTS_FILE} does not fit {root / CONFIG_FILE}: {exc}") from exc
    model.eval()
    return model


def _config_dict(config: ModelConfig) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(config)


def pip_requirements() -> list[str]:
    """What the served model needs, pinned to the versions it was logged with."""
    import safetensors

    return [
        f"torch=={torch.__version__.split('+')[0]}",
        f"safetensors=={safetensors.__version__}",
        "numpy",
        "pandas",
    ]
