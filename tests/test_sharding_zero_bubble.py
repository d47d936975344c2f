"""FSDP2-sharded stages under the zero-bubble kinds zb-h1 and zb-h2 (issue 36): a sharded
stage's B runs its whole backward (FSDP2 reduces the weights' gradients when a whole backward
ends) and its W is empty; the weights equal one-process training.

One launch of 4 gloo processes runs every scenario. The reference is plain PyTorch
(scenario_reference.py): the whole model in one process, one optimizer step per minibatch on
the minibatch's mean loss, as zb-h1 and zb-h2 promise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scenario_reference import assert_equals_one_process, one_process_training, optimizer
from test_sharding import CLIP, FP16_SCALING, LAYERS, data, model, plan_of
from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.runtime import Pipeline, launch
from torchpipedream.runtime.lr_schedule import LRSchedule
from torchpipedream.schedule.build import build_schedule
from torchpipedream.schedule.validate import validate_schedule
from torchpipedream.sim.simulator import Costs, simulate

N_PROCS = 4
#: scenario -> (kind, per-stage replicas, sharding, microbatches, optimizer, options)
SCENARIOS: dict[str, dict] = {
    "zb_h1_zero3": dict(kind="zb-h1", shape=(2, 2), sharding="zero3", m=4, opt="momentum", clip=True, sched=True),
    "zb_h2_zero2": dict(kind="zb-h2", shape=(2, 2), sharding="zero2", m=4, opt="adamw"),
    # stage 0 on three shards, stage 1 whole (its backward split as usual); the last minibatch
    # of 2 samples leaves microbatch 2 empty on one shard
    "zb_h1_3_1_uneven": dict(kind="zb-h1", shape=(3, 1), sharding="zero3", m=3, opt="adam", uneven=True),
    "zb_h2_recompute": dict(kind="zb-h2", shape=(2, 2), sharding="zero3", m=2, opt="sgd", recompute=True),
    "zb_h1_bf16": dict(kind="zb-h1", shape=(2, 2), sharding="zero3", m=2, opt="sgd", precision="bf16"),
    # float16 with a loss scale that overflows at first: skipped updates agreed over the shards
    "zb_h2_fp16": dict(kind="zb-h2", shape=(2, 2), sharding="zero2", m=2, opt="sgd", precision="fp16"),
    "zb_h2_zero1": dict(kind="zb-h2", shape=(2, 2), sharding="zero1", m=4, opt="adamw", clip=True),
    # one stage on two workers of two tensor-parallel processes, sharded over the workers
    "zb_h1_zero1_tensor_parallel": dict(kind="zb-h1", shape=(2,), sharding="zero1", m=2, opt="adam",
                                        tensor_parallel=2),
    "zb_h1_tensor_parallel": dict(kind="zb-h1", shape=(2,), sharding="zero3", m=2, opt="adam", tensor_parallel=2),
}
#: a sharded zb-h1 run's checkpoint after two minibatches, resumed on a straight ×4 flush pipeline
RESUME = (dict(kind="zb-h1", shape=(2, 2), sharding="zero3", m=4, opt="adam"),
          dict(kind="flush", shape=(1, 1, 1, 1), sharding="replicate", m=2, opt="adam"))


def _plan(sc: dict) -> Plan:
    if len(sc["shape"]) == 1:  # every layer in one stage
        return Plan(stages=[Stage(LAYERS[0] + LAYERS[1], replicas=2, ranks=[0, 1], sharding=sc["sharding"])],
                    schedule=sc["kind"], microbatches=sc["m"], tensor_parallel=sc.get("tensor_parallel", 1))
    return plan_of(sc)


def _pipeline(sc: dict, batches: list) -> Pipeline:
    return Pipeline(model(), _plan(sc), loss_fn=nn.functional.cross_entropy, optimizer=optimizer(sc["opt"]),
                    schedule=sc["kind"], sample=batches[0][0], microbatches=sc["m"],
                    precision=sc.get("precision", "fp32"),
                    loss_scaling=FP16_SCALING if sc.get("precision") == "fp16" else None,
                    clip_grad_norm=CLIP if sc.get("clip") else None,
                    lr_scheduler=LRSchedule("cosine", warmup=1, total=len(batches)) if sc.get("sched") else None,
                    recompute=sc.get("recompute", False), timeout_s=60)


def _worker(rank: int, directory: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, sc in SCENARIOS.items():
        batches = data(sc.get("uneven", False))
        pipe = _pipeline(sc, batches)
        pipe.fit(batches, epochs=1)
        out[name] = {"state": pipe.state_dict(), "norms": pipe.grad_norms,
                     "scale": (pipe.loss_scale, pipe.skipped_updates) if sc.get("precision") == "fp16" else None}
    batches = data()
    first = _pipeline(RESUME[0], batches)
    first.train_minibatches(batches[:2])
    first.save_checkpoint(f"{directory}/resume")
    again = _pipeline(RESUME[1], batches)
    again.load_checkpoint(f"{directory}/resume")
    again.train_minibatches(batches[2:])
    out["resumed"] = again.state_dict()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return launch(_worker, N_PROCS, str(tmp_path_factory.mktemp("sharded_zero_bubble")), timeout_s=300,
                  stall_timeout_s=60)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sharded_zero_bubble_pipeline_equals_one_process(results: dict, name: str) -> None:
    sc = SCENARIOS[name]
    want = one_process_training(model(), data(sc.get("uneven", False)), optimizer(sc["opt"]), sc, CLIP, FP16_SCALING)
    assert_equals_one_process(name, sc, results[name], want, CLIP)


def test_a_sharded_zero_bubble_checkpoint_resumes_on_another_plan(results: dict) -> None:
    """Two minibatches under zb-h1 on sharded stages, saved; the third on a straight flush
    pipeline that loaded it: the weights of three minibatches in one process."""
    want = one_process_training(model(), data(), optimizer("adam"), dict(m=4), CLIP, FP16_SCALING)["state"]
    for key, value in want.items():
        torch.testing.assert_close(results["resumed"][key], value, atol=2e-5, rtol=2e-5, msg=key)


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
def test_the_validator_proves_it_and_the_simulator_puts_the_whole_backward_in_b(kind: str) -> None:
    """The schedule of a 2-2 plan with both stages sharded validates (every sharded F/B a
    collective of its replicas); the simulator runs a sharded stage's whole backward in B and
    nothing in its W, a stage that is not sharded its B and W as profiled."""
    stages = [Stage(["a"], replicas=2, ranks=[0, 1], sharding="zero3", forward_ms=1.0, backward_ms=2.0,
                    input_grad_ms=0.5, weight_grad_ms=1.5, parameter_bytes=1000),
              Stage(["b"], replicas=2, ranks=[2, 3], sharding="replicate", forward_ms=1.0, backward_ms=2.0,
                    input_grad_ms=0.5, weight_grad_ms=1.5, parameter_bytes=1000)]
    plan = Plan(stages=stages, schedule=kind, microbatches=4, topology="4:1GB/s")
    sched = build_schedule(plan, kind, minibatches=2, microbatches=4)
    validate_schedule(sched)
    costs = Costs.from_plan(plan, microbatches=4)
    assert costs.weight_grad_s[0] == 0.0 and costs.backward_s[0] == pytest.approx(2.0e-3 / 4)
    assert costs.weight_grad_s[1] == pytest.approx(1.5e-3 / 4)
    trace = simulate(sched, costs).trace
    w0 = [e for e in trace.events if e.stage == 0 and e.kind == "W"]
    b0 = [e for e in trace.events if e.stage == 0 and e.kind == "B"]
    # W: no compute, at most the gradient's accumulation the simulator charges every W
    assert w0 and all(e.duration_s <= 1000 / costs.accumulate_Bps * 1.000001 for e in w0)
    # B: the whole backward, and the shards' gathers and reduce-scatters of FSDP2
    assert b0 and all(e.duration_s >= 2.0e-3 / 4 for e in b0)


def test_train_says_why_its_plan_shards_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """`train --shard` with a plan that has no replicated stage (zb-h1 or flush alike) warns
    that nothing is sharded and says how to shard anyway."""
    import logging
    from types import SimpleNamespace

    from torchpipedream.train import preparation

    caplog.set_level(logging.WARNING, logger=preparation.__name__)
    for kind in ("zb-h1", "flush"):
        preparation._warn_if_nothing_sharded(SimpleNamespace(shard="zero3"), Plan.straight([["a"], ["b"]], schedule=kind))
    for message in (r.getMessage() for r in caplog.records):
        assert message.endswith("the plan (straight ×2) has no replicated stage, so nothing is sharded; to shard "
                                "anyway, write a plan with replicated stages and give it to train --plan")
    assert len(caplog.records) == 2


def test_plan_shards_the_replicated_stages_it_plans_under_zero_bubble(capsys: pytest.CaptureFixture) -> None:
    """`plan --shard --schedule zb-h1` shards the replicated stages the planner weighs as faster
    than a straight pipeline (4:1GB/s), and warns on stderr as train does where the straight
    one wins (2x2 with 4 microbatches: no replicas, nothing sharded)."""
    from torchpipedream.cli import main

    assert main(["plan", "vgg16", "-t", "4:1GB/s", "--schedule", "zb-h1", "--microbatches", "4", "--shard"]) == 0
    out = capsys.readouterr()
    assert "config 2-1-1 (2-1-1, stage 0 sharded zero3), schedule zb-h1" in out.out and out.err == ""
    assert main(["plan", "vgg16", "-t", "2x2:10GB/s,1.25GB/s", "--schedule", "zb-h1", "--microbatches", "4",
                 "--shard"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("torchpipedream plan: warning: --shard zero3: the plan (straight ×4) has no replicated stage")
