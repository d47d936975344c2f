"""What a finished run leaves behind: plan, profile, trace, timeline, final checkpoint, and the
report (``report.json`` and the lines printed at the end)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .preparation import Prepared

__all__ = ["write_outputs", "format_report"]


def write_outputs(prep: Prepared, result: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write the run's files into ``out`` and return the report (also in ``report.json``)."""
    from ..viz import draw_timeline

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
    plan.save(paths["plan"])
    prep.graph.save(paths["graph"])
    trace = result["trace"]
    trace.save(paths["trace"])
    trace.to_chrome(paths["chrome_trace"])
    draw_timeline(trace, paths["timeline"], title=f"{cfg.model}: {plan.summary}, {cfg.schedule} (last epoch, measured)")
    tmp = paths["checkpoint"].with_suffix(".pt.tmp")
    torch.save({"model": cfg.model, "plan": plan.to_dict(), "state_dict": result["state"],
                "config": asdict(cfg)}, tmp)
    os.replace(tmp, paths["checkpoint"])
    last = result["history"][-1]
    measured_t = last["seconds"] / last["minibatches"]
    report = {
        "config": asdict(cfg),
        "plan": plan.summary,
        "plan_config": plan.config,
        "why": prep.why,
        "measured": {"time_per_minibatch_s": measured_t, "samples_per_s": last["samples_per_s"]},
        "predicted": prep.predicted,
        "final_test_accuracy": last["test_accuracy"],
        "final_test_loss": last["test_loss"],
        "history": result["history"],
        "files": {k: str(v) for k, v in paths.items()},
    }
    paths["report"].write_text(json.dumps(report, indent=1) + "\n")
    return report


def format_report(report: dict[str, Any]) -> str:
    """The human-readable end-of-run report."""
    m, p = report["measured"], report["predicted"]
    acc = report["final_test_accuracy"]
    ratio = p["time_per_minibatch_s"] / m["time_per_minibatch_s"] if m["time_per_minibatch_s"] else float("nan")
    rows = [
        ("plan", f"{report['plan']} ({report['plan_config']}), schedule {report['config']['schedule']}"),
        ("why", report["why"]),
        ("time/minibatch", f"measured {m['time_per_minibatch_s'] * 1e3:.2f} ms, predicted "
                           f"{p['time_per_minibatch_s'] * 1e3:.2f} ms (measured reaches {ratio:.0%} of the predicted "
                           "throughput; last epoch, warm-up and drain included)"),
        ("throughput", f"measured {m['samples_per_s']:.0f} samples/s, predicted {p['samples_per_s']:.0f} samples/s"),
        ("test", f"accuracy {'-' if acc is None else f'{acc:.2%}'}, loss {report['final_test_loss']:.4f}"),
    ]
    for key, label in (("timeline", "timeline"), ("chrome_trace", "trace"), ("checkpoint", "checkpoint"),
                       ("report", "report")):
        rows.append((label, report["files"][key]))
    lines = [f"{label:<15}{text}" for label, text in rows]
    return "\n".join(lines)
