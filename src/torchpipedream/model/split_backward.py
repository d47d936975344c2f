"""Split one backward pass into B (input gradients, now) and W (weight gradients, later).

Zero-bubble pipeline schedules send a stage's input gradients upstream as soon as possible and
compute its weight gradients later, in what would otherwise be an idle slot. Together B and W must
accumulate exactly what ``torch.autograd.backward(roots, grad_outputs, inputs=params + inputs)``
accumulates, without computing any product twice.

Method
------
Let *I* be the nodes of the autograd graph from which the gradient edge of some stage input is
reachable (the input-gradient path). Nodes outside *I* can only reach nodes outside *I*.

* **B** runs ``torch.autograd.backward(roots, grad_outputs, inputs=inputs, retain_graph=True)``.
  The engine then executes only the nodes of *I*, and every one of them computes only the outputs
  whose edges lead into *I* (``AddmmBackward`` of a Linear computes ``grad @ W`` but neither
  ``x.T @ grad`` nor the bias sum). A *boundary node* is a node of *I* with an edge to a node
  outside *I* from which a parameter is reachable; a pre-hook on each boundary node records the
  gradient flowing into it (its ``grad_outputs``: the same value the full backward would feed it).
* **W** restarts the engine at the boundary nodes, with the recorded gradients as the gradients of
  their ``GradientEdge``s, plus the roots that are not in *I* (their own ``grad_outputs``; with
  no stage inputs that is the whole backward), and ``inputs`` restricted to parameters. A
  parameter reachable from several sources (a shared weight, a Linear applied twice) is grouped
  with all of them (union-find), so its gradient is summed once, as in the full backward. Groups
  are run together in one engine call when no source of the call can reach a parameter of the
  call *through* *I* -- otherwise the engine would re-run the input-gradient chain between them
  (a chain of Linear layers therefore takes one W call per layer).

  When a weight is used both before and after another boundary node of the input path (weight
  sharing across the chain), its group must be run alone and the engine does follow *I* between
  the uses: there every boundary node of the group gets its recorded gradient back from its
  pre-hook (whatever the re-run fed it), every other node of *I* gets undefined gradients (so it
  computes nothing), and nothing is counted twice -- but the input-gradient products of the
  group's boundary nodes that lead to the later uses are computed again (and discarded).

The pre-hooks of the boundary nodes stay registered until W and always hand a node its recorded
gradient in W, so tensor hooks on intermediate tensors (which run again when their node re-runs)
cannot change the result. ``WeightGradients.run`` removes them and drops every reference to the
graph, so the saved activations are freed once the caller has let go of the outputs too.

Cost: B is one engine call plus one Python walk of the graph (about 1 us per node, hooks
included). W is one engine call per set of groups that can run together -- one per Linear in a
chain -- and the engine starts every call by walking all the nodes below its start nodes (to
count dependencies), so W's bookkeeping grows with depth x nodes: about 0.2 us per node walked,
negligible for a few layers per stage, some milliseconds for dozens of transformer blocks.

Limits:

* A custom ``autograd.Function`` does not know which of its outputs B needs
  (``ctx.needs_input_grad`` is fixed at forward), so at a boundary it computes its weight gradients
  in B (discarded) and its input gradients again in W (discarded); results are still exact.
* A non-reentrant activation-checkpoint region is recomputed once for B and once more for W
  (``torch.utils.checkpoint.GraphExecGroup``, where torch has it, lets all W calls share one
  recomputation). A *selective* checkpoint region that saves some ops (``context_fn=``
  ``create_selective_checkpoint_contexts(...)``) cannot be recomputed a second time: W raises
  ``NotImplementedError`` (this cannot be seen before W with public APIs). A reentrant checkpoint
  refuses ``backward(inputs=...)``, so the unsplit backward cannot run it either.
* ``grad_outputs`` (and the tensors they alias) must not be modified in place before W: the
  gradients recorded at the boundary nodes may be those very tensors.
* Post-hooks of boundary nodes run again in W (on the weight gradients only), and so does the
  ``retain_grad()`` of a tensor a boundary node produced, whose ``.grad`` then gets its gradient
  a second time; the stage inputs' ``.grad`` are protected from that.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils import checkpoint as _checkpoint

__all__ = ["backward_inputs", "WeightGradients"]

logger = logging.getLogger(__name__)

_MERGE_WINDOW = 8  # W calls a new parameter group may join (see backward_inputs)


class _Hooks:
    """What the pre-hooks of the boundary nodes share: B records, W replays."""

    __slots__ = ("capturing", "active", "captured", "call_of")

    def __init__(self, n: int) -> None:
        self.capturing = True
        self.active = -1  # the W call being run
        self.captured: list[tuple[torch.Tensor | None, ...] | None] = [None] * n
        self.call_of: list[int] = [-1] * n  # boundary node -> its W call


def _boundary_hook(state: _Hooks, k: int) -> Any:
    def hook(grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...] | None:
        if state.capturing:
            state.captured[k] = grads
            return None
        if state.active < 0:  # outside W (a dropped WeightGradients): leave the node alone
            return None
        if state.call_of[k] == state.active:
            return state.captured[k]  # its B gradient, whatever this run fed it
        return (None,) * len(grads)  # a re-run through I outside its call: contributes nothing
    return hook


def _skip_hook(grads: tuple[torch.Tensor | None, ...]) -> tuple[None, ...]:
    """Node of I re-run by a W call: undefined gradients, so it computes and passes on nothing."""
    return (None,) * len(grads)


class _Call:
    """One W engine call: boundary nodes and roots to start from, parameters to accumulate into."""

    __slots__ = ("boundary", "roots", "root_grads", "mask", "below", "params", "skip")

    def __init__(self) -> None:
        self.boundary: list[int] = []  # indices into the boundary nodes
        self.roots: list[GradientEdge] = []
        self.root_grads: list[torch.Tensor] = []
        self.mask = 0  # parameters (bits) it accumulates into
        self.below = 0  # parameters reachable from its boundary nodes through I
        self.params: list[torch.Tensor] = []
        self.skip: list[Node] = []  # nodes of I it may re-run (only when below & mask)

    @property
    def reruns_i(self) -> bool:
        """Whether the engine follows I from one of its sources to its own parameters."""
        return bool(self.below & self.mask)


class WeightGradients:
    """The W half of a split backward, returned by :func:`backward_inputs`; call :meth:`run` once."""

    __slots__ = ("_calls", "_nodes", "_hooks", "_handles", "_keep", "_nonleaf_inputs", "_done")

    def __init__(self, calls: list[_Call], nodes: list[Node], hooks: _Hooks | None,
                 handles: list[Any], keep: list[Any], nonleaf_inputs: list[torch.Tensor]) -> None:
        self._calls = calls
        self._nodes = nodes  # boundary nodes
        self._hooks = hooks
        self._handles = handles
        self._keep = keep  # keeps the graph alive (roots' edges and their ownership tokens)
        self._nonleaf_inputs = nonleaf_inputs
        self._done = False

    def run(self) -> None:
        """W: accumulate into each param's ``.grad`` what the full backward would have, then
        drop every reference to the graph (so its saved activations can be freed)."""
        if self._done:
            raise RuntimeError("WeightGradients.run() was already called")
        self._done = True
        try:
            saved = [(t, t.grad) for t in self._nonleaf_inputs]
            calls, state = self._calls, self._hooks
            if state is not None:
                state.capturing = False
            alone = [i for i, c in enumerate(calls) if c.reruns_i]
            together = [i for i, c in enumerate(calls) if not c.reruns_i]
            last = (alone or together or [-1])[-1]  # may let the engine free what it runs
            with _one_recomputation():
                for i in together:
                    self._run_call(i, i == last)
            for i in alone:  # runs nodes that other calls run too: outside the group
                self._run_call(i, i == last)
            for t, g in saved:  # a non-leaf input's grad_fn re-run in W adds to its .grad again
                t.grad = g
        finally:
            self._release()

    def _run_call(self, i: int, last: bool) -> None:
        call = self._calls[i]
        state = self._hooks
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        if call.boundary:
            assert state is not None
            nodes, captured = self._nodes, state.captured
            for k in call.boundary:
                cap = captured[k]
                if cap is None:
                    continue
                node = nodes[k]
                for nr, g in enumerate(cap):
                    if g is not None:
                        edges.append(GradientEdge(node, nr))
                        grads.append(g)
        edges += call.roots
        grads += call.root_grads
        if not edges:
            return
        handles = [n.register_prehook(_skip_hook) for n in call.skip]
        if state is not None:
            state.active = i
        try:
            torch.autograd.backward(edges, grad_tensors=grads, inputs=call.params, retain_graph=not last)
        except RuntimeError as e:
            if "selective activation checkpoint" in str(e):
                raise NotImplementedError(
                    "split backward: W cannot recompute a selective activation checkpoint region "
                    "(checkpoint(..., context_fn=create_selective_checkpoint_contexts(...)) that saves "
                    "some ops): B's recomputation consumed its saved activations, and this "
                    "microbatch's weight gradients are incomplete. Use a plain non-reentrant "
                    "checkpoint there, or run this stage's backward unsplit.") from e
            raise
        finally:
            if state is not None:
                state.active = -1
            for h in handles:
                h.remove()

    def __del__(self) -> None:
        if not self._done:  # dropped without running: take the pre-hooks off the graph
            self._release()

    def _release(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._hooks is not None:
            self._hooks.captured = []
        self._hooks = None
        self._calls = []
        self._nodes = []
        self._keep = []
        self._nonleaf_inputs = []


@contextlib.contextmanager
def _one_recomputation() -> Iterator[None]:
    """Let the W calls share one recomputation of each non-reentrant checkpoint region.

    ``GraphExecGroup`` (torch >= 2.9) is a no-op without checkpoint regions; W calls run disjoint
    parts of the graph, which it requires. Without it (or inside a caller's group) every call
    recomputes the regions it touches, which is slower but gives the same result.
    """
    group_cls = getattr(_checkpoint, "GraphExecGroup", None)
    if group_cls is None:
        yield
        return
    group = group_cls()
    try:
        group.__enter__()
    except RuntimeError:  # nested in the caller's group
        yield
        return
    try:
        yield
    finally:
        group.__exit__(None, None, None)


def _root_grads(roots: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None] | None
                ) -> list[torch.Tensor]:
    """The gradient of each root (ones for a scalar root without one, as autograd does)."""
    if grad_outputs is None:
        grad_outputs = [None] * len(roots)
    if len(grad_outputs) != len(roots):
        raise ValueError(f"{len(grad_outputs)} grad_outputs for {len(roots)} roots")
    out = []
    for i, (r, g) in enumerate(zip(roots, grad_outputs)):
        if not r.requires_grad:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have a grad_fn")
        if g is None:
            if r.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = torch.ones_like(r, memory_format=torch.preserve_format)
        out.append(g)
    return out


def _walk(starts: Sequence[Node]) -> tuple[list[Node], dict[Node, int], list[list[int]], list[int]]:
    """Nodes reachable from ``starts``: the nodes, their indices, each one's children (indices),
    and a postorder (children before parents), by one iterative depth-first walk."""
    index: dict[Node, int] = {}
    nodes: list[Node] = []
    kids: list[list[int]] = []
    order: list[int] = []
    for start in starts:
        if start in index:
            continue
        index[start] = len(nodes)
        nodes.append(start)
        kids.append([])
        stack = [(len(nodes) - 1, iter(start.next_functions))]
        while stack:
            i, it = stack[-1]
            ch = kids[i]
            for child, _ in it:
                if child is None:
                    continue
                j = index.get(child)
                if j is None:
                    j = len(nodes)
                    index[child] = j
                    nodes.append(child)
                    kids.append([])
                    ch.append(j)
                    stack.append((j, iter(child.next_functions)))
                    break
                ch.append(j)
            else:
                stack.pop()
                order.append(i)
    return nodes, index, kids, order


def backward_inputs(roots: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None] | None,
                    inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> WeightGradients:
    """B: accumulate d(roots)/d(inputs) (weighted by ``grad_outputs``, as
    ``torch.autograd.backward`` does) into each input's ``.grad``, and return the W half, whose
    :meth:`WeightGradients.run` accumulates the params' gradients later.

    ``params`` must be leaf tensors requiring grad; ``inputs`` tensors requiring grad (leaves, as
    received activations are). ``roots`` may be one scalar loss with ``grad_outputs`` None.
    """
    roots = list(roots)
    inputs = list(inputs)
    params = list({id(p): p for p in params}.values())
    _check_differentiated(inputs, params)
    if not roots or not (params or inputs):
        return WeightGradients([], [], None, [], [], [])
    grads = _root_grads(roots, grad_outputs)
    root_edges = [get_gradient_edge(r) for r in roots]

    if not inputs:  # first stage: B has nothing to do, W is the whole backward
        call = _Call()
        call.roots, call.root_grads, call.params = root_edges, grads, params
        return WeightGradients([call], [], None, [], [], [])
    if not params:  # nothing for W
        torch.autograd.backward(roots, grad_tensors=grads, inputs=inputs)
        return WeightGradients([], [], None, [], [], [])

    path = _input_path(root_edges, inputs, params)
    groups = _group_sources(path, _sources(path, root_edges, grads), len(params))
    calls = _merge_groups(groups)
    _assign_parameters(calls, path, params)
    return _run_input_gradients(path, calls, roots, grads, inputs, root_edges)


def _check_differentiated(inputs: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    """Refuse what ``torch.autograd.backward`` would, and params that are not leaves or are inputs too."""
    for t in params + inputs:
        if not t.requires_grad:
            raise RuntimeError("One of the differentiated Tensors does not require grad")
    for p in params:
        if p.grad_fn is not None:
            raise ValueError("backward_inputs: params must be leaf tensors")
    if {id(p) for p in params} & {id(t) for t in inputs}:
        raise ValueError("backward_inputs: a tensor is both a param and an input")


@dataclass
class _InputPath:
    """The graph below the roots, split by the input-gradient path I (module docstring)."""

    nodes: list[Node]
    node_index: dict[Node, int]
    in_i: list[bool]  # per node: on I
    reach: list[int]  # per node: the parameters (bits) it reaches
    boundary: list[int] = field(default_factory=list)  # nodes of I with an edge out of I to a parameter
    wmask: list[int] = field(default_factory=list)  # per boundary node: parameters it reaches outside I
    below: list[int] = field(default_factory=list)  # per boundary node: parameters it reaches through I
    nonleaf_inputs: list[torch.Tensor] = field(default_factory=list)


def _input_path(root_edges: list[GradientEdge], inputs: list[torch.Tensor],
                params: list[torch.Tensor]) -> _InputPath:
    """One walk of the graph, then one pass in postorder (children first): I, the parameters
    (bits) each node reaches, and the boundary nodes."""
    nodes, node_index, kids, order = _walk([e.node for e in root_edges])
    n = len(nodes)
    param_bit = {id(p): 1 << i for i, p in enumerate(params)}
    leaf_inputs = {id(t) for t in inputs if t.grad_fn is None}
    nonleaf_inputs = [t for t in inputs if t.grad_fn is not None]
    target = [False] * n
    if nonleaf_inputs:
        for t in nonleaf_inputs:
            i = node_index.get(t.grad_fn)
            if i is not None:
                target[i] = True
    path = _InputPath(nodes, node_index, [False] * n, [0] * n, nonleaf_inputs=nonleaf_inputs)
    in_i, reach = path.in_i, path.reach
    for i in order:
        ch = kids[i]
        if not ch:
            var = getattr(nodes[i], "variable", None)  # an AccumulateGrad node
            if var is not None:
                reach[i] = param_bit.get(id(var), 0)
                in_i[i] = target[i] or id(var) in leaf_inputs
            else:
                in_i[i] = target[i]
            continue
        r, ini, w, b = 0, target[i], 0, 0
        for j in ch:
            rj = reach[j]
            r |= rj
            if in_i[j]:
                ini = True
                b |= rj
            else:
                w |= rj
        reach[i] = r
        in_i[i] = ini
        if ini and w:
            path.boundary.append(i)
            path.wmask.append(w)
            path.below.append(b)
    return path


@dataclass
class _Sources:
    """The sources of W: the boundary nodes, then the roots outside I that reach a parameter;
    per source, the parameters (bits) it reaches outside I and through I."""

    masks: list[int]
    below: list[int]
    roots: list[tuple[GradientEdge, torch.Tensor]]  # the roots among them, with their gradients


def _sources(path: _InputPath, root_edges: list[GradientEdge], grads: list[torch.Tensor]) -> _Sources:
    src = _Sources(list(path.wmask), list(path.below), [])
    for e, g in zip(root_edges, grads):
        i = path.node_index[e.node]
        if not path.in_i[i] and path.reach[i]:
            src.roots.append((e, g))
            src.masks.append(path.reach[i])
            src.below.append(0)
    return src


def _group_sources(path: _InputPath, src: _Sources, n_params: int) -> list[_Call]:
    """The sources grouped by the parameters they share (union-find over parameter bits): one
    W call per group, in the order of each group's first source."""
    parent = list(range(n_params))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for m in src.masks:
        low = m & -m
        first = find(low.bit_length() - 1)
        m ^= low
        while m:
            low = m & -m
            other = find(low.bit_length() - 1)
            if other != first:
                parent[other] = first
            m ^= low
    groups: dict[int, _Call] = {}
    src_group: list[_Call] = []
    for m, b in zip(src.masks, src.below):
        g = find((m & -m).bit_length() - 1)
        call = groups.get(g)
        if call is None:
            call = groups[g] = _Call()
        call.mask |= m
        call.below |= b
        src_group.append(call)
    n_boundary = len(path.boundary)
    for k, call in enumerate(src_group[:n_boundary]):
        call.boundary.append(k)
    for (e, g), call in zip(src.roots, src_group[n_boundary:]):
        call.roots.append(e)
        call.root_grads.append(g)
    return list(groups.values())


def _merge_groups(groups: list[_Call]) -> list[_Call]:
    """Merge groups into few engine calls: a call must not reach its own parameters through I
    (else the engine re-runs the input-gradient chain). Groups that do (weight sharing along
    it) run alone. Siblings (q/k/v projections) are close in postorder: only the last few
    calls are tried, which keeps this linear in the number of groups."""
    calls: list[_Call] = []
    for grp in groups:
        if grp.below & grp.mask:
            calls.append(grp)
            continue
        for call in calls[-_MERGE_WINDOW:]:
            if not (call.below & call.mask) and not (call.below & grp.mask) and not (grp.below & call.mask):
                call.mask |= grp.mask
                call.below |= grp.below
                call.boundary += grp.boundary
                call.roots += grp.roots
                call.root_grads += grp.root_grads
                break
        else:
            calls.append(grp)
    return calls


def _assign_parameters(calls: list[_Call], path: _InputPath, params: list[torch.Tensor]) -> None:
    """Each call's parameters (from its bits) and, for a call that re-runs I, the nodes of I
    it must skip."""
    boundary_set = set(path.boundary)
    for call in calls:
        m = call.mask
        while m:
            low = m & -m
            call.params.append(params[low.bit_length() - 1])
            m ^= low
        if call.reruns_i:
            call.skip = [path.nodes[i] for i in range(len(path.nodes)) if path.in_i[i] and path.reach[i] & call.mask
                         and i not in boundary_set]
            logger.debug("split backward: %d parameter(s) shared along the input path; their W "
                         "re-runs part of the input-gradient chain", bin(call.mask).count("1"))


def _run_input_gradients(path: _InputPath, calls: list[_Call], roots: list[torch.Tensor],
                         grads: list[torch.Tensor], inputs: list[torch.Tensor],
                         root_edges: list[GradientEdge]) -> WeightGradients:
    """B, recording the gradient into each boundary node; the W half that replays them."""
    state = _Hooks(len(path.boundary))
    bnodes = [path.nodes[i] for i in path.boundary]
    for c, call in enumerate(calls):
        for k in call.boundary:
            state.call_of[k] = c
    handles = [node.register_prehook(_boundary_hook(state, k)) for k, node in enumerate(bnodes)]
    try:
        if any(path.in_i[i] for i in (path.node_index[e.node] for e in root_edges)):
            torch.autograd.backward(roots, grad_tensors=grads, inputs=inputs, retain_graph=True)
    except BaseException:
        for h in handles:
            h.remove()
        raise
    state.capturing = False
    return WeightGradients(calls, bnodes, state, handles, root_edges, path.nonleaf_inputs)
