"""Cut a model into pipeline stages: one ``nn.Module`` per stage of a :class:`~torchpipedream.plans.plan.Plan`.

Three ways in, one contract out. Every stage module is called with the values that cross
into it as positional arguments (stage 0: the model's own inputs, as :meth:`StageSplit.inputs`
orders them) and returns

* a tuple of values for every stage but the last (what the next stage receives), and
* the model's output for the last stage (a tensor, tuple, dict, dataclass or ``ModelOutput``).

1. A traced module (``tracing.trace``: torch.fx, else torch.export with a sample of the inputs):
   the plan's layer names are the graph's node names (what :mod:`torchpipedream.model.profiler`
   records). Each stage becomes a ``GraphModule`` that keeps the original module's qualified
   parameter names, so stage state dicts merge into the original model's ``state_dict`` keys.
   Any number of values may cross a cut (skip connections); a value produced in stage 0 and
   needed in stage 2 is relayed through stage 1 (stage 1 receives it and returns it
   unchanged).

   * **Shared parameters.** A parameter that layers of two stages use (GPT-2's input embedding
     and output layer share one tensor) is read by each of those stages from a copy of its
     own: :attr:`StageSplit.tied` names it with the stages, and the runtime keeps the copies
     equal (the ``TR`` action: their gradients summed, one update; docs/architecture.md,
     "Shared parameters").
   * **In-place operations after a cut.** A stage receives its inputs as leaves that need a
     gradient; an in-place operation on one (``ReLU(inplace=True)`` right after the cut)
     would be an error, so such an input is cloned first (only there).
2. An ``nn.Sequential`` that neither tracer can trace: split by child names ("0", "1", ...).
3. An explicit list of stage modules (the user's own split): stage i is called with stage
   i-1's outputs; a single tensor output is wrapped in a 1-tuple.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch import fx, nn

from ..plans.plan import Plan, PlanError
from ..model.capture import TraceError, Traced, canonical_names, mutates_first_input, trace

__all__ = ["split_stages", "StageSplit", "StageSplitError", "model_state_names"]

log = logging.getLogger(__name__)


class StageSplitError(PlanError):
    """The plan cannot be applied to this module; the message names the layer and what to do."""


@dataclass
class StageSplit:
    """The stages of a model and what the runtime needs to call them.

    Attributes:
        modules: one module per stage (see the module docstring for their contract).
        inputs: ``(args, kwargs) -> stage 0's positional inputs`` for a call
            ``model(*args, **kwargs)``.
        finish: the last stage's output -> the model's output (its own type).
        tied: trainable parameters that several stages hold (one object in this process):
            its name in the model (``tracing.canonical_names``) -> {stage: its name in that
            stage's module}. Whatever the way in (a user's stage modules may share one too).
        method: how the model was split: "fx", "export", "sequential" or "stages".
    """

    modules: list[nn.Module]
    inputs: Callable[[tuple, dict], tuple]
    finish: Callable[[Any], Any] = lambda out: out
    tied: dict[str, dict[int, str]] = field(default_factory=dict)
    method: str = "fx"
    layout: dict[str, Any] = field(default_factory=dict, repr=False)  # where each operation went (follow=)


def split_stages(module_or_stages: nn.Module | Sequence[nn.Module], plan: Plan, sample: tuple[tuple, dict] | None = None,
                 train: bool = True, follow: StageSplit | None = None, model: nn.Module | None = None) -> StageSplit:
    """Split the model as ``plan`` says (see the module docstring for the contract).

    Args:
        module_or_stages: the whole model, or a list/tuple of stage modules.
        plan: the stages' layer names (graph node names, or child names of an ``nn.Sequential``).
        sample: ``(args, kwargs)`` of one call of the model: needed when torch.fx cannot trace
            it (torch.export runs the model on it).
        train: trace in training mode (dropout on); torch.export fixes the mode in the graph.
        follow: the split of the same model's training graph, when this is its evaluation graph
            (``train=False``): its operations go where their counterparts in that graph went
            (the plan's layer names are the training graph's; :func:`_assign_stages`).
        model: with a list of stage modules, the whole model they were cut from: shared
            parameters are named by it, and every stage parameter must be one of its own.

    Raises:
        StageSplitError: the plan names layers the model lacks, orders them against the data
            flow, the number of stage modules differs from the plan's stages, or the model
            cannot be traced.
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
        wrapped = [_UserStage(m, i, last=(i == len(stages) - 1)) for i, m in enumerate(stages)]
        if model is not None:
            _check_cut_from(wrapped, model)
        return StageSplit(wrapped, _positional, tied=_shared_between(wrapped, model), method="stages")
    if not isinstance(module_or_stages, nn.Module):
        raise StageSplitError(f"expected an nn.Module or a list of stage modules, got {type(module_or_stages).__name__}")
    module = module_or_stages
    try:
        traced = trace(module, *(sample if sample is not None else (None, None)), train=train)
    except TraceError as exc:
        if isinstance(module, nn.Sequential):
            log.info("%s; splitting the nn.Sequential by child names", exc)
            modules = _split_sequential(module, plan, sample_missing=sample is None)
            return StageSplit(modules, _positional, tied=_shared_between(modules, module), method="sequential")
        raise StageSplitError(str(exc)) from None
    return _split_graph(traced, plan, module, follow=None if follow is None else follow.layout)


def _check_cut_from(stages: list[nn.Module], model: nn.Module) -> None:
    """Every parameter of the stage modules is one of ``model``'s (StageSplitError naming the
    first that is not: its state would have no name in the model's checkpoints)."""
    own = {id(p) for p in model.parameters()}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            if id(p) not in own:
                raise StageSplitError(f"stage {s}'s parameter {name!r} is not a parameter of the model given with "
                                      "the stages (model=): cut the stages from that model's own modules")


def _shared_between(stages: list[nn.Module], original: nn.Module | None) -> dict[str, dict[int, str]]:
    """Trainable parameters that more than one stage module holds: the model's name for each
    (the first stage's, without ``original``) -> {stage: its name in that stage}."""
    first_name = canonical_names(original) if original is not None else {}
    holders: dict[int, dict[int, str]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            if p.requires_grad:
                holders.setdefault(id(p), {})[s] = name
    return {first_name.get(pid, names[min(names)]): names for pid, names in holders.items() if len(names) > 1}


def model_state_names(stage: nn.Module, original: nn.Module | None) -> dict[str, str]:
    """Each key of ``stage``'s state dict -> the model's name for that tensor (its first name in
    ``original``: a tied parameter has one). Keys of tensors the model does not hold (constants
    torch.export lifted out of the code) are left out; without ``original`` (a user's stage
    modules) every key is its own name."""
    first: dict[int, str] = {}
    if original is not None:
        for name, t in list(original.named_parameters(remove_duplicate=False)) + \
                list(original.named_buffers(remove_duplicate=False)):
            first.setdefault(id(t), name)
    keys = set(stage.state_dict(keep_vars=True))
    out = {}
    for name, t in list(stage.named_parameters(remove_duplicate=False)) + \
            list(stage.named_buffers(remove_duplicate=False)):
        if name in keys and (original is None or id(t) in first):
            out[name] = first.get(id(t), name)
    return out


def _positional(args: tuple, kwargs: dict) -> tuple:
    if kwargs:
        raise StageSplitError(f"this model's stages take positional inputs only, got keywords {sorted(kwargs)}")
    return tuple(args)


# --------------------------------------------------------------------------- fx split
def _operation_keys(gm: fx.GraphModule) -> dict[fx.Node, tuple[str, str, int]]:
    """A name for every operation that survives a change of mode: (the module it runs in, the
    operation, how many of the same ran before in that module). torch.export names nodes by
    operation and counter, so the training and evaluation graphs of one model (which differ by
    dropout and BatchNorm's counters) give one operation different names; these keys agree."""
    seen: dict[tuple[str, str], int] = {}
    keys = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        where = next(reversed(stack.values()))[0] if stack else ""
        base = (str(where), str(node.target))
        keys[node] = (*base, seen.get(base, 0))
        seen[base] = seen.get(base, 0) + 1
    return keys


def _planned_by_layout(gm: fx.GraphModule, layout: dict[str, Any]) -> dict[fx.Node, int]:
    """Stages of an evaluation graph's operations from the training graph's ``layout``: each
    operation where its counterpart went; one without a counterpart after its inputs and in a
    stage that holds the parameters and buffers it reads."""
    planned: dict[fx.Node, int] = {}
    for node, key in _operation_keys(gm).items():
        if key in layout["operations"]:
            planned[node] = layout["operations"][key]
            continue
        after = max((planned.get(i, 0) for i in node.all_input_nodes if i.op != "get_attr"), default=0)
        for attr in (i for i in node.all_input_nodes if i.op == "get_attr"):
            holders = layout["attributes"].get(str(attr.target), [])
            after = max(after, min((h for h in holders if h >= after), default=max(holders, default=after)))
        planned[node] = after
    return planned


def _assign_stages(gm: fx.GraphModule, plan: Plan, layout: dict[str, Any] | None = None) -> dict[fx.Node, int]:
    """Stage of every node: the plan's for named layers (or, for an evaluation graph, where the
    training graph's ``layout`` put each operation), inferred for the rest."""
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    by_target = {str(n.target): n for n in nodes if n.op == "call_module"}
    planned: dict[fx.Node, int] = {}
    unknown = []
    if layout is not None:
        planned = _planned_by_layout(gm, layout)
    else:
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
        if node.op == "placeholder":  # the first stage reads every input; later ones get them relayed
            stage_of[node] = 0
        elif node in planned:
            stage_of[node] = planned[node]
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


def _split_graph(traced: Traced, plan: Plan, original: nn.Module, follow: dict[str, Any] | None = None) -> StageSplit:
    gm = traced.module
    stage_of = _assign_stages(gm, plan, follow)
    nodes = list(gm.graph.nodes)
    n = plan.num_stages
    # A parameter (get_attr) goes to every stage that uses it: each holds a copy (tied).
    holders: dict[fx.Node, list[int]] = {}
    for node in nodes:
        if node.op == "get_attr":
            holders[node] = sorted({stage_of[u] for u in node.users} or {stage_of[node]})

    def crosses(v: fx.Node, s: int) -> bool:
        return v.op not in ("output", "get_attr") and stage_of[v] <= s and any(stage_of[u] > s for u in v.users)

    # boundary[s]: values produced in stages <= s and consumed in stages > s (topological order).
    boundary = [[v for v in nodes if crosses(v, s)] for s in range(n - 1)]
    modules_by_name = dict(gm.named_modules())
    stages: list[nn.Module] = []
    for s in range(n):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if s > 0:
            for v in boundary[s - 1]:
                env[v] = g.placeholder(v.name)
            _clone_before_inplace(g, env, boundary[s - 1], stage_of, s, modules_by_name)
        for node in nodes:
            if node.op == "output":
                continue
            if node.op == "get_attr":
                if s in holders[node]:
                    env[node] = g.node_copy(node, lambda x: env[x])
                continue
            if stage_of[node] != s:
                continue
            env[node] = g.node_copy(node, lambda x: env[x])
        if s == n - 1:
            out = next(nd for nd in nodes if nd.op == "output")
            g.node_copy(out, lambda x: env[x])
        else:
            g.output(tuple(env[v] for v in boundary[s]))
        g.lint()
        stage = fx.GraphModule(gm, g, class_name=f"Stage{s}")
        _keep_non_persistent(original, stage)
        stages.append(stage)
        if s < n - 1:
            log.debug("stage %d -> %d carries %s", s, s + 1, [v.name for v in boundary[s]])
    layout = {"operations": {key: stage_of[node] for node, key in _operation_keys(gm).items()},
              "attributes": {str(node.target): stages for node, stages in holders.items()}}
    return StageSplit(stages, traced.flatten, traced.unflatten, _shared_between(stages, original),
                      method=traced.method, layout=layout)


def _clone_before_inplace(g: fx.Graph, env: dict[fx.Node, fx.Node], received: list[fx.Node], stage_of: dict,
                          s: int, modules: dict[str, nn.Module]) -> None:
    """Where this stage changes a received value in place (``ReLU(inplace=True)`` right after
    the cut), it works on a clone: the received value is a leaf that autograd must keep intact
    for its gradient."""
    for v in received:
        if any(stage_of[u] == s and u.all_input_nodes and u.all_input_nodes[0] is v and
               mutates_first_input(u, modules) for u in v.users):
            env[v] = g.call_method("clone", (env[v],))


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


def _split_sequential(module: nn.Sequential, plan: Plan, sample_missing: bool = False) -> list[nn.Module]:
    """The Sequential's children grouped by the plan's stages (their names, or fx-style ``_k``).
    ``sample_missing``: no sample was given, so a plan of graph nodes (made from a
    profile that torch.export traced with its sample) is told to give the same sample."""
    children = list(module.named_children())
    names = [c for c, _ in children]
    position = {c: i for i, c in enumerate(names)}
    position.update({f"_{c}": i for i, c in enumerate(names)})  # fx-style node names
    groups: list[list[int]] = []
    for s, stage in enumerate(plan.stages):
        idx = []
        for layer in stage.layers:
            if layer not in position:
                hint = ("; the plan's layers are graph nodes, as torch.export traces the model with a sample: give "
                        "the Pipeline the profile's sample (sample=...) so that it traces it the same way"
                        if sample_missing else "")
                raise StageSplitError(
                    f"stage {s} names layer {layer!r} but the nn.Sequential's children are {names[:8]}{hint}"
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
