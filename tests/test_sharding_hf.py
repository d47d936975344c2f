"""Hugging Face models on sharded stages (issue 36): a Llama-shaped model through two pipeline
stages each sharded over two workers (PP2 × FSDP2), and GPT-2, whose input embedding and output
layer share one matrix, sharded over four workers in one stage (the shared matrix stays whole in
one FSDP2 unit) and through two stages each sharded over two workers (PP2 × FSDP2 under flush and
zb-h1: the shared matrix, in the first and the last stage, stays whole outside FSDP2 and its
copies are kept equal by the TR actions), beside PP2 × DP2 replicated (the control). Both are split by torch.export, so evaluation runs the graphs traced for it
with the gathered weights (``sharding.GatheredEvaluation``).

The reference is the model itself in one process: SGD with momentum, one step per minibatch on
the model's own mean loss, and its evaluation loss in ``eval()`` mode.
"""

from __future__ import annotations

import functools

import pytest
import torch

import zoo_models as zoo
from torchpipedream.model.profiler import profile
from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.runtime import Pipeline, launch

pytest.importorskip("transformers")

N_PROCS = 4
OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


#: scenario -> the zoo model it trains
MODELS = {"llama": "llama", "gpt2": "gpt2", "gpt2_pp2_zero3": "gpt2", "gpt2_pp2_zb_h1_zero2": "gpt2",
          "gpt2_pp2_replicated": "gpt2"}


def _pp2(names: list[str], kind: str, sharding: str) -> Plan:
    """The layers cut in two, each half on two workers."""
    half = len(names) // 2
    return Plan(stages=[Stage(names[:half], replicas=2, ranks=[0, 1], sharding=sharding),
                        Stage(names[half:], replicas=2, ranks=[2, 3], sharding=sharding)],
                schedule=kind, microbatches=4)


def _plans() -> dict[str, Plan]:
    """Llama: its layers cut in two, each half on two shards (zero3); GPT-2: one stage, four shards (zero2),
    and two stages of two shards or two replicas."""
    llama = profile(zoo.llama(), zoo.batches("llama", 1)[0], warmup=0, iters=1).names
    gpt2 = profile(zoo.gpt2(), zoo.batches("gpt2", 1)[0], warmup=0, iters=1).names
    half = len(llama) // 2
    return {
        "gpt2_pp2_zero3": _pp2(gpt2, "flush", "zero3"),
        "gpt2_pp2_zb_h1_zero2": _pp2(gpt2, "zb-h1", "zero2"),
        "gpt2_pp2_replicated": _pp2(gpt2, "flush", "replicate"),
        "llama": Plan(stages=[Stage(llama[:half], replicas=2, ranks=[0, 1], sharding="zero3"),
                              Stage(llama[half:], replicas=2, ranks=[2, 3], sharding="zero3")],
                      schedule="flush", microbatches=2),
        "gpt2": Plan(stages=[Stage(gpt2, replicas=4, ranks=[0, 1, 2, 3], sharding="zero2")], schedule="gpipe",
                     microbatches=4),
    }


def _worker(rank: int, plans: dict[str, Plan]) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, plan in plans.items():
        model = MODELS[name]
        batches = zoo.batches(model, 3)
        pipe = Pipeline(zoo.FACTORIES.get(model, zoo.llama)(), plan, OPTIMIZER, sample=batches[0], timeout_s=60)
        pipe.train_minibatches(batches)
        out[name] = {"state": pipe.state_dict(), "eval": pipe.evaluate(zoo.batches(model, 2))["loss"],
                     "tied": [t.name for t in pipe.plan.tied]}
    return out


def _reference(name: str) -> dict:
    model = zoo.FACTORIES.get(name, zoo.llama)()
    opt = OPTIMIZER(model.parameters())
    for batch in zoo.batches(name, 3):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        losses = [(model(**b).loss.item(), len(b["input_ids"])) for b in zoo.batches(name, 2)]
    return {"state": model.state_dict(), "eval": sum(l * n for l, n in losses) / sum(n for _, n in losses)}


@pytest.fixture(scope="module")
def results() -> dict:
    return launch(_worker, N_PROCS, _plans(), timeout_s=300, stall_timeout_s=90)


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_hugging_face_models_train_and_evaluate_as_one_process(results: dict, name: str) -> None:
    got, want = results[name], _reference(MODELS[name])
    if name.startswith("gpt2_pp2"):  # the embedding and the output layer: one matrix in two stages
        assert got["tied"] == ["transformer.wte.weight"]
    compared = 0
    for key, value in want["state"].items():
        if key in got["state"] and value.is_floating_point():
            torch.testing.assert_close(got["state"][key], value, atol=1e-5, rtol=1e-4, msg=f"{name}: {key}")
            compared += 1
    assert compared >= len(dict(zoo.FACTORIES.get(MODELS[name], zoo.llama)().named_parameters()))
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5)
