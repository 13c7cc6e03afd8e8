"""The errors staging raises, in a module of their own so every other staging module can raise them.

`StageError` is the one a user sees: the stage cannot go on, and its message says what was
wrong and what to do (the CLI prints it as one line, exit code 2). `VerificationError` is
internal: a body did not match what S3 said about it, and the download is retried before
it becomes a `StageError`.
"""

from __future__ import annotations


class StageError(RuntimeError):
    """Staging cannot go on; the message says what was wrong and what to do."""


class VerificationError(Exception):
    """A body did not match what S3 said about it (retried, then a StageError)."""
