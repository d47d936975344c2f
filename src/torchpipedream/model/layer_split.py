"""Split wide linear layers into column parts, so that pipeline stages can balance.

A stage boundary can only fall between layers. When one layer holds a large share of the work
(a VGG-style classifier: 4096→4096→4096→1000), the best two-stage split of whole layers
leaves one stage idle a third of the time. ``split_wide_layers`` rewrites each wide
``nn.Linear`` (y = x Wᵀ + b) as ``parts`` narrower ones over row blocks of W (each computes a
contiguous slice of y's features) followed by ``torch.cat``, so the planner may cut between
parts. The function is unchanged — same outputs, same gradients with respect to every weight
element, so plain SGD, momentum and Adam (all elementwise) train it exactly as the original.
A cut inside a split layer sends the layer's input and the finished parts to the next stage;
the gradient of that input is summed by autograd on the stage that produced it.

The weights live in new parameters (``<layer>_part<i>``); ``merge_split_state_dict`` maps a
state dict of the split model back to the original layer names (the split model's
``split_layers`` attribute records which layers were split).
"""

from __future__ import annotations

import logging

import torch
from torch import fx, nn

__all__ = ["split_wide_layers", "merge_split_state_dict", "SPLIT_SUFFIX"]

log = logging.getLogger(__name__)

#: Name of part ``i`` of a split layer ``name``: ``f"{name}{SPLIT_SUFFIX}{i}"`` (dots become _).
SPLIT_SUFFIX = "_part"


def _part_name(target: str, i: int) -> str:
    return f"{target.replace('.', '_')}{SPLIT_SUFFIX}{i}"


def split_wide_layers(model: nn.Module, parts: int, min_out_features: int = 1024) -> fx.GraphModule:
    """A copy of ``model`` (traced with torch.fx) whose ``nn.Linear`` layers with at least
    ``min_out_features`` outputs are split into ``parts`` column parts (nearly equal sizes).

    Raises:
        ValueError: ``parts`` < 1 or the model cannot be traced by torch.fx.
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive integer, got {parts!r}")
    try:
        gm = fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many kinds of errors for untraceable code
        raise ValueError(f"split_wide_layers needs a model torch.fx can trace: {type(exc).__name__}: {exc}") from None
    modules = dict(gm.named_modules())
    split: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        layer = modules[node.target]
        if not isinstance(layer, nn.Linear) or layer.out_features < max(min_out_features, parts) or parts == 1:
            continue
        bounds = torch.linspace(0, layer.out_features, parts + 1).round().long().tolist()
        outs = []
        with gm.graph.inserting_before(node):
            for i in range(parts):
                lo, hi = bounds[i], bounds[i + 1]
                # skip_init: no random initialisation (the weights are copied), so the caller's
                # global random state is left as it was
                piece = nn.utils.skip_init(nn.Linear, layer.in_features, hi - lo, bias=layer.bias is not None,
                                           device=layer.weight.device, dtype=layer.weight.dtype)
                with torch.no_grad():
                    piece.weight.copy_(layer.weight[lo:hi])
                    if layer.bias is not None:
                        piece.bias.copy_(layer.bias[lo:hi])
                piece.weight.requires_grad_(layer.weight.requires_grad)
                if layer.bias is not None:
                    piece.bias.requires_grad_(layer.bias.requires_grad)
                name = _part_name(node.target, i)
                gm.add_submodule(name, piece)
                outs.append(gm.graph.call_module(name, node.args, node.kwargs))
            joined = gm.graph.call_function(torch.cat, (tuple(outs), -1))
        node.replace_all_uses_with(joined)
        gm.graph.erase_node(node)
        gm.delete_submodule(node.target)
        split[node.target.replace(".", "_")] = node.target
    gm.graph.lint()
    gm.recompile()
    gm.split_layers = split  # part stem -> the original layer's name
    log.info("split %d linear layer(s) into %d parts each: %s", len(split), parts, sorted(split.values()))
    return gm


def merge_split_state_dict(state: dict[str, torch.Tensor], split_layers: dict[str, str]) -> dict[str, torch.Tensor]:
    """The state dict of the original model from one of the split model (``split_layers`` is
    its ``split_layers`` attribute): the parts are concatenated back under the layer's name."""
    merged: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        module, _, field = key.rpartition(".")
        stem, sep, index = module.rpartition(SPLIT_SUFFIX)
        if sep and index.isdigit() and stem in split_layers and field in ("weight", "bias"):
            groups.setdefault((stem, field), {})[int(index)] = value
        else:
            merged[key] = value
    for (stem, field), pieces in groups.items():
        merged[f"{split_layers[stem]}.{field}"] = torch.cat([pieces[i] for i in sorted(pieces)], dim=0)
    return merged
