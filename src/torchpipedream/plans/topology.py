"""The cluster the planner plans for: a hierarchy of links, innermost first.

A :class:`Topology` is a list of :class:`Level` records. Level 1 joins ``count`` workers with
links of ``bandwidth_Bps`` (bytes/s), e.g. 4 GPUs of a server over PCIe; level 2 joins
``count`` of those components (4 servers over 10 Gbps), and so on. Ranks are laid out
innermost first: with ``4x4``, ranks 0-3 are server 0, ranks 4-7 server 1, ...

Two ranks talk over the slowest link of every level up to the first level at which they sit
in the same component; :meth:`Topology.bandwidth` returns that bandwidth.

Compact spec (CLI): ``COUNTS:BANDWIDTHS[@MEMORY][~LATENCY][%ALLREDUCE]``, innermost first::

    16:10GB/s                       16 workers on one 10 GB/s link level
    4x4:10GB/s,1.25GB/s             4 workers per server (10 GB/s), 4 servers (1.25 GB/s)
    4x4:10GB/s,10Gbps@16GB          the same, 16 GB per worker
    2:2GB/s%40                      all-reduces reach 40% of the ring formula's speed
    A   A:8   B   C   local   local:4   presets; ``:N`` sets the outermost count

Units: B/s, KB/s, MB/s, GB/s, TB/s (powers of 1000), KiB/s, MiB/s, GiB/s (powers of 1024),
bps, Kbps, Mbps, Gbps (bits per second); memory B, KB, MB, GB, TB, KiB, MiB, GiB;
latency s, ms, us.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, Sequence

from ..util.jsonio import read_json

__all__ = [
    "Level",
    "Topology",
    "TopologyError",
    "PRESETS",
    "LOCAL_BANDWIDTH_BPS",
    "DEFAULT_LATENCY_S",
    "parse_bandwidth",
    "parse_bytes",
    "format_bandwidth",
    "format_bytes",
]

#: Per-message latency assumed when none is given (seconds); used by the simulator.
DEFAULT_LATENCY_S = 20e-6

#: Loopback bandwidth of gloo send/recv between two processes on one machine (bytes/s).
#: Measured with ``runtime.measure.measure_loopback_bandwidth`` (16 MiB tensors, best of 5) on the project's
#: 2-core development machine: about 2 GB/s; rounded down so that plans are not optimistic.
LOCAL_BANDWIDTH_BPS = 2.0e9

#: The share of the ring formula's speed (2(m−1)/m · |w| / B) that gloo's all-reduce reaches
#: between local processes: on the development machine 2 MB took 2.8 ms and 16 MB 20 ms against
#: 1.05 and 8.4 ms by the formula at 2 GB/s (``runtime.measure.measure_allreduce``), i.e. 0.37-0.42.
LOCAL_ALLREDUCE_EFFICIENCY = 0.4


class TopologyError(ValueError):
    """A topology spec or file is malformed or impossible; the message says what to fix."""


@dataclass(frozen=True)
class Level:
    """``count`` components of the level below, joined by links of ``bandwidth_Bps`` bytes/s."""

    count: int
    bandwidth_Bps: float
    name: str = ""


_BW_UNITS = {
    "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
    "kib/s": 2.0**10, "mib/s": 2.0**20, "gib/s": 2.0**30,
    "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8, "tbps": 1e12 / 8,
}
_BYTE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_QUANTITY = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")


def _quantity(text: str, units: dict[str, float], what: str, default_unit: str) -> float:
    m = _QUANTITY.match(text)
    if not m:
        raise TopologyError(f"cannot read {what} {text!r}: expected a number with a unit, e.g. 10GB/s")
    value, unit = float(m.group(1)), (m.group(2) or default_unit)
    if units is _BW_UNITS and unit.endswith("b/s") and unit != "B/s":
        unit = unit[:-3] + "bps"  # a lowercase b before /s means bits: Gb/s == Gbps
    factor = units.get(unit.lower())
    if factor is None:
        raise TopologyError(f"unknown unit {unit!r} in {what} {text!r}; use one of {', '.join(sorted(units))}")
    return value * factor


def parse_bandwidth(text: str) -> float:
    """``"10GB/s"`` → 1e10 bytes/s; ``"10Gbps"`` → 1.25e9 bytes/s. Raises TopologyError if ≤ 0."""
    value = _quantity(text, _BW_UNITS, "bandwidth", "B/s")
    if value <= 0:
        raise TopologyError(f"bandwidth must be > 0, got {text!r}")
    return value


def parse_bytes(text: str) -> int:
    """``"16GB"`` → 16e9 bytes, ``"12GiB"`` → 12·2^30 bytes."""
    value = _quantity(text, _BYTE_UNITS, "memory size", "B")
    if value <= 0:
        raise TopologyError(f"memory size must be > 0, got {text!r}")
    return int(round(value))


def format_bandwidth(bps: float) -> str:
    """Shortest exact decimal spelling of a bandwidth, e.g. 1.25e9 → ``1.25GB/s``."""
    for unit, factor in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bps >= factor:
            text = f"{bps / factor:.15g}"
            if float(text) * factor == bps:
                return f"{text}{unit}"
    return f"{float(bps)!r}B/s"


def format_bytes(n: float) -> str:
    """Shortest exact decimal spelling of a byte count, e.g. 16e9 → ``16GB`` (parses back exactly)."""
    for unit, factor in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= factor:
            text = f"{n / factor:.15g}"
            if parse_bytes(text + unit) == n:
                return f"{text}{unit}"
    return f"{int(n)}B"


# The paper's clusters (PipeDream, SOSP 2019, Table 2). The paper names the intra-server
# interconnect (PCIe, NVLink) but not its bandwidth: we take ~10 GB/s for PCIe 3.0 x16 as
# achieved in practice, 25 GB/s for one NVLink 2.0 link per direction. Worker memory is the
# GPU's: V100 16 GB, Titan X 12 GB. Default server counts make 16 workers for A and B (as in
# the paper's 16-GPU runs) and 4 single-GPU servers for C.
PRESETS: dict[str, dict[str, Any]] = {
    "A": {"counts": [4, 4], "bandwidths": [10e9, 10e9 / 8], "names": ["PCIe", "10Gbps"],
          "memory_bytes": 16 * 10**9, "help": "4×V100 per server over PCIe, 10 Gbps between servers"},
    "B": {"counts": [8, 2], "bandwidths": [25e9, 25e9 / 8], "names": ["NVLink", "25Gbps"],
          "memory_bytes": 16 * 10**9, "help": "8×V100 per server over NVLink, 25 Gbps between servers"},
    "C": {"counts": [4], "bandwidths": [40e9 / 8], "names": ["40Gbps"],
          "memory_bytes": 12 * 10**9, "help": "1×Titan X per server, 40 Gbps between servers"},
}


def _percent_share(text: str) -> float:
    """``text`` percent as a share, correctly rounded (``"40"`` -> 0.4)."""
    return float(Fraction(text.strip()) / 100)


def _percent_text(share: float) -> str:
    """A short text ``t`` with ``_percent_share(t) == share``, exact (the spec round-trips)."""
    for short in (f"{share * 100:.15g}", repr(share * 100)):
        if _percent_share(short) == share:
            return short
    return format(Decimal(share) * 100, "f")  # a binary float times 100 is a finite decimal


class Topology:
    """Levels of (count, bandwidth), innermost first, plus per-worker memory and message latency.

    Args:
        levels: innermost first; ``levels[0].count`` workers share a component of level 1.
        memory_bytes: memory per worker (None = unlimited).
        latency_s: per-message latency (the planner ignores it; the simulator may use it).
        name: preset name, kept for display.
        allreduce_efficiency: the share of the ring formula's speed an all-reduce reaches
            (0 < e <= 1; 1 = the links' bandwidth): the planner and simulator charge an
            all-reduce 2(m−1)/m · |w| / (e · B). Collectives of CPU processes are slow next to
            their point-to-point links (``LOCAL_ALLREDUCE_EFFICIENCY``).
    """

    def __init__(
        self,
        levels: Sequence[Level],
        memory_bytes: int | None = None,
        latency_s: float = DEFAULT_LATENCY_S,
        name: str = "",
        allreduce_efficiency: float = 1.0,
    ) -> None:
        self.levels: tuple[Level, ...] = tuple(levels)
        self.memory_bytes = memory_bytes
        self.latency_s = latency_s
        self.name = name
        self.allreduce_efficiency = allreduce_efficiency
        self._check()

    def _check(self) -> None:
        if not self.levels:
            raise TopologyError("a topology needs at least one level (e.g. '4:10GB/s')")
        for k, lv in enumerate(self.levels, start=1):
            if isinstance(lv.count, bool) or not isinstance(lv.count, int) or lv.count < 1:
                raise TopologyError(
                    f"level {k}: count must be a positive integer, got {lv.count!r} (zero workers is not a cluster)"
                )
            bw = lv.bandwidth_Bps
            if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0 or math.isinf(bw):
                raise TopologyError(f"level {k}: bandwidth must be a finite number > 0 bytes/s, got {bw!r}")
        if self.memory_bytes is not None and (
            isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, (int, float))
            or self.memory_bytes <= 0
        ):
            raise TopologyError(f"memory_bytes must be > 0 or None, got {self.memory_bytes!r}")
        if not isinstance(self.latency_s, (int, float)) or self.latency_s < 0 or math.isnan(self.latency_s):
            raise TopologyError(f"latency_s must be >= 0, got {self.latency_s!r}")
        e = self.allreduce_efficiency
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise TopologyError(f"allreduce efficiency must be in (0, 1] (a share of the ring formula's speed), got {e!r}")

    # ------------------------------------------------------------- structure
    @property
    def num_workers(self) -> int:
        return math.prod(lv.count for lv in self.levels)

    @property
    def sizes(self) -> list[int]:
        """Workers per component of each level: ``sizes[k]`` for level k (``sizes[0] == 1``)."""
        out = [1]
        for lv in self.levels:
            out.append(out[-1] * lv.count)
        return out

    @property
    def effective_bandwidths(self) -> list[float]:
        """``eff[k]``: bandwidth of a link crossing level k (the slowest of levels 1..k); eff[0] = inf."""
        out = [math.inf]
        for lv in self.levels:
            out.append(min(out[-1], float(lv.bandwidth_Bps)))
        return out

    @property
    def allreduce_bandwidths(self) -> list[float]:
        """``effective_bandwidths`` times ``allreduce_efficiency``: what an all-reduce over a
        level-k span achieves in the ring formula."""
        return [b * self.allreduce_efficiency for b in self.effective_bandwidths]

    def allreduce_bandwidth(self, ranks: Sequence[int]) -> float:
        """The bandwidth the ring formula uses for an all-reduce among ``ranks``."""
        return self.span_bandwidth(ranks) * self.allreduce_efficiency

    def level_crossed(self, rank_a: int, rank_b: int) -> int:
        """The outermost level a link between two ranks crosses (0 for the same rank)."""
        n = self.num_workers
        for r in (rank_a, rank_b):
            if not isinstance(r, int) or not 0 <= r < n:
                raise TopologyError(f"rank {r!r} is outside this topology's {n} workers")
        sizes = self.sizes
        for k in range(len(sizes)):
            if rank_a // sizes[k] == rank_b // sizes[k]:
                return k
        raise AssertionError("unreachable: the outermost level contains every rank")

    def bandwidth(self, rank_a: int, rank_b: int) -> float:
        """Bandwidth (bytes/s) between two ranks: the slowest level their link crosses (inf if equal)."""
        return self.effective_bandwidths[self.level_crossed(rank_a, rank_b)]

    def span_bandwidth(self, ranks: Sequence[int]) -> float:
        """The slowest link inside a set of ranks (inf for one rank or none).

        Components are contiguous rank ranges, so the slowest link is the one between the lowest
        and the highest rank.
        """
        ranks = list(ranks)
        if len(ranks) < 2:
            return math.inf
        return self.bandwidth(min(ranks), max(ranks))

    # ------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, count: int | None = None) -> "Topology":
        """One of the paper's clusters (A, B, C); ``count`` sets the number of servers."""
        key = name.upper()
        if key not in PRESETS:
            raise TopologyError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)} and local")
        p = PRESETS[key]
        counts = list(p["counts"])
        if count is not None:
            counts[-1] = count
        levels = [Level(c, b, n) for c, b, n in zip(counts, p["bandwidths"], p["names"])]
        return cls(levels, memory_bytes=p["memory_bytes"], name=key)

    @classmethod
    def local(cls, workers: int | None = None, bandwidth_Bps: float | None = None) -> "Topology":
        """This machine: one worker per core (by default), joined by gloo's loopback bandwidth.

        ``bandwidth_Bps`` defaults to :data:`LOCAL_BANDWIDTH_BPS`; pass
        ``runtime.measure.measure_loopback_bandwidth()`` for this machine's own (a second or two
        of spawned processes).
        """
        n = workers if workers is not None else (os.cpu_count() or 1)
        bw = LOCAL_BANDWIDTH_BPS if bandwidth_Bps is None else bandwidth_Bps
        return cls([Level(n, bw, "loopback")], name="local", allreduce_efficiency=LOCAL_ALLREDUCE_EFFICIENCY)

    # -------------------------------------------------------------- parsing
    @classmethod
    def parse(cls, spec: str) -> "Topology":
        """Read a compact spec (see the module docstring) or a preset name."""
        if not isinstance(spec, str) or not spec.strip():
            raise TopologyError("empty topology spec; e.g. '4x4:10GB/s,1.25GB/s', '16:10GB/s' or 'A'")
        text = spec.strip()
        latency = DEFAULT_LATENCY_S
        memory: int | None = None
        efficiency: float | None = None
        if "%" in text:
            text, eff = text.rsplit("%", 1)
            try:
                efficiency = _percent_share(eff)
            except (ValueError, ZeroDivisionError):
                raise TopologyError(f"{spec!r}: after '%' give the all-reduce efficiency in percent, e.g. %40") from None
        if "~" in text:
            text, lat = text.split("~", 1)
            latency = _quantity(lat, _TIME_UNITS, "latency", "s")
        if "@" in text:
            text, mem = text.split("@", 1)
            memory = parse_bytes(mem)
        head, _, tail = text.partition(":")
        head, tail = head.strip(), tail.strip()
        if head.upper() in PRESETS or head.lower() == "local":
            count = None
            if tail:
                if not tail.isdigit() or int(tail) < 1:
                    raise TopologyError(f"{spec!r}: after '{head}:' give a positive number of servers/workers")
                count = int(tail)
            topo = cls.local(count) if head.lower() == "local" else cls.preset(head, count)
            if memory is not None:
                topo.memory_bytes = memory
            topo.latency_s = latency
            if efficiency is not None:
                topo.allreduce_efficiency = efficiency
                topo._check()
            return topo
        if not tail:
            raise TopologyError(
                f"{spec!r}: expected COUNTS:BANDWIDTHS such as '4x4:10GB/s,1.25GB/s' or a preset (A, B, C, local)"
            )
        try:
            counts = [int(c) for c in head.lower().split("x")]
        except ValueError:
            raise TopologyError(f"{spec!r}: counts {head!r} must be whole numbers joined by 'x', e.g. 4x4") from None
        bws = [parse_bandwidth(b) for b in tail.split(",")]
        if len(bws) != len(counts):
            raise TopologyError(
                f"{spec!r}: {len(counts)} level count(s) but {len(bws)} bandwidth(s); give one bandwidth per level"
            )
        return cls([Level(c, b) for c, b in zip(counts, bws)], memory_bytes=memory, latency_s=latency,
                   allreduce_efficiency=1.0 if efficiency is None else efficiency)

    def to_spec(self) -> str:
        """The compact spec; ``Topology.parse(t.to_spec())`` equals ``t`` (level names aside)."""
        spec = "x".join(str(lv.count) for lv in self.levels) + ":" + ",".join(
            format_bandwidth(lv.bandwidth_Bps) for lv in self.levels
        )
        if self.memory_bytes is not None:
            spec += "@" + format_bytes(self.memory_bytes)
        if self.latency_s != DEFAULT_LATENCY_S:
            text = f"{self.latency_s * 1e6:.15g}us"
            if _quantity(text, _TIME_UNITS, "latency", "s") != self.latency_s:
                text = f"{float(self.latency_s)!r}s"
            spec += "~" + text
        if self.allreduce_efficiency != 1.0:
            spec += "%" + _percent_text(self.allreduce_efficiency)
        return spec

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "levels": [{"count": lv.count, "bandwidth_Bps": lv.bandwidth_Bps, "name": lv.name} for lv in self.levels],
            "memory_bytes": self.memory_bytes,
            "latency_s": self.latency_s,
            "name": self.name,
            "allreduce_efficiency": self.allreduce_efficiency,
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "topology") -> "Topology":
        if not isinstance(data, dict):
            raise TopologyError(f"{source}: expected a JSON object with 'levels'")
        raw = data.get("levels")
        if not isinstance(raw, list) or not raw:
            raise TopologyError(f"{source}: field 'levels' must be a non-empty list of {{count, bandwidth_Bps}}")
        levels = []
        for k, lv in enumerate(raw):
            if not isinstance(lv, dict) or "count" not in lv or "bandwidth_Bps" not in lv:
                raise TopologyError(f"{source}: levels[{k}] must be an object with 'count' and 'bandwidth_Bps'")
            bw = lv["bandwidth_Bps"]
            if isinstance(bw, str):
                bw = parse_bandwidth(bw)
            levels.append(Level(lv["count"], bw, str(lv.get("name", ""))))
        memory = data.get("memory_bytes")
        if isinstance(memory, str):
            memory = parse_bytes(memory)
        try:
            return cls(levels, memory_bytes=memory, latency_s=data.get("latency_s", DEFAULT_LATENCY_S),
                       name=str(data.get("name", "")), allreduce_efficiency=data.get("allreduce_efficiency", 1.0))
        except TopologyError as exc:
            raise TopologyError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Topology":
        return cls.from_dict(read_json(path, TopologyError), source=str(path))

    @classmethod
    def from_any(cls, spec: "str | Path | Topology") -> "Topology":
        """A Topology, a path to a JSON file, or a compact spec / preset name."""
        if isinstance(spec, Topology):
            return spec
        text = str(spec)
        if text.endswith(".json") or (os.path.sep in text and Path(text).exists()):
            return cls.load(text)
        return cls.parse(text)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    # ---------------------------------------------------------------- misc
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return (
            [(lv.count, float(lv.bandwidth_Bps)) for lv in self.levels]
            == [(lv.count, float(lv.bandwidth_Bps)) for lv in other.levels]
            and self.memory_bytes == other.memory_bytes
            and self.latency_s == other.latency_s
            and self.allreduce_efficiency == other.allreduce_efficiency
        )

    def __repr__(self) -> str:
        return f"Topology({self.to_spec()!r}, {self.num_workers} workers)"
