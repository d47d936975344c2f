"""The layer graph: what the profiler measures and the planner plans over.

A :class:`LayerGraph` is a DAG of :class:`Layer` records. Each layer carries the numbers
PipeDream's optimizer needs: forward and backward compute time (ms, for one minibatch of
``batch_size`` samples), the bytes of its output activation (the gradient sent back is the
same size) and the bytes of its parameters.

The planner cuts a chain, so a DAG is linearised first (:meth:`LayerGraph.linearize`): a
topological order in which every prefix is closed under predecessors, so that every cut
between consecutive blocks is a valid stage boundary; the tensors that cross a cut are the
outputs of the prefix's layers that a later layer consumes (one *set* of tensors per cut,
PipeDream's antichain). See docs/architecture.md for how this differs from the original.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..util.jsonio import read_json, write_json

__all__ = ["SharedParameter", "Layer", "LayerGraph", "GraphError", "Block", "FORMAT_VERSION", "WORKING_FACTOR", "working_key"]


#: The backward's working memory in multiples of the largest (output + inputs) bytes of one of
#: the stage's layers per microbatch: the gradient arriving at a layer, the one it sends on, and
#: scratch (a convolution's backward allocates one more of that size). Chosen on the three
#: benchmark models (benchmarks/memory_model.py --models fc_heavy,small_cnn,transformer_lm);
#: judged on models it was not chosen on (the zoo rows of the same table).
WORKING_FACTOR = 1.5


def working_key(working_bytes: Any, released_bytes: Any) -> Any:
    """A layer's (or block's) backward working memory beyond what it holds, before subtracting
    what the later layers' backward freed: ``WORKING_FACTOR`` × (output + inputs) less its
    output if only later layers saved it (scalars or numpy arrays alike)."""
    return WORKING_FACTOR * working_bytes - released_bytes


FORMAT_VERSION = 1


class GraphError(ValueError):
    """A layer graph (or the file it came from) is malformed; the message says where."""


@dataclass
class Layer:
    """One node of the graph: a module call or operation.

    Times are milliseconds for one minibatch of the graph's ``batch_size``; sizes are bytes.
    ``is_input`` marks a data-loading node (PipeDream's ``Input``): its forward time is data
    loading, not compute, and the planner does not charge it to a stage. ``optimizer_ms`` is
    one optimizer step over the layer's parameters (once per update; 0 when not measured):
    on small stages it is as large as the backward, and a plan that ignores it mispredicts.
    ``input_grad_ms`` and ``weight_grad_ms`` are the two halves of the backward as a split
    backward runs them (B: the inputs' gradients, W: the weights'; model/split_backward.py),
    timed separately; their sum exceeds ``backward_ms`` by what splitting costs. None where
    not measured (profiles of older versions, PipeDream's files, the reference profiles).
    """

    name: str
    kind: str = ""
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    activation_bytes: int = 0
    parameter_bytes: int = 0
    output_shapes: list[list[int]] | None = None
    output_dtypes: list[str] | None = None
    is_input: bool = False
    stage_id: int | None = None
    optimizer_ms: float = 0.0
    saved_bytes: int | None = None
    saved_output_bytes: int | None = None
    released_bytes: int | None = None
    input_grad_ms: float | None = None
    weight_grad_ms: float | None = None

    @property
    def compute_ms(self) -> float:
        """Forward + backward + optimizer step time (zero for a data-loading input node)."""
        if self.is_input:
            return 0.0
        return self.forward_ms + self.backward_ms + self.optimizer_ms

    @property
    def stash_bytes(self) -> int:
        """Bytes this layer's forward leaves alive for the backward (``saved_bytes``: tensors
        it produced that autograd saved, by it or a later layer); 0 where not measured."""
        return self.saved_bytes or 0

    @property
    def unsaved_output_bytes(self) -> int:
        """Bytes of this layer's outputs that no backward saved (a stage ending here still
        holds them, to start its backward from); 0 where not measured."""
        if self.saved_output_bytes is None:
            return 0
        return max(0, self.activation_bytes - self.saved_output_bytes)

    @property
    def released(self) -> int:
        """Bytes of this layer's outputs that only later layers saved: their backward has freed
        them when this layer's runs (0 where the profile did not measure it)."""
        return self.released_bytes or 0


@dataclass
class Block:
    """A run of consecutive layers of a linearised graph, with the cut that follows it.

    ``cut_bytes`` is the total size of the tensors that cross from this block and everything
    before it to the layers after it (0 for the last block); ``cut_tensors`` names their
    producers. The memory model's terms (plans/memory.py): ``saved_bytes``, what the block's
    layers leave for the backward; ``unsaved_cut_bytes``, the part of the cut no layer saved;
    ``working_bytes``, the largest output + inputs of one of its layers, and ``released_bytes``
    what of that layer's output later layers' backward has freed by its own;
    ``largest_parameter_bytes``, the parameters of its largest layer; ``saves_measured``, whether
    the profile measured what its layers save (not PipeDream's files nor the reference profiles).
    ``input_grad_ms`` / ``weight_grad_ms``: its layers' split backward (:class:`Layer`), None
    unless every layer's was measured.
    """

    layers: list[str]
    forward_ms: float
    backward_ms: float
    parameter_bytes: int
    cut_bytes: int
    cut_tensors: list[str] = field(default_factory=list)
    optimizer_ms: float = 0.0
    saved_bytes: int = 0
    unsaved_cut_bytes: int = 0
    working_bytes: int = 0
    released_bytes: int = 0
    largest_parameter_bytes: int = 0
    saves_measured: bool = False
    input_grad_ms: float | None = None
    weight_grad_ms: float | None = None

    @property
    def compute_ms(self) -> float:
        """Forward + backward + optimizer step: the block's share of a stage's time per minibatch."""
        return self.forward_ms + self.backward_ms + self.optimizer_ms

    @classmethod
    def join(cls, run: Sequence["Block"]) -> "Block":
        """One block made of consecutive blocks ``run`` (the cut after the last one)."""
        return cls([n for b in run for n in b.layers], sum(b.forward_ms for b in run), sum(b.backward_ms for b in run),
                   sum(b.parameter_bytes for b in run), run[-1].cut_bytes, list(run[-1].cut_tensors),
                   sum(b.optimizer_ms for b in run), sum(b.saved_bytes for b in run), run[-1].unsaved_cut_bytes,
                   *max(((b.working_bytes, b.released_bytes) for b in run), key=lambda wr: working_key(*wr)),
                   max(b.largest_parameter_bytes for b in run), all(b.saves_measured for b in run),
                   measured_sum(b.input_grad_ms for b in run), measured_sum(b.weight_grad_ms for b in run))


def measured_sum(values: Iterable[float | None]) -> float | None:
    """The sum of measured times, or None when any of them was not measured."""
    total = 0.0
    for v in values:
        if v is None:
            return None
        total += v
    return total


@dataclass
class SharedParameter:
    """A parameter that several layers use (a tied input embedding and output layer): counted
    once, in the first of ``layers``; a plan that puts those layers in different stages gives
    each stage a copy (``plans.TiedParameter``)."""

    name: str
    layers: list[str]
    bytes: int = 0


def _check_number(value: Any, where: str, integer: bool = False) -> float:
    """Return ``value`` as a number, or raise a GraphError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraphError(f"{where}: expected a number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise GraphError(f"{where}: must be finite, got {value!r}")
    if value < 0:
        raise GraphError(f"{where}: must be >= 0, got {value!r}")
    if integer and float(value) != int(value):
        raise GraphError(f"{where}: must be a whole number of bytes, got {value!r}")
    return value


class LayerGraph:
    """A DAG of profiled layers.

    Args:
        layers: the nodes, in any order; names must be unique.
        edges: ``(producer, consumer)`` name pairs.
        batch_size: the minibatch size the numbers were measured with (None if unknown).
        meta: free-form provenance (model name, device, source file).
        tied: parameters that several layers use (:class:`SharedParameter`).
        validate: check the graph at once (default); raises :class:`GraphError`.
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        edges: Iterable[tuple[str, str]] = (),
        *,
        batch_size: int | None = None,
        meta: dict[str, Any] | None = None,
        tied: Sequence[SharedParameter] = (),
        validate: bool = True,
        source: str = "graph",
    ) -> None:
        self.layers: list[Layer] = list(layers)
        self.tied: list[SharedParameter] = list(tied)
        self.edges: list[tuple[str, str]] = [(str(a), str(b)) for a, b in edges]
        self.batch_size = batch_size
        self.meta: dict[str, Any] = dict(meta or {})
        self._by_name: dict[str, Layer] = {}
        self._topo: list[str] | None = None
        if validate:
            self.validate(source)
        else:
            self._by_name = {layer.name: layer for layer in self.layers}

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __getitem__(self, name: str) -> Layer:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def predecessors(self, name: str) -> list[str]:
        return [a for a, b in self.edges if b == name]

    @property
    def is_chain(self) -> bool:
        """True when the graph is one straight line of layers."""
        order = self.topological_order()
        return set(self.edges) == set(zip(order, order[1:])) and len(self.edges) == len(order) - 1

    def totals(self) -> dict[str, float]:
        """Summed compute (ms, input node excluded), forward/backward, parameter and activation bytes."""
        return {
            "layers": len(self.layers),
            "forward_ms": sum(l.forward_ms for l in self.layers if not l.is_input),
            "backward_ms": sum(l.backward_ms for l in self.layers if not l.is_input),
            "optimizer_ms": sum(l.optimizer_ms for l in self.layers if not l.is_input),
            "compute_ms": sum(l.compute_ms for l in self.layers),
            "parameter_bytes": sum(l.parameter_bytes for l in self.layers),
            "activation_bytes": sum(l.activation_bytes for l in self.layers),
        }

    # -------------------------------------------------------------- validation
    def validate(self, source: str = "graph") -> None:
        """Check names, numbers, edges and acyclicity; raise one clear GraphError."""
        if not self.layers:
            raise GraphError(f"{source}: the graph has no layers")
        by_name: dict[str, Layer] = {}
        for i, layer in enumerate(self.layers):
            where = f"{source}: layer {i} ({layer.name!r})"
            if not isinstance(layer.name, str) or not layer.name:
                raise GraphError(f"{source}: layer {i}: 'name' must be a non-empty string")
            if layer.name in by_name:
                raise GraphError(f"{where}: duplicate layer name")
            for attr in ("forward_ms", "backward_ms", "optimizer_ms"):
                _check_number(getattr(layer, attr), f"{where}: field {attr!r}")
            for attr in ("input_grad_ms", "weight_grad_ms"):
                if getattr(layer, attr) is not None:
                    _check_number(getattr(layer, attr), f"{where}: field {attr!r}")
            for attr in ("activation_bytes", "parameter_bytes"):
                _check_number(getattr(layer, attr), f"{where}: field {attr!r}", integer=True)
                setattr(layer, attr, int(getattr(layer, attr)))
            by_name[layer.name] = layer
        seen_edges: set[tuple[str, str]] = set()
        for j, (a, b) in enumerate(self.edges):
            for end in (a, b):
                if end not in by_name:
                    raise GraphError(
                        f"{source}: edge {j} ({a!r} -> {b!r}) names a layer that does not exist: {end!r}"
                    )
            if a == b:
                raise GraphError(f"{source}: edge {j} ({a!r} -> {b!r}) is a self-loop (a cycle)")
            seen_edges.add((a, b))
        self.edges = list(dict.fromkeys(self.edges))  # drop exact duplicates, keep order
        for i, t in enumerate(self.tied):
            if (not isinstance(t, SharedParameter) or not isinstance(t.layers, list) or len(t.layers) < 2
                    or any(name not in by_name for name in t.layers)):
                raise GraphError(f"{source}: tied[{i}] must name a parameter and two or more of the graph's layers")
            _check_number(t.bytes, f"{source}: tied[{i}] ({t.name!r}): field 'bytes'", integer=True)
        self._by_name = by_name
        self._topo = None
        self.topological_order(source)  # raises on a cycle

    # ----------------------------------------------------------- orderings
    def topological_order(self, source: str = "graph") -> list[str]:
        """Layer names so that every edge goes forward.

        Among ready layers it prefers the one that became ready most recently (depth first),
        so parallel branches (Inception, skip paths) are kept together and the tensors that
        cross a cut stay few; ties keep the layers' given order. Deterministic.
        """
        if self._topo is not None:
            return list(self._topo)
        index = {layer.name: i for i, layer in enumerate(self.layers)}
        indeg = {name: 0 for name in index}
        succ: dict[str, list[str]] = {name: [] for name in index}
        for a, b in self.edges:
            indeg[b] += 1
            succ[a].append(b)
        # heap of (-time_became_ready, given index, name): latest-ready first; the model's
        # inputs before anything (the first stage reads them all, targets included).
        inputs = {layer.name for layer in self.layers if layer.is_input}
        heap = [(-math.inf if n in inputs else 0, index[n], n) for n in index if indeg[n] == 0]
        heapq.heapify(heap)
        clock = 0
        order: list[str] = []
        while heap:
            _, _, name = heapq.heappop(heap)
            order.append(name)
            clock += 1
            for nxt in sorted(succ[name], key=index.__getitem__):
                indeg[nxt] -= 1
                if indeg[nxt] == 0:
                    heapq.heappush(heap, (-clock, index[nxt], nxt))
        if len(order) != len(index):
            stuck = sorted((n for n, d in indeg.items() if d > 0), key=index.__getitem__)
            raise GraphError(
                f"{source}: the edges form a cycle through layer(s) {', '.join(stuck[:8])}"
                + (" ..." if len(stuck) > 8 else "")
            )
        self._topo = order
        return list(order)

    def linearize(self, merge_free_cuts: bool = True) -> list[Block]:
        """Linearise the DAG into a chain of blocks the planner may cut between.

        Every prefix of the topological order is closed under predecessors, so a cut after any
        position is a valid stage boundary. The tensors crossing the cut after position i are
        the outputs of layers at or before i consumed after i; their summed ``activation_bytes``
        is what the stage boundary transfers (PipeDream's antichain at that cut).

        With ``merge_free_cuts`` a layer with no compute and no parameters is merged into the
        block before it, and free layers at the start (the inputs) into the first real block:
        a cut after a reshape or a view is never better than before it, and a stage holding
        only the data input would be a worker with nothing to do. This
        keeps imported profiles small without changing any optimum.
        """
        order = self.topological_order()
        pos = {name: i for i, name in enumerate(order)}
        last_use: dict[str, int] = {}
        inputs: dict[str, int] = {}  # bytes of the activations each layer reads
        for a, b in self.edges:
            last_use[a] = max(last_use.get(a, -1), pos[b])
            inputs[b] = inputs.get(b, 0) + self._by_name[a].activation_bytes
        # live[i]: producers at or before i whose output is consumed after i.
        blocks: list[Block] = []
        leading: list[str] = []
        open_producers: dict[str, int] = {}
        for i, name in enumerate(order):
            layer = self._by_name[name]
            if name in last_use and last_use[name] > i:
                open_producers[name] = last_use[name]
            for producer in [p for p, last in open_producers.items() if last <= i]:
                del open_producers[producer]
            crossing = sorted(open_producers, key=pos.__getitem__)
            cut_bytes = sum(self._by_name[p].activation_bytes for p in crossing)
            unsaved = sum(self._by_name[p].unsaved_output_bytes for p in crossing)
            fwd = 0.0 if layer.is_input else layer.forward_ms
            bwd = 0.0 if layer.is_input else layer.backward_ms
            opt = 0.0 if layer.is_input else layer.optimizer_ms
            free = merge_free_cuts and fwd == 0.0 and bwd == 0.0 and opt == 0.0 and layer.parameter_bytes == 0
            working = 0 if layer.is_input else layer.activation_bytes + inputs.get(name, 0)
            if free and not blocks:
                leading.append(name)  # inputs and shape arithmetic before any real layer
            elif free:
                prev = blocks[-1]
                prev.layers.append(name)
                prev.cut_bytes = cut_bytes
                prev.cut_tensors = crossing
                prev.saved_bytes += layer.stash_bytes
                prev.unsaved_cut_bytes = unsaved
                if working_key(working, layer.released) > working_key(prev.working_bytes, prev.released_bytes):
                    prev.working_bytes, prev.released_bytes = working, layer.released
                prev.saves_measured = prev.saves_measured and layer.saved_bytes is not None
                if not layer.is_input:
                    prev.input_grad_ms = measured_sum([prev.input_grad_ms, layer.input_grad_ms])
                    prev.weight_grad_ms = measured_sum([prev.weight_grad_ms, layer.weight_grad_ms])
            else:
                saved = sum(self._by_name[n].stash_bytes for n in leading) + layer.stash_bytes
                measured = all(self._by_name[n].saved_bytes is not None for n in leading + [name])
                split = [self._by_name[n] for n in leading + [name] if not self._by_name[n].is_input]
                blocks.append(Block(leading + [name], fwd, bwd, layer.parameter_bytes, cut_bytes, crossing, opt,
                                    saved, unsaved, working, layer.released, layer.parameter_bytes, measured,
                                    measured_sum(l.input_grad_ms for l in split),
                                    measured_sum(l.weight_grad_ms for l in split)))
                leading = []
        if leading:  # a graph of free layers only
            blocks.append(Block(leading, 0.0, 0.0, 0, 0, [], 0.0, sum(self._by_name[n].stash_bytes for n in leading)))
        return blocks

    # -------------------------------------------------------------- JSON I/O
    def to_dict(self) -> dict[str, Any]:
        layers = []
        for layer in self.layers:
            d = asdict(layer)
            for key in ("output_shapes", "output_dtypes", "stage_id", "saved_bytes", "saved_output_bytes",
                        "released_bytes", "input_grad_ms", "weight_grad_ms"):
                if d[key] is None:
                    del d[key]
            if not d["is_input"]:
                del d["is_input"]
            if not d["optimizer_ms"]:
                del d["optimizer_ms"]  # unmeasured: keep files of older versions identical
            layers.append(d)
        return {
            "format": "torchpipedream.LayerGraph",
            "format_version": FORMAT_VERSION,
            "batch_size": self.batch_size,
            "meta": self.meta,
            "layers": layers,
            "edges": [list(e) for e in self.edges],
            **({"tied": [asdict(t) for t in self.tied]} if self.tied else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "graph") -> "LayerGraph":
        """Build a graph from its JSON dictionary; every problem raises a GraphError naming the field."""
        if not isinstance(data, dict):
            raise GraphError(f"{source}: expected a JSON object at the top level")
        version = data.get("format_version")
        if version is None:
            raise GraphError(f"{source}: missing field 'format_version'")
        if version != FORMAT_VERSION:
            raise GraphError(
                f"{source}: format_version {version!r} is not supported (this version reads {FORMAT_VERSION})"
            )
        raw_layers = data.get("layers")
        if not isinstance(raw_layers, list):
            raise GraphError(f"{source}: field 'layers' must be a list")
        known = {f for f in Layer.__dataclass_fields__}
        layers = []
        for i, raw in enumerate(raw_layers):
            if not isinstance(raw, dict):
                raise GraphError(f"{source}: layers[{i}] must be an object")
            unknown = set(raw) - known
            if unknown:
                raise GraphError(f"{source}: layers[{i}]: unknown field(s) {sorted(unknown)}")
            if "name" not in raw:
                raise GraphError(f"{source}: layers[{i}]: missing field 'name'")
            layers.append(Layer(**raw))
        raw_edges = data.get("edges", [])
        if not isinstance(raw_edges, list):
            raise GraphError(f"{source}: field 'edges' must be a list")
        edges = []
        for j, e in enumerate(raw_edges):
            if not (isinstance(e, (list, tuple)) and len(e) == 2):
                raise GraphError(f"{source}: edges[{j}] must be a [producer, consumer] pair, got {e!r}")
            edges.append((str(e[0]), str(e[1])))
        batch_size = data.get("batch_size")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size <= 0):
            raise GraphError(f"{source}: field 'batch_size' must be a positive integer or null")
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            raise GraphError(f"{source}: field 'meta' must be an object")
        raw_tied = data.get("tied", [])
        if not isinstance(raw_tied, list):
            raise GraphError(f"{source}: field 'tied' must be a list")
        tied = []
        for i, t in enumerate(raw_tied):
            if not isinstance(t, dict) or set(t) != {"name", "layers", "bytes"}:
                raise GraphError(f"{source}: tied[{i}] must be an object with name, layers and bytes")
            tied.append(SharedParameter(**t))
        return cls(layers, edges, batch_size=batch_size, meta=meta, tied=tied, source=source)

    def save(self, path: str | Path) -> None:
        """Write the graph as JSON (lossless: :meth:`load` gives an equal graph)."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "LayerGraph":
        """Read a graph saved by :meth:`save` (JSON). For PipeDream's ``graph.txt`` files and
        the bundled reference profiles, see :func:`torchpipedream.model.profiles.load_profile`."""
        return cls.from_dict(read_json(path, GraphError), source=str(path))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayerGraph) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        t = self.totals()
        return (
            f"LayerGraph({len(self)} layers, {len(self.edges)} edges, "
            f"{t['compute_ms']:.3f} ms compute, {t['parameter_bytes']} parameter bytes)"
        )
