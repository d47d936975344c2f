"""`torchpipedream export`: a checkpoint's weights as a plain state_dict file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ...util.output_files import check_output, writing
from . import CommandError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's weights as a plain state_dict (.pt or .safetensors)",
        description="Read a checkpoint (a directory with manifest.json, or a run's --out, whose newest "
        "checkpoint is taken), verify it, and write the model's state_dict: every parameter and buffer "
        "under the model's own names, so that the original nn.Module loads it with load_state_dict. "
        "train --init starts a run from such a file.",
    )
    p.add_argument("checkpoint", help="a checkpoint directory, or a run's --out directory")
    p.add_argument("--out", required=True, help="the file to write: .pt (torch.save) or .safetensors")
    p.set_defaults(handler=_handle)


def _writer_errors(path: Path) -> tuple[type[BaseException], ...]:
    """The writer's own exception types beyond OSError and RuntimeError: safetensors' for its files."""
    if path.suffix != ".safetensors":
        return ()
    try:
        from safetensors import SafetensorError  # lazy: an optional dependency, for .safetensors files only
    except ImportError:
        return ()  # save_state_file says the package is missing
    return (SafetensorError,)


def _handle(args: argparse.Namespace) -> int:
    # lazy: these import torch; the command line starts torch-free and `export` loads it when it runs
    from ...runtime.checkpoint import MANIFEST, latest_checkpoint, read_stage_states
    from ...train.out_dir import checkpoints_root
    from ...model.state_files import SUFFIXES, save_state_file

    out = Path(args.out)
    if out.suffix not in SUFFIXES:
        raise CommandError(f"--out {out}: use a file name ending in {', '.join(SUFFIXES)}")
    check_output(out, "--out")
    source = Path(args.checkpoint)
    if not (source / MANIFEST).is_file():
        found = latest_checkpoint(checkpoints_root(source))
        if found is None:
            raise CommandError(f"{source}: not a checkpoint (no {MANIFEST}) and no complete checkpoint under "
                               f"{source / 'checkpoints'}")
        source = found
    state = read_stage_states(source)
    with writing(out, "--out", errors=_writer_errors(out)):
        path = save_state_file(state, out)
    print(f"wrote {path}: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} values, from {source}")
    return 0
