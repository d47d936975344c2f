"""Why a process that used gloo could abort at exit, and the import order that prevents it.

The abort ("terminate called without an active exception", exit -6, after all work was done)
was caught with a core dump and gdb (2 of 98 torchrun launches of examples/user_pipeline.py):

1. torch imports ``torch.distributed.nn`` lazily: the first optimizer a process builds loads
   ``torch._dynamo``, which loads FSDP, which loads ``torch.distributed.nn.functional``. That
   module's functions take ``group=group.WORLD`` as a *default argument*, evaluated once, at
   import. Imported after ``init_process_group``, the defaults hold the default process group.
2. So ``destroy_process_group()`` cannot free that group: its gloo threads (``pt_gloo_runloop``)
   live on into interpreter shutdown.
3. There, a gloo thread destroys a finished work: the final ``barrier`` holds (weakly) the
   ``gather`` of ``Pipeline.trace`` before it, whose tensors are Python objects. Releasing them
   takes the GIL; a thread that asks for the GIL while the interpreter finalizes is ended with
   ``pthread_exit``, whose unwinding crosses a ``noexcept`` destructor: ``std::terminate``.

Imported *before* any process group exists, the defaults are None (which those functions read
as the default group anyway), ``destroy_process_group`` joins gloo's threads, and nothing is
left to run at shutdown. ``import torchpipedream`` does that import when torch is already
loaded (a script's usual order: imports, then ``init_process_group``); the launcher's workers
and ``train`` do it before they form their groups. A Pipeline built in a process where the
group was pinned anyway says so once (:func:`warn_if_default_group_pinned`).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["default_group_pinned", "warn_if_default_group_pinned"]

log = logging.getLogger(__name__)

_warned = False


def default_group_pinned() -> bool:
    """Whether ``torch.distributed.nn.functional`` holds a process group in its default
    arguments (it was first imported after ``init_process_group``)."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    defaults = getattr(getattr(functional, "broadcast", None), "__defaults__", None) or ()
    return any(type(d).__name__ == "ProcessGroup" for d in defaults)


def warn_if_default_group_pinned() -> None:
    """Log once per process when :func:`default_group_pinned`: its gloo threads will outlive
    ``destroy_process_group`` and may abort the process at exit."""
    global _warned
    if _warned or not default_group_pinned():
        return
    _warned = True
    log.warning("torch.distributed.nn was first imported after init_process_group, so its default arguments "
                "keep the default process group alive past destroy_process_group; gloo's threads then outlive "
                "it and can abort the process at exit ('terminate called without an active exception'). Import "
                "torchpipedream (or torch.distributed.nn) before calling init_process_group.")
