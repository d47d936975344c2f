"""The float16 reference of the loss-scaling tests (not a test module): gradient accumulation
under float16 autocast with torch's own ``torch.amp.GradScaler``, scaling each microbatch's
summed loss as the pipeline does (``runtime/loss_scaling.py``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def grad_scaler_training(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, microbatches: int,
                         loss_fn: Callable[..., torch.Tensor], **scaling: Any) -> tuple[float, int]:
    """Train ``model`` on ``batches`` of (x, y), ``microbatches`` per update; returns the final
    scale and the number of updates the GradScaler skipped."""
    scaler = torch.amp.GradScaler("cpu", **scaling)
    skipped = 0
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(xs), ys)
            scaler.scale(loss * len(ys)).backward()
        scaler.unscale_(optimizer)
        for p in model.parameters():
            p.grad /= len(y)
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < before
    return scaler.get_scale(), skipped
