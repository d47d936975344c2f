"""Buffers of a replicated stage (BatchNorm's running statistics) kept equal across its replicas.

Each replica runs its own microbatches, so its BatchNorm layers update their running mean and
variance from those alone. At every all-reduce of the gradients (the ``AR`` action) the
replicas also combine what their buffers changed since the last one:

    buffer ← buffer at the last sync + mean over replicas of (buffer now − buffer at the last sync)

for floating-point buffers (the running statistics: the average of the replicas' estimates,
which uses every microbatch of the update), and the *sum* of the changes for integer buffers
(``num_batches_tracked`` counts every microbatch the stage ran, as one process would). A buffer
no replica changed (a causal mask, position ids) comes back bit for bit.

Why average rather than broadcast replica 0's (what DDP's ``broadcast_buffers`` does): a
broadcast throws away the statistics of every other replica's microbatches, and the replicas'
buffers would still differ between syncs in a way that depends on which replica is 0. With
the average the statistics see all the samples of the update, and after every update all
replicas hold identical buffers, so a checkpoint (replica 0's file) loses nothing. It is not
bit-identical to one process running the same microbatches in order (each replica starts from
the same value, not from the previous replica's), which is why the parity tests compare
buffers on plans without replicated stages.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .weights import wait_for

__all__ = ["ReplicaBuffers"]


class ReplicaBuffers:
    """The buffers of one replicated stage module and their value at the last sync."""

    def __init__(self, module: nn.Module, group: Any, replicas: int) -> None:
        self.buffers = [b for _, b in module.named_buffers()
                        if b.is_floating_point() or not (b.is_complex() or b.dtype == torch.bool)]
        self.group, self.replicas = group, replicas
        self.snapshot()

    def snapshot(self) -> None:
        """Take the current buffers as the common base (after a sync or a checkpoint load)."""
        self._base = [b.detach().clone() for b in self.buffers]

    def sync(self, timeout_s: float) -> int:
        """Combine the replicas' changes since the last sync (collective over the replicas);
        returns the bytes reduced."""
        if not self.buffers:
            return 0
        with torch.no_grad():
            deltas = torch.cat([(b - base).to(torch.float64).flatten() for b, base in zip(self.buffers, self._base)])
            wait_for(dist.all_reduce(deltas, group=self.group, async_op=True), timeout_s, "buffer all-reduce")
            pos = 0
            for b, base in zip(self.buffers, self._base):
                d = deltas[pos: pos + b.numel()].view_as(b)
                pos += b.numel()
                if b.is_floating_point():
                    b.copy_(base + (d / self.replicas).to(b.dtype))
                else:
                    b.copy_(base + d.round().to(b.dtype))
        self.snapshot()
        return deltas.numel() * deltas.element_size()
