#!/usr/bin/env python3
"""Lines of code in Python packages, without docstrings, comments and blank lines.

    scripts/count_code_lines.py trainer/checkpointing [--max N] [--per-file]

A line counts when a token other than a comment or a string that is a docstring (module,
class, function, or the string under an assignment that documents it) is on it. Exits 1 when
the total is above --max. `make test` runs it on trainer/checkpointing
(tests/unit/test_code_size.py), with the budget written there.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

SKIPPED_TOKENS = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()

    def is_string(node: ast.stmt) -> bool:
        return (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        )

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        documented = isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        for index, statement in enumerate(body):
            after_assignment = index > 0 and isinstance(body[index - 1], ast.Assign | ast.AnnAssign)
            if is_string(statement) and ((index == 0 and documented) or after_assignment):
                lines.update(range(statement.lineno, (statement.end_lineno or statement.lineno) + 1))
    return lines


def code_lines(source: str) -> int:
    """The number of lines of `source` that hold code."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIPPED_TOKENS:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - _docstring_lines(ast.parse(source)))


def count(folder: Path) -> dict[str, int]:
    """Code lines per .py file under `folder` (recursively), by path relative to it."""
    return {
        str(path.relative_to(folder)): code_lines(path.read_text()) for path in sorted(folder.rglob("*.py"))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--max", type=int, default=None, help="exit 1 when the total is above this")
    parser.add_argument("--per-file", action="store_true", help="print each file's count too")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    per_file = count(args.folder)
    total = sum(per_file.values())
    if args.per_file:
        for name, lines in sorted(per_file.items(), key=lambda item: -item[1]):
            print(f"{lines:6d}  {name}")
    print(
        f"{total} lines of code in {args.folder}" + (f" (at most {args.max})" if args.max is not None else "")
    )
    if args.max is not None and total > args.max:
        print(f"{args.folder} is {total - args.max} lines over its budget of {args.max}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
