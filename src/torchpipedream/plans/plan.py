"""The plan: which layers form each stage, how many workers replicate it, on which ranks.

A :class:`Plan` is what the planner produces and what the schedules, the simulator and the
runtime consume. It is plain data with a JSON form; :meth:`Plan.validate` checks it.

Ranks are assigned stage by stage: stage 0's replicas get the first ranks, and so on. A rank
may also hold several stages (virtual stages, "chunks": :meth:`Plan.looped` puts stage k on rank
k mod p, as Megatron's interleaved 1F1B does), each of them with a single replica.
Costs are per minibatch of ``batch_size`` samples on one worker (a replica of a stage with r
replicas processes every r-th minibatch).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from ..util.jsonio import read_json, write_json
from .kinds import UnknownKindError, schedule_kind
from .memory import StageActivations, scratch_of_options
from .memory import stage_memory_bytes as model_memory_bytes

__all__ = ["Stage", "Plan", "PlanError", "TiedParameter", "PLAN_FORMAT_VERSION", "SHARDINGS", "looped_rank", "v_shape_rank"]

PLAN_FORMAT_VERSION = 1
#: What a stage's replicas may do with its weights (``Stage.sharding``).
SHARDINGS = ("replicate", "zero3", "zero2", "zero1")
#: Fields that older plan files carry and this version derives or no longer keeps: read and dropped.
_LEGACY_STAGE_FIELDS = frozenset({"output_tensors"})
#: The largest batch size and microbatch count a plan may name: more samples than any run has
#: (a file's 10**20 printed 2.7e22 samples/s; issue 39).
MAX_COUNT = 2**31


def looped_rank(stage: int, workers: int) -> int:
    """The worker of ``stage`` in a looped plan (Megatron's interleaving): stage k on k mod p."""
    return stage % workers


def v_shape_rank(stage: int, workers: int) -> int:
    """The worker of ``stage`` in a V (ZB-V): worker r holds stages r and 2p − 1 − r."""
    return stage if stage < workers else 2 * workers - 1 - stage


def _stage_dict(stage: Stage) -> dict[str, Any]:
    """A stage as JSON; unmeasured split-backward times are left out (files as before them)."""
    d = asdict(stage)
    for key in ("input_grad_ms", "weight_grad_ms"):
        if d[key] is None:
            del d[key]
    if d["sharding"] == "replicate":  # files as before sharding existed
        del d["sharding"]
    return d


class PlanError(ValueError):
    """A plan is malformed or does not fit the model, topology or launch; the message says why."""


@dataclass
class Stage:
    """One pipeline stage.

    Attributes:
        layers: names of the graph layers the stage holds, in topological order.
        replicas: number of data-parallel workers running this stage.
        ranks: the global ranks of those workers (len == replicas).
        forward_ms / backward_ms: compute of one minibatch on one replica.
        parameter_bytes: bytes of the stage's weights.
        output_bytes: bytes sent to the next stage per minibatch (activations; the gradient
            coming back has the same size). 0 for the last stage.
        comm_ms: predicted communication per minibatch (activation/gradient transfers and
            the replicas' weight synchronisation, amortised).
        memory_bytes: predicted peak memory of one worker of this stage.
        optimizer_ms: one optimizer step over the stage's weights (once per update).
        recompute: activation recomputation: the forward keeps only the stage's inputs and the
            backward runs the forward again (same weight version, same dropout masks) before
            differentiating it; ``backward_ms`` does not include that second forward.
        activations: the memory model's activation terms of the stage (plans/memory.py), so
            that its memory can be predicted again for another schedule, microbatch count or
            recomputation; None in plans written before they existed.
        input_grad_ms / weight_grad_ms: the stage's backward split as the zero-bubble kinds
            run it (B: input gradients, W: weight gradients), from the profile's per-layer
            times (``Layer.input_grad_ms``); None where the profile did not time it.
        sharding: what the replicas of the stage hold: "replicate" (every replica the whole
            stage, gradients all-reduced: PipeDream's), "zero3" (torch's FSDP2 over the
            replicas: weights, gradients and optimizer state split, weights gathered for each
            forward and backward), "zero2" (the same, the gathered weights kept from a
            forward to its backward) or "zero1" (gathered once per minibatch, before its
            first forward, and the gradient reduce-scattered once, after its last backward:
            the schedule's ``UN``, ``RD`` and ``RS`` actions). See ``SHARDINGS`` and
            runtime/sharding.py.
    """

    layers: list[str]
    replicas: int = 1
    ranks: list[int] = field(default_factory=list)
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    parameter_bytes: int = 0
    output_bytes: int = 0
    comm_ms: float = 0.0
    memory_bytes: int = 0
    optimizer_ms: float = 0.0
    recompute: bool = False
    activations: StageActivations | None = None
    input_grad_ms: float | None = None
    weight_grad_ms: float | None = None
    sharding: str = "replicate"

    @property
    def sharded(self) -> bool:
        """The replicas split the stage's weights, gradients and optimizer state (FSDP2)."""
        return self.sharding != "replicate"

    @property
    def compute_ms(self) -> float:
        """Forward, backward (with the recomputed forward) and optimizer step of one minibatch."""
        return self.forward_ms * (2 if self.recompute else 1) + self.backward_ms + self.optimizer_ms


@dataclass
class TiedParameter:
    """One parameter that layers of several stages share (an input embedding and the output
    layer that reuses its matrix): each of ``stages`` holds a copy, and the schedule's ``TR``
    actions keep the copies equal (their gradients summed, one update).

    Attributes:
        name: the parameter's name in the model's state dict (one of its names, if it has several).
        stages: the stages holding a copy, ascending (two or more).
        bytes: its size (what every ``TR`` all-reduces).
        layers: the layers that use it (from the profile; empty when the plan was not planned
            from one).
    """

    name: str
    stages: list[int]
    bytes: int = 0
    layers: list[str] = field(default_factory=list)


def _check_stage_shape(s: int, stage: Any) -> None:
    """Stage ``s`` is a Stage with layer names, a positive replica count and one integer rank per replica."""
    if not isinstance(stage, Stage):
        raise PlanError(f"stage {s} is a {type(stage).__name__}, not a Stage")
    if not isinstance(stage.layers, list) or not all(isinstance(n, str) for n in stage.layers):
        raise PlanError(f"stage {s}: layers must be a list of layer names, got {stage.layers!r:.100}")
    if not stage.layers:
        raise PlanError(f"stage {s} has no layers")
    if isinstance(stage.replicas, bool) or not isinstance(stage.replicas, int) or stage.replicas < 1:
        raise PlanError(f"stage {s}: replicas must be a positive integer, got {stage.replicas!r}")
    if not isinstance(stage.ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                      for r in stage.ranks):
        raise PlanError(f"stage {s}: ranks must be a list of integers, got {stage.ranks!r:.100}")
    if len(stage.ranks) != stage.replicas:
        raise PlanError(f"stage {s}: {stage.replicas} replicas but {len(stage.ranks)} ranks {stage.ranks}")


def _check_stage_values(s: int, stage: Stage) -> None:
    """Stage ``s`` names each rank once, and its recompute flag, costs and sizes are of the right kind."""
    if len(set(stage.ranks)) != len(stage.ranks):
        raise PlanError(f"stage {s}: ranks {stage.ranks} name a rank twice")
    if not isinstance(stage.recompute, bool):
        raise PlanError(f"stage {s}: recompute must be true or false, got {stage.recompute!r}")
    if stage.sharding not in SHARDINGS:
        raise PlanError(f"stage {s}: sharding must be one of {', '.join(SHARDINGS)}, got {stage.sharding!r:.40}")
    if stage.sharded and stage.replicas < 2:
        raise PlanError(f"stage {s}: sharding {stage.sharding!r} splits the stage over its replicas, and it has "
                        f"{stage.replicas}: give it two or more, or sharding 'replicate'")
    for attr in ("forward_ms", "backward_ms", "optimizer_ms", "comm_ms", "parameter_bytes", "output_bytes",
                 "memory_bytes", "input_grad_ms", "weight_grad_ms"):
        v = getattr(stage, attr)
        if v is None and attr.endswith("_grad_ms"):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise PlanError(f"stage {s}: {attr} must be a finite number >= 0, got {v!r}")


def _check_count(name: str, value: Any, optional: bool = False) -> None:
    """The plan's ``name`` (batch_size, microbatches) is a whole number from 1 to MAX_COUNT (or None if ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise PlanError(f"{name} must be a whole number from 1 to 2**31, got {value!r}")


def _check_same_layers(layer_names: list[str], seen_layers: dict[str, int]) -> None:
    """The plan's layers (``seen_layers``: name -> stage) are the model's, no more and no fewer."""
    missing = [n for n in layer_names if n not in seen_layers]
    extra = [n for n in seen_layers if n not in set(layer_names)]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"model layers not in the plan: {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        if extra:
            parts.append(f"plan layers not in the model: {extra[:6]}{' ...' if len(extra) > 6 else ''}")
        raise PlanError(
            "the plan does not match the model ("
            + "; ".join(parts)
            + f"). The model has {len(layer_names)} layers, the plan {len(seen_layers)}: "
            "re-run `torchpipedream plan` on this model's profile."
        )


@dataclass
class Plan:
    """A partition of a model into stages over a set of workers.

    Attributes:
        stages: the stages in pipeline order.
        schedule: the schedule kind the plan was made for (a name in ``kinds.SCHEDULE_KINDS``).
        batch_size: samples per minibatch the costs refer to (None if unknown).
        microbatches: microbatches per minibatch for the batch-synchronous schedules
            (flush, gpipe, 2bw); 1 means no splitting.
        topology: the topology spec the plan was made for (see topology.py).
        predicted: at least ``time_per_minibatch_s`` and ``samples_per_s``.
        meta: provenance (graph source, model name, planner options, planning time).
        tied: parameters shared by layers of several stages (:class:`TiedParameter`).
        tensor_parallel: the tensor-parallel degree t (the DeviceMesh's innermost dimension): every
            worker of the plan is t ranks that split its stage's layers with torch's
            ``parallelize_module`` (runtime/tensor_parallel.py). The stages' ``ranks`` name
            workers; worker w runs on global ranks w·t … w·t + t − 1 (:meth:`ranks_of_worker`),
            so a launch has ``num_ranks`` = workers × t processes. 1: none (files as before).
    """

    stages: list[Stage]
    schedule: str = "pipedream"
    batch_size: int | None = None
    microbatches: int = 1
    topology: str = ""
    predicted: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    tied: list[TiedParameter] = field(default_factory=list)
    tensor_parallel: int = 1

    # ------------------------------------------------------------- derived
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_workers(self) -> int:
        return len({r for s in self.stages for r in s.ranks}) if self.virtual else sum(s.replicas for s in self.stages)

    @property
    def num_ranks(self) -> int:
        """Processes a launch of the plan has: its workers times the tensor-parallel degree."""
        return self.num_workers * self.tensor_parallel

    def worker_of_rank(self, rank: int) -> tuple[int, int]:
        """(worker, tensor rank) of a global rank: worker w runs on ranks w·t … w·t + t − 1."""
        return divmod(rank, self.tensor_parallel)

    def ranks_of_worker(self, worker: int) -> list[int]:
        """The global ranks of worker ``worker`` (its tensor-parallel group; one rank when t = 1)."""
        t = self.tensor_parallel
        return list(range(worker * t, worker * t + t))

    @property
    def virtual(self) -> bool:
        """Some rank holds more than one stage (virtual stages: chunks of the model)."""
        ranks = [r for s in self.stages for r in s.ranks]
        return len(ranks) != len(set(ranks))

    @property
    def chunks(self) -> int:
        """Stages per rank (v): 1 unless the plan has virtual stages (every rank then holds the same number)."""
        return self.num_stages // self.num_workers if self.virtual else 1

    @property
    def config(self) -> str:
        """PipeDream's summary string: replicas per stage joined by '-' ("15-1", "1-1-1-1")."""
        return "-".join(str(s.replicas) for s in self.stages)

    @property
    def summary(self) -> str:
        """A human name for the plan's shape: "data parallel ×4", "straight ×4" or "15-1", with
        its sharded stages ("2-2, stages 0, 1 sharded zero3")."""
        sharded = [s for s, st in enumerate(self.stages) if st.sharded]
        tensor = f", tensor parallel ×{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        if not sharded:
            return self._shape_name() + tensor
        modes = sorted({self.stages[s].sharding for s in sharded})
        which = "" if self.num_stages == 1 else f"{'stage' if len(sharded) == 1 else 'stages'} {', '.join(map(str, sharded))} "
        return f"{self._shape_name()}, {which}sharded {'/'.join(modes)}{tensor}"

    def _shape_name(self) -> str:
        if self.num_stages == 1:
            r = self.stages[0].replicas
            return "single worker" if r == 1 else f"data parallel ×{r}"
        if self.virtual:
            return f"{self.num_stages} stages on {self.num_workers} workers ({self.chunks} per worker)"
        if all(s.replicas == 1 for s in self.stages):
            return f"straight ×{self.num_stages}"
        return self.config

    @property
    def noam(self) -> int:
        """Minibatches the input stage admits before its first backward (PipeDream's
        NUM_OPT_ACTIVE_MINIBATCHES): ⌈workers / input-stage replicas⌉, the warm-up depth of
        stage 0 (``placement.warmup_depth``)."""
        return -(-self.num_workers // self.stages[0].replicas)

    def tied_at(self, stage: int) -> list[int]:
        """Indices into ``tied`` of the shared parameters ``stage`` holds a copy of."""
        return [k for k, t in enumerate(self.tied) if stage in t.stages]

    def stage_of_rank(self, rank: int) -> tuple[int, int]:
        """(stage index, replica index) of a global rank that holds one stage (see
        :meth:`stages_of_rank` for plans with virtual stages)."""
        held = self.stages_of_rank(rank)
        if len(held) > 1:
            raise PlanError(f"rank {rank} holds stages {held} (virtual stages); ask stages_of_rank")
        return held[0], self.stages[held[0]].ranks.index(rank)

    def placed_by(self, rank_of: Any) -> bool:
        """Every stage has one worker, ``rank_of(stage, workers)`` (``looped_rank``, ``v_shape_rank``)."""
        return all(st.ranks == [rank_of(k, self.num_workers)] for k, st in enumerate(self.stages))

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages a global rank holds, in pipeline order (one, or several with virtual stages)."""
        held = [s for s, stage in enumerate(self.stages) if rank in stage.ranks]
        if not held:
            raise PlanError(f"rank {rank} is not in the plan (it has {self.num_workers} workers)")
        return held

    # ----------------------------------------------------------- validation
    def validate(self, layer_names: list[str] | None = None, world_size: int | None = None,
                 edges: Iterable[tuple[str, str]] | None = None) -> None:
        """Check the plan's own consistency (types, layers and ranks each used once, ranks
        0..n-1), and optionally against a model (its layer names, and with ``edges`` the data
        flow: no layer may feed a layer of an earlier stage) and a launch (the world size)."""
        if not isinstance(self.stages, list) or not self.stages:
            raise PlanError("plan has no stages")
        try:
            schedule_kind(self.schedule)
        except UnknownKindError as exc:
            raise PlanError(str(exc)) from None
        _check_count("batch_size", self.batch_size, optional=True)
        _check_count("microbatches", self.microbatches)
        _check_count("tensor_parallel", self.tensor_parallel)
        seen_layers: dict[str, int] = {}
        seen_ranks: set[int] = set()
        for s, stage in enumerate(self.stages):
            _check_stage_shape(s, stage)
            for name in stage.layers:
                if name in seen_layers:
                    raise PlanError(f"layer {name!r} is in stage {seen_layers[name]} and stage {s}")
                seen_layers[name] = s
            _check_stage_values(s, stage)
            seen_ranks.update(stage.ranks)
        if seen_ranks != set(range(self.num_workers)):
            raise PlanError(f"ranks must be 0..{self.num_workers - 1}, got {sorted(seen_ranks)}")
        if self.virtual:
            self._validate_virtual()
        self._validate_tied()
        if layer_names is not None:
            _check_same_layers(layer_names, seen_layers)
        if edges is not None:
            for a, b in edges:
                if a in seen_layers and b in seen_layers and seen_layers[a] > seen_layers[b]:
                    raise PlanError(
                        f"layer {a!r} (stage {seen_layers[a]}) feeds layer {b!r} of an earlier stage "
                        f"({seen_layers[b]}): stages must follow the model's data flow, stage 0 first")
        if world_size is not None and world_size != self.num_ranks:
            each = f" of {self.tensor_parallel} tensor-parallel ranks each: {self.num_ranks} processes" \
                if self.tensor_parallel > 1 else ""
            raise PlanError(
                f"the plan is for {self.num_workers} workers{each} ({self.summary}) but {world_size} were launched"
            )

    def _validate_virtual(self) -> None:
        """A plan with virtual stages: every rank holds the same number of stages, none of them
        replicated, and at most one copy of each shared parameter (two: not supported yet)."""
        replicated = [s for s, st in enumerate(self.stages) if st.replicas > 1]
        if replicated:
            raise PlanError(f"stage {replicated[0]} has {self.stages[replicated[0]].replicas} replicas, but a rank holds "
                            "several stages: virtual stages need one worker per stage")
        held = {r: self.stages_of_rank(r) for r in range(self.num_workers)}
        counts = sorted({len(v) for v in held.values()})
        if len(counts) > 1:
            uneven = {r: v for r, v in held.items() if len(v) != counts[-1]}
            raise PlanError(f"every rank must hold the same number of stages (virtual stages); ranks hold "
                            f"{counts} stages, e.g. rank {next(iter(uneven))}: {next(iter(uneven.values()))}")
        for t in self.tied:
            twice = self.worker_holding_twice(t)
            if twice is not None:
                raise PlanError(f"parameter {t.name!r} is shared by stages {t.stages}, and worker {twice} holds two of "
                                "them: a worker holding two copies of a shared parameter is not supported yet")

    def worker_holding_twice(self, tied: "TiedParameter") -> int | None:
        """The first worker holding two of ``tied``'s stages (virtual stages), or None."""
        workers = [self.stages[s].ranks[0] for s in tied.stages if 0 <= s < len(self.stages)]
        return next((w for w in workers if workers.count(w) > 1), None)

    def _validate_tied(self) -> None:
        if not isinstance(self.tied, list):
            raise PlanError(f"tied must be a list, got {type(self.tied).__name__}")
        names = set()
        for i, t in enumerate(self.tied):
            if not isinstance(t, TiedParameter) or not isinstance(t.name, str) or not t.name:
                raise PlanError(f"tied[{i}] must name a parameter and its stages")
            if t.name in names:
                raise PlanError(f"tied[{i}]: parameter {t.name!r} is listed twice")
            names.add(t.name)
            if (not isinstance(t.stages, list) or len(t.stages) < 2 or t.stages != sorted(set(t.stages))
                    or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < self.num_stages
                               for s in t.stages)):
                raise PlanError(f"tied[{i}] ({t.name}): stages must be two or more distinct stages of the plan, "
                                f"ascending, got {t.stages!r}")
            if isinstance(t.bytes, bool) or not isinstance(t.bytes, int) or t.bytes < 0:
                raise PlanError(f"tied[{i}] ({t.name}): bytes must be an integer >= 0, got {t.bytes!r}")
            if not isinstance(t.layers, list) or not all(isinstance(n, str) for n in t.layers):
                raise PlanError(f"tied[{i}] ({t.name}): layers must be a list of layer names, got {t.layers!r}")

    # ------------------------------------------------------------- JSON I/O
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "torchpipedream.Plan",
            "format_version": PLAN_FORMAT_VERSION,
            "config": self.config,
            "summary": self.summary,
            "schedule": self.schedule,
            "batch_size": self.batch_size,
            "microbatches": self.microbatches,
            "noam": self.noam,
            "topology": self.topology,
            "predicted": dict(self.predicted),
            "stages": [_stage_dict(s) for s in self.stages],
            "tied": [asdict(t) for t in self.tied],
            "meta": self.meta,
        } | ({"tensor_parallel": self.tensor_parallel} if self.tensor_parallel != 1 else {})

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"{source}: expected a JSON object")
        if data.get("format_version") != PLAN_FORMAT_VERSION:
            raise PlanError(
                f"{source}: format_version {data.get('format_version')!r} is not supported "
                f"(this version reads {PLAN_FORMAT_VERSION})"
            )
        raw_stages = data.get("stages")
        if not isinstance(raw_stages, list):
            raise PlanError(f"{source}: field 'stages' must be a list")
        known = set(Stage.__dataclass_fields__)
        stages = []
        for i, raw in enumerate(raw_stages):
            if not isinstance(raw, dict) or "layers" not in raw:
                raise PlanError(f"{source}: stages[{i}] must be an object with 'layers'")
            unknown = set(raw) - known - _LEGACY_STAGE_FIELDS
            if unknown:
                raise PlanError(f"{source}: stages[{i}]: unknown field(s) {sorted(unknown)}")
            fields = {k: v for k, v in raw.items() if k in known}
            if fields.get("activations") is not None:
                try:
                    fields["activations"] = StageActivations.from_dict(fields["activations"])
                except ValueError as exc:
                    raise PlanError(f"{source}: stages[{i}].activations {exc}") from None
            stages.append(Stage(**fields))
        for key, types in (("schedule", str), ("batch_size", (int, type(None))), ("microbatches", int),
                           ("topology", str), ("predicted", (dict, type(None))), ("meta", (dict, type(None))),
                           ("tied", list), ("tensor_parallel", int)):
            if key in data and (isinstance(data[key], bool) or not isinstance(data[key], types)):
                raise PlanError(f"{source}: field {key!r} has the wrong type ({type(data[key]).__name__})")
        tied = []
        for i, raw in enumerate(data.get("tied") or []):
            if not isinstance(raw, dict) or set(raw) - set(TiedParameter.__dataclass_fields__) or "name" not in raw:
                raise PlanError(f"{source}: tied[{i}] must be an object with name, stages and bytes")
            tied.append(TiedParameter(**raw))
        plan = cls(
            stages=stages,
            schedule=data.get("schedule", "pipedream"),
            batch_size=data.get("batch_size"),
            microbatches=data.get("microbatches", 1),
            topology=data.get("topology", ""),
            predicted=dict(data.get("predicted") or {}),
            meta=dict(data.get("meta") or {}),
            tied=tied,
            tensor_parallel=data.get("tensor_parallel", 1),
        )
        try:
            plan.validate()
        except PlanError as exc:
            raise PlanError(f"{source}: {exc}") from None
        return plan

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(read_json(path, PlanError), source=str(path))

    def table(self) -> str:
        """A human-readable table of the stages and a summary line (what `torchpipedream plan` prints)."""

        def ranks(rs: list[int]) -> str:
            if len(rs) > 1 and rs == list(range(rs[0], rs[-1] + 1)):
                return f"{rs[0]}-{rs[-1]}"
            return ",".join(map(str, rs))

        def mem(n: float) -> str:
            for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
                if n >= f:
                    return f"{n / f:.2f} {unit}"
            return f"{int(n)} B"

        rows = [("stage", "layers", "replicas", "ranks", "compute ms", "comm ms", "memory")]
        for s, st in enumerate(self.stages):
            span = st.layers[0] if len(st.layers) == 1 else f"{st.layers[0]}..{st.layers[-1]}"
            span += " recomputed" if st.recompute else ""
            rows.append((str(s), f"{span} ({len(st.layers)})", str(st.replicas) + (f" {st.sharding}" if st.sharded else ""),
                         ranks(st.ranks),
                         f"{st.compute_ms:.3f}", f"{st.comm_ms:.3f}", mem(st.memory_bytes)))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths)))
                 for r in rows]
        p = self.predicted
        summary = f"config {self.config} ({self.summary}), schedule {self.schedule}"
        t = p.get("time_per_minibatch_s")
        if t is not None:
            summary += f": {t * 1e3:.3f} ms per minibatch"
            if p.get("samples_per_s") is not None:
                summary += f", {p['samples_per_s']:.1f} samples/s"
            elif p.get("minibatches_per_s") is not None:
                summary += f", {p['minibatches_per_s']:.2f} minibatches/s"
        if p.get("speedup_over_data_parallel") is not None:
            summary += f", {p['speedup_over_data_parallel']:.2f}x over data parallel"
        if p.get("bottleneck"):
            summary += f"; bottleneck: {p['bottleneck']}"
        shared = [f"shared parameter {t.name} ({mem(t.bytes)}): a copy in stages {', '.join(map(str, t.stages))}"
                  f"{' (used by ' + ', '.join(t.layers) + ')' if t.layers else ''}, gradients summed once per update"
                  for t in self.tied]
        return "\n".join(lines + [summary] + shared)

    def same_layout(self, other: "Plan") -> bool:
        """Whether both plans put the same layers on the same ranks with the same replicas."""
        def shape(p: "Plan") -> list[Any]:
            return [[st.layers, st.replicas, st.ranks, st.sharding] for st in p.stages] + [p.tensor_parallel]

        return shape(self) == shape(other)

    def with_recompute(self, stages: bool | Iterable[int]) -> "Plan":
        """A copy of the plan with activation recomputation on every stage (``True``), on none
        (``False``) or on the stages listed."""
        n = self.num_stages
        if isinstance(stages, bool):
            chosen = set(range(n)) if stages else set()
        else:
            chosen = set()
            for s in stages:
                if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < n:
                    raise PlanError(f"recompute: {s!r} is not a stage of this plan (0..{n - 1})")
                chosen.add(s)
        plan = copy.deepcopy(self)
        for s, st in enumerate(plan.stages):
            st.recompute = s in chosen
            memory = plan.stage_memory_bytes(s)
            if memory is not None:
                st.memory_bytes = int(math.ceil(memory))
        if plan.stages and all(st.activations is not None for st in plan.stages):
            plan.predicted["peak_memory_bytes"] = max(st.memory_bytes for st in plan.stages)
        return plan

    def with_sharding(self, sharding: str) -> "Plan":
        """A copy of the plan whose replicated stages are ``sharding`` (``Stage.sharding``)."""
        stages = [replace(st, sharding=sharding) if st.replicas > 1 else st for st in self.stages]
        return replace(self, stages=stages)

    def with_tensor_parallel(self, degree: int) -> "Plan":
        """A copy of the plan whose every worker is ``degree`` tensor-parallel ranks."""
        plan = replace(self, tensor_parallel=degree)
        plan.validate()
        return plan

    def stage_memory_bytes(self, s: int, schedule: str | None = None, microbatches: int | None = None) -> float | None:
        """The memory model's peak for one worker of stage ``s`` under ``schedule`` and
        ``microbatches`` (the plan's own by default), with the stage's recomputation; None for
        a plan without the model's activation terms (written before they existed)."""
        st = self.stages[s]
        if st.activations is None:
            return None
        options = self.meta.get("planner", {}) if isinstance(self.meta, dict) else {}
        kind = schedule or self.schedule
        mu = microbatches or self.microbatches or options.get("microbatches") or 1
        f = options.get("optimizer_state_factor", 2.0)
        depth = -(-(self.num_workers - st.ranks[0]) // st.replicas)
        first = -(-(self.num_workers - self.stages[0].ranks[0]) // self.stages[0].replicas)
        depth = schedule_kind(kind).stage_inflight(depth, first, self.num_stages, st.replicas, mu)
        return model_memory_bytes(kind, self.held_parameter_bytes(s), st.activations, depth, mu, f, st.recompute,
                                  st.replicas, scratch_of_options(options), st.sharding, self.whole_shared_bytes(s))

    def whole_shared_bytes(self, s: int) -> int:
        """Bytes of the shared parameters stage ``s`` holds (``tied``): a sharded stage keeps
        them whole on every replica (runtime/sharding.py), so the memory model does not shard them."""
        return sum(t.bytes for t in self.tied if s in t.stages)

    def held_parameter_bytes(self, s: int) -> int:
        """Parameter bytes a worker of stage ``s`` holds: its own, and a copy of each shared
        parameter it holds but does not own (every holding stage but the first: planner.evaluate)."""
        return self.stages[s].parameter_bytes + sum(t.bytes for t in self.tied if s in t.stages[1:])

    @classmethod
    def looped(cls, layer_groups: list[list[str]], workers: int, schedule: str = "interleaved",
               **kwargs: Any) -> "Plan":
        """A plan of virtual stages: stage k (layer group k) on rank k mod ``workers``, each rank
        holding len(layer_groups) / workers of them (Megatron's interleaved placement)."""
        if workers < 1 or len(layer_groups) % workers:
            raise PlanError(f"{len(layer_groups)} stages do not divide evenly over {workers} workers")
        stages = [Stage(layers=list(g), replicas=1, ranks=[looped_rank(k, workers)])
                  for k, g in enumerate(layer_groups)]
        return cls(stages=stages, schedule=schedule, **kwargs)

    @classmethod
    def v_shape(cls, layer_groups: list[list[str]], workers: int, schedule: str = "zb-v", **kwargs: Any) -> "Plan":
        """A plan of 2 × ``workers`` virtual stages in a V: worker r holds stages r and 2p − 1 − r
        (the first worker the first and the last stage), as ZB-V places them."""
        if workers < 1 or len(layer_groups) != 2 * workers:
            raise PlanError(f"a V-shaped plan has two stages per worker: {2 * workers} layer groups for {workers} "
                            f"workers, got {len(layer_groups)}")
        stages = [Stage(layers=list(g), replicas=1, ranks=[v_shape_rank(k, workers)])
                  for k, g in enumerate(layer_groups)]
        return cls(stages=stages, schedule=schedule, **kwargs)

    @classmethod
    def straight(cls, layer_groups: list[list[str]], schedule: str = "pipedream", **kwargs: Any) -> "Plan":
        """A plan with one worker per stage, ranks 0..n-1 (costs unknown unless given)."""
        stages = [Stage(layers=list(g), replicas=1, ranks=[i]) for i, g in enumerate(layer_groups)]
        plan = cls(stages=stages, schedule=schedule, **kwargs)
        plan.validate()
        return plan
