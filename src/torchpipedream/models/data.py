"""Data for the example models: real data sets for training, random batches for profiling.

* :func:`digits_data` — the 8x8 handwritten digits that scikit-learn distributes (1,797
  images), shipped inside this package (``torchpipedream/data``: its README and licence), a
  fixed stratified train/test split, pixels scaled to [0, 1]. No scikit-learn needed.
* :func:`text_data` — a character corpus built from this Python's own standard-library
  ``.py`` sources (always present, no download), cut into next-character windows.
* :func:`sample_input` / :func:`loss_fn` — a random batch of the right shape and dtype and
  the training loss for each registry model; what ``profile`` needs, without any data set.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from .language import VOCAB_SIZE

__all__ = [
    "digits_data",
    "text_data",
    "encode_text",
    "decode_text",
    "sample_input",
    "loss_fn",
    "cross_entropy",
    "DataError",
]


class DataError(ValueError):
    """A data set cannot be built (bad argument)."""


def digits_data(
    seed: int = 0, test_fraction: float = 0.25, flatten: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Return ``(x_train, y_train, x_test, y_test)`` from the bundled digits.

    Inputs are float32 in [0, 1] (pixel values 0..16 divided by 16), shaped ``(N, 1, 8, 8)``,
    or ``(N, 64)`` with ``flatten``; labels are int64 in 0..9. The split is stratified (each
    digit contributes ``round(count · test_fraction)`` of its images to the test set, chosen at
    random) and fixed by ``seed``; both sets are in a seed-dependent random order.
    """
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"digits_data: test_fraction must be in (0, 1), got {test_fraction}")
    with resources.files("torchpipedream").joinpath("data", "digits.npz").open("rb") as f:
        stored = np.load(f, allow_pickle=False)
        images, labels = stored["images"], stored["labels"]
    x = torch.from_numpy(images.astype(np.float32) / 16.0)
    y = torch.from_numpy(labels.astype(np.int64))
    g = torch.Generator().manual_seed(seed)
    train_parts, test_parts = [], []
    for digit in range(10):
        members = torch.nonzero(y == digit).flatten()
        members = members[torch.randperm(len(members), generator=g)]
        n_test = round(len(members) * test_fraction)
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    train_idx, test_idx = torch.cat(train_parts), torch.cat(test_parts)
    train_idx = train_idx[torch.randperm(len(train_idx), generator=g)]
    test_idx = test_idx[torch.randperm(len(test_idx), generator=g)]
    x = x.reshape(-1, 64) if flatten else x.reshape(-1, 1, 8, 8)
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def encode_text(text: str) -> Tensor:
    """Map text to ids: printable ASCII 32..126 → 0..94, newline → 95, tab → spaces; other
    characters are dropped."""
    text = text.replace("\t", "    ")
    ids = [95 if ch == "\n" else ord(ch) - 32 for ch in text if ch == "\n" or 32 <= ord(ch) <= 126]
    return torch.tensor(ids, dtype=torch.int64)


def decode_text(ids: Tensor) -> str:
    """Inverse of :func:`encode_text` (for looking at samples)."""
    return "".join("\n" if i == 95 else chr(i + 32) for i in ids.tolist())


def _stdlib_corpus(max_bytes: int) -> str:
    """The standard library's top-level ``.py`` files, sorted by name, concatenated up to
    ``max_bytes`` characters. Deterministic for a given Python version."""
    lib = Path(os.path.dirname(os.__file__))
    parts: list[str] = []
    total = 0
    for path in sorted(lib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not parts:
        raise DataError(f"text_data: no readable .py files under {lib}")
    return "".join(parts)[:max_bytes]


def text_data(
    context: int = 64, max_bytes: int = 300_000, val_fraction: float = 0.1, stride: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Return ``(x_train, y_train, x_val, y_val)`` next-character windows of length ``context``.

    ``y`` is ``x`` shifted by one character. The corpus's last ``val_fraction`` is held out
    (split before windowing, so no window straddles the two). Windows start every ``stride``
    characters (default: ``context``, i.e. non-overlapping).
    """
    if context < 1:
        raise DataError(f"text_data: context must be >= 1, got {context}")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"text_data: val_fraction must be in (0, 1), got {val_fraction}")
    stride = stride or context
    ids = encode_text(_stdlib_corpus(max_bytes))
    cut = int(len(ids) * (1.0 - val_fraction))

    def windows(seq: Tensor) -> tuple[Tensor, Tensor]:
        starts = torch.arange(0, len(seq) - context - 1 + 1, stride)
        if len(starts) == 0:
            raise DataError(f"text_data: corpus too short for context {context}; raise max_bytes")
        offsets = torch.arange(context)
        x = seq[starts[:, None] + offsets]
        y = seq[starts[:, None] + offsets + 1]
        return x, y

    return (*windows(ids[:cut]), *windows(ids[cut:]))


def sample_input(name: str, batch_size: int, seed: int = 0, context: int = 64) -> tuple[Tensor, Tensor]:
    """A random ``(input, target)`` batch shaped for registry model ``name`` (for profiling)."""
    if batch_size < 1:
        raise DataError(f"sample_input: batch_size must be >= 1, got {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    if name in ("mlp", "cnn", "resnet"):
        x = torch.rand(batch_size, 1, 8, 8, generator=gen)
        return x, torch.randint(0, 10, (batch_size,), generator=gen)
    if name in ("transformer", "gpt2"):
        x = torch.randint(0, VOCAB_SIZE, (batch_size, context), generator=gen)
        return x, torch.randint(0, VOCAB_SIZE, (batch_size, context), generator=gen)
    raise DataError(f"sample_input: no sample input known for model {name!r} "
                    "(known: mlp, cnn, resnet, transformer, gpt2)")


def cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy over every position: works for ``(N, C)`` and ``(N, T, C)`` logits."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def loss_fn(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The training loss of registry model ``name`` (cross-entropy for all of them)."""
    if name in ("mlp", "cnn", "resnet", "transformer", "gpt2"):
        return cross_entropy
    raise DataError(f"loss_fn: no loss known for model {name!r}")
