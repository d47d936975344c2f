"""The `torchpipedream` command line: ``app.py`` parses and dispatches; ``commands/`` holds one
module per subcommand (profile, show, plan, simulate, timeline, train, verify, export)."""

from __future__ import annotations

from .app import CommandError, build_parser, console_main, main

__all__ = ["main", "console_main", "build_parser", "CommandError"]
