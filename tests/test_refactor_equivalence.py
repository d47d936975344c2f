"""The package's reorganisation into subfolders changed no plan and no simulated time.

``tests/data/golden_plans.json`` was written by the code of commit d47f816, before the
package's modules were moved into subfolders (src/torchpipedream/...), with
``tests/golden_plans.py``: 185 cases of ``tpd.plan`` on the 14 bundled reference profiles
(several topologies and schedule kinds; each plan's JSON text as ``Plan.save`` writes it) and
of ``tpd.simulate`` on those plans and on hand-written plans like the benchmarks' (time per
minibatch, throughput, bubble, utilisation, busy time, memory peaks, digests of the schedule's
actions and of the trace). :func:`test_plans_and_simulations_match_the_golden_file` takes the
same snapshot with the package as it is now and asks for exactly the same values: floats
compared exactly, plan texts byte for byte. Only the public API is used, so the file holds
whatever the modules are called.

Left out of the snapshot as not reproducible: the planner's wall-clock ``planning_time_s``
and the host path of the profile file (``meta.graph_source``, kept as
``<reference profile>/<name>/graph.txt``); see ``tests/golden_plans.py``.

To regenerate the golden file (only from the code it must describe: a worktree of d47f816)::

    git -C /work/main worktree add /tmp/golden_wt d47f816
    cd /tmp/golden_wt && PYTHONPATH=/tmp/golden_wt/src /work/main/.venv/bin/python \\
        /work/main/tests/golden_plans.py --write

(check first that ``torchpipedream.__file__`` is under /tmp/golden_wt with that PYTHONPATH).
A change of the planner or the simulator that is meant to change results needs a new golden
file from the new code (``python tests/golden_plans.py --write``), in the same commit. Rewritten
so since d47f816: by the sharded stages' commits (issue 36), for intended differences only —
the "no plan fits" message of a flush plan suggests sharding, ``schedule="auto"``'s candidates
record their ``sharding``, and auto's sharded candidates shard only the stages that need it
(their simulated times and labels); and by issue 37's steps after the rank's last backward on
virtual stages (interleaved, zb-v): the digests of their actions and traces only (38 values),
every time, throughput, bubble, utilisation and memory peak unchanged; and by issue 36's
tensor-parallel degree search: ``schedule="auto"``'s candidates record their
``tensor_parallel`` (1 in every case: one plan text, no number changed); and by issue 36's
depth screen (one packed test over every stage count instead of one test per depth): the
``meta.feasibility_checks`` count of 9 budgeted flush plans only (one more, or fewer where
memory rules out the shallow depths), every stage, time and memory unchanged; and by issue
36's replicated zero-bubble plans (the planner weighs a replicated zb-h1/zb-h2 plan, with its
replicas' round trips charged, against the straight one): one case, alexnet on 2x2 under
zb-h1 with 4 microbatches, now 2-2 instead of straight ×4 (simulated 8.01 minibatches/s
against 7.33 in steady state); every other plan and value unchanged.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def _golden_plans():
    """tests/golden_plans.py as a module (the tests folder is not a package)."""
    name = "_torchpipedream_golden_plans"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / "golden_plans.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def golden() -> dict:
    path = _golden_plans().GOLDEN
    assert path.is_file(), f"{path} is missing; see this file's docstring to regenerate it"
    return _golden_plans().load_golden(path)


def test_plans_and_simulations_match_the_golden_file(golden: dict) -> None:
    gp = _golden_plans()
    now = gp.canonical(gp.snapshot())
    diffs = gp.differences(golden, now)
    assert not diffs, ("the snapshot differs from tests/data/golden_plans.json (written by d47f816); first: "
                       + diffs[0] + "\n" + "\n".join(diffs[1:]))
    # the whole file, byte for byte, but for the public names (new exports may come: checked above)
    assert gp.dumps({**now, "public_api": None}) == gp.dumps({**golden, "public_api": None})


def test_the_comparison_reports_a_planted_change(golden: dict) -> None:
    gp = _golden_plans()
    assert gp.differences(golden, copy.deepcopy(golden)) == []

    cases = sorted(golden["cases"])
    simulated = next(c for c in cases if "makespan_s" in golden["cases"][c].get("sim", {}))
    planned = next(c for c in cases if c.startswith("plan/") and "plan_json" in golden["cases"][c])

    # a simulated time one ulp off
    changed = copy.deepcopy(golden)
    sim = changed["cases"][simulated]["sim"]
    sim["makespan_s"] = math.nextafter(sim["makespan_s"], math.inf)
    diffs = gp.differences(golden, changed)
    assert len(diffs) == 1 and diffs[0].startswith(f"case {simulated} :: sim.makespan_s: golden "), diffs

    # a float that became an int of the same value is a difference too
    changed = copy.deepcopy(golden)
    peaks = changed["cases"][simulated]["sim"]["peak_memory_bytes"]
    peaks[0] = int(peaks[0])
    assert gp.differences(golden, changed) == [
        f"case {simulated} :: sim.peak_memory_bytes[0]: golden {golden['cases'][simulated]['sim']['peak_memory_bytes'][0]!r}, "
        f"now {peaks[0]!r}"]

    # a plan whose first stage's forward changed: named by the field inside the plan's JSON, and the line
    changed = copy.deepcopy(golden)
    plan = json.loads(changed["cases"][planned]["plan_json"])
    plan["stages"][0]["forward_ms"] += 1.0
    changed["cases"][planned]["plan_json"] = json.dumps(plan, indent=1) + "\n"
    diffs = gp.differences(golden, changed)
    assert len(diffs) == 1, diffs
    assert diffs[0].startswith(f"case {planned} :: plan_json: plan.stages[0].forward_ms: golden "), diffs
    assert "line " in diffs[0]

    # a case that disappeared, one that appeared, and a changed error message
    changed = copy.deepcopy(golden)
    del changed["cases"][cases[0]]
    changed["cases"]["plan/new/case"] = {"skipped": "PlanError: x"}
    skipped = next(c for c in cases if "skipped" in golden["cases"][c])
    changed["cases"][skipped]["skipped"] += "!"
    diffs = gp.differences(golden, changed)
    assert f"case {cases[0]}: missing now" in diffs
    assert "case plan/new/case: new (not in the golden file)" in diffs
    assert any(d.startswith(f"case {skipped} :: skipped: golden ") for d in diffs), diffs
