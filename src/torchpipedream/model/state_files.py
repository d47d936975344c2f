"""A model's ``state_dict`` as a file: ``.pt`` (``torch.save``, read back with
``weights_only=True``) or ``.safetensors``. What ``torchpipedream export`` writes from a
checkpoint and what ``train --init`` (or your own ``model.load_state_dict``) starts from, so that
pipeline checkpoints and ordinary PyTorch weights go both ways. Reading runs no code."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["save_state_file", "load_state_file", "StateFileError", "SUFFIXES"]

SUFFIXES = (".pt", ".pth", ".safetensors")


class StateFileError(ValueError):
    """A state file cannot be written or read; the message names the file and why."""


def _safetensors(path: Path):  # type: ignore[no-untyped-def]
    try:
        import safetensors.torch as st  # lazy: an optional dependency, needed for .safetensors files only
    except ImportError:
        raise StateFileError(f"{path}: .safetensors files need the safetensors package (pip install safetensors), "
                             "or use a .pt file") from None
    return st


def _suffix(path: Path) -> str:
    if path.suffix not in SUFFIXES:
        raise StateFileError(f"{path}: use a file name ending in {', '.join(SUFFIXES)}")
    return path.suffix


def save_state_file(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write ``state`` (name -> tensor) to ``path``; names that share a tensor (tied weights)
    each get their values (safetensors stores no shared memory)."""
    path = Path(path)
    suffix = _suffix(path)
    plain = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".safetensors":
        _safetensors(path).save_file({k: v.clone() for k, v in plain.items()}, str(path))
    else:
        torch.save(plain, path)
    return path


def load_state_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The state a file holds (name -> tensor), read without running code."""
    path = Path(path)
    suffix = _suffix(path)
    if not path.is_file():
        raise StateFileError(f"{path}: no such file")
    try:
        if suffix == ".safetensors":
            state = _safetensors(path).load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except StateFileError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise StateFileError(f"{path} is not a state file of plain tensors (loading runs no code): {first}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # train's OUT/checkpoint.pt
            raise StateFileError(f"{path} is a `torchpipedream train` run's checkpoint, not a state dict: "
                                 f"`torchpipedream export {path.parent} --out model.pt` writes one")
        raise StateFileError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    return state
