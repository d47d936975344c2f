"""Side by side on the same machine: torchpipedream against a single process, torch DDP and
torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B, ScheduleInterleavedZeroBubble with one
stage per rank (torch's ZB-H1), ScheduleZBVZeroBubble, ScheduleInterleaved1F1B with two stages
per rank).

Same model, global batch, optimizer (SGD) and number of processes (2 by default, 1 thread
each, gloo) for every row; the rows of one model run in ``--passes`` interleaved passes (row 1,
row 2, ..., row 1, row 2, ...) so that the machine's drift hits every row alike. For each row:
samples/s (median over passes of the median timed window after warm-up), ratio to DDP, ratio to the perfect-scaling
limit (processes × the one-thread single process) and to the side-by-side ceiling (perfect
scaling divided by how much slower that many copies of the model's own training step run side
by side than one alone), the simulator's predicted samples/s for
torchpipedream's rows (predicted afresh in every pass, from a profile and host measurements
taken just before that pass runs the row; measured / predicted is the median over passes of
each run against its own prediction), and peak RSS per rank. A CPU probe (two concurrent single-thread
processes against one) runs at the start and end; if they disagree by more than 15% the run is
flagged and should be repeated. torchpipedream's rows run the model with its wide linear layers
split into column parts (``--split-wide``, layer_split.py: the same function and training) so
that the planner can balance stages inside a layer. Every row, this process's included,
allocates with PyTorch's huge pages (``THP_MEM_ALLOC_ENABLE=1``, huge_pages.py) unless the
environment sets it: ``THP_MEM_ALLOC_ENABLE=0`` runs every row on PyTorch's default. Every row
also keeps freed memory for reuse (freed_memory.py; the launcher's workers, the peers' too, and
this process): ``TORCHPIPEDREAM_KEEP_FREED_MEMORY=0`` runs every row on glibc's defaults.

Fair rows: where ``--split-wide`` splits a layer, the single-process and DDP rows also run the
split model (rows ", split model"), so both forms are reported. Each torch.distributed.pipelining
row first tries 2, 4 and 8 microbatches with the cut balancing parameters and the cut balancing
measured layer times (one short window each) and then runs its fastest (the plan column names
it); ``--no-tune-torch`` gives them ``--microbatches`` and the parameter cut. ``--microbatches 0``
gives each microbatched torchpipedream row the count its planner predicts fastest.

    .venv/bin/python benchmarks/compare.py                       # all models
    .venv/bin/python benchmarks/compare.py --models fc_heavy --windows 3
    .venv/bin/python benchmarks/compare.py --rows "2 threads,InterleavedZeroBubble,flush,zb-h"
    .venv/bin/python benchmarks/compare.py --rows "2 threads,Interleaved1F1B,ZBVZeroBubble,flush,interleaved,zb-v" \
        --out benchmarks/results/compare_virtual
    .venv/bin/python benchmarks/compare.py --microbatches 0 --rows "2 threads,split model,pipelining GPipe,\
pipelining 1F1B,ZBVZeroBubble,=torchpipedream pipedream,=torchpipedream 2bw,=torchpipedream flush,\
=torchpipedream zb-h1,=torchpipedream zb-h2,=torchpipedream auto"   # compare.json (docs/benchmarks.md)

Writes benchmarks/results/compare.json, compare.md and compare.png. The rows themselves are in
compare_rows.py; this script holds the command line, the targets and the tables.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_format import Data, Table, listing, num, span, table, yes  # noqa: E402

#: The targets of issue 7, as compare_targets() tests them.
TARGET_FC_VS_DDP = 1.5
TARGET_FC_PERFECT_SCALING = 0.90
TARGET_PREDICTION = 0.15  # measured / predicted within 1 ± this
TARGET_SYNC_PERFECT_SCALING = 0.70  # issue 22: the best synchronous row on fc_heavy
#: compare.py's torchpipedream rows by semantics: plain training, and 2BW's one-update-stale rule
SYNCHRONOUS_ROWS = ("flush", "flush straight", "gpipe", "zb-h1", "zb-h2", "interleaved", "zb-v")
ONE_STALE_ROWS = ("2bw", "2bw straight", "zb-2bw")


def compare_results(data: Data) -> str:
    """compare.json (benchmarks/compare.py) → its caption line and its table of every row, as
    compare.py writes them to compare.md."""
    probes, rows = data["probes"], data["rows"]
    procs = data["args"]["procs"]
    pages = "huge pages" if data.get("huge_pages") else "PyTorch's default pages"
    freed = " and keeps freed memory for reuse" if data.get("keeps_freed_memory") else ""
    caption = (f"CPU probe (2 concurrent processes / 1): start {probes[0]:.2f}, end {probes[1]:.2f}; "
               f"{procs} processes; every row allocates on {pages}{freed}.")
    head = ["model", "row", "plan", "samples/s", "× DDP", "× perfect scaling", "× side-by-side ceiling", "predicted",
            "measured / predicted", "run's compute / predicted compute", "measured / predicted from the run's compute",
            "peak RSS per rank (MB)"]
    body = []
    for r in rows:
        rss = ", ".join(f"{x:.0f}" for x in r["peak_rss_mb"])
        body.append([r["model"], r["row"], r["plan"] or "-", f"{r['samples_per_s']:.1f}", f"{r['vs_ddp']:.2f}",
                     f"{r['vs_perfect_scaling']:.2f}", f"{r['vs_side_by_side_ceiling']:.2f}",
                     num(r["predicted_samples_per_s"], ".0f"), num(r["measured_vs_predicted"]),
                     num(r["run_compute_vs_profile"]), num(r["measured_vs_run_compute"]), rss])
    return caption + "\n\n" + table(head, body)


def _is_peer(row: str) -> bool:
    """Every row that is not torchpipedream's: DDP, torch.pipelining and the single process
    (its one-thread row is never the best, its two-thread row may be), as given or split."""
    return not row.startswith("torchpipedream")


def _model_rows(data: Data, model: str) -> list[dict]:
    return [r for r in data["rows"] if r["model"] == model and not r.get("failed")]


def _best(rows: list[dict], keep: Callable[[str], bool]) -> dict | None:
    rows = [r for r in rows if keep(r["row"])]
    return max(rows, key=lambda r: r["samples_per_s"]) if rows else None


def _row(rows: list[dict], name: str) -> dict | None:
    return next((r for r in rows if r["row"] == name), None)


def _short(row: str) -> str:
    return row.removeprefix("torchpipedream ")


def _within(data: Data, key: str) -> tuple[int, int, list[float]]:
    """(rows within 1 ± TARGET_PREDICTION, rows with a value, the values) for ``key``."""
    values = [r[key] for r in data["rows"] if r.get(key) is not None]
    ok = [v for v in values if abs(v - 1.0) <= TARGET_PREDICTION]
    return len(ok), len(values), values


def _models(data: Data) -> list[str]:
    return list(dict.fromkeys(r["model"] for r in data["rows"]))



def compare_targets(data: Data) -> str:
    """compare.json → the targets of issue 7 and whether this run meets them."""
    out = []
    fc = _model_rows(data, "fc_heavy")
    best_fc = _best(fc, lambda n: n.startswith("torchpipedream"))
    if best_fc is not None:
        ddp = _row(fc, "torch DDP")
        against = (f", {best_fc['samples_per_s']:.1f} against {ddp['samples_per_s']:.1f} samples/s" if ddp else "")
        out.append([f"fc_heavy: best torchpipedream row ≥ {TARGET_FC_VS_DDP:g}× DDP",
                    f"{best_fc['vs_ddp']:.2f}× ({_short(best_fc['row'])}{against})",
                    yes(best_fc["vs_ddp"] >= TARGET_FC_VS_DDP)])
        ceiling = f"{best_fc['vs_side_by_side_ceiling']:.2f} of the side-by-side ceiling"
        out.append([f"fc_heavy: best torchpipedream row ≥ {TARGET_FC_PERFECT_SCALING:.2f} of perfect scaling",
                    f"{best_fc['vs_perfect_scaling']:.2f} ({_short(best_fc['row'])}); {ceiling}",
                    yes(best_fc["vs_perfect_scaling"] >= TARGET_FC_PERFECT_SCALING)])
    for label, names in (("synchronous (plain training: " + ", ".join(SYNCHRONOUS_ROWS) + ")", SYNCHRONOUS_ROWS),
                         ("one update stale (2BW's rule: " + ", ".join(ONE_STALE_ROWS) + ")", ONE_STALE_ROWS)):
        best = _best(fc, lambda n, names=names: n.removeprefix("torchpipedream ") in names)
        if best is None:
            continue
        out.append([f"fc_heavy: best {label} row ≥ {TARGET_FC_VS_DDP:g}× DDP and ≥ {TARGET_SYNC_PERFECT_SCALING:.2f} "
                    "of perfect scaling (issue 22)",
                    f"{_short(best['row'])} ({best['plan']}): {best['vs_ddp']:.2f}× DDP, "
                    f"{best['vs_perfect_scaling']:.2f} of perfect scaling",
                    f"{yes(best['vs_ddp'] >= TARGET_FC_VS_DDP)}, "
                    f"{yes(best['vs_perfect_scaling'] >= TARGET_SYNC_PERFECT_SCALING)}"])
    parts, all_ok = [], True
    for model in _models(data):
        rows = _model_rows(data, model)
        ours, peer = _best(rows, lambda n: n.startswith("torchpipedream")), _best(rows, _is_peer)
        if ours is None or peer is None:
            continue
        ratio = ours["samples_per_s"] / peer["samples_per_s"]
        all_ok &= ratio >= 1.0
        parts.append(f"{model} {ratio:.2f}× ({_short(ours['row'])} {ours['samples_per_s']:.1f} against "
                     f"{peer['row']} {peer['samples_per_s']:.1f})")
    out.append(["every model: best torchpipedream row ≥ every other row (DDP, torch.pipelining, one process with "
                "several threads; the model as given and split)", "; ".join(parts), yes(all_ok)])
    parts, all_ok = [], True
    for model in _models(data):
        rows = _model_rows(data, model)
        flush, torch_1f1b = _row(rows, "torchpipedream flush"), _row(rows, "torch.pipelining 1F1B")
        if flush is None or torch_1f1b is None:
            continue
        ratio = flush["samples_per_s"] / torch_1f1b["samples_per_s"]
        all_ok &= ratio >= 1.0
        parts.append(f"{model} {ratio:.2f}×")
    out.append(["every model: torchpipedream flush ≥ torch.pipelining 1F1B", ", ".join(parts), yes(all_ok)])
    ok, n, values = _within(data, "measured_vs_predicted")
    passes = [m / p for r in data["rows"] for m, p in zip(r.get("passes_samples_per_s", []),
                                                           r.get("passes_predicted_samples_per_s") or [])]
    inside = sum(abs(v - 1.0) <= TARGET_PREDICTION for v in passes)
    out.append([f"torchpipedream rows: measured within {TARGET_PREDICTION:.0%} of the simulator's prediction, every "
                "pass (the models the cost model was tuned on: held_out.py checks others)",
                f"{inside} of {len(passes)} passes ({span(passes)}); by each row's median over passes {ok} of {n}",
                yes(inside == len(passes))])
    ok, n, values = _within(data, "measured_vs_run_compute")
    out.append(["the same, predicted from the run's own compute (a diagnostic)",
                f"{ok} of {n} rows ({span(values)})", "-"])
    return table(["target", "this run", "result"], out)


def _lm_target(vs_flush: float) -> str:
    return (f"transformer_lm: best synchronous ≥ {TARGET_SYNC_VS_FLUSH_LM:g}× flush "
            f"{yes(vs_flush >= TARGET_SYNC_VS_FLUSH_LM)} ({vs_flush:.2f}×)")


def _targets_vs_torch(model: str, vs_torch: Sequence[tuple[str, float | None]], vs_flush: float | None) -> list[str]:
    """A --rows run's targets for one model: each (label, our row over torch's), and on the LM the
    best synchronous row over flush."""
    out = [f"{model}: {label} {yes(r >= TARGET_ZB_VS_TORCH)} ({r:.2f}×)" for label, r in vs_torch if r is not None]
    if model == "transformer_lm" and vs_flush is not None:
        out.append(_lm_target(vs_flush))
    return out


def _passes_table(data: Data, head: list[str], body: list[list[str]], targets: list[str]) -> str:
    """A --rows run's caption (probes, processes, microbatches, passes), its table and targets."""
    probes = data["probes"]
    caption = (f"CPU probe (2 concurrent processes / 1): start {probes[0]:.2f}, end {probes[1]:.2f}; "
               f"{data['args']['procs']} processes, {data['args']['microbatches']} microbatches, "
               f"{data['args']['passes']} interleaved passes (samples/s: the median; passes in brackets).")
    return caption + "\n\n" + table(head, body) + ("\n\nTargets: " + "; ".join(targets) + "." if targets else "")


def _passes(r: dict | None) -> str:
    """A row's samples/s, each pass's in brackets, and a tuned torch.pipelining row's configuration."""
    if r is None:
        return "-"
    tuned = f" [{r['plan']}]" if r["row"].startswith("torch.pipelining") and r.get("plan") else ""
    return f"{r['samples_per_s']:.1f} ({', '.join(f'{v:.0f}' for v in r.get('passes_samples_per_s', []))}){tuned}"


#: The targets of issue 19 for the zero-bubble rows, as zero_bubble() tests them.
TARGET_ZB_VS_TORCH = 1.0
TARGET_SYNC_VS_FLUSH_LM = 1.15


def zero_bubble(data: Data) -> str:
    """compare_zero_bubble.json (compare.py --rows ...) → per model, zb-h1 against torch's ZB-H1
    (InterleavedZeroBubble, one stage per rank), against flush on the same cut and on the
    planner's own plan, with every pass, and the targets."""
    head = ["model", "zb-h1 samples/s (passes)", "torch ZB-H1 (passes)", "zb-h1 / torch ZB-H1",
            "flush, same cut (passes)", "zb-h1 / flush same cut", "zb-h2 (passes)", "zb-h2 / zb-h1",
            "flush, planner's plan", "best synchronous / flush", "one process, 2 threads",
            "measured / predicted (zb-h1, zb-h2)"]
    body, targets = [], []
    passes = _passes
    for model in _models(data):
        rows = _model_rows(data, model)
        zb, torch_zb = _row(rows, "torchpipedream zb-h1"), _row(rows, "torch.pipelining InterleavedZeroBubble")
        same, flush = _row(rows, "torchpipedream flush straight"), _row(rows, "torchpipedream flush")
        h2, threads = _row(rows, "torchpipedream zb-h2"), _row(rows, "single, 2 threads")
        if zb is None:
            continue
        sync = _best(rows, lambda n: n in ("torchpipedream flush", "torchpipedream flush straight",
                                           "torchpipedream zb-h1", "torchpipedream zb-h2"))
        vs_torch = zb["samples_per_s"] / torch_zb["samples_per_s"] if torch_zb else None
        vs_same = zb["samples_per_s"] / same["samples_per_s"] if same else None
        vs_flush = sync["samples_per_s"] / flush["samples_per_s"] if (sync and flush) else None
        body.append([model, passes(zb), passes(torch_zb), num(vs_torch), passes(same), num(vs_same), passes(h2),
                     num(h2["samples_per_s"] / zb["samples_per_s"] if h2 else None),
                     f"{flush['samples_per_s']:.1f} ({flush['plan']})" if flush else "-",
                     f"{num(vs_flush)} ({_short(sync['row'])})" if vs_flush is not None else "-",
                     f"{threads['samples_per_s']:.1f}" if threads else "-",
                     ", ".join(num(r.get("measured_vs_predicted")) for r in (zb, h2) if r)])
        targets += _targets_vs_torch(model, [("zb-h1 ≥ torch's ZB-H1", vs_torch)], vs_flush)
    return _passes_table(data, head, body, targets)


def virtual_stages(data: Data) -> str:
    """compare_virtual.json (compare.py --rows ...) → per model, interleaved and zb-v (two stages
    per worker) against torch's Interleaved1F1B and ZBVZeroBubble (two stages per rank), against
    flush on a straight cut and on the planner's own plan, with every pass, and the targets."""
    head = ["model", "interleaved (passes)", "torch Interleaved1F1B (passes)", "interleaved / torch",
            "zb-v (passes)", "torch ZBVZeroBubble (passes)", "zb-v / torch", "flush straight (passes)",
            "interleaved, zb-v / flush straight", "flush, planner's plan", "best synchronous / flush",
            "one process, 2 threads", "measured / predicted (interleaved, zb-v)"]
    body, targets = [], []
    for model in _models(data):
        rows = _model_rows(data, model)
        il, torch_il = _row(rows, "torchpipedream interleaved"), _row(rows, "torch.pipelining Interleaved1F1B")
        zbv, torch_zbv = _row(rows, "torchpipedream zb-v"), _row(rows, "torch.pipelining ZBVZeroBubble")
        same, flush = _row(rows, "torchpipedream flush straight"), _row(rows, "torchpipedream flush")
        threads = _row(rows, "single, 2 threads")
        sync = _best(rows, lambda n: n in ("torchpipedream flush", "torchpipedream flush straight",
                                           "torchpipedream interleaved", "torchpipedream zb-v"))

        def ratio(a: dict | None, b: dict | None) -> float | None:
            return a["samples_per_s"] / b["samples_per_s"] if (a and b) else None

        vs_flush = ratio(sync, flush)
        body.append([model, _passes(il), _passes(torch_il), num(ratio(il, torch_il)), _passes(zbv),
                     _passes(torch_zbv), num(ratio(zbv, torch_zbv)), _passes(same),
                     f"{num(ratio(il, same))}, {num(ratio(zbv, same))}",
                     f"{flush['samples_per_s']:.1f} ({flush['plan']})" if flush else "-",
                     f"{num(vs_flush)} ({_short(sync['row'])})" if vs_flush is not None else "-",
                     f"{threads['samples_per_s']:.1f}" if threads else "-",
                     ", ".join(num(r.get("measured_vs_predicted")) for r in (il, zbv) if r)])
        targets += _targets_vs_torch(model, [("interleaved ≥ torch's", ratio(il, torch_il)),
                                             ("zb-v ≥ torch's", ratio(zbv, torch_zbv))], vs_flush)
    return _passes_table(data, head, body, targets)


def async_split(data: Data) -> str:
    """compare_async_split.json (compare.py --rows "2 threads,2bw") → per model, zb-2bw against 2bw
    on the same straight cut and on the planner's own plan, with every pass; no targets (no peer
    has an asynchronous schedule to hold it against)."""
    head = ["model", "zb-2bw samples/s (passes)", "2bw, same cut (passes)", "zb-2bw / 2bw same cut",
            "2bw, planner's plan", "torch DDP", "one process, 2 threads", "measured / predicted (zb-2bw, 2bw same cut)"]
    body = []
    for model in _models(data):
        rows = _model_rows(data, model)
        zb, same, planned = (_row(rows, f"torchpipedream {k}") for k in ("zb-2bw", "2bw straight", "2bw"))
        ddp, threads = _row(rows, "torch DDP"), _row(rows, "single, 2 threads")
        if zb is None:
            continue
        body.append([model, _passes(zb), _passes(same),
                     num(zb["samples_per_s"] / same["samples_per_s"] if same else None),
                     f"{planned['samples_per_s']:.1f} ({planned['plan']})" if planned else "-",
                     f"{ddp['samples_per_s']:.1f}" if ddp else "-",
                     f"{threads['samples_per_s']:.1f}" if threads else "-",
                     ", ".join(num(r.get("measured_vs_predicted")) for r in (zb, same) if r)])
    return _passes_table(data, head, body, [])


#: The targets of issue 22 for the held-out validation, as held_out_results() tests them.


def compare_runs(*runs: Data) -> str:
    """Several compare JSON files (oldest first) → one summary line per run, for the changelog."""
    body = []
    for data in runs:
        fc = _model_rows(data, "fc_heavy")
        pd = _row(fc, "torchpipedream pipedream")
        flush = []
        for model in _models(data):
            rows = _model_rows(data, model)
            f, t = _row(rows, "torchpipedream flush"), _row(rows, "torch.pipelining 1F1B")
            flush.append(f"{f['samples_per_s'] / t['samples_per_s']:.2f}" if f and t else "-")
        ok, n, values = _within(data, "measured_vs_predicted")
        ok_c, n_c, values_c = _within(data, "measured_vs_run_compute")
        body.append([data["_file"], f"{data['probes'][0]:.2f} → {data['probes'][1]:.2f}",
                     "yes" if data.get("keeps_freed_memory") else "no",
                     num(pd and pd["vs_ddp"]), num(pd and pd["vs_perfect_scaling"]),
                     num(pd and pd["vs_side_by_side_ceiling"]), " / ".join(flush),
                     f"{ok} of {n} ({span(values)})", f"{ok_c} of {n_c} ({span(values_c)})"])
    head = ["results file", "CPU probes", "freed memory kept", "fc_heavy pipedream × DDP", "× perfect scaling",
            "× side-by-side ceiling", "flush ÷ torch 1F1B (fc_heavy / small_cnn / transformer_lm)",
            "measured within 15% of predicted", "within 15% from the run's own compute"]
    return table(head, body)


# ----------------------------------------------------------------------------- what the docs show
TABLES = {
    "compare_results": Table(("compare.json",), compare_results),
    "compare_targets": Table(("compare.json",), compare_targets),
    "compare_runs": Table(("compare_run11.json", "compare_run12.json", "compare_run13.json"), compare_runs),
    "zero_bubble": Table(("compare_zero_bubble.json",), zero_bubble),
    "zero_bubble_fc_m2": Table(("compare_zero_bubble_fc_m2.json",), zero_bubble),
    "virtual_stages": Table(("compare_virtual.json",), virtual_stages),
    "async_split": Table(("compare_async_split.json",), async_split),
}
#: The markdown files main() writes next to the JSON (write_results), by file.
COMPANIONS = {md: Table((md.replace(".md", ".json"),), compare_results) for md in (
    "compare.md", "compare_run11.md", "compare_run12.md", "compare_zero_bubble.md", "compare_zero_bubble_fc_m2.md",
    "compare_virtual.md", "compare_async_split.md")}


# ----------------------------------------------------------------------------- numbers the docs' prose quotes
TPD = "torchpipedream "


def _pick(data: Data, model: str, row: str) -> dict:
    found = _row(_model_rows(data, model), row)
    if found is None:
        raise KeyError(f"{data['_file']}: no row {row!r} of {model}")
    return found


def _cell(source: str, model: str, row: str, key: str, spec: str = ".2f") -> Table:
    """A value: one field of one row of ``source``."""
    return Table((source,), lambda d: format(_pick(d, model, row)[key], spec))


def _ratios(source: str, pairs: Sequence[tuple[str, str, str]], joined: bool = False) -> Table:
    """A value: samples/s of row a over row b for each (model, a, b) of ``pairs``: their range,
    or with ``joined`` each one ("1.10×, 1.54× and 1.05×")."""
    def render(d: Data) -> str:
        got = [_pick(d, m, a)["samples_per_s"] / _pick(d, m, b)["samples_per_s"] for m, a, b in pairs]
        return listing([f"{x:.2f}×" for x in got]) if joined else span(got)
    return Table((source,), render)


def _predicted(source: str, rows: Sequence[str], models: Sequence[str] | None = None) -> Table:
    """A value: the range of measured / predicted over ``rows`` of ``models`` (default all)."""
    def render(d: Data) -> str:
        return span([_pick(d, m, r)["measured_vs_predicted"] for m in models or _models(d) for r in rows])
    return Table((source,), render)


def _faster_than_two_threads(source: str) -> Table:
    """A value: per model, the two-process rows faster than one process with two threads."""
    def render(d: Data) -> str:
        parts = []
        for model in _models(d):
            rows = _model_rows(d, model)
            threads = _pick(d, model, "single, 2 threads")["samples_per_s"]
            faster = [_short(r["row"]) for r in rows if r["samples_per_s"] > threads and _is_two_process(r)]
            parts.append(f"{model}: {listing(faster) if faster else 'none'}")
        return "; ".join(parts)
    return Table((source,), render)


def _fastest_two_process(source: str) -> Table:
    """A value: per model, the fastest row of two processes."""
    def render(d: Data) -> str:
        best = (max((r for r in _model_rows(d, m) if _is_two_process(r)), key=lambda r: r["samples_per_s"])
                for m in _models(d))
        return "; ".join(f"{r['model']}: {_short(r['row'])}" for r in best)
    return Table((source,), render)


def _is_two_process(r: dict) -> bool:
    return not r["row"].startswith("single") and not r["plan"].startswith("single worker")


def _auto_vs_two_threads(d: Data) -> str:
    parts = []
    for model in _models(d):
        auto = _pick(d, model, TPD + "auto")
        ratio = auto["samples_per_s"] / _pick(d, model, "single, 2 threads")["samples_per_s"]
        parts.append(f"{model} {ratio:.2f} ({auto['plan']})")
    return "; ".join(parts)


def _split_model_vs_given(d: Data) -> str:
    rows = ("single, 1 thread", "single, 2 threads", "torch DDP")
    speed = {r["row"]: r["samples_per_s"] for r in _model_rows(d, "fc_heavy")}
    return listing([f"{speed[r + ', split model'] / speed[r]:.2f}" for r in rows])


def _fc_heavy_ceiling(d: Data) -> str:
    return f"{1 / _pick(d, 'fc_heavy', TPD + 'pipedream')['side_by_side_slowdown']:.2f}"


def _fc_m2_targets(d: Data) -> str:
    ddp, scaling = (_pick(d, "fc_heavy", TPD + "zb-h1")[k] for k in ("vs_ddp", "vs_perfect_scaling"))
    ok = yes(scaling >= TARGET_SYNC_PERFECT_SCALING)
    return (f"{ddp:.2f}× DDP (target ≥ {TARGET_FC_VS_DDP:g}×: {yes(ddp >= TARGET_FC_VS_DDP)}) and {scaling:.2f} of "
            f"perfect scaling (target ≥ {TARGET_SYNC_PERFECT_SCALING:.2f}: {ok})")


def _virtual_vs_torch_met(d: Data) -> str:
    pairs = [(m, TPD + ours, "torch.pipelining " + theirs) for m in _models(d)
             for ours, theirs in (("interleaved", "Interleaved1F1B"), ("zb-v", "ZBVZeroBubble"))]
    speed = {(r["model"], r["row"]): r["samples_per_s"] for r in d["rows"]}
    met = [speed[(m, a)] / speed[(m, b)] >= TARGET_ZB_VS_TORCH for m, a, b in pairs]
    return f"{sum(met)} of {len(met)}"


MODELS = ("fc_heavy", "small_cnn", "transformer_lm")
ZB, VIRTUAL, ASYNC = "compare_zero_bubble.json", "compare_virtual.json", "compare_async_split.json"
VALUES = {
    # compare.json
    "fc_heavy_side_by_side_slowdown": _cell("compare.json", "fc_heavy", TPD + "pipedream", "side_by_side_slowdown",
                                            ".3f"),
    "fc_heavy_side_by_side_ceiling": Table(("compare.json",), _fc_heavy_ceiling),
    "fc_heavy_pipelines_vs_ceiling": Table(("compare.json",), lambda d: listing(sorted({
        f"{_pick(d, 'fc_heavy', TPD + r)['vs_side_by_side_ceiling']:.2f}" for r in ("pipedream", "2bw")}))),
    "fc_heavy_split_model_vs_given": Table(("compare.json",), _split_model_vs_given),
    "fc_heavy_2bw_plan": _cell("compare.json", "fc_heavy", TPD + "2bw", "plan", ""),
    "fc_heavy_2bw_perfect_scaling": _cell("compare.json", "fc_heavy", TPD + "2bw", "vs_perfect_scaling"),
    "fc_heavy_flush_plan": _cell("compare.json", "fc_heavy", TPD + "flush", "plan", ""),
    "fc_heavy_flush_perfect_scaling": _cell("compare.json", "fc_heavy", TPD + "flush", "vs_perfect_scaling"),
    "faster_than_two_threads": _faster_than_two_threads("compare.json"),
    "auto_vs_two_threads": Table(("compare.json",), _auto_vs_two_threads),
    "fc_heavy_zb_h1_plan": _cell("compare.json", "fc_heavy", TPD + "zb-h1", "plan", ""),
    "fc_heavy_zb_h2_plan": _cell("compare.json", "fc_heavy", TPD + "zb-h2", "plan", ""),
    "fc_heavy_zb_h1_compute": _cell("compare.json", "fc_heavy", TPD + "zb-h1", "run_compute_vs_profile"),
    "fc_heavy_zb_h1_schedule": _cell("compare.json", "fc_heavy", TPD + "zb-h1", "measured_vs_run_compute"),
    "lm_2bw_compute": _cell("compare.json", "transformer_lm", TPD + "2bw", "run_compute_vs_profile"),
    "lm_2bw_schedule": _cell("compare.json", "transformer_lm", TPD + "2bw", "measured_vs_run_compute"),
    # compare_zero_bubble.json, compare_zero_bubble_fc_m2.json
    "zb_h2_vs_torch_zb_h1": _ratios(ZB, [(m, TPD + "zb-h2", "torch.pipelining InterleavedZeroBubble") for m in MODELS],
                                    joined=True),
    "zb_h1_vs_flush_straight": _ratios(ZB, [(m, TPD + "zb-h1", TPD + "flush straight") for m in MODELS]),
    "zb_h2_vs_zb_h1": _ratios(ZB, [(m, TPD + "zb-h2", TPD + "zb-h1") for m in MODELS]),
    "zb_faster_than_two_threads": _faster_than_two_threads(ZB),
    "zb_predicted": _predicted(ZB, (TPD + "zb-h1", TPD + "zb-h2")),
    "zb_lm_predicted": _predicted(ZB, (TPD + "zb-h1", TPD + "zb-h2"), ("transformer_lm",)),
    "zb_lm_flush_predicted": _predicted(ZB, (TPD + "flush", TPD + "flush straight"), ("transformer_lm",)),
    "fc_m2_zb_h1_targets": Table(("compare_zero_bubble_fc_m2.json",), _fc_m2_targets),
    "fc_m2_two_threads": _cell("compare_zero_bubble_fc_m2.json", "fc_heavy", "single, 2 threads", "samples_per_s",
                               ".1f"),
    # compare_virtual.json
    "virtual_vs_torch_met": Table((VIRTUAL,), _virtual_vs_torch_met),
    "cnn_virtual_flush_straight": _cell(VIRTUAL, "small_cnn", TPD + "flush straight", "samples_per_s", ".1f"),
    "cnn_virtual_flush": _cell(VIRTUAL, "small_cnn", TPD + "flush", "samples_per_s", ".1f"),
    "fc_heavy_zb_v_vs_flush": _ratios(VIRTUAL, [("fc_heavy", TPD + "zb-v", TPD + "flush")], joined=True),
    "fc_heavy_zb_v_vs_ddp": _cell(VIRTUAL, "fc_heavy", TPD + "zb-v", "vs_ddp"),
    "fc_heavy_zb_v_perfect_scaling": _cell(VIRTUAL, "fc_heavy", TPD + "zb-v", "vs_perfect_scaling"),
    "fc_heavy_virtual_two_threads": _cell(VIRTUAL, "fc_heavy", "single, 2 threads", "samples_per_s", ".1f"),
    "virtual_predicted": _predicted(VIRTUAL, (TPD + "interleaved", TPD + "zb-v")),
    "lm_zb_v_predicted": _cell(VIRTUAL, "transformer_lm", TPD + "zb-v", "measured_vs_predicted"),
    # compare_async_split.json
    "zb_2bw_vs_2bw_straight": _ratios(ASYNC, [(m, TPD + "zb-2bw", TPD + "2bw straight") for m in MODELS], joined=True),
    "lm_zb_2bw_predicted_samples": _cell(ASYNC, "transformer_lm", TPD + "zb-2bw", "predicted_samples_per_s", ".0f"),
    "lm_2bw_straight_predicted_samples": _cell(ASYNC, "transformer_lm", TPD + "2bw straight", "predicted_samples_per_s",
                                               ".0f"),
    "zb_2bw_vs_ddp": Table((ASYNC,),
                           lambda d: listing([f"{_pick(d, m, TPD + 'zb-2bw')['vs_ddp']:.2f}×" for m in MODELS])),
    "async_faster_than_two_threads": _faster_than_two_threads(ASYNC),
    "async_fastest_two_process": _fastest_two_process(ASYNC),
}


# ----------------------------------------------------------------------------- the run
def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        sub = [r for r in rows if r["model"] == m]
        colours = ["#4a90d9" if r["row"].startswith("torchpipedream") else "#999999" for r in sub]
        ax.barh([r["row"] for r in sub], [r["vs_ddp"] for r in sub], color=colours)
        ax.axvline(1.0, color="black", lw=0.8, ls=":")
        ax.set_title(m)
        ax.set_xlabel("samples/s relative to torch DDP")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    import compare_rows  # sets this process's allocator up before it imports torch
    from peers import probed, write_results

    workloads = compare_rows.WORKLOADS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(workloads))
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4,
                    help="microbatches per minibatch of torchpipedream's microbatched rows; 0: each row's count the "
                         "planner predicts fastest of 1, 2, 4 and 8")
    ap.add_argument("--windows", type=int, default=3, help="timed windows per row and pass")
    ap.add_argument("--passes", type=int, default=3,
                    help="interleaved passes over all rows of a model (3: the median rejects one slow pass)")
    ap.add_argument("--per-window", type=int, default=32,
                    help="minibatches per torchpipedream schedule (fit() runs an epoch as one schedule; a window "
                         "pays one fill and drain)")
    ap.add_argument("--split-wide", type=int, default=4, metavar="PARTS",
                    help="torchpipedream rows: split linear layers with >= 1024 outputs into PARTS column parts so "
                         "stages can balance (1 = off; default 4)")
    ap.add_argument("--rows", default="",
                    help="comma-separated parts of row names to run (e.g. 'flush,zb-h1,ZeroBubble'), or =NAME for "
                         "exactly that row ('=torchpipedream 2bw'); the single 1-thread and DDP rows always run "
                         "(default: every row)")
    ap.add_argument("--no-tune-torch", dest="tune_torch", action="store_false",
                    help="torch.pipelining rows: --microbatches and the parameter-balanced cut instead of their best "
                         "of 2, 4 and 8 microbatches with each cut (peers.CUTS)")
    ap.add_argument("--out", default="benchmarks/results/compare")
    args = ap.parse_args(argv)
    for name in args.models.split(","):
        if name not in workloads:
            ap.error(f"unknown model {name!r}; choose from {', '.join(workloads)}")
    rows, probes, _ = probed(lambda: [row for name in args.models.split(",") for row in compare_rows.compare_model(
        workloads[name], args.procs, args.microbatches, args.windows, args.per_window, args.split_wide, args.passes,
        tuple(r for r in args.rows.split(",") if r), args.tune_torch)])
    result = {"probes": probes, "args": vars(args), "huge_pages": compare_rows.huge_pages_on(),
              "keeps_freed_memory": compare_rows.KEEPS_FREED_MEMORY, "rows": rows}
    # the same function renders docs/benchmarks.md's table (TABLES)
    write_results(args.out, result, compare_results(result))
    _plot(rows, Path(f"{args.out}.png"))
    print(f"wrote {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
