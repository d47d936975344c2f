"""torchpipedream: PipeDream pipeline-parallel training for PyTorch.

profile → LayerGraph → plan → Plan → build_schedule → Schedule → simulate / runtime → Trace.

Every name in ``__all__`` is imported from its module on first use, so that
``import torchpipedream`` stays cheap (no torch for the graph, planner, schedules and
simulator). No module of the package is named like one of these names, so an export means the
same whatever was imported before (``tests/test_public_api.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Layer": "graph",
    "LayerGraph": "graph",
    "GraphError": "graph",
    "Block": "graph",
    "load_graph_txt": "pipedream_profile",
    "load_profile": "profiles",
    "profile": "profiler",
    "split_wide_layers": "layer_split",
    "Topology": "topology",
    "plan": "auto_schedule",  # planner.plan, and schedule="auto"
    "choose_schedule": "auto_schedule",
    "Plan": "plans",
    "Stage": "plans",
    "PlanError": "plans",
    "ScheduleKind": "kinds",
    "schedule_kind": "kinds",
    "Action": "actions",
    "Kind": "actions",
    "Schedule": "actions",
    "build_schedule": "schedules",
    "validate_schedule": "validate",
    "simulate": "simulator",
    "Costs": "simulator",
    "SimResult": "simulator",
    "ScheduleError": "validate",
    "Trace": "trace",
    "Event": "trace",
    "draw_timeline": "viz",
    "Pipeline": "runtime",
    "LossScaling": "runtime",
    "PipelineFailure": "runtime",
    "launch": "runtime",
    "share_plan": "runtime",
    "verify": "verification",
    "verify_plans": "verification",
    "VerifyReport": "verification",
    "TiedParameter": "plans",
    "SharedParameter": "graph",
    "keep_freed_memory": "freed_memory",
    "merge_split_state_dict": "layer_split",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchpipedream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
