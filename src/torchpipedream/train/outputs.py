"""What a finished run leaves behind: plan, profile, trace, timeline, final checkpoint, and the
report (``report.json`` and the lines printed at the end).

Every file is written to a temporary name and renamed into place, so a failure (a full disk)
leaves the previous file or none, never half of one, and is one line naming the file. The
final checkpoint of the run holds what the outputs are made of (weights, history, the last
epoch's trace), so ``train --resume`` with the same options writes them again
(:func:`outputs_from_checkpoint`). ``report.json`` is strict JSON: a loss that is not a
number (a diverged run) is written as ``null``.
"""

from __future__ import annotations

import io
import json
import math
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..runtime import checkpoint
from ..runtime.checkpoint import read_extra, read_stage_states
from ..sim.draw import draw_timeline
from ..sim.trace import Trace
from ..util.units import human_bytes
from ..search.auto import auto_summary_lines, threads_per_worker
from .resume import plan_side_text
from .config import TrainError, schedule_of
from .preparation import Prepared
from .time_split import split_lines, split_of

__all__ = ["write_outputs", "format_report", "outputs_from_checkpoint", "strict_json"]


def strict_json(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _write(path: Path, data: bytes) -> None:
    try:
        checkpoint.write_atomic(path, data)  # looked up when called (tests fill the disk through it)
    except OSError as exc:
        raise TrainError(f"cannot write the run's outputs: {exc.strerror or exc}; free space and run the same "
                         "command with --resume to write them again from the last checkpoint") from None


def outputs_from_checkpoint(directory: str | Path) -> dict[str, Any]:
    """The training result (history, trace, full state) a run's final checkpoint holds."""
    extra = read_extra(directory)
    if not extra.get("trace"):
        raise TrainError(f"--resume: the checkpoint {directory} ends the run but holds no trace to write the "
                         "outputs from (it was written by an older version)")
    return {"history": list(extra["history"]), "trace": Trace.from_dict(extra["trace"], source=str(directory)),
            "state": read_stage_states(directory)}


def write_outputs(prep: Prepared, result: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write the run's files into ``out`` and return the report (also in ``report.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg, plan = prep.config, prep.plan
    paths = {
        "plan": out / "plan.json",
        "graph": out / "graph.json",
        "trace": out / "trace.json",
        "chrome_trace": out / "trace.chrome.json",
        "timeline": out / "timeline.png",
        "checkpoint": out / "checkpoint.pt",
        "report": out / "report.json",
    }
    trace: Trace = result["trace"]
    _write(paths["plan"], (json.dumps(plan.to_dict(), indent=1) + "\n").encode())
    _write(paths["graph"], (json.dumps(prep.graph.to_dict(), indent=1) + "\n").encode())
    _write(paths["trace"], (json.dumps(trace.to_dict(), indent=1) + "\n").encode())
    _write(paths["chrome_trace"], json.dumps(trace.to_chrome_dict()).encode())
    with tempfile.TemporaryDirectory(dir=out) as tmp:  # matplotlib writes a file; then moved in whole
        picture = Path(tmp) / "timeline.png"
        draw_timeline(trace, picture, title=f"{cfg.model}: {plan.summary}, {plan.schedule} (last epoch, measured)")
        _write(paths["timeline"], picture.read_bytes())
    buf = io.BytesIO()
    torch.save({"model": cfg.model, "plan": plan.to_dict(), "state_dict": result["state"],
                "config": asdict(cfg)}, buf)
    _write(paths["checkpoint"], buf.getvalue())
    last = result["history"][-1]
    measured_t = last["seconds"] / last["minibatches"]
    report = strict_json({
        "config": asdict(cfg),
        "plan": plan.summary,
        "plan_config": plan.config,
        # what trained (--schedule auto: the chosen kind and microbatches)
        "schedule": schedule_of(cfg, plan)[0],
        "microbatches": schedule_of(cfg, plan)[1],
        # torch threads each worker ran with (--schedule auto on local cores may choose several)
        "threads_per_worker": result.get("threads") or threads_per_worker(plan),
        # --schedule auto: the choice, the runner-up and every candidate with its prediction
        "auto": plan.meta.get("auto"),
        "why": prep.why,
        # parameters several stages hold a copy of (a tied embedding and output layer)
        "shared_parameters": [{"name": t.name, "stages": t.stages, "bytes": t.bytes, "layers": t.layers}
                              for t in plan.tied],
        # every resumption onto another plan: when (epoch, minibatch), from, to and why
        "plan_changes": list(prep.plan_changes),
        "measured": {"time_per_minibatch_s": measured_t, "samples_per_s": last["samples_per_s"]},
        # per stage: the memory model's peak per worker, and with --measure-memory the measured one
        "memory": stage_memory(plan, result.get("memory_peak_bytes")),
        # --precision fp16: the loss scale at the end and the updates skipped (float16 overflowed)
        "loss_scaling": result.get("loss_scaling"),
        "predicted": {k: v for k, v in prep.predicted.items() if k != "time_split"},
        # per rank: compute, communication and outside actions, per minibatch; per stage and pass
        "time_split": {"measured": split_of(trace, last["minibatches"]),
                       "predicted": prep.predicted.get("time_split")},
        "final_test_accuracy": last["test_accuracy"],
        "final_test_loss": last["test_loss"],
        "history": result["history"],
        "files": {k: str(v) for k, v in paths.items()},
    })
    _write(paths["report"], (json.dumps(report, indent=1, allow_nan=False) + "\n").encode())
    return report


def stage_memory(plan: Any, peaks: list[int | None] | None) -> list[dict[str, Any]]:
    """Per stage: the predicted peak of one worker and, when measured (``--measure-memory``), the
    largest measured peak among the stage's ranks."""
    rows = []
    for s, st in enumerate(plan.stages):
        measured = [peaks[r] for r in st.ranks if peaks and r < len(peaks) and peaks[r] is not None]
        rows.append({"stage": s, "ranks": list(st.ranks), "predicted_bytes": st.memory_bytes,
                     "measured_bytes": max(measured) if measured else None})
    return rows


def _number(value: Any, scale: float = 1.0, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value * scale, spec)


def format_report(report: dict[str, Any]) -> str:
    """The human-readable end-of-run report (numbers that are not numbers print as "-")."""
    m, p = report["measured"], report["predicted"]
    acc = report["final_test_accuracy"]
    measured_t, predicted_t = m["time_per_minibatch_s"], p.get("time_per_minibatch_s")
    ratio = predicted_t / measured_t if measured_t and predicted_t is not None else None
    rows = [
        ("plan", f"{report['plan']} ({report['plan_config']}), schedule {report.get('schedule', report['config']['schedule'])}"
                 + (f", {report['microbatches']} microbatches" if report.get("microbatches", 1) > 1 else "")
                 + (f", {report['threads_per_worker']} threads per worker" if report.get("threads_per_worker", 1) > 1
                    else "")),
        *[("auto", line) for line in auto_summary_lines(report.get("auto"))],
        ("why", report["why"]),
        *[("shared", f"{t['name']} (layers {', '.join(t['layers']) or '-'}): a copy in stages "
                     f"{', '.join(map(str, t['stages']))}, gradients summed once per update")
          for t in report.get("shared_parameters", [])],
        *[("plan change", f"at epoch {c['epoch']}{' + ' + str(c['minibatch']) + ' minibatches' if c['minibatch'] else ''}"
                          f": {plan_side_text(c, 'from')} -> {plan_side_text(c, 'to')}, because "
                          f"{'; '.join(c['because'])}") for c in report.get("plan_changes", [])],
        ("time/minibatch", f"measured {_number(measured_t, 1e3)} ms, predicted {_number(predicted_t, 1e3)} ms "
                           f"(measured reaches {_number(ratio, 1, '.0%')} of the predicted throughput; last epoch, "
                           "warm-up and drain included)"),
        ("throughput", f"measured {_number(m['samples_per_s'], 1, '.0f')} samples/s, predicted "
                       f"{_number(p.get('samples_per_s'), 1, '.0f')} samples/s"),
        *split_lines(report.get("time_split"), ratio),
        *[("memory", f"stage {m['stage']}: predicted {human_bytes(m['predicted_bytes'])}"
                     + (f", measured {human_bytes(m['measured_bytes'])} "
                        f"({m['measured_bytes'] / m['predicted_bytes']:.2f} of predicted)"
                        if m.get("measured_bytes") and m["predicted_bytes"] else ""))
          for m in report.get("memory", [])],
        *[("loss scale", f"{s['scale']:g} at the end; {s['skipped_updates']} update(s) skipped because "
                         "float16 gradients overflowed") for s in [report.get("loss_scaling")] if s],
        ("test", f"accuracy {_number(acc, 1, '.2%')}, loss "
                 f"{_number(report['final_test_loss'], 1, '.4f', 'not a number (the run diverged)')}"),
    ]
    for key, label in (("timeline", "timeline"), ("chrome_trace", "trace"), ("checkpoint", "checkpoint"),
                       ("report", "report")):
        rows.append((label, report["files"][key]))
    return "\n".join(f"{label:<15}{text}" for label, text in rows)
