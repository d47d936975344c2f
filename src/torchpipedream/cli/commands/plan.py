"""`torchpipedream plan`: choose stages and replicas for a layer graph on a topology."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ...model.profiles import load_profile
from ...plans.kinds import AUTO, KIND_NAMES, SCHEDULE_KINDS
from ...plans.memory import DEFAULT_OPTIMIZER_STATE_FACTOR
from ...plans.plan import PlanError
from ...plans.topology import Topology, parse_bytes
from ...util.output_files import check_output, writing
from . import CommandError

#: ``--schedule all``: every kind with true gradients planned and ranked by the simulator.
ALL = "all"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="split a profiled model into pipeline stages over a cluster (writes plan JSON)",
        description="Find the stages, replica counts and ranks with the smallest predicted time per "
        "minibatch (PipeDream's optimizer, exact, memory-aware) and print them as a table. "
        "Topologies: a compact spec innermost first such as 4x4:10GB/s,1.25GB/s (4 workers per "
        "server over 10 GB/s, 4 servers over 1.25 GB/s), 16:10GB/s, a preset (A, B, C, A:8, "
        "local, local:4) or a JSON file.",
    )
    p.add_argument("graph", help="layer graph: JSON from `torchpipedream profile`, a PipeDream graph.txt, or the "
                   "name of a bundled reference profile (alexnet, vgg16, resnet50, gnmt, ...)")
    p.add_argument("--topology", "-t", default="local", help="cluster spec, preset or JSON file (default: local)")
    p.add_argument("--straight", action="store_true", help="one worker per stage, no replication")
    p.add_argument("--stages", type=int, default=None, metavar="K", help="exactly K stages")
    p.add_argument("--allow-fewer-workers", action="store_true",
                   help="the plan may leave workers idle when that is not slower")
    p.add_argument("--memory", default=None, help="memory per worker, e.g. 16GB (default: the topology's, if any)")
    p.add_argument("--no-memory-limit", action="store_true", help="ignore the topology's memory per worker")
    p.add_argument("--schedule", default="pipedream", choices=[*KIND_NAMES, AUTO, ALL],
                   help="the schedule kind to plan for; auto: plan every synchronous kind at 1, 2, 4 and 8 "
                        "microbatches and keep the fastest the simulator predicts; all: the same over every kind "
                        "with true gradients (asynchronous, zero-bubble and interleaved ones too), ranked "
                        "(default: %(default)s)")
    p.add_argument("--allow-stale", action="store_true",
                   help="--schedule auto may also choose pipedream or 2bw (stale but true gradients)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="microbatches per minibatch (2bw, flush, gpipe, zb-h1, zb-h2, zb-v, zb-2bw; interleaved: a multiple of "
                        "the workers)")
    p.add_argument("--chunks", type=int, default=2, metavar="V",
                   help="interleaved: stages per worker, the model cut into workers x V stages (default: %(default)s)")
    p.add_argument("--optimizer-state", type=float, default=None, metavar="F",
                   help="extra weight-sized buffers per worker: gradient + optimizer state (default 2)")
    p.add_argument("--recompute", action="store_true",
                   help="activation recomputation on every stage (each backward runs its forward again)")
    p.add_argument("--shard", nargs="?", const="zero3", default="replicate", choices=["zero3", "zero2", "zero1"],
                   help="shard every replicated stage over its replicas (FSDP2; flush, gpipe, zb-h1, zb-h2), priced with the "
                        "shards' memory and collectives; --shard alone means zero3")
    p.add_argument("--tensor-parallel", type=_tensor_degree, default=1, metavar="T",
                   help="every worker is T processes of the innermost level splitting its Linear pairs and "
                        "transformer blocks (the synchronous kinds); priced with their all-reduces; 'auto': the "
                        "fastest predicted of 1, 2, 4, ... up to the innermost level's processes (with --schedule "
                        "auto or all: for every candidate) (default: %(default)s)")
    p.add_argument("--method", default="fast", choices=["fast", "hierarchical"],
                   help="fast: exact bisection (default); hierarchical: the paper's DP, for comparison")
    p.add_argument("--out", "-o", default=None, help="where to write the plan JSON")
    p.set_defaults(handler=run)


def _tensor_degree(text: str) -> int | str:
    """--tensor-parallel: a positive whole number or "auto"."""
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number or 'auto', got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    # lazy: every command module loads at start-up; the planner loads when `plan` runs (--help and show start sooner)
    from ...search.auto import auto_candidates_table, choose_schedule, plan
    from ...search.planner import nothing_sharded

    if args.out:
        check_output(args.out, "--out")
    graph = load_profile(args.graph)
    topo = Topology.from_any(args.topology)
    memory = parse_bytes(args.memory) if args.memory else None
    if args.no_memory_limit:
        if memory is not None:
            raise CommandError("give either --memory or --no-memory-limit, not both")
        topo.memory_bytes = None
    f = DEFAULT_OPTIMIZER_STATE_FACTOR if args.optimizer_state is None else args.optimizer_state
    options = dict(straight=args.straight, num_stages=args.stages, allow_fewer_workers=args.allow_fewer_workers,
                   memory_bytes=memory, optimizer_state_factor=f, method=args.method, recompute=args.recompute,
                   chunks=args.chunks, sharding=args.shard)
    if args.tensor_parallel != 1:
        if args.schedule == ALL and args.tensor_parallel != AUTO:
            raise CommandError(f"--tensor-parallel {args.tensor_parallel} splits layers under the synchronous kinds "
                               "only, and --schedule all plans every kind; give --schedule auto (the synchronous "
                               "kinds at this degree), one kind, or --tensor-parallel auto (each candidate at every "
                               "degree)")
        options["tensor_parallel"] = args.tensor_parallel
    if args.schedule == ALL:
        if args.microbatches != 1:
            raise CommandError("--schedule all tries 1, 2, 4 and 8 microbatches itself; drop --microbatches")
        kinds = [k.name for k in SCHEDULE_KINDS.values() if k.true_gradients]
        try:
            p = choose_schedule(graph, topo, kinds=kinds, allow_stale=True, **options)
        except PlanError as exc:
            raise CommandError(str(exc)) from None
    else:
        p = plan(graph, topo, schedule=args.schedule, microbatches=args.microbatches, allow_stale=args.allow_stale,
                 **options)
    print(f"{args.graph}: {len(graph)} layers, {len(graph.linearize())} blocks; topology {topo.to_spec()} "
          f"({topo.num_workers} workers)")
    print(p.table())
    why = nothing_sharded(p, args.shard) if args.schedule not in (AUTO, ALL) else None
    if why is not None:
        print(f"torchpipedream plan: warning: --shard {args.shard}: {why}", file=sys.stderr)
    if args.schedule in (AUTO, ALL):
        print(auto_candidates_table(p))
    for tried in p.meta.get("tensor_parallel_search", []):
        print(f"tensor parallel ×{tried['tensor_parallel']}: " + (
            f"does not fit: {tried['error']}" if "error" in tried else
            f"{tried['config']}, predicted {tried['time_per_minibatch_s'] * 1e3:.3f} ms per minibatch"))
    if args.out:
        with writing(args.out, "--out") as out:
            p.save(out)
        print(f"wrote {out}")
    return 0
