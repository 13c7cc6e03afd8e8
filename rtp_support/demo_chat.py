"""A small conversation set made offline from real text on this machine, for `rtp local --sft`.

Each conversation asks what a standard-library function does and answers with the first
paragraph of its docstring: real questions and real answers written by people, with no
download. The set is the same on every machine with the same Python (sorted files, a fixed
cap), and a tiny model with a ChatML template (the layout SmolLM2 and Qwen2.5 use) is made
beside it to fine-tune.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, written here for the demo's tiny model (whose trained tokenizer has no template)."""
DEFAULT_CONVERSATIONS = 400
MAX_ANSWER_CHARS = 400


def _functions(path: Path) -> Iterator[tuple[str, str]]:
    """(qualified name with signature, first docstring paragraph) of the module's public functions."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    module = path.stem
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        first = " ".join(doc.strip().split("\n\n")[0].split())
        if 20 <= len(first) <= MAX_ANSWER_CHARS:
            arguments = ", ".join(a.arg for a in node.args.args)
            yield f"{module}.{node.name}({arguments})", first


def demo_conversations(limit: int = DEFAULT_CONVERSATIONS) -> list[dict]:
    """Up to `limit` conversations from the standard library's docstrings (module docstring)."""
    import sysconfig

    conversations = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for name, answer in _functions(path):
            conversations.append(
                {
                    "messages": [
                        {"role": "user", "content": f"What does {name} do?"},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
            if len(conversations) >= limit:
                return conversations
    return conversations


def write_demo_chat(path: Path, limit: int = DEFAULT_CONVERSATIONS) -> Path:
    """The demo conversations as JSON Lines at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c) + "\n" for c in demo_conversations(limit)))
    return path


def write_demo_chat_model(folder: Path) -> Path:
    """A tiny tied Llama (rtp make-tiny-model --tie-embeddings) with the ChatML template."""
    from rtp_support.demo_data import demo_corpus
    from rtp_support.tiny_models import write_tiny_model

    texts = (path.read_text(encoding="utf-8", errors="replace") for _, path in demo_corpus())
    write_tiny_model(folder, "llama", texts=texts, tie=True)
    (folder / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    return folder
