"""A whole training run, on this computer's cores (``launch``) or as one process of torchrun.

Before any worker starts, the options are checked (``config.check_options``), ``--out`` is
locked for the run's lifetime and checked (``out_dir``), the inputs are read, and only then is
an earlier run that ``--overwrite`` replaces deleted; a run whose newest compatible checkpoint
already ends it only writes its outputs again. Locally, the launcher stops the run only when no worker has made
progress for ``--timeout`` plus the failure path's deadlines, or when a worker has not started
(imported torch and the model's modules) within ``--startup-timeout``: a healthy run is never
cut short, however long it takes or however slowly a loaded machine starts it.

Under torchrun, rank 0 prepares and sends the plan to the others as JSON through the store
(``runtime/agreement.py``). A mistake of the user's (an option, a file) is reported once, by
rank 0; a restarted attempt of the same torchrun job (``--max-restarts``) recognises it and
stops at once instead of reporting it again, since a restart cannot fix it.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import launch
from ..runtime.agreement import Agreement
from ..runtime.failures import new_store_prefix
from ..runtime.flight_recorder import read_reports
from ..runtime.devices import default_backend, ranks_per_node
from ..runtime.launcher import LaunchError, init_from_env
from ..search.auto import threads_per_worker
from .config import TrainConfig, TrainError, check_options
from .out_dir import OutDirLock, check_out_dir, clear_out_dir, flight_record_dir, lock_out_dir
from .outputs import outputs_from_checkpoint, write_outputs
from .preparation import Prepared, prepare
from .resume import resume_after_restart
from .worker import train_rank

__all__ = ["run", "stall_timeout_s"]

log = logging.getLogger(__name__)

#: Rank 0's lock on --out under torchrun: held until its process ends (a restart is a new process).
_held_lock: OutDirLock | None = None


def stall_timeout_s(cfg: TrainConfig) -> float:
    """How long the launcher lets every worker go without progress before it stops the run:
    ``--timeout`` (every wait's deadline) plus time for the failure path to report."""
    return cfg.timeout_s + 3 * cfg.failure_timeout_s + 5.0


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Prepare, launch one worker per plan rank on this computer, train, and write the outputs;
    returns the report.

    Under torchrun (RANK and WORLD_SIZE set) each process is one worker: rank 0 prepares and
    sends the plan, and writes the outputs (the other ranks return an empty dict).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_under_torchrun(cfg)
    check_options(cfg)
    with lock_out_dir(cfg.out):  # one run at a time in --out, for the whole run
        prep = _prepare_in_out_dir(cfg, measure_host=True)
        if prep.complete:
            return _rewrite_outputs(prep)
        if prep.resume_from is not None:
            log.warning("resuming from %s", prep.resume_from)
        log.info("plan %s for %d workers: %s", prep.plan.summary, prep.plan.num_workers, prep.why)
        try:
            result = launch(train_rank, prep.plan.num_ranks, prep, stall_timeout_s=stall_timeout_s(cfg),
                            comm_timeout_s=cfg.timeout_s, startup_timeout_s=cfg.startup_timeout_s,
                            threads=threads_per_worker(prep.plan))
        except LaunchError as exc:
            raise LaunchError(f"{exc}{_where_ranks_stood(cfg.out, prep.plan.num_ranks)}") from None
        return write_outputs(prep, result, Path(cfg.out))


def _where_ranks_stood(out: str, ranks: int) -> str:
    """The lines the failed run's ranks wrote into OUT/flight_record (empty when none wrote)."""
    folder = flight_record_dir(out)
    if not folder.is_dir():
        return ""
    lines = "\n".join(f"  {line}" for line in read_reports(folder, ranks))
    return f"\nWhere every rank stood (their last actions are in {folder}):\n{lines}"


def _prepare_in_out_dir(cfg: TrainConfig, measure_host: bool = False) -> Prepared:
    """Check ``--out`` (locked by the caller), prepare the run, reading its inputs (``--plan``,
    ``--init``), and only then clear the earlier run that ``--overwrite`` replaces: a refused
    or failed preparation deletes nothing, and an input inside ``--out`` is read first."""
    check_out_dir(cfg)
    prep = prepare(cfg, measure_host=measure_host)
    clear_out_dir(cfg)
    return prep


def _rewrite_outputs(prep: Prepared) -> dict[str, Any]:
    log.warning("the run in %s is complete (checkpoint %s): writing its outputs again", prep.config.out,
                prep.resume_from)
    return write_outputs(prep, outputs_from_checkpoint(prep.resume_from), Path(prep.config.out))  # type: ignore[arg-type]


def _start_ticks(pid: int) -> str:
    """When process ``pid`` started, in clock ticks after boot (``/proc/<pid>/stat`` field 22);
    OSError or IndexError where it cannot be read."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _job_id() -> str | None:
    """What identifies this torchrun job across its restarts: ``--rdzv-id`` when given, else the
    elastic agent (the workers' parent) by its pid and start time (a reused pid differs in the
    latter); None outside torchrun."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    agent = os.getppid()
    try:
        started = _start_ticks(agent)
    except (OSError, IndexError):
        return None
    return f"agent{agent}-{started}"


def _marker() -> Path | None:
    """Where rank 0 notes a user error for the restarts of the same torchrun job (None outside one)."""
    job = _job_id()
    if job is None:
        return None
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in job)
    return Path(tempfile.gettempdir()) / f"torchpipedream-{safe}-user-error.txt"


_AGENT_MARKER = re.compile(r"torchpipedream-agent(\d+)-(\d+)-user-error\.txt")


def prune_stale_markers(directory: str | Path | None = None) -> int:
    """Remove the user-error markers of torchrun jobs whose elastic agent has ended (a marker
    named by its agent's pid and start time, as :func:`_job_id` names it, whose pid no longer
    runs or runs another process): nothing reads them again, and without this every failed
    job would leave one in the temporary folder. Returns how many were removed."""
    removed = 0
    for path in Path(directory or tempfile.gettempdir()).glob("torchpipedream-agent*-user-error.txt"):
        match = _AGENT_MARKER.fullmatch(path.name)
        if match is None:
            continue
        try:
            alive = _start_ticks(int(match[1])) == match[2]
        except (OSError, IndexError):
            alive = False
        if not alive:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _agent_started_unix() -> float | None:
    """When the elastic agent (this worker's parent) started, in Unix seconds (None if unknown)."""
    try:
        ticks = int(_start_ticks(os.getppid()))
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def reported_by_this_job(marker: Path, agent_started: float | None) -> bool:
    """Whether ``marker`` was written by an attempt of the running job: after its agent started.
    A ``--rdzv-id`` is often reused by later jobs, whose restarts must not read an old marker
    (one second of slack: ``btime`` is whole seconds)."""
    try:
        written = marker.stat().st_mtime
    except OSError:
        return False
    return agent_started is None or written >= agent_started - 1.0


def _lock_until_exit(out: str) -> None:
    """Rank 0 under torchrun: lock ``--out`` until this process ends (the run's lifetime)."""
    global _held_lock
    _release_lock()
    _held_lock = lock_out_dir(out)


def _release_lock() -> None:
    """Release rank 0's lock on ``--out`` (a run refused before it started)."""
    global _held_lock
    if _held_lock is not None:
        _held_lock.release()
        _held_lock = None


def _prepare_on_rank0(cfg: TrainConfig) -> dict[str, Any]:
    """What rank 0 sends the others: the prepared run, or the error that stops it."""
    marker = _marker()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if marker is not None and restart == 0:
        prune_stale_markers(marker.parent)
    if marker is not None and restart > 0 and reported_by_this_job(marker, _agent_started_unix()):
        return {"error": "not retried: an earlier attempt of this job stopped on the mistake it reported "
                         f"(noted in {marker})", "user": True, "repeat": True}
    try:
        resume_after_restart(cfg)
        check_options(cfg)
        _lock_until_exit(cfg.out)
        return {"prepared": _prepare_in_out_dir(cfg).to_dict()}
    except (ValueError, FileNotFoundError) as exc:  # TrainError, PlanError, ...: the user's to fix
        _release_lock()
        if marker is not None:
            try:
                marker.write_text(str(exc))
            except OSError:
                pass
        return {"error": str(exc), "user": True}
    except Exception as exc:
        log.exception("rank 0 failed while preparing the run")
        return {"error": f"{type(exc).__name__}: {exc}", "user": False}


def _run_under_torchrun(cfg: TrainConfig) -> dict[str, Any]:
    if not dist.is_initialized():
        backend = default_backend(ranks_per_node(int(os.environ.get("WORLD_SIZE", 1))))
        init_from_env(backend, cfg.timeout_s, cfg.startup_timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg.workers = world
    store, prefix = new_store_prefix()
    # Rank 0 profiles and plans while the others wait: a longer deadline than one step's.
    agreement = Agreement(store, rank, world, max(cfg.timeout_s, 600.0), prefix + "start/")
    sent = agreement.broadcast("the start of the run", _prepare_on_rank0(cfg) if rank == 0 else None)
    if "error" in sent:
        dist.destroy_process_group()  # leave no gloo work behind ("terminate called without an active exception")
        if rank == 0:  # a repeat says so in one line, so that no attempt ends without a word
            raise TrainError(sent["error"]) if sent["user"] else RuntimeError(sent["error"])
        raise TrainError(sent["error"], quiet=True)  # reported by rank 0
    prep = Prepared.from_dict(sent["prepared"])
    if prep.complete:
        dist.destroy_process_group()
        return _rewrite_outputs(prep) if rank == 0 else {}
    if prep.resume_from is not None:
        log.warning("rank %d: resuming from %s", rank, prep.resume_from)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    result = train_rank(rank, prep)
    # Leave together (as launch() does): a rank whose process exits while a peer's gloo work
    # is still in flight can abort the peer ("terminate called without an active exception",
    # seen after a resumed run).
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return {}
    return write_outputs(prep, result, Path(cfg.out))
