"""Cut a model into pipeline stages: one ``nn.Module`` per stage of a :class:`~torchpipedream.plans.Plan`.

Three ways in, one contract out. Every stage module is called with the tensors that cross
into it as positional arguments (stage 0: the model's own inputs) and returns

* a tuple of tensors for every stage but the last (what the next stage receives), and
* the model's output for the last stage.

1. A traceable module (``torch.fx.symbolic_trace``): the plan's layer names are fx node names
   (what :mod:`torchpipedream.profiler` records). Each stage becomes a ``GraphModule`` that
   keeps the original module's qualified parameter names, so stage state dicts merge into
   the original model's ``state_dict`` keys. Any number of tensors may cross a cut (skip
   connections); a tensor produced in stage 0 and needed in stage 2 is relayed through
   stage 1 (stage 1 receives it and returns it unchanged).
2. An ``nn.Sequential`` that fx cannot trace: split by child names ("0", "1", ...).
3. An explicit list of stage modules (the user's own split): stage i is called with stage
   i-1's outputs; a single tensor output is wrapped in a 1-tuple.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from torch import fx, nn

from ..plans import Plan, PlanError

__all__ = ["split_stages", "StageSplitError"]

log = logging.getLogger(__name__)


class StageSplitError(PlanError):
    """The plan cannot be applied to this module; the message names the layer and what to do."""


def split_stages(module_or_stages: nn.Module | Sequence[nn.Module], plan: Plan) -> list[nn.Module]:
    """Return one module per stage of ``plan`` (see the module docstring for the contract).

    Args:
        module_or_stages: the whole model, or a list/tuple of stage modules.
        plan: the stages' layer names (fx node names, or child names of an ``nn.Sequential``).

    Raises:
        StageSplitError: the plan names layers the model lacks, orders them against the data
            flow, or the number of stage modules differs from the plan's stages.
    """
    if isinstance(module_or_stages, (list, tuple)):
        stages = list(module_or_stages)
        if len(stages) != plan.num_stages:
            raise StageSplitError(
                f"{len(stages)} stage modules were given but the plan has {plan.num_stages} stages"
            )
        for i, m in enumerate(stages):
            if not isinstance(m, nn.Module):
                raise StageSplitError(f"stage {i} is a {type(m).__name__}, not an nn.Module")
        return [_UserStage(m, i, last=(i == len(stages) - 1)) for i, m in enumerate(stages)]
    if not isinstance(module_or_stages, nn.Module):
        raise StageSplitError(f"expected an nn.Module or a list of stage modules, got {type(module_or_stages).__name__}")
    module = module_or_stages
    try:
        gm = fx.symbolic_trace(module)
    except Exception as exc:  # fx raises many kinds of errors for untraceable code
        if isinstance(module, nn.Sequential):
            log.info("fx cannot trace %s (%s); splitting the nn.Sequential by child names",
                     type(module).__name__, exc)
            return _split_sequential(module, plan)
        raise StageSplitError(
            f"torch.fx cannot trace {type(module).__name__} ({type(exc).__name__}: {exc}); "
            "pass an explicit list of stage modules instead"
        ) from None
    return _split_graph(module, gm, plan)


# --------------------------------------------------------------------------- fx split
def _assign_stages(gm: fx.GraphModule, plan: Plan) -> dict[fx.Node, int]:
    """Stage of every node: the plan's for named layers, inferred for the rest."""
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    by_target = {str(n.target): n for n in nodes if n.op == "call_module"}
    planned: dict[fx.Node, int] = {}
    unknown = []
    for s, stage in enumerate(plan.stages):
        for name in stage.layers:
            node = by_name.get(name) or by_target.get(name)
            if node is None:
                unknown.append(name)
                continue
            planned[node] = s
    if unknown:
        raise StageSplitError(
            f"the plan names layers this model does not have: {unknown[:6]}{' ...' if len(unknown) > 6 else ''} "
            f"(model layers are fx node names such as {[n.name for n in nodes[:4]]}); "
            "re-profile and re-plan this model"
        )
    last = plan.num_stages - 1
    stage_of: dict[fx.Node, int] = {}
    for node in nodes:  # topological order
        if node in planned:
            stage_of[node] = planned[node]
        elif node.op == "placeholder":
            stage_of[node] = 0
        elif node.op == "output":
            stage_of[node] = last
        elif node.op == "get_attr":
            stage_of[node] = -1  # resolved below: stage of its first user
        else:
            inputs = [stage_of[i] for i in node.all_input_nodes if stage_of.get(i, -1) >= 0]
            stage_of[node] = max(inputs, default=-1)
    # get_attr nodes (and input-free unplanned nodes) go with their first user.
    for node in reversed(nodes):
        if stage_of[node] < 0:
            users = [stage_of[u] for u in node.users if stage_of[u] >= 0]
            stage_of[node] = min(users, default=0)
    for node in nodes:
        for inp in node.all_input_nodes:
            if stage_of[inp] > stage_of[node]:
                raise StageSplitError(
                    f"layer {node.name!r} is in stage {stage_of[node]} but uses {inp.name!r} from the later "
                    f"stage {stage_of[inp]}; stages must follow the data flow (re-plan the model)"
                )
    return stage_of


def _split_graph(module: nn.Module, gm: fx.GraphModule, plan: Plan) -> list[nn.Module]:
    stage_of = _assign_stages(gm, plan)
    nodes = list(gm.graph.nodes)
    n = plan.num_stages
    # boundary[s]: values produced in stages <= s and consumed in stages > s (topological order).
    boundary: list[list[fx.Node]] = []
    for s in range(n - 1):
        boundary.append([
            v for v in nodes
            if v.op != "output" and stage_of[v] <= s and any(stage_of[u] > s for u in v.users)
        ])
    stages: list[nn.Module] = []
    for s in range(n):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if s > 0:
            for v in boundary[s - 1]:
                env[v] = g.placeholder(v.name)
        for node in nodes:
            if stage_of[node] != s or node.op == "output":
                continue
            env[node] = g.node_copy(node, lambda x: env[x])
        if s == n - 1:
            out = next(nd for nd in nodes if nd.op == "output")
            g.node_copy(out, lambda x: env[x])
        else:
            g.output(tuple(env[v] for v in boundary[s]))
        g.lint()
        stage = fx.GraphModule(module, g, class_name=f"Stage{s}")
        _keep_non_persistent(module, stage)
        stages.append(stage)
        if s < n - 1:
            log.debug("stage %d -> %d carries %s", s, s + 1, [v.name for v in boundary[s]])
    return stages


def _keep_non_persistent(original: nn.Module, stage: nn.Module) -> None:
    """GraphModule re-registers buffers read through get_attr as persistent; restore the
    original's choice so stage state dicts hold exactly the original's keys."""
    stage_buffers = dict(stage.named_buffers())
    for path, mod in original.named_modules():
        for name in getattr(mod, "_non_persistent_buffers_set", ()):
            key = f"{path}.{name}" if path else name
            if key in stage_buffers:
                owner = stage.get_submodule(path) if path else stage
                owner._non_persistent_buffers_set.add(name)


# --------------------------------------------------------------------------- nn.Sequential
class _SequentialStage(nn.Module):
    """Consecutive children of an ``nn.Sequential`` under their original names."""

    def __init__(self, children: list[tuple[str, nn.Module]], last: bool) -> None:
        super().__init__()
        for name, child in children:
            self.add_module(name, child)
        self._last = last

    def forward(self, *inputs: Any) -> Any:
        x: Any = inputs[0] if len(inputs) == 1 else inputs
        for child in self._modules.values():
            x = child(x)
        if self._last:
            return x
        return x if isinstance(x, tuple) else (x,)


def _split_sequential(module: nn.Sequential, plan: Plan) -> list[nn.Module]:
    children = list(module.named_children())
    names = [c for c, _ in children]
    position = {c: i for i, c in enumerate(names)}
    position.update({f"_{c}": i for i, c in enumerate(names)})  # fx-style node names
    groups: list[list[int]] = []
    for s, stage in enumerate(plan.stages):
        idx = []
        for layer in stage.layers:
            if layer not in position:
                raise StageSplitError(
                    f"stage {s} names layer {layer!r} but the nn.Sequential's children are {names[:8]}"
                )
            idx.append(position[layer])
        groups.append(sorted(idx))
    flat = [i for g in groups for i in g]
    if flat != list(range(len(children))):
        raise StageSplitError(
            "for an untraceable nn.Sequential the plan's stages must cover its children "
            f"{names} in order, each exactly once; got {[[names[i] for i in g] for g in groups]}"
        )
    return [_SequentialStage([children[i] for i in g], last=(s == len(groups) - 1)) for s, g in enumerate(groups)]


# --------------------------------------------------------------------------- user stages
class _UserStage(nn.Module):
    """A user-supplied stage module, registered as child ``str(index)`` so that state-dict keys
    read ``"<stage>.<param>"`` (as if the stages were an ``nn.Sequential``)."""

    def __init__(self, module: nn.Module, index: int, last: bool) -> None:
        super().__init__()
        self.add_module(str(index), module)
        self._key = str(index)
        self._last = last

    def forward(self, *inputs: Any) -> Any:
        out = self._modules[self._key](*inputs)
        if self._last:
            return out
        return out if isinstance(out, tuple) else (out,)
