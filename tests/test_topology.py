"""Topology: spec parsing, presets, rank-to-rank bandwidth, JSON round trips, errors."""

from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchpipedream.runtime.measure import measure_accumulate_bandwidth, measure_allreduce, measure_loopback_bandwidth
from torchpipedream.plans.topology import (
    LOCAL_ALLREDUCE_EFFICIENCY,
    LOCAL_BANDWIDTH_BPS,
    Level,
    Topology,
    TopologyError,
    parse_bandwidth,
    parse_bytes,
)


def test_two_level_spec_innermost_first():
    t = Topology.parse("4x4:10GB/s,1.25GB/s")
    assert t.num_workers == 16
    assert [lv.count for lv in t.levels] == [4, 4]
    assert [lv.bandwidth_Bps for lv in t.levels] == [10e9, 1.25e9]
    assert t.memory_bytes is None


def test_flat_spec_memory_and_latency():
    t = Topology.parse("16:10GB/s@16GB~5us")
    assert t.num_workers == 16 and t.levels[0].bandwidth_Bps == 10e9
    assert t.memory_bytes == 16 * 10**9
    assert t.latency_s == pytest.approx(5e-6)


@pytest.mark.parametrize(
    "text, expected",
    [("1B/s", 1), ("3KB/s", 3e3), ("2.5MB/s", 2.5e6), ("10GB/s", 1e10), ("1TB/s", 1e12),
     ("1KiB/s", 1024), ("1MiB/s", 2**20), ("2GiB/s", 2 * 2**30),
     ("8bps", 1), ("10Gbps", 1.25e9), ("100Mbps", 12.5e6), ("10Gb/s", 1.25e9), ("8Kbps", 1e3)],
)
def test_bandwidth_units(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


def test_memory_units():
    assert parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6


def test_presets_follow_the_paper():
    a, b, c = Topology.parse("A"), Topology.parse("B"), Topology.parse("C")
    assert [lv.count for lv in a.levels] == [4, 4] and a.levels[1].bandwidth_Bps == 10e9 / 8
    assert [lv.count for lv in b.levels] == [8, 2] and b.levels[1].bandwidth_Bps == 25e9 / 8
    assert [lv.count for lv in c.levels] == [4] and c.levels[0].bandwidth_Bps == 40e9 / 8
    assert a.memory_bytes == b.memory_bytes == 16 * 10**9 and c.memory_bytes == 12 * 10**9
    assert Topology.parse("A:8").num_workers == 32
    assert Topology.parse("B:1").num_workers == 8
    assert Topology.parse("A@32GB").memory_bytes == 32 * 10**9


def test_local_preset_uses_this_machines_cores():
    t = Topology.parse("local")
    assert t.num_workers == (os.cpu_count() or 1)
    assert t.levels[0].bandwidth_Bps == LOCAL_BANDWIDTH_BPS
    assert Topology.parse("local:4").num_workers == 4


def _reference_bandwidth(counts, bws, a, b):
    """Independent reference: compare mixed-radix digits from the outermost level inwards."""
    if a == b:
        return math.inf
    digits_a, digits_b = [], []
    for c in counts:
        digits_a.append(a % c)
        digits_b.append(b % c)
        a //= c
        b //= c
    # highest level index whose digit differs is the outermost level crossed
    top = max(k for k in range(len(counts)) if digits_a[k] != digits_b[k])
    return min(bws[: top + 1])


@pytest.mark.parametrize("counts, bws", [([4, 4], [10e9, 1.25e9]), ([2, 3, 2], [5e9, 3e9, 4e9]), ([6], [1e9])])
def test_bandwidth_between_ranks_matches_reference(counts, bws):
    t = Topology([Level(c, b) for c, b in zip(counts, bws)])
    n = t.num_workers
    for a in range(n):
        for b in range(n):
            assert t.bandwidth(a, b) == _reference_bandwidth(counts, bws, a, b)
    for lo in range(n):
        for hi in range(lo, n):
            ranks = list(range(lo, hi + 1))
            expected = min((_reference_bandwidth(counts, bws, x, y) for x in ranks for y in ranks), default=math.inf)
            assert t.span_bandwidth(ranks) == expected


def test_examples_of_bandwidth_and_span():
    t = Topology.parse("4x4:10GB/s,1.25GB/s")
    assert t.bandwidth(0, 3) == 10e9  # same server
    assert t.bandwidth(3, 4) == 1.25e9  # neighbours across servers
    assert t.bandwidth(5, 5) == math.inf
    assert t.span_bandwidth(range(4, 8)) == 10e9
    assert t.span_bandwidth(range(0, 15)) == 1.25e9
    assert t.span_bandwidth([7]) == math.inf
    with pytest.raises(TopologyError, match="outside"):
        t.bandwidth(0, 16)


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    bws=st.lists(st.floats(1.0, 1e13), min_size=3, max_size=3),
    memory=st.one_of(st.none(), st.integers(1, 10**13)),
    latency=st.floats(0, 1e-2),
    efficiency=st.one_of(st.just(1.0), st.just(0.4), st.floats(1e-6, 1.0)),
)
def test_spec_and_dict_round_trip(counts, bws, memory, latency, efficiency):
    t = Topology([Level(c, b) for c, b in zip(counts, bws)], memory_bytes=memory, latency_s=latency,
                 allreduce_efficiency=efficiency)
    assert Topology.parse(t.to_spec()) == t
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_load_json_file(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"levels": [{"count": 2, "bandwidth_Bps": "25GB/s", "name": "nvlink"},
                                           {"count": 3, "bandwidth_Bps": 1e9}], "memory_bytes": "8GB"}))
    t = Topology.load(path)
    assert t.num_workers == 6 and t.levels[0].bandwidth_Bps == 25e9 and t.memory_bytes == 8 * 10**9
    assert Topology.from_any(str(path)) == t


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0:1GB/s", "count must be a positive integer"),
        ("4x0:1GB/s,1GB/s", "count must be a positive integer"),
        ("4:0GB/s", "bandwidth must be > 0"),
        ("4:-2GB/s", "bandwidth must be > 0"),
        ("4x4:1GB/s", "one bandwidth per level"),
        ("4:fast", "cannot read bandwidth"),
        ("4:3 furlongs/s", "cannot read bandwidth|unknown unit"),
        ("4:3parsecs", "unknown unit"),
        ("fourxfour:1GB/s", "whole numbers"),
        ("16", "COUNTS:BANDWIDTHS"),
        ("", "empty topology spec"),
        ("Z", "COUNTS:BANDWIDTHS"),
        ("A:0", "positive number"),
        ("4:1GB/s@0GB", "memory size must be > 0"),
    ],
)
def test_malformed_specs_are_clear_errors(spec, message):
    with pytest.raises(TopologyError, match=message):
        Topology.parse(spec)


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(TopologyError, match="no such file"):
        Topology.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{ levels: ")
    with pytest.raises(TopologyError, match="invalid JSON"):
        Topology.load(bad)
    bad.write_text(json.dumps({"levels": [{"count": 2}]}))
    with pytest.raises(TopologyError, match=r"levels\[0\]"):
        Topology.load(bad)
    bad.write_text(json.dumps({"levels": [{"count": 2, "bandwidth_Bps": 0}]}))
    with pytest.raises(TopologyError, match="bandwidth must be"):
        Topology.load(bad)


@pytest.mark.timeout(120)
def test_measured_loopback_bandwidth_is_positive():
    t = Topology.local(workers=2, bandwidth_Bps=measure_loopback_bandwidth())
    bw = t.levels[0].bandwidth_Bps
    assert 1e6 < bw < 1e12


@pytest.mark.timeout(120)
def test_measured_allreduce_grows_with_size_and_needs_two_workers():
    # 16 MB through gloo's ring takes milliseconds more than 4 KB; both are real times.
    small = measure_allreduce(4096, workers=2, repeats=5)
    large = measure_allreduce(16 * 2**20, workers=2, repeats=5)
    assert 0 < small < large < 10.0
    assert large > small + 16 * 2**20 / 50e9  # no faster than memory can move the bytes
    with pytest.raises(ValueError, match="at least 2 workers"):
        measure_allreduce(4096, workers=1)


def test_allreduce_efficiency_spec_and_local_default():
    assert Topology.parse("2:1GB/s%40").allreduce_efficiency == pytest.approx(0.4)
    assert Topology.parse("2:1GB/s").allreduce_efficiency == 1.0
    assert Topology.parse("local:2").allreduce_efficiency == LOCAL_ALLREDUCE_EFFICIENCY < 1
    t = Topology.parse("2:1GB/s%25")
    assert t.allreduce_bandwidth([0, 1]) == pytest.approx(0.25e9) and t.span_bandwidth([0, 1]) == 1e9
    for bad, match in (("2:1GB/s%0", r"\(0, 1\]"), ("2:1GB/s%120", r"\(0, 1\]"), ("2:1GB/s%fast", "percent")):
        with pytest.raises(TopologyError, match=match):
            Topology.parse(bad)


def test_measured_accumulate_bandwidth_is_a_plausible_memory_speed():
    bps = measure_accumulate_bandwidth(8 * 2**20, repeats=3)
    assert 1e8 < bps < 1e12


def test_memory_spec_is_exact_even_when_not_round():
    t = Topology([Level(1, 1.0)], memory_bytes=1_000_000_000_001)
    assert Topology.parse(t.to_spec()).memory_bytes == 1_000_000_000_001
    assert Topology([Level(2, 1e9)], memory_bytes=16 * 10**9).to_spec() == "2:1GB/s@16GB"
