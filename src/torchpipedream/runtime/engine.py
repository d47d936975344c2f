"""The per-rank interpreter: runs this rank's action list from a Schedule, in order
(``run_actions``), each action by the ``Engine`` of its stage: one per stage the rank holds.

The engine has no schedule logic of its own. What it reads from the schedule beyond its own
list are static facts computed once before the run: the order of its receives per peer (so
receives can be posted early) and how many F/B actions use each weight version (so stashes
are kept exactly as long as needed). Everything else, including which weight version each
F and B uses, comes from the actions.

Per microbatch it keeps: the stage's inputs (data or received activations), the autograd
graph of its forward (outputs and the leaves it needs gradients for), the received output
gradients and the computed input gradients, each dropped as soon as the action that
consumes it has run.

A recomputing stage (``Stage.recompute``) runs its training forwards under
``torch.utils.checkpoint`` (non-reentrant): the graph keeps the stage's inputs only, and the
backward runs the forward again, with the same weight version (the stash lives until B, as
without recomputation) and the same random numbers (reseeded as the first run was), before
differentiating it. Buffers the
forward updates (BatchNorm's running statistics) are restored after every second run of a
forward, so they move once per microbatch, as without recomputation.

A split backward (a microbatch with a W action on this rank: zero-bubble kinds) runs in two
parts (model/split_backward.py): B computes only the gradients of the stage's inputs, which
SG sends at once, and keeps the graph; W computes the weights' gradients from where B left
them, releases the weight version and frees the graph.

Each executed action becomes an :class:`~torchpipedream.sim.trace.Event` with wall-clock times
relative to a common start (ranks start after a barrier).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.func import functional_call
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from ..schedule.actions import Action, Kind, message_key, split_backwards
from ..sim.trace import Event
from . import liveness
from .action_clock import ActionClock
from .buffers import ReplicaBuffers
from .clipping import GradientClipper
from .comm import P2P
from .flight_recorder import FlightRecorder
from .loss_scaling import LossScaler
from ..model.split_backward import WeightGradients, backward_inputs
from .sharding import free_gathered, gather_weights, reduce_in_backward
from .weights import WeightVersions

__all__ = ["Engine", "EngineConfig", "MicrobatchResult", "as_tuple", "run_actions"]

log = logging.getLogger(__name__)


#: ``get(i) -> (inputs, targets, samples)`` of microbatch ``i``: the first stage's data.
MicrobatchSource = Callable[[int], tuple[tuple[Any, ...], tuple[Any, ...], int]]


def as_tuple(x: Any) -> tuple[Any, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _correct_predictions(output: Any, targets: tuple[Any, ...]) -> int | None:
    """How many class labels the model's output (as the user sees it: a tensor of scores, or a
    ModelOutput or dict with ``logits``) predicts right; None where it has no such scores."""
    scores = output
    if not isinstance(scores, torch.Tensor):
        scores = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if len(targets) != 1 or not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        return None
    y = targets[0]
    if isinstance(y, torch.Tensor) and not y.is_floating_point() and y.dim() == 1 and len(y) == len(scores):
        return int((scores.detach().argmax(dim=1) == y).sum().item())
    return None


def _grad_leaves(values: Any) -> list[torch.Tensor]:
    """The tensors among ``values`` (nested in tuples, lists, dicts too) that require grad, in
    pytree leaf order: the order gradients cross a cut in (``comm.flatten_message``)."""
    return [t for t in pytree.tree_leaves(list(values)) if isinstance(t, torch.Tensor) and t.requires_grad]


def _zero_of(out: Any) -> torch.Tensor | None:
    """A zero that depends on every differentiable tensor of ``out`` (an empty microbatch's loss
    on a sharded stage, whose backward must run like its replicas')."""
    tensors = _grad_leaves(as_tuple(out))
    return sum((t.sum() * 0 for t in tensors), torch.zeros(())) if tensors else None


def _fresh_leaf(t: Any) -> Any:
    """A tensor handed to the next stage in memory as the wire would: a copy, a new leaf."""
    return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t


def _parameter_slots(module: nn.Module, names: set[str]) -> list[tuple[nn.Module, str, str]] | None:
    """(owning module, attribute, parameter name) of every trainable parameter slot, tied
    slots included; None when a module caches its parameters elsewhere (RNNs keep
    ``_flat_weights``), where only ``functional_call`` swaps them correctly."""
    if any(isinstance(m, nn.RNNBase) for m in module.modules()):
        return None
    first_name: dict[int, str] = {}
    for name, p in module.named_parameters():
        first_name.setdefault(id(p), name)
    slots = []
    for mod in module.modules():  # each module object once, even if registered twice
        for attr, p in mod._parameters.items():
            name = first_name.get(id(p)) if p is not None else None
            if name in names:
                slots.append((mod, attr, name))
    return slots


@dataclass
class MicrobatchResult:
    """What the last stage learned about one microbatch."""

    samples: int
    loss: float  # as returned by loss_fn (mean or sum over the microbatch's samples)
    correct: int | None = None  # class-label accuracy count, when applicable


@dataclass
class TiedCopy:
    """This stage's copy of a shared parameter (``plan.tied[k]``): its own weight versions and
    the process group of every rank holding a copy (``holders`` stages)."""

    weights: WeightVersions
    group: Any
    holders: int


@dataclass
class _Context:
    version: int
    inputs: tuple[Any, ...]
    leaves: list[torch.Tensor]  # received activations that need a gradient
    outputs: list[torch.Tensor] = field(default_factory=list)  # outputs to differentiate
    loss: torch.Tensor | None = None
    targets: tuple[Any, ...] = ()
    samples: int = 0
    tied_versions: dict[int, int] = field(default_factory=dict)  # shared parameter k -> version F used


@dataclass(frozen=True)
class EngineConfig:
    """How an :class:`Engine` runs its stage, fixed at its construction.

    Args:
        timeout_s: deadline for collectives.
        loss_reduction: "mean" or "sum" (what ``loss_fn`` returns).
        device: the stage's device.
        draws_random: the stage draws random numbers in training (dropout): each forward then
            draws from a generator seeded by (``rng_seed``, stage, microbatch number since the
            start), so replicas draw different masks, a recomputed forward the same, and a run
            with the same seed the same (see ``Engine._seeded``).
        recompute: activation recomputation (``Stage.recompute``).
        compute_dtype: bf16/fp16: forwards run under autocast in it (``Pipeline(precision=)``);
            None: float32, no autocast.
        rng_seed: the seed of the stage's random numbers in training.
    """

    timeout_s: float = 300.0
    loss_reduction: str = "mean"
    device: torch.device | str = "cpu"
    draws_random: bool = False
    recompute: bool = False
    compute_dtype: torch.dtype | None = None
    rng_seed: int = 0


class Engine:
    """Executes one stage's actions of a rank's list (``run_actions`` drives the engines of a
    rank's stages through the list: one, or several with virtual stages).

    Args:
        rank / stage / replica: who this is.
        module: the stage module (see stage_split).
        is_first / is_last: stage position (the first reads data, the last computes the loss).
        weights: the stage's WeightVersions.
        loss_fn: ``loss_fn(output, *targets) -> scalar tensor``.
        ar_group: the replicas' process group (None when the stage is not replicated).
        tied: the stage's copies of shared parameters, by index into ``plan.tied`` (their
            weights are not in ``weights``).
        buffers: a replicated stage's buffers, combined with its replicas' at every ``AR``.
        scaler: float16's loss scale (``loss_scaling.py``; None without one).
        config: the engine's settings (:class:`EngineConfig`).
        finish: the last stage's output -> the model's output as the user sees it (for accuracy).
        clipper: the rank's clipping by the global gradient norm (``clipping.py``; None without).
    """

    def __init__(
        self,
        rank: int,
        stage: int,
        replica: int,
        module: nn.Module,
        is_first: bool,
        is_last: bool,
        weights: WeightVersions,
        loss_fn: Callable[..., torch.Tensor],
        ar_group: Any = None,
        tied: dict[int, TiedCopy] | None = None,
        buffers: ReplicaBuffers | None = None,
        scaler: LossScaler | None = None,
        config: EngineConfig | None = None,
        clipper: GradientClipper | None = None,
        finish: Callable[[Any], Any] | None = None,
    ) -> None:
        config = config or EngineConfig()
        self.config = config
        self.rank, self.stage, self.replica = rank, stage, replica
        self.module = module
        self.is_first, self.is_last = is_first, is_last
        self.weights = weights
        self.loss_fn = loss_fn
        self.ar_group = ar_group
        self.device = torch.device(config.device)
        self.tied = dict(tied or {})
        self.buffers = buffers
        # a sharded stage's weights are installed by FSDP2 itself (sharding.py): no slot to swap
        # (its shared parameters stay plain tensors outside FSDP2 and the tensor layout: their
        # copies' versions are swapped into their slots as on any stage)
        names = (set() if weights.sharded else set(weights.names)).union(*(set(c.weights.names) for c in self.tied.values()))
        self._slots = _parameter_slots(module, names)
        self.eval_graph = False  # True while ``module`` is a graph traced for evaluation (its own weights)
        self.scaler = scaler
        self.clipper = clipper
        self.finish = finish or (lambda out: out)
        self.microbatch_base = 0  # microbatches trained before the running schedule

    # The settings the actions read: views of the config, which is fixed at construction.
    timeout_s = property(lambda self: self.config.timeout_s)
    loss_reduction = property(lambda self: self.config.loss_reduction)
    draws_random = property(lambda self: self.config.draws_random)
    recompute = property(lambda self: self.config.recompute)
    compute_dtype = property(lambda self: self.config.compute_dtype)
    rng_seed = property(lambda self: self.config.rng_seed)

    # ------------------------------------------------------------------ run (run_actions drives these)

    def begin(self, actions: list[Action], train: bool, rank_engines: list["Engine"] | None = None,
              decisions: dict[int, tuple[float, bool]] | None = None) -> None:
        """Start a schedule: ``actions`` are this stage's (its part of the rank's list).
        ``rank_engines`` (every stage the rank holds) share ``decisions``: one loss-scale
        decision per update for the rank, over all their gradients."""
        self._ctx: dict[int, _Context] = {}
        self._received: dict[int, tuple[int, tuple[Any, ...], tuple[Any, ...]]] = {}
        self._to_send: dict[int, tuple[int, list[torch.Tensor], list[Any]]] = {}
        self._out_grads: dict[int, list[torch.Tensor]] = {}
        self._in_grads: dict[int, list[torch.Tensor]] = {}
        self._updates = {} if decisions is None else decisions  # update -> (1 / its loss scale, apply it?)
        self._rank_engines = rank_engines or [self]
        self._split = split_backwards(actions) if train else set()
        self._weight_work: dict[int, tuple[WeightGradients | None, _Context, int | None]] = {}  # B done, W to run
        # a "zero1" stage (sharding.py): the B that each RD follows reduce-scatters the gradient
        self._reducing = {b.id for b, a in zip(actions, actions[1:]) if a.kind is Kind.REDUCE_GRAD}
        self._shard_bytes = 0  # what this replica's gather received (its RD sends as much)

    def execute(self, action: Action, comm: P2P | None, get_microbatch: Any, train: bool, version_base: int,
                results: dict[int, MicrobatchResult]) -> tuple[int, int | None]:
        """Run one action of this stage; returns (bytes moved, the weight version it used or made)."""
        nbytes = 0
        version = None if action.version is None else action.version + version_base
        kind = action.kind
        if kind == Kind.FORWARD:
            if not train:
                version = self.weights.version  # evaluation: always the current weights
            self._forward(action.id, version, comm, get_microbatch, train, results)
        elif kind == Kind.BACKWARD:
            self._backward(action.id, version)
        elif kind == Kind.WEIGHT_GRAD:
            self._weight_grad(action.id)
        elif kind == Kind.SEND_ACT:
            samples, tensors, passengers = self._to_send.pop(action.id)
            nbytes = comm.send_acts(action.peer, message_key(action), samples, tensors, passengers)
        elif kind == Kind.RECV_ACT:
            samples, acts, passengers, nbytes = comm.recv_acts(action.peer, message_key(action))
            self._received[action.id] = (samples, tuple(acts), tuple(passengers))
        elif kind == Kind.SEND_GRAD:
            nbytes = comm.send_grads(action.peer, message_key(action), self._in_grads.pop(action.id))
        elif kind == Kind.RECV_GRAD:
            grads, nbytes = comm.recv_grads(action.peer, message_key(action))
            self._out_grads[action.id] = grads
        elif kind == Kind.ALLREDUCE:
            nbytes = self.weights.allreduce(self.ar_group, self.timeout_s)
            if self.buffers is not None:
                nbytes += self.buffers.sync(self.timeout_s)
        elif kind == Kind.OPTIMIZER_STEP:
            version = self._step(action.id)
        elif kind == Kind.TIED_POST:
            copy = self.tied[action.tie]
            nbytes = copy.weights.post_allreduce(copy.group, copy.holders, action.id)
        elif kind == Kind.TIED_REDUCE:
            unscale, apply = self._update(action.id)
            self.tied[action.tie].weights.step_posted(self.timeout_s, unscale, apply)
            version = self.tied[action.tie].weights.version
        elif kind == Kind.UNSHARD:
            self._shard_bytes = nbytes = gather_weights(self.module)
        elif kind == Kind.REDUCE_GRAD:  # reduce-scattered by the B before it (its FSDP2 hooks)
            nbytes = self._shard_bytes
        elif kind == Kind.RESHARD:
            free_gathered(self.module)
        else:  # pragma: no cover - Kind is closed
            raise RuntimeError(f"unknown action {action}")
        return int(nbytes), version

    def hand_over(self, action: Action, to: "Engine") -> None:
        """A transfer between two stages of this rank (virtual stages): SA gives ``to`` (the
        next stage) this microbatch's outputs as its received inputs, SG gives ``to`` (the
        previous stage) the inputs' gradients, both as the wire would (fresh leaves, copies)."""
        if action.kind is Kind.SEND_ACT:
            samples, tensors, passengers = self._to_send.pop(action.id)
            acts = tuple(pytree.tree_map(_fresh_leaf, list(tensors)))
            to._received[action.id] = (samples, acts, tuple(passengers))
        else:
            to._out_grads[action.id] = [g.detach().clone() for g in self._in_grads.pop(action.id)]

    def leftovers(self) -> list[str]:
        """What the schedule left held (for a warning at its end)."""
        return [k for k, v in (("forward graphs", self._ctx), ("unsent activations", self._to_send),
                               ("unsent gradients", self._in_grads), ("weight gradients", self._weight_work)) if v]

    def _step(self, update: int) -> int:
        """U: this stage's step of ``update``; returns the version it produces. With clipping it
        is deferred where it can be (weights.py ``defer``): the global norm's all-reduce runs
        meanwhile and is waited for when the new weights are first needed."""
        if self.clipper is not None and self.weights.can_defer:
            unscale, apply = self._scaled(update)
            self.clipper.start(update, unscale, apply)
            self.weights.defer(functools.partial(self.clipper.factor, update), unscale, apply)
            return self.weights.next_version
        self.weights.step(*self._update(update))
        return self.weights.version

    def _update(self, update: int) -> tuple[float, bool]:
        """(gradient factor, apply) for a step of ``update`` taken now: :meth:`_scaled`, times
        the global norm's clipping factor with a clipper (clipping.py; waits for the norm)."""
        unscale, apply = self._scaled(update)
        if self.clipper is not None:
            self.clipper.start(update, unscale, apply)
            unscale *= self.clipper.factor(update)
        return unscale, apply

    def _scaled(self, update: int) -> tuple[float, bool]:
        """(1 / loss scale, apply) for this rank's steps of ``update``, decided once per update
        (at the first of its TR and U actions, when every gradient of the update is here) by the
        loss scaler and agreed with every rank; (1, True) without one. A rank holding several
        stages decides once for all of them (they share ``_updates``), over all their gradients."""
        if self.scaler is None:
            return 1.0, True
        if update not in self._updates:
            overflow = any(e.weights.gradient_overflowed() or any(
                copy.weights.posted_gradient_overflowed(self.timeout_s) for copy in e.tied.values())
                for e in self._rank_engines)
            apply, used = self.scaler.decide(overflow)
            if not apply:
                log.info("rank %d: update %d skipped: the float16 gradients overflowed at loss scale %g",
                         self.rank, update, used)
            self._updates[update] = (1.0 / used, apply)
        return self._updates[update]

    # ------------------------------------------------------------------ compute
    def _inputs(self, microbatch: int, get_microbatch: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], int, list[torch.Tensor]]:
        if self.is_first:
            if get_microbatch is None:
                raise RuntimeError(f"rank {self.rank}: the first stage needs data for microbatch {microbatch}")
            inputs, targets, samples = get_microbatch(microbatch)
            return inputs, targets, samples, []
        if microbatch not in self._received:
            raise RuntimeError(f"rank {self.rank}: F{microbatch} before its activations were received (RA missing)")
        samples, acts, passengers = self._received.pop(microbatch)
        leaves = _grad_leaves(acts)
        return acts, passengers, samples, leaves

    def _params(self, version: int, tied_versions: dict[int, int]) -> dict[str, torch.Tensor]:
        """The stage's parameter tensors of ``version`` (its shared parameters' of theirs)."""
        params = self.weights.tensors(version)
        if self.tied:
            params = dict(params)
            for k, copy in self.tied.items():
                params.update(copy.weights.tensors(tied_versions[k]))
        return params

    def _run_module(self, version: int, inputs: tuple[Any, ...], targets: tuple[Any, ...],
                    tied_versions: dict[int, int]) -> tuple[Any, torch.Tensor | None]:
        """The stage's forward (and the loss on the last stage) with the weights of ``version``,
        under autocast when the pipeline computes in a lower precision."""
        if self.compute_dtype is None:
            return self._call_module(version, inputs, targets, tied_versions)
        with torch.autocast(self.device.type, dtype=self.compute_dtype):
            return self._call_module(version, inputs, targets, tied_versions)

    def _call_module(self, version: int, inputs: tuple[Any, ...], targets: tuple[Any, ...],
                     tied_versions: dict[int, int]) -> tuple[Any, torch.Tensor | None]:
        if self.eval_graph:  # evaluation with the current weights, which that graph reads itself
            out = self.module(*inputs)
            return out, (self.loss_fn(out, *targets) if self.is_last else None)
        params = self._params(version, tied_versions)
        if self._slots is None:
            out = functional_call(self.module, params, inputs)
        else:
            # Install the version's tensors in the modules' parameter slots for this call and
            # put the parameters back afterwards: what functional_call does, without its
            # ~25 µs per parameter of checks (measured: 200 µs on an 8-parameter stage).
            saved = []
            for mod, attr, name in self._slots:
                saved.append(mod._parameters[attr])
                mod._parameters[attr] = params[name]
            try:
                out = self.module(*inputs)
            finally:
                for (mod, attr, _), p in zip(self._slots, saved):
                    mod._parameters[attr] = p
        # An empty microbatch (a last minibatch smaller than the number of microbatches)
        # contributes no loss and no gradient.
        empty = bool(inputs) and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() > 0 and inputs[0].shape[0] == 0
        loss = self.loss_fn(out, *targets) if self.is_last and not empty else None
        return out, loss

    @contextlib.contextmanager
    def _buffers_kept(self) -> Iterator[None]:
        """Run a forward a second time without moving the module's buffers (BatchNorm's running
        statistics and batch counts are put back as they were)."""
        saved = [(b, b.clone()) for b in self.module.buffers()]
        try:
            yield
        finally:
            with torch.no_grad():
                for b, value in saved:
                    b.copy_(value)

    def _run_recomputable(self, microbatch: int, version: int, inputs: tuple[Any, ...], targets: tuple[Any, ...],
                          tied_versions: dict[int, int]) -> tuple[Any, torch.Tensor | None]:
        """``_run_module`` of ``microbatch`` under a non-reentrant checkpoint: autograd keeps the
        inputs only and runs the forward again when the backward reaches it, reseeded as the first
        run was (``_seeded``: the same random numbers on any device, where the checkpoint's own
        ``preserve_rng_state`` restores the CUDA generators of its tensor arguments' devices only),
        buffers restored by ``_buffers_kept``. The caller runs the first run under ``_seeded``."""
        runs = 0

        def forward(*xs: Any) -> tuple[Any, torch.Tensor | None]:
            nonlocal runs
            runs += 1
            if runs == 1:
                return self._run_module(version, xs, targets, tied_versions)
            with self._seeded(microbatch, True), self._buffers_kept():
                return self._run_module(version, xs, targets, tied_versions)

        return checkpoint(forward, *inputs, use_reentrant=False, preserve_rng_state=False)

    @contextlib.contextmanager
    def _seeded(self, microbatch: int, train: bool) -> Iterator[None]:
        """Run a training forward with the random state of its microbatch (the caller's global
        random state is restored afterwards); nothing changes for a stage that draws none."""
        if not (train and self.draws_random):
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(hash((self.rng_seed, self.stage, self.microbatch_base + microbatch)) & ((1 << 63) - 1))
            yield

    def _forward(self, microbatch: int, version: int, comm: P2P | None, get_microbatch: Any, train: bool,
                 results: dict[int, MicrobatchResult]) -> None:
        inputs, targets, samples, leaves = self._inputs(microbatch, get_microbatch)
        # A shared parameter's version is the number of its steps (TR) so far (actions.py).
        tied = {k: copy.weights.version for k, copy in self.tied.items()}
        with torch.set_grad_enabled(train), self._seeded(microbatch, train):
            if train and self.recompute and not self.eval_graph:
                out, loss = self._run_recomputable(microbatch, version, inputs, targets, tied)
            else:
                out, loss = self._run_module(version, inputs, targets, tied)
        if train:
            self.weights.release(version)
            for k, copy in self.tied.items():
                copy.weights.release(tied[k])
        if self.is_last and samples == 0:
            if train:  # no loss: B has nothing to differentiate, the stage's inputs get zeros
                # (a sharded stage's B is a collective of its replicas all the same: it differentiates a zero)
                zero = _zero_of(out) if self.weights.sharded else None
                self._ctx[microbatch] = _Context(version, inputs, leaves, loss=zero, targets=targets, samples=0,
                                                   tied_versions=tied)
        elif self.is_last:
            assert loss is not None
            if loss.dim() != 0:
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)}; use reduction='mean' or 'sum'"
                )
            correct = _correct_predictions(self.finish(out), targets)
            results[microbatch] = MicrobatchResult(samples, float(loss.detach().item()), correct)
            if train:
                self._ctx[microbatch] = _Context(version, inputs, leaves, loss=loss, targets=targets, samples=samples,
                                                   tied_versions=tied)
        else:
            outs = list(as_tuple(out))
            self._to_send[microbatch] = (samples, outs, list(targets))
            if train:
                diff = _grad_leaves(outs)
                self._ctx[microbatch] = _Context(version, inputs, leaves, outputs=diff, targets=targets, samples=samples,
                                                   tied_versions=tied)

    def _backward(self, microbatch: int, version: int | None) -> None:
        ctx = self._ctx.pop(microbatch, None)
        if ctx is None:
            raise RuntimeError(f"rank {self.rank}: B{microbatch} without its forward F{microbatch} on this rank")
        if version is not None and version != ctx.version:
            # No stashing (naive): recompute the forward with the weights this B names, then
            # differentiate that graph (inputs from F, weights of the B's version).
            inputs = tuple(pytree.tree_map(
                lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, list(ctx.inputs)))
            leaves = _grad_leaves(inputs)
            with torch.enable_grad(), self._seeded(microbatch, True), self._buffers_kept():
                out, loss = self._run_module(version, inputs, ctx.targets, ctx.tied_versions)
            ctx.leaves = leaves
            ctx.loss = loss
            ctx.outputs = [t for t in as_tuple(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        use_version = ctx.version if version is None else version
        params = list(self._params(use_version, ctx.tied_versions).values())
        if self.is_last:
            if ctx.loss is None:  # empty microbatch
                roots, grad_outputs = [], None
            else:
                # the gradient of the summed loss (weights.py, "Loss scaling by construction"),
                # or of the minibatch's mean when every update applies one whole minibatch
                summed = self.loss_reduction == "mean" and not self.weights.grads_are_means
                root = ctx.loss * ctx.samples if summed else ctx.loss
                if self.scaler is not None:
                    root = root * self.scaler.scale
                roots, grad_outputs = [root], None
        else:
            grads = self._out_grads.pop(microbatch, None)
            if grads is None:
                raise RuntimeError(f"rank {self.rank}: B{microbatch} before the gradients of its outputs were received (RG missing)")
            if len(grads) != len(ctx.outputs):
                raise RuntimeError(f"rank {self.rank}: B{microbatch} got {len(grads)} gradients for {len(ctx.outputs)} outputs")
            roots, grad_outputs = ctx.outputs, grads
        split = (self.stage, microbatch) in self._split
        if split and not self.weights.fsdp:  # FSDP2 holds no weights to name in a W (shared ones aside)
            # B: the inputs' gradients now (sent by SG), the weights' at this microbatch's W
            work = backward_inputs(roots, grad_outputs, ctx.leaves, params) if roots else None
            self._weight_work[microbatch] = (work, ctx, version)
        elif self.weights.sharded:
            reduces = microbatch in self._reducing
            if reduces:  # a zero1 stage's last B of an update: its hooks reduce-scatter (the RD after it)
                reduce_in_backward(self.module, True)
            if roots:  # into everything the graph holds: FSDP2's gathered weights, whose hooks reduce them
                torch.autograd.backward(roots, grad_tensors=grad_outputs)
            if reduces:
                reduce_in_backward(self.module, False)
            if split:  # FSDP2 reduces the weights' gradients when a whole backward ends: W has nothing left
                self._weight_work[microbatch] = (None, ctx, version)
            else:
                self._weights_done(ctx, version)
        else:
            wrt = params + ctx.leaves
            if wrt and roots:
                # Accumulates into the weight aliases' .grad (the stage's persistent buffers, in
                # place) and into the received activations' .grad (sent back by SG).
                torch.autograd.backward(roots, grad_tensors=grad_outputs, inputs=wrt)
            self._weights_done(ctx, version)
        if not self.is_first:
            self._in_grads[microbatch] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ctx.leaves]

    def _weight_grad(self, microbatch: int) -> None:
        """W of a split backward: the weights' gradients of ``microbatch`` from where its B left them."""
        if microbatch not in self._weight_work:
            raise RuntimeError(f"rank {self.rank}: W{microbatch} without its B{microbatch} on this rank")
        work, ctx, version = self._weight_work.pop(microbatch)
        if work is not None:
            work.run()
        self._weights_done(ctx, version)

    def _weights_done(self, ctx: _Context, version: int | None) -> None:
        """A microbatch's weight gradients are in: count its samples, release its versions."""
        self.weights.add_samples(ctx.samples)
        for k, copy in self.tied.items():
            copy.weights.add_samples(ctx.samples)
            copy.weights.release(ctx.tied_versions[k])
        if version is not None:
            self.weights.release(version)


def run_actions(
    engines: dict[int, Engine],
    actions: list[Action],
    comm: P2P | None,
    get_microbatch: MicrobatchSource | None,
    train: bool,
    version_base: int,
    t0: float,
    recorder: FlightRecorder | None = None,
) -> tuple[dict[int, MicrobatchResult], list[Event]]:
    """Execute one rank's ``actions`` in order, each by the engine of its stage (``engines``:
    stage -> Engine; several where the rank holds virtual stages). A transfer between two of
    them (peer = this rank) is a hand-over in memory; its receive only checks that it came.
    ``get_microbatch(i)`` gives (inputs, targets, samples) of microbatch ``i`` (the first
    stage's rank); ``version_base`` is the number of updates before this schedule (schedule
    versions are relative to its start); times are relative to ``t0``, timed where the engines'
    device computes (``action_clock.py``). ``recorder`` notes each action as it starts and ends
    (where the rank stood, should the run fail).
    Returns the last stage's per-microbatch results and one event per action."""
    any_engine = next(iter(engines.values()))
    rank = any_engine.rank
    recorder = recorder or FlightRecorder(rank, str)
    decisions: dict[int, tuple[float, bool]] = {}  # the rank's loss-scale decision of each update
    for stage, engine in engines.items():
        engine.begin([a for a in actions if a.stage == stage], train, list(engines.values()), decisions)
    results: dict[int, MicrobatchResult] = {}
    clock = ActionClock(any_engine.device, t0)
    mark = clock.mark
    done: list[tuple[Action, int, int, int | None]] = []  # (action, replica, bytes, version)
    marks: list[Any] = []  # start and end of each action in ``done``
    for action in actions:
        engine = engines[action.stage]
        recorder.start(action)
        marks.append(mark())
        if action.kind.is_transfer and action.peer == rank:
            nbytes, version = 0, None
            if action.kind.is_send:
                engine.hand_over(action, engines[action.stage + (1 if action.kind is Kind.SEND_ACT else -1)])
        else:
            nbytes, version = engine.execute(action, comm, get_microbatch, train, version_base, results)
        marks.append(mark())
        liveness.mark()
        recorder.finish()
        if comm is not None:
            if action.kind is Kind.OPTIMIZER_STEP and comm.drain_at_update:
                with recorder.phase("waiting for its sends to complete before the next minibatch"):
                    comm.drain()
            comm.pump()  # post the receives that became possible (outside the timed action)
        done.append((action, engine.replica, nbytes, version))
    if comm is not None:
        with recorder.phase("waiting for its last sends of the schedule to complete"):
            comm.finish()
    times = clock.seconds(marks)
    events = [Event(rank=rank, stage=action.stage, kind=action.kind.value, id=action.id, start_s=times[2 * i],
                    end_s=times[2 * i + 1], bytes=nbytes, action=str(action), replica=replica, version=version)
              for i, (action, replica, nbytes, version) in enumerate(done)]
    leftover = sorted({what for engine in engines.values() for what in engine.leftovers()})
    if leftover and train:
        log.warning("rank %d: schedule ended with %s still held", rank, ", ".join(leftover))
    return results, events
