"""What tensor parallelism does to a model's costs, for the planner and the simulator.

A tensor-parallel worker (``Plan.tensor_parallel`` t: t processes, runtime/tensor_parallel.py)
splits some layers and runs the rest whole on each process. The planner plans such workers by
planning an ordinary pipeline of the model as one of the t processes sees it
(:func:`tensor_parallel_graph`) on the topology whose innermost level's processes are grouped t
at a time (:func:`worker_topology`). The plan's stage times and memory are then a process's,
with the all-reduces of the split layers inside them, and the simulator prices the plan as it
prices any other (a worker's processes run its actions alike).

Which layers split, as the runtime splits them:

* a ``TransformerBlock`` of an analytic profile (model/analytic_profiles.py), or a measured
  Hugging Face ``GPT2Block`` (``train --model gpt2 --tensor-parallel`` profiles GPT-2 block by
  block: ``GPT2Logits.pipeline_units``): the whole block, Megatron's layout (attention heads and the MLP's hidden features split; 2 all-reduces of the
  block's output in its forward and 2 of its input gradient in its backward: Narayanan et al.
  2021, section 2.3);
* a pair of ``Linear`` layers of a measured profile with only element-wise layers between them
  (``runtime.tensor_parallel.linear_pairs``): 1 all-reduce of the second layer's output in the
  forward, 1 of the first layer's input gradient in the backward.

A split layer's compute, weights (and their gradients and optimizer state) and the activations
it keeps are 1/t of the whole (a pair's first layer keeps its whole input); its output counts
whole (a cut inside a pair is priced as if the pair still split: the runtime runs such a pair
whole, so the prediction is optimistic there); an all-reduce of b bytes among t processes over the innermost
link costs the ring formula (``sim.costs.ring_allreduce_s``, per microbatch). A transformer
block keeps 24 of its 34 activation terms per token split and 10 whole (Korthikanti et al. 2022,
"Reducing Activation Recomputation", tensor parallelism without sequence parallelism:
s·b·h·(10 + 24/t) + 5·a·s²·b/t). Not modelled: the output head and embedding split over the
vocabulary (Megatron does it; the runtime does not), sequence parallelism.
"""

from __future__ import annotations

import dataclasses
import math
import re

from ..model.graph import Layer, LayerGraph
from ..plans.plan import PlanError
from ..plans.topology import Level, Topology
from ..sim.costs import ring_allreduce_s

__all__ = ["split_layers", "tensor_parallel_graph", "worker_topology", "BLOCK_KIND", "BLOCK_KINDS"]

#: The kind of an analytic profile's transformer block (model/analytic_profiles.py).
BLOCK_KIND = "TransformerBlock"
#: Layer kinds split as whole transformer blocks: an analytic profile's, and a measured GPT-2 block
#: (its attention and MLP split by runtime.tensor_parallel.named_blocks).
BLOCK_KINDS = (BLOCK_KIND, "GPT2Block")
#: A block's activation terms per token that stay whole under tensor parallelism, of 34 (Korthikanti et al.).
_BLOCK_WHOLE_SHARE = 10 / 34
_LINEAR = re.compile(r"Linear\(in_features=(\d+), out_features=(\d+)")
_ELEMENTWISE = ("ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "LeakyReLU", "ELU", "Mish", "Hardswish", "Dropout",
                "Identity", "Softplus", "relu", "gelu", "silu", "tanh", "sigmoid", "dropout", "neg")


def _linear_width(layer: Layer) -> tuple[int, int] | None:
    """(in, out) features of a profiled ``nn.Linear`` layer, or None."""
    m = _LINEAR.match(layer.kind)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _elementwise(layer: Layer) -> bool:
    return layer.kind.startswith(_ELEMENTWISE) and layer.parameter_bytes == 0


def split_layers(graph: LayerGraph, degree: int) -> dict[str, tuple[int, int]]:
    """The layers a worker of ``degree`` processes splits: name -> (all-reduces of the forward,
    of the backward) the layer pays (a pair's forward all-reduce is its second layer's, its
    backward one its first layer's; the layers between them pay none)."""
    layers = {layer.name: layer for layer in graph.layers}
    successors: dict[str, list[str]] = {}
    predecessors: dict[str, list[str]] = {}
    for a, b in graph.edges:
        successors.setdefault(a, []).append(b)
        predecessors.setdefault(b, []).append(a)
    out: dict[str, tuple[int, int]] = {}
    for layer in graph.layers:
        if layer.kind in BLOCK_KINDS:
            out[layer.name] = (2, 2)
            continue
        width = _linear_width(layer)
        if width is None or width[1] % degree or layer.name in out:
            continue
        between, cur = [], layer.name
        while len(successors.get(cur, [])) == 1:
            nxt = successors[cur][0]
            if len(predecessors.get(nxt, [])) != 1:
                break
            if _linear_width(layers[nxt]) is not None:
                out[layer.name] = (0, 1)
                out.update({n: (0, 0) for n in between})
                out[nxt] = (1, 0)
                break
            if not _elementwise(layers[nxt]):
                break
            between.append(nxt)
            cur = nxt
    return out


def _allreduce_ms(nbytes: float, degree: int, topology: Topology, microbatches: int) -> float:
    """One all-reduce per microbatch of a minibatch's ``nbytes`` among a worker's ``degree``
    processes (the innermost link), over a minibatch: milliseconds."""
    bandwidth = topology.levels[0].bandwidth_Bps * topology.allreduce_efficiency
    return microbatches * ring_allreduce_s(nbytes / microbatches, degree, bandwidth, topology.latency_s) * 1e3


def _split_layer(layer: Layer, input_bytes: int, reduces: tuple[int, int], degree: int, topology: Topology,
                 microbatches: int) -> Layer:
    """``layer`` as one of ``degree`` processes runs it split (see the module docstring)."""
    forward_reduce = reduces[0] * _allreduce_ms(layer.activation_bytes, degree, topology, microbatches)
    backward_reduce = reduces[1] * _allreduce_ms(input_bytes, degree, topology, microbatches)
    if layer.kind in BLOCK_KINDS:
        kept = _BLOCK_WHOLE_SHARE + (1 - _BLOCK_WHOLE_SHARE) / degree
    else:  # a pair's first layer keeps its whole input; the others keep split activations
        kept = 1.0 if reduces == (0, 1) else 1 / degree

    def share(n: int | None, fraction: float) -> int | None:
        return None if n is None else int(math.ceil(n * fraction))

    return dataclasses.replace(
        layer,
        forward_ms=layer.forward_ms / degree + forward_reduce,
        backward_ms=layer.backward_ms / degree + backward_reduce,
        optimizer_ms=layer.optimizer_ms / degree,
        parameter_bytes=share(layer.parameter_bytes, 1 / degree),
        saved_bytes=share(layer.saved_bytes, kept),
        input_grad_ms=None if layer.input_grad_ms is None else layer.input_grad_ms / degree + backward_reduce,
        weight_grad_ms=None if layer.weight_grad_ms is None else layer.weight_grad_ms / degree,
    )


def tensor_parallel_graph(graph: LayerGraph, degree: int, topology: Topology, microbatches: int = 1) -> LayerGraph:
    """``graph`` as each of a worker's ``degree`` processes runs it: its split layers' compute,
    weights and kept activations 1/``degree``, their all-reduces over ``topology``'s innermost
    link added to their forward and backward times (``microbatches`` of them a minibatch).
    PlanError where nothing splits."""
    if degree == 1:
        return graph
    split = split_layers(graph, degree)
    if not split:
        raise PlanError(f"tensor_parallel {degree}: the model has no layer a tensor-parallel worker splits (a pair of "
                        f"Linear layers with only element-wise layers between them whose width {degree} divides, or "
                        "a transformer block)")
    produced = {layer.name: layer.activation_bytes for layer in graph.layers}
    inputs = {b: produced[a] for a, b in graph.edges}
    layers = [(_split_layer(layer, inputs.get(layer.name, 0), split[layer.name], degree, topology, microbatches)
               if layer.name in split else layer) for layer in graph.layers]
    return LayerGraph(layers, graph.edges, batch_size=graph.batch_size, meta=dict(graph.meta, tensor_parallel=degree),
                      tied=graph.tied, validate=False)


def worker_topology(topology: Topology, degree: int) -> Topology:
    """The topology of tensor-parallel workers of ``degree`` processes each: the innermost
    level's processes grouped ``degree`` at a time (a worker never spans the innermost link)."""
    inner = topology.levels[0]
    if inner.count % degree:
        raise PlanError(f"tensor_parallel {degree}: the topology's innermost level has {inner.count} processes, which "
                        f"do not make whole workers of {degree} (a worker's processes share the innermost link)")
    levels = [Level(inner.count // degree, inner.bandwidth_Bps, inner.name), *topology.levels[1:]]
    return Topology(levels, memory_bytes=topology.memory_bytes, latency_s=topology.latency_s, name=topology.name,
                    allreduce_efficiency=topology.allreduce_efficiency)
