"""The validator's rules for a stage sharded "zero1": its weights gathered once per update.

A stage sharded "zero1" (``Stage.sharding``; runtime/sharding.py) gathers its weights whole
before the update's first forward (``UN u``, an all-gather among its replicas), keeps them and
the gradient whole while the update's microbatches run, reduce-scatters the gradient into its
shards right after the update's last backward (``RD u``) and frees the gathered weights
(``RS u``) before the update's step. One replica's list must therefore read, for every update
u in order::

    UN u  (F, B, W of update u only)  ... B  RD u  ...  RS u  ...  U u

* every F, B and W of the stage runs between the UN and the RS of its update (nothing runs on
  shards);
* one gathered copy at a time: no UN while one is held (the memory the plan charges);
* RD u directly follows a B of update u, once every B of u has run: FSDP2 reduces the gradient
  from that backward's hooks (the runtime turns gradient sync on for that one B), so nothing
  may run between them;
* RS u after RD u and after every W of u; the AR and U of update u after RS u.

:class:`GatherWalk` keeps this state for one replica; ``validate._RankWalk`` calls it at each
action. UN and RD are collectives of the stage's replicas: the deadlock check meets them
(``validate._ShardedRun``).
"""

from __future__ import annotations

from typing import Callable

from .actions import Action, Kind

__all__ = ["GatherWalk"]

#: (step, what is wrong) -> the error to raise
ErrorAt = Callable[[int, str], Exception]


class GatherWalk:
    """One replica's gathers, reduce-scatters and reshards, checked in list order."""

    def __init__(self, stage: int, sharding: str, n_updates: int, updates: dict[int, list[int]]) -> None:
        self.stage, self.zero1, self.n_updates = stage, sharding == "zero1", n_updates
        self.updates = updates  # update -> this replica's microbatches of it
        self.gathered: int | None = None  # the update whose gathered weights are held
        self.done = {Kind.UNSHARD: 0, Kind.REDUCE_GRAD: 0, Kind.RESHARD: 0}  # of each, so far

    def action(self, k: int, a: Action, previous: Action | None, done_b: set[int], pending_w: set[int],
               err: ErrorAt) -> None:
        """UN, RD or RS ``a`` at step ``k``: ``previous`` is the rank's action before it, ``done_b``
        the microbatches backpropagated so far, ``pending_w`` those whose W has not run."""
        if not self.zero1:
            raise err(k, f"stage {self.stage} is not sharded 'zero1': only a zero1 stage gathers, reduce-scatters "
                         "and reshards its weights as actions of its own (UN, RD, RS)")
        want = self.done[a.kind]
        if a.id != want:
            raise err(k, f"the {a.kind.value} actions of stage {self.stage} come in update order: expected "
                         f"{a.kind.value}{want}")
        mine = self.updates.get(a.id, [])
        if a.kind is Kind.UNSHARD:
            if self.gathered is not None:
                raise err(k, f"the weights are gathered already (UN{self.gathered} has no RS yet): a zero1 stage "
                             "holds one gathered copy")
            self.gathered = a.id
        elif a.kind is Kind.REDUCE_GRAD:
            missing = next((j for j in mine if j not in done_b), None)
            if missing is not None:
                raise err(k, f"RD{a.id} reduce-scatters update {a.id}'s gradient before the backward of microbatch "
                             f"{missing} adds to it")
            if previous is None or previous.kind is not Kind.BACKWARD or previous.stage != self.stage \
                    or previous.id not in mine:
                raise err(k, f"RD{a.id} must directly follow a B of update {a.id} (FSDP2 reduce-scatters from that "
                             f"backward's hooks), not {previous}")
        else:
            if self.gathered != a.id:
                raise err(k, f"RS{a.id} frees weights that are not gathered (no UN{a.id} before it)")
            if self.done[Kind.REDUCE_GRAD] <= a.id:
                raise err(k, f"RS{a.id} before RD{a.id}: the update's gradient is reduce-scattered first")
            late = next((j for j in mine if j in pending_w), None)
            if late is not None:
                raise err(k, f"RS{a.id} frees the weights before the W of microbatch {late}")
            self.gathered = None
        self.done[a.kind] = want + 1

    def compute(self, k: int, a: Action, update: int, err: ErrorAt) -> None:
        """An F, B or W of microbatch ``a.id`` (of ``update``) runs on gathered weights."""
        if self.zero1 and self.gathered != update:
            raise err(k, f"stage {self.stage} is sharded 'zero1': microbatch {a.id} of update {update} runs on "
                         f"its gathered weights, between UN{update} and RS{update}")

    def step(self, k: int, a: Action, err: ErrorAt) -> None:
        """The AR or U of update ``a.id`` comes after its reduce-scatter and reshard."""
        if self.zero1 and self.done[Kind.RESHARD] <= a.id:
            raise err(k, f"{a.kind.value}{a.id} before RS{a.id}: a zero1 stage reduce-scatters its gradient and "
                         "frees its gathered weights before the update's all-reduce and step")

    def finish(self, err: Callable[[str], Exception]) -> None:
        """Every update gathered, reduced and resharded; nothing left gathered."""
        if not self.zero1:
            return
        for kind, count in self.done.items():
            if count != self.n_updates:
                raise err(f"stage {self.stage} runs {count} {kind.value} actions; a zero1 stage needs one per update "
                          f"({self.n_updates})")
