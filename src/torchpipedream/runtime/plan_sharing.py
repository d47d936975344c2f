"""``share_plan``: one rank's plan on every rank, as JSON bytes in a tensor (nothing unpickled).

Profiling measures time, so ranks that each profiled and planned could reach different plans;
one rank plans and the others receive its plan. ``dist.broadcast_object_list`` would do it
with pickle, which runs whatever code the bytes name: a plan is data, so it travels as JSON
and is checked by :meth:`Plan.from_dict` on arrival.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ..plans.plan import Plan

__all__ = ["share_plan"]


def share_plan(plan: Plan | None, src: int = 0, group: Any = None) -> Plan:
    """Rank ``src``'s ``plan`` on every rank of ``group`` (collective: every rank calls it; the
    others pass None). Uses the default process group's device rules (CPU tensors for gloo)."""
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    if rank == src:
        if not isinstance(plan, Plan):
            raise TypeError(f"share_plan: rank {src} must pass its Plan, got {type(plan).__name__}")
        data = json.dumps(plan.to_dict()).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if rank == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=src, group=group)
    return Plan.from_dict(json.loads(bytes(buf.cpu().numpy().tobytes()).decode()), source=f"the plan of rank {src}")
