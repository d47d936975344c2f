"""Trace: JSON round trip, Chrome export, summary statistics; timeline pictures."""

from __future__ import annotations

import json

import pytest

from torchpipedream.sim.trace import Event, Trace, TraceFormatError


def _two_rank_trace() -> Trace:
    # rank 0: F 0..1, B 3..5 ; rank 1: F 1..2, B 2..3 ; a send on rank 0 1..1.5
    return Trace(
        [
            Event(0, 0, "F", 0, 0.0, 1.0, action="s0F0v0", version=0),
            Event(0, 0, "SA", 0, 1.0, 1.5, bytes=100, action="s0SA0@1"),
            Event(1, 1, "F", 0, 1.5, 2.0, action="s1F0v0", version=0),
            Event(1, 1, "B", 0, 2.0, 3.0, action="s1B0v0", version=0),
            Event(0, 0, "B", 0, 3.0, 5.0, action="s0B0v0", version=0),
        ],
        meta={"source": "test", "minibatches": 1, "samples_per_minibatch": 10},
    )


def test_summary_stats_by_hand() -> None:
    t = _two_rank_trace()
    assert t.makespan == pytest.approx(5.0)
    busy = t.busy_time()
    assert busy[0] == pytest.approx(3.0)  # the send does not count as busy
    assert busy[1] == pytest.approx(1.5)
    assert t.utilisation()[1] == pytest.approx(0.3)
    assert t.bubble_fraction() == pytest.approx(1 - 4.5 / 10)
    s = t.summary()
    assert s["samples_per_s"] == pytest.approx(2.0)
    assert s["events"]["F"] == 2


def test_overlapping_events_counted_once() -> None:
    t = Trace([Event(0, 0, "F", 0, 0.0, 2.0), Event(0, 0, "B", 0, 1.0, 3.0), Event(0, 0, "F", 1, 5.0, 6.0)])
    assert t.busy_time()[0] == pytest.approx(4.0)


def test_json_round_trip(tmp_path) -> None:
    t = _two_rank_trace()
    p = tmp_path / "t.json"
    t.save(p)
    back = Trace.load(p)
    assert back.events == t.events
    assert back.meta == t.meta


def test_kind_enum_accepted() -> None:
    from torchpipedream.schedule.actions import Kind

    assert Event(0, 0, Kind.FORWARD, 0, 0.0, 1.0).kind == "F"


def test_chrome_export(tmp_path) -> None:
    t = _two_rank_trace()
    p = tmp_path / "c.json"
    t.to_chrome(p)
    data = json.loads(p.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 5
    b0 = next(e for e in xs if e["name"] == "s0B0v0")
    assert b0["pid"] == 0 and b0["ts"] == pytest.approx(3e6) and b0["dur"] == pytest.approx(2e6)
    sa = next(e for e in xs if e["name"] == "s0SA0@1")
    assert sa["tid"] != b0["tid"] and sa["args"]["bytes"] == 100
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0 (stage 0)", "rank 1 (stage 1)"}


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{", "invalid JSON"),
        ('{"format": "other"}', "not a torchpipedream trace"),
        ('{"format": "torchpipedream.Trace", "format_version": 1, "events": [{"rank": 0}]}', "events[0]"),
        (
            '{"format": "torchpipedream.Trace", "format_version": 1, "events": [{"rank": 0, "stage": 0, '
            '"kind": "X", "id": 0, "start_s": 0, "end_s": 1}]}',
            "unknown kind",
        ),
        (
            '{"format": "torchpipedream.Trace", "format_version": 1, "events": [{"rank": 0, "stage": 0, '
            '"kind": "F", "id": 0, "start_s": 2, "end_s": 1}]}',
            "end_s >= start_s",
        ),
        (
            '{"format": "torchpipedream.Trace", "format_version": 1, "events": [{"rank": "0", "stage": 0, '
            '"kind": "F", "id": 0, "start_s": 0, "end_s": 1}]}',
            "rank must be integers",
        ),
    ],
)
def test_bad_trace_files(tmp_path, content: str, needle: str) -> None:
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(TraceFormatError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        Trace.load(p)


# --------------------------------------------------------------------------- pictures and CLI
def _simulated(kind: str = "pipedream", **kw):
    from torchpipedream.plans.plan import Plan
    from torchpipedream.schedule.build import build_schedule
    from torchpipedream.sim.simulator import Costs, simulate

    plan = Plan.straight([["a"], ["b"], ["c"]])
    sched = build_schedule(plan, kind, minibatches=4, **kw)
    return simulate(sched, Costs(forward_s=[0.01] * 3, backward_s=[0.02] * 3, output_bytes=[1e5, 1e5, 0], bandwidth_Bps=1e8))


def test_draw_timeline_png_and_svg(tmp_path) -> None:
    from torchpipedream.sim.draw import draw_timeline

    res = _simulated()
    png = draw_timeline(res.trace, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = draw_timeline(res.trace, tmp_path / "t.svg", title="my title")
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "my title" in text


def test_gantt_draws_a_numbered_box_per_compute_event() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torchpipedream.sim.draw import COLOURS, _plot

    res = _simulated()
    fig, ax = plt.subplots()
    _plot(ax, res.trace, "t", 1.0, "s")
    boxes = {"F": 0, "B": 0}
    for coll in ax.collections:
        colour = matplotlib.colors.to_hex(coll.get_facecolor()[0])
        for k in boxes:
            if colour == COLOURS[k].lower():
                boxes[k] += len(coll.get_paths())
    assert boxes == {"F": 12, "B": 12}  # 3 stages × 4 minibatches
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(str(i) for i in range(4) for _ in range(6))
    sends = [c for c in ax.collections if matplotlib.colors.to_hex(c.get_facecolor()[0]) == COLOURS["SA"].lower()]
    assert sum(len(c.get_paths()) for c in sends) == 8  # 2 boundaries × 4 minibatches
    plt.close(fig)


def test_draw_timelines_stacks_panels(tmp_path) -> None:
    from matplotlib import image

    from torchpipedream.sim.draw import draw_timelines

    one = draw_timelines([("a", _simulated().trace)], tmp_path / "one.png")
    two = draw_timelines([("a", _simulated().trace), ("b", _simulated("gpipe", microbatches=2).trace)], tmp_path / "two.png")
    assert image.imread(two).shape[0] > image.imread(one).shape[0]


def test_viz_errors(tmp_path) -> None:
    from torchpipedream.sim.draw import VizError, draw_timeline

    res = _simulated()
    with pytest.raises(VizError, match="suffix"):
        draw_timeline(res.trace, tmp_path / "t.jpg2")
    with pytest.raises(VizError, match="does not exist"):
        draw_timeline(res.trace, tmp_path / "missing" / "t.png")
    with pytest.raises(VizError, match="no events"):
        draw_timeline(Trace([]), tmp_path / "t.png")


def _plan_file(tmp_path, **kw):
    from torchpipedream.plans.plan import Plan

    plan = Plan.straight([["a"], ["b"], ["c"], ["d"]], batch_size=16, microbatches=4, **kw)
    for st in plan.stages:
        st.forward_ms, st.backward_ms, st.output_bytes, st.parameter_bytes = 1.0, 2.0, 1000, 10_000
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def test_cli_simulate_all_and_timeline(tmp_path, capsys) -> None:
    from torchpipedream.cli import main

    plan = _plan_file(tmp_path)
    rc = main(["simulate", str(plan), "--schedule", "all", "--minibatches", "8",
               "--trace", str(tmp_path / "tr.json"), "--timeline", str(tmp_path / "all.png")])
    out = capsys.readouterr().out
    assert rc == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in
            ("pipedream", "2bw", "flush", "gpipe", "naive")}
    assert set(rows) == {"pipedream", "2bw", "flush", "gpipe", "naive"}
    assert "42.9%" in rows["flush"]  # (p−1)/(m+p−1) = 3/7 with 4 stages, 4 microbatches (tiny comm)
    assert (tmp_path / "all.png").exists()
    trace = Trace.load(tmp_path / "tr.gpipe.json")
    assert trace.meta["schedule"] == "gpipe" and len([e for e in trace.events if e.kind == "F"]) == 4 * 32
    rc = main(["timeline", str(tmp_path / "tr.pipedream.json"), "--out", str(tmp_path / "pd.svg"),
               "--chrome", str(tmp_path / "c.json")])
    assert rc == 0 and (tmp_path / "pd.svg").exists()
    rc = main(["timeline", str(tmp_path / "tr.pipedream.json"), str(tmp_path / "tr.flush.json"),
               "--out", str(tmp_path / "two.png")])
    assert rc == 0 and (tmp_path / "two.png").exists()
    assert json.loads((tmp_path / "c.json").read_text())["traceEvents"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["simulate", "PLAN", "--schedule", "zigzag"], "--schedule 'zigzag'"),
        (["simulate", "PLAN", "--minibatches", "0"], "--minibatches must be a positive"),
        (["simulate", "PLAN", "--timeline", "x.bmp"], "--timeline x.bmp"),
        (["simulate", "NOPE.json"], "no such file"),
        (["timeline", "NOPE.json", "--out", "x.png"], "no such file"),
        (["timeline", "PLAN", "--out", "x.png"], "not a torchpipedream trace"),
        (["timeline", "PLAN"], "nothing to do"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, argv, needle) -> None:
    from torchpipedream.cli import main

    plan = _plan_file(tmp_path)
    argv = [str(plan) if a == "PLAN" else str(tmp_path / a) if a.startswith("NOPE") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_cli_simulate_plan_without_costs(tmp_path, capsys) -> None:
    from torchpipedream.cli import main
    from torchpipedream.plans.plan import Plan

    path = tmp_path / "p.json"
    Plan.straight([["a"], ["b"]]).save(path)
    assert main(["simulate", str(path)]) == 2
    assert "no compute costs" in capsys.readouterr().err


def test_readme_schedules_figure(tmp_path) -> None:
    from matplotlib import image

    from torchpipedream.sim.draw import schedules_figure

    out = schedules_figure(tmp_path / "s.png")
    h, w = image.imread(out).shape[:2]
    assert w > 1500 and h > 1000


def test_cli_rejects_hand_edited_schedule_with_grid(tmp_path, capsys) -> None:
    from torchpipedream.cli import main

    plan = _plan_file(tmp_path)
    sched = tmp_path / "s.json"
    assert main(["simulate", str(plan), "--schedule", "flush", "--minibatches", "2", "--save-schedule", str(sched)]) == 0
    capsys.readouterr()
    data = json.loads(sched.read_text())
    assert main(["simulate", str(sched)]) == 0  # unedited: validates and simulates
    assert "flush" in capsys.readouterr().out
    # stage 2 waits for microbatch 1's activations before microbatch 0's: FIFO order broken
    data["actions"]["2"] = data["actions"]["2"].replace("s2RA0@1", "TMP").replace("s2RA1@1", "s2RA0@1").replace("TMP", "s2RA1@1")
    sched.write_text(json.dumps(data))
    assert main(["simulate", str(sched)]) == 2
    err = capsys.readouterr().err
    assert "forward before its activations arrived" in err and ">>s2F0v0<<" in err and "rank 3" in err
