"""Weight versions of one stage: the live weights, stashes of older versions still in use,
gradient accumulation, the replicas' all-reduce and the optimizer step.

How a version is used. Every forward ``F`` and backward ``B`` names the version ``v`` it
computes with. The engine runs the stage with *aliases* of the parameters swapped into the
parameter slots for the call (``torch.func.functional_call`` for RNNs) (``p.data`` views made leaves with ``requires_grad``; they share storage with the
parameter but have their own autograd version counter). The autograd graph of ``F`` holds
those aliases, so ``B`` differentiates with exactly the weights ``F`` used: weight stashing
without a copy at ``F`` time.

Copy on update, only where needed (``schedule.versions.copies_on_update``, the rule the
simulator charges too). The schedule is known in advance, so for every version we count the
``F``/``B`` actions that will still use it. At an optimizer step, if the
current version is still needed (an in-flight minibatch has run ``F`` but not ``B``, or a
later ``F`` is scheduled with it, as in vertical sync or 2BW), every parameter is moved to a
copy *before* the optimizer updates it in place (into the storage of a stash dropped earlier
when there is one, else ``p.data.clone()``); the old storage then belongs to the stash alone. When no one needs it (flush, gpipe, the last stage
of a pipedream pipeline), the step is in place and nothing is copied. Stashes are dropped
when their last use has run, so a pipedream stage holds at most one version per in-flight
minibatch and 2BW at most two.

Gradient buffers (``schedule.versions.keeps_gradient_buffers``, which also tells the simulator
which backwards accumulate). On a replicated stage every parameter has one persistent gradient
buffer (views into a single flat tensor with a slot for the sample count), set as the ``.grad`` of
every alias, so each backward accumulates in place and the replicas' all-reduce runs on the
flat tensor without a copy (a parameter without gradient is then stepped with a zero one).
On a stage without replicas the aliases start with no ``.grad``: the first backward of an
update hands over its gradient tensors (no add, no zeroing; on a CPU an update's cost is its
passes over the weights), later ones add to them, and a stash dropped before the step passes
its gradients on first. There a parameter without gradient is skipped by the optimizer, as
in plain PyTorch.

Optimizer. Any ``torch.optim`` optimizer works: it is built by the user's factory on this
stage's own parameters (each rank owns only its stage), given as ``(name, parameter)`` pairs
under the original model's names (so that groups by name, such as no weight decay on biases,
work as in one process), keeps its state keyed by the parameter objects, and steps them with
the accumulated gradient: the gradient computed with the stashed weights is applied to the
latest weights with the optimizer's state. A learning-rate scheduler (``lr_schedule.py``)
steps right after every update.

Clipping by the global norm (``clipping.py``). :meth:`squared_norm` is the squared norm of the
gradient the coming update applies (after the replicas' all-reduce and the division by the
samples); the clipper sums it over every stage and hands the update a factor, which multiplies
the gradient with the division, in the same pass.

Loss scaling by construction. The engine back-propagates, per microbatch, the gradient of
the *sum* of the per-sample losses (``loss * samples`` for a mean-reducing loss) and counts
the samples. An update divides the accumulated gradient by the total number of samples that
contributed to it, summed over the stage's replicas in the same all-reduce as the gradients.
So the applied gradient is the mean over all samples of the update whatever the number of
microbatches, stages or replicas, and stays exact for a smaller last microbatch. With
``loss_reduction="sum"`` the gradient of the summed loss is applied unchanged.

Where every update applies exactly one whole minibatch (:func:`updates_are_minibatch_means`:
one microbatch per minibatch, no replicated stage, one backward per update on every rank, a
mean-reducing loss) the engine back-propagates the mean loss itself and the update skips the
division (``grads_are_means``): the same gradient without a pass over the stage's gradients,
which on a CPU costs as much as a tenth of the step (a 75 MB stage of the FC-heavy model: 15
of 55 ms).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..schedule.actions import Kind, Schedule
from ..schedule.versions import copies_on_update, keeps_gradient_buffers
from .loss_scaling import has_nonfinite
from .lr_schedule import SchedulerFactory, build_scheduler, fast_forward, step_quietly

__all__ = ["WeightVersions", "OptimizerFactory", "updates_are_minibatch_means", "wait_for", "local_tensor"]

log = logging.getLogger(__name__)

#: ``Pipeline(optimizer=)``: called with the stage's ``(name, parameter)`` pairs (the model's names).
OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


def wait_for(work: Any, timeout_s: float, what: str) -> None:
    """Wait for an asynchronous collective; a missed deadline raises naming ``what``."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise RuntimeError(f"{what} did not complete within {timeout_s:g} s: {str(exc).splitlines()[0][:200]}") from None


def updates_are_minibatch_means(schedule: Schedule, replicated: bool, loss_reduction: str) -> bool:
    """Whether the backward may start from each minibatch's mean loss so that updates apply
    gradients as they are (no division by the update's samples): a mean-reducing loss, one
    microbatch per minibatch, no replicated stage (an all-reduce sums several minibatches)
    and exactly one backward between consecutive updates on every rank. The answer depends on
    the schedule alone, so every rank reaches the same one (the gradients that travel between
    stages must be in one form)."""
    if loss_reduction != "mean" or replicated or schedule.microbatches != 1:
        return False
    for actions in schedule.actions.values():
        backwards = 0
        for a in actions:
            if a.kind is Kind.BACKWARD:
                backwards += 1
            elif a.kind is Kind.OPTIMIZER_STEP:
                if backwards != 1:
                    return False
                backwards = 0
    return True


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded or tensor-parallel tensor (a DTensor's local part; under
    ``torch.no_grad`` its own storage, so writing it writes the DTensor); ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class WeightVersions:
    """Versions, gradients and optimizer of one stage replica.

    Args:
        module: the stage module (its trainable parameters are the stage's weights).
        optimizer: factory ``params -> torch.optim.Optimizer``.
        uses: version -> number of F and B actions in the coming schedule that use it.
        loss_reduction: "mean" (divide by the samples of the update) or "sum".
        normalized: with "sum", divide by the update's samples all the same: they are then the
            counts of ``Pipeline(loss_normalizer=)`` (tokens, say), not rows.
        model_names: this module's parameter name -> the model's (given to the optimizer factory).
        scheduler: factory of the learning-rate scheduler stepped after every update.
        where: who this is, for error messages.
    """

    #: FSDP2 shards the weights and reduces their gradients (sharding.py's subclass): the engine
    #: then runs the stage module as it is and back-propagates into whatever it holds.
    sharded = False
    #: FSDP2 holds the weights themselves (no tensor of them to name: a split backward's W has
    #: nothing to differentiate); a tensor-parallel stage is ``sharded`` without it.
    fsdp = False

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory, loss_reduction: str = "mean",
                 replicated: bool = False, only: set[str] | None = None, exclude: set[str] = frozenset(),
                 normalized: bool = False, model_names: dict[str, str] | None = None,
                 scheduler: SchedulerFactory | None = None, where: str = "this stage") -> None:
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in exclude
                 and (only is None or n in only)]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        model_names = model_names or {}
        self.optimizer = optimizer([(model_names.get(n, n), p) for n, p in named]) if self.params else None
        self._scheduler_factory, self._where = scheduler, where
        self.scheduler = build_scheduler(scheduler, self.optimizer, where) \
            if scheduler is not None and self.optimizer is not None else None
        self.loss_reduction = loss_reduction
        # The update divides the gradient by its samples (a mean-reducing loss, or a normalizer's count).
        self.divides = loss_reduction == "mean" or normalized
        # True while a schedule runs whose backwards start from minibatch means (see the
        # module docstring): the update then applies the gradient without rescaling it.
        self.grads_are_means = False
        self.version = 0
        self._uses: dict[int, int] = {}
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        # Replicated stages: persistent flat buffers for the all-reduce. Otherwise the first
        # backward of an update hands its gradient tensors over (autograd "steals" them: no
        # add, no zeroing) and they are dropped after the step.
        self._flat, self._grads = self._grad_buffers() if keeps_gradient_buffers(replicated) else (None, None)
        self._pending: list[torch.Tensor | None] = [None] * len(self.params)
        self._samples = 0.0
        self._spare: list[list[torch.Tensor]] = []
        self.copies = 0  # number of copy-on-update events (for tests and reports)
        self.max_versions_alive = 1
        self._posted: list[tuple[Any, torch.Tensor, int, int]] = []  # all-reduces posted (work, sum, holders, update)
        # Updates set aside until their weights are needed (defer): gradients, samples, the
        # factor (clipping's, waited for then), unscale, apply.
        self._deferred: list[tuple[list[torch.Tensor | None], float, Callable[[], float], float, bool]] = []

    def tensors_held(self) -> list[object]:
        """Every tensor this holder keeps between actions: gradient buffers and pending
        gradients, stashed versions, spare storage and the optimizer's state."""
        state = list(self.optimizer.state.values()) if self.optimizer is not None else []
        deferred = [d[0] for d in self._deferred]
        return [self._flat, self._grads, self._pending, self._spare, list(self._views.values()), state, deferred]

    # ------------------------------------------------------------------ versions
    def expect(self, uses: dict[int, int]) -> None:
        """Declare how many F/B actions of the coming schedule use each (absolute) version."""
        self._uses = dict(uses)

    def tensors(self, version: int) -> dict[str, torch.Tensor]:
        """The parameter tensors of ``version`` (leaf aliases with ``requires_grad``); applies the
        deferred updates that make it first."""
        if self._deferred and version > self.version:
            self.apply_deferred(upto=version)
        if not self.params:
            # A stage without trainable weights (say ReLU, pooling, flatten) has one, empty,
            # set of weights for every version. Its steps keep no stash, so an older version
            # named by vertical sync or 2BW would otherwise look like a missing stash.
            return {}
        views = self._views.get(version)
        if views is None:
            if version != self.version:
                raise RuntimeError(
                    f"weight version {version} was requested but this stage holds version {self.version} "
                    f"and stashes {sorted(self._views)}; the schedule's versions are inconsistent"
                )
            views = {}
            grads = self._grads if self._grads is not None else [None] * len(self.params)
            for n, p, g in zip(self.names, self.params, grads):
                alias = p.data.requires_grad_(True)
                alias.grad = g  # None, or the persistent buffer the backward accumulates into
                views[n] = alias
            self._views[version] = views
        return views

    def release(self, version: int) -> None:
        """One F/B that used ``version`` has finished; drop a stash nobody needs any more."""
        left = self._uses.get(version, 0) - 1
        self._uses[version] = left
        if left <= 0 and version != self.version:
            self._recycle(self._views.pop(version, None))

    def _take_grads(self, views: dict[str, torch.Tensor] | None) -> None:
        """Move gradients held by a version's aliases into the pending sum (steal mode)."""
        if views is None or self._grads is not None:
            return
        for i, alias in enumerate(views.values()):
            g = alias.grad
            if g is not None:
                alias.grad = None
                self._pending[i] = g if self._pending[i] is None else self._pending[i].add_(g)

    def _gather_grads(self) -> None:
        """Move every live version's alias gradients into the pending sum (steal mode; with
        persistent buffers they are already there)."""
        for views in self._views.values():
            self._take_grads(views)

    def _recycle(self, views: dict[str, torch.Tensor] | None) -> None:
        """Keep a dropped stash's storage for the next copy on update (allocating megabytes
        costs page faults every time; copying into recycled memory does not)."""
        self._take_grads(views)
        if views is not None and len(self._spare) < 2:
            self._spare.append([v.detach() for v in views.values()])

    # ------------------------------------------------------------------ gradients
    def _grad_buffers(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Persistent gradient buffers, allocated once: views into one flat tensor (plus one
        slot for the sample count) when all parameters share a dtype, so the replicas'
        all-reduce needs no copy and no update allocates (or frees) gradient memory."""
        if not self.params:
            return None, []
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            return None, [torch.zeros_like(p) for p in self.params]
        total = sum(p.numel() for p in self.params)
        flat = torch.zeros(total + 1, dtype=dtypes.pop(), device=self.params[0].device)
        return flat, self._views_of(flat)

    def add_samples(self, samples: int) -> None:
        """Count the samples of one microbatch whose backward accumulated into the buffers."""
        self._samples += samples

    def accumulate(self, grads: Iterable[torch.Tensor | None], samples: int) -> None:
        """Add one microbatch's parameter gradients by hand (the engine's backward instead
        accumulates into the aliases' ``.grad``, which are these same buffers)."""
        with torch.no_grad():
            for i, g in enumerate(grads):
                if g is None:
                    continue
                if self._grads is not None:
                    self._grads[i].add_(g)
                else:
                    self._pending[i] = g.clone() if self._pending[i] is None else self._pending[i].add_(g)
        self._samples += samples

    def allreduce(self, group: dist.ProcessGroup | None, timeout_s: float) -> int:
        """Sum gradients and sample counts over the stage's replicas; returns bytes reduced."""
        if group is None:
            return 0
        if self._grads is None:
            raise RuntimeError("all-reduce on a stage built without replicated=True")
        if self._flat is not None:
            tensors = [self._flat]
            self._flat[-1] = self._samples
        else:  # mixed dtypes: one all-reduce per buffer, plus the count
            count = torch.tensor([self._samples], dtype=torch.float64, device=self._device())
            tensors = list(self._grads) + [count]
        for t in tensors:
            wait_for(dist.all_reduce(t, group=group, async_op=True), timeout_s, "gradient all-reduce")
        self._samples = float(tensors[-1][-1].item())
        return sum(t.numel() * t.element_size() for t in tensors)

    def post_allreduce(self, group: dist.ProcessGroup, holders: int, update: int = 0) -> int:
        """Start summing this update's gradient (and sample count) over ``group`` without waiting:
        a shared parameter's copies on ``holders`` stages (each counts the update's samples, so
        the sum of counts is divided by ``holders`` when it lands). The gradient moves to a
        buffer of its own, so later backwards accumulate the next update meanwhile. Returns the
        bytes it moves."""
        if self._flat is None:
            raise RuntimeError("a shared parameter's weights need one flat gradient buffer (replicated=True)")
        self._flat[-1] = self._samples
        posted = self._flat.clone()
        self._flat.zero_()
        self._samples = 0.0
        work = dist.all_reduce(posted, group=group, async_op=True)
        self._posted.append((work, posted, holders, update))
        return posted.numel() * posted.element_size()

    def step_posted(self, timeout_s: float, unscale: float = 1.0, apply: bool = True) -> bool:
        """Wait for the oldest posted all-reduce and apply its sum as one update (the step every
        copy of a shared parameter takes); returns whether it copied a stashed version.
        ``unscale`` and ``apply`` as in :meth:`step`."""
        posted = self._oldest_posted(timeout_s)
        _, _, holders, _ = self._posted.pop(0)
        return self._apply(self._views_of(posted), float(posted[-1].item()) / holders, unscale, apply)

    def _oldest_posted(self, timeout_s: float, update: int | None = None) -> torch.Tensor:
        """The oldest posted all-reduce's sum (or that of ``update``), waited for (waiting again
        is a no-op)."""
        entries = [e for e in self._posted if update is None or e[3] == update]
        if not entries:
            raise RuntimeError("a shared parameter's step (TR) without its posted gradient (TP) before it")
        work, posted, _, _ = entries[0]
        wait_for(work, timeout_s, "shared parameter all-reduce")
        return posted

    def posted_gradient_overflowed(self, timeout_s: float) -> bool:
        """Whether the oldest posted sum (a shared parameter's gradient, waited for) holds an
        inf or NaN."""
        return has_nonfinite([self._oldest_posted(timeout_s)])

    def gradient_overflowed(self) -> bool:
        """Whether the accumulated gradient of the coming update holds an inf or NaN (a float16
        backward overflowed)."""
        if self._flat is not None:
            return has_nonfinite([self._flat])
        self._gather_grads()
        return has_nonfinite(self._grads if self._grads is not None else self._pending)

    def _scale(self, samples: float, unscale: float) -> float:
        """What multiplies the accumulated gradient at an update: ``unscale`` (float16's 1 / loss
        scale), divided by the update's samples where the update applies a mean."""
        scale = unscale
        if self.divides:
            if samples <= 0:
                raise RuntimeError("optimizer step with no samples behind it (no backward before U)")
            if not self.grads_are_means:
                scale /= samples
        return scale

    def squared_norm(self, unscale: float = 1.0, timeout_s: float = 0.0, posted: int | None = None) -> torch.Tensor:
        """The squared L2 norm (float64) of the gradient the coming update applies: this
        stage's accumulated one, or the posted sum of a shared parameter's copies for update
        ``posted`` (waited for)."""
        if posted is not None:
            flat = self._oldest_posted(timeout_s, posted)
            grads: list[torch.Tensor | None] = [flat[:-1]]
            samples = float(flat[-1].item()) / self._posted[0][2]  # every entry has the same holders
        else:
            self._gather_grads()
            grads, samples = (self._grads if self._grads is not None else self._pending), self._samples
        present = [g for g in grads if g is not None]
        if not present:
            return torch.zeros((), dtype=torch.float64)
        # each tensor's norm in its own dtype, as clip_grad_norm_ takes it (in float64 a pass cost
        # 15x: 6.8 against 0.46 ms for 3.1M gradients on one CPU thread), summed in float64
        total = torch.stack(torch._foreach_norm(present)).double().square().sum()
        return total.cpu() * self._scale(samples, unscale) ** 2

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, pos = [], 0
        for p in self.params:
            out.append(flat[pos: pos + p.numel()].view_as(p))
            pos += p.numel()
        return out

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def step(self, unscale: float = 1.0, apply: bool = True) -> bool:
        """Apply the accumulated gradient to the latest weights; returns whether it copied.

        ``unscale`` multiplies the gradient first (1 / the loss scale of float16 training);
        ``apply=False`` skips the optimizer (an overflowed update: the gradient is dropped,
        the weights stay, the version still advances so the schedule's versions hold)."""
        if self.params and self.optimizer is not None:
            self._gather_grads()
        grads = self._grads if self._grads is not None else self._pending
        copied = self._apply(grads, self._samples, unscale, apply)
        if self.params and self.optimizer is not None:
            with torch.no_grad():
                if self._flat is not None:
                    self._flat.zero_()
                elif self._grads is not None:
                    for g in self._grads:
                        g.zero_()
            self._pending = [None] * len(self.params)
        self._samples = 0.0
        return copied

    @property
    def can_defer(self) -> bool:
        """Whether an update can be set aside without a copy: its gradient tensors were handed
        over by autograd (a stage without replicas), not accumulated in persistent buffers."""
        return self._grads is None

    @property
    def next_version(self) -> int:
        """The version the updates so far produce, deferred ones included."""
        return self.version + len(self._deferred)

    def defer(self, factor: Callable[[], float], unscale: float = 1.0, apply: bool = True) -> None:
        """Set this update's gradient aside and apply it when its weights are first needed
        (:meth:`tensors` asks for a newer version, or :meth:`apply_deferred`); ``factor()``
        (clipping's: it may wait for a collective) then multiplies it, with ``unscale``."""
        if not self.can_defer:
            raise RuntimeError("an update of persistent gradient buffers (a replicated stage) cannot be deferred")
        if self.params and self.optimizer is not None:
            self._gather_grads()
        self._deferred.append((self._pending, self._samples, factor, unscale, apply))
        self._pending = [None] * len(self.params)
        self._samples = 0.0

    def apply_deferred(self, upto: int | None = None) -> None:
        """Apply the deferred updates in order: all, or until the version reaches ``upto``."""
        while self._deferred and (upto is None or self.version < upto):
            grads, samples, factor, unscale, apply = self._deferred.pop(0)
            self._apply(grads, samples, unscale * factor(), apply)

    def _apply(self, grads: list[torch.Tensor | None], samples: float, unscale: float = 1.0,
               apply: bool = True) -> bool:
        """One optimizer step with ``grads``, the sum over ``samples`` samples (copying the
        current version first when a stash still needs it); the version counter advances."""
        copied = False
        if self.params and self.optimizer is not None:
            if copies_on_update(self._uses.get(self.version, 0)):
                # Copy on update: the stash keeps the old storage, the parameters move.
                self.tensors(self.version)
                spare = self._spare.pop() if self._spare else None
                with torch.no_grad():
                    current = [p.data for p in self.params]
                    if spare is not None:
                        torch._foreach_copy_(spare, current)  # one call, not one per parameter
                    else:
                        spare = [t.clone() for t in current]
                    for p, t in zip(self.params, spare):
                        p.data = t
                self.copies += 1
                copied = True
            else:
                self._views.pop(self.version, None)
            scale = self._scale(samples, unscale)
            present = [g for g in grads if g is not None]
            if apply:
                with torch.no_grad():
                    if present and scale != 1.0:  # the local parts: DTensor and whole gradients may mix
                        torch._foreach_mul_([local_tensor(g) for g in present], scale)
                for p, g in zip(self.params, grads):
                    p.grad = g
                self.optimizer.step()
                for p in self.params:
                    p.grad = None
            if self.scheduler is not None:  # stepped by every update, skipped or not: lr(t) everywhere
                step_quietly(self.scheduler)
        self.version += 1
        self.max_versions_alive = max(self.max_versions_alive, len(self._views) + 1)
        return copied

    def boundary_state(self) -> dict[str, object]:
        """The state a checkpoint needs at a schedule boundary: version counter and optimizer.

        Between schedules nothing is in flight (every F has had its B and U), so no stashed
        version is still needed and no gradient is pending; asserted here, because a
        checkpoint taken mid-schedule would silently drop the stashes.
        """
        live = [v for v in self._views if v != self.version]
        if live or self._samples or self._posted or self._deferred or any(g is not None for g in self._pending):
            raise RuntimeError(
                f"checkpoint requested mid-schedule (stashed versions {live}, {self._samples:g} samples of "
                "unapplied gradient): save only after train_step/fit returned"
            )
        return {"version": self.version,
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def restore_boundary_state(self, state: dict[str, object]) -> None:
        """Inverse of :meth:`boundary_state` (the weights themselves are loaded into the module)."""
        self.reset_versions()
        self.version = int(state["version"])  # type: ignore[call-overload]
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
            self.resume_schedule()

    def resume_schedule(self) -> None:
        """After the optimizer's state was restored at version ``self.version``: rebuild the
        learning-rate scheduler as it was built at the start and step it once per update so far
        (lr_schedule.py: exact under any plan)."""
        if self._scheduler_factory is None or self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            if "initial_lr" in group:
                group["lr"] = group["initial_lr"]
        self.scheduler = build_scheduler(self._scheduler_factory, self.optimizer, self._where)
        fast_forward(self.scheduler, self.version)

    def reset_versions(self) -> None:
        """Forget stashes (between schedules: everything in flight has finished)."""
        for version in [v for v in self._views if v != self.version]:
            self._recycle(self._views.pop(version))
        self._views.clear()
        self._uses = {}
