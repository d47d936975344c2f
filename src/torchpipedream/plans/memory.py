"""The memory model: the peak bytes one worker of a stage holds, term by term.

A worker of a stage holding ``d`` minibatches in flight (``planner.in_flight``) holds

* its weights: one copy per live version (``ScheduleKind.memory_terms``: pipedream one per
  in-flight minibatch, 2bw two, the others one), the gradient buffer and the optimizer's state
  (``optimizer_state_factor`` × weights together; 2 for SGD with momentum);
* per in-flight microbatch, what the forward left for the backward: the tensors autograd saved
  that the stage's layers produced (``Layer.saved_bytes``, measured by the profiler), the
  received inputs, the outputs nothing saved (the backward starts from them), and two message
  buffers of the outputs' size (the packed copy being sent, and the gradient receive posted as
  soon as it is sent). A recomputing stage keeps its inputs and outputs only;
* once: the backward's working memory (gradients arriving and leaving a layer and the kernels'
  scratch: ``WORKING_FACTOR`` × the largest output + inputs of a layer of the stage, per
  microbatch), the gradient a backward makes before adding it to an existing one (the largest
  parameter of the stage, when a backward accumulates: several microbatches per update or a
  replicated stage), a posted activation receive and an outstanding gradient send (the inputs'
  size), and for a recomputing stage one microbatch's saved tensors while it recomputes;
  or the optimizer step's temporaries when they are larger (``optimizer_scratch``: torch's
  Adam on a CPU, a per-parameter loop, holds two of one parameter's size at once; with
  ``foreach`` it holds one of the stage's weights; SGD steps in place).

A stage sharded over its ``m`` replicas (``Stage.sharding``, FSDP2; one weight version: flush,
gpipe) holds ``(1 + optimizer_state_factor) / m`` of its weights' worth, and gathered on top
(:func:`sharded_weight_bytes`): under "zero3" one layer's weights and its unsharded gradient
at a time (the largest parameter stands for the largest layer), under "zero2" the whole
stage's weights (kept gathered from a forward to its backward) and one unsharded gradient,
under "zero1" the whole stage's weights and its whole gradient (both kept from the minibatch's
gather, ``UN``, to its reduce-scatter and reshard, ``RD``/``RS``) and, at the reduce-scatter,
FSDP2's flat copy of that gradient: three times the stage's weights (charged beside the
in-flight activations, which are mostly freed by then: an overcount where they are large;
benchmarks/sharding.py measures it).

The planner (feasibility under a budget), ``Plan.stages[s].memory_bytes`` and the simulator
(with the schedule's exact in-flight counts) all use these terms. benchmarks/memory_model.py
measures the peak per stage (``Pipeline(measure_memory=True)``) beside them, on the benchmark
models the constant was chosen on and on models it was not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..model.graph import WORKING_FACTOR, working_key
from .kinds import ScheduleKind, schedule_kind

if TYPE_CHECKING:
    from ..model.graph import Block

__all__ = ["WORKING_FACTOR", "DEFAULT_OPTIMIZER_STATE_FACTOR", "NO_SCRATCH", "scratch_of_options", "StageActivations",
           "stage_activations", "working_key", "once_bytes", "memory_terms", "stage_memory_bytes", "sharded_weight_bytes"]

#: Extra copies of a stage's weights a worker holds besides its weight versions
#: (``optimizer_state_factor``): the gradient buffer and one momentum buffer (SGD with
#: momentum). Adam would be 3. The planner's and the simulator's default, so planned and
#: simulated memory agree.
DEFAULT_OPTIMIZER_STATE_FACTOR = 2.0


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes of one stage per minibatch (the planner divides by the microbatches).

    Attributes:
        saved: tensors autograd saved that the stage's layers produced.
        inputs: the activations the stage receives (0 for the first stage).
        outputs: the activations it sends (0 for the last stage).
        unsaved_outputs: the part of ``outputs`` no layer saved (held for the backward).
        working: the backward's working memory beyond what the stage holds: the most, over
            its layers, of ``WORKING_FACTOR`` × (output + inputs) less what the backward of the
            layers after it has freed by then (what they saved, and the layer's output if only
            they saved it).
        largest_parameter: the largest parameter bytes of one of its layers.
        measured: whether the profile measured what the layers save. A profile that did not
            (PipeDream's graph.txt, the bundled reference profiles, graphs written before)
            gets the older model: weights and stashed inputs only, a lower bound.
    """

    saved: float = 0.0
    inputs: float = 0.0
    outputs: float = 0.0
    unsaved_outputs: float = 0.0
    working: float = 0.0
    largest_parameter: float = 0.0
    measured: bool = True

    @classmethod
    def from_dict(cls, raw: Any) -> "StageActivations":
        """The terms as a plan file stores them; ValueError naming the terms if malformed."""
        names = cls.__dataclass_fields__
        if not isinstance(raw, dict) or set(raw) - set(names) or not all(
                isinstance(v, bool) if k == "measured" else
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for k, v in raw.items()):
            raise ValueError(f"must map the memory model's terms ({', '.join(names)}) to bytes >= 0")
        return cls(**raw)

    def held(self, recompute: bool) -> float:
        """Bytes held per in-flight minibatch between its forward and its backward."""
        if not self.measured:
            return self.inputs
        kept = self.inputs + self.unsaved_outputs if not recompute else self.inputs + self.outputs
        return kept + (0.0 if recompute else self.saved) + 2 * self.outputs

    def once(self, recompute: bool) -> float:
        """Bytes a worker needs once, in minibatch terms (divide by the microbatches), beside
        what it holds per in-flight microbatch."""
        if not self.measured:
            return 0.0
        return self.working + 2 * self.inputs + (self.saved if recompute else 0.0)


def stage_activations(blocks: Sequence["Block"], first: int, last: int) -> StageActivations:
    """The activation terms of a stage made of ``blocks[first..last]`` (a linearised graph)."""
    inside = blocks[first:last + 1]
    end = last == len(blocks) - 1
    if not all(b.saves_measured for b in inside):
        return StageActivations(inputs=float(blocks[first - 1].cut_bytes) if first > 0 else 0.0, measured=False)
    return StageActivations(
        saved=float(sum(b.saved_bytes for b in inside)),
        inputs=float(blocks[first - 1].cut_bytes) if first > 0 else 0.0,
        outputs=0.0 if end else float(blocks[last].cut_bytes),
        unsaved_outputs=0.0 if end else float(blocks[last].unsaved_cut_bytes),
        working=float(max((working_key(b.working_bytes, b.released_bytes) - sum(a.saved_bytes for a in inside[k + 1:])
                           for k, b in enumerate(inside)), default=0.0)),
        largest_parameter=float(max((b.largest_parameter_bytes for b in inside), default=0)),
    )


#: ``optimizer_scratch`` of an optimizer whose step works in place (SGD, with or without momentum).
NO_SCRATCH: tuple[float, float] = (0.0, 0.0)


def scratch_of_options(options: Any) -> tuple[float, float]:
    """The ``optimizer_scratch`` a plan was made with (its ``meta["planner"]`` options);
    ``NO_SCRATCH`` for plans made without one."""
    raw = options.get("optimizer_scratch") if isinstance(options, dict) else None
    if isinstance(raw, (list, tuple)) and len(raw) == 2 and all(isinstance(v, (int, float)) for v in raw):
        return float(raw[0]), float(raw[1])
    return NO_SCRATCH


def once_bytes(acts: StageActivations, microbatches: int, recompute: bool = False, replicas: int = 1,
               scratch: tuple[float, float] = NO_SCRATCH, weights: Any = 0.0) -> Any:
    """What a worker needs once besides its weights and in-flight microbatches: the working
    memory of one microbatch's backward (and recomputation), message buffers, and the gradient
    a backward makes before adding it to an existing one when backwards accumulate (several
    microbatches per update, or a replicated stage's persistent gradients); or, when larger,
    the optimizer step's temporaries (``scratch`` = (a, b): a × the largest layer's parameters
    + b × the stage's ``weights``), which come after the backward has freed its own."""
    mu = max(1, int(microbatches))
    accumulates = replicas > 1 or mu > 1
    backward = acts.once(recompute) / mu + (acts.largest_parameter if accumulates and acts.measured else 0.0)
    if not acts.measured or scratch == NO_SCRATCH:
        return backward
    step = scratch[0] * acts.largest_parameter + scratch[1] * weights
    both = np.maximum(backward, step)
    return float(both) if np.ndim(both) == 0 else both


def sharded_weight_bytes(weights: Any, replicas: int, optimizer_factor: float, sharding: str,
                         largest_parameter: Any, whole: float = 0.0) -> Any:
    """What one replica of a sharded stage holds of its weights (see the module docstring): its
    shard of the weights and of the gradient and optimizer state, and what is gathered whole.
    ``whole``: bytes of those weights FSDP2 leaves whole on every replica (a parameter stages
    share: runtime/sharding.py), held with their optimizer state as on a replicated stage."""
    sharded = weights - whole
    gathered = {"zero3": 2 * largest_parameter, "zero2": sharded + largest_parameter}.get(sharding, 3 * sharded)
    return (1 + optimizer_factor) * (sharded / max(1, int(replicas)) + whole) + gathered


def memory_terms(kind: str | ScheduleKind, weights: float, acts: StageActivations, microbatches: int,
                 optimizer_factor: float, recompute: bool = False, replicas: int = 1,
                 scratch: tuple[float, float] = NO_SCRATCH, sharding: str = "replicate",
                 whole: float = 0.0) -> tuple[float, float, float]:
    """``(base, per, cap)``: a worker of a stage of ``replicas`` replicas holding ``d``
    minibatches in flight needs ``base + per · min(d, cap)`` bytes (the planner's vectorised
    search uses the same form; versions and in-flight counts are the kind's,
    ``ScheduleKind.memory_terms``). A sharded stage (one version: the kinds that shard keep
    ``(1 + f)`` weights' worth) holds :func:`sharded_weight_bytes` instead (``whole``: its
    bytes that stay whole, shared parameters)."""
    k = schedule_kind(kind)
    mu = max(1, int(microbatches)) if k.microbatched else 1
    base, per, cap = k.memory_terms(weights, acts.held(recompute), mu, optimizer_factor, replicas)
    if sharding != "replicate" and replicas > 1:
        base = base - (1 + optimizer_factor) * weights + sharded_weight_bytes(
            weights, replicas, optimizer_factor, sharding, acts.largest_parameter, whole)
    return base + once_bytes(acts, mu, recompute, replicas, scratch, weights), per, cap


def stage_memory_bytes(kind: str | ScheduleKind, weights: float, acts: StageActivations, depth: int,
                       microbatches: int, optimizer_factor: float, recompute: bool = False,
                       replicas: int = 1, scratch: tuple[float, float] = NO_SCRATCH,
                       sharding: str = "replicate", whole: float = 0.0) -> float:
    """Predicted peak bytes of one worker of a stage of ``replicas`` replicas with ``depth``
    minibatches in flight (its weights ``sharding`` over them, but for ``whole`` bytes of
    shared parameters)."""
    base, per, cap = memory_terms(kind, weights, acts, microbatches, optimizer_factor, recompute, replicas, scratch,
                                  sharding, whole)
    return base + per * min(depth, cap)
