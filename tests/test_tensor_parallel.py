"""Tensor parallelism inside pipeline stages (issue 36): each worker of a plan is t processes that
split its stage's Linear layers with torch's DTensor (``Plan.tensor_parallel``), equal to one
process, composed with replicated and FSDP2-sharded stages, checkpointed with DCP, refused by
name where it does not run.

One launch of 4 gloo processes runs every scenario (PP2 × TP2, DP2 × TP2, DP2-sharded × TP2) and
a checkpoint moved between layouts. The reference is plain PyTorch (tests/scenario_reference.py):
the whole model in one process, one optimizer step per minibatch on the minibatch's mean loss (clipped by
``clip_grad_norm_``, scheduled by a ``LambdaLR``, under bfloat16 autocast with the microbatches'
gradients accumulated, or with torch's GradScaler, where the scenario says so).
"""

from __future__ import annotations

import collections
import json
import dataclasses
import functools
from typing import Callable

import pytest
import torch
from torch import fx, nn

from scenario_reference import assert_equals_one_process, one_process_training, optimizer
from torchpipedream.models import MODELS
from torchpipedream.plans.kinds import schedule_kind
from torchpipedream.plans.plan import Plan, PlanError, Stage
from torchpipedream.runtime import Pipeline, PipelineError, launch
from torchpipedream.runtime.composition import cell
from torchpipedream.runtime.loss_scaling import LossScaling
from torchpipedream.runtime.lr_schedule import LRSchedule
from torchpipedream.runtime.tensor_parallel import (TensorLayoutError, check_layout_names, linear_pairs, named_blocks,
                                                    stage_layout)
from torchpipedream.runtime.weights import local_tensor
from torchpipedream.schedule.build import build_schedule
from torchpipedream.schedule.validate import validate_schedule

N_PROCS = 4
CLIP = 0.3
FP16_SCALING = LossScaling(init_scale=2.0 ** 20, growth_interval=2)
#: the model's layers: two Linear pairs (fc1-fc2, fc3-fc4) around a LayerNorm, and a head
LAYERS = [["input_1", "fc1", "act1", "fc2", "norm"], ["fc3", "act2", "fc4", "head"]]
#: scenario -> (kind, stage replicas, sharding, microbatches, optimizer, options)
SCENARIOS: dict[str, dict] = {
    "pp2_flush": dict(kind="flush", shape=(1, 1), m=4, opt="momentum", clip=True, sched=True),
    "dp2_gpipe": dict(kind="gpipe", shape=(2,), m=2, opt="adamw", evaluate=True),
    "dp2_zero3": dict(kind="flush", shape=(2,), sharding="zero3", m=2, opt="adam", clip=True),
    "pp2_bf16": dict(kind="flush", shape=(1, 1), m=2, opt="sgd", precision="bf16"),
    "pp2_recompute": dict(kind="gpipe", shape=(1, 1), m=4, opt="momentum", recompute=True),
    "pp2_fp16": dict(kind="flush", shape=(1, 1), m=2, opt="sgd", precision="fp16"),
    # a layout of the user's: the second pair only (the first runs whole on both tensor ranks)
    "pp2_user_layout": dict(kind="gpipe", shape=(1, 1), m=2, opt="sgd", layout={"fc3": "colwise", "fc4": "rowwise"}),
    # four stages on two workers (Megatron's interleaving), a Linear pair in stages 0 and 2
    "interleaved": dict(kind="interleaved", shape="looped", m=4, opt="momentum"),
    # the zero-bubble kinds: the weights' gradients of DTensor parameters taken in their own pass
    "pp2_zb_h1": dict(kind="zb-h1", shape=(1, 1), m=4, opt="momentum", clip=True),
    "zb_v": dict(kind="zb-v", shape="v", m=4, opt="sgd"),
}
#: the interleaved scenario's stages: stage k on worker k mod 2
LOOPED = [["input_1", "fc1", "act1", "fc2"], ["norm"], ["fc3", "act2", "fc4"], ["head"]]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(collections.OrderedDict([
        ("fc1", nn.Linear(6, 16)), ("act1", nn.GELU()), ("fc2", nn.Linear(16, 8)), ("norm", nn.LayerNorm(8)),
        ("fc3", nn.Linear(8, 32)), ("act2", nn.Tanh()), ("fc4", nn.Linear(32, 8)), ("head", nn.Linear(8, 3))]))


def data(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def plan_of(sc: dict) -> Plan:
    """The scenario's plan of 2 workers × 2 tensor ranks: two stages, or one stage on two replicas."""
    if sc["shape"] in ("looped", "v"):  # four stages on two workers: k mod 2, or a V
        make = Plan.looped if sc["shape"] == "looped" else Plan.v_shape
        return dataclasses.replace(make(LOOPED, 2, schedule=sc["kind"], microbatches=sc["m"]), tensor_parallel=2)
    if sc["shape"] == (2,):
        stages = [Stage(LAYERS[0] + LAYERS[1], replicas=2, ranks=[0, 1], sharding=sc.get("sharding", "replicate"))]
    else:
        stages = [Stage(LAYERS[0], ranks=[0]), Stage(LAYERS[1], ranks=[1])]
    return Plan(stages=stages, schedule=sc["kind"], microbatches=sc["m"], tensor_parallel=2)


def _pipeline(sc: dict, batches: list) -> Pipeline:
    return Pipeline(model(), plan_of(sc), loss_fn=nn.functional.cross_entropy, optimizer=optimizer(sc["opt"]),
                    precision=sc.get("precision", "fp32"),
                    loss_scaling=FP16_SCALING if sc.get("precision") == "fp16" else None,
                    clip_grad_norm=CLIP if sc.get("clip") else None,
                    lr_scheduler=LRSchedule("cosine", warmup=1, total=len(batches)) if sc.get("sched") else None,
                    recompute=sc.get("recompute", False), tensor_layout=sc.get("layout"), timeout_s=60)


def _held(pipe: Pipeline) -> list[int]:
    """[bytes of this rank's parts of its weights, bytes of those weights whole]."""
    return [sum(local_tensor(p).numel() * p.element_size() for p in pipe.weights.params),
            sum(p.numel() * p.element_size() for p in pipe.weights.params)]


# ------------------------------------------------------------------ Llama from transformers, as stage modules
class LlamaBlocks(nn.Module):
    """A pipeline stage of a Hugging Face Llama: its embedding (first stage), some decoder layers,
    its final norm and output layer (last stage), as torchtitan cuts one."""

    def __init__(self, lm: nn.Module, layers: list[nn.Module], first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = lm.model.embed_tokens if first else None
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = lm.model.rotary_emb
        self.norm = lm.model.norm if last else None
        self.lm_head = lm.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1]).unsqueeze(0)
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers:
            h = layer(h, position_embeddings=rotary, attention_mask=None, position_ids=positions)
        return self.lm_head(self.norm(h)) if self.lm_head is not None else h


def llama_stages() -> list[nn.Module]:
    import zoo_models as zoo
    lm = zoo.llama()
    return [LlamaBlocks(lm, lm.model.layers[:1], True, False), LlamaBlocks(lm, lm.model.layers[1:], False, True)]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal LM loss: each token predicts the next, averaged over tokens."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def llama_data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import zoo_models as zoo
    return [(b["input_ids"], b["labels"]) for b in zoo.batches("llama", n)]


LLAMA_OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def _llama(rank: int) -> dict:
    plan = Plan(stages=[Stage(["first"], ranks=[0]), Stage(["last"], ranks=[1])], schedule="flush", microbatches=2,
                tensor_parallel=2)
    pipe = Pipeline(llama_stages(), plan, LLAMA_OPTIMIZER, loss_fn=causal_lm_loss, timeout_s=60)
    pipe.train_minibatches(llama_data(3))
    return {"state": pipe.state_dict(), "held": _held(pipe)}


# ------------------------------------------------------------------ GPT-2 from transformers, as stage modules
#: scenario -> (kind, clipping, blocks per stage): the output layer's weight is the token embedding's (shared
#: by the first and the last stage); interleaved runs four stages on the two workers (stage k on worker k mod 2)
GPT2_SCENARIOS = {"gpt2_flush": dict(kind="flush", clip=False, blocks=[1, 1]),
                  "gpt2_zb_h1_clipped": dict(kind="zb-h1", clip=True, blocks=[1, 1]),
                  "gpt2_interleaved": dict(kind="interleaved", clip=False, blocks=[1, 1, 1, 1])}
GPT2_CLIP = 0.5


def gpt2_model(layers: int = 2) -> nn.Module:
    from torchpipedream.models.hf import gpt2
    torch.manual_seed(0)
    return gpt2(vocab_size=64, context=16, d_model=32, layers=layers, heads=4)


def gpt2_data(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(n)]
    return [(t, t) for t in tokens]


def _gpt2_pipeline(kind: str, clip: bool, blocks: list[int]) -> Pipeline:
    from torchpipedream.models.hf import gpt2_stages
    plan = dataclasses.replace(Plan.looped([[f"stage{s}"] for s in range(len(blocks))], 2, schedule=kind,
                                           microbatches=2), tensor_parallel=2)  # stage k on worker k mod 2
    return Pipeline(gpt2_stages(gpt2_model(len(blocks)), blocks), plan, LLAMA_OPTIMIZER, loss_fn=causal_lm_loss,
                    clip_grad_norm=GPT2_CLIP if clip else None, timeout_s=60)


def _gpt2(rank: int, directory: str) -> dict:
    """Each GPT-2 scenario's three minibatches on PP2 × TP2; and two minibatches saved, loaded by a
    fresh PP2 × TP2 pipeline that trains the third."""
    from torchpipedream.runtime.checkpoint import read_stage_states
    out: dict = {}
    for name, sc in GPT2_SCENARIOS.items():
        pipe = _gpt2_pipeline(sc["kind"], sc["clip"], sc["blocks"])
        pipe.train_minibatches(gpt2_data())
        out[name] = {"state": pipe.state_dict(), "held": _held(pipe), "norms": pipe.grad_norms}
    first = _gpt2_pipeline("flush", False, [1, 1])
    first.train_minibatches(gpt2_data()[:2])
    first.save_checkpoint(directory)
    out["saved"], out["read"] = first.state_dict(), read_stage_states(directory)
    again = _gpt2_pipeline("flush", False, [1, 1])
    again.load_checkpoint(directory)
    again.train_minibatches(gpt2_data()[2:])
    out["resumed"] = again.state_dict()
    return out


# ------------------------------------------------------------------ the launch
def _checkpoint(directory: str) -> dict:
    """Two minibatches on PP2 × TP2, saved; resumed on DP2-sharded × TP2 for the third, and on one
    worker of four tensor ranks (another degree: every split weight cut in four) for the third."""
    batches = data()
    first = _pipeline(SCENARIOS["pp2_user_layout"] | {"layout": None, "opt": "adam"}, batches)
    first.train_minibatches(batches[:2])
    first.save_checkpoint(directory)
    again = _pipeline(dict(kind="flush", shape=(2,), sharding="zero2", m=2, opt="adam"), batches)
    again.load_checkpoint(directory)
    again.train_minibatches(batches[2:])
    four = Pipeline(model(), Plan(stages=[Stage(LAYERS[0] + LAYERS[1], ranks=[0])], schedule="flush", microbatches=2,
                                  tensor_parallel=4),
                    loss_fn=nn.functional.cross_entropy, optimizer=optimizer("adam"), timeout_s=60)
    four.load_checkpoint(directory)
    four.train_minibatches(batches[2:])
    return {"zero2_tp2": again.state_dict(), "tp4": four.state_dict(), "tp4_held": _held(four)}


def _refusal(rank: int) -> str:
    """What a tensor-parallel Pipeline says of a model torch.export traces (the whole Llama)."""
    import zoo_models as zoo
    from torchpipedream.model.profiler import profile
    names = profile(zoo.llama(), zoo.batches("llama", 1)[0], warmup=0, iters=1).names
    plan = Plan(stages=[Stage(names[:len(names) // 2], ranks=[0]), Stage(names[len(names) // 2:], ranks=[1])],
                schedule="flush", microbatches=2, tensor_parallel=2)
    try:
        Pipeline(zoo.llama(), plan, LLAMA_OPTIMIZER, sample=zoo.batches("llama", 1)[0], timeout_s=60)
    except PipelineError as exc:
        return str(exc)
    return "no refusal"


def _worker(rank: int, directory: str) -> dict:
    torch.set_num_threads(1)
    out: dict = {"checkpoint": _checkpoint(directory), "llama": _llama(rank), "refusal": _refusal(rank),
                 "gpt2": _gpt2(rank, directory + "_gpt2")}
    for name, sc in SCENARIOS.items():
        batches = data()
        pipe = _pipeline(sc, batches)
        pipe.fit(batches, epochs=1)
        result = {"state": pipe.state_dict(), "norms": pipe.grad_norms, "held": _held(pipe),
                  "scale": (pipe.loss_scale, pipe.skipped_updates) if sc.get("precision") == "fp16" else None}
        trace = pipe.trace()
        result["trace_ranks"] = sorted({e.rank for e in trace.events}) if trace is not None else None
        if sc.get("evaluate"):
            result["eval"] = pipe.evaluate(batches)
        out[name] = result
    held = torch.tensor(out["pp2_flush"]["held"], dtype=torch.int64)
    gathered = [torch.zeros_like(held) for _ in range(N_PROCS)]
    torch.distributed.all_gather(gathered, held)
    out["held_by_rank"] = [t.tolist() for t in gathered]
    return out


def reference(sc: dict, n: int = 3) -> dict:
    """One process, one step per minibatch on its mean loss (plain PyTorch: scenario_reference.py)."""
    return one_process_training(model(), data(n), optimizer(sc["opt"]), sc, CLIP, FP16_SCALING)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("tensor_parallel_checkpoints") / "ckpt")


@pytest.fixture(scope="module")
def results(checkpoints: str) -> dict:
    return launch(_worker, N_PROCS, checkpoints, timeout_s=300, stall_timeout_s=60)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_tensor_parallel_pipeline_equals_one_process(results: dict, name: str) -> None:
    sc, got = SCENARIOS[name], results[name]
    assert_equals_one_process(name, sc, got, reference(sc), CLIP)
    # the trace is the plan's workers' (each worker's events once, not once per tensor rank)
    assert got["trace_ranks"] == list(range(plan_of(sc).num_workers))


def model_key(key: str, blocks: str, model_blocks: str, other: Callable[[str], str]) -> str:
    """The model's name of a stage-list state key "<stage>.<name>" whose stage s holds block s
    onwards (``blocks``: the stage's attribute of blocks, ``model_blocks``: the model's); ``other``
    names the rest."""
    stage, _, rest = key.partition(".")
    if rest.startswith(blocks + "."):
        index, tail = rest.split(".", 2)[1:]
        return f"{model_blocks}.{int(index) + int(stage)}.{tail}"
    return other(rest)


def test_a_llama_from_transformers_trains_as_one_process_on_pp2_tp2(results: dict) -> None:
    """A Hugging Face Llama cut into two stage modules, its attention and MLP split over two tensor
    ranks by their layers' names (q/k/v/gate/up column-wise, o/down row-wise): the weights of
    three steps of the model itself in one process."""
    pytest.importorskip("transformers")
    import zoo_models as zoo
    lm = zoo.llama()
    opt = LLAMA_OPTIMIZER(lm.parameters())
    for x, y in llama_data(3):
        opt.zero_grad()
        lm(input_ids=x, labels=y).loss.backward()
        opt.step()
    want = lm.state_dict()
    got = results["llama"]["state"]
    compared = 0
    for key, value in got.items():
        name = model_key(key, "layers", "model.layers", lambda rest: rest if rest.startswith("lm_head") else f"model.{rest}")
        torch.testing.assert_close(value, want[name], atol=1e-5, rtol=1e-4, msg=key)
        compared += 1
    assert compared == len(want)
    held, whole = results["llama"]["held"]
    assert held < 0.8 * whole  # the attention and MLP projections are split, not replicated


def _gpt2_reference(clip: bool, layers: int = 2, n: int = 3) -> tuple[dict[str, torch.Tensor], list[float]]:
    """GPT-2 itself in one process: n steps on each minibatch's mean loss, clipped by the global norm
    (its tied weight counted once) where asked; its state and the norms before clipping."""
    lm = gpt2_model(layers)
    opt = LLAMA_OPTIMIZER(lm.parameters())
    norms = []
    for x, y in gpt2_data(n):
        opt.zero_grad()
        causal_lm_loss(lm(x), y).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(lm.parameters(), GPT2_CLIP)))
        opt.step()
    return lm.state_dict(), norms


def _assert_gpt2_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    """A GPT-2 pipeline of one block per stage's state (keys "<stage>.<its module's name>") against
    the model's own."""
    compared = set()
    for key, value in got.items():
        name = model_key(key, "h", "model.transformer.h",
                         lambda rest: f"model.{rest}" if rest.startswith("lm_head") else f"model.transformer.{rest}")
        assert type(value) is torch.Tensor, (label, key)  # gathered whole
        torch.testing.assert_close(value, want[name], atol=1e-5, rtol=1e-4, msg=f"{label}: {key}")
        compared.add(name)
    assert compared == set(want), (label, set(want) - compared)


@pytest.mark.parametrize("name", list(GPT2_SCENARIOS))
def test_gpt2_from_transformers_trains_as_one_process_on_pp2_tp2(results: dict, name: str) -> None:
    """GPT-2 cut into two stage modules (``models.hf.gpt2_stages``), its Conv1D attention and MLP
    split over two tensor ranks (c_attn by heads: each rank its heads' queries, keys and values;
    c_fc column-wise; c_proj row-wise), its tied embedding and output layer kept equal across the
    two stages: the weights (and, clipped, the global norms) of three steps of GPT-2 in one process."""
    pytest.importorskip("transformers")
    sc, got = GPT2_SCENARIOS[name], results["gpt2"][name]
    want, norms = _gpt2_reference(sc["clip"], len(sc["blocks"]))
    _assert_gpt2_state(got["state"], want, name)
    assert got["norms"] == pytest.approx(norms, rel=1e-4)
    assert all(n > GPT2_CLIP for n in norms) or not sc["clip"]  # clipping acted on every step
    held, whole = got["held"]
    assert held < 0.8 * whole  # the attention and MLP layers are split, not replicated


def test_a_gpt2_checkpoint_of_split_heads_reads_whole_and_resumes_on_pp2_tp2(results: dict) -> None:
    """The fused query/key/value layer's split (a strided shard, which DCP cannot save as one
    chunk) is saved whole: the checkpoint read without a pipeline is the saved model, and a fresh
    PP2 × TP2 pipeline that loads it (weights and momentum) and trains the third minibatch ends
    where three steps in one process do."""
    pytest.importorskip("transformers")
    got = results["gpt2"]
    assert set(got["read"]) == set(got["saved"])
    for key, value in got["saved"].items():
        torch.testing.assert_close(got["read"][key], value, atol=0, rtol=0, msg=key)
    _assert_gpt2_state(got["resumed"], _gpt2_reference(False)[0], "resumed")


def test_a_checkpoint_moves_from_pp2_tp2_to_sharded_tp2_to_tp4_and_to_one_process(results: dict,
                                                                                   checkpoints: str) -> None:
    want = reference(dict(opt="adam"))["state"]
    one = Pipeline(model(), Plan.straight([LAYERS[0] + LAYERS[1]], schedule="flush"),
                   loss_fn=nn.functional.cross_entropy, optimizer=optimizer("adam"))
    one.load_checkpoint(checkpoints)  # the tensor-parallel save, read whole on one process
    one.train_minibatches(data()[2:])
    # on four tensor ranks each holds a quarter of every split weight (fc1-fc4 but the row-wise
    # layers' biases; the norm and head whole)
    split = sum(v.numel() * v.element_size() for k, v in model().state_dict().items()
                if k.startswith("fc") and k not in ("fc2.bias", "fc4.bias"))
    local, whole = results["checkpoint"]["tp4_held"]
    assert local == whole - split + split // 4
    for label, got in (("DP2 zero2 × TP2", results["checkpoint"]["zero2_tp2"]), ("TP4", results["checkpoint"]["tp4"]),
                       ("one process", one.state_dict())):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, atol=2e-5, rtol=2e-5, msg=f"{label}: {key}")


def test_each_tensor_rank_holds_half_of_the_split_layers(results: dict) -> None:
    """PP2 × TP2: every split Linear (all of stage 1's but the head, fc1 and fc2 of stage 0) is held
    half on each tensor rank; the two tensor ranks of a worker together hold each split weight once."""
    held = results["held_by_rank"]
    whole = model().state_dict()
    split = {0: ["fc1", "fc2"], 1: ["fc3", "fc4"]}
    for rank, (local, total) in enumerate(held):
        stage = rank // 2
        halved = sum(whole[f"{n}.{p}"].numel() * 4 for n in split[stage] for p in ("weight", "bias")
                     if not (p == "bias" and n in ("fc2", "fc4")))  # a row-wise layer's bias stays whole
        assert local == total - halved // 2, (rank, local, total, halved)


def test_a_model_torch_export_traces_is_refused_by_name(results: dict) -> None:
    assert "torch.export traced this model" in results["refusal"] and "tensor_parallel 2" in results["refusal"]


# ------------------------------------------------------------------ layouts, plans and refusals (no process)
def test_the_default_layout_splits_linear_pairs_with_elementwise_work_between() -> None:
    graph = fx.symbolic_trace(model())
    assert linear_pairs(graph, 2) == {"fc1": "colwise", "fc2": "rowwise", "fc3": "colwise", "fc4": "rowwise"}
    assert linear_pairs(model(), 2) == linear_pairs(graph, 2)  # a Sequential's layers alike
    assert linear_pairs(graph, 32) == {"fc3": "colwise", "fc4": "rowwise"}  # fc1's 16 outputs do not split in 32
    # something between the two Linears that is not element-wise (a LayerNorm mixes the features)
    mixed = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    assert linear_pairs(fx.symbolic_trace(mixed), 2) == {}


def test_llama_blocks_are_split_by_their_layers_names() -> None:
    pytest.importorskip("transformers")
    first = llama_stages()[0]
    layout = named_blocks(first, 2)
    assert layout == {f"layers.0.self_attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")} \
        | {"layers.0.self_attn.o_proj": "rowwise", "layers.0.mlp.gate_proj": "colwise",
           "layers.0.mlp.up_proj": "colwise", "layers.0.mlp.down_proj": "rowwise"}
    assert named_blocks(first, 3) == {}  # 32 features do not split in three


def test_gpt2_blocks_are_split_by_their_layers_names() -> None:
    """GPT-2's Conv1D blocks: c_attn by heads ("qkv"), c_fc column-wise, both c_proj row-wise; none
    where the degree does not divide the heads; a user's layout of them checked by name."""
    pytest.importorskip("transformers")
    from torchpipedream.models.hf import gpt2_stages
    first, last = gpt2_stages(gpt2_model(), [1, 1])
    assert named_blocks(first, 2) == {"h.0.attn.c_attn": "qkv", "h.0.attn.c_proj": "rowwise",
                                      "h.0.mlp.c_fc": "colwise", "h.0.mlp.c_proj": "rowwise"}
    assert named_blocks(first, 3) == {}  # 4 heads and 128 inner features do not split in three
    assert "lm_head" not in named_blocks(last, 2)  # the output layer (tied to the embedding) stays whole
    names = {n: f"0.{n}" for n, _ in first.named_parameters()}  # stage name -> the model's
    assert stage_layout(first, 2, {"0.h.0.mlp.c_fc": "colwise"}, names) == {"h.0.mlp.c_fc": "colwise"}
    for layout, message in (({"0.h.0.mlp.c_fc": "qkv"}, "'qkv' splits a GPT-2 attention's fused c_attn"),
                            ({"0.h.0.ln_1": "colwise"}, "the module is a LayerNorm"),
                            ({"0.h.0.attn.c_attn": "qkv"}, "4 heads of 8 features do not split evenly over 8")):
        with pytest.raises(TensorLayoutError, match=message):
            stage_layout(first, 8 if "c_attn" in str(layout) else 2, layout, names)


def test_a_layout_that_splits_a_shared_parameter_or_fuses_under_fsdp2_is_refused_by_name() -> None:
    from torchpipedream.runtime.tensor_parallel import split_layers_problem
    layout = {"h.0.attn.c_attn": "qkv", "lm_head": "colwise"}
    assert "splits 'lm_head', whose parameter is 'wte.weight'" in split_layers_problem(
        layout, {"lm_head.weight": "'wte.weight'"}, None)
    assert "sharded (zero3)" in split_layers_problem(layout, {}, "zero3")
    assert split_layers_problem(layout, {"wte.weight": "'wte.weight'"}, None) is None


def test_a_users_layout_is_checked_by_name() -> None:
    net = model()
    with pytest.raises(TensorLayoutError, match="'fc9', which is not a module of the model"):
        check_layout_names({"fc9": "colwise"}, net)
    with pytest.raises(TensorLayoutError, match="must be 'colwise', 'rowwise' or a ParallelStyle"):
        check_layout_names({"fc1": "diagonal"}, net)
    names = {f"{n}.{p}": f"{n}.{p}" for n in ("fc1", "norm") for p in ("weight", "bias")}
    with pytest.raises(TensorLayoutError, match="the module is a LayerNorm"):
        stage_layout(net, 2, {"norm": "colwise"}, names)
    with pytest.raises(TensorLayoutError, match="16 features does not split evenly over 3"):
        stage_layout(net, 3, {"fc1": "colwise"}, names)


def test_plan_files_carry_the_tensor_degree_and_old_files_load() -> None:
    plan = plan_of(SCENARIOS["pp2_flush"])
    data = plan.to_dict()
    assert data["tensor_parallel"] == 2 and Plan.from_dict(data).tensor_parallel == 2
    assert "tensor_parallel" not in plan.with_tensor_parallel(1).to_dict()  # files as before
    assert plan.num_ranks == 4 and plan.worker_of_rank(3) == (1, 1) and plan.ranks_of_worker(1) == [2, 3]
    assert "tensor parallel ×2" in plan.summary
    with pytest.raises(PlanError, match="2 workers of 2 tensor-parallel ranks each: 4 processes"):
        plan.validate(world_size=2)
    with pytest.raises(PlanError, match="tensor_parallel must be a whole number"):
        plan.with_tensor_parallel(0)


@pytest.mark.parametrize("kind", ["pipedream", "2bw", "zb-2bw", "naive"])
def test_kinds_that_cannot_split_tensors_are_refused_by_name(kind: str) -> None:
    refused = cell(kind, "tensor parallel (×2)")
    assert refused.status == "refused" and "tensor_parallel 2" in (refused.message or "")
    assert cell("flush", "tensor parallel (×2)").status == "runs"


def test_the_schedule_is_the_workers_and_is_proven() -> None:
    """The schedule has one action list per worker (its tensor ranks run it alike) and validates."""
    plan = plan_of(SCENARIOS["pp2_flush"])
    sched = build_schedule(plan, "flush", minibatches=2, microbatches=4)
    assert sorted(sched.actions) == [0, 1]
    validate_schedule(sched)


def test_train_takes_tensor_parallel(tmp_path, capsys) -> None:
    """`train --tensor-parallel 2` trains the default model on workers of two processes (its
    report says so, its exported weights are whole tensors) and resumes from its DCP checkpoint;
    what it cannot run is refused by name before anything starts."""
    from torchpipedream.cli import main

    out = tmp_path / "tensor"
    common = ["train", "--workers", "2", "--tensor-parallel", "2", "--schedule", "flush", "--no-progress",
              "--max-minibatches", "4", "--timeout", "60", "--out", str(out)]
    assert main(common + ["--epochs", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert "tensor parallel ×2" in report["plan"] and report["final_test_loss"] > 0
    state = torch.load(out / "checkpoint.pt", weights_only=True)["state_dict"]
    whole = {k: v.shape for k, v in MODELS["cnn"]().state_dict().items()}
    assert {k: v.shape for k, v in state.items()} == whole and all(type(v) is torch.Tensor for v in state.values())
    assert (out / "checkpoints" / "epoch_1" / "stage0.dcp").is_dir()
    assert main(common + ["--epochs", "2", "--resume"]) == 0
    capsys.readouterr()
    for extra, message in ((["--schedule", "pipedream"], "runs under the synchronous kinds"),
                           (["--workers", "3"], "--workers 3 processes do not make whole workers of 2")):
        assert main(["train", "--tensor-parallel", "2", "--schedule", "flush", "--workers", "2", *extra,
                     "--out", str(tmp_path / "no")]) == 2
        assert message in capsys.readouterr().err


def test_train_schedule_auto_chooses_among_the_kinds_that_split_layers(tmp_path, capsys) -> None:
    """`train --schedule auto --tensor-parallel 2` plans every synchronous kind for workers of two
    processes and trains the fastest predicted one; --allow-stale, which would let it choose an
    asynchronous kind, is refused by name."""
    from torchpipedream.cli import main

    out = tmp_path / "auto"
    assert main(["train", "--workers", "4", "--tensor-parallel", "2", "--schedule", "auto", "--no-progress",
                 "--max-minibatches", "3", "--epochs", "1", "--timeout", "60", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert "tensor parallel ×2" in report["plan"] and report["final_test_loss"] > 0
    assert not schedule_kind(report["schedule"]).asynchronous
    capsys.readouterr()
    assert main(["train", "--workers", "4", "--tensor-parallel", "2", "--schedule", "auto", "--allow-stale",
                 "--out", str(tmp_path / "no")]) == 2
    assert "drop --allow-stale" in capsys.readouterr().err


def test_train_splits_gpt2_over_tensor_ranks_and_its_checkpoint_resumes_without(tmp_path) -> None:
    """`train --model gpt2 --tensor-parallel 2` profiles and cuts GPT-2 by its own modules
    (``GPT2Logits.pipeline_units``), here two stages of two processes each with the tied embedding
    in the first and the output layer in the last; its exported state has the model's own names,
    and its checkpoint resumes on two processes without tensor parallelism (torch.export's split)
    to the weights of a run that never stopped."""
    pytest.importorskip("transformers")
    from torchpipedream.cli import main
    from torchpipedream.models.hf import gpt2

    def train(out, *extra: str) -> dict[str, torch.Tensor]:
        assert main(["train", "--model", "gpt2", "--schedule", "flush", "--no-progress", "--max-minibatches", "3",
                     "--timeout", "60", "--out", str(out), *extra]) == 0
        return torch.load(out / "checkpoint.pt", weights_only=True)["state_dict"]

    tensor = ["--workers", "4", "--tensor-parallel", "2", "--straight"]
    state = train(tmp_path / "tp", *tensor, "--epochs", "1")
    report = json.loads((tmp_path / "tp" / "report.json").read_text())
    assert "straight ×2, tensor parallel ×2" in report["plan"]
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in gpt2().state_dict().items()}
    assert torch.equal(state["model.lm_head.weight"], state["model.transformer.wte.weight"])
    resumed = train(tmp_path / "tp", "--workers", "2", "--epochs", "2", "--resume")
    straight = train(tmp_path / "plain", "--workers", "2", "--epochs", "2")
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-5, rtol=1e-4, msg=key)


# ------------------------------------------------------------------ what the planner and the simulator charge
def test_the_cost_model_splits_what_the_runtime_splits() -> None:
    """The planner's split layers are the runtime's Linear pairs (and the element-wise layers between
    them); each costs half its compute, weights and kept activations on each of two processes, plus
    the ring all-reduce of the pair's output (forward) and of its input gradient (backward) over the
    innermost link, once per microbatch."""
    from torchpipedream.model.profiler import profile
    from torchpipedream.plans.topology import Topology
    from torchpipedream.search.tensor_parallel import split_layers, tensor_parallel_graph
    from torchpipedream.sim.costs import ring_allreduce_s

    graph = profile(model(), data(1)[0][0], warmup=0, iters=1)
    split = split_layers(graph, 2)
    assert split == {"fc1": (0, 1), "act1": (0, 0), "fc2": (1, 0), "fc3": (0, 1), "act2": (0, 0), "fc4": (1, 0)}
    assert {n for n, r in split.items() if r != (0, 0)} == set(linear_pairs(fx.symbolic_trace(model()), 2))
    topo = Topology.parse("4:1GB/s%50")
    tp = {layer.name: layer for layer in tensor_parallel_graph(graph, 2, topo, microbatches=2).layers}
    whole = {layer.name: layer for layer in graph.layers}

    def reduce_ms(nbytes: int) -> float:  # two microbatches, each an all-reduce of half the minibatch's bytes
        return 2 * ring_allreduce_s(nbytes / 2, 2, 1e9 * 0.5, topo.latency_s) * 1e3

    assert tp["fc2"].forward_ms == pytest.approx(whole["fc2"].forward_ms / 2 + reduce_ms(whole["fc2"].activation_bytes))
    assert tp["fc1"].forward_ms == pytest.approx(whole["fc1"].forward_ms / 2)
    assert tp["fc1"].backward_ms == pytest.approx(whole["fc1"].backward_ms / 2 + reduce_ms(whole["input_1"].activation_bytes))
    assert tp["fc3"].parameter_bytes == whole["fc3"].parameter_bytes // 2
    assert tp["head"] == whole["head"] and tp["norm"] == whole["norm"]


def test_gpt2_blocks_profiled_as_units_are_priced_as_split_transformer_blocks() -> None:
    """GPT-2 profiled by its units (what `train --tensor-parallel` does): each GPT2Block is split
    whole, with a transformer block's two all-reduces each way; the embeddings and head are not."""
    pytest.importorskip("transformers")
    from torchpipedream.model.profiler import profile
    from torchpipedream.search.tensor_parallel import split_layers
    lm = gpt2_model()
    x, y = gpt2_data(1)[0]
    graph = profile(lm.pipeline_units(), x, warmup=0, iters=1)
    assert [layer.kind for layer in graph.layers] == ["GPT2Stage", "GPT2Block", "GPT2Block", "GPT2Stage"]
    assert split_layers(graph, 2) == {"1": (2, 2), "2": (2, 2)}


def test_the_planner_plans_workers_of_several_processes() -> None:
    """plan(tensor_parallel=2) groups the innermost level's processes in twos and plans the model as
    one of them runs it: the plan runs on all the topology's processes, its stage times are a
    process's (smaller than a whole worker's for a model of Linear pairs on a fast link), and it
    refuses what it cannot price by name."""
    from torchpipedream.model.profiler import profile
    from torchpipedream.plans.topology import Topology
    from torchpipedream.search.planner import plan
    from torchpipedream.search.tensor_parallel import worker_topology

    topo = Topology.parse("8x2:100GB/s,1GB/s")
    grouped = worker_topology(topo, 4)
    assert [lv.count for lv in grouped.levels] == [2, 2] and grouped.levels[0].bandwidth_Bps == 100e9
    with pytest.raises(PlanError, match="8 processes, which do not make whole workers of 3"):
        worker_topology(topo, 3)
    graph = profile(model(), data(1)[0][0], warmup=0, iters=1)
    # no latency: the split layers' halved compute is then always more than their all-reduces cost
    one = plan(graph, "2:100GB/s~0s", schedule="flush", microbatches=2, straight=True)
    two = plan(graph, "4:100GB/s~0s", schedule="flush", microbatches=2, straight=True, tensor_parallel=2)
    assert two.tensor_parallel == 2 and two.num_workers == 2 and two.num_ranks == 4
    assert two.meta["planner"]["tensor_parallel"] == 2 and Topology.parse(two.topology).num_workers == 4
    assert sum(st.forward_ms for st in two.stages) < sum(st.forward_ms for st in one.stages)
    with pytest.raises(PlanError, match="tensor_parallel 2: pipedream is not supported"):
        plan(graph, "8:100GB/s", schedule="pipedream", tensor_parallel=2)
    assert plan(graph, "4:100GB/s", schedule="zb-h1", microbatches=2, tensor_parallel=2).tensor_parallel == 2
    no_pairs = profile(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3)), torch.randn(8, 4),
                       warmup=0, iters=1)
    with pytest.raises(PlanError, match="no layer a tensor-parallel worker splits"):
        plan(no_pairs, "8:100GB/s", schedule="flush", tensor_parallel=2)
