"""Measure a model layer by layer and return the :class:`~torchpipedream.model.graph.LayerGraph`.

The model is traced with ``torch.fx.symbolic_trace``; every fx node except ``output`` and
``get_attr`` becomes one :class:`~torchpipedream.model.graph.Layer` whose ``name`` is the fx node's
name (the runtime later splits the same traced graph by these names). ``get_attr`` nodes
(parameters and buffers used directly, e.g. a position embedding) belong to the nodes that
use them: their parameter bytes are charged to the first user and they add no edges.
Placeholders become input layers (``is_input=True``, no compute).

How each number is measured (times are medians over ``iters`` runs after ``warmup``):

* forward: the traced graph is run node by node by a small interpreter, timing each node's
  call alone (``time.perf_counter``; on CUDA a pair of CUDA events per node, read after a
  synchronize at the end of the pass). Autograd is on, as in training.
* backward: each node is re-run on *detached* copies of its inputs (an input requires grad
  exactly when it did in the real forward, i.e. when it depends on parameters), then only
  ``torch.autograd.backward(outputs, ones)`` is timed. This is the node's own backward:
  gradients for its parameters and for the inputs that need them, nothing upstream. Nodes
  whose outputs need no gradient (shape arithmetic, masks) get 0.
* loss: with ``loss_fn``, the loss's forward and backward are timed the same way and added
  to the layer that produces the model's output (the last such layer in graph order); the
  loss is not a layer of its own, so stage splits never isolate it. ``meta["loss_layer"]``
  names that layer.
* nodes whose output holds no tensor (shape arithmetic such as ``x.shape[1]``) are recorded
  with zero time: they cost about a microsecond of Python, and a zero lets
  :meth:`LayerGraph.linearize` merge them into the block before them.
* activation_bytes: exact bytes of the node's output tensors (summed over tuples, lists and
  dicts; views count their full size, since that is what crosses a stage boundary).
* saved_bytes: bytes a layer's forward leaves alive for the backward, from one more (untimed)
  forward whose saved tensors are recorded with ``torch.autograd.graph.saved_tensors_hooks``:
  each distinct storage that autograd saves (a parameter or buffer excepted) is charged once,
  to the layer that produced it (the layer whose output it is, or during whose call it was
  made); the loss's saved tensors are charged the same way (the output layer's, or the one
  that produced them); the model's inputs are the caller's batch and are not charged (a
  microbatch is a view of it). ``saved_output_bytes`` is the part that is the layer's own output, and
  ``released_bytes`` the part of that only later layers saved (freed by their backward before
  this layer's runs). The planner's memory model adds these up per stage (docs/planner.md).
* parameter_bytes: bytes of a ``call_module`` node's module parameters (recursively), plus
  the parameters it reads through ``get_attr``; each parameter is counted once, at its first
  user, so the total equals ``sum(p.numel() * p.element_size() for p in module.parameters())``.

Profiling leaves the model as it found it: parameter gradients, buffers (BatchNorm running
statistics), the RNG state, the device (when ``device`` moved it) and the thread count are
restored afterwards.

If fx cannot trace the model and it is an ``nn.Sequential`` (or a list of modules), its
children are profiled as the layers instead (names ``"0"``, ``"1"``, ...; a chain, exactly
the child names, with no input layer, so the runtime can split by them), with
``meta["split"] = "sequential"``.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate, map_arg
from torch.utils import _pytree as pytree

from .graph import Layer, LayerGraph, SharedParameter
from .split_backward import backward_inputs
from .capture import TraceError, as_call, first_samples, canonical_names, mutates_first_input, trace

__all__ = ["profile", "ProfilerError"]

log = logging.getLogger(__name__)

class ProfilerError(ValueError):
    """The model cannot be profiled as given; the message says why and what to do."""


# --------------------------------------------------------------------------- helpers
def _tensors(value: Any) -> list[Tensor]:
    """All tensors in a (nested) tuple/list/dict value, in order."""
    found: list[Tensor] = []

    def visit(v: Any) -> Any:
        if isinstance(v, Tensor):
            found.append(v)
        return v

    map_aggregate(value, visit)
    return found


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _module_kind(mod: nn.Module) -> str:
    text = repr(mod)
    return text if "\n" not in text else type(mod).__name__


def _function_kind(target: Any) -> str:
    name = getattr(target, "__name__", str(target))
    module = getattr(target, "__module__", None) or ""
    if module in ("builtins", "_operator", "operator", ""):
        return name
    if module == "torch.nn.functional":
        return f"F.{name}"
    if module.startswith("torch"):
        return f"torch.{name}"
    return f"{module}.{name}"


class _Timer:
    """Times a region: perf_counter on the CPU; CUDA events (read after a synchronize) on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, start: Any) -> Any:
        """A pending measurement; :meth:`ms` turns it into milliseconds."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return (start, end)
        return (time.perf_counter() - start) * 1e3

    def ms(self, pending: Any) -> float:
        if self.cuda:
            start, end = pending
            return float(start.elapsed_time(end))
        return float(pending)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


@dataclass
class _Step:
    """One layer to time: how to gather its arguments from the environment and call it."""

    name: str
    kind: str
    inputs: list[str]  # producer layer names (edges)
    resolve: Callable[[dict[str, Any]], tuple[tuple, dict]]
    invoke: Callable[[tuple, dict], Any]
    params: list[nn.Parameter] = field(default_factory=list)  # counted for this layer
    own_params: list[nn.Parameter] = field(default_factory=list)  # grads it touches
    mutates: bool = False


@dataclass
class _Program:
    """The model as an ordered list of steps (fx nodes or Sequential children)."""

    inputs: list[tuple[str, Any]]  # placeholder name, default (or _NO_DEFAULT)
    steps: list[_Step]
    constants: dict[str, Any]  # get_attr node name -> value
    output: Callable[[dict[str, Any]], Any]
    output_producers: list[str]
    split: str
    input_layers: bool = True  # emit placeholders as is_input layers
    # (args, kwargs) of a model call -> the values of ``inputs``, in order
    flatten: Callable[[tuple, dict], tuple] = lambda args, kwargs: args
    finish: Callable[[Any], Any] = lambda out: out  # the graph's output -> the model's output


_NO_DEFAULT = object()


# ------------------------------------------------------------------ building programs
def _fx_program(gm: GraphModule) -> _Program:
    modules = dict(gm.named_modules())
    params_by_id = {id(p): p for p in gm.parameters()}
    constants: dict[str, Any] = {}
    inputs: list[tuple[str, Any]] = []
    steps: list[_Step] = []
    output_fn: Callable[[dict[str, Any]], Any] = lambda env: None
    output_producers: list[str] = []
    kept: set[str] = set()

    def fetch_attr(target: str) -> Any:
        obj: Any = gm
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            default = node.args[0] if node.args else _NO_DEFAULT
            inputs.append((node.name, default))
            kept.add(node.name)
        elif node.op == "get_attr":
            constants[node.name] = fetch_attr(node.target)
        elif node.op == "output":
            out_arg = node.args[0]
            output_fn = lambda env, a=out_arg: map_arg(a, lambda n: env[n.name])
            output_producers = [n.name for n in node.all_input_nodes if n.name in kept]
        else:
            steps.append(_fx_step(node, modules, constants, params_by_id, kept))
            kept.add(node.name)
    return _Program(inputs, steps, constants, output_fn, output_producers, "fx")


def _fx_step(
    node: Node,
    modules: dict[str, nn.Module],
    constants: dict[str, Any],
    params_by_id: dict[int, nn.Parameter],
    kept: set[str],
) -> _Step:
    args, kwargs, target = node.args, node.kwargs, node.target

    def resolve(env: dict[str, Any]) -> tuple[tuple, dict]:
        return map_arg(args, lambda n: env[n.name]), map_arg(kwargs, lambda n: env[n.name])

    params: list[nn.Parameter] = []
    mutates = mutates_first_input(node, modules)
    if node.op == "call_module":
        mod = modules[target]
        kind = _module_kind(mod)
        params = list(mod.parameters())

        def invoke(a: tuple, k: dict) -> Any:
            return mod(*a, **k)

    elif node.op == "call_function":
        kind = _function_kind(target)

        def invoke(a: tuple, k: dict) -> Any:
            return target(*a, **k)

    elif node.op == "call_method":
        kind = f"Tensor.{target}"

        def invoke(a: tuple, k: dict) -> Any:
            return getattr(a[0], target)(*a[1:], **k)

    else:  # pragma: no cover - fx has no other node kinds today
        raise ProfilerError(f"fx node {node.name!r}: unsupported op {node.op!r}")
    for inp in node.all_input_nodes:
        if inp.op == "get_attr" and isinstance(constants.get(inp.name), nn.Parameter):
            p = constants[inp.name]
            params.append(params_by_id.get(id(p), p))
    inputs = [inp.name for inp in node.all_input_nodes if inp.name in kept]
    return _Step(node.name, kind, inputs, resolve, invoke, params, list(params), mutates)


def _sequential_program(seq: nn.Sequential) -> _Program:
    names = list(seq._modules)
    input_name = "input"  # only a key in the environment: no layer of this name is emitted
    while input_name in names:
        input_name = "_" + input_name
    steps = []
    prev = input_name
    for child_name in names:
        child = seq._modules[child_name]
        assert child is not None

        def resolve(env: dict[str, Any], p: str = prev) -> tuple[tuple, dict]:
            return (env[p],), {}

        def invoke(a: tuple, k: dict, m: nn.Module = child) -> Any:
            return m(*a, **k)

        params = list(child.parameters())
        edges_in = [] if prev == input_name else [prev]
        steps.append(
            _Step(child_name, _module_kind(child), edges_in, resolve, invoke, params, params,
                  bool(getattr(child, "inplace", False)))
        )
        prev = child_name
    last = prev
    return _Program([(input_name, _NO_DEFAULT)], steps, {}, lambda env: env[last], [last], "sequential",
                    input_layers=False)


def _build_program(module: nn.Module | Sequence[nn.Module], args: tuple, kwargs: dict) -> tuple[_Program, nn.Module]:
    """The steps to time: the traced graph's nodes (``capture.trace``: torch.fx, else
    torch.export with the sample), or the children of a list / an untraceable nn.Sequential."""
    if isinstance(module, (list, tuple)):
        if not module or not all(isinstance(m, nn.Module) for m in module):
            raise ProfilerError("profile: a list of stage modules must be a non-empty list of nn.Module")
        seq = nn.Sequential(*module)
        return _sequential_program(seq), seq
    if not isinstance(module, nn.Module):
        raise ProfilerError(f"profile: expected an nn.Module, got {type(module).__name__}")
    try:
        traced = trace(module, args, kwargs, train=True)
    except TraceError as exc:
        if isinstance(module, nn.Sequential):
            log.info("%s; profiling the nn.Sequential's children instead", exc)
            return _sequential_program(module), module
        raise ProfilerError(f"profile: {exc}") from None
    program = _fx_program(traced.module)
    program.flatten, program.finish = traced.flatten, traced.unflatten
    program.split = traced.method
    return program, traced.module


# --------------------------------------------------------------------------- running
def _bind_inputs(program: _Program, args: tuple) -> dict[str, Any]:
    n_required = sum(1 for _, d in program.inputs if d is _NO_DEFAULT)
    if not n_required <= len(args) <= len(program.inputs):
        raise ProfilerError(
            f"profile: the model takes {n_required}..{len(program.inputs)} inputs "
            f"({', '.join(n for n, _ in program.inputs)}), the sample gave {len(args)}; "
            "pass a tensor, or a tuple with one tensor per input"
        )
    env = dict(program.constants)
    for i, (name, default) in enumerate(program.inputs):
        env[name] = args[i] if i < len(args) else default
    return env


def _forward_pass(program: _Program, args: tuple, timer: _Timer, first: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run every step once, timing each call; returns (environment, pending times)."""
    env = _bind_inputs(program, args)
    pending: dict[str, Any] = {}
    for step in program.steps:
        a, k = step.resolve(env)
        try:
            start = timer.start()
            out = step.invoke(a, k)
            pending[step.name] = timer.stop(start)
        except Exception as exc:
            if not first:
                raise
            raise ProfilerError(
                f"profile: running layer {step.name!r} ({step.kind}) on the sample input failed: "
                f"{_first_line(exc)}; check the sample input's shape and dtype"
            ) from None
        env[step.name] = out
    return env, pending


def _detached(value: Any, clone: bool) -> Any:
    """Leaf copies of the tensors in ``value``: requires_grad where the original had it; its
    containers as they were (torch's pytree keeps a ModelOutput one, where fx would make it
    an immutable dict)."""

    def leaf(v: Any) -> Any:
        if not isinstance(v, Tensor):
            return v
        d = v.detach()
        if v.requires_grad and (d.is_floating_point() or d.is_complex()):
            d.requires_grad_(True)
        return d.clone() if clone else d

    return pytree.tree_map(leaf, value)


def _backward_once(step: _Step, env: dict[str, Any], timer: _Timer) -> Any:
    """Re-run ``step`` on detached inputs and time only its backward; None if it has none."""
    a, k = step.resolve(env)
    try:
        out = step.invoke(_detached(a, step.mutates), _detached(k, step.mutates))
    except RuntimeError as exc:
        if step.mutates:
            raise ProfilerError(f"profile: re-running layer {step.name!r} for its backward failed: {_first_line(exc)}") from None
        # An in-place op we did not recognise ("a leaf Variable that requires grad is being
        # used in an in-place operation"): give it non-leaf copies from now on.
        step.mutates = True
        return _backward_once(step, env, timer)
    roots = [t for t in _tensors(out) if t.requires_grad]
    if not roots:
        return None
    grads = [torch.ones_like(t) for t in roots]
    for p in step.own_params:
        p.grad = None
    timer.sync()
    start = timer.start()
    try:
        torch.autograd.backward(roots, grads)
    except RuntimeError as exc:
        raise ProfilerError(f"profile: the backward of layer {step.name!r} ({step.kind}) failed: {_first_line(exc)}") from None
    pending = timer.stop(start)
    for p in step.own_params:
        p.grad = None
    return pending


def _split_backward_once(step: _Step, env: dict[str, Any], timer: _Timer) -> tuple[Any, Any] | None:
    """Re-run ``step`` on detached inputs and time its backward split as the zero-bubble kinds run
    it (model/split_backward.py): B, the inputs' gradients, then W, the weights'. (None, None)
    when the layer has no backward; None when the split fails (its layer stays unmeasured)."""
    a, k = step.resolve(env)
    own = {id(p): p for p in step.own_params if p.requires_grad}
    # the layer's own parameters passed as arguments (an fx get_attr folded into its user) stay
    # parameters, differentiated in W as the runtime does; everything else is a fresh input
    a, k = map_aggregate((a, k), lambda v: v if id(v) in own and not step.mutates else _detached(v, step.mutates))
    out = step.invoke(a, k)
    roots = [t for t in _tensors(out) if t.requires_grad]
    if not roots:
        return None, None
    inputs = [t for t in _tensors((a, k)) if t.requires_grad and id(t) not in own]
    params = list(own.values())
    grads = [torch.ones_like(t) for t in roots]
    for p in params:
        p.grad = None
    timer.sync()
    try:
        start = timer.start()
        work = backward_inputs(roots, grads, inputs, params)
        input_half = timer.stop(start)
        start = timer.start()
        work.run()
        weight_half = timer.stop(start)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        log.debug("profile: layer %r: split backward not timed (%s)", step.name, _first_line(exc))
        return None
    for p in params:
        p.grad = None
    return input_half, weight_half


def _loss_once(loss_fn: Callable, output: Any, target: Any, timer: _Timer) -> tuple[Any, Any]:
    """Time the loss's forward and backward on a detached copy of the model output."""
    out = _detached(output, clone=False)
    start = timer.start()
    try:
        loss = loss_fn(out, target) if target is not None else loss_fn(out)
    except Exception as exc:
        raise ProfilerError(
            f"profile: loss_fn failed on the model's output: {_first_line(exc)}; "
            "check the target matches the output (loss_fn(output, target))"
        ) from None
    fwd = timer.stop(start)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ProfilerError("profile: loss_fn must return a scalar tensor")
    if not loss.requires_grad:
        return fwd, None
    start = timer.start()
    loss.backward()
    return fwd, timer.stop(start)


# --------------------------------------------------------------------------- public
def profile(
    module: nn.Module | Sequence[nn.Module],
    sample_input: Any,
    loss_fn: Callable[..., Tensor] | None = None,
    target: Any = None,
    device: str | torch.device | None = None,
    warmup: int = 3,
    iters: int = 10,
    name: str | None = None,
    num_threads: int | None = 1,
    optimizer: Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer] | None = None,
    microbatches: int = 1,
    split_backward: bool = True,
) -> LayerGraph:
    """Profile ``module`` on ``sample_input`` and return its layer graph.

    Args:
        module: the model (traced with torch.fx, else torch.export: ``model/capture.py``), or an
            nn.Sequential / list of modules that neither can trace (profiled child by child).
        sample_input: one minibatch of the model's inputs: a tensor, a tuple with one value per
            positional argument, or a dict of keyword arguments (``{"input_ids": ...,
            "attention_mask": ...}``), as ``Pipeline`` takes them. Dimension 0 of its first
            tensor is recorded as the graph's ``batch_size``.
        loss_fn: optional ``loss_fn(output, target)`` (or ``loss_fn(output)`` without target);
            its time is added to the layer producing the output. A model that computes its own
            loss (``labels=`` among the inputs) needs none: the loss is part of its graph.
        target: the loss's target for this minibatch.
        device: where to time; the module is moved there and back. Default: where its
            parameters are (CPU for a parameterless module).
        warmup, iters: untimed and timed repetitions; each number is a median over ``iters``.
        name: the model's name for ``meta["model"]`` (default: its class name).
        num_threads: torch threads during CPU timing (default 1, restored afterwards);
            None keeps the current setting.
        optimizer: a factory ``params -> torch.optim.Optimizer`` (as for ``Pipeline``); when
            given, one step over each layer's parameters is timed into ``Layer.optimizer_ms``
            (on copies: the model's weights and state are untouched).
        microbatches: profile the minibatch as a schedule with this many microbatches runs
            it: time the first ``batch/microbatches`` samples and multiply the times and
            activation bytes by ``microbatches``. The graph still describes one minibatch
            (``batch_size`` is the whole batch), so ``Costs.from_plan(plan, m)`` gets the
            measured microbatch cost back; small microbatches are less efficient than a
            fraction of a large one (small matrix products, per-call overhead), and profiling
            at the minibatch size would predict flush, gpipe and 2bw too fast.
        split_backward: also time each layer's backward split in two as the zero-bubble kinds
            run it (``Layer.input_grad_ms`` / ``weight_grad_ms``): splitting costs more than
            one backward (up to 1.7x on small layers), and the simulator charges what was timed.
            About a third more profiling time; False leaves them unmeasured (the simulator then
            assumes ``simulator.WEIGHT_GRAD_SHARE``).

    The times include what this process's allocator pays. The command line and the workers of
    ``launch`` keep freed memory for reuse (``host/tuning.py``); in a process of your own, call
    ``torchpipedream.keep_freed_memory()`` first (process-wide) if the workers will be tuned, so
    that the profile does not charge page faults that the workers do not pay.

    Raises:
        ProfilerError: fx cannot trace a non-Sequential model, the sample does not fit the
            model, or the arguments are invalid. The message says what to do.
    """
    _check_counts(iters, warmup, microbatches)
    root = module if isinstance(module, nn.Module) else None
    home, dev = _devices(root, device)
    args, kwargs, target, batch_size = _timed_inputs(sample_input, target, dev, microbatches)
    with _process_state_kept(root, home, dev):
        program, traced = _build_program(module, args, kwargs)
        flat = _flat_sample(program, args, kwargs)
        if dev.type == "cpu" and num_threads is not None:
            torch.set_num_threads(num_threads)
        graph = _measure_model(program, traced, flat, loss_fn, target, dev, warmup, iters, batch_size,
                               split_backward, optimizer)
        graph.tied = _shared(program, root if root is not None else traced)
        if microbatches > 1:  # one microbatch was timed: the graph describes the whole minibatch
            _scale_to_minibatch(graph, microbatches, batch_size)
        graph.meta.update(_profile_meta(module, name, dev, program.split, microbatches, warmup, iters))
        return graph


def _check_counts(iters: int, warmup: int, microbatches: int) -> None:
    """Refuse repetition and microbatch counts that cannot be profiled."""
    if iters < 1 or warmup < 0:
        raise ProfilerError(f"profile: need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ProfilerError(f"profile: microbatches must be a positive integer, got {microbatches!r}")


def _devices(root: nn.Module | None, device: str | torch.device | None) -> tuple[torch.device, torch.device]:
    """(where the model's parameters are, where to time): ``device``, else where the model is
    (CPU for a parameterless model or a list of modules)."""
    first_param = next(iter(root.parameters()), None) if root is not None else None
    home = first_param.device if first_param is not None else torch.device("cpu")
    dev = torch.device(device) if device is not None else home
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfilerError(f"profile: device {dev} requested but CUDA is not available")
    return home, dev


@contextlib.contextmanager
def _process_state_kept(root: nn.Module | None, home: torch.device, dev: torch.device) -> Iterator[None]:
    """Move the model to ``dev`` for profiling; afterwards put back the thread count, the RNG
    states and the model's device."""
    moved = root is not None and dev != home
    if moved:
        root.to(dev)
    old_threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, dev)
        if moved:
            root.to(home)


def _flat_sample(program: _Program, args: tuple, kwargs: dict) -> tuple:
    """The sample as the program's flat arguments; a sample that does not fit is the user's to fix."""
    try:
        return program.flatten(args, kwargs)
    except (TypeError, ValueError) as exc:
        raise ProfilerError(f"profile: the sample does not fit the model's arguments: {_first_line(exc)}") from None


def _measure_model(program: _Program, traced: nn.Module, flat: tuple, loss_fn: Callable[..., Tensor] | None,
                   target: Any, dev: torch.device, warmup: int, iters: int, batch_size: int | None,
                   split_backward: bool,
                   optimizer: Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer] | None) -> LayerGraph:
    """Time every layer (and the loss, and with ``optimizer`` each layer's update) and record
    what autograd saves, with the model's gradients and buffers put back afterwards."""
    with _model_state_kept(traced):
        with torch.enable_grad():
            graph = _measure(program, flat, loss_fn, target, _Timer(dev), warmup, iters, batch_size, split_backward)
            _measure_saved(program, flat, loss_fn, target, graph)
        if optimizer is not None:
            names = {id(p): n for n, p in traced.named_parameters()}
            _time_optimizer(program, graph, optimizer, _Timer(dev), warmup, iters, names)
    return graph


def _scale_to_minibatch(graph: LayerGraph, microbatches: int, batch_size: int | None) -> None:
    """One microbatch was timed: scale every time and size to the whole minibatch of
    ``microbatches`` of them, whose size the graph records."""
    for layer in graph.layers:
        layer.forward_ms *= microbatches
        layer.backward_ms *= microbatches
        for attr in ("input_grad_ms", "weight_grad_ms"):
            if getattr(layer, attr) is not None:
                setattr(layer, attr, getattr(layer, attr) * microbatches)
        layer.activation_bytes *= microbatches
        layer.saved_bytes = None if layer.saved_bytes is None else layer.saved_bytes * microbatches
        layer.saved_output_bytes = (None if layer.saved_output_bytes is None
                                    else layer.saved_output_bytes * microbatches)
        layer.released_bytes = None if layer.released_bytes is None else layer.released_bytes * microbatches
    graph.batch_size = batch_size


def _profile_meta(module: nn.Module | Sequence[nn.Module], name: str | None, dev: torch.device, split: str,
                  microbatches: int, warmup: int, iters: int) -> dict[str, Any]:
    """How the profile was taken, for ``graph.meta`` (read while the profiling thread count is set)."""
    return dict(
        microbatches=microbatches,
        model=name or (type(module).__name__ if isinstance(module, nn.Module) else "list"),
        device=str(dev),
        torch=torch.__version__,
        threads=torch.get_num_threads() if dev.type == "cpu" else None,
        split=split,
        warmup=warmup,
        iters=iters,
        timer="cuda_events" if dev.type == "cuda" else "perf_counter",
    )


def _timed_inputs(sample_input: Any, target: Any, dev: torch.device, microbatches: int
                  ) -> tuple[tuple, dict, Any, int | None]:
    """The forward's positional and keyword arguments and the loss's target on ``dev``, cut to one
    microbatch when ``microbatches`` > 1, and the minibatch's size (dim 0 of its first tensor)."""
    args, kwargs = as_call(sample_input)
    args, kwargs, target = map_aggregate((args, kwargs, target),
                                         lambda v: v.to(dev) if isinstance(v, Tensor) else v)
    first_tensor = next(iter(_tensors((args, kwargs))), None)
    batch_size = int(first_tensor.shape[0]) if first_tensor is not None and first_tensor.dim() > 0 else None
    if microbatches > 1:
        if batch_size is None or batch_size < microbatches:
            raise ProfilerError(
                f"profile: a minibatch of {batch_size} samples cannot be split into {microbatches} "
                "microbatches; give a sample input whose first dimension is the minibatch")
        # The largest microbatch of the split (sizes differ by at most one sample).
        args, kwargs, target = first_samples((args, kwargs, target), batch_size, -(-batch_size // microbatches))
    return tuple(args), dict(kwargs), target, batch_size


@contextlib.contextmanager
def _model_state_kept(module: nn.Module) -> Iterator[None]:
    """Profiling runs forwards and backwards on the user's model: put its parameters'
    gradients and its buffers (BatchNorm statistics) back as they were afterwards."""
    params = list(module.parameters())
    saved_grads = [p.grad for p in params]
    saved_buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in saved_buffers:
                b.copy_(saved)


def _shared(program: _Program, model: nn.Module) -> list[SharedParameter]:
    """Parameters that more than one layer uses (a tied embedding and output layer), by their
    canonical names (``capture.canonical_names``)."""
    names = canonical_names(model)
    users: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    for step in program.steps:
        for p in {id(p): p for p in step.params}.values():
            users.setdefault(id(p), []).append(step.name)
            sizes[id(p)] = p.numel() * p.element_size()
    return [SharedParameter(names.get(pid, f"parameter_{pid}"), layers, sizes[pid])
            for pid, layers in users.items() if len(layers) > 1]


@dataclass
class _Timings:
    """The timed milliseconds of every iteration: per layer, and of the loss."""

    fwd: dict[str, list[float]]
    bwd: dict[str, list[float]]
    split: dict[str, list[tuple[float, float]]]  # per layer, (B, W); a layer whose split fails is dropped
    loss_fwd: list[float] = field(default_factory=list)
    loss_bwd: list[float] = field(default_factory=list)


def _measure(
    program: _Program,
    args: tuple,
    loss_fn: Callable[..., Tensor] | None,
    target: Any,
    timer: _Timer,
    warmup: int,
    iters: int,
    batch_size: int | None,
    split_backward: bool = True,
) -> LayerGraph:
    """The layer graph with every layer's median times (and the loss's, added to the output layer)."""
    env, timings = _time_layers(program, args, loss_fn, target, timer, warmup, iters, split_backward)
    layers, edges = _timed_layers(program, env, timings)
    meta: dict[str, Any] = {"loss_layer": None}
    if loss_fn and program.output_producers:
        meta["loss_layer"] = _add_loss(program, layers, timings)
    return LayerGraph(layers, edges, batch_size=batch_size, meta=meta)


def _time_layers(program: _Program, args: tuple, loss_fn: Callable[..., Tensor] | None, target: Any,
                 timer: _Timer, warmup: int, iters: int, split_backward: bool) -> tuple[dict[str, Any], _Timings]:
    """Run the forward, each layer's backward (whole and split) and the loss ``warmup + iters``
    times; the last forward's values and the timed iterations' times."""
    any_mutation = any(s.mutates for s in program.steps)
    timings = _Timings(fwd={s.name: [] for s in program.steps}, bwd={s.name: [] for s in program.steps},
                       split={s.name: [] for s in program.steps} if split_backward else {})
    split = timings.split
    env: dict[str, Any] = {}
    for i in range(warmup + iters):
        run_args = _detached(args, clone=True) if any_mutation else args
        env, pending = _forward_pass(program, run_args, timer, first=(i == 0))
        pending_bwd = {s.name: _backward_once(s, env, timer) for s in program.steps}
        pending_split = {s.name: _split_backward_once(s, env, timer) for s in program.steps if s.name in split}
        pending_loss = _loss_once(loss_fn, program.finish(program.output(env)), target, timer) if loss_fn \
            else (None, None)
        timer.sync()
        if i < warmup:
            continue
        for step in program.steps:
            timings.fwd[step.name].append(timer.ms(pending[step.name]))
            pb = pending_bwd[step.name]
            timings.bwd[step.name].append(timer.ms(pb) if pb is not None else 0.0)
        for name, halves in pending_split.items():
            if halves is None:
                del split[name]
            else:
                b, w = (timer.ms(h) if h is not None else 0.0 for h in halves)
                split[name].append((b, w))
        if loss_fn:
            timings.loss_fwd.append(timer.ms(pending_loss[0]))
            timings.loss_bwd.append(timer.ms(pending_loss[1]) if pending_loss[1] is not None else 0.0)
    return env, timings


def _timed_layers(program: _Program, env: dict[str, Any], timings: _Timings
                  ) -> tuple[list[Layer], list[tuple[str, str]]]:
    """The graph's layers (inputs first) with their median times, and its edges."""
    layers: list[Layer] = []
    edges: list[tuple[str, str]] = []
    for input_name, _ in program.inputs if program.input_layers else []:
        value = env.get(input_name)
        layers.append(_layer(input_name, "Input", value, 0.0, 0.0, 0, is_input=True))
    seen: set[int] = set()
    for step in program.steps:
        pbytes = 0
        for p in step.params:
            if id(p) not in seen:
                seen.add(id(p))
                pbytes += p.numel() * p.element_size()
        # A node with no tensor output is shape arithmetic (x.shape[1]): about a microsecond
        # of Python. It is recorded as free so that LayerGraph.linearize() merges it away.
        free = not _tensors(env[step.name]) and not pbytes
        fwd = 0.0 if free else statistics.median(timings.fwd[step.name])
        layer = _layer(step.name, step.kind, env[step.name], fwd, statistics.median(timings.bwd[step.name]), pbytes)
        halves = timings.split.get(step.name)
        if halves:
            layer.input_grad_ms = statistics.median(b for b, _ in halves)
            layer.weight_grad_ms = statistics.median(w for _, w in halves)
        layers.append(layer)
        edges.extend((src, step.name) for src in step.inputs)
    return layers, edges


def _add_loss(program: _Program, layers: list[Layer], timings: _Timings) -> str:
    """Add the loss's median times to the layer that produces the model's output (the last such
    in graph order); that layer's name."""
    order = {s.name: i for i, s in enumerate(program.steps)}
    last = max(program.output_producers, key=lambda n: order.get(n, -1))
    layer = next(l for l in layers if l.name == last)
    layer.forward_ms += statistics.median(timings.loss_fwd)
    layer.backward_ms += statistics.median(timings.loss_bwd)
    if layer.input_grad_ms is not None:  # B starts at the loss: its backward is B's
        layer.input_grad_ms += statistics.median(timings.loss_bwd)
    return last


def _storage(t: Tensor) -> tuple[int, int]:
    """(address, bytes) of a tensor's storage; address 0 for none (empty or meta)."""
    if t.device.type == "meta":
        return 0, 0
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _measure_saved(program: _Program, args: tuple, loss_fn: Callable[..., Tensor] | None, target: Any,
                   graph: LayerGraph) -> None:
    """Fill every layer's ``saved_bytes`` and ``saved_output_bytes`` from one forward (and the
    loss) run with autograd's saved-tensor hooks (see the module doc)."""
    fixed = {_storage(t)[0] for s in program.steps for t in s.params}
    fixed |= {_storage(t)[0] for t in _tensors(list(program.constants.values()))}
    producer: dict[int, str] = {}  # storage address -> layer that produced it
    outputs: dict[int, str] = {}  # storage address -> layer whose output it is
    charged: dict[int, tuple[str, int]] = {}  # saved storage -> (layer charged, bytes)
    first_saver: dict[int, str] = {}  # saved storage -> the first layer that saved it
    packed: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        packed.append(t)
        return t

    def charge(name: str) -> None:
        for t in packed:
            ptr, nbytes = _storage(t)
            if ptr and ptr not in fixed and ptr not in charged:
                charged[ptr] = (producer.setdefault(ptr, name), nbytes)
                first_saver[ptr] = name
        packed.clear()

    def produced(name: str, value: Any) -> None:
        for t in _tensors(value):
            ptr, _ = _storage(t)
            if ptr and ptr not in fixed and ptr not in producer:
                producer[ptr] = outputs[ptr] = name

    # copies: a sample cut to one microbatch is a view of the whole batch's storage
    run_args = _detached(args, clone=True)
    target = map_aggregate(target, lambda v: v.clone() if isinstance(v, Tensor) else v)
    env = _bind_inputs(program, run_args)
    for name, _ in program.inputs:
        produced(name, env.get(name))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for step in program.steps:
            a, k = step.resolve(env)
            env[step.name] = out = step.invoke(a, k)
            produced(step.name, out)
            charge(step.name)
        if loss_fn is not None and graph.meta.get("loss_layer"):
            output = program.finish(program.output(env))
            loss_fn(output, target) if target is not None else loss_fn(output)
            charge(graph.meta["loss_layer"])
    totals = {layer.name: [0, 0, 0] for layer in graph.layers}
    inputs = {name for name, _ in program.inputs}
    for ptr, (name, nbytes) in charged.items():
        if name in inputs or name not in totals:
            continue  # the model's inputs: the caller's batch, held whatever the pipeline does
        totals[name][0] += nbytes
        if outputs.get(ptr) == name:
            totals[name][1] += nbytes
            if first_saver[ptr] != name:
                totals[name][2] += nbytes
    for layer in graph.layers:
        layer.saved_bytes, layer.saved_output_bytes, layer.released_bytes = totals[layer.name]


_DISTURBANCE: list[Tensor] = []


def disturb_caches() -> None:
    """Run a few milliseconds of unrelated compute (small matrix products over 4 MB of weights),
    as a pipeline stage's forwards and backwards do between its updates and messages.

    Short operations timed in a tight loop run with hot caches and predictors; in a pipeline
    they run right after a large kernel. Measured on the development machine, a stage's update
    and a message's packing took 1.5-2× longer in the run than in a hot loop, so the
    profiler times each update (and ``measure_message_overhead`` each message) after this.
    """
    if not _DISTURBANCE:
        g = torch.Generator().manual_seed(0)
        _DISTURBANCE.extend([torch.randn(64, 1024, generator=g), torch.randn(1024, 1024, generator=g)])
    x, w = _DISTURBANCE
    # in float32 whatever autocast the caller profiles under: float16 products on a CPU are ~50×
    # slower (a profile under --precision fp16 spent 14 s here on a 6-layer MLP)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for _ in range(2):
            x = torch.relu(x @ w).mul_(1e-3)


def _time_optimizer(program: _Program, graph: LayerGraph, optimizer: Callable[..., torch.optim.Optimizer],
                    timer: _Timer, warmup: int, iters: int, names: dict[int, str]) -> None:
    """Time the update of each layer's own parameters, on copies, as the runtime makes it: a
    new gradient each time (autograd hands over fresh tensors), scaled in place by 1/samples
    (the runtime accumulates sums), then the optimizer's step, after other compute
    (:func:`disturb_caches`), not in a hot loop.

    A step has a fixed cost per call (Python, the optimizer's bookkeeping) that a stage pays
    once, not once per layer; summing per-layer steps over a 4-layer stage predicted 1.0 ms
    where the runtime took 0.6. So one step over all the model's parameters is timed too and
    the per-layer times are scaled to add up to it: each layer's ``optimizer_ms`` is its share
    of the whole model's update. The factory gets ``(name, parameter)`` pairs, as the
    pipeline gives it (``names``: the model's name of each parameter).
    """
    seen: set[int] = set()
    per_layer: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for step in program.steps:
        mine = [(names.get(id(p), f"{step.name}.{i}"), p) for i, p in enumerate(step.params) if id(p) not in seen]
        seen.update(id(p) for _, p in mine)
        if mine and step.name in graph:
            per_layer[step.name] = mine
    if not per_layer:
        return
    times = {name: _time_update(f"layer {name!r}", params, optimizer, timer, warmup, iters)
             for name, params in per_layer.items()}
    whole = _time_update("all the model's parameters", [p for ps in per_layer.values() for p in ps], optimizer, timer, warmup, iters)
    total = sum(times.values())
    for name, t in times.items():
        graph[name].optimizer_ms = t * whole / total if total > 0 else whole / len(times)


def _time_update(what: str, params: list[tuple[str, nn.Parameter]], optimizer: Callable[..., torch.optim.Optimizer],
                 timer: _Timer, warmup: int, iters: int) -> float:
    """Median milliseconds of one runtime-style update of ``params`` (on copies)."""
    named = [(n, nn.Parameter(p.detach().clone())) for n, p in params]
    copies = [c for _, c in named]
    try:
        opt = optimizer(named)
    except Exception as exc:
        raise ProfilerError(f"profile: the optimizer factory failed on {what}: {exc}") from None
    times = []
    for i in range(warmup + iters):
        for c in copies:
            c.grad = torch.randn_like(c).mul_(1e-3)
        grads = [c.grad for c in copies]
        if timer.device.type == "cpu":
            disturb_caches()
        pending = timer.start()
        with torch.no_grad():
            torch._foreach_mul_(grads, 1.0)
        opt.step()
        done = timer.stop(pending)
        timer.sync()
        if i >= warmup:
            times.append(timer.ms(done))
    return float(statistics.median(times))


def _layer(name: str, kind: str, value: Any, fwd: float, bwd: float, pbytes: int, is_input: bool = False) -> Layer:
    tensors = _tensors(value)
    return Layer(
        name=name,
        kind=kind,
        forward_ms=float(fwd),
        backward_ms=float(bwd),
        activation_bytes=sum(t.numel() * t.element_size() for t in tensors),
        parameter_bytes=int(pbytes),
        output_shapes=[list(t.shape) for t in tensors],
        output_dtypes=[str(t.dtype).replace("torch.", "") for t in tensors],
        is_input=is_input,
    )
