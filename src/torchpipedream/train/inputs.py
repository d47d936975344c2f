"""The model, data, loss and optimizer that a :class:`TrainConfig` names."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..model.capture import canonical_names
from ..model.graph import LayerGraph
from ..models import cross_entropy, get_model
from ..model.state_files import StateFileError, load_state_file
from ..plans.plan import Plan
from .config import TrainConfig, TrainError, load_data, tensor_degree

__all__ = ["load_data", "build_model", "seeded_model", "loss_for", "optimizer_factory", "build_optimizer",
           "decay_groups", "minibatches", "pipeline_units", "stage_modules", "units_named_by_model"]


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


def pipeline_units(cfg: TrainConfig, model: nn.Module) -> list[nn.Module] | None:
    """With ``--tensor-parallel`` > 1, the model as the chain of its own modules it lists
    (``model.pipeline_units()``: GPT-2's embeddings, blocks and head), which train then profiles
    and cuts: torch.export would trace the model into a graph with no layer left to split.
    None otherwise (the model is profiled and split as given)."""
    units = getattr(model, "pipeline_units", None)
    return list(units()) if tensor_degree(cfg) > 1 and callable(units) else None


def units_named_by_model(graph: LayerGraph, units: list[nn.Module], model: nn.Module) -> LayerGraph:
    """``graph`` (the profile of ``units``) with its shared parameters named as ``model`` names
    them, as the pipeline of the units cut from the model finds them; returns it."""
    chain, names = nn.Sequential(*units), canonical_names(model)
    for t in graph.tied:
        t.name = names.get(id(chain.get_parameter(t.name)), t.name)
    return graph


def stage_modules(units: list[nn.Module], plan: Plan) -> list[nn.Module]:
    """Each stage of ``plan`` (whose layers are the units' indices, as their profile names them)
    as the chain of its units."""
    try:
        return [nn.Sequential(*(units[int(name)] for name in st.layers)) for st in plan.stages]
    except (ValueError, IndexError):
        raise TrainError(f"the plan's layers ({plan.stages[0].layers[:3]} ...) are not this model's "
                         f"{len(units)} units: plan it again") from None


def loss_for(cfg: TrainConfig) -> Callable[..., torch.Tensor]:
    """The loss of every built-in model: cross entropy over the last dimension."""
    return cross_entropy


def optimizer_factory(cfg: TrainConfig) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> optimizer`` for ``--optimizer``, ``--lr`` and ``--weight-decay`` (see
    ``Pipeline``'s ``optimizer``); picklable, so that ``verify`` can send it to its worker processes."""
    return functools.partial(build_optimizer, kind=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)


#: The torch optimizer of each ``--optimizer`` and its fixed arguments.
_OPTIMIZER_CLASSES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {}), "momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "adam": (torch.optim.Adam, {}), "adamw": (torch.optim.AdamW, {})}


def build_optimizer(params: Iterable[Any], kind: str, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer ``kind`` on ``params``: (name, parameter) pairs, as a pipeline stage gives
    them, or bare parameters (the profiler, ``verify``'s reference). With ``adamw`` or a weight
    decay, the parameters go into two groups (:func:`decay_groups`)."""
    cls, fixed = _OPTIMIZER_CLASSES[kind]
    items = list(params)
    if kind == "adamw" or weight_decay:
        return cls(decay_groups(items, weight_decay), lr=lr, **fixed)
    return cls(items, lr=lr, **fixed)


def decay_groups(params: Iterable[Any], weight_decay: float) -> list[dict[str, Any]]:
    """The standard weight-decay recipe as parameter groups: ``weight_decay`` on the matrices
    and kernels (2+ dimensions), none on biases and normalisation weights (fewer), which decay
    would only pull towards zero without regularising. Only non-empty groups: a stage may hold
    no bias. Items keep their form (a (name, parameter) pair or a bare parameter)."""
    items = list(params)

    def tensor(item: Any) -> torch.Tensor:
        return item[1] if isinstance(item, tuple) else item

    groups = [{"params": [i for i in items if tensor(i).ndim >= 2], "weight_decay": weight_decay},
              {"params": [i for i in items if tensor(i).ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


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
