"""Weight versions of one stage: the live weights, stashes of older versions still in use,
gradient accumulation, the replicas' all-reduce and the optimizer step.

How a version is used. Every forward ``F`` and backward ``B`` names the version ``v`` it
computes with. The compute runs through ``torch.func.functional_call`` on *aliases* of the
parameters (``p.data`` views made leaves with ``requires_grad``; they share storage with the
parameter but have their own autograd version counter). The autograd graph of ``F`` holds
those aliases, so ``B`` differentiates with exactly the weights ``F`` used: weight stashing
without a copy at ``F`` time.

Copy on update, only where needed. The schedule is known in advance, so for every version
we count the ``F``/``B`` actions that will still use it. At an optimizer step, if the
current version is still needed (an in-flight minibatch has run ``F`` but not ``B``, or a
later ``F`` is scheduled with it, as in vertical sync or 2BW), every parameter is moved to a
fresh copy (``p.data = p.data.clone()``) *before* the optimizer updates it in place; the old
storage then belongs to the stash alone. When no one needs it (flush, gpipe, the last stage
of a pipedream pipeline), the step is in place and nothing is copied. Stashes are dropped
when their last use has run, so a pipedream stage holds at most one version per in-flight
minibatch and 2BW at most two.

Optimizer. Any ``torch.optim`` optimizer works: it is built by the user's factory on this
stage's own parameters (each rank owns only its stage), keeps its state keyed by the
parameter objects, and steps them with the accumulated gradient: the gradient computed with
the stashed weights is applied to the latest weights with the optimizer's state.

Loss scaling by construction. The engine back-propagates, per microbatch, the gradient of
the *sum* of the per-sample losses (``loss * samples`` for a mean-reducing loss) and counts
the samples. An update divides the accumulated gradient by the total number of samples that
contributed to it, summed over the stage's replicas in the same all-reduce as the gradients.
So the applied gradient is the mean over all samples of the update whatever the number of
microbatches, stages or replicas, and stays exact for a smaller last microbatch. With
``loss_reduction="sum"`` the gradient of the summed loss is applied unchanged.
"""

from __future__ import annotations

import datetime
import logging
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["WeightVersions", "OptimizerFactory"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class WeightVersions:
    """Versions, gradients and optimizer of one stage replica.

    Args:
        module: the stage module (its trainable parameters are the stage's weights).
        optimizer: factory ``params -> torch.optim.Optimizer``.
        uses: version -> number of F and B actions in the coming schedule that use it.
        loss_reduction: "mean" (divide by the samples of the update) or "sum".
    """

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory, loss_reduction: str = "mean") -> None:
        self.module = module
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = optimizer(self.params) if self.params else None
        self.loss_reduction = loss_reduction
        self.version = 0
        self._uses: dict[int, int] = {}
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._grads: list[torch.Tensor | None] = [None] * len(self.params)
        self._samples = 0.0
        self.copies = 0  # number of copy-on-update events (for tests and reports)
        self.max_versions_alive = 1

    # ------------------------------------------------------------------ versions
    def expect(self, uses: dict[int, int]) -> None:
        """Declare how many F/B actions of the coming schedule use each (absolute) version."""
        self._uses = dict(uses)

    def tensors(self, version: int) -> dict[str, torch.Tensor]:
        """The parameter tensors of ``version`` (leaf aliases with ``requires_grad``)."""
        views = self._views.get(version)
        if views is None:
            if version != self.version:
                raise RuntimeError(
                    f"weight version {version} was requested but this stage holds version {self.version} "
                    f"and stashes {sorted(self._views)}; the schedule's versions are inconsistent"
                )
            views = {n: p.data.requires_grad_(True) for n, p in zip(self.names, self.params)}
            self._views[version] = views
        return views

    def release(self, version: int) -> None:
        """One F/B that used ``version`` has finished; drop a stash nobody needs any more."""
        left = self._uses.get(version, 0) - 1
        self._uses[version] = left
        if left <= 0 and version != self.version:
            self._views.pop(version, None)

    # ------------------------------------------------------------------ gradients
    def accumulate(self, grads: Iterable[torch.Tensor | None], samples: int) -> None:
        """Add one microbatch's parameter gradients (of the summed or user-reduced loss)."""
        for i, g in enumerate(grads):
            if g is None:
                continue
            if self._grads[i] is None:
                self._grads[i] = g.detach()  # autograd.grad returns fresh tensors: no copy
            else:
                self._grads[i].add_(g)
        self._samples += samples

    def allreduce(self, group: dist.ProcessGroup | None, timeout_s: float) -> int:
        """Sum gradients and sample counts over the stage's replicas; returns bytes reduced."""
        if group is None:
            return 0
        flat_parts = []
        for g, p in zip(self._grads, self.params):
            flat_parts.append((g if g is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64 if p.dtype == torch.float64 else torch.float32))
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        flat = torch.cat([t.to(dtype) for t in flat_parts] + [torch.tensor([self._samples], dtype=dtype, device=self._device())])
        work = dist.all_reduce(flat, group=group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise RuntimeError(f"gradient all-reduce did not complete within {timeout_s:g} s: {str(exc)[:200]}") from None
        pos = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            self._grads[i] = flat[pos: pos + n].view_as(p).to(p.dtype)
            pos += n
        self._samples = float(flat[-1].item())
        return flat.numel() * flat.element_size()

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def step(self) -> bool:
        """Apply the accumulated gradient to the latest weights; returns whether it copied."""
        copied = False
        if self.params and self.optimizer is not None:
            still_needed = self._uses.get(self.version, 0) > 0
            if still_needed:
                # Copy on update: the stash keeps the old storage, the parameters move.
                self.tensors(self.version)
                for p in self.params:
                    p.data = p.data.clone()
                self.copies += 1
                copied = True
            else:
                self._views.pop(self.version, None)
            scale = 1.0
            if self.loss_reduction == "mean":
                if self._samples <= 0:
                    raise RuntimeError("optimizer step with no samples behind it (no backward before U)")
                scale = 1.0 / self._samples
            for p, g in zip(self.params, self._grads):
                if g is not None and scale != 1.0:
                    g.mul_(scale)  # our own buffer (or the all-reduce's): scale in place
                p.grad = g
            self.optimizer.step()
            for p in self.params:
                p.grad = None
        self._grads = [None] * len(self.params)
        self._samples = 0.0
        self.version += 1
        self.max_versions_alive = max(self.max_versions_alive, len(self._views) + 1)
        return copied

    def reset_versions(self) -> None:
        """Forget stashes (between schedules: everything in flight has finished)."""
        self._views.clear()
        self._uses = {}
