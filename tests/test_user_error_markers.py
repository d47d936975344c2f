"""The user-error markers `train` leaves for the restarts of a torchrun job (train/job.py): the
markers of jobs whose elastic agent has ended are removed when a later job starts, and only
those."""

from __future__ import annotations

import os
from pathlib import Path

from torchpipedream.train.job import prune_stale_markers


def _start_ticks(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def test_markers_of_ended_agents_are_removed_and_no_other(tmp_path: Path) -> None:
    parent = os.getppid()
    alive = tmp_path / f"torchpipedream-agent{parent}-{_start_ticks(parent)}-user-error.txt"
    reused = tmp_path / f"torchpipedream-agent{parent}-{int(_start_ticks(parent)) + 1}-user-error.txt"  # pid reused
    gone = tmp_path / f"torchpipedream-agent{2 ** 22 + 7}-123-user-error.txt"  # above any pid_max
    by_id = tmp_path / "torchpipedream-my_rdzv_id-user-error.txt"  # --rdzv-id: its job decides
    other = tmp_path / "something-else.txt"
    for path in (alive, reused, gone, by_id, other):
        path.write_text("--plan: no such file")
    assert prune_stale_markers(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (alive, by_id, other))
    assert prune_stale_markers(tmp_path) == 0
