"""Dynamic loss scaling for float16 training (``Pipeline(precision="fp16")``).

float16 flushes gradients below about 6e-8 to zero; multiplying the loss by a large scale S
before the backward keeps them representable, and the update divides by S again
(Micikevicius et al., "Mixed Precision Training", ICLR 2018). The scale is dynamic: an update
whose gradients hold an inf or NaN (the scaled backward overflowed) is skipped and S is
multiplied by ``backoff_factor``; after ``growth_interval`` updates in a row without one, S is
multiplied by ``growth_factor``. The defaults are those of ``torch.amp.GradScaler``.

In a pipeline the overflow may happen on any stage, so the decision is global: at every
update each rank checks its own gradients, the ranks agree (a MAX over every rank), and every
stage skips, or applies, the same updates; so every rank's scale moves the same way. That needs
stages that update together: the synchronous kinds (flush, gpipe, zb-h1, zb-h2), where update u of every
stage applies the gradients of minibatch u. The engine scales the root of the last stage's
backward: the *summed* loss of a microbatch times S (weights.py, "Loss scaling by
construction"), so the gradients that cross the cuts are S × the summed loss's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import torch

__all__ = ["LossScaling", "LossScaler", "has_nonfinite"]


@dataclass(frozen=True)
class LossScaling:
    """The dynamic loss scale's policy (``Pipeline(loss_scaling=)``); torch's defaults."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        checks = [
            ("init_scale", self.init_scale, isinstance(self.init_scale, (int, float)) and math.isfinite(self.init_scale)
             and self.init_scale > 0, "a positive finite number"),
            ("growth_factor", self.growth_factor, isinstance(self.growth_factor, (int, float))
             and math.isfinite(self.growth_factor) and self.growth_factor > 1, "a finite number above 1"),
            ("backoff_factor", self.backoff_factor, isinstance(self.backoff_factor, (int, float))
             and 0 < self.backoff_factor < 1, "a number between 0 and 1"),
            ("growth_interval", self.growth_interval, isinstance(self.growth_interval, int)
             and not isinstance(self.growth_interval, bool) and self.growth_interval >= 1, "a positive integer"),
        ]
        for name, value, ok, want in checks:
            if not ok:
                raise ValueError(f"LossScaling.{name} must be {want}, got {value!r}")


def has_nonfinite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether any of ``tensors`` holds an inf or NaN (one synchronisation, at the end)."""
    flags = [torch.logical_not(torch.isfinite(t).all()) for t in tensors if t is not None and t.numel()]
    return bool(torch.stack(flags).any().item()) if flags else False


class LossScaler:
    """One rank's copy of the loss scale; every rank's moves identically.

    Args:
        policy: the scale's policy.
        agree: ``agree(found_here) -> found_anywhere``: the MAX of every rank's overflow flag
            (a collective; identity in one process).
    """

    def __init__(self, policy: LossScaling, agree: Callable[[bool], bool]) -> None:
        self.policy = policy
        self.scale = float(policy.init_scale)
        self.good_updates = 0  # updates in a row without an overflow (torch's growth tracker)
        self.skipped_updates = 0  # in total, this process's lifetime (and checkpoints')
        self._agree = agree

    def decide(self, found_here: bool) -> tuple[bool, float]:
        """Agree on one update: (apply it?, the scale its gradients carry). Moves the scale."""
        used = self.scale
        overflow = self._agree(bool(found_here))
        if overflow:
            self.scale *= self.policy.backoff_factor
            self.good_updates = 0
            self.skipped_updates += 1
        else:
            self.good_updates += 1
            if self.good_updates == self.policy.growth_interval:
                self.scale *= self.policy.growth_factor
                self.good_updates = 0
        return not overflow, used

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_updates": self.good_updates, "skipped_updates": self.skipped_updates,
                "policy": asdict(self.policy)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scale and counters (the policy stays the one this pipeline was built with)."""
        scale = state.get("scale")
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"loss scaler state: 'scale' must be a positive number, got {scale!r}")
        counts = {k: state.get(k, 0) for k in ("good_updates", "skipped_updates")}
        for k, v in counts.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"loss scaler state: {k!r} must be a non-negative integer, got {v!r}")
        self.scale = float(scale)
        self.good_updates, self.skipped_updates = counts["good_updates"], counts["skipped_updates"]
