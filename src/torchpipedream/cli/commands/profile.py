"""`torchpipedream profile`: measure a model layer by layer and write its graph as JSON."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from ...util.output_files import check_output, writing
from . import CommandError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile",
        help="profile a model layer by layer and write its layer graph (JSON)",
        description="Trace a model with torch.fx, time every layer's forward and backward, record "
        "activation and parameter sizes, and write the layer graph the planner reads. A "
        "'module:function' model must either define sample_input(batch_size) in its module "
        "(returning an input, or an (input, target) pair; loss_fn(output, target) is used if "
        "the module defines it) or be given --input-shape.",
    )
    p.add_argument("--model", default="cnn", help="mlp, cnn (default), resnet, transformer, or module:function")
    p.add_argument("--batch-size", type=int, default=64, help="minibatch size to profile with (default 64)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="profile as a schedule with this many microbatches per minibatch runs it (flush, gpipe, "
                        "2bw): times of one microbatch × this number (default 1)")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions; numbers are medians (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (default 3)")
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: where the model is)")
    p.add_argument("--threads", type=int, default=1, help="torch threads while timing on CPU (default 1)")
    p.add_argument("--input-shape", default=None, help="per-sample float input shape for a module:function model, e.g. 1,8,8")
    p.add_argument("--no-loss", action="store_true", help="do not add the loss's time to the output layer")
    p.add_argument("--out", required=True, help="where to write the graph JSON")
    p.set_defaults(handler=run)


def _parse_shape(text: str) -> list[int]:
    try:
        shape = [int(s) for s in text.replace("x", ",").split(",") if s.strip()]
    except ValueError:
        shape = []
    if not shape or any(d <= 0 for d in shape):
        raise CommandError(f"--input-shape {text!r}: expected positive integers separated by commas, e.g. 1,8,8")
    return shape


def _user_sample(spec: str, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(input, target, loss_fn) for a module:function model."""
    import torch  # lazy: the command line starts torch-free; `profile` loads torch when it runs

    module = importlib.import_module(spec.partition(":")[0])
    if args.input_shape:
        x = torch.rand(args.batch_size, *_parse_shape(args.input_shape), generator=torch.Generator().manual_seed(0))
        return x, None, None
    make = getattr(module, "sample_input", None)
    if make is None:
        raise CommandError(
            f"--model {spec}: give --input-shape (e.g. --input-shape 1,8,8) or define "
            f"sample_input(batch_size) in module {module.__name__!r}"
        )
    sample = make(args.batch_size)
    target = None
    if isinstance(sample, tuple) and len(sample) == 2:
        sample, target = sample
    loss = getattr(module, "loss_fn", None) if target is not None else None
    return sample, target, loss


def run(args: argparse.Namespace) -> int:
    # lazy: both import torch; the command line starts torch-free and `profile` loads it when it runs
    from ...models import MODELS, get_model, loss_fn, sample_input
    from ...model.profiler import profile

    if args.batch_size < 1:
        raise CommandError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.iters < 1 or args.warmup < 0:
        raise CommandError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    if args.microbatches < 1 or args.microbatches > args.batch_size:
        raise CommandError(f"--microbatches must be between 1 and --batch-size ({args.batch_size}), got {args.microbatches}")
    if args.threads < 1:
        raise CommandError(f"--threads must be >= 1, got {args.threads}")
    out = check_output(args.out, "--out")

    model = get_model(args.model)
    if args.model in MODELS:
        x, target = sample_input(args.model, args.batch_size)
        loss = loss_fn(args.model)
    else:
        x, target, loss = _user_sample(args.model, args)
    if args.no_loss:
        loss, target = None, None
    graph = profile(
        model, x, loss_fn=loss, target=target, device=args.device, warmup=args.warmup,
        iters=args.iters, name=args.model, num_threads=args.threads, microbatches=args.microbatches,
    )
    with writing(out, "--out"):
        graph.save(out)
    t = graph.totals()
    heaviest = sorted(graph.layers, key=lambda l: l.compute_ms, reverse=True)[:3]
    print(
        f"profiled {args.model}: {len(graph)} layers, {len(graph.edges)} edges ({graph.meta['split']}), "
        f"batch {graph.batch_size} on {graph.meta['device']}"
    )
    print(
        f"  forward {t['forward_ms']:.3f} ms, backward {t['backward_ms']:.3f} ms, "
        f"parameters {t['parameter_bytes'] / 1e6:.2f} MB"
        + (f", loss in {graph.meta['loss_layer']!r}" if graph.meta.get("loss_layer") else "")
    )
    print("  heaviest: " + ", ".join(f"{l.name} {l.compute_ms:.3f} ms" for l in heaviest))
    print(f"wrote {out}")
    return 0
