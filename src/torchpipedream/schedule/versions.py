"""What a stage replica does with its weights and gradients as its action list runs.

Two rules, followed by the runtime (``runtime.weights.WeightVersions``) and charged by the
simulator (``sim.simulator``), so both read them here:

* **copy on update** (:func:`copies_on_update`, :func:`stash_copies`): an optimizer step (U)
  updates the weights in place unless the version it replaces is still used by a later F, B
  or W of the replica (a stashed version, or the version 2bw's next batch uses); then it copies
  the weights first and the copy goes on as the new version.
* **gradient accumulation** (:func:`keeps_gradient_buffers`, :func:`accumulating_backwards`):
  a replicated stage keeps persistent gradient buffers (the replicas' all-reduce runs on them),
  so every backward adds its weight gradient into them; elsewhere the first backward after an
  update hands its fresh gradient tensors over and only the later ones add theirs. Where the
  backward is split (B and W), the W computes the weight gradient and is the one that adds.

The versions every F, B and W uses are the kind's (``ScheduleKind.version_rule``), written
into the actions by ``schedule.build``. No torch.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .actions import Action, Kind, split_backwards

__all__ = ["copies_on_update", "keeps_gradient_buffers", "stash_copies", "accumulating_backwards", "by_stage"]


def copies_on_update(uses_left: int) -> bool:
    """Whether an update copies the weights first: the version it replaces has ``uses_left``
    F, B or W actions still to run."""
    return uses_left > 0


def keeps_gradient_buffers(replicated: bool) -> bool:
    """Whether a stage keeps persistent gradient buffers that every backward adds into (a
    replicated stage: its replicas all-reduce them) rather than taking the first backward's
    fresh gradients after each update."""
    return replicated


def stash_copies(actions: Sequence[Action]) -> set[int]:
    """Positions of the U actions in one stage replica's list that copy the weights.

    The weights before the k-th U of a schedule are version k (versions count updates from
    the schedule's start); the U copies them if a compute action after it names version k.
    """
    copies: set[int] = set()
    uses_left: dict[int, int] = {}
    version = sum(1 for a in actions if a.kind is Kind.OPTIMIZER_STEP)
    for p in range(len(actions) - 1, -1, -1):
        a = actions[p]
        if a.kind is Kind.OPTIMIZER_STEP:
            version -= 1
            if copies_on_update(uses_left.get(version, 0)):
                copies.add(p)
        elif a.version is not None and a.kind.is_compute:
            uses_left[a.version] = uses_left.get(a.version, 0) + 1
    return copies


def accumulating_backwards(actions: Sequence[Action], replicated: bool) -> set[int]:
    """Positions of the B actions (the W actions, where a backward is split) in one stage
    replica's list that add their weight gradient into an existing one: every one where the
    stage keeps gradient buffers, elsewhere every one after the first since the last U (the
    first hands over fresh gradient tensors, as the profile times it)."""
    out: set[int] = set()
    first = True
    split = split_backwards(list(actions))
    for p, a in enumerate(actions):
        if a.kind is Kind.WEIGHT_GRAD or (a.kind is Kind.BACKWARD and (a.stage, a.id) not in split):
            if keeps_gradient_buffers(replicated) or not first:
                out.add(p)
            first = False
        elif a.kind is Kind.OPTIMIZER_STEP:
            first = True
    return out


def by_stage(actions: Sequence[Action], positions: Callable[[list[Action], int], set[int]]) -> set[int]:
    """``positions(sub, stage)`` (positions in ``sub``) for each stage's own actions of one
    rank's list, as positions in the whole list (a rank holding several stages keeps versions
    and gradients per stage)."""
    stages = {a.stage for a in actions}
    if len(stages) <= 1:
        return positions(list(actions), next(iter(stages), 0))
    out: set[int] = set()
    for s in stages:
        at = [p for p, a in enumerate(actions) if a.stage == s]
        out |= {at[i] for i in positions([actions[p] for p in at], s)}
    return out
