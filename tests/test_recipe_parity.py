"""Training recipes (issue 35) against independent single-process references: learning-rate
schedules, global gradient clipping, parameter groups by name, token-normalized losses and
frozen parameters, under every schedule kind.

One launch of 3 gloo processes runs every scenario (spawning costs seconds on a 2-core
machine). The references are plain PyTorch written here and share nothing with the runtime
but the test's own optimizer factories: one optimizer over the whole model (SGD with momentum
and AdamW step each parameter on its own, so one optimizer steps exactly as one per stage),
``torch.nn.utils.clip_grad_norm_`` over the whole model's gradient, a ``LambdaLR`` with the
schedule's formula written out (or torch's own ``StepLR``), the token-mean loss of the whole
minibatch, and the kinds' weight-version rules with explicit weight histories (pipedream:
0-based stage s of n uses version t − (n − 1 − s); 2bw and zb-2bw: t − 1).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau, StepLR

from test_interleaved import CUTS, NAMES as DEEP_NAMES, deep_mlp
from test_runtime_parity import LAYERS, PARAM_STAGE, data, mlp, straight, two_one
from test_shared_parameters import STAGE as TIED_STAGE, THREE as TIED_LAYERS, lm_loss, tied_lm
from test_shared_parameters import data as tied_data
from torchpipedream.plans.plan import Plan
from torchpipedream.runtime import Pipeline, PipelineError, launch
from torchpipedream.runtime.lr_schedule import LRSchedule

N_PROCS = 3
LR, ADAM_LR, PAD, CHECKPOINT_AT = 0.1, 0.01, -100, 3
#: max_norm per model: below most updates' gradient norm, so that clipping really clips.
CLIP = {"mlp": 0.25, "tokens": 0.15, "tied": 0.5, "deep": 0.2}
#: deep_mlp (test_interleaved) cut into 6 stages: two per rank on 3 ranks.
DEEP_CUT = [DEEP_NAMES[:3], DEEP_NAMES[3:5], DEEP_NAMES[5:7], DEEP_NAMES[7:9], DEEP_NAMES[9:11], DEEP_NAMES[11:]]
#: the tied model's second name of its shared matrix (test_shared_parameters.TiedLM)
ALIASES = {"head.weight": "emb.weight"}

SCENARIOS: dict[str, dict] = {
    # clipping + an LR schedule on every kind (SGD with momentum; clip unless clip=None)
    "flush": dict(kind="flush", m=4, sched="cosine"),
    "gpipe": dict(kind="gpipe", m=2, sched="step"),
    "zb-h1": dict(kind="zb-h1", m=4, sched="step"),
    "zb-h2": dict(kind="zb-h2", m=4, sched="cosine"),
    "pipedream": dict(kind="pipedream", n=8, sched="cosine"),
    "2bw": dict(kind="2bw", m=2, sched="step"),
    "zb-2bw": dict(kind="zb-2bw", m=2, sched="cosine"),
    # virtual stages: the schedule only (clipping is refused there: test_clipping_refused_...)
    "interleaved": dict(model="deep", kind="interleaved", m=3, sched="cosine", clip=None),
    "zb-v": dict(model="deep", kind="zb-v", m=3, sched="step", clip=None),
    "flush_tied": dict(model="tied", kind="flush", m=2, sched="step"),
    # a replicated stage ("2-1"); flush also with a token-normalized loss across both replicas
    "flush_2_1": dict(kind="flush", m=4, plan="2-1", sched="cosine", tokens=True),
    # pipedream on "2-1" (stage 0 updates once per two minibatches: no schedule nor clipping,
    # test_recipes_refused_...), with groups and a token-normalized loss over both replicas
    "pipedream_2_1": dict(kind="pipedream", n=8, plan="2-1", opt="adamw", tokens=True, clip=None),
    # parameter groups by name (AdamW, decay on matrices, other decay and lr on biases)
    "gpipe_groups": dict(kind="gpipe", m=2, opt="adamw", sched="cosine"),
    "pipedream_groups": dict(kind="pipedream", n=8, opt="adamw", sched="step"),
    "2bw_groups": dict(kind="2bw", m=2, opt="adamw", sched="cosine"),
    # token-normalized loss, padding spread unevenly over the microbatches
    "flush_tokens": dict(kind="flush", m=4, tokens=True, sched="step"),
    "pipedream_tokens": dict(kind="pipedream", n=8, tokens=True, sched="cosine"),
    "2bw_tokens": dict(kind="2bw", m=2, tokens=True, clip=None),
    # frozen parameters: a whole stage each (0, 1, 2) and one more parameter
    "zb-h1_frozen": dict(kind="zb-h1", m=2, frozen=("0.weight", "0.bias", "4.bias"), sched="cosine"),
    "pipedream_frozen": dict(kind="pipedream", n=8, frozen=("2.weight", "2.bias", "0.bias"), sched="step"),
    "2bw_frozen": dict(kind="2bw", m=2, frozen=("4.weight", "4.bias", "2.bias"), sched="cosine", opt="adamw",
                       clip=0.2),
}
#: the first CHECKPOINT_AT minibatches in the launch, saved; the rest on one process (test_checkpoint_...)
CHECKPOINTED = {"ckpt_flush": dict(kind="flush", m=2, sched="step"),
                "ckpt_2bw_groups": dict(kind="2bw", m=2, opt="adamw", sched="cosine")}
ALL = {**SCENARIOS, **CHECKPOINTED}


# --------------------------------------------------------------------------- recipe pieces
class Recording:
    """An optimizer that records, at every step, the learning rate of each parameter by name
    (torch keeps the names of named parameters in ``param_groups[i]["param_names"]``)."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        record = {n: g["lr"] for g in self.param_groups for n in g.get("param_names", ())}  # type: ignore[attr-defined]
        self.__dict__.setdefault("lrs", []).append(record)
        return super().step(closure)  # type: ignore[misc]


class RecordingSGD(Recording, torch.optim.SGD):
    pass


class RecordingAdamW(Recording, torch.optim.AdamW):
    pass


def sgd(named: list) -> torch.optim.Optimizer:
    return RecordingSGD(named, lr=LR, momentum=0.9)


def grouped_adamw(named: list) -> torch.optim.Optimizer:
    """Groups by name: weight decay on the matrices; the biases another decay and twice the lr."""
    groups = [{"params": [(n, p) for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
              {"params": [(n, p) for n, p in named if n.endswith("bias")], "weight_decay": 0.01, "lr": 2 * ADAM_LR}]
    return RecordingAdamW([g for g in groups if g["params"]], lr=ADAM_LR)


def uniform_adamw(named: list) -> torch.optim.Optimizer:
    """The wrong grouping (one group for every parameter): the tests see the groups."""
    return RecordingAdamW(named, lr=ADAM_LR, weight_decay=0.1)


OPTIMIZERS = {"sgd": sgd, "adamw": grouped_adamw, "uniform_adamw": uniform_adamw}


def step_lr(optimizer: torch.optim.Optimizer) -> StepLR:
    return StepLR(optimizer, 2, 0.5)


def cosine(update: int, total: int, warmup: int = 2, final: float = 0.1) -> float:
    """The cosine schedule's multiplier, written out: linear warm-up, then half a cosine."""
    if update < warmup:
        return (update + 1) / warmup
    progress = min(1.0, (update - warmup) / (total - warmup))
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def pipeline_scheduler(sc: dict):  # type: ignore[no-untyped-def]
    if sc.get("sched") == "cosine":
        return LRSchedule("cosine", warmup=2, total=sc.get("n", 6), final=0.1)
    return step_lr if sc.get("sched") == "step" else None


def reference_scheduler(sc: dict, optimizer: torch.optim.Optimizer):  # type: ignore[no-untyped-def]
    if sc.get("sched") == "cosine":
        return LambdaLR(optimizer, functools.partial(cosine, total=sc.get("n", 6)))
    return step_lr(optimizer) if sc.get("sched") == "step" else None


def count_tokens(batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return (batch[1] != PAD).sum()


def token_loss_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=PAD,
                                       reduction="sum")


def token_data(n: int, seed: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """mlp on sequences (8 of 6 positions, 4 features); the first four sequences long (4-6
    tokens), the last four short (1-2), rolled by 4 every batch: with 4 microbatches of 2
    sequences some hold 8-12 tokens and others 2-4; the totals vary by batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(n):
        x, y = torch.randn(8, 6, 4, generator=g), torch.randint(0, 3, (8, 6), generator=g)
        lengths = torch.cat([torch.randint(4, 7, (4,), generator=g), torch.randint(1, 3, (4,), generator=g)])
        y[torch.arange(6)[None, :] >= lengths.roll(4 * t)[:, None]] = PAD
        out.append((x, y))
    return out


def deep_data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    return [(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(n)]


def model_of(sc: dict) -> str:
    return "tokens" if sc.get("tokens") else sc.get("model", "mlp")


def build_model(sc: dict) -> nn.Module:
    module = {"tied": tied_lm, "deep": deep_mlp}.get(sc.get("model", ""), mlp)()
    for name in sc.get("frozen", ()):
        module.get_parameter(name).requires_grad_(False)
    return module


def batches_of(sc: dict) -> list:
    n = sc.get("n", 6)
    return {"tokens": token_data, "tied": tied_data, "deep": deep_data}.get(model_of(sc), data)(n)


def plan_of(sc: dict) -> Plan:
    kind, m = sc["kind"], sc.get("m", 1)
    if sc.get("plan") == "2-1":
        return two_one(kind, m)
    if sc.get("model") == "deep":
        return Plan.v_shape(DEEP_CUT, N_PROCS, microbatches=m) if kind == "zb-v" else \
            Plan.looped(DEEP_CUT, N_PROCS, microbatches=m)
    if sc.get("model") == "tied":
        return Plan.straight(TIED_LAYERS, schedule=kind, microbatches=m)
    return straight("mlp", kind, m)


def clip_of(sc: dict) -> float | None:
    return sc.get("clip", CLIP[model_of(sc)])


# --------------------------------------------------------------------------- the workers
def pipeline(sc: dict, plan: Plan, seen: list[str]) -> Pipeline:
    """The scenario's pipeline; ``seen`` collects the names the optimizer factory is given."""
    def factory(named):  # type: ignore[no-untyped-def]
        named = list(named)
        seen.extend(n for n, _ in named)
        return OPTIMIZERS[sc.get("opt", "sgd")](named)

    tokens = sc.get("tokens", False)
    loss_fn = token_loss_sum if tokens else lm_loss if sc.get("model") == "tied" else nn.CrossEntropyLoss()
    m = sc.get("m")
    return Pipeline(build_model(sc), plan, optimizer=factory, loss_fn=loss_fn,
                    loss_reduction="sum" if tokens else "mean", microbatches=m, timeout_s=30,
                    lr_scheduler=pipeline_scheduler(sc), clip_grad_norm=clip_of(sc),
                    loss_normalizer=count_tokens if tokens else None)


def optimizers_of(pipe: Pipeline) -> list:
    """Every optimizer this rank steps: its stages' and its copies of shared parameters'."""
    weights = [e.weights for e in pipe.engines.values()] + [c.weights for c in pipe.tied.values()]
    return [w.optimizer for w in weights if w.optimizer is not None]


def learning_rates(optimizers: list) -> list[dict[str, float]]:
    """Per update, the lr of every parameter this rank's optimizers stepped, by the model's name."""
    updates = max((len(getattr(o, "lrs", [])) for o in optimizers), default=0)
    out: list[dict[str, float]] = [{} for _ in range(updates)]
    for o in optimizers:
        for t, record in enumerate(getattr(o, "lrs", [])):
            out[t].update({ALIASES.get(n, n): lr for n, lr in record.items()})
    return out


def run_scenario(name: str, root: str) -> dict:
    sc, seen = ALL[name], []
    pipe = pipeline(sc, plan_of(sc), seen)
    batches = batches_of(sc)
    if name in CHECKPOINTED:
        batches = batches[:CHECKPOINT_AT]
    losses = pipe.train_minibatches(batches)
    if name in CHECKPOINTED:
        pipe.save_checkpoint(Path(root) / name)
    return {"full": pipe.state_dict(dst=0), "stage": pipe.stage_state_dict(), "losses": losses,
            "norms": list(pipe.grad_norms), "lrs": learning_rates(optimizers_of(pipe)),
            "names": sorted({ALIASES.get(n, n) for n in seen}), "optimizers": len(optimizers_of(pipe))}


def refusal(sc: dict) -> str | None:
    """The message a run of ``sc`` is refused with (None: it ran)."""
    try:
        pipeline(sc, plan_of(sc), []).train_minibatches(batches_of(sc))
    except PipelineError as exc:
        return str(exc)
    return None


def worker(rank: int, root: str) -> dict:
    torch.set_num_threads(1)
    out = {name: run_scenario(name, root) for name in ALL}
    # pipedream on "2-1": stage 0 updates once per two minibatches, stage 1 once per minibatch
    out["refused_2_1"] = {"clip_grad_norm": refusal({**SCENARIOS["pipedream_2_1"], "clip": CLIP["tokens"]}),
                          "lr_scheduler": refusal({**SCENARIOS["pipedream_2_1"], "sched": "cosine"})}
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recipe_checkpoints")


@pytest.fixture(scope="module")
def results(root) -> list[dict]:
    return launch(worker, N_PROCS, str(root), timeout_s=240, comm_timeout_s=60, return_all=True)


# --------------------------------------------------------------------------- references
def stage_of(sc: dict, name: str) -> int:
    """The stage of a parameter (written by hand from the plans above)."""
    if sc.get("model") == "tied":
        return TIED_STAGE[name.split(".")[0]]
    if sc.get("model") == "deep":  # Sequential index i: the layer "_i" of the cut
        return next(s for s, layers in enumerate(DEEP_CUT) if f"_{name.split('.')[0]}" in layers)
    if sc.get("plan") == "2-1":
        return 0 if name.split(".")[0] in ("0", "2") else 1
    return PARAM_STAGE["mlp"][name.split(".")[0]]


def version_rule(sc: dict):  # type: ignore[no-untyped-def]
    """Version of stage s's weights that minibatch t computes with (before max(0, ·))."""
    if sc["kind"] == "pipedream":
        return lambda s, t: t - (N_PROCS - 1 - s)
    if sc["kind"] in ("2bw", "zb-2bw"):
        return lambda s, t: t - 1
    return lambda s, t: t


def reference_loss(sc: dict, module: nn.Module, params: dict, batch: tuple, rule: str = "exact") -> torch.Tensor:
    """The loss whose gradient an update applies: the minibatch's mean (tokens: over its
    non-padding tokens); ``rule="microbatch means"``: the wrong rule, the mean of the
    microbatches' token means."""
    x, y = batch
    if not sc.get("tokens"):
        out = functional_call(module, params, (x,))
        return lm_loss(out, y) if sc.get("model") == "tied" else nn.functional.cross_entropy(out, y)
    if rule == "microbatch means":
        parts = list(zip(x.chunk(sc["m"]), y.chunk(sc["m"])))
        return sum(reference_loss(sc, module, params, part) for part in parts) / len(parts)
    out = functional_call(module, params, (x,))
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=PAD)


def reference(sc: dict, version_of=None, loss_rule: str = "exact", **changes) -> dict:  # type: ignore[no-untyped-def]
    """Single-process training of scenario ``sc`` (``changes`` override its entries): per
    minibatch t, the gradient with every stage's weights of version ``version_of(stage, t)``
    (default: the kind's rule), clipped by torch over the whole model, one optimizer step, one
    scheduler step. Returns the final state, each update's norm (before clipping), loss,
    learning rates by name, and gradient norms by name."""
    sc = {**sc, **changes}
    module = build_model(sc)
    named = [(k, p) for k, p in module.named_parameters() if p.requires_grad]  # a tied matrix once
    fixed = {k: p.detach() for k, p in module.named_parameters() if not p.requires_grad}
    optimizer = OPTIMIZERS[sc.get("opt", "sgd")](named)
    scheduler = reference_scheduler(sc, optimizer)
    rule, clip = version_of or version_rule(sc), clip_of(sc)
    history = [{k: p.detach().clone() for k, p in named}]
    out: dict = {"norms": [], "losses": [], "by_name": []}
    for t, batch in enumerate(batches_of(sc)):
        params = {k: history[max(0, rule(stage_of(sc, k), t))][k].clone().requires_grad_(True) for k, _ in named}
        loss = reference_loss(sc, module, {**params, **fixed}, batch, loss_rule)
        for (_, p), g in zip(named, torch.autograd.grad(loss, list(params.values()))):
            p.grad = g
        out["by_name"].append({k: p.grad.norm().item() for k, p in named})
        # torch's own clipping over the whole model (max_norm inf: the norm alone, gradients × 1)
        total = torch.nn.utils.clip_grad_norm_([p for _, p in named], clip if clip else math.inf)
        out["norms"].append(total.item())
        out["losses"].append(loss.item())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        history.append({k: p.detach().clone() for k, p in named})
    out["full"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    out["lrs"] = optimizer.lrs
    out["final_lrs"] = {n: g["lr"] for g in optimizer.param_groups for n in g["param_names"]}
    return out


def reference_round_robin(sc: dict) -> dict:
    """pipedream on the "2-1" plan: minibatch t runs on replica t mod 2 of stage 0 with its
    version max(0, ⌊t/2⌋ − 1) (2 forwards in flight per replica) and on stage 1 with version t;
    stage 0 updates once per round of two minibatches with their summed gradient over their
    summed counts (tokens or samples), stage 1 once per minibatch; one optimizer per stage."""
    module = build_model(sc)
    named = [(k, p) for k, p in module.named_parameters() if p.requires_grad]
    stages = {s: [(k, p) for k, p in named if stage_of(sc, k) == s] for s in (0, 1)}
    optimizers = {s: OPTIMIZERS[sc.get("opt", "sgd")](stages[s]) for s in stages}
    history = {s: [{k: p.detach().clone() for k, p in stages[s]}] for s in stages}
    version = {0: lambda t: max(0, t // 2 - 1), 1: lambda t: t}
    losses, summed, counts = [], {k: torch.zeros_like(p) for k, p in stages[0]}, 0
    for t, (x, y) in enumerate(batches_of(sc)):
        params = {k: history[s][version[s](t)][k].clone().requires_grad_(True) for s in stages for k, _ in stages[s]}
        loss = reference_loss(sc, module, params, (x, y))
        losses.append(loss.item())
        count = int((y != PAD).sum()) if sc.get("tokens") else len(y)
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        counts += count
        for k, _ in stages[0]:
            summed[k] += grads[k] * count
        for s in (1, 0) if t % 2 else (1,):
            for k, p in stages[s]:
                p.grad = summed[k] / counts if s == 0 else grads[k]
            optimizers[s].step()
            history[s].append({k: p.detach().clone() for k, p in stages[s]})
        if t % 2:
            summed, counts = {k: torch.zeros_like(p) for k, p in stages[0]}, 0
    return {"full": {k: v.detach().clone() for k, v in module.state_dict().items()}, "losses": losses,
            "lrs": {s: optimizers[s].lrs for s in stages}}


def names_of_rank(sc: dict, rank: int) -> list[str]:
    """The trainable parameters of the stages ``rank`` holds (the model's names)."""
    plan = plan_of(sc)
    stages = set(plan.stages_of_rank(rank))
    module = build_model(sc)
    names = [k for k, p in module.named_parameters() if p.requires_grad and stage_of(sc, k) in stages]
    if sc.get("model") == "tied" and rank == N_PROCS - 1:
        names.append("emb.weight")  # the output layer's copy of the shared matrix
    return sorted(names)


def assert_close(got: dict, want: dict, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """Final weights: float32 SGD and AdamW land within ~6e-8 of the reference here."""
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=rtol, msg=f"parameter {k}")


def differs(got: dict, want: dict) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


def assert_learning_rates(records: list[dict[str, float]], want: list[dict[str, float]], names: list[str]) -> None:
    """The rank's per-update learning rates are the reference's for its parameters."""
    expected = [{n: lrs[n] for n in names} for lrs in want] if names else []
    assert [sorted(r) for r in records] == [sorted(e) for e in expected]
    flat = [r[n] for r in records for n in sorted(r)]
    assert flat == pytest.approx([e[n] for e in expected for n in sorted(e)], rel=1e-12, abs=0)


# --------------------------------------------------------------------------- tests: runs
# pipedream on a replicated stage updates stage 0 once per round of two minibatches and the
# last stage once per minibatch: its own test below.
STRAIGHT_UPDATES = sorted(set(SCENARIOS) - {"pipedream_2_1"})


@pytest.mark.parametrize("name", STRAIGHT_UPDATES)
def test_weights_norms_losses_and_learning_rates_equal_the_reference(results, name):
    """Every recipe under every kind: the final weights, each update's gradient norm (the same
    on every rank), each minibatch's loss, and each update's learning rate on every rank."""
    sc = SCENARIOS[name]
    want = reference(sc)
    got = results[0][name]
    assert_close(got["full"], want["full"])
    for r in results:
        assert r[name]["norms"] == results[0][name]["norms"], "every rank reports the same norms"
        assert r[name]["losses"] == results[0][name]["losses"]
    # grad_norms: every update's norm with clipping, none without
    assert got["norms"] == (pytest.approx(want["norms"], rel=1e-6) if clip_of(sc) else [])
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    for rank, r in enumerate(results):
        names = names_of_rank(sc, rank)
        assert r[name]["names"] == names, f"rank {rank}: the optimizer factory's (name, parameter) pairs"
        assert_learning_rates(r[name]["lrs"], want["lrs"], names)


@pytest.mark.parametrize("name", [n for n in STRAIGHT_UPDATES if clip_of(SCENARIOS[n])])
def test_clipping_clips_most_updates_and_matters(results, name):
    sc = SCENARIOS[name]
    want = reference(sc)
    clip = clip_of(sc)
    assert sum(v > clip for v in want["norms"]) * 2 >= len(want["norms"]), (want["norms"], clip)
    # without clipping the run would have ended elsewhere: the test sees the clipping
    assert differs(results[0][name]["full"], reference(sc, clip=None)["full"]) > 1e-4


def test_tied_parameter_counted_once_in_the_norm(results):
    sc = SCENARIOS["flush_tied"]
    want = reference(sc)
    twice = [math.sqrt(total ** 2 + by_name["emb.weight"] ** 2)
             for total, by_name in zip(want["norms"], want["by_name"])]
    got = results[0]["flush_tied"]["norms"]
    assert got == pytest.approx(want["norms"], rel=1e-6)
    assert all(abs(g - w) > 1e-3 * w for g, w in zip(got, twice)), "the shared matrix counted twice"


@pytest.mark.parametrize("name", ["pipedream", "2bw", "zb-2bw", "pipedream_groups", "2bw_groups",
                                  "pipedream_tokens", "2bw_tokens", "pipedream_frozen", "2bw_frozen"])
def test_asynchronous_kinds_keep_their_version_rule_with_the_recipe(results, name):
    """The plain synchronous rule is measurably elsewhere: the weight versions matter here."""
    sc = SCENARIOS[name]
    assert differs(results[0][name]["full"], reference(sc, version_of=lambda s, t: t)["full"]) > 1e-4


@pytest.mark.parametrize("name", ["gpipe_groups", "pipedream_groups", "2bw_groups"])
def test_parameter_groups_by_name(results, name):
    """Groups chosen by the original names: one group for all would train something else."""
    got = results[0][name]["full"]
    assert differs(got, reference(SCENARIOS[name], opt="uniform_adamw")["full"]) > 1e-3


@pytest.mark.parametrize("name", ["flush_tokens", "2bw_tokens", "flush_2_1"])
def test_token_normalization_is_over_the_whole_minibatch(results, name):
    """Sum of the microbatches' summed losses over the sum of their token counts: the mean of
    the microbatches' means (wrong here, the padding is uneven) is far from it."""
    sc = SCENARIOS[name]
    counts = [[int((y != PAD).sum()) for y in yb.chunk(sc["m"])] for _, yb in batches_of(sc)]
    assert all(max(c) >= 2 * min(c) for c in counts), counts
    wrong = reference(sc, loss_rule="microbatch means")
    assert differs(results[0][name]["full"], wrong["full"]) > 1e-3
    assert results[0][name]["losses"] != pytest.approx(wrong["losses"], rel=1e-3)


@pytest.mark.parametrize("name", ["zb-h1_frozen", "pipedream_frozen", "2bw_frozen"])
def test_frozen_parameters_stay_and_a_frozen_stage_has_no_optimizer(results, name):
    sc = SCENARIOS[name]
    got, initial = results[0][name]["full"], mlp().state_dict()
    for k in sc["frozen"]:
        assert torch.equal(got[k], initial[k]), k
    assert all(not torch.equal(got[k], initial[k]) for k in initial if k not in sc["frozen"])
    whole = [rank for rank in range(N_PROCS) if not names_of_rank(sc, rank)]
    assert len(whole) == 1
    assert results[whole[0]][name]["optimizers"] == 0 and results[whole[0]][name]["lrs"] == []


def test_pipedream_on_a_replicated_stage(results):
    """Stage 0's replicas update once per round of two minibatches (tokens normalized over
    both), stage 1 once per minibatch; the optimizers' groups by name on both."""
    sc = SCENARIOS["pipedream_2_1"]
    want = reference_round_robin(sc)
    got = results[0]["pipedream_2_1"]
    assert_close(got["full"], want["full"])
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    for rank, r in enumerate(results):
        stage = 0 if rank < 2 else 1
        names = names_of_rank(sc, rank)
        assert r["pipedream_2_1"]["names"] == names
        assert_learning_rates(r["pipedream_2_1"]["lrs"], want["lrs"][stage], names)
    assert len(want["lrs"][0]) == 4 and len(want["lrs"][1]) == 8
    # plain synchronous training is measurably elsewhere
    assert differs(got["full"], reference(sc, version_of=lambda s, t: t)["full"]) > 1e-4


@pytest.mark.parametrize("name", ["flush_2_1", "pipedream_2_1"])
def test_replicas_stay_bit_identical(results, name):
    a, b = results[0][name]["stage"], results[1][name]["stage"]
    assert sorted(a) == sorted(b) and a
    assert all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- tests: checkpoints
def resumed(sc: dict, directory: Path) -> tuple[Pipeline, list[float]]:
    """The checkpoint loaded onto one process holding the whole model (flush), trained on."""
    plan = Plan.straight([sum(LAYERS["mlp"], [])], schedule="flush", microbatches=2)
    pipe = pipeline(sc, plan, [])
    pipe.load_checkpoint(directory)
    return pipe, pipe.train_minibatches(batches_of(sc)[CHECKPOINT_AT:])


@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_checkpoint_resumes_schedule_clipping_and_optimizer_on_another_plan(results, root, name):
    sc = CHECKPOINTED[name]
    rule = version_rule(sc)
    want = reference(sc, version_of=lambda s, t: rule(s, t) if t < CHECKPOINT_AT else t)
    assert results[0][name]["norms"] == pytest.approx(want["norms"][:CHECKPOINT_AT], rel=1e-6)
    pipe, losses = resumed(sc, root / name)
    assert_close(pipe.state_dict(), want["full"])
    assert losses == pytest.approx(want["losses"][CHECKPOINT_AT:], rel=1e-5)
    after = len(want["norms"]) - CHECKPOINT_AT
    assert pipe.grad_norms[-after:] == pytest.approx(want["norms"][CHECKPOINT_AT:], rel=1e-6)
    [optimizer] = optimizers_of(pipe)
    assert_learning_rates(optimizer.lrs, want["lrs"][CHECKPOINT_AT:], sorted(want["final_lrs"]))
    now = {n: g["lr"] for g in optimizer.param_groups for n in g["param_names"]}
    assert now == pytest.approx(want["final_lrs"], rel=1e-12)
    # the schedule moved: a run that restarted it would have other learning rates
    assert want["lrs"][CHECKPOINT_AT] != want["lrs"][0]


# --------------------------------------------------------------------------- tests: one process
@pytest.mark.parametrize("schedule, points", [
    (LRSchedule("cosine", warmup=2, total=10), {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.85355339, 6: 0.5, 10: 0.0, 20: 0.0}),
    (LRSchedule("cosine", warmup=2, total=10, final=0.1), {6: 0.55, 8: 0.1 + 0.9 * 0.14644661, 12: 0.1}),
    (LRSchedule("linear", total=4), {0: 1.0, 1: 0.75, 3: 0.25, 4: 0.0, 9: 0.0}),
    (LRSchedule("polynomial", warmup=1, total=5, power=2.0, final=0.2), {0: 1.0, 1: 1.0, 3: 0.4, 5: 0.2}),
    (LRSchedule("constant", warmup=4), {0: 0.25, 2: 0.75, 3: 1.0, 100: 1.0}),
])
def test_lr_schedule_formula_at_hand_computed_points(schedule, points):
    assert {u: schedule(u) for u in points} == pytest.approx(points, abs=1e-8)
    # as a torch scheduler: the lr after u steps is base_lr × f(u)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.2)
    scheduler = schedule.scheduler(optimizer)
    for u in range(max(points) + 1):
        if u in points:
            assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * points[u], abs=1e-9), u
        optimizer.step()
        scheduler.step()


def one_process(**kwargs) -> Pipeline:
    plan = Plan.straight([sum(LAYERS["mlp"], [])], schedule="flush", microbatches=2)
    return Pipeline(mlp(), plan, optimizer=sgd, loss_fn=nn.CrossEntropyLoss(), **kwargs)


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_bad_clip_grad_norm_is_refused_by_name(value):
    with pytest.raises(PipelineError, match="clip_grad_norm"):
        one_process(clip_grad_norm=value)


def test_loss_normalizer_needs_a_summed_loss():
    with pytest.raises(PipelineError, match="loss_normalizer"):
        one_process(loss_normalizer=count_tokens)


@pytest.mark.parametrize("kind", ["interleaved", "zb-v"])
def test_a_rank_with_several_stages_steps_after_its_last_backward_which_clipping_needs(kind):
    """A rank holding several stages takes its steps of an update after its last backward of it
    (over all its stages), so the global norm can be there at its first step; a step moved
    before one of the rank's backwards is what the validator refuses, and clipping with it."""
    import dataclasses

    from torchpipedream.schedule.actions import Kind
    from torchpipedream.schedule.build import build_schedule
    from torchpipedream.schedule.validate import update_barrier_problem

    plan = Plan.v_shape(CUTS[4], 2, microbatches=4) if kind == "zb-v" else Plan.looped(CUTS[4], 2, microbatches=4)
    sched = build_schedule(plan, kind, minibatches=2)
    assert update_barrier_problem(sched) is None
    for actions in sched.actions.values():
        steps = [k for k, a in enumerate(actions) if a.kind is Kind.OPTIMIZER_STEP and a.id == 0]
        backwards = [k for k, a in enumerate(actions) if a.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD) and a.id < 4]
        assert len(steps) == 2 and min(steps) > max(backwards)
    early = list(sched.actions[0])
    step = next(k for k, a in enumerate(early) if a.kind is Kind.OPTIMIZER_STEP)
    last_b = max(k for k, a in enumerate(early) if a.kind is Kind.BACKWARD and a.id < 4)
    early.insert(last_b, early.pop(step))
    problem = update_barrier_problem(dataclasses.replace(sched, actions={**sched.actions, 0: early}))
    assert problem is not None and "before its" in problem


@pytest.mark.parametrize("option", ["clip_grad_norm", "lr_scheduler"])
def test_recipes_refused_by_name_for_pipedream_on_a_replicated_stage(results, option):
    """Its stages do not update together (stage 0 once per round of two minibatches, stage 1
    once per minibatch): no update count or update-wide norm means the same on both. Refused
    on every rank with the same message (no rank left waiting)."""
    messages = [r["refused_2_1"][option] for r in results]
    assert messages[0] is not None and option in messages[0]
    assert messages == [messages[0]] * N_PROCS


def test_lr_scheduler_instance_and_metric_schedulers_are_refused():
    """A scheduler instance (bound to one optimizer; each stage needs its own) and a scheduler
    that steps on a metric (a resumed run could not rebuild it from the update count)."""
    instance = StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 2)
    with pytest.raises(PipelineError, match="lr_scheduler must be a factory"):
        one_process(lr_scheduler=instance)
    with pytest.raises(PipelineError, match="lr_scheduler ReduceLROnPlateau"):
        one_process(lr_scheduler=lambda o: ReduceLROnPlateau(o))
