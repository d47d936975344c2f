"""The `torchpipedream` command line: profile | show | plan | simulate | timeline | train.

Each subcommand lives in its own module under ``torchpipedream.commands`` and is discovered
here. Bad input (any ValueError from the library, FileNotFoundError) becomes one clear line
on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from typing import Sequence

from . import __version__, commands
from .freed_memory import keep_freed_memory
from .huge_pages import prefer_huge_pages

__all__ = ["main", "build_parser", "CommandError"]


class CommandError(ValueError):
    """A command was given input it cannot use; the message tells the user what to do."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchpipedream",
        description="PipeDream pipeline-parallel training for PyTorch: profile a model, plan its "
        "stages, prove and simulate the schedule, train, and see where the time went.",
    )
    parser.add_argument("--version", action="version", version=f"torchpipedream {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Before this process allocates its first tensor (the profile runs here): see huge_pages.py
    # and freed_memory.py.
    prefer_huge_pages()
    keep_freed_memory()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"torchpipedream {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"torchpipedream {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
