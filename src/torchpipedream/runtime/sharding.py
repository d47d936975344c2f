"""A stage sharded over its replicas with torch's FSDP2 (``Stage.sharding``: "zero3", "zero2").

PipeDream's replicated stage keeps the whole stage on every replica and all-reduces the
gradients; a sharded one splits the weights, the gradients and the optimizer state over the
replicas (ZeRO), so a stage that does not fit one worker fits several. The sharding is
torch's own (``fully_shard``); what this module adds is how a pipeline stage drives it.

How a sharded stage runs:

* :func:`shard_stage` wraps each block of the stage (every submodule the stage calls as a
  module: a graph's ``call_module`` targets, a ``Sequential``'s layers) and then the stage module itself
  with ``fully_shard`` on a DeviceMesh of the replicas' process group. "zero3" gathers a
  block's weights for each forward and again for its backward; "zero2" keeps them gathered
  from a forward until its backward (``reshard_after_forward=False``). A parameter that two
  blocks share stays with the stage module (FSDP2 shards each parameter in one group).
* "zero1" gathers once per update instead, by actions of the schedule (schedule/actions.py:
  ``UN``, ``RD``, ``RS``), the whole stage as one FSDP2 unit (one all-gather and one
  reduce-scatter per minibatch, not one per block): FSDP2 is told to keep the gathered weights after forwards and
  backwards and to accumulate the gradient whole without reducing it
  (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``). ``UN``
  gathers every unit (:func:`gather_weights`: FSDP2's ``unshard``), so the F and B of the
  update communicate nothing; the engine turns gradient sync on for the one B that ``RD``
  follows (:func:`reduce_in_backward`), whose hooks reduce-scatter the accumulated gradient
  into the shards; ``RS`` frees the gathered weights (:func:`free_gathered`: ``reshard``).
  The price is memory: the whole stage's weights and gradient while an update runs.
* The engine calls the stage module as it is (no weight aliases: FSDP2 installs the gathered
  weights itself) and back-propagates without naming the parameters, so FSDP2's hooks see
  every backward: each microbatch's weight gradient is reduce-scattered when its backward
  ends and summed into the shards (``DTensor`` ``.grad``). Under zb-h1 and zb-h2 a sharded
  stage therefore does not split its backward: its B runs the whole of it and its W is empty
  (``Engine._backward``).
* Every F and B is therefore a collective of the stage's replicas. The schedule's replicas of
  a sharded stage take equal shares of each batch (``build._check_sharded_shares``), and the
  validator runs the lists with every such F/B as a collective (``validate._ShardedRun``):
  proven free of deadlock before the run.
* :class:`ShardedWeights` is the stage's :class:`WeightVersions`: one version (the kinds that
  keep several are refused: ``placement.sharding_support_problem``), the optimizer on the
  shards, the ``AR`` action reduced to the replicas' sample count. FSDP2 averages the
  gradient over the replicas (its reduce-scatter divides by their number: gloo has no
  pre-multiplied sum) and the engine back-propagates summed losses, so an update multiplies
  the shards' gradient by replicas / samples — the mean over the update's samples, as
  everywhere else (weights.py, "Loss scaling by construction").
* Checkpoints: a sharded stage's replicas save their shards with torch.distributed.checkpoint
  (dcp_files.py: nothing is gathered whole on one worker), and loading reads any checkpoint's
  tensors in this replica's layout (DCP for a sharded stage's folder; :func:`shard_like`, no
  communication, for a whole tensor of another stage's file). So a sharded run resumes on any
  other plan, and any checkpoint resumes on a sharded one. ``Pipeline.state_dict()`` gathers
  the whole model (:func:`full_state_dict`).
* A model torch.export split evaluates through graphs traced in evaluation mode, which read the
  weights the model had; on a sharded stage :class:`GatheredEvaluation` runs such a graph with
  the training stage's weights gathered whole for the call.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from .loss_scaling import has_nonfinite
from .weights import OptimizerFactory, WeightVersions, local_tensor, wait_for

__all__ = ["shard_stage", "ShardedWeights", "GatheredEvaluation", "full_state_dict", "local_tensor", "whole", "shard_like",
           "sharded_optimizer_entries", "gather_weights", "free_gathered", "reduce_in_backward"]

log = logging.getLogger(__name__)

def _called_blocks(module: nn.Module) -> list[nn.Module]:
    """The submodules the stage calls as modules, which FSDP2 can gather for one by one (it
    gathers a unit's weights in a hook on the unit's call): a graph's ``call_module`` targets
    whose parameters no ``get_attr`` reads directly, a ``Sequential``'s layers; none for other
    modules, whose code may read a child's weights without calling it."""
    if isinstance(module, fx.GraphModule):
        read = [str(n.target) for n in module.graph.nodes if n.op == "get_attr"]
        targets = dict.fromkeys(str(n.target) for n in module.graph.nodes if n.op == "call_module")
        return [module.get_submodule(t) for t in targets
                if not any(r == t or r.startswith(t + ".") for r in read)]
    if isinstance(module, nn.Sequential):
        return list(module)
    return []


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: called blocks holding parameters that no other block holds
    too (shared ones stay with the stage module, FSDP2's root unit)."""
    blocks = [b for b in _called_blocks(module) if any(True for _ in b.parameters())]
    owners: dict[int, int] = {}
    for b in blocks:
        for p in b.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [b for b in blocks if all(owners[id(p)] == 1 for p in b.parameters())]


def shard_stage(module: nn.Module, group: dist.ProcessGroup, device: torch.device, sharding: str,
                mesh: Any = None, ignored: set[nn.Parameter] | None = None) -> nn.Module:
    """Shard ``module`` (a stage, on ``device``) over the ranks of ``group`` with FSDP2, block
    by block and then as a whole; ``sharding`` "zero3" or "zero2". ``mesh``: FSDP2's DeviceMesh
    when given (a tensor-parallel stage's: its (data, tensor) mesh's data dimension), else one
    of ``group``. ``ignored``: parameters FSDP2 leaves whole and alone (FSDP2's
    ``ignored_params``: a parameter stages share, whose copies the TR actions keep equal).
    Returns the module (FSDP2 shards in place)."""
    # lazy: the FSDP2 and DeviceMesh imports load torch.distributed's tensor machinery, which
    # plans and schedules never need
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh if mesh is not None else DeviceMesh.from_group(group, device.type)
    keep = sharding in ("zero2", "zero1")
    # zero1 gathers the whole stage at once (UN): one unit, one all-gather and one reduce-scatter
    # per minibatch; block units only pay off where blocks are gathered one at a time
    blocks = _blocks(module) if sharding != "zero1" else []
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=not keep, ignored_params=ignored or None)
    root = fully_shard(module, mesh=mesh, reshard_after_forward=not keep, ignored_params=ignored or None)
    if sharding == "zero1":  # gathered and reduced by the schedule's UN, RD and RS actions (module docstring)
        root.set_reshard_after_backward(False)
        root.set_requires_gradient_sync(False)
    log.info("stage sharded (%s) over ranks %s in %d blocks", sharding, dist.get_process_group_ranks(group),
             len(blocks) + 1)
    return module


def _units(module: nn.Module) -> list[nn.Module]:
    # lazy: FSDP2 is loaded by the sharded stage already
    from torch.distributed.fsdp import FSDPModule
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def gather_weights(module: nn.Module) -> int:
    """UN of a "zero1" stage: gather every FSDP2 unit's weights whole (FSDP2's ``unshard``, an
    all-gather among the replicas); they stay gathered until :func:`free_gathered`. Returns the
    bytes received (the other replicas' shards)."""
    received = _others_shard_bytes(module)
    for unit in _units(module):
        unit.unshard()
    return received


def _others_shard_bytes(module: nn.Module) -> int:
    """Bytes of the stage's weights that the other replicas hold (what a gather receives and a
    reduce-scatter sends); 0 while the weights are gathered."""
    shards = [p for p in module.parameters() if getattr(p, "device_mesh", None) is not None]
    return sum((p.numel() - local_tensor(p).numel()) * p.element_size() for p in shards)


def free_gathered(module: nn.Module) -> None:
    """RS of a "zero1" stage: free the gathered weights (FSDP2's ``reshard``)."""
    for unit in _units(module):
        unit.reshard()


def reduce_in_backward(module: nn.Module, on: bool) -> None:
    """Whether the next backwards of a "zero1" stage reduce-scatter the gradient they
    accumulated (on for the one B its ``RD`` follows; FSDP2 reduces from a backward's hooks)."""
    module.set_requires_gradient_sync(on)


class GatheredEvaluation(nn.Module):
    """A sharded stage's evaluation graph (torch.export fixes dropout's mode in a graph, so
    evaluation runs one of its own): each call gathers the training stage's weights whole
    (FSDP2's ``unshard``, a collective of the replicas: every replica evaluates the same
    microbatches), runs the graph with them in its parameter slots, and reshards. Built before
    the stage is sharded: the graph's slots are matched to the stage's parameter names by
    identity then."""

    def __init__(self, graph: nn.Module, trained: nn.Module) -> None:
        super().__init__()
        names = {id(p): n for n, p in trained.named_parameters()}
        # (owning module, attribute, the training stage's name) of every parameter slot of the graph
        slots = [(mod, attr, names[id(p)]) for mod in graph.modules() for attr, p in mod._parameters.items()
                 if p is not None and id(p) in names]
        self._parts = (graph, trained, slots)  # a tuple: not submodules (no second copy of their state)

    def forward(self, *inputs: Any) -> Any:
        # lazy: FSDP2 is loaded by the sharded stage already
        from torch.distributed.fsdp import FSDPModule

        graph, trained, slots = self._parts
        units = [m for m in trained.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        whole_weights = dict(trained.named_parameters())
        saved = [mod._parameters[attr] for mod, attr, _ in slots]
        try:
            for mod, attr, name in slots:
                mod._parameters[attr] = whole_weights[name]
            return graph(*inputs)
        finally:
            for (mod, attr, _), p in zip(slots, saved):
                mod._parameters[attr] = p
            for unit in units:
                unit.reshard()


def whole(t: Any) -> Any:
    """A sharded tensor gathered whole, on the CPU (collective over its replicas); any other
    tensor copied to the CPU; other values as they are."""
    if not isinstance(t, torch.Tensor):
        return t
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().cpu().clone()


def shard_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (a whole tensor) cut into ``like``'s layout where ``like`` is sharded: this
    replica's shard, taken locally (every replica holds ``t``); ``t`` itself otherwise."""
    mesh = getattr(like, "device_mesh", None)
    if mesh is None or getattr(t, "device_mesh", None) is not None:  # like whole, or t a shard already
        return t
    # lazy: DTensor's machinery, needed only by sharded stages
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(t.to(like.dtype), mesh, like.placements, src_data_rank=None)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state with every sharded tensor gathered whole (on the CPU). Collective over
    the shards' replicas: every replica of the stage calls it."""
    return {k: whole(v) for k, v in module.state_dict().items()}


def sharded_optimizer_entries(entries: dict[str, dict[str, Any]],
                              params: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Saved optimizer entries (whole tensors) cut to the shards of ``params`` (name ->
    parameter): a state tensor of its parameter's shape takes its layout (momentum, moments);
    others (a step count) stay as they are."""
    out = {}
    for name, entry in entries.items():
        p = params.get(name)
        state = entry["state"]
        if p is not None:
            state = {k: shard_like(v, p) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                     for k, v in state.items()}
        out[name] = {**entry, "state": state}
    return out


class ShardedWeights(WeightVersions):
    """The weights of a stage FSDP2 shards over its ``replicas`` (see the module docstring):
    one version, the optimizer on the shards, gradients reduced by FSDP2 in every backward."""

    sharded = True
    fsdp = True

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory, loss_reduction: str, replicas: int,
                 **options: Any) -> None:
        super().__init__(module, optimizer, loss_reduction, replicated=False, **options)
        self.replicas = replicas

    @property
    def can_defer(self) -> bool:
        """Never: the gradients live in the shards' ``.grad`` until the step."""
        return False

    def tensors(self, version: int) -> dict[str, torch.Tensor]:
        """No aliases: FSDP2 installs the gathered weights when the stage module runs."""
        if version != self.version:
            raise RuntimeError(f"weight version {version} was requested but this sharded stage holds version "
                               f"{self.version} only; the schedule's versions are inconsistent")
        return {}

    def _shard_grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.params]

    def allreduce(self, group: dist.ProcessGroup | None, timeout_s: float) -> int:
        """Sum the update's sample count over the replicas (FSDP2 reduced the gradients in the
        backwards); returns the bytes reduced."""
        if group is None:
            return 0
        count = torch.tensor([self._samples], dtype=torch.float64, device=self._device())
        wait_for(dist.all_reduce(count, group=group, async_op=True), timeout_s, "sample count all-reduce")
        self._samples = float(count[0].item())
        return count.numel() * count.element_size()

    def gradient_overflowed(self) -> bool:
        """Whether this rank's gradient shards hold an inf or NaN (every rank's answer is agreed
        by the loss scaler)."""
        return has_nonfinite([local_tensor(g) for g in self._shard_grads() if g is not None])

    def squared_norm(self, unscale: float = 1.0, timeout_s: float = 0.0, posted: int | None = None) -> torch.Tensor:
        """This rank's shards' part of the squared norm of the coming update's gradient (the
        clipper sums the parts of every rank, each shard counted once)."""
        present = [local_tensor(g) for g in self._shard_grads() if g is not None]
        if not present:
            return torch.zeros((), dtype=torch.float64)
        total = torch.stack(torch._foreach_norm(present)).double().square().sum()
        return total.cpu() * (self._scale(self._samples, unscale) * self.replicas) ** 2

    def step(self, unscale: float = 1.0, apply: bool = True) -> bool:
        """Apply the shards' gradient (times replicas / samples, see the module docstring)."""
        copied = self._apply(self._shard_grads(), self._samples, unscale * self.replicas, apply)
        for p in self.params:
            p.grad = None
        self._samples = 0.0
        return copied
