"""The `torchpipedream` command line: profile | show | plan | simulate | timeline | train.

Each subcommand lives in its own module under ``torchpipedream.cli.commands`` and is discovered
here. Bad input (any ValueError from the library, FileNotFoundError) becomes one clear line
on stderr and exit status 2, never a traceback.

:func:`main` may be called from Python and changes nothing process-wide; the installed
``torchpipedream`` command and ``python -m torchpipedream`` enter through :func:`console_main`,
whose process is the command's own, so it tunes its allocator first (``host/tuning.py``).
Starting the command imports no torch: commands that need it import it when they run.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from typing import Sequence

from .. import __version__
from ..host.tuning import tune_own_process
from . import commands
from .commands import CommandError

__all__ = ["main", "console_main", "build_parser", "CommandError"]


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
    """Run one command (``argv`` defaults to ``sys.argv[1:]``); returns its exit status."""
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


def console_main() -> int:
    """The ``torchpipedream`` command: this process is the command's own, so it allocates like
    the workers it starts (huge pages, freed memory kept; ``host/tuning.py``), then runs :func:`main`."""
    tune_own_process()  # before the first tensor: the profile and `train`'s preparation run here
    return main()


if __name__ == "__main__":
    sys.exit(console_main())
