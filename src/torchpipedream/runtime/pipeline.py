"""``Pipeline``: train a model with pipeline parallelism, one stage per process (or several:
virtual stages, under the interleaved and zb-v schedules).

Every rank runs the same script (SPMD; under ``torchrun`` or :func:`~torchpipedream.launch`).
Each builds the whole model (same seed), keeps only its own stage(s), and calls the same
methods; the data is read only by the first stage's ranks, the targets travel with the
activations to the last stage (so only the input stage needs a data loader that yields
data; the other ranks only need ``len(loader)``).

One call = one schedule. ``train_step(batch)`` runs a schedule of one minibatch (flush,
gpipe, 2bw: split into ``microbatches``); ``train_minibatches([b0, b1, ...])`` streams N
minibatches through one schedule of length N; ``fit(loader, epochs)`` streams a whole epoch
through one schedule of ``len(loader)`` minibatches, so pipedream keeps the pipeline full
for the whole epoch and drains only at its end. Schedules are built with
:func:`~torchpipedream.schedule.build.build_schedule`, validated with
:func:`~torchpipedream.schedule.validate.validate_schedule` and cached per length.

Why ``optimizer`` is a factory (``lambda params: torch.optim.SGD(params, lr=0.1)``): each
rank owns only its stage's parameters, which exist only after the split, so the optimizer
must be built per rank on those.

A batch is ``(inputs, targets)`` with a ``loss_fn``, or the model's inputs alone when the model
computes its own loss; inputs are a tensor, a tuple of positional arguments or a dict of
keyword arguments. Restrictions: dim 0 of every input and target tensor is the batch dimension
(minibatches are split along it into microbatches); tensors, Python numbers, None and tuples,
lists and dicts of them (an LSTM's ``(output, (h, c))``) may cross stage boundaries, nothing
else; ``loss_fn`` is called as
``loss_fn(output, *targets)`` and returns a scalar, the mean over the microbatch's samples
(``loss_reduction="mean"``, e.g. ``nn.CrossEntropyLoss()``) or their sum
(``loss_reduction="sum"``). Reported losses are per minibatch, in the same reduction.
Parameters shared by stages, BatchNorm and dropout: docs/architecture.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import io
import json
import logging
import os
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ..host.freed_memory import keep_freed_memory
from ..host.huge_pages import HUGE_PAGES_ENV
from ..model.capture import as_call, draws_random_numbers, microbatch_sample, model_loss, parameter_aliases, with_aliases
from ..plans.kinds import UnknownKindError, schedule_kind
from ..plans.plan import Plan, PlanError, TiedParameter
from ..schedule.actions import Action, Kind, Schedule, message_key
from ..schedule.build import build_schedule
from ..schedule.placement import sharding_support_problem, tied_support_problem
from ..schedule.validate import ScheduleError, uneven_updates, update_barrier_problem, validate_schedule
from ..sim.trace import Event, Trace
from .agreement import Agreement
from .buffers import ReplicaBuffers
from .checkpoint import CheckpointError, CheckpointState, StageState, load_checkpoint, save_checkpoint
from .clipping import GradientClipper, NormPart, check_max_norm
from .comm import P2P
from .devices import default_backend, default_device, ranks_per_node, wire_device
from .engine import Engine, EngineConfig, MicrobatchResult, TiedCopy, as_tuple, run_actions
from .failures import FailureBoard, PipelineFailure, close_connections, is_comm_failure, new_store_prefix
from .flight_recorder import FlightRecorder, standings_text
from .launcher import init_from_env
from .loss_scaling import LossScaler, LossScaling
from .lr_schedule import LRScheduleError, SchedulerArgument, as_scheduler_factory
from .memory_probe import allocation_peak, held_bytes
from .process_exit import warn_if_default_group_pinned
from .sharding import GatheredEvaluation, ShardedWeights, full_state_dict, shard_stage
from .stage_split import model_state_names, split_stages
from .tensor_parallel import (TensorLayoutError, TensorParallelWeights, check_layout_names, parallelize_stage,
                              split_layers_problem,
                              stage_layout, stage_meshes)
from .weights import OptimizerFactory, WeightVersions, updates_are_minibatch_means, wait_for

__all__ = ["Pipeline", "PipelineError", "PipelineFailure", "forward_only"]

log = logging.getLogger(__name__)


#: ``Pipeline(precision=)``: the dtype forwards compute in under autocast (None: float32, no autocast).
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

#: How many minibatch losses ``Pipeline.history`` keeps (the newest).
HISTORY_LIMIT = 10_000


class PipelineError(ValueError):
    """The pipeline cannot run with these arguments; the message says what to change."""


def forward_only(schedule: Schedule) -> dict[int, list[Action]]:
    """The forward part of a schedule (F, SA, RA in each rank's order, and a "zero1" stage's
    gathers and reshards around them, UN and RS): evaluation.

    Dropping backwards, gradient transfers and updates keeps it deadlock-free: each remaining
    receive waits only for a send that comes after fewer actions upstream, and every replica
    of a zero1 stage keeps its gathers in the same order.
    """
    keep = (Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT, Kind.UNSHARD, Kind.RESHARD)
    return {r: [a for a in acts if a.kind in keep] for r, acts in schedule.actions.items()}


def outstanding_sends(actions: Sequence[Action]) -> int:
    """How many sends a rank keeps outstanding (``P2P.max_sends``): the most microbatches it
    holds between their forward and backward (all of a batch for GPipe); 2 for a forward-only
    schedule (evaluation).

    A send beyond that is waited for only when its receiver already has it: under 1F1B the
    first stage's forward of microbatch k + L follows its backward of k, which needed the next
    stage to have received k's activations; the last stage's gradient send of k + 1 follows
    the whole forward and backward of k + 1, long after the previous stage posted the receive
    for k's gradient. One more outstanding send held one more message of memory at the
    pipeline's ends than the memory model charges (measured on small_cnn: a last stage over
    by one received input, 8 MiB at 64 samples) and bought nothing."""
    live = most = 0
    for a in actions:
        if a.kind == Kind.FORWARD:
            live += 1
        elif a.kind == Kind.BACKWARD:
            live -= 1
        most = max(most, live)
    return max(1, most) if any(a.kind == Kind.BACKWARD for a in actions) else 2


def _check_arguments(optimizer: Any, loss_reduction: str, precision: str) -> None:
    """Refuse a loss reduction, an optimizer or a precision the pipeline cannot use."""
    if loss_reduction not in ("mean", "sum"):
        raise PipelineError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        raise PipelineError(f"optimizer must be a factory such as `lambda params: {optimizer.__name__}(params, lr=...)`"
                            f" (the class {optimizer.__name__} itself has no learning rate)")
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise PipelineError(
            "optimizer must be a factory such as `lambda params: torch.optim.SGD(params, lr=0.1)` "
            "(each rank builds it on its own stage's parameters), not an optimizer instance"
        )
    if precision not in PRECISIONS:
        raise PipelineError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def _check_recipe_arguments(lr_scheduler: Any, clip_grad_norm: Any, loss_normalizer: Any, loss_reduction: str) -> Any:
    """Refuse a learning-rate schedule, a clipping norm or a loss normalizer the pipeline
    cannot use; returns the scheduler factory (None: a constant learning rate)."""
    try:
        check_max_norm(clip_grad_norm)
        factory = as_scheduler_factory(lr_scheduler)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    if loss_normalizer is not None:
        if not callable(loss_normalizer):
            raise PipelineError(f"loss_normalizer must be a function of a microbatch that returns a count, "
                                f"got {type(loss_normalizer).__name__}")
        if loss_reduction != "sum":
            raise PipelineError("loss_normalizer divides summed losses by a count over the whole minibatch: it needs "
                                f"loss_reduction='sum' (a loss_fn that sums over the microbatch), not {loss_reduction!r}")
    return factory


def _with_recompute(plan: Plan, recompute: bool | Sequence[int] | None) -> Plan:
    """``plan`` with ``Pipeline(recompute=)`` applied to its stages (unchanged when None)."""
    if recompute is None:
        return plan
    try:
        return plan.with_recompute(recompute)
    except PlanError as exc:
        raise PipelineError(str(exc)) from None


class Pipeline:
    """Pipeline-parallel training of ``module_or_stages`` as laid out by ``plan``.

    Args:
        module_or_stages: the whole model (split with torch.fx by the plan's layer names) or
            a list of stage modules.
        plan: stages, replicas and ranks (``Plan.straight([[...], ...])`` for a quick one).
        optimizer: factory ``params -> torch.optim.Optimizer`` (see the module docstring).
        loss_fn: ``loss_fn(output, *targets) -> scalar``; None when the model computes its own
            loss (``output.loss`` / ``output["loss"]``, e.g. a Hugging Face model given
            ``labels``): a batch is then the model's inputs alone.
        schedule: pipedream, 2bw, flush, gpipe, zb-h1, zb-h2, interleaved, zb-v, zb-2bw or naive (default
            ``plan.schedule``; interleaved and zb-v run plans whose ranks hold several stages).
        microbatches: per minibatch for the microbatched kinds (all but pipedream and naive; default
            ``plan.microbatches``).
        loss_reduction: "mean" or "sum" (what loss_fn returns; the update applies the same).
        vertical_sync: pipedream only: every stage uses the input stage's weight version.
        timeout_s: deadline of every wait for a peer (a hung-but-alive peer fails after it).
        failure_timeout_s: deadline of each step of the failure path (posting to and reading
            the failure board in the process group's store, closing connections): when a
            peer dies, every rank raises within a few of these per pipeline hop, typically
            milliseconds (see ``runtime/failures.py``).
        device: this rank's compute device (default: ``cuda:(LOCAL_RANK % device_count)`` wherever
            CUDA is available, whatever the backend, else cpu; see ``runtime/devices.py``). With
            gloo a CUDA rank's messages travel through host memory (gloo moves CPU tensors only).
        seed: the seed of the random numbers the stages draw in training (dropout): each
            microbatch's forward draws from a generator seeded by (seed, stage, microbatch), so
            replicas draw different masks, a run is reproducible, and the caller's global random
            state is left alone. Default: ``torch.initial_seed()`` (what ``torch.manual_seed`` set).
        sample: one batch of the model's inputs (a tensor, a tuple of positional arguments or a
            dict of keyword arguments), needed when torch.fx cannot trace the model:
            torch.export runs it on the sample (``model/capture.py``).
        tune_allocator: make this process's malloc keep freed memory for reuse
            (``torchpipedream.keep_freed_memory``; process-wide and for the process's
            lifetime, so off by default; the workers of ``launch`` and of the command line
            are tuned anyway). Faster steps on CPU workers (docs/architecture.md, "Freed memory").
        recompute: activation recomputation on every stage (True), none (False) or the stages
            listed; default: the plan's ``Stage.recompute``. A recomputing stage keeps only its
            inputs between a forward and its backward and runs the forward again in the
            backward (same weights version, dropout masks and BatchNorm statistics as without).
        precision: "fp32" (default) or "bf16": every forward and loss runs under
            ``torch.autocast`` with bfloat16 (CPU and CUDA), so activations and their gradients
            cross the cuts in bfloat16 (half the bytes); weights, gradients and optimizer state
            stay float32 (the master copy). "fp16": the same with float16 and dynamic loss
            scaling (``loss_scaling``), for the synchronous schedules (flush, gpipe, zb-h1, zb-h2): an
            update whose gradients overflowed on any stage is skipped by every stage
            (``runtime/loss_scaling.py``; ``loss_scale`` and ``skipped_updates`` say where
            it stands).
        loss_scaling: the loss scale's policy with ``precision="fp16"`` (default
            :class:`~torchpipedream.runtime.loss_scaling.LossScaling`: torch's GradScaler
            defaults).
        lr_scheduler: a factory ``optimizer -> torch.optim.lr_scheduler.LRScheduler`` (each
            stage builds one on its optimizer) or an
            :class:`~torchpipedream.runtime.lr_schedule.LRSchedule`; every stage steps it after
            each update, so update t runs with lr(t) on every stage under every kind
            (``runtime/lr_schedule.py``); checkpoints resume it under any plan.
        clip_grad_norm: clip every update's gradient by the norm over all the model's
            gradients, as ``torch.nn.utils.clip_grad_norm_`` in one process (each replicated
            or shared gradient counted once; ``runtime/clipping.py``). ``grad_norms`` holds every
            update's norm. Kinds whose ranks hold several stages (interleaved, zb-v) are refused.
        loss_normalizer: with ``loss_reduction="sum"``: a function of a microbatch (the same
            ``(inputs, targets)`` form as a minibatch) returning a count, such as its tokens that
            are not padding; each update divides the summed gradient by the count over all of
            its microbatches, so the loss is averaged over the minibatch's tokens, not as a mean
            of microbatch means. Counts must add up over microbatches.
        accumulate: minibatches per update (default 1): the gradients of ``accumulate``
            minibatches are summed into one update (their mean over all their samples), as one
            schedule whose updates each cover ``accumulate`` × ``microbatches`` microbatches.
            For the kinds that split minibatches (all but pipedream and naive, whose rule is
            one update per minibatch). A last group of fewer minibatches makes one update of its own.
        tensor_layout: with ``plan.tensor_parallel`` > 1, which layers each stage splits over its
            worker's tensor ranks: the model's module names -> "colwise", "rowwise" or a torch
            ``ParallelStyle`` (it must leave each stage's outputs whole). Default: every pair of
            Linear layers with only element-wise work between them (runtime/tensor_parallel.py).
        model: with a list of stage modules, the whole model they were cut from (their
            parameters and buffers are its own, as ``models.hf.gpt2_stages`` cuts them): state
            dicts, checkpoints and ``tensor_layout`` then use the model's names, so a checkpoint
            loads onto a pipeline of the model itself. Default: the stages' own names
            ("<stage>.<name>").

    Example, in one process (the same code runs on every rank under ``torchrun`` or
    :func:`~torchpipedream.launch` with a plan of more workers, e.g.
    ``Plan.straight([graph.names[:2], graph.names[2:]])`` for two):

    >>> import torch, torchpipedream as tpd
    >>> from torch import nn
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    >>> graph = tpd.profile(model, x, loss_fn=nn.CrossEntropyLoss(), target=y)
    >>> graph.names
    ['input_1', '_0', '_1', '_2']
    >>> plan = tpd.Plan.straight([graph.names], schedule="flush", microbatches=4)
    >>> pipe = tpd.Pipeline(model, plan, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    ...                     loss_fn=nn.CrossEntropyLoss())
    >>> losses = pipe.train_minibatches([(x, y)] * 5)
    >>> len(losses), losses[-1] < losses[0]
    (5, True)
    """

    def __init__(
        self,
        module_or_stages: nn.Module | Sequence[nn.Module],
        plan: Plan,
        optimizer: OptimizerFactory,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        schedule: str | None = None,
        microbatches: int | None = None,
        loss_reduction: str = "mean",
        vertical_sync: bool = False,
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
        seed: int | None = None,
        failure_timeout_s: float = 10.0,
        tune_allocator: bool = False,
        sample: Any = None,
        recompute: bool | Sequence[int] | None = None,
        precision: str = "fp32",
        measure_memory: bool = False,
        loss_scaling: LossScaling | None = None,
        lr_scheduler: SchedulerArgument = None,
        clip_grad_norm: float | None = None,
        loss_normalizer: Callable[[Any], Any] | None = None,
        accumulate: int = 1,
        tensor_layout: Mapping[str, Any] | None = None,
        model: nn.Module | None = None,
    ) -> None:
        _check_arguments(optimizer, loss_reduction, precision)
        self._scheduler_factory = _check_recipe_arguments(lr_scheduler, clip_grad_norm, loss_normalizer, loss_reduction)
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.loss_normalizer = loss_normalizer
        self.accumulate = self._check_accumulate(accumulate, schedule or plan.schedule)
        self._check_loss_scaling(precision, loss_scaling, schedule or plan.schedule)
        self.precision = precision
        # Peak tensor bytes of this rank's training runs (memory_probe.py), when measured.
        self.measure_memory = bool(measure_memory)
        self.memory_peak_bytes: int | None = None
        self.plan = _with_recompute(plan, recompute)
        self.kind = schedule or self.plan.schedule
        self.microbatches = microbatches
        self.vertical_sync = vertical_sync
        self.loss_reduction = loss_reduction
        self.timeout_s = float(timeout_s)
        if not failure_timeout_s > 0:
            raise PipelineError(f"failure_timeout_s must be a positive number of seconds, got {failure_timeout_s!r}")
        self.failure_timeout_s = float(failure_timeout_s)
        self._join_processes(precision)
        self._choose_device(device, tune_allocator)
        self.loss_fn = loss_fn
        self._whole_model = module_or_stages if isinstance(module_or_stages, nn.Module) else model
        self._tensor_layout = None if tensor_layout is None else check_layout_names(tensor_layout, self._whole_model)
        modules, local_tied = self._split_model(module_or_stages, sample)
        self._ar_group = self._make_replica_groups()
        self._split_tensors(modules, local_tied)  # tensor parallelism first, then FSDP2 over it (torch's order)
        self._shard(modules, local_tied)
        weights = self._make_weights(modules, local_tied, optimizer)
        scaler = self._make_loss_scaler(precision, loss_scaling)
        self.clipper = self._make_clipper(weights)
        self.engines = self._make_engines(modules, weights, scaler, precision, seed)
        # This rank's (first) stage: what a one-stage-per-rank pipeline is made of.
        self.engine = self.engines[self.stage]
        self.module, self.weights = self.engine.module, self.engine.weights
        self.state_names = self._state_names[self.stage]
        self._start_bookkeeping()
        if self.distributed:
            warn_if_default_group_pinned()  # the optimizers just built import what pins it
        if self.clipper is not None or self._scheduler_factory is not None:
            self.schedule_for(2 * self.world_size)  # refuses what the recipe cannot follow, here (_check_recipe)

    # ------------------------------------------------------------------ setup
    def _join_processes(self, precision: str) -> None:
        """Join (or make) the process group; this rank's place in the plan: the stages it runs
        (one, or several of one worker each: virtual stages) and its replica."""
        plan = self.plan
        self.distributed = self._ensure_process_group(plan.num_ranks)
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        plan.validate(world_size=self.world_size)
        # the plan's worker this process is part of, and its rank among the worker's tensor ranks
        self.worker, self.tensor_rank = plan.worker_of_rank(self.rank)
        self.stages_held = plan.stages_of_rank(self.worker)
        self.stage, self.replica = (self.stages_held[0], 0) if plan.virtual else plan.stage_of_rank(self.worker)

    def _choose_device(self, device: torch.device | str | None, tune_allocator: bool) -> None:
        """This rank's device (unless given: ``devices.default_device``, a GPU wherever there is
        one) and allocator."""
        self.device = torch.device(device) if device is not None else default_device()
        if tune_allocator:  # every microbatch re-allocates the same buffers: reuse them (host/freed_memory.py)
            keep_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL point-to-point uses the current device
        elif self.rank == 0 and HUGE_PAGES_ENV not in os.environ:
            log.info("%s is not set: CPU workers allocate weight gradients on 4 KiB pages; "
                     "`export %s=1` before torchrun makes weight-heavy models train faster "
                     "(torchpipedream.launch sets it; see torchpipedream/host/huge_pages.py)", HUGE_PAGES_ENV, HUGE_PAGES_ENV)

    def _split_model(self, module_or_stages: nn.Module | Sequence[nn.Module],
                     sample: Any) -> tuple[dict[int, nn.Module], dict[int, dict[int, str]]]:
        """Split the model into this rank's stage modules (on its device); returns them by stage
        and, by stage, each held stage's local name of each shared parameter it holds (by index
        into ``plan.tied``). Keeps what the runs need of the split: the plan with the shared
        parameters it found (checked against the plan's), the model's names of the stages'
        state, the first stage's input mapping, the last stage's output finish and, for a graph
        torch.export traced, the stages traced for evaluation."""
        model = self._whole_model
        # traced at the size the profile was (torch.export specialises a graph to the sizes it sees)
        profiled = self.plan.meta.get("profile_microbatches") if isinstance(self.plan.meta, dict) else None
        m = profiled if isinstance(profiled, int) and profiled > 1 else 1
        call = as_call(microbatch_sample(sample, m)) if sample is not None else None
        split = split_stages(module_or_stages, self.plan, sample=call, train=True, model=model)
        self.plan = plan = self._with_shared_parameters(self.plan, split)
        # parameters the model knows by several names (tied): canonical name -> every name
        self._aliases = {k: v for k, v in parameter_aliases(model).items() if len(v) > 1} if model is not None else {}
        local_tied = {s: {k: split.tied[t.name][s] for k, t in enumerate(plan.tied) if s in t.stages}
                      for s in self.stages_held}
        # The model's name of each entry of each held stage's state (checkpoints are keyed by it).
        self._state_names = {s: model_state_names(split.modules[s], model) for s in self.stages_held}
        modules = {s: split.modules[s].to(self.device) for s in self.stages_held}
        self._stage_inputs, self._finish, self._split_method = split.inputs, split.finish, split.method
        # torch.export fixes dropout's mode in the graph: evaluation runs a graph traced for it.
        self._eval_modules = self._evaluation_stages(module_or_stages, plan, call, split, modules) \
            if split.method == "export" else {}
        return modules, local_tied

    def _make_replica_groups(self) -> Any:
        """One process group per replicated stage, created in the same order on every rank;
        returns this rank's stage's (None when it is not replicated)."""
        mine = None
        for st in self.plan.stages:
            if st.replicas > 1:
                mine = self._workers_group(st.ranks) or mine
        return mine

    def _workers_group(self, workers: list[int]) -> Any:
        """A process group of the plan's ``workers``, made on every rank in the same order; with
        tensor parallelism one per tensor rank (each rank joins its counterparts on the other
        workers). Returns this rank's, or None when it is not among them."""
        mine = None
        for i in range(self.plan.tensor_parallel):
            ranks = [self.plan.ranks_of_worker(w)[i] for w in workers]
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s))
            if self.rank in ranks:
                mine = group
        return mine

    def _split_tensors(self, modules: dict[int, nn.Module], local_tied: dict[int, dict[int, str]]) -> None:
        """With ``plan.tensor_parallel`` t > 1: the process groups of every worker (its t ranks)
        and of every stage (all its ranks), made on every rank in the same order, and this
        rank's stage split over its worker's ranks (runtime/tensor_parallel.py); a shared
        parameter (``local_tied``) stays whole (its copies are kept equal by the TR actions)."""
        t = self.plan.tensor_parallel
        self._stage_groups: dict[int, Any] = {}  # every rank of each stage held (their DCP checkpoint is a collective of it)
        self._data_mesh = None  # FSDP2's mesh where the stage is sharded too: the (data, tensor) mesh's first dimension
        if t == 1:
            return
        if self._split_method == "export":
            raise PipelineError(f"tensor_parallel {t}: torch.export traced this model, so its layers are no longer "
                                "modules torch's parallelize_module can split; give the stages as modules "
                                "(Pipeline([stage0, stage1, ...], plan, ...)) or a model torch.fx traces")
        tensor_group = None
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for w in range(self.plan.num_workers):
            group = dist.new_group(self.plan.ranks_of_worker(w), timeout=timeout)
            tensor_group = group if w == self.worker else tensor_group
        for s, st in enumerate(self.plan.stages):
            group = dist.new_group([r for w in st.ranks for r in self.plan.ranks_of_worker(w)], timeout=timeout)
            if s in self.stages_held:
                self._stage_groups[s] = group
        st = self.plan.stages[self.stage]
        grid = [self.plan.ranks_of_worker(w) for w in st.ranks]  # replicas × tensor ranks
        tensor_mesh, self._data_mesh = stage_meshes(grid, self._ar_group if st.sharded else None, tensor_group,
                                                    self.device)
        for s in self.stages_held:
            try:
                layout = stage_layout(modules[s], t, self._tensor_layout, self._state_names[s])
            except TensorLayoutError as exc:
                raise PipelineError(f"stage {s}: {exc}") from None
            self._check_split_layers(s, layout, local_tied[s])
            parallelize_stage(modules[s], tensor_mesh, layout)

    def _check_split_layers(self, stage: int, layout: dict[str, Any], tied: dict[int, str]) -> None:
        """Refuse, by name, what the stage's layout cannot split (``split_layers_problem``)."""
        problem = split_layers_problem(layout, {local: f"{self.plan.tied[k].name!r}, which stages "
                                                f"{self.plan.tied[k].stages} share" for k, local in tied.items()},
                                       self.plan.stages[stage].sharding if self.plan.stages[stage].sharded else None)
        if problem:
            raise PipelineError(f"stage {stage}: {problem}")

    @property
    def _sharded(self) -> bool:
        """This rank's stage is sharded over its replicas (``Stage.sharding``; runtime/sharding.py)."""
        return self.plan.stages[self.stage].sharded

    def _shard(self, modules: dict[int, nn.Module], local_tied: dict[int, dict[int, str]]) -> None:
        """Shard this rank's stage over its replicas with FSDP2 where the plan says so (its
        evaluation graph, if torch.export traced one, then runs with the gathered weights); a
        parameter stages share stays whole, outside FSDP2 (its copies are the TR actions')."""
        if not self._sharded:
            return
        st = self.plan.stages[self.stage]
        if self.stage in self._eval_modules:  # torch.export's evaluation graph: the gathered weights
            self._eval_modules[self.stage] = GatheredEvaluation(self._eval_modules[self.stage], modules[self.stage])
        module = modules[self.stage]
        shared = {module.get_parameter(name) for name in local_tied[self.stage].values()}
        shard_stage(module, self._ar_group, self.device, st.sharding, mesh=self._data_mesh, ignored=shared)

    def _make_tied_copies(self, modules: dict[int, nn.Module], factory: OptimizerFactory,
                          local_tied: dict[int, dict[int, str]]) -> dict[int, TiedCopy]:
        """This rank's copy of each shared parameter its stages hold (at most one of each:
        ``tied_support_problem``), by index into ``plan.tied``: weights of its own, stepped by
        the TR actions, and a process group of every rank holding a copy (every shared
        parameter's group is created, in the same order, on every rank). ``self._tied_stage``
        says which stage holds each."""
        plan, tied = self.plan, {}
        for k, t in enumerate(plan.tied):
            ranks = sorted({r for ts in t.stages for r in plan.stages[ts].ranks})
            group = self._workers_group(ranks)
            for s, names in local_tied.items():
                if k in names:
                    weights = WeightVersions(modules[s], factory, self.loss_reduction, replicated=True,
                                             only={names[k]}, **self._weights_options(s))
                    tied[k] = TiedCopy(weights, group, holders=len(t.stages))
                    self._tied_stage[k] = s
        return tied

    def _make_loss_scaler(self, precision: str, loss_scaling: LossScaling | None) -> LossScaler | None:
        """float16's loss scale, with every rank's overflow flag MAX-reduced at each update (in a
        group of its own, made on every rank like the groups above); None in other precisions."""
        if precision != "fp16":
            return None
        group = dist.new_group(list(range(self.world_size)), timeout=datetime.timedelta(seconds=self.timeout_s)) \
            if self.distributed else None
        return LossScaler(loss_scaling or LossScaling(), self._overflow_agreement(group))

    def _make_weights(self, modules: dict[int, nn.Module], local_tied: dict[int, dict[int, str]],
                      optimizer: OptimizerFactory) -> dict[int, WeightVersions]:
        """The weight versions (and optimizer) of each stage this rank holds, and its copies of
        shared parameters (``self.tied``)."""
        factory = self._guard_optimizer(optimizer)
        self.tied: dict[int, TiedCopy] = {}
        self._tied_stage: dict[int, int] = {}  # shared parameter k -> the held stage with its copy
        weights: dict[int, WeightVersions] = {}
        try:
            for s in self.stages_held:
                if self.plan.tensor_parallel > 1:
                    st = self.plan.stages[s]
                    weights[s] = TensorParallelWeights(modules[s], factory, self.loss_reduction, self.plan.tensor_parallel,
                                                       st.replicas, st.sharded, exclude=set(local_tied[s].values()),
                                                       **self._weights_options(s))
                    continue
                if self.plan.stages[s].sharded:
                    weights[s] = ShardedWeights(modules[s], factory, self.loss_reduction,
                                                self.plan.stages[s].replicas, exclude=set(local_tied[s].values()),
                                                **self._weights_options(s))
                    continue
                weights[s] = WeightVersions(modules[s], factory, self.loss_reduction,
                                            replicated=self._ar_group is not None,
                                            exclude=set(local_tied[s].values()), **self._weights_options(s))
            self.tied = self._make_tied_copies(modules, factory, local_tied)
        except LRScheduleError as exc:
            raise PipelineError(str(exc)) from None
        return weights

    def _weights_options(self, stage: int) -> dict[str, Any]:
        """What every WeightVersions of ``stage`` shares: the model's parameter names (for the
        optimizer factory), the scheduler factory, the normalizer's division, who it is."""
        return {"normalized": self.loss_normalizer is not None, "model_names": self._state_names[stage],
                "scheduler": self._scheduler_factory, "where": self._describe(self.rank)}

    def _make_clipper(self, weights: dict[int, WeightVersions]) -> GradientClipper | None:
        """This rank's part of clipping by the global norm (clipping.py): its stages' gradients
        and its copies of shared parameters, each with its share of the squared norm, summed
        over every rank in a group of its own (made on every rank, like the groups above)."""
        if self.clip_grad_norm is None:
            return None
        # a replica's part of a replicated stage's norm is 1/replicas of it; a shard's, its own
        stages = self.plan.stages
        parts = [NormPart(w, 1.0 if stages[s].sharded or self.plan.tensor_parallel > 1 else 1.0 / stages[s].replicas)
                 for s, w in weights.items()]
        for k, copy in self.tied.items():  # a copy on every tensor rank of every holder's replicas
            copies = self.plan.tensor_parallel * sum(self.plan.stages[ts].replicas for ts in self.plan.tied[k].stages)
            parts.append(NormPart(copy.weights, 1.0 / copies, posted=True))
        group = dist.new_group(list(range(self.world_size)), timeout=datetime.timedelta(seconds=self.timeout_s)) \
            if self.distributed else None

        def start(local: torch.Tensor) -> Callable[[], torch.Tensor]:
            if group is None:
                return lambda: local
            value = local.reshape(1).to(self.device)
            work = dist.all_reduce(value, group=group, async_op=True)

            def wait() -> torch.Tensor:
                wait_for(work, self.timeout_s, "the global gradient norm")
                return value.cpu()[0]
            return wait

        return GradientClipper(self.clip_grad_norm, parts, start, self.timeout_s)

    @property
    def grad_norms(self) -> list[float]:
        """The global gradient norm of every update so far, before clipping (``clip_grad_norm``;
        NaN for a float16 update skipped); the same on every rank. Empty without clipping."""
        return list(self.clipper.norms) if self.clipper is not None else []

    def _make_engines(self, modules: dict[int, nn.Module], weights: dict[int, WeightVersions],
                      scaler: LossScaler | None, precision: str, seed: int | None) -> dict[int, Engine]:
        """One engine per stage this rank holds, its settings in one :class:`EngineConfig`; each
        with its copies of shared parameters, all with the rank's loss scale."""
        # Dropout masks come from (this seed, stage, microbatch): distinct on every replica and
        # reproducible; without a seed, the process's (what torch.manual_seed set, if anything).
        rng_seed = seed if seed is not None else torch.initial_seed()
        engines: dict[int, Engine] = {}
        for s in self.stages_held:
            module = modules[s]
            config = EngineConfig(timeout_s=self.timeout_s, loss_reduction=self.loss_reduction, device=self.device,
                                  draws_random=draws_random_numbers(module), recompute=self.plan.stages[s].recompute,
                                  compute_dtype=PRECISIONS[precision], rng_seed=rng_seed)
            engines[s] = Engine(
                self.worker, s, self.replica, module,
                is_first=s == 0, is_last=s == self.plan.num_stages - 1, weights=weights[s],
                loss_fn=self._loss_of_output, ar_group=self._ar_group, tied=self._tied_of(s),
                # BatchNorm statistics of replicas: averaged at every update (runtime/buffers.py)
                buffers=ReplicaBuffers(module, self._ar_group, self.plan.stages[s].replicas)
                if self._ar_group is not None else None,
                scaler=scaler, config=config, clipper=self.clipper, finish=self._finish,
            )
        return engines

    def _tied_of(self, stage: int) -> dict[int, TiedCopy]:
        """The copies of shared parameters ``stage`` holds on this rank, by index into ``plan.tied``."""
        return {k: copy for k, copy in self.tied.items() if self._tied_stage[k] == stage}

    def _start_bookkeeping(self) -> None:
        """What the runs keep: built schedules, negotiated message sizes, the last run's events,
        the loss history and data position, and the failure board and agreement of the ranks."""
        self._schedules: dict[int, Schedule] = {}
        self._accumulating: dict[tuple[int, int], Schedule] = {}  # (updates, minibatches each) -> schedule
        self._message_sizes: dict[tuple[str, int], int] = {}  # negotiated once per channel
        self._events: list[Any] = []
        self.last_schedule: Schedule | None = None
        # Losses of the last HISTORY_LIMIT minibatches (bounded: a long run must not grow in
        # memory, nor its checkpoints in size, with every minibatch).
        self.history: collections.deque[float] = collections.deque(maxlen=HISTORY_LIMIT)
        self.epochs_done = 0  # data position, saved in checkpoints: epochs finished by fit
        self.minibatches_done = 0  # minibatches trained in total (train_step and fit)
        self._board: FailureBoard | None = None
        # this tensor rank's counterpart on each worker (whom its point-to-point messages go to)
        self._counterpart = [self.plan.ranks_of_worker(w)[self.tensor_rank] for w in range(self.plan.num_workers)]
        #: The last actions of this rank, with times: where it stood should a run fail.
        self.flight_recorder = FlightRecorder(self.rank, self._describe, peer_rank=self._counterpart.__getitem__)
        self.agreement: Agreement | None = None  # deadline-bounded JSON collectives (runtime/agreement.py)
        if self.distributed:
            store, prefix = new_store_prefix()
            self._board = FailureBoard(store, prefix + "failures/", self.failure_timeout_s)
            self.agreement = Agreement(store, self.rank, self.world_size, self.timeout_s, prefix + "agree/",
                                       self._describe)

    def _with_shared_parameters(self, plan: Plan, split: Any) -> Plan:
        """``plan`` with the parameters its stages share (``plan.tied``), as the split found them,
        checked against what the plan says and against the schedule kind."""
        found = []
        for name, holders in sorted(split.tied.items(), key=lambda kv: min(kv[1])):
            stage, local = min(holders.items())
            p = split.modules[stage].get_parameter(local)
            found.append(TiedParameter(name, sorted(holders), p.numel() * p.element_size()))
        if plan.tied and [(t.name, t.stages) for t in plan.tied] != [(t.name, t.stages) for t in found]:
            raise PipelineError(
                f"the plan lists the shared parameters {[(t.name, t.stages) for t in plan.tied]} but this model, split "
                f"by it, shares {[(t.name, t.stages) for t in found]}: plan this model again")
        for t in found:  # the layers that use it, as the profile named them
            t.layers = next((list(p.layers) for p in plan.tied if p.name == t.name), [])
        plan = dataclasses.replace(plan, tied=found)
        problem = tied_support_problem(plan, self.kind, self.vertical_sync) or sharding_support_problem(plan, self.kind)
        if problem:
            raise PipelineError(problem)
        if found:
            log.info("parameters shared between stages (kept equal by the TR actions): %s",
                     ", ".join(f"{t.name} in stages {t.stages}" for t in found))
        return plan

    def _loss_of_output(self, output: Any, *targets: Any) -> torch.Tensor:
        """The last stage's loss: ``loss_fn(model output, *targets)``, or the model's own."""
        output = self._finish(output)
        if self.loss_fn is None:
            return model_loss(output)
        return self.loss_fn(output, *targets)

    def _evaluation_stages(self, model: nn.Module, plan: Plan, call: Any, split: Any,
                           training: dict[int, nn.Module]) -> dict[int, nn.Module]:
        """This rank's stages of the graph torch.export traces in evaluation mode: each must read
        no parameter or buffer that its training stage does not hold (those are updated elsewhere)."""
        modules = split_stages(model, plan, sample=call, train=False, follow=split).modules
        state = {id(t) for t in list(model.parameters()) + list(model.buffers())}  # not export's own constants
        out = {}
        for s, trained in training.items():
            stage = modules[s].to(self.device)
            held = {id(t) for t in list(trained.parameters()) + list(trained.buffers())}
            foreign = [name for name, t in list(stage.named_parameters()) + list(stage.named_buffers())
                       if id(t) in state and id(t) not in held]
            if foreign:
                raise PipelineError(
                    f"the graph torch.export traces for evaluation puts {foreign[:3]} in stage {s}, whose training "
                    "graph does not hold them; evaluate this model in one process (its state_dict), or re-plan it")
            out[s] = stage
        return out

    def _ensure_process_group(self, workers: int) -> bool:
        if dist.is_available() and dist.is_initialized():
            return True
        if all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
            init_from_env(default_backend(ranks_per_node(int(os.environ["WORLD_SIZE"]))), self.timeout_s)
            return True
        if workers == 1:
            return False
        raise PipelineError(
            f"the plan needs {workers} processes but no process group is set up: run the script with "
            f"`torchrun --nproc-per-node {workers} script.py` or through torchpipedream.launch(fn, {workers})"
        )

    def _guard_optimizer(self, factory: OptimizerFactory) -> OptimizerFactory:
        """The user's factory, with its failure (or a non-optimizer result) named by stage."""
        where = self._describe(self.rank)

        def build(params: Any) -> torch.optim.Optimizer:
            try:
                opt = factory(params)
            except Exception as exc:
                raise PipelineError(
                    f"{where}: the optimizer factory raised {type(exc).__name__}: {exc} "
                    "(it is called with this stage's parameters, e.g. `lambda params: torch.optim.SGD(params, lr=0.1)`)"
                ) from exc
            if not isinstance(opt, torch.optim.Optimizer):
                raise PipelineError(f"{where}: the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
            return opt

        return build

    def _describe(self, rank: int) -> str:
        """A global rank in words, with the stage(s) it runs ("rank 2 (stage 1 replica 0)")."""
        worker, i = self.plan.worker_of_rank(rank)
        tensor = f" tensor rank {i}" if self.plan.tensor_parallel > 1 else ""
        if self.plan.virtual:
            return f"rank {rank} (stages {', '.join(map(str, self.plan.stages_of_rank(worker)))}{tensor})"
        s, q = self.plan.stage_of_rank(worker)
        return f"rank {rank} (stage {s}{f' replica {q}' if self.plan.stages[s].replicas > 1 else ''}{tensor})"

    @contextlib.contextmanager
    def _failure_guard(self, what: str, agreed: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Turn a failure during collective work into a clean stop on every rank.

        This rank's own error is posted on the failure board and re-raised; a failed wait on
        a peer becomes :class:`PipelineFailure` naming the first failure any rank reported.
        Either way this rank closes its connections, so its peers stop waiting on it at once.
        ``agreed`` errors are raised on every rank alike (a refused checkpoint) and pass through.
        """
        try:
            with self.flight_recorder.phase(what):
                yield
        except BaseException as exc:
            if (isinstance(exc, (PipelineFailure, GeneratorExit) + agreed) or not self.distributed
                    or self.world_size == 1):
                raise
            failure = self._on_failure(exc, what)
            if failure is None:
                raise
            raise failure from None

    def _on_failure(self, exc: BaseException, what: str) -> PipelineFailure | None:
        me = self._describe(self.rank)
        text = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        standing = self.flight_recorder.summary()
        if self._board is not None:
            self._board.post_standing(self.rank, standing)
        if not is_comm_failure(exc):
            if self._board is not None:
                self._board.post(f"{me} failed during {what}: {type(exc).__name__}: {text}")
            log.error("%s failed during %s: %s: %s (where it stood: %s)", me, what, type(exc).__name__, text, standing)
            close_connections(self.world_size, self.rank, self.failure_timeout_s)
            return None
        first = self._board.first() if self._board is not None else None
        if first is None:  # nobody reported: the peer died without a word (killed) or hangs
            peer = getattr(exc, "peer", None)
            who = self._describe(peer) if isinstance(peer, int) else "a peer"
            how = ("died or closed its connection" if getattr(exc, "closed", False)
                   else f"did not respond within {self.timeout_s:g} s" if isinstance(peer, int)
                   else "failed or closed its connection")
            first = f"{who} {how} (seen by {me} during {what})"
            if self._board is not None:
                self._board.post(first)
        stood = self._board.standings(self.world_size) if self._board is not None else {self.rank: standing}
        close_connections(self.world_size, self.rank, self.failure_timeout_s)
        return PipelineFailure(f"{me} stopped because the pipeline failed: {first}. This rank saw: {text}. "
                               f"Where the ranks stood: {standings_text(stood, self.world_size, self._describe)}")

    def use_schedule(self, schedule: Schedule) -> None:
        """Run ``schedule`` for every run of its number of minibatches, instead of the one
        ``build_schedule`` would generate: one written by hand, or read from torch's action
        text (schedule/torch_text.py). Every rank passes the same schedule. It must be for this
        pipeline's plan (the same stages, layers and ranks), the same weight-version rule and
        microbatch count; ``validate_schedule`` proves it here.

        Raises:
            PipelineError: naming what differs, or the rule it breaks (with the grid).
        """
        if self.accumulate > 1:
            raise PipelineError(f"use_schedule runs a schedule of one update per minibatch; this pipeline has "
                                f"accumulate={self.accumulate} (write the schedule with {self.accumulate}× the microbatches "
                                "per minibatch instead, and accumulate=1)")
        theirs, ours = schedule.plan, self.plan
        if [(st.layers, st.ranks) for st in theirs.stages] != [(st.layers, st.ranks) for st in ours.stages]:
            raise PipelineError(f"the schedule is for plan {theirs.config} ({theirs.num_stages} stages, layers "
                                f"{[st.layers[:2] for st in theirs.stages]}); this pipeline runs {ours.config} "
                                f"({ours.num_stages} stages, layers {[st.layers[:2] for st in ours.stages]})")
        try:
            mine, kind = schedule_kind(self.kind), schedule_kind(schedule.kind)
        except UnknownKindError as exc:
            raise PipelineError(str(exc)) from None
        if kind.version_rule is not mine.version_rule:
            raise PipelineError(f"the schedule's kind {kind.name} uses weights by another rule than this pipeline's "
                                f"{mine.name} ({kind.version_rule.value} against {mine.version_rule.value})")
        m = self.microbatches or ours.microbatches or 1
        if mine.microbatched and schedule.microbatches != m:
            raise PipelineError(f"the schedule has {schedule.microbatches} microbatches per minibatch; this pipeline "
                                f"splits each minibatch in {m}")
        try:
            validate_schedule(schedule)
        except ScheduleError as exc:
            raise PipelineError(f"the schedule is invalid: {exc}") from None
        self._check_recipe(schedule)
        self._schedules[schedule.minibatches] = schedule

    @staticmethod
    def _check_accumulate(accumulate: Any, kind: str) -> int:
        """``accumulate`` checked: a positive whole number, above 1 only for the kinds that
        split a minibatch into microbatches (an update may then span several minibatches)."""
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise PipelineError(f"accumulate must be a whole number of minibatches per update >= 1, got {accumulate!r}")
        try:
            microbatched = schedule_kind(kind).microbatched
        except UnknownKindError:
            return accumulate  # the schedule's own check names it
        if accumulate > 1 and not microbatched:
            raise PipelineError(f"accumulate={accumulate} needs a kind whose updates span microbatches (flush, gpipe, "
                                f"zb-h1, zb-h2, 2bw, zb-2bw, interleaved, zb-v); {kind} updates once per minibatch by its rule")
        return accumulate

    def _training_schedules(self, minibatches: int) -> list[tuple[Schedule, int]]:
        """The schedules that train ``minibatches`` minibatches, each with its minibatches per
        update: one schedule without accumulation; with it, one whose updates each cover
        ``accumulate`` minibatches (a schedule of as many times the microbatches), then one
        update of the minibatches left over."""
        k = self.accumulate
        if k == 1:
            return [(self.schedule_for(minibatches), 1)]
        runs = [(group, count) for group, count in ((k, minibatches // k), (minibatches % k, 1)) if group and count]
        return [(self._accumulating_schedule(count, group), group) for group, count in runs]

    def _accumulating_schedule(self, updates: int, group: int) -> Schedule:
        """A schedule of ``updates`` updates of ``group`` minibatches each (cached)."""
        key = (updates, group)
        if key not in self._accumulating:
            m = self.microbatches or self.plan.microbatches or 1
            self._accumulating[key] = self._proven_schedule(minibatches=updates, microbatches=group * m)
        return self._accumulating[key]

    def _check_recipe(self, schedule: Schedule) -> None:
        """Refuse a schedule whose updates cannot follow ``lr_scheduler`` or ``clip_grad_norm``:
        one where update t is not the same minibatches' on every stage (a replicated stage under
        pipedream or naive), or, for clipping, whose updates cannot wait for the norm of every
        stage's gradient (schedule.validate.update_barrier_problem), as for float16 on a rank
        holding several stages (one loss-scale decision for all of them)."""
        if self._scheduler_factory is not None:
            uneven = uneven_updates(schedule)
            if uneven:
                raise PipelineError(f"lr_scheduler cannot follow the {schedule.kind} schedule of this plan: {uneven}, so "
                                    "a learning rate by update count would differ between stages; plan without "
                                    "replicated stages, or use a kind that splits minibatches (flush, gpipe, 2bw)")
        problem = update_barrier_problem(schedule) if self.clipper is not None else None
        if problem:
            raise PipelineError(f"clip_grad_norm cannot run with the {schedule.kind} schedule of this plan: {problem}; "
                                "clipping by the global norm needs every stage's gradients of one update before its "
                                "first step (flush, gpipe, zb-h1, zb-h2, interleaved, zb-v, 2bw, zb-2bw, and pipedream "
                                "without a parameter shared by stages; replicated stages with those that split "
                                "minibatches)")
        scaled_together = self.precision == "fp16" and schedule.plan.virtual
        problem = update_barrier_problem(schedule) if scaled_together and self.clipper is None else None
        if problem:  # the rank's one loss-scale decision of an update needs all its stages' gradients
            raise PipelineError(f"precision='fp16' cannot run with the {schedule.kind} schedule of this plan: {problem}")

    def schedule_for(self, minibatches: int) -> Schedule:
        """The validated schedule covering ``minibatches`` minibatches (cached; see
        :meth:`use_schedule`)."""
        sched = self._schedules.get(minibatches)
        if sched is None:
            kwargs: dict[str, Any] = {"minibatches": minibatches}
            if self.microbatches is not None:
                kwargs["microbatches"] = self.microbatches
            sched = self._schedules[minibatches] = self._proven_schedule(**kwargs)
        return sched

    def _proven_schedule(self, **kwargs: Any) -> Schedule:
        """``build_schedule`` for this pipeline's plan and kind, validated and checked against
        the recipe (``_check_recipe``)."""
        if self.vertical_sync:
            kwargs["vertical_sync"] = True
        sched = build_schedule(self.plan, self.kind, **kwargs)
        validate_schedule(sched)
        self._check_recipe(sched)
        return sched

    # ------------------------------------------------------------------ data
    def _microbatch_source(self, batches: Iterable[Any], m: int) -> Callable[[int], tuple[tuple[Any, ...], tuple[Any, ...], int]]:
        batches = iter(batches)  # one iterator, also across the schedules of one call (accumulate)
        state: dict[str, Any] = {"t": -1, "parts": None}

        def get(microbatch: int) -> tuple[tuple[Any, ...], tuple[Any, ...], int]:
            t, j = divmod(microbatch, m)
            if t < state["t"]:
                raise RuntimeError(f"microbatch {microbatch} requested after minibatch {state['t']} (schedule order)")
            while state["t"] < t:
                try:
                    batch = next(batches)
                except StopIteration:
                    raise PipelineError(f"the data ran out before minibatch {t} (len() promised more)") from None
                state["t"] += 1
                state["parts"] = self._split(batch, m, state["t"]) if state["t"] == t else None
            return state["parts"][j]

        return get

    def _split(self, batch: Any, m: int, t: int) -> list[tuple[tuple[Any, ...], tuple[Any, ...], int]]:
        """Minibatch ``t`` cut into ``m`` microbatches: (stage 0's inputs, targets, samples) each.

        A batch is ``(inputs, targets)`` with a ``loss_fn``, else the model's inputs alone (the
        model computes its loss); inputs are a tensor, a tuple of positional arguments or a dict
        of keyword arguments. Every tensor whose dimension 0 is the batch's (the first input
        tensor's) is cut along it; other values go to every microbatch as they are.
        """
        if self.loss_fn is not None:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise PipelineError(
                    f"minibatch {t}: expected (inputs, targets), got {type(batch).__name__}"
                    f"{' of length ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}"
                    " (without a loss_fn the model computes its loss and a batch is its inputs alone)"
                )
            inputs, targets = batch[0], as_tuple(batch[1])
        else:
            inputs, targets = batch, ()
        args, kwargs = as_call(inputs)
        moved = pytree.tree_map(lambda v: v.to(self.device) if isinstance(v, torch.Tensor) else v,
                                (args, kwargs, tuple(targets)))
        first = next((v for v in pytree.tree_leaves(moved[:2]) if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        if first is None:
            raise PipelineError(f"minibatch {t}: the inputs hold no tensor with a batch dimension (dim 0 = samples)")
        size = first.shape[0]
        if size < 1:
            raise PipelineError(f"minibatch {t} is empty (0 samples along dim 0 of its first input)")
        leaves, spec = pytree.tree_flatten(moved)
        # A minibatch smaller than m leaves some microbatches empty: they run (shapes of 0 rows)
        # but add no loss, no gradient and no samples.
        parts = [list(torch.tensor_split(v, m, dim=0)) if isinstance(v, torch.Tensor) and v.dim() > 0
                 and v.shape[0] == size else [v] * m for v in leaves]
        counted = next(p for p, v in zip(parts, leaves) if v is first)  # its rows are the samples
        out = []
        for j in range(m):
            args_j, kwargs_j, targets_j = pytree.tree_unflatten([p[j] for p in parts], spec)
            samples = int(counted[j].shape[0])
            if self.loss_normalizer is not None:
                samples = self._normalizer_count(args_j, kwargs_j, targets_j, t) if samples else 0
            try:
                stage_inputs = self._stage_inputs(args_j, kwargs_j)
            except (TypeError, ValueError) as exc:
                raise PipelineError(f"minibatch {t}: its inputs do not fit the model's arguments: {exc}") from None
            out.append((tuple(stage_inputs), tuple(targets_j), samples))
        return out

    def _normalizer_count(self, args: Any, kwargs: Any, targets: Any, t: int) -> int:
        """``loss_normalizer`` of one microbatch, in the form a minibatch has, checked: a
        whole number >= 0 (it travels with the microbatch as its samples)."""
        inputs = args[0] if len(args) == 1 and not kwargs else (kwargs if not args else args)
        count = self.loss_normalizer((inputs, targets[0] if len(targets) == 1 else targets)  # type: ignore[misc]
                                     if self.loss_fn is not None else inputs)
        value = count.item() if isinstance(count, torch.Tensor) and count.numel() == 1 else count
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
            raise PipelineError(f"minibatch {t}: loss_normalizer returned {count!r}; it must return a whole number "
                                ">= 0 (the microbatch's count, such as its tokens that are not padding)")
        return int(value)

    # ------------------------------------------------------------------ running
    def _run(self, sched: Schedule, batches: Iterator[Any] | None, train: bool,
             group: int = 1) -> list[tuple[float, int, int]]:
        """Run one schedule whose updates each cover ``group`` minibatches; per minibatch
        (reduced loss, samples, correct) on every rank."""
        with self._failure_guard("training" if train else "evaluation"):
            return self._run_schedule(sched, batches, train, group)

    def _train_on(self, minibatches: int, batches: Iterator[Any] | None) -> list[float]:
        """Train ``minibatches`` minibatches from ``batches`` (None off the first stage):
        through the schedules :meth:`_training_schedules` gives; their losses, in order."""
        losses: list[float] = []
        for sched, group in self._training_schedules(minibatches):
            losses += [r[0] for r in self._run(sched, batches, train=True, group=group)]
            self.minibatches_done += sched.minibatches * group
        return losses

    def _run_schedule(self, sched: Schedule, batches: Iterator[Any] | None, train: bool,
                      group: int = 1) -> list[tuple[float, int, int]]:
        n_minibatches, m = sched.minibatches * group, sched.microbatches // group
        actions = sched.actions[self.worker] if train else forward_only(sched)[self.worker]
        base = self.weights.version
        means = train and updates_are_minibatch_means(sched, any(st.replicas > 1 for st in self.plan.stages),
                                                      self.loss_reduction)
        for weights in self._all_weights():
            weights.grads_are_means = means
        if self.clipper is not None:
            self.clipper.begin()
        if train:
            self._expect_uses(actions, base)
            for engine in self.engines.values():
                engine.microbatch_base = self.minibatches_done * m
        comm = None
        if self.world_size > 1:
            act_order: dict[int, list[tuple[int, int]]] = {}
            grad_order: dict[int, list[tuple[int, int]]] = {}
            for a in actions:
                if a.peer == self.worker:  # between two stages of this rank: handed over in memory
                    continue
                if a.kind == Kind.RECV_ACT:
                    act_order.setdefault(a.peer, []).append(message_key(a))
                elif a.kind == Kind.RECV_GRAD:
                    grad_order.setdefault(a.peer, []).append(message_key(a))
            counterpart = self._counterpart
            comm = P2P(self.worker, lambda w: self._describe(counterpart[w]), act_order, grad_order, self.device,
                       self.timeout_s, sizes=self._message_sizes, max_sends=outstanding_sends(actions),
                       drain_at_update=not schedule_kind(sched.kind).asynchronous, global_rank=counterpart.__getitem__,
                       wire_device=wire_device(dist.get_backend(), self.device))
            with self.flight_recorder.phase("the barrier at the start of the schedule"):
                self.agreement.barrier("the start of the schedule")  # type: ignore[union-attr]
        source = self._microbatch_source(batches, m) if (0 in self.engines and batches is not None) else None
        t0 = time.perf_counter()
        with self._mode(train), self._memory_measured(train):
            results, events = run_actions(self.engines, actions, comm, source, train=train, version_base=base, t0=t0,
                                          recorder=self.flight_recorder)
        for weights in self._all_weights():
            weights.apply_deferred()  # updates still waiting for their first use (clipping defers them)
            weights.reset_versions()
        self._events = events
        self.last_schedule = sched
        return self._reduce_results(results, n_minibatches, m)

    @contextlib.contextmanager
    def _memory_measured(self, train: bool) -> Iterator[None]:
        """With ``measure_memory``, the peak of a training run: what the stage held when it
        started (weights, gradients, optimizer state, stashes) plus the most it allocated."""
        if not (train and self.measure_memory):
            yield
            return
        modules = [engine.module for engine in self.engines.values()]
        held = held_bytes([p for mod in modules for p in mod.parameters()], [b for mod in modules for b in mod.buffers()],
                          *(w.tensors_held() for w in self._all_weights()))
        with allocation_peak(self.device) as peak:
            yield
        self.memory_peak_bytes = max(self.memory_peak_bytes or 0, held + peak.peak_bytes)

    def memory_peaks(self) -> list[int | None]:
        """Every worker's ``memory_peak_bytes`` (the largest of its tensor ranks'; None where not
        measured), on every rank, indexed as the plan's ranks; a collective when distributed (a
        deadline-bounded exchange through the store)."""
        if not self.distributed:
            return [self.memory_peak_bytes]
        peaks = self.agreement.exchange("the measured memory peaks", self.memory_peak_bytes)  # type: ignore[union-attr]
        t = self.plan.tensor_parallel
        return [max((p for p in peaks[w * t:(w + 1) * t] if p is not None), default=None)
                for w in range(self.plan.num_workers)]

    @staticmethod
    def _check_loss_scaling(precision: str, loss_scaling: Any, kind: str) -> None:
        """float16 needs a loss scale every stage applies to the same updates: refuse what
        cannot (another precision given a policy, an asynchronous schedule)."""
        if loss_scaling is not None and not isinstance(loss_scaling, LossScaling):
            raise PipelineError(f"loss_scaling must be a LossScaling, got {type(loss_scaling).__name__}")
        if loss_scaling is not None and precision != "fp16":
            raise PipelineError(f"loss_scaling applies to precision='fp16' only (precision is {precision!r})")
        if precision != "fp16":
            return
        try:
            asynchronous = schedule_kind(kind).asynchronous
        except UnknownKindError:
            return  # the schedule's own check names it
        if asynchronous:
            raise PipelineError(
                f"precision='fp16' needs a synchronous schedule (flush, gpipe, zb-h1, zb-h2, interleaved, zb-v), not "
                f"{kind!r}: an update "
                "whose float16 gradients overflowed must be skipped by every stage, and with "
                f"{kind!r} the stages apply different minibatches' updates at a time; use precision='bf16' "
                "(no loss scaling needed)")

    def _overflow_agreement(self, group: Any) -> Callable[[bool], bool]:
        """``agree(found_here) -> found_anywhere`` over every rank (deadline-bounded)."""
        def agree(found: bool) -> bool:
            if group is None:
                return found
            flag = torch.tensor([1.0 if found else 0.0], device=self.device)
            wait_for(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True), self.timeout_s,
                     "the loss scaler's overflow check")
            return bool(flag.item())
        return agree

    @property
    def loss_scale(self) -> float | None:
        """The current float16 loss scale (None unless ``precision="fp16"``); the same on every rank."""
        return self.engine.scaler.scale if self.engine.scaler is not None else None

    @property
    def skipped_updates(self) -> int:
        """Updates skipped because float16 gradients overflowed (every stage skips the same)."""
        return self.engine.scaler.skipped_updates if self.engine.scaler is not None else 0

    def _all_weights(self) -> list[WeightVersions]:
        return [engine.weights for engine in self.engines.values()] + [copy.weights for copy in self.tied.values()]

    def _expect_uses(self, actions: list[Action], base: int) -> None:
        """Tell every weight-version holder how many F/B actions will use each version, so a
        stash lives exactly as long as needed. A shared parameter's version at an F is the
        number of its steps (TR) before it; the F's B uses the same."""
        uses: dict[int, int] = {}
        tied_uses: dict[int, dict[int, int]] = {k: {} for k in self.tied}
        tied_version = {k: copy.weights.version for k, copy in self.tied.items()}
        at_forward: dict[tuple[int, int], int] = {}
        stage_uses: dict[int, dict[int, int]] = {s: {} for s in self.engines}
        for a in actions:
            if a.kind in (Kind.FORWARD, Kind.BACKWARD) and a.version is not None:
                uses = stage_uses[a.stage]
                uses[base + a.version] = uses.get(base + a.version, 0) + 1
            for k in self.tied:
                if a.stage != self._tied_stage[k]:
                    continue
                if a.kind is Kind.FORWARD:
                    at_forward[(k, a.id)] = tied_version[k]
                if a.kind in (Kind.FORWARD, Kind.BACKWARD):
                    v = at_forward[(k, a.id)]
                    tied_uses[k][v] = tied_uses[k].get(v, 0) + 1
                elif a.kind is Kind.TIED_REDUCE and a.tie == k:
                    tied_version[k] += 1
        for s, engine in self.engines.items():
            engine.weights.expect(stage_uses[s])
        for k, copy in self.tied.items():
            copy.weights.expect(tied_uses[k])

    @contextlib.contextmanager
    def _mode(self, train: bool) -> Iterator[None]:
        """Evaluation runs the stage in eval mode (dropout off, BatchNorm's running statistics
        used and left alone): ``module.eval()``, or the graph torch.export traced for it."""
        if train:
            yield
            return
        training = {s: engine.module for s, engine in self.engines.items()}
        for s, engine in self.engines.items():
            if s in self._eval_modules:
                engine.module, engine.eval_graph = self._eval_modules[s], True
            else:
                engine.module.eval()
        try:
            yield
        finally:
            for s, engine in self.engines.items():
                engine.module, engine.eval_graph = training[s], False
                engine.module.train()

    def _reduce_results(self, results: dict[int, MicrobatchResult], n_minibatches: int, m: int) -> list[tuple[float, int, int]]:
        table = torch.zeros(n_minibatches, 4, dtype=torch.float64)
        if self.tensor_rank:  # a worker's losses once: its first tensor rank's
            results = {}
        for microbatch, r in results.items():
            t = microbatch // m
            weight = r.samples if self.loss_reduction == "mean" else 1
            table[t, 0] += r.loss * weight
            table[t, 1] += r.samples
            table[t, 2] += r.correct or 0
            table[t, 3] += 1 if r.correct is not None else 0
        if self.distributed:
            self.agreement.barrier("the end of the schedule")  # type: ignore[union-attr]
            table = table.to(self.device)
            dist.all_reduce(table)
            table = table.cpu()
        out = []
        for t in range(n_minibatches):
            loss_sum, samples, correct, has_acc = table[t].tolist()
            divide = self.loss_reduction == "mean" or self.loss_normalizer is not None
            loss = loss_sum / samples if (divide and samples) else loss_sum
            out.append((loss, int(samples), int(correct) if has_acc else -1))
        return out

    # ------------------------------------------------------------------ public API
    def train_step(self, batch: Any) -> float:
        """Train on one minibatch ``(inputs, targets)`` (a tuple, or the list a DataLoader
        yields); returns its loss on every rank. For several minibatches in one schedule (the
        pipeline full across them) use :meth:`train_minibatches`."""
        return self.train_minibatches([batch])[0]

    def train_minibatches(self, batches: Sequence[Any]) -> list[float]:
        """Stream ``batches`` (a sequence of minibatches) through one schedule; returns each
        minibatch's loss on every rank. Every rank passes a sequence of the same length (only
        the first stage's ranks read the data)."""
        if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence):
            raise PipelineError(f"train_minibatches takes a sequence of minibatches, got {type(batches).__name__}")
        if not batches:
            raise PipelineError("train_minibatches got an empty sequence of minibatches")
        losses = self._train_on(len(batches), iter(batches))
        self.history.extend(losses)
        return losses

    def fit(self, loader: Iterable[Any], epochs: int = 1) -> list[float]:
        """Train for ``epochs`` passes over ``loader``; returns each epoch's mean loss (all ranks).

        Only the first stage's ranks iterate the loader; every rank needs ``len(loader)``.
        """
        try:
            n = len(loader)  # type: ignore[arg-type]
        except TypeError:
            raise PipelineError("fit needs a loader with len() (e.g. a DataLoader) to size the schedule") from None
        if n < 1:
            raise PipelineError("the loader is empty")
        out = []
        for _ in range(epochs):
            losses = self._train_on(n, iter(loader) if 0 in self.engines else None)
            self.history.extend(losses)
            self.epochs_done += 1
            out.append(sum(losses) / len(losses))
        return out

    @torch.no_grad()
    def evaluate(self, loader: Iterable[Any]) -> dict[str, float | None]:
        """Forward only (no stashing, current weights): mean loss and, for class labels, accuracy."""
        batches = loader if isinstance(loader, list) else loader
        try:
            n = len(batches)  # type: ignore[arg-type]
        except TypeError:
            raise PipelineError("evaluate needs a loader with len()") from None
        rows = self._run(self.schedule_for(n), iter(batches) if self.stage == 0 else None, train=False)
        samples = sum(r[1] for r in rows)
        if self.loss_reduction == "mean":
            loss = sum(r[0] * r[1] for r in rows) / max(samples, 1)
        else:
            loss = sum(r[0] for r in rows)
        acc = sum(r[2] for r in rows) / samples if rows and all(r[2] >= 0 for r in rows) and samples else None
        return {"loss": loss, "accuracy": acc, "samples": samples}

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stage parameters and buffers (of every stage it holds), under the original
        model's key names."""
        # stage modules cut from a model given with them (model=) are named by the model; a
        # traced stage's keys are the model's already
        names = {s: self._state_names[s] if self._split_method == "stages" else {} for s in self.engines}
        if self._sharded or self.plan.tensor_parallel > 1:  # gathered whole: every rank of the stage calls this
            return {names[s].get(k, k): v for s, engine in self.engines.items()
                    for k, v in full_state_dict(engine.module).items()}
        return {names[s].get(k, k): v.detach().cpu().clone() for s, engine in self.engines.items()
                for k, v in engine.module.state_dict().items()}

    def state_dict(self, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
        """The full model state, gathered on rank ``dst`` (every rank when ``dst`` is None).

        Keys match the original module's ``state_dict`` (for user-given stages without
        ``model=``, ``"<stage>.<key>"``). Collective: call on every rank. Other ranks get None.
        """
        gathered = self._sharded or self.plan.tensor_parallel > 1  # a collective of the stage's ranks
        mine = self.stage_state_dict() if self.replica == 0 or gathered else {}
        mine = mine if self.replica == 0 and self.tensor_rank == 0 else {}
        if not self.distributed:
            return with_aliases(mine, self._aliases.values())
        buf = io.BytesIO()
        torch.save(mine, buf)
        with self._failure_guard("gathering the state"):
            parts = self._gather_bytes(buf.getvalue(), dst, "the gathering of the state")
        if parts is None:
            return None
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(torch.load(io.BytesIO(part), map_location="cpu", weights_only=True))
        return with_aliases(full, self._aliases.values())

    def _gather_bytes(self, data: bytes, dst: int | None, what: str) -> list[bytes] | None:
        """Every rank's ``data`` on rank ``dst`` (every rank when None; None elsewhere): raw
        bytes through the process group, after a deadline-bounded barrier that names a rank
        that does not come. Nothing is unpickled."""
        self.agreement.barrier(what)  # type: ignore[union-attr]
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=self.device))
        lengths = [int(t.item()) for t in sizes]
        width = max(1, max(lengths))
        buf = torch.zeros(width, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = buf.to(self.device)
        if dst is None:
            parts = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
            dist.all_gather(parts, buf)
        else:
            parts = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)] \
                if self.rank == dst else None  # type: ignore[assignment]
            dist.gather(buf, parts, dst=dst)
            if self.rank != dst:
                return None
        return [bytes(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, lengths)]

    def save_checkpoint(self, directory: str | os.PathLike[str], **extra: Any) -> Any:
        """Write an exact checkpoint into ``directory`` (collective; between schedules).

        Each stage's file (its weights and optimizer state under the model's names, version, RNG)
        is written atomically, then rank 0 writes a manifest with the index of names, every
        file's sha256 and the data position last. ``extra`` (JSON-serialisable) comes back from
        :meth:`load_checkpoint`. See ``runtime/checkpoint.py``.
        """
        with self._failure_guard("saving a checkpoint", agreed=(CheckpointError,)):
            return save_checkpoint(self._checkpoint_state(), directory, **extra)

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore this pipeline from a verified checkpoint (collective); returns its ``extra``.

        The checkpoint may come from another plan of the same model (other stages, replicas,
        workers or schedule): it is keyed by the model's names. Raises CheckpointError (same
        message on every rank) for a missing manifest, a corrupted, truncated or non-tensor
        file, another model, or another optimizer class.
        """
        with self._failure_guard("loading a checkpoint", agreed=(CheckpointError,)):
            resumed = load_checkpoint(self._checkpoint_state(), directory)
            self.epochs_done, self.minibatches_done = resumed.epochs_done, resumed.minibatches_done
            self.history.clear()
            self.history.extend(resumed.history)
            return resumed.extra

    def _checkpoint_state(self) -> CheckpointState:
        """This rank's stages as checkpointing reads and restores them (``runtime/checkpoint.py``):
        each tensor rank of a replica is a replica of its own there (its own file of random state),
        and a tensor-parallel stage saves its parts with DCP over all of its ranks, as a sharded
        one. A rank holding several stages (virtual stages) writes a file for each."""
        t = self.plan.tensor_parallel
        parts = []
        for s in self.stages_held:
            engine = self.engines[s]
            copies = [copy.weights for copy in self._tied_of(s).values()]
            group = self._stage_groups.get(s) or (self._ar_group if self.plan.stages[s].sharded else None)
            parts.append(StageState(stage=s, replica=self.replica * t + self.tensor_rank, module=engine.module,
                                    state_names=self._state_names[s], weights=[engine.weights] + copies,
                                    buffers=engine.buffers, group=group))
        return CheckpointState(
            rank=self.rank, world_size=self.world_size, device=self.device, plan=self.plan, kind=self.kind,
            stages=parts, aliases=self._aliases, scaler=self.engine.scaler, agreement=self.agreement,
            epochs_done=self.epochs_done, minibatches_done=self.minibatches_done, history=list(self.history),
        )

    def trace(self, dst: int | None = 0) -> Trace | None:
        """The measured trace of the last schedule run, all ranks' events (collective)."""
        meta = {"source": "runtime", "kind": self.kind, "plan": self.plan.summary}
        if self.last_schedule is not None:
            meta.update(minibatches=self.last_schedule.minibatches, microbatches=self.last_schedule.microbatches)
        if not self.distributed:
            return Trace(list(self._events), meta=meta)
        events = self._events if self.tensor_rank == 0 else []  # a worker's events once
        mine = json.dumps([dataclasses.asdict(e) for e in events]).encode()
        with self._failure_guard("gathering the trace"):
            parts = self._gather_bytes(mine, dst, "the gathering of the trace")
        if parts is None:
            return None
        events = [Event(**e) for part in parts for e in json.loads(part.decode())]
        events.sort(key=lambda e: (e.start_s, e.rank))
        return Trace(events, meta=meta)
