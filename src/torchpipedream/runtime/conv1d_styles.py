"""GPT-2's ``Conv1D`` layers split over a worker's tensor ranks: the column-wise and row-wise
styles of torch's tensor parallelism for a layer torch's own styles do not take.

Hugging Face's ``Conv1D`` (GPT-2, GPT, and models built from them) is a Linear layer whose
weight is stored transposed, (in features, out features), and whose forward is
``addmm(bias, x, weight)`` viewed back to ``x``'s leading dimensions and ``nf`` outputs.
torch's ``ColwiseParallel`` and ``RowwiseParallel`` take ``nn.Linear`` and ``nn.Embedding``
only, so these two styles do what they do for a ``Conv1D``, with torch's DTensor doing the
arithmetic (``distribute_module``, ``distribute_tensor``):

* :class:`Conv1DColwise` shards the output features: the weight on its dimension 1, the bias on
  its dimension 0; the input is whole on every tensor rank and the output is this rank's share
  of the features, handed on as a plain tensor.
* A **fused** projection (GPT-2's ``c_attn``: query, key and value side by side, 3 × d outputs)
  cannot be cut into contiguous pieces: rank 0 would get all the queries and half the keys.
  ``Conv1DColwise(fused=3)`` gives rank i the i-th piece of *each* of the three parts (its
  heads' queries, keys and values) with DTensor's strided shard (``_StridedShard(dim,
  split_factor=3)``): the weight stays one parameter of its own shape and name, and gathering
  it (``full_tensor``, a state dict) gives back the model's own tensor. DCP cannot describe a
  strided shard on one mesh dimension as a chunk, so checkpoints save and load such a tensor
  whole (``dcp_files``).
* :class:`Conv1DRowwise` shards the input features: the weight on its dimension 0, the bias
  whole; each rank's output is a partial sum, all-reduced to the whole output.

The attention that reads a fused projection's output must split it into the local width:
:func:`localize_attention` sets GPT-2's ``split_size`` (and its head count and width) to the
tensor rank's share, as torchtitan sets a split attention's head count.

Importing this module imports torch's DTensor (about 0.4 s): ``tensor_parallel`` imports it
when a stage is split.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = ["Conv1DColwise", "Conv1DRowwise", "is_conv1d", "localize_attention", "strided"]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` (GPT-2's Linear with its weight stored
    transposed; by class name and weight shape, so nothing of transformers is imported to ask)."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
        and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))


def strided(t: Any) -> bool:
    """Whether ``t`` is a DTensor with a strided shard on a one-dimensional mesh (a fused
    projection's part, which DCP cannot save as a chunk)."""
    placements = getattr(t, "placements", None)
    return placements is not None and len(placements) == 1 and isinstance(placements[0], _StridedShard)


class _Conv1DStyle(ParallelStyle):
    """What both styles share: torch's ``distribute_module`` with the style's parameter
    placements (:meth:`_placements`) and its conversions of the input and the output."""

    input_placement: Placement

    def __init__(self, fused: int = 1) -> None:
        super().__init__()
        if fused < 1:
            raise ValueError(f"fused must be at least 1, got {fused}")
        self.fused = fused

    def _placements(self) -> dict[str, Placement]:
        raise NotImplementedError

    def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
        for attr, placement in self._placements().items():
            p = getattr(module, attr, None)
            if p is not None:
                module.register_parameter(attr, nn.Parameter(
                    distribute_tensor(p.data, mesh, [placement], src_data_rank=self.src_data_rank),
                    requires_grad=p.requires_grad))

    def _input(self, module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_placement], run_check=False)
        return (x, *inputs[1:])

    @staticmethod
    def _output(module: nn.Module, output: Any, mesh: Any) -> Any:
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_conv1d(module):
            raise TypeError(f"{type(self).__name__} splits a transformers Conv1D, got a {type(module).__name__}")
        return distribute_module(module, device_mesh, self._partition, self._input, self._output)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({f'fused={self.fused}' if self.fused > 1 else ''})"


class Conv1DColwise(_Conv1DStyle):
    """A Conv1D split by its output features; with ``fused`` parts side by side (GPT-2's
    ``c_attn``: 3), each part split alike (the module docstring)."""

    input_placement = Replicate()

    def _placements(self) -> dict[str, Placement]:
        if self.fused == 1:
            return {"weight": Shard(1), "bias": Shard(0)}
        return {"weight": _StridedShard(1, split_factor=self.fused), "bias": _StridedShard(0, split_factor=self.fused)}

    @staticmethod
    def _output(module: nn.Module, output: Any, mesh: Any) -> Any:
        return output.to_local()  # this rank's share of the features


class Conv1DRowwise(_Conv1DStyle):
    """A Conv1D split by its input features; its partial sums all-reduced to the whole output."""

    input_placement = Shard(-1)

    def _placements(self) -> dict[str, Placement]:
        return {"weight": Shard(0), "bias": Replicate()}

    @staticmethod
    def _output(module: nn.Module, output: Any, mesh: Any) -> Any:
        return output.redistribute(mesh, [Replicate()]).to_local()


def localize_attention(module: nn.Module, fused_layers: set[str], degree: int) -> list[str]:
    """Set every GPT-2 attention of ``module`` whose fused projection (``<name>.c_attn``) is among
    ``fused_layers`` to run on its tensor rank's share of the heads: its ``split_size``,
    ``embed_dim`` and ``num_heads`` divided by ``degree``. Returns the attentions' names."""
    done = []
    for name, attn in module.named_modules():
        prefix = f"{name}." if name else ""
        if prefix + "c_attn" in fused_layers and hasattr(attn, "split_size"):
            attn.split_size //= degree
            attn.embed_dim //= degree
            attn.num_heads //= degree
            done.append(name)
    return done
