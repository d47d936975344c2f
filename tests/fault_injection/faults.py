"""Fault injection for the tests: a rank that dies or raises at a chosen minibatch.

``TORCHPIPEDREAM_FAULT="rank=1,minibatch=12[,mode=kill|raise]"`` makes that rank die (SIGKILL,
default) or raise in the forward of that training minibatch (counted from 0 in its process), on
the first attempt only (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a job restarted by
``torchrun --max-restarts`` then runs clean. ``mode=slow,seconds=S`` is a healthy but slow rank
instead: from that minibatch on, every training forward of its stage first sleeps S seconds (a
run that takes at least that long per minibatch, however fast the machine).

The library knows nothing of this. A process started with :func:`fault_environment` finds
``sitecustomize.py`` (next to this file) on its path at start-up; that wraps
``Pipeline.__init__`` when ``torchpipedream.runtime.pipeline`` is first imported, and arms the
fault on the rank it names.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("tests.fault_injection")

FAULT_ENV = "TORCHPIPEDREAM_FAULT"
HERE = Path(__file__).resolve().parent


def fault_environment(fault: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables that arm ``fault`` in processes started with them (``base``
    defaults to this process's environment; the result is a new dict)."""
    env = dict(os.environ if base is None else base)
    env[FAULT_ENV] = fault
    env["PYTHONPATH"] = os.pathsep.join([str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def parse_fault(text: str) -> dict[str, Any]:
    """``"rank=1,minibatch=12[,mode=kill|raise|stop]"`` or ``"rank=1,save=2,mode=stop"`` ->
    {"rank": 1, "minibatch": 12, "mode": "kill"} (a ``save`` instead of the ``minibatch``);
    ``"rank=1,minibatch=0,mode=slow,seconds=0.25"`` -> {..., "mode": "slow", "seconds": 0.25}."""
    out: dict[str, Any] = {"mode": "kill"}
    try:
        for part in text.split(","):
            key, value = (x.strip() for x in part.split("="))
            if key in ("rank", "minibatch", "save"):
                out[key] = int(value)
            elif key == "seconds" and float(value) > 0:
                out[key] = float(value)
            elif key == "mode" and value in ("kill", "raise", "stop", "slow"):
                out[key] = value
            else:
                raise ValueError(part)
        out["rank"]  # required
        if ("minibatch" in out) == ("save" in out):
            raise ValueError("give one of minibatch and save")
        if (out["mode"] == "slow") != ("seconds" in out) or (out["mode"] == "slow" and "save" in out):
            raise ValueError("mode=slow takes seconds and a minibatch, and only it takes seconds")
    except (ValueError, KeyError):
        raise ValueError(f"{FAULT_ENV}={text!r}: expected 'rank=R,minibatch=K[,mode=kill|raise|stop]', "
                         "'rank=R,save=K[,mode=...]' or 'rank=R,minibatch=K,mode=slow,seconds=S'") from None
    return out


def _fire(fault: dict[str, Any], where: str) -> None:
    log.warning("injected fault (%s) %s", fault["mode"], where)
    if fault["mode"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault["mode"] == "stop":
        print(f"FAULT-STOP pid={os.getpid()} time={time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    raise RuntimeError(f"injected fault {where} ({FAULT_ENV})")


def install_fault(pipe: Any) -> None:
    """Arm the fault named by ``TORCHPIPEDREAM_FAULT`` on ``pipe``'s rank (a forward pre-hook on
    its stage module, or a wrapper of its ``save_checkpoint``), on a first attempt only."""
    import torch

    from torchpipedream.plans.kinds import schedule_kind

    text = os.environ.get(FAULT_ENV)
    if not text or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return
    fault = parse_fault(text)
    if fault["rank"] != pipe.rank:
        return
    if "save" in fault:
        saves = [0]
        original = pipe.save_checkpoint

        def save_checkpoint(directory: Any, **extra: Any) -> Any:
            saves[0] += 1
            if saves[0] == fault["save"]:
                _fire(fault, f"at checkpoint save {saves[0]} on rank {pipe.rank}")
            return original(directory, **extra)

        pipe.save_checkpoint = save_checkpoint
        return
    per_minibatch = max(1, int(pipe.microbatches or pipe.plan.microbatches or 1)) \
        if schedule_kind(pipe.kind).microbatched else 1
    fire_at = fault["minibatch"] * per_minibatch  # training forwards of this stage before the fault
    seen = [0]

    def hook(module: Any, args: Any) -> None:
        if not torch.is_grad_enabled():  # evaluation does not count
            return
        seen[0] += 1
        if fault["mode"] == "slow":
            if seen[0] > fire_at:
                time.sleep(fault["seconds"])
        elif seen[0] == fire_at + 1:
            _fire(fault, f"at minibatch {fault['minibatch']} on rank {pipe.rank}")

    pipe.module.register_forward_pre_hook(hook)


def wrap_pipeline(pipeline_class: Any) -> None:
    """Make every new ``Pipeline`` arm the fault once it is built."""
    original = pipeline_class.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        install_fault(self)

    pipeline_class.__init__ = __init__
