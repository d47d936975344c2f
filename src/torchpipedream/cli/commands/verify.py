"""`torchpipedream verify`: train a few minibatches with the pipeline and in one process, and
compare every parameter and buffer (``torchpipedream.runtime.verification``)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from typing import Any

from ...plans.kinds import KIND_NAMES, SHARDING_KINDS_TEXT, schedule_kind
from ...plans.plan import Plan
from ...plans.topology import Topology
from ...train import OPTIMIZERS, TrainConfig, TrainError
from ...train.config import LR_SCHEDULES, check_recipe
from . import CommandError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check that the pipeline trains a model exactly as its schedule's update rule says",
        description="Train a few minibatches of the model with the pipeline (worker processes on this "
        "computer) and with a one-process reference of each schedule's update rule, then compare every "
        "parameter and buffer; on a difference, name the first minibatch, stage and parameter. Run it once "
        "on a new model. The model must draw no random numbers in training (dropout 0 for the check).",
    )
    p.add_argument("--model", default="cnn",
                   help="mlp, cnn, resnet, transformer, gpt2, or module:function (a model for (N,1,8,8) digits, as "
                        "train takes) (default: %(default)s)")
    p.add_argument("--schedule", default="flush,pipedream",
                   help=f"comma-separated schedules to check, of {', '.join(KIND_NAMES)} (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default: %(default)s)")
    p.add_argument("--minibatches", type=int, default=4, help="minibatches to train (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per minibatch (default: %(default)s)")
    p.add_argument("--microbatches", type=int, default=2,
                   help="microbatches per minibatch for 2bw, flush, gpipe (default: %(default)s)")
    p.add_argument("--optimizer", default="momentum", choices=OPTIMIZERS,
                   help="sgd, momentum, adam or adamw (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="weight decay on the parameters of two or more dimensions, none on biases and norms, "
                        "in the pipeline and the reference alike (default: %(default)s)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default: %(default)s)")
    p.add_argument("--lr-schedule", default="constant", choices=LR_SCHEDULES,
                   help="the learning rate over the checked updates, stepped after each by every stage and by the "
                        "reference (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=0, metavar="N", help="updates of linear warm-up (default: %(default)s)")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="clip every update by the norm over all the model's gradients; the reference uses "
                        "torch.nn.utils.clip_grad_norm_ on the whole model")
    p.add_argument("--straight", action="store_true", help="plan a straight pipeline (no replicated stages)")
    p.add_argument("--shard", nargs="?", const="zero3", default="replicate", choices=["zero3", "zero2", "zero1"],
                   help="shard the plan's replicated stages over their replicas (FSDP2; flush, gpipe, zb-h1, zb-h2); "
                        "--shard alone means zero3")
    p.add_argument("--plan", dest="plan_file", default=None, help="check this plan.json instead of planning")
    p.add_argument("--seed", type=int, default=0, help="the model's initialisation seed (default: %(default)s)")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default: %(default)s)")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="tolerance relative to the largest value of each tensor (default: %(default)s)")
    p.add_argument("--device", default="cpu",
                   help="where the workers and the reference compute: cpu or cuda[:i] (workers that share a GPU "
                        "exchange messages through host memory; default: %(default)s)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: both sides' forwards and losses under bfloat16 autocast (default: %(default)s)")
    p.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    # lazy: these import torch (or the planner); the command line starts torch-free and `verify` loads it when it runs
    from ...model.profiler import profile
    from ...runtime.verification import verify_plans
    from ...search.planner import plan
    from ...train.inputs import load_data, loss_for, minibatches, optimizer_factory, seeded_model
    from ...train.worker import lr_schedule_of

    logging.getLogger("torchpipedream").setLevel(logging.WARNING)
    kinds = [k.strip() for k in args.schedule.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KIND_NAMES]
    if not kinds or unknown:
        raise CommandError(f"--schedule {args.schedule!r}: use schedules of {', '.join(KIND_NAMES)}, comma-separated")
    for flag, value in (("--workers", args.workers), ("--minibatches", args.minibatches),
                        ("--batch-size", args.batch_size), ("--microbatches", args.microbatches)):
        if value < 1:
            raise CommandError(f"{flag} must be at least 1, got {value}")
    for flag, tolerance in (("--atol", args.atol), ("--rtol", args.rtol)):
        if not tolerance >= 0:  # also NaN: a negative bound reported "MISMATCH, max |diff| 0"
            raise CommandError(f"{flag} must be a number >= 0, got {tolerance}")
    cannot = [k for k in kinds if args.shard != "replicate" and not schedule_kind(k).can_shard]
    if cannot:
        raise CommandError(f"--shard {args.shard} runs under {SHARDING_KINDS_TEXT}, not --schedule {cannot[0]}")
    if not 0 <= args.weight_decay < float("inf"):
        raise CommandError(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    cfg = TrainConfig(model=args.model, schedule=kinds[0], workers=args.workers, batch_size=args.batch_size,
                      microbatches=args.microbatches, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
                      weight_decay=args.weight_decay, lr_schedule=args.lr_schedule, warmup=args.warmup,
                      clip_grad_norm=args.clip_grad_norm, epochs=1, max_minibatches=args.minibatches)
    try:
        check_recipe(cfg, updates=args.minibatches)
    except TrainError as exc:
        raise CommandError(str(exc)) from None
    model = functools.partial(seeded_model, args.model, args.seed)
    x, y, _, _ = load_data(cfg)
    batches = minibatches(x, y, args.batch_size, args.minibatches, args.seed)
    if args.plan_file:
        base = Plan.load(args.plan_file)
    else:
        graph = profile(model(), x[: args.batch_size], loss_fn=loss_for(cfg), target=y[: args.batch_size],
                        warmup=1, iters=3)
        base = plan(graph, Topology.local(args.workers), schedule=kinds[0], microbatches=args.microbatches,
                    straight=args.straight, sharding=args.shard)
        if "pipedream" in kinds and any(st.replicas > 1 for st in base.stages):
            print(f"the planner chose {base.summary}; pipedream is checked on plans without replicated stages, so "
                  "checking a straight pipeline")
            base = plan(graph, Topology.local(args.workers), schedule=kinds[0], microbatches=args.microbatches,
                        straight=True)
    if args.shard != "replicate":  # a plan file's replicated stages too
        base = base.with_sharding(args.shard)
    plans = [dataclasses.replace(base, schedule=k, microbatches=args.microbatches) for k in kinds]
    print(f"verify {args.model}: {base.summary} ({base.config}), {len(batches)} minibatches of {args.batch_size}, "
          f"{args.precision} on {args.device}")
    reports = verify_plans(model, batches, plans, optimizer_factory(cfg), loss_fn=loss_for(cfg),
                           atol=args.atol, rtol=args.rtol, lr_scheduler=lr_schedule_of(cfg, len(batches)),
                           clip_grad_norm=cfg.clip_grad_norm, device=args.device, precision=args.precision)
    for report in reports:
        print(report)
    return 0 if all(r.ok for r in reports) else 1
