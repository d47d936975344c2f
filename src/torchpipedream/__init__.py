"""torchpipedream: PipeDream pipeline-parallel training for PyTorch.

profile → LayerGraph → plan → Plan → build_schedule → Schedule → simulate / runtime → Trace.
Names are imported lazily so that `import torchpipedream` stays cheap (no torch for the
graph, planner, schedules and simulator).
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
    "profile": "profiler",
    "split_wide_layers": "layer_split",
    "Topology": "topology",
    "plan": "planner",
    "Plan": "plan",
    "Stage": "plan",
    "PlanError": "plan",
    "Action": "actions",
    "Kind": "actions",
    "Schedule": "actions",
    "build_schedule": "schedules",
    "validate_schedule": "schedules",
    "simulate": "simulate",
    "Costs": "simulate",
    "SimResult": "simulate",
    "ScheduleError": "validate",
    "Trace": "trace",
    "Event": "trace",
    "draw_timeline": "viz",
    "Pipeline": "runtime",
    "launch": "runtime",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchpipedream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
