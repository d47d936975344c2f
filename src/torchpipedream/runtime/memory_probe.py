"""The peak of tensor memory a stretch of code allocates, on CPU and CUDA alike.

On CUDA the caching allocator keeps the statistics (``torch.cuda.max_memory_allocated``). A CPU
has no such counter, so :func:`allocation_peak` records the allocator's events with PyTorch's
profiler (``profile_memory=True``): every allocation and free made while it runs, in order,
whose running sum peaks at the most bytes the code held at once beyond what was allocated
before it started (a free of an older tensor is not reported, so it never lowers the count).
That is an allocator hook, not a sample: a peak that lasts one operation is seen.

Profiling costs time (each operation is recorded), so measure memory in runs of its own, not
in the runs that measure speed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from .sharding import local_tensor

__all__ = ["AllocationPeak", "allocation_peak", "held_bytes"]


@dataclass
class AllocationPeak:
    """Filled when the ``allocation_peak`` block ends: the most bytes allocated in it at once
    (beyond what was held when it started), and the bytes still held at its end."""

    peak_bytes: int = 0
    end_bytes: int = 0


@contextlib.contextmanager
def allocation_peak(device: torch.device | str = "cpu") -> Iterator[AllocationPeak]:
    """Measure the peak tensor memory the block allocates on ``device`` (see the module doc)."""
    dev = torch.device(device)
    result = AllocationPeak()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        yield result
        torch.cuda.synchronize(dev)
        result.peak_bytes = torch.cuda.max_memory_allocated(dev) - start
        result.end_bytes = torch.cuda.memory_allocated(dev) - start
        return
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    total = peak = 0
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    for event in sorted(events, key=lambda e: e.start_ns()):
        total += event.nbytes()
        peak = max(peak, total)
    result.peak_bytes, result.end_bytes = int(peak), int(total)


def held_bytes(*groups: object) -> int:
    """Bytes of the distinct tensor storages in ``groups`` (tensors, or iterables / dicts of
    them, nested): what a stage holds, each storage counted once however many views share it
    (of a sharded tensor, this rank's shard)."""
    seen: dict[int, int] = {}

    def visit(x: object) -> None:
        if isinstance(x, torch.Tensor):
            local = local_tensor(x)  # of a sharded tensor (DTensor), this rank's shard
            if local.device.type != "meta":
                s = local.untyped_storage()
                if s.data_ptr():
                    seen[s.data_ptr()] = s.nbytes()
            grad = x.grad if x.is_leaf and x.requires_grad else None
            if grad is not None:
                visit(grad)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                visit(v)

    for g in groups:
        visit(g)
    return sum(seen.values())
