"""One module per CLI subcommand; each defines ``register(subparsers)``.

cli.py discovers every module in this package, so a new command is one new file.
A command's handler returns an exit code; it raises ``CommandError`` (or one of the library's
ValueError subclasses) for bad input, which cli.py prints as one line without a traceback.
"""
