"""Scale, on paper: GPT-3 175B and Llama 3 70B planned on 8 to 1,024 GPUs from analytic profiles.

Each model gets the GPU it was published on (model/analytic_profiles.py: GPT-3 on A100-80GB at
140 TFLOP/s, Llama 3 70B on H100-80GB at 400 TFLOP/s) in servers of 8 joined by NVLink, the
servers by InfiniBand (one network port per GPU). The planner is today's: pipeline stages ×
replicated data parallelism × tensor parallelism inside a server (``--tensor``: 1 and 8, all of
1, 2, 4, 8 at ``--tensor-sweep-at`` GPUs; search/tensor_parallel.py prices it), schedule
``flush`` (synchronous 1F1B, Megatron's), mixed-precision Adam (16 bytes per parameter:
``optimizer_state_factor`` 7 over the bf16 weights), with and without activation recomputation. A case the planner has not finished in ``--limit-s`` seconds
is cut (it runs in a child process) and recorded as cut. Per case: planning time, the plan,
predicted samples/s and TFLOP/s per GPU, predicted peak memory per GPU against the GPU's.

Prints a table and writes benchmarks/results/scale.json, with the published configurations
beside it (``PUBLISHED``). docs/scale.md shows both.

    .venv/bin/python benchmarks/scale.py [--gpus 8,64,512,1024] [--tensor 1,8] [--limit-s 60]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from table_format import Data, Table, listing, num, table  # noqa: E402

from torchpipedream.model.analytic_profiles import (A100_80GB, GPT3_175B, H100_80GB, LLAMA3_70B,  # noqa: E402
                                                    OPTIMIZER_STATE_FACTOR, GPUSpec, TransformerShape,
                                                    block_forward_flops, head_forward_flops, transformer_graph)
from torchpipedream.plans.plan import PlanError  # noqa: E402
from torchpipedream.plans.topology import Level, Topology, format_bandwidth  # noqa: E402
from torchpipedream.search.planner import plan  # noqa: E402

GPUS_PER_NODE = 8
#: Links per GPU and direction. A100 (DGX A100, the Selene nodes of Narayanan et al. 2021, §5):
#: NVLink 3 through NVSwitch, 600 GB/s per GPU both ways together, and one 200 Gb/s HDR
#: InfiniBand port per GPU. H100 (DGX H100 / Meta's Grand Teton, Llama 3 §3.3.1: "400 Gbps
#: interconnects between GPUs", InfiniBand for the smaller models): NVLink 4, 900 GB/s both ways,
#: one 400 Gb/s port per GPU. Data-sheet rates; all-reduces charged at the ring formula's full speed.
LINKS = {"A100-80GB": (("NVLink 3", 300e9), ("InfiniBand HDR 200 Gb/s", 25e9)),
         "H100-80GB": (("NVLink 4", 450e9), ("InfiniBand NDR 400 Gb/s", 50e9))}

#: (shape, GPU, sequences per minibatch, flash attention, why). Microbatches of one sequence.
MODELS = [
    (GPT3_175B, A100_80GB, 1536, False,
     "batch 1,536 as Megatron-LM's GPT-3 runs (Narayanan et al. 2021, §5.1, Table 2); attention keeps its "
     "s×s scores (Korthikanti et al.'s count; no fused attention in 2021)"),
    (LLAMA3_70B, H100_80GB, 2048, True,
     "batch 2,048 × 8,192 tokens = 16M tokens, the 405B run's final batch (Llama 3 paper, Table 4; the paper "
     "gives none for 70B: our choice); fused (flash) attention"),
]

#: Published configurations, for reference. Only what we could state with confidence; ``note``
#: says where a number comes from and marks what we could not check.
PUBLISHED = [
    {"model": "GPT-3 175B (174.6B)", "source": "Narayanan et al. 2021 (Megatron-LM, SC21), §5.1", "gpus": 1024,
     "gpu": "A100-80GB", "tensor": None, "pipeline": None, "data": None, "batch": 1536, "tflops_per_gpu": 140,
     "note": "the paper's training-time estimate (34 days for 300B tokens) at 140 TFLOP/s per GPU, 45% of the "
             "312 TFLOP/s peak; FLOPs counted with recomputation. The split into tensor × pipeline is in its "
             "Table 2 (model-parallel size), not checked here"},
    {"model": "GPT-3 175B (174.6B)", "source": "Narayanan et al. 2021, Table 2 (PTD-P rows)", "gpus": 1536,
     "gpu": "A100-80GB", "tensor": None, "pipeline": None, "data": None, "batch": 1536, "tflops_per_gpu": 141,
     "note": "153 / 149 / 141 TFLOP/s per GPU on 384 / 768 / 1,536 GPUs, read from a transcription of the "
             "table, not from the paper itself"},
    {"model": "GPT 145.6B (h 12288, 80 layers)", "source": "Narayanan et al. 2021, Table 1", "gpus": 1536,
     "gpu": "A100-80GB", "tensor": 8, "pipeline": 8, "data": 24, "batch": 2304, "tflops_per_gpu": 148,
     "note": "47% of peak; GPT-3's width on fewer layers. 148 TFLOP/s and 47% also in a transcription of the "
             "table; tensor, pipeline and batch as we recall the table, not checked"},
    {"model": "GPT 1T (1008B)", "source": "Narayanan et al. 2021, abstract and Table 1", "gpus": 3072,
     "gpu": "A100-80GB", "tensor": 8, "pipeline": 64, "data": 6, "batch": 3072, "tflops_per_gpu": 163,
     "note": "52% of peak, 502 PFLOP/s in all: the paper's headline (the 52% is this model's, not GPT-3's)"},
    {"model": "Llama 3 405B", "source": "Dubey et al. 2024 (The Llama 3 Herd of Models), Table 4", "gpus": 16384,
     "gpu": "H100-80GB", "tensor": 8, "pipeline": 16, "data": 128, "batch": 2048, "tflops_per_gpu": 400,
     "note": "sequence 8,192, 16M tokens per batch; 430 TFLOP/s on 8,192 GPUs (data 64); BF16 MFU 38-43%. The "
             "paper states no parallel configuration for 70B"},
    {"model": "Llama 3 70B", "source": "NVIDIA NeMo Framework 24.12 performance summary", "gpus": 64,
     "gpu": "unsure (H100, we believe)", "tensor": 4, "pipeline": 4, "data": 2, "batch": 128,
     "tflops_per_gpu": 734,
     "note": "FP8, not bf16; context parallel 2, 5 virtual stages, microbatch 1, sequence 8,192; 1,524 tokens/s "
             "per GPU; model TFLOP/s. The GPU type was not on the page as we read it"},
]


def cluster(gpu: GPUSpec, gpus: int) -> Topology:
    """``gpus`` GPUs in servers of 8 (NVLink inside, InfiniBand between), with the GPU's memory."""
    (inner, inner_bw), (outer, outer_bw) = LINKS[gpu.name]
    levels = [Level(min(gpus, GPUS_PER_NODE), inner_bw, inner)]
    if gpus > GPUS_PER_NODE:
        if gpus % GPUS_PER_NODE:
            raise SystemExit(f"--gpus: {gpus} is not a whole number of {GPUS_PER_NODE}-GPU servers")
        levels.append(Level(gpus // GPUS_PER_NODE, outer_bw, outer))
    return Topology(levels, memory_bytes=gpu.memory_bytes, name=f"{gpus}×{gpu.name}")


def flops_per_sequence(shape: TransformerShape) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs with recomputation) of one sequence's forward and backward."""
    block = sum(block_forward_flops(shape, 1))
    forward = shape.layers * block + head_forward_flops(shape, 1)
    return 3 * forward, 3 * forward + shape.layers * block


def _plan_case(shape: TransformerShape, gpu: GPUSpec, gpus: int, batch: int, flash: bool,
               recompute: bool, tensor: int) -> dict[str, Any]:
    """Plan one case (in the child process); the row's planner fields."""
    graph = transformer_graph(shape, 1, gpu, microbatches=batch, flash_attention=flash)
    topo = cluster(gpu, gpus)
    t0 = time.perf_counter()
    try:
        p = plan(graph, topo, schedule="flush", microbatches=batch, optimizer_state_factor=OPTIMIZER_STATE_FACTOR,
                 recompute=recompute, tensor_parallel=tensor)
    except PlanError as exc:
        needed = re.search(r"fits in is [^(]*\((\d+) bytes\)", str(exc))
        return {"planning_s": time.perf_counter() - t0, "status": "does not fit", "fits": False,
                "smallest_budget_bytes": int(needed[1]) if needed else None, "error": str(exc)}
    elapsed = time.perf_counter() - t0
    model_flops, hardware_flops = flops_per_sequence(shape)
    sps = p.predicted["samples_per_s"]
    return {"planning_s": elapsed, "status": "planned", "fits": p.predicted["peak_memory_bytes"] <= gpu.memory_bytes,
            "config": p.config, "summary": p.summary, "stages": p.num_stages,
            "replicas": sorted({s.replicas for s in p.stages}), "samples_per_s": sps,
            "tokens_per_s": sps * shape.seq_len,
            "time_per_minibatch_s": p.predicted["time_per_minibatch_s"],
            "model_tflops_per_gpu": sps * model_flops / gpus / 1e12,
            "hardware_tflops_per_gpu": sps * (hardware_flops if recompute else model_flops) / gpus / 1e12,
            "peak_memory_bytes": p.predicted["peak_memory_bytes"], "bottleneck": p.predicted.get("bottleneck"),
            "feasibility_checks": p.meta["feasibility_checks"]}


def _child(conn: Any, *args: Any) -> None:
    conn.send(_plan_case(*args))
    conn.close()


def run_case(shape: TransformerShape, gpu: GPUSpec, gpus: int, batch: int, flash: bool, recompute: bool,
             tensor: int, limit_s: float) -> dict[str, Any]:
    """One row: the case, and the plan or the cut after ``limit_s`` seconds."""
    topo = cluster(gpu, gpus)
    row: dict[str, Any] = {"model": shape.name, "gpu": gpu.name, "gpus": gpus, "topology": topo.to_spec(),
                           "links": [f"{lv.name} {format_bandwidth(lv.bandwidth_Bps)}" for lv in topo.levels],
                           "memory_per_gpu_bytes": gpu.memory_bytes, "batch": batch, "microbatch_size": 1,
                           "microbatches": batch, "flash_attention": flash, "recompute": recompute, "tensor": tensor,
                           "state_bytes_per_gpu": 2 * (1 + OPTIMIZER_STATE_FACTOR) * shape.parameters / gpus}
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, shape, gpu, gpus, batch, flash, recompute, tensor))
    t0 = time.perf_counter()
    proc.start()
    if parent.poll(limit_s):
        row.update(parent.recv())
        proc.join()
    else:
        proc.terminate()
        proc.join()
        row.update({"planning_s": time.perf_counter() - t0, "status": "cut", "fits": None, "limit_s": limit_s})
    return row


def _row_text(r: Data) -> str:
    head = (f"{r['model']:<11} {r['gpus']:>5} {r.get('tensor', 1):>3} {'yes' if r['recompute'] else 'no':>4} "
            f"{r['planning_s']:>9.1f}")
    if r["status"] == "cut":
        return f"{head}  cut after {r['limit_s']:.0f} s"
    if r["status"] == "does not fit":
        return f"{head}  nothing fits; smallest budget {num(gb(r['smallest_budget_bytes']), '.0f')} GB"
    return (f"{head}  {r['stages']:>3} stages × {_replicas(r):<6} {r['samples_per_s']:>8.2f} "
            f"{r['model_tflops_per_gpu']:>6.0f} {gb(r['peak_memory_bytes']):>6.1f} GB  fits: {r['fits']}")


def gb(n: float | None) -> float | None:
    """Bytes as GB (10⁹), the unit the GPUs' memory is sold in."""
    return None if n is None else n / 1e9


def _replicas(r: Data) -> str:
    reps = r["replicas"]
    return str(reps[0]) if len(reps) == 1 else f"{reps[0]}-{reps[-1]}"


# ----------------------------------------------------------------------------- what the docs show
def _plan_cell(r: Data) -> str:
    if r["status"] == "cut":
        return f"cut after {r['limit_s']:.0f} s"
    if r["status"] == "does not fit":
        return f"nothing fits (needs {num(gb(r['smallest_budget_bytes']), '.0f')} GB per GPU)"
    return f"{r['stages']} stages × {_replicas(r)} replicas"


def _tflops_cell(r: Data) -> str:
    if r["status"] != "planned":
        return "-"
    return f"{r['model_tflops_per_gpu']:.0f} ({r['hardware_tflops_per_gpu']:.0f})"


def scale(data: Data) -> str:
    """scale.json → one row per case: planning time, plan, predicted throughput and memory."""
    head = ["model", "GPUs", "tensor", "recompute", "planning s", "plan (pipeline stages × data replicas)", "samples/s",
            "TFLOP/s per GPU, model (hardware)", "peak memory per GPU, GB", "fits in 80 GB"]
    body = []
    for r in data["rows"]:
        planned = r["status"] == "planned"
        body.append([r["model"], f"{r['gpus']:,}", str(r.get("tensor", 1)), "yes" if r["recompute"] else "no",
                     f"{r['planning_s']:.1f}",
                     _plan_cell(r), num(r.get("samples_per_s")), _tflops_cell(r),
                     num(gb(r.get("peak_memory_bytes")), ".1f"),
                     ("yes" if r["fits"] else "no") if planned else ("no" if r["status"] == "does not fit" else "-")])
    return table(head, body)


def scale_published(data: Data) -> str:
    """scale.json → the published configurations it records beside the plans."""
    head = ["model", "source", "GPUs", "GPU", "tensor × pipeline × data", "batch", "TFLOP/s per GPU", "note"]
    body = [[p["model"], p["source"], f"{p['gpus']:,}", p["gpu"],
             " × ".join("?" if p[k] is None else str(p[k]) for k in ("tensor", "pipeline", "data")), f"{p['batch']:,}",
             p["tflops_per_gpu"], p["note"]] for p in data["published"]]
    return table(head, body)


def _cut_cases(data: Data) -> str:
    cut = [f"{r['model']} on {r['gpus']:,}" for r in data["rows"] if r["status"] == "cut"]
    return listing(cut) if cut else "none"


def _slowest_finished(data: Data) -> str:
    done = [r for r in data["rows"] if r["status"] != "cut"]
    r = max(done, key=lambda r: r["planning_s"])
    return f"{r['planning_s']:.1f} s ({r['model']} on {r['gpus']:,} GPUs)"


def _tensor_ranking(data: Data) -> str:
    """Per model, at the GPU count with the most tensor degrees: model TFLOP/s per GPU by degree."""
    parts = []
    for model in dict.fromkeys(r["model"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["model"] == model and r["status"] == "planned" and r["recompute"]]
        if not rows:
            continue
        gpus = max({r["gpus"] for r in rows}, key=lambda g: (sum(r["gpus"] == g for r in rows), -g))
        cells = [f"tensor {r.get('tensor', 1)}: {r['model_tflops_per_gpu']:.0f}"
                 for r in sorted((r for r in rows if r["gpus"] == gpus), key=lambda r: r.get("tensor", 1))]
        parts.append(f"{model} on {gpus:,} GPUs, {', '.join(cells)}")
    return "; ".join(parts)


TABLES = {"scale": Table(("scale.json",), scale), "scale_published": Table(("scale.json",), scale_published)}
VALUES = {"scale_limit_s": Table(("scale.json",), lambda d: f"{d['limit_s']:.0f} s"),
          "scale_cut_cases": Table(("scale.json",), _cut_cases),
          "scale_slowest_finished": Table(("scale.json",), _slowest_finished),
          "scale_tensor_ranking": Table(("scale.json",), _tensor_ranking)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="8,64,512,1024", help="GPU counts (default: %(default)s)")
    ap.add_argument("--limit-s", type=float, default=60.0, help="cut a case planning longer (default: %(default)s)")
    ap.add_argument("--no-recompute-up-to", type=int, default=8,
                    help="also plan without recomputation up to this many GPUs (default: %(default)s)")
    ap.add_argument("--tensor", default="1,8", help="tensor-parallel degrees of every case (default: %(default)s)")
    ap.add_argument("--tensor-sweep-at", type=int, default=64,
                    help="at this many GPUs also the degrees 2 and 4 (default: %(default)s)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "scale.json"))
    args = ap.parse_args()
    counts = [int(c) for c in args.gpus.split(",")]
    degrees = [int(t) for t in args.tensor.split(",")]
    rows = []
    print(f"{'model':<11} {'GPUs':>5} {'TP':>3} {'rec':>4} {'plan s':>9}  {'plan':<20} {'samples/s':>8} {'TFLOPs':>6} "
          f"{'memory':>9}")
    for shape, gpu, batch, flash, _ in MODELS:
        for gpus in counts:
            for tensor in sorted(set(degrees) | ({2, 4} if gpus == args.tensor_sweep_at else set())):
                for recompute in ([False, True] if gpus <= args.no_recompute_up_to else [True]):
                    rows.append(run_case(shape, gpu, gpus, batch, flash, recompute, tensor, args.limit_s))
                    print(_row_text(rows[-1]), flush=True)
    models = [{"model": s.name, "parameters": s.parameters, "gpu": g.name, "sustained_tflops": g.sustained_tflops,
               "batch": b, "flash_attention": f, "why": why} for s, g, b, f, why in MODELS]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                               "limit_s": args.limit_s, "schedule": "flush",
                               "optimizer_state_factor": OPTIMIZER_STATE_FACTOR, "models": models, "rows": rows,
                               "published": PUBLISHED}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
