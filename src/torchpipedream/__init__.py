"""torchpipedream: PipeDream pipeline-parallel training for PyTorch.

profile → LayerGraph → plan → Plan → build_schedule → Schedule → simulate / runtime → Trace.

Every name in ``__all__`` is imported from its module on first use, so that
``import torchpipedream`` stays cheap (no torch for the graph, planner, schedules and
simulator). No module of the package is named like one of these names, so an export means the
same whatever was imported before (``tests/test_public_api.py``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Layer": "model.graph",
    "LayerGraph": "model.graph",
    "GraphError": "model.graph",
    "Block": "model.graph",
    "load_graph_txt": "model.pipedream_profile",
    "load_profile": "model.profiles",
    "profile": "model.profiler",
    "split_wide_layers": "model.layer_split",
    "Topology": "plans.topology",
    "plan": "search.auto",  # search.planner.plan, and schedule="auto"
    "choose_schedule": "search.auto",
    "Plan": "plans.plan",
    "Stage": "plans.plan",
    "PlanError": "plans.plan",
    "ScheduleKind": "plans.kinds",
    "schedule_kind": "plans.kinds",
    "Action": "schedule.actions",
    "Kind": "schedule.actions",
    "Schedule": "schedule.actions",
    "build_schedule": "schedule.build",
    "validate_schedule": "schedule.validate",
    "simulate": "sim.simulator",
    "Costs": "sim.simulator",
    "SimResult": "sim.simulator",
    "ScheduleError": "schedule.validate",
    "Trace": "sim.trace",
    "Event": "sim.trace",
    "draw_timeline": "sim.draw",
    "Pipeline": "runtime",
    "LossScaling": "runtime",
    "LRSchedule": "runtime",
    "PipelineFailure": "runtime",
    "launch": "runtime",
    "share_plan": "runtime",
    "verify": "runtime.verification",
    "verify_plans": "runtime.verification",
    "VerifyReport": "runtime.verification",
    "TiedParameter": "plans.plan",
    "SharedParameter": "model.graph",
    "keep_freed_memory": "host.freed_memory",
    "merge_split_state_dict": "model.layer_split",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if "torch" in sys.modules:  # a script's usual order: imports, then init_process_group
    try:  # before any process group exists: see runtime/process_exit.py (an abort at exit)
        importlib.import_module("torch.distributed.nn")
    except ImportError:  # a torch built without distributed support
        pass


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchpipedream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
