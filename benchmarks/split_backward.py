"""What splitting a stage's backward into B (inputs' gradient) and W (weights' gradient) costs.

For each benchmark model of compare.py (wide layers split in 4, as its torchpipedream rows run
it) cut into the stages of its 2-worker zb-h1 plan, and for a deep transformer stage, one
process, one thread: the median seconds of one microbatch's full backward
(``torch.autograd.backward`` over weights and inputs, what flush runs) against B
(``split_backward.backward_inputs``) and W (``WeightGradients.run``) of the same microbatch,
interleaved (full, split, full, split, ...) so that drift hits both alike. Reports B + W over
the full backward (the split's overhead) and W / (B + W) (the share the simulator assumes,
``simulator.WEIGHT_GRAD_SHARE``).

    .venv/bin/python benchmarks/split_backward.py          # ~1 min

Writes benchmarks/results/split_backward.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_format import Data, Table, span, table  # noqa: E402


def _stage_case(module: torch.nn.Module, inputs: tuple[Any, ...], loss: Callable[[Any], torch.Tensor] | None,
                first: bool = False) -> Callable[[bool], tuple[float, float]]:
    """A function timing one backward of ``module`` on ``inputs`` (leaves needing a gradient, but
    on the ``first`` stage, whose inputs are data, as in the runtime): full (returns (seconds,
    0)) or split (returns (B seconds, W seconds)). ``loss`` turns the last stage's output into
    the loss; other stages get random output gradients."""
    import torch

    from torchpipedream.model.split_backward import backward_inputs
    from torchpipedream.runtime.engine import as_tuple

    params = [p for p in module.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    grads = None

    def once(split: bool) -> tuple[float, float]:
        nonlocal grads
        xs = tuple(t.detach().requires_grad_(t.is_floating_point() and not first) if isinstance(t, torch.Tensor)
                   else t for t in inputs)
        leaves = [t for t in xs if isinstance(t, torch.Tensor) and t.requires_grad]
        out = module(*xs)
        if loss is not None:
            roots, grad_outputs = [loss(out)], None
        else:
            roots = [t for t in as_tuple(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if grads is None:
                grads = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in roots]
            grad_outputs = grads
        t0 = time.perf_counter()
        if not split:
            torch.autograd.backward(roots, grad_tensors=grad_outputs, inputs=params + leaves)
            return time.perf_counter() - t0, 0.0
        work = backward_inputs(roots, grad_outputs, leaves, params)
        t1 = time.perf_counter()
        work.run()
        return t1 - t0, time.perf_counter() - t1

    return once


def _measure(once: Callable[[bool], tuple[float, float]], reps: int) -> dict[str, float]:
    for split in (False, True, False, True):  # warm-up
        once(split)
    full, b, w = [], [], []
    for _ in range(reps):
        full.append(once(False)[0])
        tb, tw = once(True)
        b.append(tb)
        w.append(tw)
    f, bb, ww = statistics.median(full), statistics.median(b), statistics.median(w)
    return {"full_ms": f * 1e3, "b_ms": bb * 1e3, "w_ms": ww * 1e3, "split_over_full": (bb + ww) / f,
            "w_share": ww / (bb + ww)}


def model_rows(name: str, microbatches: int, reps: int) -> list[dict]:
    """Every stage of the model's 2-worker zb-h1 plan (compare.py's cut, wide layers in 4 parts)."""
    import torch
    from compare_rows import WORKLOADS, choose_plan, tpd_model

    from torchpipedream.runtime.engine import as_tuple
    from torchpipedream.runtime.stage_split import split_stages

    work = WORKLOADS[name]
    plan, _ = choose_plan(work, 2, "zb-h1", microbatches, 4)
    model = tpd_model(work, 4)
    x, y = work.make_batch(work.batch_size // microbatches, torch.Generator().manual_seed(0))
    split = split_stages(model, plan, sample=((x,), {}))
    rows, values = [], split.inputs((x,), {})
    for s, module in enumerate(split.modules):
        last = s == len(split.modules) - 1
        once = _stage_case(module, tuple(values), (lambda out: work.loss_fn(out, y)) if last else None, first=s == 0)
        rows.append({"model": name, "stage": s, "layers": len(plan.stages[s].layers), **_measure(once, reps)})
        if not last:
            with torch.no_grad():
                values = list(as_tuple(module(*values)))
    return rows


def deep_rows(blocks: int, reps: int) -> list[dict]:
    """A stage of ``blocks`` transformer blocks (the LM's, d_model 128) after the first stage."""
    import torch

    from torchpipedream.models import transformer

    torch.manual_seed(0)
    lm = transformer(layers=blocks)
    stage = torch.nn.Sequential(*lm.blocks)
    h = torch.randn(4, 64, lm.blocks[0].ln1.normalized_shape[0])
    return [{"model": f"{blocks} transformer blocks", "stage": 1, "layers": blocks,
             **_measure(_stage_case(stage, (h,), None), reps)}]


# ----------------------------------------------------------------------------- what the docs show
def split_backward(data: Data) -> str:
    """split_backward.json (benchmarks/split_backward.py) → one stage per row: the full backward
    against B and W of the split one."""
    head = ["model", "stage", "layers", "full backward ms", "B ms", "W ms", "(B + W) / full", "W / (B + W)"]
    body = [[r["model"], r["stage"], r["layers"], f"{r['full_ms']:.2f}", f"{r['b_ms']:.2f}", f"{r['w_ms']:.2f}",
             f"{r['split_over_full']:.2f}", f"{r['w_share']:.2f}"] for r in data["rows"]]
    return (table(head, body) + f"\n\nOne process, {data['threads']} thread, {data['args']['reps']} interleaved "
            f"repetitions (medians); microbatches of batch / {data['args']['microbatches']}.")



def _stage(model: str, stage: int, key: str = "split_over_full") -> Table:
    """A value: ``key`` of one row (a model's stage, or a deep stage by its model name)."""
    def render(d: Data) -> str:
        return f"{next(r[key] for r in d['rows'] if r['model'] == model and r['stage'] == stage):.2f}"
    return Table(("split_backward.json",), render)


BENCHMARK_MODELS = ("fc_heavy", "small_cnn", "transformer_lm")
VALUES = {
    "split_lm_second_stage": _stage("transformer_lm", 1),
    "split_8_blocks": _stage("8 transformer blocks", 1),
    "split_24_blocks": _stage("24 transformer blocks", 1),
    "split_w_share": Table(("split_backward.json",),
                           lambda d: span([r["w_share"] for r in d["rows"] if r["stage"] > 0])),
    "split_benchmark_stages": Table(("split_backward.json",), lambda d: span(
        [r["split_over_full"] for r in d["rows"] if r["model"] in BENCHMARK_MODELS])),
}
TABLES = {"split_backward": Table(("split_backward.json",), split_backward)}
COMPANIONS = {"split_backward.md": Table(("split_backward.json",), split_backward)}


def main(argv: list[str] | None = None) -> int:
    from compare_rows import WORKLOADS  # tunes the allocator, before torch is imported
    from peers import write_results

    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(WORKLOADS))
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--deep", default="2,8,24", help="transformer block counts of the deep-stage rows")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/split_backward")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [r for name in args.models.split(",") if name for r in model_rows(name, args.microbatches, args.reps)]
    rows += [r for n in args.deep.split(",") if n for r in deep_rows(int(n), args.reps)]
    for r in rows:
        print(f"{r['model']:<22} stage {r['stage']}  full {r['full_ms']:7.2f} ms  B {r['b_ms']:7.2f}  "
              f"W {r['w_ms']:7.2f}  (B+W)/full {r['split_over_full']:.2f}  W share {r['w_share']:.2f}", flush=True)
    result = {"args": vars(args), "threads": 1, "rows": rows}
    write_results(args.out, result, split_backward(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
