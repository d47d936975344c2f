"""Checkpoints of plans with virtual stages (a worker holding several stages: interleaved, zb-v),
exact and movable between layouts, and clipping by the global norm on them (issue 37, item 5).

One launch of 4 gloo processes:

- **same layout**: interleaved on 4 workers (8 stages, dropout in a stage) trains 6 minibatches
  straight through; a second run trains 3, saves, builds a fresh pipeline, loads and trains 3:
  weights, Adam state, loss history and data position equal the uninterrupted run bit for bit
  (the random state is restored with the layout).
- **across layouts**: interleaved (8 stages on 4 workers) → zb-v (8 stages in a V) → a straight
  flush pipeline (4 stages), saving and loading between them, and with tensor parallelism
  interleaved (4 stages on 2 workers × 2 tensor ranks) → flush PP2 × TP2; each ends equal to plain
  PyTorch in one process (the reference is written here).
- **clipping**: interleaved and zb-v on 8 stages clip by the global norm under a cosine
  learning-rate schedule, equal to torch's ``clip_grad_norm_`` in one process.
- **float16**: interleaved and zb-v on 8 stages with loss scaling (an update skipped), saved and
  resumed, equal to torch's ``GradScaler`` in one process (tests/fp16_reference.py).
- After the launch, the interleaved checkpoint loads into one process and exports to a plain
  state dict, both equal to the reference at its step.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from scenario_reference import assert_equals_one_process, one_process_training, optimizer
from torchpipedream.models import MODELS
from torchpipedream.plans.plan import Plan
from torchpipedream.runtime import Pipeline, launch
from torchpipedream.runtime.checkpoint import read_stage_states
from torchpipedream.runtime.loss_scaling import LossScaling
from torchpipedream.runtime.lr_schedule import LRSchedule

N_PROCS = 4
NAMES = ["input_1", "fc1", "act1", "fc2", "norm", "fc3", "act2", "drop", "fc4", "head"]
#: eight stages for four workers (a linear layer in most)
EIGHT = [["input_1", "fc1"], ["act1", "fc2"], ["norm"], ["fc3"], ["act2"], ["drop"], ["fc4"], ["head"]]
FOUR = [["input_1", "fc1", "act1"], ["fc2", "norm"], ["fc3", "act2", "drop"], ["fc4", "head"]]
#: with tensor parallelism: four stages on two workers, a Linear pair (fc1-fc2, fc3-fc4) in stages 0 and 2
LOOPED_TP = [["input_1", "fc1", "act1", "fc2"], ["norm"], ["fc3", "act2", "drop", "fc4"], ["head"]]
TWO_TP = [LOOPED_TP[0] + LOOPED_TP[1], LOOPED_TP[2] + LOOPED_TP[3]]
LR = 0.02
CLIP = 0.3
#: float16's loss scale: 2**20 overflows on the first update (skipped), then halves
FP16_SCALING = LossScaling(init_scale=2.0 ** 20, growth_interval=2)


def model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(collections.OrderedDict([
        ("fc1", nn.Linear(6, 16)), ("act1", nn.GELU()), ("fc2", nn.Linear(16, 8)), ("norm", nn.LayerNorm(8)),
        ("fc3", nn.Linear(8, 16)), ("act2", nn.Tanh()), ("drop", nn.Dropout(dropout)), ("fc4", nn.Linear(16, 8)),
        ("head", nn.Linear(8, 3))]))


def data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def reference(steps: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch in one process: one Adam step per minibatch on its mean loss."""
    net = model()
    opt = adam(net.parameters())
    for x, y in data()[:steps]:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.state_dict()


def plan(shape: str, kind: str, tensor_parallel: int = 1) -> Plan:
    made = {"looped": lambda: Plan.looped(EIGHT, 4, schedule=kind, microbatches=4),
            "v": lambda: Plan.v_shape(EIGHT, 4, schedule=kind, microbatches=4),
            "straight": lambda: Plan.straight(FOUR, schedule=kind, microbatches=4),
            "looped_tp": lambda: Plan.looped(LOOPED_TP, 2, schedule=kind, microbatches=4),
            "straight_tp": lambda: Plan.straight(TWO_TP, schedule=kind, microbatches=4)}[shape]()
    return dataclasses.replace(made, tensor_parallel=tensor_parallel)


def pipeline(p: Plan, dropout: float = 0.0) -> Pipeline:
    return Pipeline(model(dropout), p, optimizer=adam, loss_fn=nn.functional.cross_entropy, timeout_s=60, seed=0)


def _summary(pipe: Pipeline) -> dict:
    return {"state": pipe.state_dict(), "history": list(pipe.history), "minibatches": pipe.minibatches_done,
            "version": pipe.engine.weights.version}


def _same_layout(root: Path) -> dict:
    """Interleaved with dropout: 6 minibatches straight through, and 3 + save + load + 3."""
    batches, p = data(), plan("looped", "interleaved")
    whole = pipeline(p, dropout=0.25)
    whole.train_minibatches(batches[:3])
    whole.train_minibatches(batches[3:])
    first = pipeline(p, dropout=0.25)
    first.train_minibatches(batches[:3])
    first.save_checkpoint(root / "same", next_minibatch=3)
    again = pipeline(p, dropout=0.25)
    extra = again.load_checkpoint(root / "same")
    again.train_minibatches(batches[3:])
    return {"whole": _summary(whole), "resumed": _summary(again), "extra": extra}


def _across(root: Path) -> dict:
    """interleaved (3 minibatches) -> zb-v (2) -> straight flush (1), through checkpoints."""
    batches = data()
    out = {}
    for i, (shape, kind, start, stop) in enumerate([("looped", "interleaved", 0, 3), ("v", "zb-v", 3, 5),
                                                     ("straight", "flush", 5, 6)]):
        pipe = pipeline(plan(shape, kind))
        if i:
            pipe.load_checkpoint(root / f"across{i - 1}")
        pipe.train_minibatches(batches[start:stop])
        pipe.save_checkpoint(root / f"across{i}")
        out[kind] = pipe.state_dict()
    return out


def _tensor_parallel(root: Path) -> dict:
    """interleaved on 2 workers × 2 tensor ranks (2 minibatches) -> flush PP2 × TP2 (1)."""
    batches = data()
    first = pipeline(plan("looped_tp", "interleaved", tensor_parallel=2))
    first.train_minibatches(batches[:2])
    first.save_checkpoint(root / "tp")
    again = pipeline(plan("straight_tp", "flush", tensor_parallel=2))
    again.load_checkpoint(root / "tp")
    again.train_minibatches(batches[2:3])
    return {"state": again.state_dict()}


def _clipped(kind: str) -> dict:
    """4 minibatches on 8 stages, clipped by the global norm under a warm-up-then-cosine schedule."""
    shape = "looped" if kind == "interleaved" else "v"
    pipe = Pipeline(model(), plan(shape, kind), optimizer=optimizer("momentum"), loss_fn=nn.functional.cross_entropy,
                    clip_grad_norm=CLIP, lr_scheduler=LRSchedule("cosine", warmup=1, total=4), timeout_s=60)
    pipe.train_minibatches(data()[:4])
    return {"state": pipe.state_dict(), "norms": pipe.grad_norms}


def _float16(kind: str, root: Path) -> dict:
    """3 minibatches on 8 stages in float16 with a loss scale that overflows at first, saved
    after 2 and resumed for the third (the scale travels with the checkpoint)."""
    shape = "looped" if kind == "interleaved" else "v"

    def make() -> Pipeline:
        return Pipeline(model(), plan(shape, kind), optimizer=optimizer("sgd"), loss_fn=nn.functional.cross_entropy,
                        precision="fp16", loss_scaling=FP16_SCALING, timeout_s=60)
    first = make()
    first.train_minibatches(data()[:2])
    first.save_checkpoint(root / f"fp16_{kind}")
    again = make()
    again.load_checkpoint(root / f"fp16_{kind}")
    again.train_minibatches(data()[2:3])
    return {"state": again.state_dict(), "norms": [], "scale": (again.loss_scale, again.skipped_updates)}


class TiedLM(nn.Module):
    """A language model whose output layer is its embedding (one matrix, in stages 0 and 7)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(11, 8)
        self.h = nn.ModuleList([nn.Linear(8, 8) for _ in range(6)])
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embedding(x)
        for layer in self.h:
            h = torch.tanh(layer(h))
        return self.head(h)


TIED_EIGHT = [["x", "embedding"]] + [[f"h_{i}", "tanh" if i == 0 else f"tanh_{i}"] for i in range(6)] + [["head"]]


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, 11), y.reshape(-1))


def tokens(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 11, (8, 5), generator=g), torch.randint(0, 11, (8, 5), generator=g)) for _ in range(n)]


def _tied() -> dict:
    """The tied model interleaved on 4 workers (its two copies on workers 0 and 3), clipped."""
    p = Plan.looped(TIED_EIGHT, 4, schedule="interleaved", microbatches=4)
    pipe = Pipeline(TiedLM(), p, optimizer=adam, loss_fn=token_loss, clip_grad_norm=CLIP, timeout_s=60)
    pipe.train_minibatches(tokens())
    return {"state": pipe.state_dict(), "norms": pipe.grad_norms}


def _worker(rank: int, root: str) -> dict:
    torch.set_num_threads(1)
    return {"same": _same_layout(Path(root)), "across": _across(Path(root)), "tp": _tensor_parallel(Path(root)),
            "clipped": {kind: _clipped(kind) for kind in ("interleaved", "zb-v")},
            "fp16": {kind: _float16(kind, Path(root)) for kind in ("interleaved", "zb-v")}, "tied": _tied()}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("virtual_checkpoints")


@pytest.fixture(scope="module")
def results(root: Path) -> dict:
    return launch(_worker, N_PROCS, str(root), timeout_s=300, stall_timeout_s=60)


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=2e-6, rtol=2e-5, msg=f"{what}: {key}")


def test_resume_on_the_same_virtual_layout_equals_the_uninterrupted_run(results: dict) -> None:
    whole, resumed = results["same"]["whole"], results["same"]["resumed"]
    for key, value in whole["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    assert resumed["history"] == whole["history"] and len(whole["history"]) == 6
    assert resumed["minibatches"] == whole["minibatches"] == 6
    assert resumed["version"] == whole["version"]
    assert results["same"]["extra"] == {"next_minibatch": 3}
    # dropout draws: the run is not the dropout-free model's, so the equality above is not vacuous
    assert any((whole["state"][k] - results["across"]["flush"][k]).abs().max() > 1e-4 for k in whole["state"])


def test_a_virtual_checkpoint_moves_between_layouts_and_kinds(results: dict) -> None:
    across = results["across"]
    assert_close(across["interleaved"], reference(3), "interleaved, 3 minibatches")
    assert_close(across["zb-v"], reference(5), "zb-v from interleaved's checkpoint")
    assert_close(across["flush"], reference(6), "flush from zb-v's checkpoint")


def test_a_tensor_parallel_virtual_checkpoint_resumes_on_another_plan(results: dict) -> None:
    assert_close(results["tp"]["state"], reference(3), "flush PP2 x TP2 from interleaved x TP2")


@pytest.mark.parametrize("kind", ["interleaved", "zb-v"])
def test_virtual_stages_clip_by_the_global_norm_as_one_process(results: dict, kind: str) -> None:
    """A rank's steps of an update follow its last backward of it over all its stages, so the
    norm over every rank's gradients is there at its first step (clipping with every kind)."""
    case = dict(m=4, clip=True, sched=True)
    want = one_process_training(model(), data()[:4], optimizer("momentum"), case, CLIP, None)
    assert_equals_one_process(kind, case, results["clipped"][kind], want, CLIP)


@pytest.mark.parametrize("kind", ["interleaved", "zb-v"])
def test_virtual_stages_scale_float16_losses_as_torchs_grad_scaler(results: dict, kind: str) -> None:
    """Every stage a rank holds skips the same updates (one decision per rank and update, over
    all its stages' gradients, agreed with every rank), as torch's GradScaler in one process."""
    case = dict(m=4, precision="fp16")
    want = one_process_training(model(), data()[:3], optimizer("sgd"), case, CLIP, FP16_SCALING)
    assert_equals_one_process(kind, case, results["fp16"][kind], want, CLIP)


def test_a_shared_parameter_on_virtual_stages_trains_as_one_model(results: dict) -> None:
    """Each copy (stage 0 on worker 0, stage 7 on worker 3) posts its gradient and steps with the
    sum after its rank's last backward of the update: equal to the tied model in one process,
    clipped by torch's clip_grad_norm_ (which counts the tied matrix once)."""
    net = TiedLM()
    opt = adam(net.parameters())
    norms = []
    for x, y in tokens():
        opt.zero_grad()
        token_loss(net(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
    got = results["tied"]
    assert_close(got["state"], net.state_dict(), "tied, interleaved")
    assert got["norms"] == pytest.approx(norms, rel=1e-5) and max(norms) > CLIP
    assert torch.equal(got["state"]["embedding.weight"], got["state"]["head.weight"])


def test_every_stage_of_a_virtual_plan_has_its_file(root: Path, results: dict) -> None:
    manifest = json.loads((root / "across0" / "manifest.json").read_text())
    files = {e["file"]: e for e in manifest["files"] if e["file"].startswith("stage")}
    assert sorted(files) == sorted(f"stage{s}.pt" for s in range(8))
    assert {files[f"stage{s}.pt"]["rank"] for s in (0, 4)} == {0}  # stages 0 and 4 live on worker 0
    assert set(manifest["index"].values()) <= set(files)


def test_a_virtual_checkpoint_loads_into_one_process_and_exports(root: Path, results: dict) -> None:
    want = reference(3)
    assert_close(read_stage_states(root / "across0"), want, "exported")
    one = Pipeline(model(), Plan.straight([NAMES], schedule="flush", microbatches=2), optimizer=adam,
                   loss_fn=nn.functional.cross_entropy)
    one.load_checkpoint(root / "across0")
    assert_close(one.state_dict(), want, "loaded into one process")
    one.train_minibatches(data()[3:5])  # Adam's moments came with the weights
    assert_close(one.state_dict(), reference(5), "one process, two more minibatches")


@pytest.mark.timeout(300)
def test_train_runs_interleaved_and_resumes_it_as_zb_v(tmp_path: Path) -> None:
    """`train` runs the kinds with virtual stages: one epoch interleaved (a plan file of 4 stages on
    2 workers), then --resume --schedule zb-v re-plans for the V and continues from its checkpoint
    (that the weights continue exactly is shown above, on the same pipelines `train` runs)."""
    from test_train import _mlp_layer_names
    from torchpipedream.train import TrainConfig
    from torchpipedream.train.job import run

    names = _mlp_layer_names()
    quarter = -(-len(names) // 4)
    Plan.looped([names[i:i + quarter] for i in range(0, len(names), quarter)], 2, schedule="interleaved",
                microbatches=2).save(tmp_path / "plan.json")
    common = dict(model="mlp", workers=2, batch_size=16, lr=0.05, optimizer="momentum", max_minibatches=4,
                  progress=False, timeout_s=60.0, out=str(tmp_path / "run"))
    first = run(TrainConfig(epochs=1, schedule="interleaved", plan_file=str(tmp_path / "plan.json"), **common))
    assert first["schedule"] == "interleaved" and "2 per worker" in first["plan"]
    resumed = run(TrainConfig(epochs=2, schedule="zb-v", resume=True, **common))
    assert resumed["schedule"] == "zb-v" and "2 per worker" in resumed["plan"]
    assert [r["epoch"] for r in resumed["history"]] == [1, 2]
    assert resumed["history"][0]["train_loss"] == first["history"][0]["train_loss"]
    assert resumed["plan_changes"] and "'zb-v'" in " ".join(resumed["plan_changes"][0]["because"])
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["state_dict"]
    assert set(state) == set(MODELS["mlp"]().state_dict())
