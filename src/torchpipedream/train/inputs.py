"""The model, data, loss and optimizer that a :class:`TrainConfig` names."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from ..models import cross_entropy, digits_data, get_model, text_data
from ..model.state_files import StateFileError, load_state_file
from .config import TrainConfig, TrainError

__all__ = ["load_data", "build_model", "seeded_model", "loss_for", "optimizer_factory", "minibatches"]


def _is_text_model(name: str) -> bool:
    return name in ("transformer", "gpt2")


def load_data(cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits images for the vision models (and a user's model), stdlib text for the LM:
    (train inputs, train targets, test inputs, test targets)."""
    if _is_text_model(cfg.model):
        return text_data(context=64, max_bytes=120_000)
    return digits_data(seed=0)


def build_model(cfg: TrainConfig) -> nn.Module:
    """The configuration's model, initialised from ``cfg.seed`` (the same on every rank), or
    from the weights of ``--init``."""
    model = seeded_model(cfg.model, cfg.seed)
    if cfg.init:
        try:
            state = load_state_file(cfg.init)
            missing, unexpected = model.load_state_dict(state, strict=False)
        except (StateFileError, RuntimeError) as exc:
            raise TrainError(f"--init {cfg.init}: {str(exc).splitlines()[0][:300]}") from None
        if missing or unexpected:
            raise TrainError(f"--init {cfg.init} does not fit --model {cfg.model}: missing {sorted(missing)[:4]}, "
                             f"unexpected {sorted(unexpected)[:4]}")
    return model


def loss_for(cfg: TrainConfig) -> Callable[..., torch.Tensor]:
    """The loss of every built-in model: cross entropy over the last dimension."""
    return cross_entropy


def optimizer_factory(cfg: TrainConfig) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> optimizer`` for ``--optimizer`` and ``--lr`` (see ``Pipeline``'s ``optimizer``);
    picklable, so that ``verify`` can send it to its worker processes."""
    lr, kind = cfg.lr, cfg.optimizer
    if kind == "sgd":
        return functools.partial(torch.optim.SGD, lr=lr)
    if kind == "momentum":
        return functools.partial(torch.optim.SGD, lr=lr, momentum=0.9)
    return functools.partial(torch.optim.Adam, lr=lr)


def seeded_model(name: str, seed: int) -> nn.Module:
    """Model ``name`` initialised from ``seed``: a picklable factory with ``functools.partial``."""
    torch.manual_seed(seed)
    return get_model(name)


def minibatches(x: torch.Tensor, y: torch.Tensor, batch_size: int, limit: int | None,
                shuffle_seed: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Minibatches as a list (deterministic order; reshuffled per epoch by ``shuffle_seed``).

    With a shuffle seed (training) a last partial minibatch is dropped, as DataLoader's
    ``drop_last=True`` does: it could not be split into microbatches, and every method then
    sees the same minibatches. Evaluation keeps every sample.
    """
    idx = torch.arange(len(x))
    if shuffle_seed is not None:
        idx = idx[torch.randperm(len(x), generator=torch.Generator().manual_seed(shuffle_seed))]
    end = len(x) - len(x) % batch_size if shuffle_seed is not None and len(x) >= batch_size else len(x)
    out = [(x[idx[i:i + batch_size]], y[idx[i:i + batch_size]]) for i in range(0, end, batch_size)]
    return out[:limit] if limit else out
