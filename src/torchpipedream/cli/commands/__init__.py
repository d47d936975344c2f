"""One module per CLI subcommand; each defines ``register(subparsers)``.

cli.py discovers every module in this package, so a new command is one new file. A command
module imports nothing heavy at its top (no torch, no matplotlib): the command line starts in
a fraction of a second, and a command imports what it needs when it runs. A command's handler
returns an exit code; it raises :class:`CommandError` (or one of the library's ValueError
subclasses) for bad input, which cli.py prints as one line without a traceback.
"""

from __future__ import annotations

__all__ = ["CommandError"]


class CommandError(ValueError):
    """A command was given input it cannot use; the message tells the user what to do."""
