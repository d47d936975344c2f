"""One module per CLI subcommand; each defines ``register(subparsers)``.

``cli/app.py`` discovers every module in this package, so a new command is one new file. Every
command module loads at start-up, so none imports anything heavy at its top (no torch, no
matplotlib, neither the planner nor the simulator): the command line starts in a fraction of a
second, and a command imports those when it runs (each such import says why: ``# lazy:``). A
command's handler returns an exit code; it raises :class:`CommandError` (or one of the
library's ValueError subclasses) for bad input, which ``cli/app.py`` prints as one line without
a traceback.
"""

from __future__ import annotations

__all__ = ["CommandError"]


class CommandError(ValueError):
    """A command was given input it cannot use; the message tells the user what to do."""
