"""The validate step's pure rules: do the stored tensors fit the model config, is the optimizer
state there, and is the candidate good enough to become the champion.

Nothing here reads files or talks to MLflow: the caller passes what it read (tensor shapes
from the DCP metadata, losses on the holdout) and gets back problems or a decision with
its reasons, so every rule is tested without a checkpoint or a server.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MODEL_PREFIX = "model."
OPTIMIZER_STATE_PREFIX = "optim.state."
LN2 = math.log(2)

DECISIONS = ("champion", "challenger", "reject")
"""champion: beats the current champion (or there is none) and is under max_loss;
challenger: under max_loss but not better enough than the champion; reject: not registered."""


@dataclass(frozen=True, slots=True)
class Decision:
    decision: str
    reasons: list[str] = field(default_factory=list)


def shape_problems(stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Model tensors missing from, unexpected in, or shaped differently in the checkpoint.

    `stored` maps DCP keys (`model.<param>`, `optim....`) to shapes; `expected` maps the
    model's own parameter names to the shapes its config gives them.
    """
    stored_model = {k[len(MODEL_PREFIX) :]: v for k, v in stored.items() if k.startswith(MODEL_PREFIX)}
    problems = []
    for name, shape in expected.items():
        if name not in stored_model:
            problems.append(f"tensor {name!r} is missing from the checkpoint")
        elif tuple(stored_model[name]) != tuple(shape):
            problems.append(
                f"tensor {name!r} has shape {list(stored_model[name])}, the model config gives {list(shape)}"
            )
    for name in sorted(set(stored_model) - set(expected)):
        problems.append(f"tensor {name!r} in the checkpoint is not part of the configured model")
    return problems


def optimizer_problems(stored_keys: Iterable[str], parameters: Iterable[Sequence[str]]) -> list[str]:
    """Parameters without any optimizer state in the checkpoint (resuming would restart them cold).

    `parameters` holds one tuple of names per parameter: a tied weight (an output head sharing
    the embedding's) is one parameter under several names, and torch keeps its optimizer state
    under one of them."""
    have = set()
    for key in stored_keys:
        if key.startswith(OPTIMIZER_STATE_PREFIX):
            have.add(key[len(OPTIMIZER_STATE_PREFIX) :])
    missing = [
        names[0] for names in parameters if not any(k.startswith(f"{name}.") for name in names for k in have)
    ]
    if not missing:
        return []
    shown = ", ".join(repr(n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
    return [f"no optimizer state for {len(missing)} parameter(s): {shown}"]


def parameter_names(named: Iterable[tuple[str, object]]) -> list[tuple[str, ...]]:
    """One tuple of names per distinct parameter, from `named_parameters(remove_duplicate=False)`:
    tied names share a tuple, in the order the model lists them."""
    groups: dict[int, list[str]] = {}
    for name, param in named:
        groups.setdefault(id(param), []).append(name)
    return [tuple(names) for names in groups.values()]


def decide(
    nats_per_byte: float,
    max_loss: float,
    champion_nats_per_byte: float | None,
    min_improvement: float,
    champion_label: str = "the champion",
) -> Decision:
    """Reject above max_loss; otherwise champion when there is none to beat or the candidate's
    loss is lower by at least `min_improvement` (and by more than nothing), else challenger.

    Losses and both thresholds are in nats per byte (bits per byte x ln 2): per byte, so
    models with different tokenizers compare fairly; in nats, so the thresholds keep the
    meaning they had for the byte LM (whose nats per token are nats per byte)."""
    bits = f"{nats_per_byte / LN2:.4f} bits/byte"
    if not nats_per_byte <= max_loss:  # also rejects NaN
        return Decision(
            "reject", [f"holdout loss {nats_per_byte:.4f} nats/byte ({bits}) > max_loss {max_loss}"]
        )
    reasons = [f"holdout loss {nats_per_byte:.4f} nats/byte ({bits}) <= max_loss {max_loss}"]
    if champion_nats_per_byte is None:
        return Decision("champion", [*reasons, "there is no champion to beat"])
    delta = champion_nats_per_byte - nats_per_byte
    comparison = (
        f"{champion_label} scores {champion_nats_per_byte:.4f} nats/byte "
        f"({champion_nats_per_byte / LN2:.4f} bits/byte) on the same holdout text: improvement "
        f"{delta:+.4f} nats/byte (min_improvement {min_improvement})"
    )
    if delta > 0 and delta >= min_improvement:
        return Decision("champion", [*reasons, f"{comparison}: beats it"])
    return Decision("challenger", [*reasons, f"{comparison}: does not beat it"])


def eval_record_problems(
    record: dict, weights_sha256: str, step: int, model_kind: str, holdout: dict
) -> list[str]:
    """Why the training's eval record does not belong to this checkpoint (empty: it does).

    It belongs when it scored these weights (their SHA-256), at this step, as this model kind,
    on these holdout windows (`holdout`: files and windows with their digests, seq_len)."""
    problems = []
    if record.get("model_sha256") != weights_sha256:
        problems.append(
            f"it scored weights with SHA-256 {str(record.get('model_sha256'))[:16]}…, "
            f"the checkpoint holds {weights_sha256[:16]}…"
        )
    if record.get("step") != step:
        problems.append(f"it scored step {record.get('step')}, the checkpoint is step {step}")
    if record.get("model_kind") != model_kind:
        problems.append(f"it scored a {record.get('model_kind')} model, the checkpoint holds a {model_kind}")
    scored = record.get("holdout") or {}
    differ = [key for key in sorted(holdout) if scored.get(key) != holdout[key]]
    if differ:
        problems.append(f"its holdout differs in {', '.join(differ)}")
    for key in ("nats_total", "tokens", "bytes"):
        if not isinstance(record.get(key), (int, float)) or isinstance(record.get(key), bool):
            problems.append(f"it has no number {key!r}")
    return problems
