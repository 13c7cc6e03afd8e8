"""KFP components of the pipeline, one folder per step.

Each `<step>/component.py` holds only the KFP interface (signature, docstring, a body that
imports and calls one plain function); the logic lives in sibling modules that tests and
the `rtp` CLI call directly. `as_component()` turns a body into a lightweight component
that runs on the project image.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DEFAULT_IMAGE = "rtp:0.1.0"
"""The component image built from the project's Dockerfile (docs/eks.md); override
it at compile time with `rtp compile --image <registry>/rtp:<tag>`."""


def as_component(func: Callable[..., Any], image: str = DEFAULT_IMAGE) -> Any:
    """A lightweight Python component running `func` on `image` (which already has kfp)."""
    from kfp import dsl

    return dsl.component(func, base_image=image, install_kfp_package=False)
