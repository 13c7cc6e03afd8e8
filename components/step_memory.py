"""How much memory the validate and register pods need for a model, and whether a run fits.

`rtp compile --model-params` sizes both pods by `model_step_memory` (request = limit,
docs/eks.md "Pod sizes"), so their memory is fixed when the pipeline is compiled while the
model is chosen per run. `undersized_steps` compares the two: the check step refuses a run
whose model needs more than the compiled pods have, before anything is staged, instead of
an OOM-killed register after hours of training. The built-in byte LM's size follows from
its config (`byte_lm_parameters`); a Hugging Face model's is unknown until it is staged.
Pure: no torch, no kfp.
"""

from __future__ import annotations

import re

from trainer.config_sections import ModelConfig

GIB = 2**30
STEP_BASE_GIB = 2.0
"""Python, torch, transformers and the MLflow client in a step's process."""
READ_GROUP_GIB = 0.25
"""validate reads the checkpoint in groups of at most this much (twice: a group and its check)."""
SCORED_IN_PROCESS_MAX_GIB = 4.0
"""validate scores a model in its own process only up to this many bytes of fp32 weights;
larger ones are scored by the training ranks (the eval record)."""
LARGEST_TENSOR_SHARE = 0.08
"""The largest tensor's share of a model's parameters (the embedding: 6.5% for Llama-3-8B)."""
LARGEST_TENSOR_MAX_PARAMS = 2.2e9
"""...but never more than Llama-3.1-405B's embedding (128256 x 16384 = 2.1e9 parameters)."""
MODEL_STEPS = ("validate", "register")
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti)?")
_BINARY = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def model_step_memory(step: str, model_params: float) -> str:
    """Memory request (= limit) of the validate or register pod for a model of
    `model_params` parameters, in whole GiB (docs/eks.md, "Pod sizes"):

    validate = 2 + 2 x 0.25 + 3 x min(4, 4 B x params) GiB: streamed checks in two groups,
               plus weights, champion and activations when it scores in its own process;
    register = 2 + 3 x 4 B x min(0.08 x params, 2.2e9) GiB: the streamed export holds one
               tensor in fp32, its cast and its write buffer at a time (the read groups are
               smaller)."""
    fp32_gib = 4.0 * model_params / GIB
    if step == "validate":
        need = STEP_BASE_GIB + 2 * READ_GROUP_GIB + 3 * min(SCORED_IN_PROCESS_MAX_GIB, fp32_gib)
    elif step == "register":
        largest_gib = 4.0 * min(LARGEST_TENSOR_SHARE * model_params, LARGEST_TENSOR_MAX_PARAMS) / GIB
        need = STEP_BASE_GIB + 3 * largest_gib
    else:
        raise ValueError(f"no memory formula for step {step!r}; one of {', '.join(MODEL_STEPS)}")
    # A tenth of a GiB is all the constants above are good for: a CPU preset's few MB of
    # weights must not lift the default (0 parameters) size to the next GiB.
    need = round(need, 1)
    return f"{max(1, -(-need // 1)):.0f}Gi"


def memory_bytes(quantity: str) -> int:
    """Bytes in a Kubernetes memory quantity with a binary suffix ('15Gi', '512Mi', '1024')."""
    found = _QUANTITY.fullmatch(quantity.strip())
    if not found:
        raise ValueError(f"memory {quantity!r} is not a quantity like 15Gi")
    return int(float(found[1]) * _BINARY[found[2]])


def byte_lm_parameters(model: ModelConfig) -> int:
    """Parameters of the built-in byte LM (trainer/models/byte_lm.py): token and position
    embeddings (the output head reuses the token embedding), per block two LayerNorms, the
    fused qkv, the projection and the 4x MLP, and the final LayerNorm."""
    d = model.d_model
    block = 2 * 2 * d + 3 * d * d + d * d + 2 * 4 * d * d
    return (model.vocab_size + model.seq_len) * d + model.n_layers * block + 2 * d


def undersized_steps(model_params: float, compiled: dict[str, str]) -> dict[str, tuple[str, str]]:
    """The steps of `compiled` (step -> the memory the pipeline gives its pod) that have less
    than a model of `model_params` needs: step -> (needed, compiled)."""
    short: dict[str, tuple[str, str]] = {}
    for step, given in compiled.items():
        needed = model_step_memory(step, model_params)
        if memory_bytes(given) < memory_bytes(needed):
            short[step] = (needed, given)
    return short
