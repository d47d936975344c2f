"""The runtime: stage modules, weight versions, point-to-point transfers, the per-rank engine,
the ``Pipeline`` API and the local launcher.

Import cost: this package imports torch (unlike the graph, planner and schedule modules).
"""

from __future__ import annotations

from .checkpoint import CheckpointError, latest_checkpoint, verify_checkpoint
from .failures import PipelineFailure
from .launcher import LaunchError, launch
from .loss_scaling import LossScaling
from .lr_schedule import LRSchedule
from .pipeline import Pipeline, PipelineError, forward_only
from .plan_sharing import share_plan
from .stage_split import StageSplitError, split_stages

__all__ = ["Pipeline", "PipelineError", "launch", "LaunchError", "split_stages", "StageSplitError", "forward_only",
           "CheckpointError", "latest_checkpoint", "verify_checkpoint", "PipelineFailure", "share_plan",
           "LossScaling", "LRSchedule"]
