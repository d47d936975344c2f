"""``verify``: train a user's model a few minibatches with the pipeline and in one process, and
compare every parameter and buffer.

Run it once on a new model (and after changing how it is split): the pipeline must give the
weights that the schedule's written update rule gives (docs/architecture.md), whatever the
model does inside: shared parameters, BatchNorm, keyword arguments, a loss the model computes
itself. The reference runs here, in the calling process, with plain PyTorch and nothing of the
runtime:

* flush and gpipe: one optimizer step per minibatch over the gradient of its mean loss,
  accumulated microbatch by microbatch (the microbatches cut from dimension 0 of every tensor
  of the batch as the pipeline cuts them, run in order, so BatchNorm's running statistics
  follow the same sequence);
* 2bw: the same with every weight at version t−1 in minibatch t (PipeDream-2BW's
  ``W(t+1) = W(t) − η·∇f(W(t−1))``);
* pipedream (plans without replicated stages): stage s of n uses its weights of version
  t − (n − 1 − s) in minibatch t (weight stashing), and a parameter shared by stages s0 < ... its
  version t − n + s0 at every use (docs/architecture.md, "Shared parameters").

The pipeline runs on ``plan.num_workers`` local processes (:func:`~torchpipedream.launch`). When
the final weights differ, shorter runs find the first minibatch after which they do, and the
report names it with the stage and the parameter. Copies of a shared parameter and the replicas
of a stage must also be bit-identical to each other.

What it needs: ``model`` a picklable factory that builds the same model every time (seed it
inside), ``optimizer`` a picklable factory (``functools.partial(torch.optim.SGD, lr=0.1)``),
and a model that draws no random numbers in training (dropout 0 for the check): one process
cannot reproduce the stages' dropout masks.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ..plans.kinds import ScheduleKind, VersionRule, schedule_kind
from ..plans.plan import Plan
from ..schedule.build import build_schedule
from ..schedule.orders import ScheduleBuildError
from ..model.capture import as_call, model_loss, parameter_aliases
from .launcher import launch
from .lr_schedule import as_scheduler_factory
from .pipeline import Pipeline

__all__ = ["verify", "verify_plans", "VerifyReport", "Mismatch", "VerifyError"]

log = logging.getLogger(__name__)


class VerifyError(ValueError):
    """verify cannot run with these arguments; the message says what to change."""


@dataclass
class Mismatch:
    """The first difference found: after ``minibatch`` minibatches (1 = after the first)."""

    minibatch: int
    stage: int
    name: str
    max_abs_diff: float
    what: str = "differs from the reference"

    def __str__(self) -> str:
        return (f"after minibatch {self.minibatch}, stage {self.stage}: {self.name} {self.what} "
                f"(max |diff| {self.max_abs_diff:.3g})")


@dataclass
class VerifyReport:
    """The outcome of one plan's check.

    Attributes:
        schedule / microbatches / plan: what ran.
        minibatches: how many minibatches both trained.
        max_abs_diff: over every parameter and buffer, after the last minibatch.
        per_stage: stage -> (values compared, max |diff|).
        mismatch: the first difference, or None.
        seconds: wall time of the pipeline's run (spawning included).
        not_compared: buffers of replicated stages (their replicas average BatchNorm statistics,
            which one process does not: ``runtime/buffers.py``).
    """

    schedule: str
    microbatches: int
    plan: str
    minibatches: int
    max_abs_diff: float
    per_stage: dict[int, tuple[int, float]] = field(default_factory=dict)
    mismatch: Mismatch | None = None
    seconds: float = 0.0
    not_compared: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatch is None

    def __str__(self) -> str:
        head = (f"{self.schedule} (microbatches {self.microbatches}) on {self.plan}, {self.minibatches} minibatches: "
                f"{'OK' if self.ok else 'MISMATCH'}, max |diff| {self.max_abs_diff:.3g}")
        rows = [f"  stage {s}: {n} values, max |diff| {d:.3g}" for s, (n, d) in sorted(self.per_stage.items())]
        if self.not_compared:
            rows.append(f"  not compared: {len(self.not_compared)} buffers of replicated stages (their replicas average "
                        "BatchNorm statistics)")
        if self.mismatch is not None:
            rows.append(f"  first difference: {self.mismatch}")
        return "\n".join([head] + rows)


@dataclass
class _Job:
    model: Callable[[], nn.Module]
    batches: list[Any]
    plans: list[Plan]
    optimizer: Callable[..., torch.optim.Optimizer]
    loss_fn: Callable[..., torch.Tensor] | None
    loss_reduction: str
    timeout_s: float
    prefixes: list[int]  # run each plan on batches[:k] for each k
    lr_scheduler: Any = None  # as Pipeline(lr_scheduler=): a picklable factory or an LRSchedule
    clip_grad_norm: float | None = None
    device: str = "cpu"  # where both sides compute (the workers' Pipeline(device=) and the reference)
    precision: str = "fp32"  # "fp32" or "bf16": both sides' forwards under the same autocast


def _worker(rank: int, job: _Job) -> list[dict[int, dict[str, Any]]]:
    """Each plan's and prefix's stage state on this rank (with its stage and replica)."""
    out = []
    for plan in job.plans:
        runs = {}
        for k in job.prefixes:
            inputs = job.batches[0] if job.loss_fn is None else job.batches[0][0]
            pipe = Pipeline(job.model(), plan, job.optimizer, loss_fn=job.loss_fn, loss_reduction=job.loss_reduction,
                            timeout_s=job.timeout_s, sample=inputs, lr_scheduler=job.lr_scheduler,
                            clip_grad_norm=job.clip_grad_norm, device=job.device, precision=job.precision)
            pipe.train_minibatches(job.batches[:k])
            state = {name: value.cpu() for name, value in pipe.stage_state_dict().items()}  # pickled to the parent
            runs[k] = {"stage": pipe.stage, "replica": pipe.replica, "state": state,
                       "tied": {pipe.plan.tied[i].name: state[pipe.tied[i].weights.names[0]] for i in pipe.tied}}
        out.append(runs)
    return out


# ----------------------------------------------------------------------------- the reference
def _microbatches(inputs: Any, targets: tuple, m: int) -> list[tuple[Any, tuple, int]]:
    """Cut a minibatch as the pipeline does: every tensor whose dimension 0 is the first input
    tensor's is split into ``m`` nearly equal parts (empty ones dropped)."""
    leaves = [v for v in pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor) and v.dim() > 0]
    size = leaves[0].shape[0]

    def part(v: Any, j: int) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size:
            return torch.tensor_split(v, m, dim=0)[j]
        return v

    out = []
    for j in range(m):
        n = len(torch.tensor_split(torch.arange(size), m)[j])
        if n:
            out.append((pytree.tree_map(lambda v: part(v, j), inputs),
                        tuple(pytree.tree_map(lambda v: part(v, j), t) for t in targets), n))
    return out


def _call(module: nn.Module, params: dict[str, torch.Tensor] | None, inputs: Any) -> Any:
    args, kwargs = as_call(inputs)
    if params is None:
        return module(*args, **kwargs)
    return functional_call(module, params, args, kwargs)


def _reference(job: _Job, plan: Plan, version_of: Callable[[str, int], int]) -> list[dict[str, torch.Tensor]]:
    """The state after each minibatch under ``version_of(parameter, t)`` (the weight version
    minibatch t uses), one optimizer step per minibatch; on one thread, as the workers run
    (the caller's setting is restored): some models' training amplifies the last bit of a sum
    a thousandfold per step, so the same arithmetic matters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_states(job, plan, version_of)
    finally:
        torch.set_num_threads(threads)


def _on(device: torch.device, value: Any) -> Any:
    """``value`` with every tensor in it moved to ``device``."""
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def _reference_states(job: _Job, plan: Plan, version_of: Callable[[str, int], int]) -> list[dict[str, torch.Tensor]]:
    device = torch.device(job.device)
    module = job.model().to(device)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    live = dict(module.named_parameters())
    optimizer = job.optimizer([(n, live[n]) for n in names])  # named, as the pipeline gives them
    factory = as_scheduler_factory(job.lr_scheduler)
    scheduler = factory(optimizer) if factory is not None else None
    history = [{n: live[n].detach().clone() for n in names}]
    states = []
    m = plan.microbatches if schedule_kind(plan.schedule).microbatched else 1
    for t, batch in enumerate(_on(device, job.batches)):
        inputs, targets = (batch, ()) if job.loss_fn is None else (batch[0], tuple(batch[1]) if isinstance(
            batch[1], (tuple, list)) else (batch[1],))
        params = {n: history[max(0, version_of(n, t))][n].clone().requires_grad_(True) for n in names}
        parts = _microbatches(inputs, targets, m)
        total = sum(n for _, _, n in parts)
        loss = 0.0
        for x, y, n in parts:
            # the pipeline runs each microbatch's forward and loss under the same autocast
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=job.precision == "bf16"):
                out = _call(module, params, x)
                value = model_loss(out) if job.loss_fn is None else job.loss_fn(out, *y)
            loss = loss + (value * n / total if job.loss_reduction == "mean" else value)
        grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
        for n, g in zip(names, grads):
            live[n].grad = g
        if job.clip_grad_norm is not None:  # the norm over every parameter's gradient of this update
            torch.nn.utils.clip_grad_norm_([live[n] for n in names if live[n].grad is not None], job.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        history.append({n: live[n].detach().clone() for n in names})
        states.append({k: v.detach().cpu().clone() for k, v in module.state_dict().items()})
    return states


def _version_rule(plan: Plan, kind: ScheduleKind, stage_of: dict[str, int], first_holder: dict[str, int]
                  ) -> Callable[[str, int], int]:
    """The version each parameter has in minibatch t under the kind's written semantics
    (``stage_of``: each parameter's stage; ``first_holder``: the first stage holding a copy of
    each parameter that several stages share)."""
    if kind.version_rule is VersionRule.BATCH:
        return lambda name, t: t
    if kind.version_rule is VersionRule.PREVIOUS_BATCH:
        return lambda name, t: t - 1
    if kind.version_rule is VersionRule.STASHED:
        if any(st.replicas > 1 for st in plan.stages):
            raise VerifyError(f"verify's pipedream reference covers plans without replicated stages; {plan.summary} "
                              "has some: check it with flush, or a straight plan")
        n = plan.num_stages
        return lambda name, t: (t - n + first_holder[name] if name in first_holder
                                else t - (n - 1 - stage_of[name]))
    raise VerifyError(f"{kind.name} keeps no version rule to compare against (its backward recomputes with "
                      "whatever weights are current); verify pipedream, 2bw, flush or gpipe")


# ----------------------------------------------------------------------------- comparison
def _assemble(runs: list[dict[str, Any]], aliases: dict[str, list[str]]
              ) -> tuple[dict[str, tuple[int, torch.Tensor]], Mismatch | None]:
    """Replica 0's values by name (with their stage; every name of a parameter with several),
    and a difference between copies that must be identical: replicas of a stage, copies of a
    shared parameter."""
    full: dict[str, tuple[int, torch.Tensor]] = {}
    for run in sorted(runs, key=lambda r: (r["stage"], r["replica"])):
        for name, value in run["state"].items():
            if run["replica"] == 0:
                full.setdefault(name, (run["stage"], value))
    for name in list(full):
        for other in aliases.get(name, []):
            full.setdefault(other, full[name])
    for run in runs:
        base = next(r for r in runs if r["stage"] == run["stage"] and r["replica"] == 0)
        for name, value in run["state"].items():
            if not torch.equal(value, base["state"][name]):
                return full, Mismatch(0, run["stage"], name, _diff(value, base["state"][name]),
                                      f"of replica {run['replica']} differs from replica 0's")
    copies: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for run in runs:
        for name, value in run["tied"].items():
            copies.setdefault(name, []).append((run["stage"], value))
    for name, held in copies.items():
        for stage, value in held[1:]:
            if not torch.equal(value, held[0][1]):
                return full, Mismatch(0, stage, name, _diff(value, held[0][1]),
                                      f"(shared) differs from stage {held[0][0]}'s copy")
    return full, None


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if not a.is_floating_point():
        return float((a.long() - b.long()).abs().max().item()) if a.numel() else 0.0
    return float((a.double() - b.double()).abs().max().item()) if a.numel() else 0.0


def _compare(full: dict[str, tuple[int, torch.Tensor]], want: dict[str, torch.Tensor], atol: float, rtol: float,
             skip: set[str] = frozenset()) -> tuple[dict[int, tuple[int, float]], Mismatch | None]:
    per_stage: dict[int, tuple[int, float]] = {}
    first: Mismatch | None = None
    for name, expected in want.items():
        if name not in full:
            return per_stage, Mismatch(0, -1, name, math.inf, "is missing from the pipeline's state")
        stage, got = full[name]
        if name in skip:
            continue
        d = _diff(got, expected)
        count, worst = per_stage.get(stage, (0, 0.0))
        per_stage[stage] = (count + got.numel(), max(worst, d))
        bound = atol + rtol * float(expected.double().abs().max().item()) if expected.numel() else atol
        if first is None and not d <= bound:
            first = Mismatch(0, stage, name, d)
    return per_stage, first


def _check_job(job: _Job) -> None:
    for what, value in (("model", job.model), ("optimizer", job.optimizer), ("loss_fn", job.loss_fn)):
        try:
            pickle.dumps(value)
        except Exception:
            raise VerifyError(
                f"verify runs the pipeline in new processes, so {what} must be picklable: a module-level "
                f"function or class instance, or functools.partial of one (got {value!r})") from None
    a, b = job.model(), job.model()
    sa, sb = a.state_dict(), b.state_dict()
    if sorted(sa) != sorted(sb) or any(not torch.equal(sa[k], sb[k]) for k in sa):
        raise VerifyError("the model factory builds different models on two calls: seed it inside "
                          "(torch.manual_seed) so that every process builds the same one")
    a.train()
    inputs = job.batches[0] if job.loss_fn is None else job.batches[0][0]
    with torch.no_grad():
        first, second = _call(copy.deepcopy(a), None, inputs), _call(copy.deepcopy(a), None, inputs)
    same = all(torch.equal(x, y) for x, y in zip(pytree.tree_leaves(first), pytree.tree_leaves(second))
               if isinstance(x, torch.Tensor))
    if not same:
        raise VerifyError("the model gives different outputs for the same input in training mode (dropout?): "
                          "verify compares against one process, which cannot draw the stages' masks; build it "
                          "with dropout 0 for the check")


def _check_arguments(plans: list[Plan], batches: list[Any], atol: float, rtol: float) -> None:
    """Refuse, before any process starts, what verify cannot check: no plans or minibatches, plans
    for different worker counts, a negative tolerance, a schedule its plan cannot run."""
    if not plans:
        raise VerifyError("no plan to verify")
    if len({p.num_workers for p in plans}) != 1:
        raise VerifyError(f"the plans use different numbers of workers {[p.num_workers for p in plans]}; verify them "
                          "in separate calls")
    if not batches:
        raise VerifyError("verify needs at least one minibatch")
    for name, value in (("atol", atol), ("rtol", rtol)):
        if not value >= 0:  # also NaN
            raise VerifyError(f"{name} must be a number >= 0, got {value}")
    for plan in plans:
        try:
            build_schedule(plan, plan.schedule, minibatches=len(batches))
        except ScheduleBuildError as exc:
            raise VerifyError(f"cannot verify {plan.schedule} on the plan {plan.summary}: {exc}; verify it on a plan "
                              f"made for it (torchpipedream verify --schedule {plan.schedule}, alone)") from None


def _check_device(device: str | torch.device, precision: str) -> None:
    """Refuse a device this process cannot compute on, or a precision the reference has no rule for."""
    if precision not in ("fp32", "bf16"):
        raise VerifyError(f"verify's reference covers precision 'fp32' and 'bf16', not {precision!r} (fp16's "
                          "dynamic loss scaling skips updates the reference would have to replay)")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise VerifyError(f"device {device!r} is not a device: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise VerifyError(f"device {device!r}: CUDA is not available here")
    if dev.type not in ("cpu", "cuda"):
        raise VerifyError(f"device {device!r}: verify runs on cpu or cuda")


def _shared_references(job: _Job, plans: list[Plan], rules: list[ScheduleKind]) -> list[Any]:
    """Each plan's reference states, or None for pipedream's (its versions follow the stages the
    run reports). A reference depends only on the version rule and the microbatch count, so plans
    that share both (flush, gpipe and the zero-bubble kinds at one count) share one computation."""
    computed: dict[tuple[VersionRule, int], list[dict[str, torch.Tensor]]] = {}
    references: list[Any] = []
    for plan, kind in zip(plans, rules):
        if kind.version_rule is VersionRule.STASHED:
            references.append(None)
            continue
        key = (kind.version_rule, plan.microbatches if kind.microbatched else 1)
        if key not in computed:
            computed[key] = _reference(job, plan, _version_rule(plan, kind, {}, {}))
        references.append(computed[key])
    return references


def verify_plans(model: Callable[[], nn.Module], batches: Sequence[Any], plans: Sequence[Plan],
                 optimizer: Callable[..., torch.optim.Optimizer], loss_fn: Callable[..., torch.Tensor] | None = None,
                 loss_reduction: str = "mean", atol: float = 1e-5, rtol: float = 1e-4,
                 timeout_s: float = 120.0, lr_scheduler: Any = None,
                 clip_grad_norm: float | None = None, device: str | torch.device = "cpu",
                 precision: str = "fp32") -> list[VerifyReport]:
    """Check several plans of one model (all for the same number of workers) in one launch of
    worker processes; each plan runs its own ``schedule`` and ``microbatches``. See
    :func:`verify`."""
    plans = list(plans)
    batches = list(batches)
    _check_arguments(plans, batches, atol, rtol)
    _check_device(device, precision)
    job = _Job(model, batches, plans, optimizer, loss_fn, loss_reduction, timeout_s, [len(batches)], lr_scheduler,
               clip_grad_norm, str(device), precision)
    rules = [schedule_kind(plan.schedule) for plan in plans]
    for plan, kind in zip(plans, rules):
        _version_rule(plan, kind, {}, {})  # refuses what has no reference, before anything runs
    _check_job(job)
    references = _shared_references(job, plans, rules)
    t0 = time.perf_counter()
    results = launch(_worker, plans[0].num_workers, job, return_all=True, stall_timeout_s=timeout_s)
    seconds = time.perf_counter() - t0
    reports = []
    aliases = _aliases(model)
    buffers = [name for name, _ in model().named_buffers()]
    for i, plan in enumerate(plans):
        runs = [r[i][len(batches)] for r in results]
        full, copy_problem = _assemble(runs, aliases)
        # A replicated stage averages its replicas' BatchNorm statistics (runtime/buffers.py):
        # not the sequence one process runs, so its buffers are not compared.
        skip = {name for name in buffers if name in full and plan.stages[full[name][0]].replicas > 1}
        if references[i] is None:  # pipedream: versions by stage, which the runs tell
            stage_of = {name: stage for name, (stage, _) in full.items()}
            first_holder = {name: min(r["stage"] for r in runs if name in r["tied"])
                            for r0 in runs for name in r0["tied"]}
            references[i] = _reference(job, plan, _version_rule(plan, rules[i], stage_of, first_holder))
        want = references[i]
        per_stage, mismatch = _compare(full, want[-1], atol, rtol, skip)
        max_diff = max((d for _, d in per_stage.values()), default=0.0)
        if copy_problem is not None:
            copy_problem.minibatch = len(batches)
            mismatch = copy_problem
        elif mismatch is not None:
            mismatch = _first_difference(job, i, want, aliases, atol, rtol, skip) or mismatch
            if mismatch.minibatch == 0:
                mismatch.minibatch = len(batches)
        reports.append(VerifyReport(plan.schedule, plan.microbatches if rules[i].microbatched else 1, plan.summary,
                                    len(batches), max_diff, per_stage, mismatch, seconds, sorted(skip)))
        log.info("%s", reports[-1])
    return reports


def _aliases(model: Callable[[], nn.Module]) -> dict[str, list[str]]:
    """Name -> the other names of the same parameter, for parameters a model knows by several."""
    groups = parameter_aliases(model()).values()
    return {n: [o for o in group if o != n] for group in groups if len(group) > 1 for n in group}


def _first_difference(job: _Job, i: int, want: list[dict[str, torch.Tensor]], aliases: dict[str, list[str]],
                      atol: float, rtol: float, skip: set[str]) -> Mismatch | None:
    """Run plan ``i`` on every shorter prefix of the minibatches; the first that differs."""
    prefixes = list(range(1, len(job.batches)))
    if not prefixes:
        return None
    short = dataclasses.replace(job, plans=[job.plans[i]], prefixes=prefixes)
    results = launch(_worker, job.plans[i].num_workers, short, return_all=True, stall_timeout_s=job.timeout_s)
    for k in prefixes:
        full, problem = _assemble([r[0][k] for r in results], aliases)
        if problem is None:
            _, problem = _compare(full, want[k - 1], atol, rtol, skip)
        if problem is not None:
            problem.minibatch = k
            return problem
    return None


def verify(model: Callable[[], nn.Module], batches: Sequence[Any], plan: Plan,
           optimizer: Callable[..., torch.optim.Optimizer], loss_fn: Callable[..., torch.Tensor] | None = None,
           loss_reduction: str = "mean", atol: float = 1e-5, rtol: float = 1e-4,
           timeout_s: float = 120.0, lr_scheduler: Any = None, clip_grad_norm: float | None = None,
           device: str | torch.device = "cpu", precision: str = "fp32") -> VerifyReport:
    """Train ``batches`` with the pipeline (``plan``: its schedule and microbatches) and with
    the reference of its update rule in this process; compare every parameter and buffer.

    Args:
        model: a picklable factory building the same model every call (seeded).
        batches: minibatches as :class:`~torchpipedream.Pipeline` takes them.
        plan: the stages (its ``schedule`` and ``microbatches`` are used).
        optimizer: a picklable factory, e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``.
        loss_fn: as for Pipeline (None: the model computes its loss).
        atol, rtol: a value matches when ``|pipeline − reference| <= atol + rtol · max|reference|``.
        timeout_s: stop the check when the pipeline makes no progress for this long.
        lr_scheduler, clip_grad_norm: the recipe, as for Pipeline (picklable); the reference
            steps its scheduler after every update and clips each update's gradient with
            ``torch.nn.utils.clip_grad_norm_`` over the whole model.
        device: where the workers and the reference compute ("cpu" or "cuda:i"; workers that
            share a GPU exchange messages through host memory over gloo).
        precision: "fp32" or "bf16" (both sides' forwards and losses under bfloat16 autocast:
            compare with tolerances of bfloat16's 8 bits, e.g. atol 1e-3, rtol 1e-2).

    Returns:
        A :class:`VerifyReport` (``ok``, the largest difference per stage, the first mismatch
        with its minibatch, stage and parameter).
    """
    return verify_plans(model, batches, [plan], optimizer, loss_fn, loss_reduction, atol, rtol, timeout_s,
                        lr_scheduler, clip_grad_norm, device, precision)[0]
