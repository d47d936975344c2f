"""`python -m torchpipedream` runs the command-line tool."""

from .cli import console_main

if __name__ == "__main__":
    raise SystemExit(console_main())
