"""Golden snapshot of the planner's plans and the simulator's results, through the public API only.

Not a test module: ``tests/test_refactor_equivalence.py`` calls :func:`snapshot` with the
package as it is now and compares the result with ``tests/data/golden_plans.json``, which was
written by the code of commit d47f816 (before the package's modules were moved into
subfolders). Only names of ``torchpipedream.__all__`` are used (``tpd.load_profile``,
``tpd.Topology``, ``tpd.plan``, ``tpd.Plan``, ``tpd.Stage``, ``tpd.build_schedule``,
``tpd.simulate``, ``tpd.Costs``) and the methods of the objects they return, so that the
snapshot means the same before and after the move.

A snapshot is ``{"cases": {case id: record}, ...}``. A case is

* ``plan/<profile>/<topology>/<variant>``: ``tpd.plan`` of a bundled reference profile; the
  record holds the plan's JSON text (``plan_json``: exactly what ``Plan.save`` writes, with the
  two fields below made host-independent), whether ``Plan.load`` reads it back to the same
  dict, and the simulation of the plan's own schedule (``sim``);
* ``handmade/<name>``: a plan written by hand as the benchmarks write them
  (benchmarks/simulator_speed.py, zb_2bw_depth.py, runtime_vs_sim.py), simulated with
  explicit ``Costs`` overrides.

A combination that raises is recorded as ``{"skipped": "<ExceptionType>: <message>"}``, so a
changed message is a difference too.

Left out as not reproducible: ``meta.planning_time_s`` of a plan (the planner's wall-clock
time) is replaced by the text ``"<excluded: wall clock>"``; ``meta.graph_source`` (the path of
the profile file, which depends on where the package lies) is kept as
``<reference profile>/<name>/graph.txt`` when it is that file's path. Nothing else is rounded
or dropped: floats are written with ``repr`` (JSON's float form round-trips exactly).

Regenerate (only with the code the golden file must describe, e.g. a worktree of d47f816)::

    git -C /work/main worktree add /tmp/golden_wt d47f816
    cd /tmp/golden_wt && PYTHONPATH=/tmp/golden_wt/src /work/main/.venv/bin/python \\
        /work/main/tests/golden_plans.py --write

``python tests/golden_plans.py`` (without ``--write``) prints the snapshot's case count and
how it compares with the golden file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torchpipedream as tpd

GOLDEN = Path(__file__).parent / "data" / "golden_plans.json"
SNAPSHOT_FORMAT = 1

#: The 14 reference profiles that ship with the package (PipeDream's measurements).
PROFILES = ("alexnet", "densenet121", "gnmt", "gnmt_large", "inception_v3", "nasnetalarge", "nasnetamobile",
            "resnet101", "resnet18", "resnet50", "resnext101", "resnext50", "squeezenet1_0", "vgg16")
#: Small and medium profiles, planned with every variant and on more topologies.
SMALL = ("alexnet", "gnmt", "gnmt_large", "resnet18", "squeezenet1_0", "vgg16")

#: label -> topology spec given to tpd.plan.
TOPOLOGIES = {
    "2x2": "2x2:10GB/s,1.25GB/s",  # 2 workers per server, 2 servers: two levels
    "4x2": "4x2:10GB/s,1.25GB/s",  # 4 workers per server, 2 servers
    "C": "C",  # preset: 4 single-GPU servers, 12 GB per worker (a memory budget)
    "A": "A",  # preset: 4x4 V100, 16 GB per worker
    "B:1": "B:1",  # preset B with one server: 8 workers over NVLink
}

#: label -> (schedule kind, tpd.plan options).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "pipedream": ("pipedream", {}),
    "pipedream-straight": ("pipedream", {"straight": True}),
    "2bw-m4": ("2bw", {"microbatches": 4}),
    "flush-m4": ("flush", {"microbatches": 4}),
    "gpipe-m4": ("gpipe", {"microbatches": 4}),
    "zb-h1-m4": ("zb-h1", {"microbatches": 4}),
    "zb-h2-m4": ("zb-h2", {"microbatches": 4}),
    "zb-2bw-m4": ("zb-2bw", {"microbatches": 4}),
    "interleaved-m4": ("interleaved", {"microbatches": 4}),
    "interleaved-m8": ("interleaved", {"microbatches": 8}),
    "zb-v-m4": ("zb-v", {"microbatches": 4}),
    "naive": ("naive", {}),
    "pipedream-hierarchical": ("pipedream", {"method": "hierarchical"}),
    "flush-m4-recompute": ("flush", {"microbatches": 4, "recompute": True}),
    "2bw-m4-3stages": ("2bw", {"microbatches": 4, "num_stages": 3}),
    "pipedream-fewer": ("pipedream", {"allow_fewer_workers": True}),
    "flush-m2-1GB": ("flush", {"microbatches": 2, "memory_bytes": 10**9}),
    "auto": ("auto", {}),
}

# Which (profiles, topologies, variants) are planned: a cross product per row. The large
# profiles (nasnet*, densenet, resnext101, ...) take seconds per plan with the microbatched
# kinds' memory search, so they get the cheap variants only; the run stays well under a minute
# on two cores.
MATRIX: list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = [
    (PROFILES, ("2x2",), ("pipedream", "pipedream-straight", "zb-h1-m4")),
    (PROFILES, ("4x2",), ("pipedream",)),
    (tuple(p for p in PROFILES if not p.startswith("nasnet")), ("2x2",), ("flush-m4",)),
    (SMALL, ("2x2",), ("2bw-m4", "gpipe-m4", "zb-h2-m4", "zb-2bw-m4", "interleaved-m4", "zb-v-m4", "naive",
                       "pipedream-hierarchical", "flush-m4-recompute", "2bw-m4-3stages", "pipedream-fewer",
                       "flush-m2-1GB")),
    (SMALL, ("C",), ("pipedream", "flush-m4")),
    (("vgg16", "resnet18"), ("C",), ("interleaved-m4",)),
    (("resnet50", "inception_v3"), ("2x2",), ("2bw-m4",)),
    (("vgg16", "gnmt"), ("4x2",), ("2bw-m4", "zb-h1-m4", "interleaved-m4", "interleaved-m8")),
    (("vgg16", "alexnet"), ("A",), ("pipedream", "pipedream-straight", "interleaved-m4")),
    (("vgg16",), ("B:1",), ("pipedream", "zb-v-m4")),
    (("vgg16",), ("C",), ("auto",)),
]

#: Minibatches (batches, for the microbatched kinds) each plan's schedule is simulated over.
SIM_MINIBATCHES = 4


# ------------------------------------------------------------------------------ helpers
def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _normalised_plan_json(plan: Any, profile: str | None) -> tuple[str, bool]:
    """The text ``plan.save`` writes, with the wall-clock planning time and the host's profile
    path replaced (module docstring), and whether ``Plan.load`` reads the file back to the same dict."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        plan.save(path)
        text = path.read_text()
        reloads = tpd.Plan.load(path).to_dict() == plan.to_dict()
    data = json.loads(text)
    if json.dumps(data, indent=1) + "\n" != text:  # the file is json.dumps(to_dict, indent=1): say if not
        raise AssertionError("Plan.save no longer writes json.dumps(..., indent=1); update golden_plans.py")
    meta = data.get("meta")
    if isinstance(meta, dict):
        if "planning_time_s" in meta:
            meta["planning_time_s"] = "<excluded: wall clock>"
        source = meta.get("graph_source")
        if profile and isinstance(source, str) and Path(source).parts[-2:] == (profile, "graph.txt"):
            meta["graph_source"] = f"<reference profile>/{profile}/graph.txt"
    return json.dumps(data, indent=1) + "\n", reloads


def _sha256(lines: Any) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


def _sim_record(schedule: Any, result: Any) -> dict[str, Any]:
    """Everything a SimResult says as plain numbers, and digests of the schedule and the trace."""
    events = result.trace.events
    return {
        "kind": schedule.kind,
        "minibatches": schedule.minibatches,
        "microbatches": schedule.microbatches,
        "actions": schedule.total_actions(),
        "actions_sha256": _sha256(f"{r}: " + " ".join(str(a) for a in acts)
                                  for r, acts in sorted(schedule.actions.items())),
        "makespan_s": result.makespan_s,
        "time_per_minibatch_s": result.makespan_s / schedule.minibatches,
        "minibatches_per_s": result.minibatches_per_s,
        "samples_per_s": result.samples_per_s,
        "steady_minibatches_per_s": result.steady_minibatches_per_s,
        "steady_samples_per_s": result.steady_samples_per_s,
        "bubble_fraction": result.bubble_fraction,
        "steady_bubble_fraction": result.steady_bubble_fraction,
        "utilisation": {str(r): u for r, u in sorted(result.utilisation.items())},
        "busy_s": {str(r): b for r, b in sorted(result.trace.busy_time().items())},
        "max_versions": list(result.max_versions),
        "max_inflight": list(result.max_inflight),
        "peak_memory_bytes": list(result.peak_memory_bytes),
        "events": len(events),
        "events_sha256": _sha256(f"{e.rank}|{e.stage}|{e.replica}|{e.kind}|{e.id}|{e.version}|{e.start_s!r}|"
                                 f"{e.end_s!r}|{e.bytes}|{e.action}" for e in events),
    }


def _simulate(plan: Any, kind: str | None = None, minibatches: int = SIM_MINIBATCHES,
              microbatches: int | None = None, costs: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    try:
        sched = tpd.build_schedule(plan, kind, minibatches=minibatches, microbatches=microbatches)
        result = tpd.simulate(sched, costs(sched) if costs is not None else None)
    except Exception as exc:  # noqa: BLE001 - recorded, part of the snapshot
        return {"skipped": _error(exc)}
    return _sim_record(sched, result)


# ------------------------------------------------------------------------------ cases
def _planned_cases() -> dict[str, dict[str, Any]]:
    graphs: dict[str, Any] = {}
    out: dict[str, dict[str, Any]] = {}
    for profiles, topologies, variants in MATRIX:
        for profile in profiles:
            if profile not in graphs:
                graphs[profile] = tpd.load_profile(profile)
            for topo in topologies:
                for variant in variants:
                    key = f"plan/{profile}/{topo}/{variant}"
                    kind, options = VARIANTS[variant]
                    record: dict[str, Any] = {"profile": profile, "topology": TOPOLOGIES[topo], "schedule": kind,
                                              "options": dict(options)}
                    try:
                        plan = tpd.plan(graphs[profile], TOPOLOGIES[topo], schedule=kind, **options)
                    except Exception as exc:  # noqa: BLE001 - recorded, part of the snapshot
                        record["skipped"] = _error(exc)
                        out[key] = record
                        continue
                    record["plan_json"], record["reloads_equal"] = _normalised_plan_json(plan, profile)
                    record["sim"] = _simulate(plan)
                    out[key] = record
    return out


def _speed_plan(config: list[int]) -> Any:
    """benchmarks/simulator_speed.py's plan_for: one layer per stage, equal costs."""
    stages, r = [], 0
    for i, k in enumerate(config):
        stages.append(tpd.Stage(layers=[f"l{i}"], replicas=k, ranks=list(range(r, r + k)), forward_ms=1.0,
                                backward_ms=2.0, parameter_bytes=10**6, output_bytes=10**5))
        r += k
    return tpd.Plan(stages=stages, batch_size=32)


def _handmade_cases() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}

    # benchmarks/simulator_speed.py: its CASES, on short schedules.
    for kind, config, m in [("pipedream", [1] * 8, None), ("pipedream", [2, 1, 1, 4], None), ("2bw", [1] * 8, 8),
                            ("flush", [1] * 8, 8), ("gpipe", [1] * 8, 8)]:
        plan = _speed_plan(config)
        out[f"handmade/simulator_speed/{kind}/{plan.config}"] = {
            "plan_json": _normalised_plan_json(plan, None)[0],
            "sim": _simulate(plan, kind, minibatches=6, microbatches=m,
                             costs=lambda s, p=plan: tpd.Costs.from_plan(p, s.microbatches)),
        }

    # benchmarks/zb_2bw_depth.py's case(): one straight cut planned for 2bw, simulated as 2bw and
    # zb-2bw with a V100's memory bandwidth for accumulation and stash copies.
    for model, n, m in [("vgg16", 4, 2), ("gnmt", 8, 4)]:
        key = f"handmade/zb_2bw_depth/{model}/n{n}/m{m}"
        try:
            cut = tpd.plan(tpd.load_profile(model), f"{n}:10GB/s", schedule="2bw", microbatches=m, num_stages=n,
                           straight=True)
        except Exception as exc:  # noqa: BLE001
            out[key] = {"skipped": _error(exc)}
            continue
        record: dict[str, Any] = {"plan_json": _normalised_plan_json(cut, model)[0]}
        for kind in ("2bw", "zb-2bw"):
            plan = dataclasses.replace(cut, schedule=kind)
            record[kind] = _simulate(plan, kind, minibatches=8, microbatches=m,
                                     costs=lambda s, p=plan: tpd.Costs.from_plan(p, microbatches=m,
                                                                                 accumulate_Bps=900e9,
                                                                                 copy_Bps=900e9))
            record[kind]["stage_memory_bytes"] = [plan.stage_memory_bytes(s, kind, m) for s in range(n)]
        out[key] = record

    # benchmarks/runtime_vs_sim.py: a 2-stage straight plan on 2 local workers, simulated with
    # measured-style overrides (loopback bandwidth, no latency, message overhead, copy
    # bandwidth, compute slowdown); the profile's times are written in here instead of measured.
    local = tpd.Topology.local(2)
    for kind in ("pipedream", "flush", "gpipe"):
        m = 1 if kind == "pipedream" else 4
        names = [f"fc{i}" for i in range(8)]
        plan = tpd.Plan.straight([names[:4], names[4:]], schedule=kind, batch_size=64, microbatches=m,
                                 topology=local.to_spec())
        for s, st in enumerate(plan.stages):
            st.forward_ms, st.backward_ms = 3.1 + s * 0.4, 6.3 + s * 0.9
            st.optimizer_ms, st.parameter_bytes = 0.7, 1_050_624 + s * 20_480
            st.output_bytes = 64 * 512 * 4 if s == 0 else 0
        out[f"handmade/runtime_vs_sim/{kind}"] = {
            "plan_json": _normalised_plan_json(plan, None)[0],
            "sim": _simulate(plan, kind, minibatches=6, costs=lambda s, p=plan: tpd.Costs.from_plan(
                p, s.microbatches, bandwidth_fn=None, bandwidth_Bps=2.1e9, latency_s=0.0,
                message_overhead_s=45e-6, copy_Bps=11.5e9, compute_slowdown=1.15)),
        }

    # Virtual stages written by hand: interleaved (looped) and zb-v (V-shaped) on 4 workers.
    groups = [[f"b{k}"] for k in range(8)]
    for kind, make in (("interleaved", tpd.Plan.looped), ("zb-v", tpd.Plan.v_shape)):
        plan = make(groups, 4, schedule=kind, microbatches=8, batch_size=32, topology="4:10GB/s")
        for k, st in enumerate(plan.stages):
            st.forward_ms, st.backward_ms = 1.0 + 0.1 * k, 2.0 + 0.3 * (k % 3)
            st.parameter_bytes, st.output_bytes = 2_000_000 + k, (4 * 10**5 if k < 7 else 0)
        out[f"handmade/virtual/{kind}"] = {
            "plan_json": _normalised_plan_json(plan, None)[0],
            "sim": _simulate(plan, kind, minibatches=3),
        }
    return out


def snapshot() -> dict[str, Any]:
    """The snapshot of the package as imported now (module docstring)."""
    cases = {**_planned_cases(), **_handmade_cases()}
    return {
        "format": SNAPSHOT_FORMAT,
        "public_api": sorted(tpd.__all__),
        "cases": dict(sorted(cases.items())),
    }


# ------------------------------------------------------------------------------ comparison
def _same_leaf(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _first_text_difference(a: str, b: str) -> str:
    """Where two texts first differ: the line number and both lines (plan JSON: the field)."""
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb), start=1):
        if x != y:
            return f"line {i}: golden {x.strip()!r}, now {y.strip()!r}"
    return f"golden has {len(la)} lines, now {len(lb)}"


def _first_json_path(a: Any, b: Any, path: str) -> str:
    """The first key path at which two parsed JSON values differ (``path`` when they are leaves)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}.{k} ({'missing now' if k in a else 'new'})"
            if not _same_leaf(a[k], b[k]):
                return _first_json_path(a[k], b[k], f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if not _same_leaf(x, y):
                return _first_json_path(x, y, f"{path}[{i}]")
        if len(a) != len(b):
            return f"{path} (length {len(a)} -> {len(b)})"
    return f"{path}: golden {a!r}, now {b!r}"


def differences(golden: dict[str, Any], current: dict[str, Any], limit: int = 20) -> list[str]:
    """Up to ``limit`` differences between two snapshots, in case order, each naming the case
    and the key (for plan JSON text: the field path inside the plan, and the line)."""
    out: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if k not in b:
                    out.append(f"{where}{k}: missing now (golden has it)")
                elif k not in a:
                    out.append(f"{where}{k}: new (not in the golden file)")
                else:
                    walk(a[k], b[k], f"{where}{k}.")
                if len(out) >= limit:
                    return
            return
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where.removesuffix('.')}[{i}].")
            return
        key = where[:-1]
        if _same_leaf(a, b):
            return
        if isinstance(a, str) and isinstance(b, str) and key.endswith("plan_json"):
            try:
                field = _first_json_path(json.loads(a), json.loads(b), "plan")
            except ValueError:
                field = "plan (not JSON)"
            out.append(f"{key}: {field}; {_first_text_difference(a, b)}")
        else:
            out.append(f"{key}: golden {a!r}, now {b!r}")

    walk(golden.get("format"), current.get("format"), "format.")
    # The public names the golden tree exported must all still be exported; new ones may come.
    missing = sorted(set(golden.get("public_api") or []) - set(current.get("public_api") or []))
    if missing:
        out.append(f"public_api: no longer exported: {missing}")
    gc, cc = golden.get("cases", {}), current.get("cases", {})
    for case in sorted(set(gc) | set(cc)):
        if len(out) >= limit:
            break
        if case not in cc:
            out.append(f"case {case}: missing now")
        elif case not in gc:
            out.append(f"case {case}: new (not in the golden file)")
        else:
            walk(gc[case], cc[case], f"case {case} :: ")
    return out


def canonical(snap: dict[str, Any]) -> dict[str, Any]:
    """``snap`` as it reads back from its JSON file (integer dict keys become strings, tuples lists)."""
    return json.loads(dumps(snap))


def dumps(snap: dict[str, Any]) -> str:
    return json.dumps(snap, sort_keys=True, indent=1) + "\n"


def load_golden(path: Path = GOLDEN) -> dict[str, Any]:
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    snap = snapshot()
    n = len(snap["cases"])
    skipped = sum(1 for c in snap["cases"].values() if "skipped" in c)
    if "--write" in argv:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(dumps(snap))
        print(f"wrote {GOLDEN}: {n} cases ({skipped} skipped) from {Path(tpd.__file__).parent}")
        return 0
    diffs = differences(load_golden(), canonical(snap))
    print(f"{n} cases ({skipped} skipped) from {Path(tpd.__file__).parent}: "
          + ("same as the golden file" if not diffs else f"differs from the golden file:\n  " + "\n  ".join(diffs)))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
