"""Optimizer state keyed by parameter name, so that it moves between plans.

``torch.optim.Optimizer.state_dict()`` numbers parameters by their position in the optimizer's
groups: an index means nothing once the parameters are split into stages differently. A
checkpoint therefore stores, per parameter *name* (the original model's), its state (momentum
buffer, Adam's moments and step) and the hyperparameters of the group it was in (learning rate
after a scheduler, betas, weight decay). Loading builds the new optimizer's state dict from
those, group by group: a group takes the hyperparameters its first parameter had. Plain
tensors and Python values only, so the file loads with ``weights_only=True``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["state_by_name", "load_state_by_name", "OptimizerStateError"]


#: Entries of a saved group that are not hyperparameters: its members (positions, and names when
#: the optimizer was given named parameters), which belong to the group of the plan that saved.
_NOT_HYPER = ("params", "param_names")


class OptimizerStateError(ValueError):
    """Saved optimizer state does not fit this optimizer; the message names the parameter."""


def state_by_name(optimizer: torch.optim.Optimizer, name_of: dict[int, str]) -> dict[str, dict[str, Any]]:
    """``{name: {"class", "hyper", "state"}}`` for every parameter of ``optimizer`` (``name_of``:
    ``id(parameter) -> name``)."""
    saved = optimizer.state_dict()
    out: dict[str, dict[str, Any]] = {}
    for group, live in zip(saved["param_groups"], optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k not in _NOT_HYPER}
        for index, param in zip(group["params"], live["params"]):
            out[name_of[id(param)]] = {"class": type(optimizer).__name__, "hyper": hyper,
                                       "state": dict(saved["state"].get(index, {}))}
    return out


def load_state_by_name(optimizer: torch.optim.Optimizer, saved: dict[str, dict[str, Any]],
                       name_of: dict[int, str]) -> None:
    """Give ``optimizer`` the saved state of each of its parameters, by name."""
    state = optimizer.state_dict()
    for group, live in zip(state["param_groups"], optimizer.param_groups):
        first: dict[str, Any] | None = None
        for index, param in zip(group["params"], live["params"]):
            name = name_of[id(param)]
            entry = saved.get(name)
            if entry is None:
                raise OptimizerStateError(f"the checkpoint holds no optimizer state for parameter {name!r}")
            if entry.get("class") != type(optimizer).__name__:
                raise OptimizerStateError(
                    f"parameter {name!r} was trained with {entry.get('class')}, this pipeline's optimizer is "
                    f"{type(optimizer).__name__}: resume with the same optimizer")
            if entry["state"]:
                state["state"][index] = entry["state"]
            first = first or entry
        if first is not None:
            group.update({k: v for k, v in first["hyper"].items() if k not in _NOT_HYPER})
    optimizer.load_state_dict(state)
