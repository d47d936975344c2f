"""Trace: JSON round trip, Chrome export, summary statistics; timeline pictures."""

from __future__ import annotations

import json

import pytest

from torchpipedream.trace import Event, Trace, TraceFormatError


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
    from torchpipedream.actions import Kind

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
    ],
)
def test_bad_trace_files(tmp_path, content: str, needle: str) -> None:
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(TraceFormatError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        Trace.load(p)
