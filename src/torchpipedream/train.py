"""The main job: profile → plan → launch → train → report, on this computer or under torchrun.

`torchpipedream train` with no arguments profiles the default example model (a CNN whose
weights sit mostly in its wide fully-connected head), plans it for one worker per core,
launches the workers, trains on scikit-learn's bundled digits images (a fixed split) with a
progress bar, and writes a report, the measured timeline picture, a Chrome trace and the final
checkpoint into the output directory.

All option checking happens in :func:`prepare` before any worker starts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .graph import LayerGraph
from .plan import SCHEDULE_KINDS, Plan, PlanError

__all__ = ["TrainConfig", "TrainError", "prepare", "run", "explain_plan"]

log = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "momentum", "adam")


class TrainError(ValueError):
    """An option or input of `torchpipedream train` cannot be used; the message says what to do."""


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
    microbatches: int = 4
    stages: int | None = None  # planner: exactly this many stages
    straight: bool = False  # planner: no replication
    plan_file: str | None = None
    topology: str | None = None
    out: str = "runs/train"
    seed: int = 0
    timeout_s: float = 120.0
    vertical_sync: bool = False
    progress: bool = True
    max_minibatches: int | None = None  # per epoch, for quick runs and tests
    resume: bool = False  # continue from the newest verified checkpoint in OUT/checkpoints
    checkpoint_every: int | None = None  # also checkpoint every N minibatches inside an epoch
    failure_timeout_s: float = 10.0  # deadline of each step of the failure path (runtime/failures.py)

    def resolved_workers(self) -> int:
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)


@dataclass
class Prepared:
    """What the parent process computed before launching workers (picklable)."""

    config: TrainConfig
    plan: Plan
    graph: LayerGraph
    predicted: dict[str, float] = field(default_factory=dict)
    why: str = ""
    resume_from: str | None = None  # checkpoint directory to load before training


# ---------------------------------------------------------------------------- data and model
def _is_text_model(name: str) -> bool:
    return name == "transformer"


def load_data(cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits images for the vision models (and a user's model), stdlib text for the LM."""
    from .models import digits_data, text_data

    if _is_text_model(cfg.model):
        return text_data(context=64, max_bytes=120_000)
    return digits_data(seed=0)


def build_model(cfg: TrainConfig) -> nn.Module:
    from .models import get_model

    torch.manual_seed(cfg.seed)
    return get_model(cfg.model)


def loss_for(cfg: TrainConfig) -> Callable[..., torch.Tensor]:
    from .models import cross_entropy

    return cross_entropy


def optimizer_factory(cfg: TrainConfig) -> Callable[[Any], torch.optim.Optimizer]:
    lr, kind = cfg.lr, cfg.optimizer
    if kind == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    if kind == "momentum":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    return lambda params: torch.optim.Adam(params, lr=lr)


def _batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, limit: int | None, shuffle_seed: int | None) -> list:
    """Minibatches as a list (deterministic order; reshuffled per epoch by ``shuffle_seed``).

    With a shuffle seed (training) a last partial minibatch is dropped, as DataLoader's
    ``drop_last=True`` does: it could not be split into microbatches, and every method then
    sees the same minibatches. Evaluation keeps every sample.
    """
    idx = torch.arange(len(x))
    if shuffle_seed is not None:
        idx = idx[torch.randperm(len(x), generator=torch.Generator().manual_seed(shuffle_seed))]
    end = len(x) - len(x) % batch_size if shuffle_seed is not None and len(x) >= batch_size else len(x)
    out = [(x[idx[i:i + batch_size]], y[idx[i:i + batch_size]]) for i in range(0, end, batch_size)]
    return out[:limit] if limit else out


# ---------------------------------------------------------------------------- preparation
def _check_options(cfg: TrainConfig) -> None:
    from .models import MODELS

    if cfg.schedule not in SCHEDULE_KINDS:
        raise TrainError(f"unknown schedule {cfg.schedule!r}; choose one of {', '.join(SCHEDULE_KINDS)}")
    if cfg.optimizer not in OPTIMIZERS:
        raise TrainError(f"unknown optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for name in ("epochs", "batch_size", "microbatches"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if cfg.checkpoint_every is not None and (not isinstance(cfg.checkpoint_every, int) or cfg.checkpoint_every < 1):
        raise TrainError(f"--checkpoint-every must be a positive number of minibatches, got {cfg.checkpoint_every!r}")
    if not (cfg.failure_timeout_s > 0 and math.isfinite(cfg.failure_timeout_s)):
        raise TrainError(f"--failure-timeout must be a positive number of seconds, got {cfg.failure_timeout_s}")
    if cfg.stages is not None and cfg.stages < 1:
        raise TrainError(f"--stages must be a positive integer, got {cfg.stages}")
    if cfg.workers < 0:
        raise TrainError(f"--workers must be >= 1 (or 0 for one per core), got {cfg.workers}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise TrainError(f"--lr must be a positive number, got {cfg.lr}")
    if cfg.model not in MODELS and ":" not in cfg.model:
        raise TrainError(
            f"unknown model {cfg.model!r}: use one of {', '.join(MODELS)} or 'module:function' for your own "
            "(it must take (N, 1, 8, 8) digit images and return 10 logits)"
        )
    if cfg.schedule in ("flush", "gpipe", "2bw") and cfg.batch_size < cfg.microbatches:
        raise TrainError(
            f"--batch-size {cfg.batch_size} cannot be split into --microbatches {cfg.microbatches}"
        )


def explain_plan(plan: Plan, graph: LayerGraph) -> str:
    """One line on why the planner chose this plan (the trade it made)."""
    from .units import human_bytes as format_bytes

    total_w = sum(s.parameter_bytes for s in plan.stages)
    t = plan.predicted.get("time_per_minibatch_s")
    speedup = plan.predicted.get("speedup_over_data_parallel")
    if plan.num_stages == 1:
        if plan.stages[0].replicas == 1:
            return "one worker: nothing to split."
        return (
            f"data parallelism: the {format_bytes(total_w)} of weights are cheap to all-reduce next to "
            f"the compute, and every cut would send more than it saves."
        )
    heavy = max(range(plan.num_stages), key=lambda s: plan.stages[s].parameter_bytes)
    share = plan.stages[heavy].parameter_bytes / max(total_w, 1)
    cut_bytes = sum(s.output_bytes for s in plan.stages[:-1])
    line = (
        f"{plan.summary}: stage {heavy} holds {share:.0%} of the {format_bytes(total_w)} of weights; "
        f"pipelining sends {format_bytes(cut_bytes)} of activations per minibatch across its cuts "
        f"instead of all-reducing weights"
    )
    if speedup:
        line += f", predicted {speedup:.2f}x the throughput of data parallelism"
    if t:
        line += f" ({t * 1e3:.2f} ms per minibatch)"
    return line + "."


def prepare(cfg: TrainConfig, measure_host: bool = False) -> Prepared:
    """Check options, profile the model, plan (or load and check a plan) and predict its time.

    With ``measure_host`` (a local run on this machine's cores, no --topology) the prediction
    charges this host's measured message overhead, all-reduces and copy bandwidth
    (host_costs.measure_local_costs, a few seconds of spawned processes) instead of the link
    model's bytes / bandwidth, which on CPU workers predicts gloo's collectives 3-10× too fast.
    """
    from .profiler import profile
    from .schedules import build_schedule
    from .simulate import Costs, simulate
    from .topology import Topology

    _check_options(cfg)
    resume_from, saved_plan = _resume_point(cfg) if cfg.resume else (None, None)
    workers = cfg.resolved_workers()
    model = build_model(cfg)
    x, y, _, _ = load_data(cfg)
    graph = profile(model, x[: cfg.batch_size], loss_fn=loss_for(cfg), target=y[: cfg.batch_size],
                    name=cfg.model, optimizer=optimizer_factory(cfg), microbatches=_microbatches(cfg))
    if saved_plan is not None:  # resume on the checkpoint's plan (re-planning could pick another)
        try:
            saved_plan.validate(layer_names=graph.names, world_size=workers)
        except PlanError as exc:
            raise TrainError(f"--resume: the checkpoint's plan {exc}") from None
        plan = saved_plan
    elif cfg.plan_file:
        plan = Plan.load(cfg.plan_file)
        try:
            plan.validate(layer_names=graph.names, world_size=workers)
        except PlanError as exc:
            raise TrainError(f"plan file {cfg.plan_file}: {exc}") from None
        plan.schedule = cfg.schedule
    else:
        from .planner import plan as make_plan

        topo = Topology.from_any(cfg.topology) if cfg.topology else Topology.local(workers)
        if topo.num_workers != workers:
            raise TrainError(f"--topology has {topo.num_workers} workers but --workers is {workers}")
        plan = make_plan(graph, topo, schedule=cfg.schedule, microbatches=_microbatches(cfg),
                         num_stages=cfg.stages, straight=cfg.straight)
    n = len(_batches(x, y, cfg.batch_size, cfg.max_minibatches, 0))
    sched = build_schedule(plan, cfg.schedule, minibatches=n, microbatches=_microbatches(cfg),
                           **({"vertical_sync": True} if cfg.vertical_sync else {}))
    host: dict[str, Any] = {}
    if measure_host and not cfg.topology and plan.num_workers > 1:
        from .host_costs import measure_local_costs

        log.info("measuring this host's message, all-reduce and copy costs for the prediction")
        host = measure_local_costs(plan, _microbatches(cfg))
    sim = simulate(sched, Costs.from_plan(plan, microbatches=_microbatches(cfg), **host))
    predicted = {
        "time_per_minibatch_s": sim.makespan_s / n,
        "samples_per_s": cfg.batch_size * n / sim.makespan_s if sim.makespan_s > 0 else float("inf"),
        "steady_samples_per_s": (sim.steady_minibatches_per_s or 0.0) * cfg.batch_size,
        "bubble_fraction": sim.bubble_fraction,
    }
    return Prepared(cfg, plan, graph, predicted, explain_plan(plan, graph), resume_from=resume_from)


# Options that may change between a run and its resumption (everything else must match).
_RESUMABLE_CHANGES = {"epochs", "progress", "timeout_s", "resume", "out", "failure_timeout_s"}


def checkpoint_dir(out: str | Path, epoch: int, minibatch: int = 0) -> Path:
    """Where the workers write the checkpoint taken after ``epoch`` epochs and ``minibatch``
    minibatches of the next one (``--checkpoint-every``)."""
    name = f"epoch_{epoch}" if minibatch == 0 else f"epoch_{epoch}_plus_{minibatch}mb"
    return Path(out) / "checkpoints" / name


def _resume_point(cfg: TrainConfig) -> tuple[str, Plan]:
    """The newest verified checkpoint in OUT/checkpoints and its plan, after checking that it
    was written by a run with the same options and has epochs left to train."""
    from .runtime.checkpoint import CheckpointError, latest_checkpoint, read_manifest

    root = Path(cfg.out) / "checkpoints"
    found = latest_checkpoint(root)
    if found is None:
        raise TrainError(
            f"--resume: no complete checkpoint in {root} (incomplete or corrupted ones are skipped); "
            "run without --resume to start from scratch"
        )
    try:
        manifest = read_manifest(found)
        extra = torch.load(found / "extra.pt", map_location="cpu", weights_only=False)
    except (CheckpointError, OSError) as exc:
        raise TrainError(f"--resume: {exc}") from None
    saved = extra.get("config", {}) if isinstance(extra, dict) else {}
    mine = asdict(cfg)
    differ = sorted(k for k in mine if k not in _RESUMABLE_CHANGES and saved.get(k) != mine[k])
    if differ:
        shown = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)!r} (now {mine[k]!r})" for k in differ)
        raise TrainError(f"--resume: the checkpoint {found} was written with other options: {shown}; "
                         "resume with the same options (only --epochs, --timeout and progress may change)")
    done = int(extra.get("epoch", 0))
    if done >= cfg.epochs and not extra.get("minibatch", 0):
        raise TrainError(f"--resume: the checkpoint {found} is already at epoch {done} of --epochs {cfg.epochs}; "
                         "raise --epochs to train further")
    return str(found), Plan.from_dict(manifest["plan"], source=str(found / "manifest.json"))


def _microbatches(cfg: TrainConfig) -> int:
    return cfg.microbatches if cfg.schedule in ("flush", "gpipe", "2bw") else 1


# ---------------------------------------------------------------------------- the workers
def _worker(rank: int, prep: Prepared) -> dict[str, Any] | None:
    """One rank of the run: build the pipeline, train, evaluate, and gather results on rank 0."""
    from .runtime import Pipeline

    cfg = prep.config
    model = build_model(cfg)
    x, y, xt, yt = load_data(cfg)
    pipe = Pipeline(model, prep.plan, optimizer=optimizer_factory(cfg), loss_fn=loss_for(cfg),
                    schedule=cfg.schedule, microbatches=_microbatches(cfg), vertical_sync=cfg.vertical_sync,
                    timeout_s=cfg.timeout_s, seed=cfg.seed, failure_timeout_s=cfg.failure_timeout_s)
    test = _batches(xt, yt, 256, None, None)
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        n = len(_batches(x, y, cfg.batch_size, cfg.max_minibatches, 0))
        bar = tqdm(total=cfg.epochs * n, unit="mb", desc=f"train {cfg.model} [{prep.plan.summary}, {cfg.schedule}]",
                   dynamic_ncols=True)
    history: list[dict[str, Any]] = []
    start, start_mb, partial = 0, 0, {"losses": [], "seconds": 0.0}
    if prep.resume_from is not None:
        extra = pipe.load_checkpoint(prep.resume_from)  # collective; verified on every rank
        start, history = int(extra["epoch"]), list(extra["history"])
        start_mb = int(extra.get("minibatch", 0))  # inside epoch `start` (--checkpoint-every)
        partial = dict(extra.get("partial") or partial)
        if bar is not None:
            bar.update(start * bar.total // cfg.epochs + start_mb)
    trace = None
    for epoch in range(start, cfg.epochs):
        batches = _batches(x, y, cfg.batch_size, cfg.max_minibatches, cfg.seed * 1000 + epoch)
        every = cfg.checkpoint_every or len(batches)
        first = start_mb if epoch == start else 0
        losses: list[float] = list(partial["losses"]) if epoch == start else []
        seconds = float(partial["seconds"]) if epoch == start else 0.0
        # One schedule per chunk of `every` minibatches (the whole epoch by default): the
        # pipeline drains at each chunk's end, so a checkpoint there is exact.
        for lo in range(first, len(batches), every):
            chunk = batches[lo: lo + every]
            t0 = time.perf_counter()
            losses += pipe.train_step(chunk)
            seconds += time.perf_counter() - t0
            if bar is not None:
                bar.update(len(chunk))
            done_mb = lo + len(chunk)
            if done_mb < len(batches):
                pipe.save_checkpoint(checkpoint_dir(cfg.out, epoch, done_mb), epoch=epoch, minibatch=done_mb,
                                     partial={"losses": losses, "seconds": seconds}, history=history,
                                     config=asdict(cfg))
        pipe.epochs_done += 1
        loss = sum(losses) / len(losses)
        if epoch == cfg.epochs - 1:
            trace = pipe.trace(dst=0)  # collective: the measured trace of the last schedule
        metrics = pipe.evaluate(test)
        samples = sum(len(b[1]) for b in batches)
        row = {"epoch": epoch + 1, "train_loss": loss, "test_loss": metrics["loss"],
               "test_accuracy": metrics["accuracy"], "seconds": seconds, "minibatches": len(batches),
               "samples_per_s": samples / seconds}
        history.append(row)
        # Collective, after the schedule returned: nothing in flight; exact to resume from.
        pipe.save_checkpoint(checkpoint_dir(cfg.out, epoch + 1), epoch=epoch + 1, minibatch=0, history=history,
                             config=asdict(cfg))
        if bar is not None:
            acc = row["test_accuracy"]
            bar.set_postfix(loss=f"{loss:.3f}", acc="-" if acc is None else f"{acc:.3f}",
                            samples_s=f"{row['samples_per_s']:.0f}")
    if bar is not None:
        bar.close()
    state = pipe.state_dict(dst=0)
    if rank != 0:
        return None
    return {"history": history, "trace": trace, "state": state}


# ---------------------------------------------------------------------------- outputs
def _write_outputs(prep: Prepared, result: dict[str, Any], out: Path) -> dict[str, Any]:
    from .viz import draw_timeline

    out.mkdir(parents=True, exist_ok=True)
    cfg, plan = prep.config, prep.plan
    paths = {
        "plan": out / "plan.json",
        "graph": out / "graph.json",
        "trace": out / "trace.json",
        "chrome_trace": out / "trace.chrome.json",
        "timeline": out / "timeline.png",
        "checkpoint": out / "checkpoint.pt",
        "report": out / "report.json",
    }
    plan.save(paths["plan"])
    prep.graph.save(paths["graph"])
    trace = result["trace"]
    trace.save(paths["trace"])
    trace.to_chrome(paths["chrome_trace"])
    draw_timeline(trace, paths["timeline"], title=f"{cfg.model}: {plan.summary}, {cfg.schedule} (last epoch, measured)")
    tmp = paths["checkpoint"].with_suffix(".pt.tmp")
    torch.save({"model": cfg.model, "plan": plan.to_dict(), "state_dict": result["state"],
                "config": asdict(cfg)}, tmp)
    os.replace(tmp, paths["checkpoint"])
    last = result["history"][-1]
    measured_t = last["seconds"] / last["minibatches"]
    report = {
        "config": asdict(cfg),
        "plan": plan.summary,
        "plan_config": plan.config,
        "why": prep.why,
        "measured": {"time_per_minibatch_s": measured_t, "samples_per_s": last["samples_per_s"]},
        "predicted": prep.predicted,
        "final_test_accuracy": last["test_accuracy"],
        "final_test_loss": last["test_loss"],
        "history": result["history"],
        "files": {k: str(v) for k, v in paths.items()},
    }
    paths["report"].write_text(json.dumps(report, indent=1) + "\n")
    return report


def format_report(report: dict[str, Any]) -> str:
    """The human-readable end-of-run report."""
    m, p = report["measured"], report["predicted"]
    acc = report["final_test_accuracy"]
    ratio = p["time_per_minibatch_s"] / m["time_per_minibatch_s"] if m["time_per_minibatch_s"] else float("nan")
    lines = [
        f"plan        {report['plan']} ({report['plan_config']}), schedule {report['config']['schedule']}",
        f"why         {report['why']}",
        f"time/mb     measured {m['time_per_minibatch_s'] * 1e3:.2f} ms, predicted {p['time_per_minibatch_s'] * 1e3:.2f} ms "
        f"(measured reaches {ratio:.0%} of the predicted throughput; last epoch, warm-up and drain included)",
        f"throughput  measured {m['samples_per_s']:.0f} samples/s, predicted {p['samples_per_s']:.0f} samples/s",
        f"test        accuracy {'-' if acc is None else f'{acc:.2%}'}, loss {report['final_test_loss']:.4f}",
    ]
    for key, label in (("timeline", "timeline"), ("chrome_trace", "trace"), ("checkpoint", "checkpoint"),
                       ("report", "report")):
        lines.append(f"{label:<11} {report['files'][key]}")
    return "\n".join(lines)


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Prepare, launch one worker per plan rank on this computer, train, and write the outputs.

    Under torchrun (RANK and WORLD_SIZE set) each process is one worker: rank 0 prepares and
    broadcasts the plan, and writes the outputs.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_under_torchrun(cfg)
    from .runtime import launch

    prep = prepare(cfg, measure_host=True)
    log.info("plan %s for %d workers: %s", prep.plan.summary, prep.plan.num_workers, prep.why)
    result = launch(_worker, prep.plan.num_workers, prep, timeout_s=max(cfg.timeout_s * 4, 600.0))
    return _write_outputs(prep, result, Path(cfg.out))


def _run_under_torchrun(cfg: TrainConfig) -> dict[str, Any]:
    import torch.distributed as dist

    if not dist.is_initialized():
        from .runtime.launch import init_from_env

        init_from_env("nccl" if torch.cuda.is_available() else "gloo", max(cfg.timeout_s, 60.0))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg.workers = world
    box: list[Any] = [None]
    if rank == 0:
        try:
            _resume_after_restart(cfg)
            box[0] = prepare(cfg)
        except Exception as exc:  # tell the other ranks, then fail here
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    prep: Prepared = box[0]
    if prep.resume_from is not None:
        log.warning("rank %d: resuming from %s", rank, prep.resume_from)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    result = _worker(rank, prep)
    # Leave together (as launch() does): a rank whose process exits while a peer's gloo work
    # is still in flight can abort the peer ("terminate called without an active exception",
    # seen after a resumed run).
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return {}
    return _write_outputs(prep, result, Path(cfg.out))


def _resume_after_restart(cfg: TrainConfig) -> None:
    """Under ``torchrun --max-restarts``: a restarted attempt (TORCHELASTIC_RESTART_COUNT > 0)
    continues from the newest verified checkpoint in OUT/checkpoints, as ``--resume`` would,
    when there is one (a job that failed before its first checkpoint starts over)."""
    from .runtime.checkpoint import latest_checkpoint

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart > 0 and not cfg.resume and latest_checkpoint(Path(cfg.out) / "checkpoints") is not None:
        log.warning("restart %d: resuming from the newest checkpoint in %s", restart, Path(cfg.out) / "checkpoints")
        cfg.resume = True
