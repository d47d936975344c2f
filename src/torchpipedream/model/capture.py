"""One graph of a model, whatever the model: torch.fx where it can trace, torch.export where not.

The profiler times the graph's nodes and the stage split cuts the same graph into stages, so
both go through :func:`trace`. A model is called as users call it: positional arguments, keyword
arguments (``{"input_ids": ..., "attention_mask": ..., "labels": ...}``), or both; its output
may be a tensor, a tuple, a dict, a dataclass or a Hugging Face ``ModelOutput``.

1. ``torch.fx.symbolic_trace`` first. Arguments the sample leaves out (an optional ``mask=None``)
   are traced as their defaults (``concrete_args``), so a missing optional argument is not
   traced as present. The graph keeps ``call_module`` nodes and the model's output structure.
2. When fx cannot trace the model (Hugging Face models, data-dependent Python control flow),
   ``torch.export.export(model, args, kwargs, strict=False)`` with the sample, every dimension
   of every input tensor dynamic where the model allows it (``Dim.AUTO``: batch and sequence
   lengths may change), and ``ep.module()``: a ``GraphModule`` of ATen operations that
   keeps the original parameter and buffer names. Its inputs are the sample's flattened leaves
   (:meth:`Traced.flatten`), its outputs a flat tuple that :meth:`Traced.unflatten` turns back
   into the model's output type. Export fixes the training mode (dropout) at trace time, so a
   model is traced once per mode (``train=``).
3. An ``nn.Sequential`` that neither can trace is left to the callers (split by children).

What cannot be traced either way is a :class:`TraceError` that says what was tried.
"""

from __future__ import annotations

import collections
import inspect
import logging
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

__all__ = ["Traced", "TraceError", "trace", "as_call", "first_samples", "microbatch_sample", "model_loss", "mutates_first_input",
           "canonical_names", "parameter_aliases", "with_aliases", "draws_random_numbers"]

log = logging.getLogger(__name__)


class TraceError(ValueError):
    """Neither torch.fx nor torch.export could trace the model; the message says what each said."""


def first_samples(values: Any, batch: int, keep: int) -> Any:
    """``values`` with every tensor whose first dimension is the batch cut to ``keep`` samples."""
    return pytree.tree_map(lambda v: v[:keep] if isinstance(v, torch.Tensor) and v.dim() > 0
                           and v.shape[0] == batch else v, values)


def microbatch_sample(sample: Any, microbatches: int) -> Any:
    """A sample minibatch cut to its largest microbatch (ceil(batch / microbatches) samples; the
    batch is dim 0 of its first tensor), as the profiler times it: ``torch.export`` specialises a
    graph to the sizes it sees, so the stages are traced at the size the profile was
    (``Plan.meta["profile_microbatches"]``)."""
    if microbatches <= 1:
        return sample
    first = next((v for v in pytree.tree_leaves(sample) if isinstance(v, torch.Tensor)), None)
    if first is None or first.dim() == 0 or first.shape[0] < microbatches:
        return sample
    batch = int(first.shape[0])
    return first_samples(sample, batch, -(-batch // microbatches))


def as_call(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) of a model call from a sample or a batch's inputs: a dict is keyword
    arguments, a tuple or list positional ones, anything else the one positional argument."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself (``labels=`` in Hugging Face models): ``output.loss`` or
    ``output["loss"]``; ValueError when the output holds none."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(output, dict) and loss is None and hasattr(output, "loss"):
        loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "no loss_fn was given and the model's output holds no loss (output.loss / output['loss']); "
            "pass loss_fn, or inputs that make the model compute its loss (e.g. labels=)")
    return loss


@dataclass
class Traced:
    """A model as one ``fx.GraphModule`` and how to call it with the user's arguments.

    Attributes:
        module: the graph (its parameters and buffers are the original model's objects).
        method: "fx" or "export".
        input_names: the graph's placeholders, in order (what :meth:`flatten` returns values for).
        out_spec: for "export", the pytree spec of the model's output (None for "fx", whose
            graph returns the output itself).
    """

    module: fx.GraphModule
    method: str
    input_names: list[str]
    out_spec: Any = None
    _bind: Any = field(default=None, repr=False)  # fx: the forward's signature
    _arg_names: list[str] = field(default_factory=list, repr=False)  # fx: its traced parameters, in order
    _in_spec: Any = field(default=None, repr=False)  # export: the pytree spec of (args, kwargs)
    _out_type: Any = field(default=None, repr=False)  # fx: the dict subclass the model returns (a ModelOutput)

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The values of the graph's placeholders for a call ``model(*args, **kwargs)``."""
        if self.method == "fx":  # placeholders follow the signature (fx may rename them: input -> input_1)
            bound = self._bind.bind(*args, **kwargs)
            return tuple(bound.arguments[name] if name in bound.arguments else
                         self._bind.parameters[name].default for name in self._arg_names)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise ValueError(f"the inputs' structure differs from the traced sample's: {_describe(spec)} "
                             f"against {_describe(self._in_spec)} (same arguments, keywords and nesting needed)")
        return tuple(leaves)

    def unflatten(self, output: Any) -> Any:
        """The model's output from what the graph (or its last stage) returned."""
        if self.out_spec is None:
            # fx returns a dict subclass (a ModelOutput) as a plain immutable dict: rebuild its class
            return self._out_type(**output) if self._out_type is not None and isinstance(output, dict) else output
        flat = list(output) if isinstance(output, (tuple, list)) else [output]
        return pytree.tree_unflatten(flat, self.out_spec)


def _describe(spec: Any) -> str:
    text = str(spec)
    return text if len(text) < 200 else text[:200] + "..."


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _fx(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Traced:
    signature = inspect.signature(model.forward)
    concrete: dict[str, Any] = {}
    if kwargs is not None:  # a sample is known: parameters it leaves out are traced as their defaults
        bound = signature.bind_partial(*args, **kwargs)
        for name, param in signature.parameters.items():
            if name not in bound.arguments and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                if param.default is inspect.Parameter.empty:
                    raise TraceError(f"the sample gives no value for the model's argument {name!r}")
                concrete[name] = param.default
    tracer = _OutputTypeTracer()
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(tracer.root, graph, model.__class__.__name__)
    if concrete:  # fx keeps placeholders for them (checked, then unused): the graph takes what is passed
        gm = _without_concrete_placeholders(gm, [n if n in concrete else None for n, p in signature.parameters.items()
                                                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)])
    _drop_unused_items(gm)
    mutated = _mutated_buffers(gm)
    if mutated:
        raise _NotForFx(f"{type(model).__name__} updates its buffer {mutated[0]!r} in forward, and torch.fx records "
                        "no torch.no_grad() around the update (its gradient would flow)")
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    arg_names = [n for n, p in signature.parameters.items()
                 if n not in concrete and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(arg_names) != len(placeholders):
        raise TraceError(f"torch.fx traced {type(model).__name__} with inputs {placeholders} that do not match its "
                         f"arguments {arg_names}")
    return Traced(gm, "fx", placeholders, _bind=signature, _arg_names=arg_names, _out_type=tracer.output_type(graph))


class _OutputTypeTracer(fx.Tracer):
    """torch.fx's tracer with buffers traced as values, remembering the dict subclasses the
    traced code builds (fx turns the model's returned ModelOutput into an immutable dict; its
    class is rebuilt from this)."""

    def __init__(self) -> None:
        super().__init__()
        # A buffer read in forward becomes a graph value, so that updating it in place
        # (``self.ema.mul_(0.9)``) is traced into the graph, not run once on the real buffer
        # while tracing.
        self.proxy_buffer_attributes = True
        self._dict_types: list[tuple[type, list[Any]]] = []

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, dict) and type(a) not in (dict, collections.OrderedDict):
            self._dict_types.append((type(a), list(a.keys())))
        return super().create_arg(a)

    def output_type(self, graph: fx.Graph) -> type | None:
        """The class of the dict the graph returns, when the model built one of its own (the
        last one built with the output's keys: the output is the last value traced)."""
        output = next(n for n in graph.nodes if n.op == "output").args[0]
        if not isinstance(output, dict) or not self._dict_types:
            return None
        cls, keys = self._dict_types[-1]
        return cls if keys == list(output.keys()) else None


def _without_concrete_placeholders(gm: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """fx leaves a placeholder (and a check of its value) for every concrete argument; the
    stages and the profiler call the graph with the other arguments only, so drop them.
    ``names``: every argument of the forward, in order (its placeholders follow that order; fx
    may rename them, ``mask`` to ``mask_1``), with None for those traced as they are."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        if name is not None:
            _erase_checks(graph, node)
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def _erase_checks(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and fx's check of its value (``_assert_is_none(x)``, or
    ``_assert(x == value)``): the functions that use only it and end unused."""
    for user in list(node.users):
        if user.op == "call_function":
            for later in list(user.users):
                if later.op == "call_function" and not later.users:
                    graph.erase_node(later)
            if not user.users:
                graph.erase_node(user)
    if not node.users:
        graph.erase_node(node)


class _NotForFx(RuntimeError):
    """torch.fx traced the model but its graph would not compute what the model does: torch.export next."""


def _mutated_buffers(gm: fx.GraphModule) -> list[str]:
    """The buffers the graph updates in place itself (``self.ema.mul_(0.9)``; a module's own
    update inside a call, BatchNorm's, is not one: the module runs it as in one process)."""
    buffers = {name for name, _ in gm.named_buffers()}
    modules = dict(gm.named_modules())
    found = []
    for node in gm.graph.nodes:
        if node.op in ("call_method", "call_function") and node.args and mutates_first_input(node, modules):
            base = node.args[0]
            while isinstance(base, fx.Node) and base.op != "get_attr" and base.args and mutates_first_input(base, modules):
                base = base.args[0]  # a chain of in-place updates: mul_(...).add_(...)
            if isinstance(base, fx.Node) and base.op == "get_attr" and str(base.target) in buffers:
                found.append(str(base.target))
    return found


def _drop_unused_items(gm: fx.GraphModule) -> None:
    """Remove the items of a returned tuple that nothing uses (``h, _ = self.lstm(x)`` traces a
    ``getitem`` for the ``_``). Such a node would be a layer of its own that only the whole tuple
    feeds, placed anywhere after the call, so a cut between the two carried the tuple for
    nothing. The export path drops them with every other unused node (``_drop_unused``)."""
    graph = gm.graph
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target is operator.getitem and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _dynamic_batch(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Every dimension of every input tensor may vary where the model lets it (``Dim.AUTO``:
    dynamic unless the model fixes it), by the forward's argument names: microbatches of other
    sizes, and sequences of another length (minibatches padded to their own longest)."""
    auto = torch.export.Dim.AUTO

    def dims(x: Any) -> Any:
        return {d: auto for d in range(x.dim())} if isinstance(x, torch.Tensor) and x.dim() > 0 else None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: pytree.tree_map(dims, value) for name, value in bound.arguments.items()}


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool) -> Traced:
    was_training = model.training
    model.train(train)
    try:
        with torch.no_grad() if not train else torch.enable_grad():
            ep = torch.export.export(model, args, kwargs, strict=False,
                                     dynamic_shapes=_dynamic_batch(model, args, kwargs))
    finally:
        model.train(was_training)
    gm = ep.module(check_guards=False)
    _drop_unused(gm)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    _, in_spec = pytree.tree_flatten((args, kwargs))
    return Traced(gm, "export", names, out_spec=ep.call_spec.out_spec, _in_spec=in_spec)


def _drop_unused(gm: fx.GraphModule) -> None:
    """Remove nodes that nothing uses and that change nothing: export leaves shape assertions
    (``_assert_tensor_metadata``) and unused ``get_attr`` nodes (a tied weight's other name),
    which would otherwise be layers of their own. In-place operations (a BatchNorm's batch
    counter) stay."""
    def impure(node: fx.Node) -> bool:
        if node.op == "call_function" and getattr(node.target, "__name__", "").startswith("_assert"):
            return False
        return node.is_impure()

    gm.graph.eliminate_dead_code(is_impure_node=impure)
    gm.graph.lint()
    gm.recompile()


_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor"}


def mutates_first_input(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node`` modifies its first argument in place: a module or function called with
    ``inplace=True`` (``ReLU(inplace=True)``), a method or ATen operation named with a trailing
    underscore (``x.add_``, ``aten.relu_``), or an augmented assignment (``x += y``)."""
    if node.kwargs.get("inplace", False):
        return True
    if node.op == "call_module":
        return bool(getattr(modules.get(str(node.target)), "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).endswith("__")
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None:  # an ATen operation: its schema says whether it writes an argument
            return bool(schema.arguments) and schema.arguments[0].alias_info is not None and \
                schema.arguments[0].alias_info.is_write
        name = getattr(node.target, "__name__", "")
        return name in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
    return False


#: Substrings of the operations that draw random numbers (dropout, rand*, bernoulli, ...).
_RANDOM_OPERATIONS = ("dropout", "bernoulli", "rand", "normal", "multinomial", "rrelu", "poisson", "exponential_",
                      "geometric_", "cauchy_", "random_", "uniform_")


def draws_random_numbers(module: nn.Module) -> bool:
    """Whether running ``module`` in training mode may draw from the random number generator
    (dropout): read from its graph when it has one, else assumed (its code is not inspected)."""
    if not isinstance(module, fx.GraphModule):
        return True
    for node in module.graph.nodes:
        if node.op == "call_module":
            sub = module.get_submodule(str(node.target))
            for m in sub.modules():
                builtin = type(m).__module__.startswith("torch.nn.")
                if not builtin or "dropout" in type(m).__name__.lower() or isinstance(m, nn.RReLU):
                    return True
        elif node.op in ("call_function", "call_method"):
            name = (node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target)))
            if any(op in name.lower() for op in _RANDOM_OPERATIONS):
                return True
    return False


def canonical_names(model: nn.Module) -> dict[int, str]:
    """Each parameter object's first name in ``model.named_parameters()``: the one name a
    parameter with several (a tied embedding and output layer) is known by."""
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), name)
    return first_name


def parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Canonical name -> every name of that parameter object in ``model`` (itself first)."""
    first_name = canonical_names(model)
    out: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(first_name[id(p)], []).append(name)
    return out


def with_aliases(state: dict[str, Any], groups: Any) -> dict[str, Any]:
    """``state`` with every name of each parameter in ``groups`` (lists of the names one
    parameter has, as :func:`parameter_aliases` gives them), as the model's own ``state_dict``
    has them: a stage or a checkpoint holds a tied parameter under one name."""
    for names in groups:
        present = next((n for n in names if n in state), None)
        if present is not None:
            for n in names:
                state.setdefault(n, state[present])
    return state


def trace(model: nn.Module, args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None,
          train: bool = True) -> Traced:
    """The model's graph (see the module docstring).

    Args:
        model: the module to trace.
        args, kwargs: one batch of the model's inputs as a call ``model(*args, **kwargs)``
            (``as_call`` makes them from a tensor, tuple or dict); needed when fx cannot trace
            the model (export runs it). ``args=None``: no sample.
        train: the mode to trace in (matters for export, which fixes dropout at trace time).

    Raises:
        TraceError: neither tracer works; the message gives both reasons and what to do.
    """
    have_sample = args is not None
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    try:
        return _fx(model, args, kwargs if have_sample else None)
    except TraceError:
        raise
    except Exception as fx_error:  # fx raises many kinds (TraceError, TypeError, ValueError, ...)
        fx_reason = _first_line(fx_error)
    if not have_sample:
        raise TraceError(f"torch.fx cannot trace {type(model).__name__} ({fx_reason}); pass a sample of its "
                         "inputs so that torch.export can trace it instead")
    try:
        traced = _export(model, args, kwargs, train)
    except Exception as export_error:
        raise TraceError(
            f"neither torch.fx ({fx_reason}) nor torch.export ({_first_line(export_error)}) can trace "
            f"{type(model).__name__}; make its forward traceable, wrap its parts in an nn.Sequential, or pass a "
            "list of stage modules") from None
    log.info("torch.fx cannot trace %s (%s); traced it with torch.export", type(model).__name__, fx_reason)
    return traced
