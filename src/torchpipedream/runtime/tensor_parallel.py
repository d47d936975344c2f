"""Tensor parallelism inside pipeline stages (``Plan.tensor_parallel``): each worker of the plan
is t ranks that split its stage's layers with torch's DTensor (``parallelize_module``).

The split is torch's own; what this module adds is which layers a stage splits and how a
pipeline stage drives them:

* **Ranks.** Worker w of the plan runs on global ranks w·t … w·t + t − 1 (its tensor-parallel
  group, the innermost dimension of the (pipeline, data, tensor) mesh; ``Plan.ranks_of_worker``).
  The t ranks run the worker's schedule actions in lockstep on the same microbatches.
* **Who sends what.** A stage's outputs and its inputs' gradients are whole on each of its
  tensor ranks (every layout below ends a stage's split layers with a row-wise layer, whose
  all-reduce makes them whole), so tensor rank i of a stage exchanges its messages with tensor
  rank i of the neighbouring stage: t transfers of the same bytes side by side, each between
  its own pair of processes, and no broadcast after them (``Pipeline`` maps the schedule's
  workers to ranks for ``P2P``). The other choice, one send and a broadcast in the receiving
  group, puts a collective on every cut; with counterparts the cut stays point to point.
* **Layouts.** By default (:func:`linear_pairs`) a stage splits every pair of ``nn.Linear``
  layers with only element-wise work between them (an MLP's fc1 → activation → fc2: Megatron's
  pattern): the first column-wise (``ColwiseParallel``: its output features split), the second
  row-wise (``RowwiseParallel``: its input features split, its outputs all-reduced). One
  all-reduce per pair in the forward, one in the backward (DTensor's). :func:`named_blocks` adds
  attention and MLP blocks by their layers' names (Llama's q/k/v/gate/up column-wise, o/down
  row-wise: torchtitan's plan, for stage modules built from Hugging Face blocks), and GPT-2's
  blocks of ``Conv1D`` layers (``c_fc`` column-wise, ``c_proj`` row-wise, the fused ``c_attn``
  by heads, "qkv": ``conv1d_styles``). Every other layer runs whole on each tensor rank, as
  Megatron runs its layer norms, and so does a parameter stages share (its copies are the TR
  actions'). ``Pipeline(tensor_layout=)`` gives a layout instead: the model's module names →
  ``"colwise"``, ``"rowwise"``, ``"qkv"`` or a ``ParallelStyle``; it must leave each stage's
  outputs whole. A model
  torch.export traced has no layer modules left to wrap: ``Pipeline`` refuses it by name.
* **Weights.** :class:`TensorParallelWeights`: one weight version, no aliases (DTensor
  parameters are used as they are), the stage module back-propagated into whatever it holds;
  the replicas of a replicated stage all-reduce the local parts of their gradients (each
  tensor rank with its counterparts, over the same shard). Clipping counts a split weight's
  parts once each and a whole weight once per worker (each tensor rank adds 1/t of it).
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import fx, nn

from .sharding import ShardedWeights, local_tensor
from .weights import OptimizerFactory, wait_for

__all__ = ["linear_pairs", "named_blocks", "COLWISE_NAMES", "ROWWISE_NAMES", "stage_layout", "stage_meshes", "parallelize_stage", "TensorParallelWeights", "TensorLayoutError",
           "check_layout_names", "STYLE_NAMES", "is_conv1d",
           "split_layers_problem"]

log = logging.getLogger(__name__)

#: Layout values a user may write by name (``Pipeline(tensor_layout=)``): "qkv" is a fused
#: query/key/value projection split by heads (GPT-2's ``c_attn``: ``conv1d_styles``).
STYLE_NAMES = ("colwise", "rowwise", "qkv")

#: Modules and functions that act on each element alone: what may sit between a column-wise and a
#: row-wise Linear (they then act on each tensor rank's slice of the features).
_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish,
                        nn.Hardswish, nn.Dropout, nn.Identity, nn.ReLU6, nn.Softplus)
_ELEMENTWISE_FUNCTIONS = {torch.relu, torch.tanh, torch.sigmoid, nn.functional.relu, nn.functional.gelu,
                          nn.functional.silu, nn.functional.tanh, nn.functional.sigmoid, nn.functional.leaky_relu,
                          nn.functional.dropout, nn.functional.elu, nn.functional.mish, operator.neg}
_ELEMENTWISE_METHODS = {"relu", "tanh", "sigmoid", "neg"}


class TensorLayoutError(ValueError):
    """A tensor-parallel layout does not fit the stage (the message names the module)."""


def _elementwise(module: nn.Module, node: fx.Node, source: fx.Node) -> bool:
    """``node`` acts on ``source`` element by element and reads no other tensor."""
    others = [a for a in node.all_input_nodes if a is not source]
    if others:
        return False
    if node.op == "call_module":
        return isinstance(module.get_submodule(str(node.target)), _ELEMENTWISE_MODULES)
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    return node.op == "call_method" and node.target in _ELEMENTWISE_METHODS


def _graph_pairs(module: fx.GraphModule) -> list[tuple[str, str]]:
    """(column-wise, row-wise) Linear pairs of a traced stage: a Linear called once whose output
    reaches, through element-wise nodes used once each, exactly one other Linear called once."""
    calls: dict[str, int] = {}
    for n in module.graph.nodes:
        if n.op == "call_module":
            calls[str(n.target)] = calls.get(str(n.target), 0) + 1

    def linear(n: fx.Node) -> bool:
        return n.op == "call_module" and calls[str(n.target)] == 1 \
            and isinstance(module.get_submodule(str(n.target)), nn.Linear)

    pairs = []
    for first in (n for n in module.graph.nodes if linear(n)):
        cur = first
        while len(cur.users) == 1:
            nxt = next(iter(cur.users))
            if linear(nxt) and nxt.args[0] is cur and len(nxt.all_input_nodes) == 1:
                pairs.append((str(first.target), str(nxt.target)))
                break
            if not _elementwise(module, nxt, cur):
                break
            cur = nxt
    return pairs


def _sequential_pairs(module: nn.Sequential, prefix: str = "") -> list[tuple[str, str]]:
    """(column-wise, row-wise) Linear pairs among a Sequential's consecutive layers."""
    layers = list(module.named_children())
    pairs = []
    for i, (name, layer) in enumerate(layers):
        if not isinstance(layer, nn.Linear):
            continue
        for later_name, later in layers[i + 1:]:
            if isinstance(later, nn.Linear):
                pairs.append((prefix + name, prefix + later_name))
                break
            if not isinstance(later, _ELEMENTWISE_MODULES):
                break
    return pairs


def linear_pairs(module: nn.Module, degree: int) -> dict[str, str]:
    """The default layout of a stage: its Linear pairs (see the module docstring) whose inner
    width ``degree`` divides, as module name -> "colwise" / "rowwise"; the pairs never overlap."""
    if isinstance(module, fx.GraphModule):
        found = _graph_pairs(module)
    elif isinstance(module, nn.Sequential):
        found = _sequential_pairs(module)
    else:
        return {}
    layout: dict[str, str] = {}
    for first, second in found:
        width = module.get_submodule(first).out_features
        if first in layout or second in layout or width % degree:
            continue
        layout[first], layout[second] = "colwise", "rowwise"
    return layout


#: The layer names Megatron's layout splits column-wise (a block's first projections: attention's
#: query, key and value, a gated MLP's two up projections) and row-wise (the projections back to
#: the model's width), as Hugging Face's Llama, Mistral and Qwen and Meta's own Llama code name them.
COLWISE_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "wq", "wk", "wv", "w1", "w3"})
ROWWISE_NAMES = frozenset({"o_proj", "down_proj", "wo", "w2"})


def _gpt2_block(block: nn.Module, degree: int) -> dict[str, str]:
    """The layout of a GPT-2 attention (``c_attn`` fused query/key/value, ``c_proj``) or MLP
    (``c_fc``, ``c_proj``) made of ``Conv1D`` layers, or {} (not one, or ``degree`` does not
    divide its heads or its inner width)."""
    convs = {n: m for n, m in block.named_children() if is_conv1d(m)}
    if "c_proj" not in convs or ("c_attn" in convs) == ("c_fc" in convs):
        return {}
    if "c_attn" in convs:  # self-attention: three parts of split_size each, heads split whole
        heads, width = getattr(block, "num_heads", 0), getattr(block, "split_size", 0)
        if not heads or convs["c_attn"].nf != 3 * width or heads % degree or width % degree:
            return {}
        return {"c_attn": "qkv", "c_proj": "rowwise"}
    return {} if convs["c_fc"].nf % degree else {"c_fc": "colwise", "c_proj": "rowwise"}


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` (``conv1d_styles.is_conv1d``)."""
    from .conv1d_styles import is_conv1d as conv1d  # lazy: that module imports DTensor (0.4 s)
    return conv1d(module)


def named_blocks(module: nn.Module, degree: int) -> dict[str, str]:
    """The layout of a stage's attention and MLP blocks by their layers' names (torchtitan's
    Llama plan): in every module whose Linear children include both :data:`COLWISE_NAMES` and
    :data:`ROWWISE_NAMES`, the first column-wise and the second row-wise, where ``degree``
    divides every width split; GPT-2's Conv1D blocks alike (``c_attn`` by heads, "qkv";
    ``c_fc`` column-wise; ``c_proj`` row-wise). Attention then runs on each tensor rank's share
    of the heads (Llama's code takes the head count from the projections' widths; GPT-2's is
    told: :func:`parallelize_stage`)."""
    layout: dict[str, str] = {}
    for parent, block in module.named_modules():
        prefix = f"{parent}." if parent else ""
        layout.update({prefix + n: style for n, style in _gpt2_block(block, degree).items()})
        linears = {n: m for n, m in block.named_children() if isinstance(m, nn.Linear)}
        col = [n for n in linears if n in COLWISE_NAMES]
        row = [n for n in linears if n in ROWWISE_NAMES]
        if not (col and row):
            continue
        widths = [linears[n].out_features for n in col] + [linears[n].in_features for n in row]
        if any(w % degree for w in widths):
            continue
        layout.update({prefix + n: "colwise" for n in col} | {prefix + n: "rowwise" for n in row})
    return layout


def check_layout_names(layout: Mapping[str, Any], model: nn.Module | None) -> dict[str, Any]:
    """A user's layout checked: every value a style name or a ParallelStyle, every name a module of
    ``model`` (when the whole model is given). Returns it as a dict."""
    # lazy: DTensor's parallel styles, needed only by tensor-parallel plans
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(layout, Mapping):
        raise TensorLayoutError(f"tensor_layout must map module names to 'colwise', 'rowwise' or a ParallelStyle, "
                                f"got a {type(layout).__name__}")
    known = dict(model.named_modules()) if model is not None else None
    for name, style in layout.items():
        if not (style in STYLE_NAMES or isinstance(style, ParallelStyle)):
            raise TensorLayoutError(f"tensor_layout[{name!r}] must be 'colwise', 'rowwise' or a ParallelStyle, "
                                    f"got {style!r:.60}")
        if known is not None and name not in known:
            raise TensorLayoutError(f"tensor_layout names {name!r}, which is not a module of the model")
    return dict(layout)


def stage_layout(module: nn.Module, degree: int, given: Mapping[str, Any] | None,
                 model_names: Mapping[str, str]) -> dict[str, Any]:
    """The layout of one stage: ``given`` (keyed by the model's module names, translated to the
    stage's through ``model_names``: stage parameter name -> model's) restricted to the stage's
    modules, else :func:`linear_pairs` and :func:`named_blocks`. Every split module must be a
    Linear or GPT-2 Conv1D (or Embedding, for a ParallelStyle) whose split dimension ``degree``
    divides."""
    if given is None:
        pairs = linear_pairs(module, degree)
        return pairs | {n: style for n, style in named_blocks(module, degree).items() if n not in pairs}
    stage_name = {m.rpartition(".")[0]: s.rpartition(".")[0] for s, m in model_names.items()}
    layout = {stage_name[name]: style for name, style in given.items() if name in stage_name}
    for name, style in layout.items():
        _check_style(name, module.get_submodule(name), style, degree, module)
    return layout


def _check_style(name: str, sub: nn.Module, style: Any, degree: int, stage: nn.Module) -> None:
    """A user's layout entry checked against the stage's module: a style name on an nn.Linear or
    a GPT-2 Conv1D ("qkv" on an attention's fused ``c_attn`` only), its split width divisible
    by ``degree``."""
    if not isinstance(style, str):
        return
    conv = is_conv1d(sub)
    if not (conv or isinstance(sub, nn.Linear)):
        raise TensorLayoutError(f"tensor_layout[{name!r}] = {style!r}: the module is a {type(sub).__name__}, "
                                "and 'colwise' / 'rowwise' split an nn.Linear or a transformers Conv1D "
                                "(give a ParallelStyle for others)")
    if style == "qkv":
        parent = stage.get_submodule(name.rpartition(".")[0])
        if not conv or name.rpartition(".")[2] != "c_attn" or _gpt2_block(parent, 1).get("c_attn") != "qkv":
            raise TensorLayoutError(f"tensor_layout[{name!r}] = 'qkv' splits a GPT-2 attention's fused c_attn "
                                    f"(a Conv1D of 3 × split_size outputs), not a {type(sub).__name__} there")
        if not _gpt2_block(parent, degree):
            raise TensorLayoutError(f"tensor_layout[{name!r}]: the attention's {parent.num_heads} heads of "
                                    f"{parent.split_size // parent.num_heads} features do not split evenly over "
                                    f"{degree} tensor ranks")
        return
    inputs, outputs = (sub.nx, sub.nf) if conv else (sub.in_features, sub.out_features)
    width = outputs if style == "colwise" else inputs
    if width % degree:
        raise TensorLayoutError(f"tensor_layout[{name!r}]: {type(sub).__name__} with {width} features does not "
                                f"split evenly over {degree} tensor ranks")


def split_layers_problem(layout: Mapping[str, Any], shared: Mapping[str, str], sharding: str | None) -> str | None:
    """Why a stage cannot split its layers as ``layout`` says, naming the layer, or None:
    ``shared`` (a stage parameter's name -> what shares it) must stay whole on each tensor rank
    (the TR actions keep its copies equal), and a fused query/key/value split ("qkv") is not
    run under FSDP2 (``sharding``: the stage's, None where it replicates) yet."""
    for local, what in shared.items():
        owner = local.rpartition(".")[0]
        if owner in layout:
            return (f"tensor_layout splits {owner!r}, whose parameter is {what}; a shared parameter stays whole "
                    "on each tensor rank: leave that layer out of the layout")
    fused = [name for name, style in layout.items() if style == "qkv"]
    if fused and sharding is not None:
        return (f"the stage is sharded ({sharding}) and its layout splits {fused[0]!r} by heads ('qkv'): FSDP2 over "
                "a fused projection's split is not supported yet; use sharding 'replicate' there")
    return None


def stage_meshes(grid: list[list[int]], data_group: dist.ProcessGroup | None, tensor_group: dist.ProcessGroup,
                 device: torch.device) -> tuple[Any, Any]:
    """The DeviceMeshes of a tensor-parallel stage whose ranks are ``grid`` (replicas × tensor
    ranks): (tensor mesh, None), or with ``data_group`` (the stage is sharded too: this rank's
    counterparts on the other replicas) the two dimensions of one (data, tensor) mesh, as
    torch's FSDP2 needs over tensor-parallel weights."""
    # lazy: DTensor's machinery, needed only by tensor-parallel plans
    from torch.distributed.device_mesh import DeviceMesh

    if data_group is None:
        return DeviceMesh.from_group(tensor_group, device.type), None
    mesh = DeviceMesh.from_group([data_group, tensor_group], device.type, mesh=torch.tensor(grid),
                                 mesh_dim_names=("data", "tensor"))
    return mesh["tensor"], mesh["data"]


def parallelize_stage(module: nn.Module, mesh: Any, layout: Mapping[str, Any]) -> nn.Module:
    """Split ``module``'s layers over the ranks of ``mesh`` (a 1-D DeviceMesh: a worker's tensor
    ranks) as ``layout`` says (torch's ``parallelize_module``). Returns the module (split in place)."""
    # lazy: DTensor's tensor-parallel machinery, needed only by tensor-parallel plans
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: (_conv1d_style(s) if is_conv1d(module.get_submodule(name)) else styles[s]()) if isinstance(s, str)
            else s for name, s in layout.items()}
    if plan:
        parallelize_module(module, mesh, plan)
        fused = {name for name, s in layout.items() if s == "qkv"}
        if fused:
            from .conv1d_styles import localize_attention  # lazy: as above
            localize_attention(module, fused, mesh.size())
        log.info("stage split over tensor ranks %s: %s", mesh.mesh.tolist(),
                 ", ".join(f"{n} {s}" for n, s in layout.items()))
    else:
        log.warning("tensor parallelism: a stage has no layer to split (no Linear pair; give tensor_layout): "
                    "each of its tensor ranks runs it whole")
    return module


def _conv1d_style(style: str) -> Any:
    """The ParallelStyle of a Conv1D for a style name (conv1d_styles)."""
    from .conv1d_styles import Conv1DColwise, Conv1DRowwise  # lazy: DTensor, as parallelize_stage's

    return Conv1DRowwise() if style == "rowwise" else Conv1DColwise(fused=3 if style == "qkv" else 1)


def _parts(t: torch.Tensor) -> int:
    """Into how many distinct parts ``t`` is cut over the ranks (1 for a whole tensor; a DTensor:
    the product of its mesh's sharded dimensions: neither replicated nor partial sums; FSDP2's
    strided shard over a tensor-parallel one counts)."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return 1
    return math.prod(mesh.size(d) for d, placement in enumerate(t.placements)
                     if not (placement.is_replicate() or placement.is_partial()))


class TensorParallelWeights(ShardedWeights):
    """The weights of a tensor-parallel stage (see the module docstring): one version, DTensor
    parameters used as they are. A replicated stage's replicas all-reduce their gradients part
    by part; a sharded one's are reduce-scattered by FSDP2 in each backward (ShardedWeights')."""

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory, loss_reduction: str, degree: int,
                 replicas: int, sharded: bool, **options: Any) -> None:
        # FSDP2 averages its gradients over the replicas (ShardedWeights multiplies them back);
        # all-reduced parts are sums
        super().__init__(module, optimizer, loss_reduction, replicas=replicas if sharded else 1, **options)
        self.degree, self.stage_ranks, self.fsdp = degree, replicas * degree, sharded

    def tensors(self, version: int) -> dict[str, torch.Tensor]:
        """The stage's own (DTensor) parameters: nothing is installed in the module (no slots), but
        a split backward differentiates with respect to them (its W); FSDP2's gather its own."""
        super().tensors(version)  # one version: refuses any other
        return {} if self.fsdp else dict(zip(self.names, self.params))

    def allreduce(self, group: dist.ProcessGroup | None, timeout_s: float) -> int:
        """Sum the update's sample count, and unless FSDP2 reduced them, the local parts of its
        gradients, over the stage's replicas (this tensor rank's counterparts); returns the
        bytes reduced."""
        if group is None or self.fsdp:
            return super().allreduce(group, timeout_s)
        with torch.no_grad():  # local_tensor is then the DTensor's own storage: written in place below
            for p in self.params:
                if p.grad is None:  # a weight this replica's microbatches did not reach: its zero
                    p.grad = torch.zeros_like(p)
            parts = [local_tensor(p.grad) for p in self.params]
            count = torch.tensor([self._samples], dtype=parts[0].dtype if parts else torch.float64,
                                 device=self._device())
            flat = torch.cat([t.reshape(-1) for t in parts] + [count])
            wait_for(dist.all_reduce(flat, group=group, async_op=True), timeout_s, "gradient all-reduce")
            offset = 0
            for t in parts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        self._samples = float(flat[-1].item())
        return flat.numel() * flat.element_size()

    def squared_norm(self, unscale: float = 1.0, timeout_s: float = 0.0, posted: int | None = None) -> torch.Tensor:
        """This rank's part of the squared norm of the coming update's gradient: each gradient's
        local part times (distinct parts / the stage's ranks), so that summed over the stage's
        ranks every element counts once (a split weight's part once; a whole weight, or a part
        that several ranks hold alike, a share on each)."""
        by_share: dict[float, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is not None:
                by_share.setdefault(_parts(p.grad) / self.stage_ranks, []).append(local_tensor(p.grad))
        total = torch.zeros((), dtype=torch.float64)
        for share, grads in by_share.items():
            total = total + torch.stack(torch._foreach_norm(grads)).double().square().sum().cpu() * share
        return total * (self._scale(self._samples, unscale) * self.replicas) ** 2
