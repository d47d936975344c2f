"""`torchpipedream train`: the main job (profile, plan, launch, train, report)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Iterator

from ...plans.kinds import AUTO, KIND_NAMES
from ...train import OPTIMIZERS, TrainConfig, TrainError
from ...train.config import LR_SCHEDULES

_EPILOG = """\
With no options: the default CNN on the bundled digits images, one worker per core, PipeDream's
1F1B schedule with weight stashing. Outputs (plan, profile, measured timeline picture, Chrome
trace, checkpoint, report.json) go to --out; after every epoch the workers write an exact
checkpoint into OUT/checkpoints/epoch_N/ (the newest --keep-checkpoints are kept), and --resume
continues from the newest one written with the same options (or, for a finished run, writes
its outputs again). A --out that holds another run is refused unless --resume or --overwrite.
Under torchrun the same command runs one worker per process:
torchrun --nproc-per-node 4 -m torchpipedream train --model cnn
With torchrun --max-restarts K a job whose worker died restarts and resumes from the newest
checkpoint by itself (add --checkpoint-every N to lose at most N minibatches).
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model with pipeline parallelism on this computer's cores (the main job)",
        description="Profile the model, plan its stages for the workers, launch them, train on the "
        "bundled data with a progress bar, and report measured against predicted time.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = TrainConfig()
    _add_model_and_plan_options(p, d)
    _add_recipe_options(p, d)
    _add_run_options(p, d)
    p.set_defaults(handler=_handle)


def _add_model_and_plan_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """What to train, on how many workers, and how the plan is chosen."""
    p.add_argument("--model", default=d.model,
                   help="mlp, cnn, resnet, transformer (a character LM on Python's own sources), gpt2 (a small "
                        "Hugging Face GPT-2 on the same text; needs transformers), or a "
                        "user's module:function returning an nn.Module for (N,1,8,8) digits (default: %(default)s)")
    p.add_argument("--schedule", default=d.schedule, choices=[*KIND_NAMES, AUTO],
                   help="pipedream (1F1B + weight stashing), 2bw, flush, gpipe, zb-h1, zb-h2 (zero bubble), zb-2bw (2bw "
                        "with the backward split), naive, "
                        "or auto: the fastest predicted synchronous kind and microbatch count (default: %(default)s)")
    p.add_argument("--allow-stale", action="store_true",
                   help="--schedule auto may also choose pipedream or 2bw (stale but true gradients)")
    p.add_argument("--vertical-sync", action="store_true", help="pipedream: every stage uses the input stage's weight version")
    p.add_argument("--workers", type=int, default=d.workers, help="number of worker processes (default: one per core)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training data (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per minibatch (default: %(default)s)")
    p.add_argument("--microbatches", type=int, default=d.microbatches,
                   help="microbatches per minibatch for 2bw, flush, gpipe, zb-h1, zb-h2, zb-2bw (default: %(default)s)")
    p.add_argument("--stages", type=int, default=None, help="plan exactly this many stages (default: the planner's choice)")
    p.add_argument("--straight", action="store_true", help="plan a straight pipeline (no replicated stages)")
    p.add_argument("--shard", nargs="?", const="zero3", default=d.shard, choices=["zero3", "zero2", "zero1"],
                   help="shard every replicated stage over its replicas with torch's FSDP2 (ZeRO: weights, gradients "
                        "and optimizer state split; zero3 gathers the weights for each forward and backward, zero2 "
                        "keeps them from a forward to its backward, zero1 gathers them once per minibatch and "
                        "reduce-scatters the gradient once); flush, gpipe, zb-h1 and zb-h2; the planner prices it. "
                        "--shard alone means zero3 (default: replicate)")
    p.add_argument("--tensor-parallel", type=int, default=d.tensor_parallel, metavar="T",
                   help="every worker of the plan is T processes that split its stage's Linear pairs (an MLP's "
                        "two layers, a Llama block's projections, GPT-2's attention and MLP) with torch's DTensor; "
                        "--workers counts processes, so the plan has workers / T workers; the synchronous kinds: "
                        "flush, gpipe, zb-h1, zb-h2, interleaved, zb-v (default: %(default)s)")
    p.add_argument("--recompute", action="store_true",
                   help="activation recomputation on every stage: keep only each stage's inputs between a forward "
                        "and its backward, and run the forward again in the backward (less memory, more compute)")
    p.add_argument("--memory", default=None, metavar="BYTES",
                   help="per-worker memory budget, such as 512MB: every stage's predicted peak must fit "
                        "(plans/memory.py); with --schedule auto, activation recomputation is tried too and "
                        "the report says what the budget gave up")
    p.add_argument("--measure-memory", action="store_true",
                   help="record each worker's peak tensor memory (every allocation, through PyTorch's "
                        "profiler: slower) and report it per stage beside the prediction")
    p.add_argument("--precision", default=d.precision, choices=["fp32", "bf16", "fp16"],
                   help="bf16: forwards and losses under bfloat16 autocast, activations cross the cuts in "
                        "bfloat16; weights and optimizer state stay float32. fp16: the same in float16 with "
                        "dynamic loss scaling (synchronous schedules: flush, gpipe, auto) (default: %(default)s)")
    p.add_argument("--plan", dest="plan_file", default=None, help="use this plan.json instead of planning")
    p.add_argument("--topology", default=None, help="topology spec for the planner (default: local, one level)")


def _add_recipe_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The optimizer, its learning-rate schedule, weight decay and gradient clipping."""
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate (default: %(default)s)")
    p.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZERS,
                   help="sgd, momentum (SGD with momentum 0.9), adam or adamw (Adam with decoupled weight decay) "
                        "(default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, metavar="W",
                   help="weight decay on the weights of two or more dimensions (none on biases and norm weights); "
                        "decoupled with adamw, an L2 term with the others (default: %(default)s)")
    p.add_argument("--lr-schedule", default=d.lr_schedule, choices=LR_SCHEDULES,
                   help="the learning rate over the run's updates (one per minibatch): constant, or a linear, "
                        "cosine or polynomial decay to 0 at the last update, after --warmup (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, metavar="N",
                   help="raise the learning rate linearly over the first N updates (default: %(default)s)")
    p.add_argument("--clip-grad-norm", type=float, default=d.clip_grad_norm, metavar="X",
                   help="clip every update's gradient to a global norm of at most X, the norm taken over the "
                        "whole model's gradients across stages; the report gives each epoch's largest and mean norm")


def _add_run_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Where the run writes, its deadlines, checkpoints and resumption."""
    p.add_argument("--out", default=d.out, help="output directory (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (default: %(default)s)")
    p.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s,
                   help="the deadline of every wait for a peer and of every collective step; a run stops when "
                        "no worker makes progress for this long (plus the failure path's), never while it "
                        "works; must exceed the longest single step (default: %(default)s)")
    p.add_argument("--startup-timeout", dest="startup_timeout_s", type=float, default=d.startup_timeout_s,
                   metavar="SECONDS",
                   help="how long a worker process may take to start (import torch and the model's modules, "
                        "load its arguments) before the run is stopped naming it; separate from --timeout, "
                        "so that a loaded machine's slow start is not taken for a hang (default: %(default)s)")
    p.add_argument("--max-minibatches", type=int, default=None, metavar="N",
                   help="train at most N minibatches per epoch (quick runs; N >= 1)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete, verified checkpoint in OUT/checkpoints written with "
                        "the same options (it says which); --epochs is the total to reach; a finished run only "
                        "writes its outputs again")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="also write an exact checkpoint every N minibatches inside an epoch (the pipeline "
                        "drains there: one schedule per N minibatches); under torchrun --max-restarts a "
                        "restarted job resumes from the newest checkpoint by itself")
    p.add_argument("--failure-timeout", dest="failure_timeout_s", type=float, default=d.failure_timeout_s,
                   help="when a worker fails, the deadline of each step the others take to stop "
                        "(reporting and reading the failure; they stop within milliseconds per stage "
                        "when the failed worker's connections close) (default: %(default)s)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, metavar="N",
                   help="keep the N newest checkpoints, and always the newest one of an epoch's end; 0 keeps "
                        "every checkpoint (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true",
                   help="--out holds another run: delete its checkpoints and outputs and start afresh")
    p.add_argument("--init", default=None, metavar="FILE",
                   help="start from these weights: a state_dict file (.pt or .safetensors), such as "
                        "`torchpipedream export` writes (a checkpoint of --resume takes precedence)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _resume_hint(out: str) -> str:
    from ...runtime.checkpoint import latest_checkpoint  # lazy: imports torch (the command line starts torch-free)

    found = latest_checkpoint(f"{out}/checkpoints")
    if found is None:
        return "no checkpoint was written before the failure: run again to start over"
    return f"the newest checkpoint is {found}; continue from it with --resume (and the same options)"


class _Terminated(Exception):
    """SIGTERM reached the `train` command while it ran workers on this computer."""


@contextlib.contextmanager
def _sigterm_stops_the_run() -> Iterator[None]:
    """In this command's own process, and only for a local run: SIGTERM stops the run as an
    error does (launch() kills its workers on the way out) and ends in one line, where the
    default action ended this process at once and left its workers to find the store gone,
    each printing torch's C++ stack. Under torchrun the worker keeps the default action (its
    main thread may be blocked in gloo, where a Python handler would not run)."""
    if "RANK" in os.environ or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _handle(args: argparse.Namespace) -> int:
    # lazy: these import torch; the command line starts torch-free and `train` loads it when it runs
    from ...runtime.failures import PipelineFailure
    from ...runtime.launcher import LaunchError
    from ...train.job import run
    from ...train.outputs import format_report

    fields = TrainConfig.__dataclass_fields__
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    logging.getLogger("torchpipedream").setLevel(logging.WARNING)
    try:
        with _sigterm_stops_the_run():
            report = run(cfg)
    except _Terminated:
        print(f"torchpipedream train: stopped by SIGTERM; its workers were stopped.\n{_resume_hint(cfg.out)}",
              file=sys.stderr)
        return 128 + signal.SIGTERM
    except TrainError as exc:
        if exc.quiet:  # under torchrun, rank 0 reports it
            return 2
        raise
    except (LaunchError, PipelineFailure) as exc:
        # A worker failed: its own error and traceback are in the message; the launcher's
        # stack on top of it would only bury them. Under torchrun a PipelineFailure means
        # another rank failed (its own process prints its error), and the message names the
        # first failure and where every rank stood. Checkpoints written so far are kept.
        print(f"torchpipedream train: training failed: {exc}\n{_resume_hint(cfg.out)}", file=sys.stderr)
        return 1
    if report:  # under torchrun only rank 0 reports
        print(format_report(report))
    return 0
