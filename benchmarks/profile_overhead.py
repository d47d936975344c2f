"""How well per-layer profiling adds up, and what profiling costs.

For each example model (one CPU thread) this prints the summed per-layer forward time from
``profile`` next to the whole model's forward time measured directly, and the same for the
backward (whole forward+backward minus whole forward, loss included), with ratios; plus how
long ``profile`` itself took. Ratios near 1 mean the per-layer numbers add up to the real
thing; the per-layer backward is re-run node by node, so it misses autograd's fused
scheduling and pays a small fixed cost per node.

    .venv/bin/python benchmarks/profile_overhead.py [--iters 20] [--models cnn,resnet]

Writes benchmarks/results/profile_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from table_format import Data, Table, table

BATCH = {"mlp": 64, "cnn": 64, "resnet": 64, "transformer": 16}


def whole_model_ms(model, x, y, loss, iters: int, warmup: int = 3) -> tuple[float, float]:
    """Median forward ms and forward+backward(+loss) ms of the unsplit model."""
    fwd, both = [], []
    for i in range(warmup + iters):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        loss(out, y).backward()
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append((t1 - t0) * 1e3)
            both.append((t2 - t0) * 1e3)
    model.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(both)


# ----------------------------------------------------------------------------- what the docs show
def profile_overhead(data: Data) -> str:
    """profile_overhead.json (benchmarks/profile_overhead.py) → per-layer sums against whole-model times."""
    head = ["model", "batch", "layers", "forward: per-layer sum ms", "whole ms", "ratio", "backward: per-layer sum ms",
            "whole ms", "ratio", "profile s"]
    body = [[r["model"], r["batch"], r["layers"], f"{r['layer_fwd_ms']:.3f}", f"{r['whole_fwd_ms']:.3f}",
             f"{r['fwd_ratio']:.2f}", f"{r['layer_bwd_ms']:.3f}", f"{r['whole_bwd_ms']:.3f}", f"{r['bwd_ratio']:.2f}",
             f"{r['profile_s']:.2f}"] for r in data["rows"]]
    return table(head, body) + f"\n\ntorch {data['torch']}, {data['threads']} thread, median of {data['iters']}."


TABLES = {"profile_overhead": Table(("profile_overhead.json",), profile_overhead)}


def main() -> None:
    import torch

    from torchpipedream.model.profiler import profile
    from torchpipedream.models import MODELS, get_model, loss_fn, sample_input

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "profile_overhead.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = get_model(name)
        x, y = sample_input(name, BATCH[name])
        loss = loss_fn(name)
        t0 = time.perf_counter()
        graph = profile(model, x, loss_fn=loss, target=y, iters=args.iters, name=name)
        profile_s = time.perf_counter() - t0
        whole_fwd, whole_both = whole_model_ms(model, x, y, loss, args.iters)
        t = graph.totals()
        rows.append({
            "model": name,
            "batch": BATCH[name],
            "layers": len(graph),
            "layer_fwd_ms": round(t["forward_ms"], 3),
            "whole_fwd_ms": round(whole_fwd, 3),
            "fwd_ratio": round(t["forward_ms"] / whole_fwd, 3),
            "layer_bwd_ms": round(t["backward_ms"], 3),
            "whole_bwd_ms": round(whole_both - whole_fwd, 3),
            "bwd_ratio": round(t["backward_ms"] / (whole_both - whole_fwd), 3),
            "profile_s": round(profile_s, 2),
        })
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))
    result = {"torch": torch.__version__, "threads": 1, "iters": args.iters, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
