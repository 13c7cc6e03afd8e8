"""`rtp make-tiny-model`: a tiny Hugging Face model folder built offline, to try the pipeline with.

The folder (rtp_support/tiny_models.py) is what a user brings for a real model: config.json,
model.safetensors and tokenizer files. `rtp local --model-source FOLDER` then sends it
through stage, train, validate and register.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rtp_cli.errors import UserError
from rtp_support.tiny_models import ARCHITECTURES, DEFAULT_TOKENIZER_VOCAB


def add_make_tiny_model_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tiny-model",
        help="write a tiny random Hugging Face model folder (no download) to try the pipeline with",
        description="Build a random 2-layer, hidden-64 causal LM of the given architecture from a "
        "transformers config object and train a small byte-level BPE tokenizer on the demo corpus "
        "(this Python's standard-library sources), then save both into OUT_DIR as save_pretrained "
        "does. Nothing is downloaded. Then: rtp local --model-source OUT_DIR.",
    )
    p.add_argument(
        "out_dir", metavar="OUT_DIR", help="the model folder to write (must not exist or be empty)"
    )
    p.add_argument(
        "--arch", choices=ARCHITECTURES, default="llama", help="architecture (default: %(default)s)"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_TOKENIZER_VOCAB,
        help="tokenizer vocabulary to train (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    p.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="tie the output head to the input embeddings (one shared weight), as SmolLM, "
        "Llama-3.2-1B/3B and the small Qwen2.5 models do",
    )
    p.set_defaults(handler=_cmd_make_tiny_model)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from rtp_support.demo_data import demo_corpus
    from rtp_support.tiny_models import write_tiny_model

    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty folder: choose a new OUT_DIR")
    if args.vocab_size < 300:
        raise UserError(
            f"--vocab-size must be at least 300 (256 bytes + EOS + merges), got {args.vocab_size}"
        )
    texts = (path.read_text(encoding="utf-8", errors="replace") for _, path in demo_corpus())
    write_tiny_model(
        out,
        args.arch,
        texts=texts,
        tokenizer_vocab_size=args.vocab_size,
        seed=args.seed,
        tie=args.tie_embeddings,
    )
    config = json.loads((out / "config.json").read_text())
    print(
        f"rtp make-tiny-model: wrote a random {args.arch} model ({config['num_hidden_layers']} layers, "
        f"hidden {config['hidden_size']}, vocabulary {config['vocab_size']}"
        f"{', head tied to the embeddings' if config.get('tie_word_embeddings') else ''}) "
        f"and its tokenizer to {out}"
    )
    return 0
