"""The consolidated model bundle: the files a registered version carries besides its code.

    weights.safetensors   the full state dict in one file (no pickle, loadable anywhere)
    config.json           the ModelConfig the weights belong to
    tokenizer.json        what a token is (a byte) and how text becomes tokens

The register step writes the bundle and logs it as the pyfunc's artifacts; the validate
step reads the champion's bundle back to score it on the same holdout as a candidate.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainer.models import ModelError, byte_lm

WEIGHTS_FILE = byte_lm.WEIGHTS_FILE
CONFIG_FILE = byte_lm.CONFIG_FILE
TOKENIZER_FILE = byte_lm.TOKENIZER_FILE
BUNDLE_FILES = {"weights": WEIGHTS_FILE, "config": CONFIG_FILE, "tokenizer": TOKENIZER_FILE}
tokenizer_description = byte_lm.tokenizer_description


class BundleError(RuntimeError):
    """A model bundle is missing a file or does not fit its config; the message names it."""


def write_bundle(
    model: nn.Module, folder: str | Path, metadata: dict[str, str] | None = None
) -> dict[str, str]:
    """Write the three files into `folder`; returns {artifact name: path} for log_model."""
    assert isinstance(model, byte_lm.ByteLM), type(model)
    written = byte_lm.write_files(model.state_dict(), model.cfg, Path(folder), metadata)
    return {name: str(path) for name, path in written.items()}


def read_bundle(folder: str | Path) -> nn.Module:
    """The bundle's model with its weights, in eval mode; BundleError names what is wrong."""
    try:
        return byte_lm.read_folder(Path(folder))
    except ModelError as exc:
        raise BundleError(str(exc)) from exc


def pip_requirements() -> list[str]:
    """What the served model needs, pinned to the versions it was logged with."""
    import safetensors

    return [
        f"torch=={torch.__version__.split('+')[0]}",
        f"safetensors=={safetensors.__version__}",
        "numpy",
        "pandas",
    ]
