"""`UserError`: the exception a subcommand raises for bad command-line input.

`rtp_cli.main` prints it (and the other error types it lists as the user's) as one line
that says what was wrong and what to do, with exit code 2, instead of a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the command line."""
