"""What a training run is asked to do: :class:`TrainConfig`, its checks, and the data it
trains on (:func:`load_data`, counted by the checks). No torch import at module level, so the
command line can build its options from it quickly."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..plans.kinds import AUTO, KIND_NAMES, SHARDING_KINDS_TEXT, schedule_kind
from ..plans.plan import SHARDINGS, Plan, PlanError
from ..plans.topology import Topology, TopologyError, parse_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["TrainConfig", "TrainError", "OPTIMIZERS", "OPTIMIZER_STATE", "LR_SCHEDULES", "optimizer_scratch_of",
           "check_options", "microbatches_of", "schedule_of", "flag", "WORKER_MEMORY_BYTES", "load_data",
           "minibatches_per_epoch", "run_updates", "check_recipe"]

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
#: Copies of the weights each optimizer keeps besides the weights (the gradient included): the
#: memory model's ``optimizer_state_factor`` (plans/memory.py).
OPTIMIZER_STATE = {"sgd": 1.0, "momentum": 2.0, "adam": 3.0, "adamw": 3.0}
#: ``--lr-schedule``: runtime.lr_schedule.LR_SCHEDULE_KINDS, spelled out here to keep this module torch-free.
LR_SCHEDULES = ("constant", "linear", "cosine", "polynomial")


def optimizer_scratch_of(optimizer: str, cuda: bool) -> tuple[float, float]:
    """The memory model's ``optimizer_scratch`` of ``--optimizer`` (plans.memory.once_bytes):
    SGD steps in place; torch's Adam (and AdamW, the same code) runs a per-parameter loop on a CPU
    (two temporaries of the largest parameter's size) and its ``foreach`` form on CUDA (one of the
    stage's weights)."""
    if optimizer not in ("adam", "adamw"):
        return (0.0, 0.0)
    return (0.0, 1.0) if cuda else (2.0, 0.0)

#: Resident memory of one worker process before its model (Python, torch, gloo): about 300 MB
#: measured on the development machine (benchmarks/results/soak.json, "start_rss_mib"); the
#: bound on --workers charges 400 MB each, plus the model's weights four times (weights,
#: gradients, optimizer state, a stashed version).
WORKER_MEMORY_BYTES = 400 * 2**20

#: The command-line option of each TrainConfig field whose name differs from the option's.
_FLAGS = {"plan_file": "--plan", "timeout_s": "--timeout", "failure_timeout_s": "--failure-timeout",
          "startup_timeout_s": "--startup-timeout",
          "progress": "--no-progress"}


def flag(field_name: str) -> str:
    """The command-line option that sets the TrainConfig field ``field_name``."""
    return _FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


class TrainError(ValueError):
    """An option or input of `torchpipedream train` cannot be used; the message says what to do.

    ``quiet``: another process (rank 0 under torchrun) reports it; this one only exits."""

    def __init__(self, message: str, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


@dataclass
class TrainConfig:
    """Everything a training run needs; the CLI fills it from its options."""

    model: str = "cnn"
    schedule: str = "pipedream"
    workers: int = 0  # 0: one per core
    epochs: int = 8
    batch_size: int = 32
    lr: float = 0.001
    optimizer: str = "adam"
    weight_decay: float = 0.0  # on weights of 2+ dimensions only (not biases and norm weights)
    lr_schedule: str = "constant"  # constant, linear, cosine or polynomial decay to 0 at the run's last update
    warmup: int = 0  # updates of linear learning-rate warm-up
    clip_grad_norm: float | None = None  # clip by the global gradient norm over the whole model
    microbatches: int = 4
    stages: int | None = None  # planner: exactly this many stages
    straight: bool = False  # planner: no replication
    recompute: bool = False  # activation recomputation on every stage (Stage.recompute)
    shard: str = "replicate"  # what replicated stages do with their weights: replicate, zero3, zero2, zero1 (Stage.sharding)
    tensor_parallel: int = 1  # processes per worker splitting its stage's layers (Plan.tensor_parallel)
    memory: str | None = None  # per-worker memory budget for the planner ("512MB")
    measure_memory: bool = False  # record each worker's peak tensor memory (runtime/memory_probe.py)
    precision: str = "fp32"  # fp32, bf16 or fp16 (forwards under autocast; float32 master weights)
    allow_stale: bool = False  # --schedule auto may choose the asynchronous kinds (pipedream, 2bw)
    plan_file: str | None = None
    topology: str | None = None
    out: str = "runs/train"
    seed: int = 0
    timeout_s: float = 120.0
    startup_timeout_s: float = 300.0  # how long a worker may take to start (import torch, the model's modules)
    vertical_sync: bool = False
    progress: bool = True
    max_minibatches: int | None = None  # per epoch, for quick runs and tests
    resume: bool = False  # continue from the newest verified checkpoint in OUT/checkpoints
    checkpoint_every: int | None = None  # also checkpoint every N minibatches inside an epoch
    failure_timeout_s: float = 10.0  # deadline of each step of the failure path (runtime/failures.py)
    keep_checkpoints: int = 3  # newest checkpoints kept (plus the newest epoch end); 0 keeps all
    overwrite: bool = False  # replace another run's checkpoints and outputs in --out
    init: str | None = None  # start from these weights (a state_dict file: .pt or .safetensors)

    def resolved_workers(self) -> int:
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)


def microbatches_of(cfg: TrainConfig) -> int:
    """Microbatches per minibatch the run uses: ``--microbatches`` for the kinds that split a
    minibatch, 1 for the others (``--schedule auto``: see :func:`schedule_of`)."""
    if cfg.schedule == AUTO:
        raise TrainError("--schedule auto: the microbatches come from the chosen plan (schedule_of)")
    return cfg.microbatches if schedule_kind(cfg.schedule).microbatched else 1


def schedule_of(cfg: TrainConfig, plan: Plan) -> tuple[str, int]:
    """The schedule kind and microbatches per minibatch the run trains with: the options', or
    with ``--schedule auto`` the chosen plan's."""
    if cfg.schedule != AUTO:
        return cfg.schedule, microbatches_of(cfg)
    return plan.schedule, (plan.microbatches if schedule_kind(plan.schedule).microbatched else 1)


def load_data(cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits images for the vision models (and a user's model), stdlib text for the LM:
    (train inputs, train targets, test inputs, test targets)."""
    from ..models import digits_data, text_data  # lazy: models imports torch (this module stays torch-free)

    if cfg.model in ("transformer", "gpt2"):
        return text_data(context=64, max_bytes=120_000)
    return digits_data(seed=0)


def minibatches_per_epoch(samples: int, batch_size: int, limit: int | None) -> int:
    """How many minibatches ``inputs.minibatches`` makes of ``samples`` training samples in an
    epoch (a last partial one dropped; at most ``limit``)."""
    count = samples // batch_size if samples >= batch_size else min(samples, 1)
    return min(count, limit) if limit else count


def run_updates(cfg: TrainConfig) -> int:
    """The run's number of updates (one per minibatch under every schedule): ``--epochs`` times
    the minibatches of an epoch; what ``--lr-schedule`` decays over."""
    samples = len(load_data(cfg)[0])
    return cfg.epochs * minibatches_per_epoch(samples, cfg.batch_size, cfg.max_minibatches)


def _positive_int(cfg: TrainConfig, name: str, allow_none: bool = False, minimum: int = 1) -> None:
    value = getattr(cfg, name)
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        if name in ("checkpoint_every", "max_minibatches"):
            what = "a positive number of minibatches"
        raise TrainError(f"{flag(name)} must be {what}, got {value!r}")


def _positive_seconds(cfg: TrainConfig, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise TrainError(f"{flag(name)} must be a positive number of seconds, got {value!r}")


#: Seeds of magnitude below this: torch's seeds are 64-bit, and an epoch's minibatch order is
#: seeded by ``seed * 1000 + epoch``.
SEED_LIMIT = 2**53


def _check_seed(seed: object) -> None:
    """TrainError for a ``--seed`` that torch cannot take."""
    if isinstance(seed, bool) or not isinstance(seed, int) or abs(seed) >= SEED_LIMIT:
        raise TrainError(f"--seed must be an integer between -2**53 and 2**53 (exclusive), got {seed!r}")


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_workers_fit(workers: int, model_bytes: int = 0, available: int | None = None) -> None:
    """TrainError when ``workers`` processes would not fit in this machine's available memory
    (``WORKER_MEMORY_BYTES`` each, plus four copies of the model's weights)."""
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    need = workers * (WORKER_MEMORY_BYTES + 4 * model_bytes)
    if need > available:
        fit = max(1, available // (WORKER_MEMORY_BYTES + 4 * model_bytes))
        raise TrainError(
            f"--workers {workers} would need about {need / 2**30:.1f} GiB ({(WORKER_MEMORY_BYTES + 4 * model_bytes) / 2**20:.0f} "
            f"MiB per worker process: Python, torch and the model) but this machine has {available / 2**30:.1f} GiB "
            f"available: use at most {fit} workers")


def _finite_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_recipe(cfg: TrainConfig, updates: int | None = None) -> None:
    """TrainError for a weight decay, learning-rate schedule or clipping norm that cannot work
    (``updates``: the run's, when known; else counted from the data and the options)."""
    if not (_finite_number(cfg.weight_decay) and cfg.weight_decay >= 0):
        raise TrainError(f"--weight-decay must be a finite number >= 0, got {cfg.weight_decay!r}")
    if cfg.clip_grad_norm is not None and not (_finite_number(cfg.clip_grad_norm) and cfg.clip_grad_norm > 0):
        raise TrainError(f"--clip-grad-norm must be a positive finite number (the largest global gradient norm), "
                         f"got {cfg.clip_grad_norm!r}")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise TrainError(f"unknown --lr-schedule {cfg.lr_schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")
    _positive_int(cfg, "warmup", minimum=0)
    if cfg.lr_schedule != "constant" and cfg.warmup >= cfg.epochs:  # else fewer than the updates: >= 1 per epoch
        total = run_updates(cfg) if updates is None else updates
        if total <= cfg.warmup:
            raise TrainError(f"--warmup {cfg.warmup} must be fewer than the run's {total} updates ({cfg.epochs} "
                             f"epoch(s) of {total // cfg.epochs} minibatches) to leave updates for --lr-schedule "
                             f"{cfg.lr_schedule} to decay over")


def _check_shard(cfg: TrainConfig) -> None:
    """``--shard`` names a sharding, for a kind that shards, on stages that may have replicas."""
    if cfg.shard not in SHARDINGS:
        raise TrainError(f"--shard {cfg.shard!r}: choose one of {', '.join(s for s in SHARDINGS if s != 'replicate')}")
    if cfg.shard == "replicate":
        return
    if cfg.schedule != AUTO and not schedule_kind(cfg.schedule).can_shard:
        raise TrainError(f"--shard {cfg.shard} splits replicated stages with FSDP2, which runs under "
                         f"{SHARDING_KINDS_TEXT} (one weight version), not --schedule {cfg.schedule}")
    if cfg.straight:
        raise TrainError(f"--shard {cfg.shard} with --straight: a straight plan has no replicas to shard over")


def tensor_degree(cfg: TrainConfig) -> int:
    """Processes per worker: ``--tensor-parallel``, else the ``--plan`` file's (1 without one)."""
    if cfg.tensor_parallel > 1 or not cfg.plan_file:
        return cfg.tensor_parallel
    try:
        return Plan.load(cfg.plan_file).tensor_parallel
    except PlanError:
        return 1  # check_options names the file's problem


def _check_tensor_parallel(cfg: TrainConfig) -> None:
    """``--tensor-parallel`` (or a plan file's degree): whole workers of that many processes and
    a kind that splits layers (a model torch.export traces is refused by the Pipeline unless it
    lists its units, as GPT-2 does: ``inputs.pipeline_units``)."""
    _positive_int(cfg, "tensor_parallel")
    t = tensor_degree(cfg)
    if t == 1:
        return
    if cfg.schedule != AUTO and schedule_kind(cfg.schedule).asynchronous:
        raise TrainError(f"--tensor-parallel {t} splits layers with torch's DTensor, which runs under the synchronous "
                         f"kinds (one weight version: flush, gpipe, zb-h1, zb-h2), not --schedule {cfg.schedule}")
    if cfg.schedule == AUTO and cfg.allow_stale:
        raise TrainError(f"--tensor-parallel {t} runs under the synchronous kinds only, and --allow-stale lets "
                         "--schedule auto choose an asynchronous one: drop --allow-stale")
    processes = cfg.resolved_workers()
    if processes % t:
        raise TrainError(f"--tensor-parallel {t}: --workers {processes} processes do not make whole workers of {t} "
                         f"processes each; give a multiple of {t}")


def check_options(cfg: TrainConfig) -> None:
    """TrainError for the first option that cannot work, before anything is started."""
    if cfg.schedule not in KIND_NAMES and cfg.schedule != AUTO:
        raise TrainError(f"unknown schedule {cfg.schedule!r}; choose one of {', '.join(KIND_NAMES)} or auto")
    if cfg.vertical_sync and cfg.schedule == AUTO:
        raise TrainError("--vertical-sync applies to pipedream only, and --schedule auto has not chosen a kind yet: "
                         "use --schedule pipedream --vertical-sync, or drop --vertical-sync")
    if cfg.allow_stale and cfg.schedule != AUTO:
        raise TrainError(f"--allow-stale lets --schedule auto choose an asynchronous kind; with --schedule "
                         f"{cfg.schedule} it does nothing (drop it, or use --schedule auto)")
    if cfg.precision == "fp16" and (cfg.allow_stale or (cfg.schedule != AUTO and schedule_kind(cfg.schedule).asynchronous)):
        chosen = "--schedule auto --allow-stale" if cfg.schedule == AUTO else f"--schedule {cfg.schedule}"
        raise TrainError(f"--precision fp16 needs a synchronous schedule (flush, gpipe, or auto without --allow-stale), "
                         f"not {chosen}: an update whose float16 gradients overflowed is skipped by every stage at "
                         "once; --precision bf16 needs no loss scaling and works with every schedule")
    if cfg.optimizer not in OPTIMIZERS:
        raise TrainError(f"unknown optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    _check_shard(cfg)
    for name in ("epochs", "batch_size", "microbatches"):
        _positive_int(cfg, name)
    _positive_int(cfg, "checkpoint_every", allow_none=True)
    _positive_int(cfg, "max_minibatches", allow_none=True)
    _positive_int(cfg, "stages", allow_none=True)
    _positive_int(cfg, "keep_checkpoints", minimum=0)
    _positive_int(cfg, "workers", minimum=0)
    _check_tensor_parallel(cfg)
    _positive_seconds(cfg, "timeout_s")
    _positive_seconds(cfg, "failure_timeout_s")
    _positive_seconds(cfg, "startup_timeout_s")
    _check_seed(cfg.seed)
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise TrainError(f"--lr must be a positive number, got {cfg.lr}")
    if cfg.memory is not None:
        try:
            parse_bytes(cfg.memory)  # refuses sizes <= 0 too
        except (TopologyError, ValueError) as exc:
            raise TrainError(f"--memory {cfg.memory!r}: {exc}") from None
    if cfg.resume and cfg.overwrite:
        raise TrainError("--resume continues the run in --out and --overwrite replaces it: give one of them")
    from ..models import MODELS  # lazy: models imports torch, and train.config stays torch-free (the CLI's start)

    if cfg.model not in MODELS and ":" not in cfg.model:
        raise TrainError(
            f"unknown model {cfg.model!r}: use one of {', '.join(MODELS)} or 'module:function' for your own "
            "(it must take (N, 1, 8, 8) digit images and return 10 logits)"
        )
    check_recipe(cfg)  # after --epochs, --batch-size, --max-minibatches and --model: it may count the updates
    if cfg.schedule != AUTO and schedule_kind(cfg.schedule).microbatched and cfg.batch_size < cfg.microbatches:
        raise TrainError(
            f"--batch-size {cfg.batch_size} cannot be split into --microbatches {cfg.microbatches}"
        )
    if cfg.topology:
        try:
            Topology.from_any(cfg.topology)
        except (TopologyError, ValueError, OSError) as exc:
            raise TrainError(f"--topology {cfg.topology}: {exc}") from None
    if cfg.plan_file:
        try:
            Plan.load(cfg.plan_file)
        except PlanError as exc:
            raise TrainError(f"--plan: {exc}") from None
