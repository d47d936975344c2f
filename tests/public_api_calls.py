"""Run by tests/test_public_api.py in a fresh interpreter (not a test module): import every
submodule of torchpipedream first, then call every export, and print the names called."""

from __future__ import annotations

import importlib
import operator
import pkgutil
import sys
import tempfile
import types
from pathlib import Path

import torchpipedream as tpd

called: set[str] = set()


def call(name: str, *args, **kwargs):
    obj = getattr(tpd, name)
    assert not isinstance(obj, types.ModuleType), f"tpd.{name} is a module"
    assert callable(obj), f"tpd.{name} is not callable"
    called.add(name)
    return obj(*args, **kwargs)


def small_model():
    """A picklable model factory for verify (its workers import this file as a module)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def main() -> None:
    # First every submodule: importing a module named like an export used to replace the export.
    for info in pkgutil.walk_packages(tpd.__path__, "torchpipedream."):
        importlib.import_module(info.name)

    import torch
    from torch import nn

    tmp = Path(tempfile.mkdtemp())
    for error in ("GraphError", "PlanError", "ScheduleError"):
        assert isinstance(call(error, "message"), ValueError)
    assert isinstance(call("PipelineFailure", "message"), RuntimeError)

    layer = call("Layer", "a", forward_ms=1.0, backward_ms=2.0, parameter_bytes=16)
    small = call("LayerGraph", [layer, tpd.Layer("b", forward_ms=1.0, backward_ms=1.0)], [("a", "b")])
    assert [b.layers for b in small.linearize()] == [["a"], ["b"]]
    assert call("Block", ["a"], 1.0, 2.0, 16, 0).compute_ms == 3.0
    vgg = call("load_profile", "vgg16")
    reference = Path(tpd.__file__).parent / "model" / "reference_profiles" / "vgg16" / "graph.txt"
    assert call("load_graph_txt", reference) == vgg

    topology = call("Topology", tpd.Topology.parse("4:10GB/s").levels)
    made = call("plan", vgg, topology)
    assert isinstance(made, tpd.Plan) and made.num_workers == 4
    chosen = call("choose_schedule", vgg, topology, microbatches=(1, 2))
    assert chosen.schedule in ("flush", "gpipe") and chosen.meta["auto"]["chosen"]["microbatches"] in (1, 2)
    assert call("Plan", [call("Stage", ["a"], ranks=[0]), tpd.Stage(["b"], ranks=[1])]).num_stages == 2
    sched = call("build_schedule", made, "flush", minibatches=4, microbatches=4)
    assert isinstance(sched, tpd.Schedule)
    call("validate_schedule", sched)
    again = call("Schedule", sched.plan, sched.kind, sched.minibatches, sched.microbatches, sched.actions)
    assert again.total_actions() == sched.total_actions()
    assert str(call("Action", 0, call("Kind", "F"), 3, version=1)) == "s0F3v1"
    assert call("schedule_kind", "2bw").version_rule.name == "PREVIOUS_BATCH"
    assert call("ScheduleKind", "x", "test", tpd.schedule_kind("flush").version_rule, microbatched=True).round_robin is False
    result = call("simulate", sched)
    assert isinstance(result, tpd.SimResult) and result.makespan_s > 0
    costs = call("Costs", forward_s=[1.0], backward_s=[2.0])
    assert costs.forward_s == [1.0]
    assert isinstance(call("SimResult", **{f: getattr(result, f) for f in result.__dataclass_fields__}), tpd.SimResult)
    event = call("Event", rank=0, stage=0, kind="F", id=0, start_s=0.0, end_s=1.0)
    trace = call("Trace", [event])
    call("draw_timeline", trace, tmp / "timeline.png")
    assert (tmp / "timeline.png").stat().st_size > 0

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2048), nn.ReLU(), nn.Linear(2048, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    graph = call("profile", model, x, loss_fn=nn.CrossEntropyLoss(), target=y, iters=1, warmup=0)
    split = call("split_wide_layers", model, parts=2, min_out_features=1024)
    merged = call("merge_split_state_dict", split.state_dict(), split.split_layers)
    assert merged.keys() == model.state_dict().keys()
    one = tpd.Plan.straight([graph.names], schedule="flush", microbatches=2)
    pipe = call("Pipeline", model, one, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss())
    assert isinstance(pipe.train_step((x, y)), float)
    half = call("Pipeline", model, one, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                precision="fp16", loss_scaling=call("LossScaling", init_scale=2.0 ** 10))
    assert isinstance(half.train_step((x, y)), float) and half.loss_scale in (2.0 ** 9, 2.0 ** 10)
    warm = call("Pipeline", model, one, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                lr_scheduler=call("LRSchedule", "linear", warmup=2, total=4))
    warm.train_step((x, y))
    assert warm.weights.optimizer.param_groups[0]["lr"] == 0.1  # after one update: lr(1) = 2 / 2 of 0.1
    assert call("launch", operator.add, 1, 5) == 5
    call("keep_freed_memory")

    import functools

    import torch.distributed as dist

    tied = call("TiedParameter", "w", [0, 1], 16)
    assert call("SharedParameter", "w", ["a", "b"], 16).layers == ["a", "b"]
    two = tpd.Plan.straight([["a"], ["b"]], tied=[tied])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert call("share_plan", two).tied == [tied]
    finally:
        dist.destroy_process_group()
    mlp_graph = tpd.profile(small_model(), x, loss_fn=nn.CrossEntropyLoss(), target=y, iters=1, warmup=0)
    single = tpd.Plan.straight([mlp_graph.names], schedule="flush", microbatches=2)
    report = call("verify", small_model, [(x, y)] * 2, single, functools.partial(torch.optim.SGD, lr=0.1),
                  loss_fn=nn.CrossEntropyLoss())
    assert report.ok, str(report)
    assert call("verify_plans", small_model, [(x, y)], [single], functools.partial(torch.optim.SGD, lr=0.1),
                loss_fn=nn.CrossEntropyLoss())[0].ok
    assert call("VerifyReport", "flush", 2, "x", 1, 0.0).ok

    missing = sorted(set(tpd.__all__) - {"__version__"} - called)
    assert not missing, f"exports not called: {missing}"
    print("CALLED", " ".join(sorted(called)))


if __name__ == "__main__":  # launch() spawns a worker that imports this file as a module
    main()
    sys.exit(0)
