"""Page faults of a training step's allocation pattern, for the allocator tests (not a test module)."""

from __future__ import annotations

import resource


def faults_per_round() -> float:
    """Page faults per round of three 8 MiB buffers allocated, written and freed (like a step's
    activations), after six rounds of warm-up."""
    import torch

    def round_() -> None:
        buffers = [torch.empty(2 << 20).fill_(1.0) for _ in range(3)]
        del buffers

    for _ in range(6):
        round_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        round_()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5


def churn_worker(rank: int) -> float:
    """``faults_per_round`` in a worker of ``launch``."""
    return faults_per_round()
