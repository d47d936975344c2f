"""Which process-group backend and which compute device a rank uses by default: one rule for
``Pipeline``, ``launch`` and the ``train`` command.

* **Backend.** NCCL only where it can work: CUDA and NCCL are available and this node has a
  GPU for each of its ranks (NCCL refuses two ranks on one GPU: "Duplicate GPU detected").
  Otherwise gloo, on CPUs or GPUs alike: gloo's point-to-point moves host memory only, so
  ``comm.P2P`` stages a CUDA rank's messages through host memory (its *wire device*).
* **Compute device.** ``cuda:(LOCAL_RANK % device_count)`` wherever CUDA is available, whatever
  the backend (two ranks sharing one GPU both compute on it), else cpu.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["default_backend", "default_device", "ranks_per_node", "wire_device"]


def ranks_per_node(default: int = 1) -> int:
    """The number of ranks on this node: ``LOCAL_WORLD_SIZE`` (set by torchrun and ``launch``),
    else ``default``."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else default


def default_backend(ranks_per_node: int) -> str:
    """"nccl" when CUDA and NCCL are available and this node has at least one GPU per rank
    (``ranks_per_node`` of them), else "gloo"."""
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= max(1, ranks_per_node) else "gloo"


def default_device() -> torch.device:
    """This rank's compute device: ``cuda:(LOCAL_RANK % device_count)`` when CUDA is available
    (whatever the backend), else cpu."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())


def wire_device(backend: str, device: torch.device) -> torch.device:
    """Where messages of a rank computing on ``device`` travel: host memory with gloo (its
    send and receive take CPU tensors only), the compute device itself otherwise (NCCL)."""
    return torch.device("cpu") if backend == "gloo" else device
