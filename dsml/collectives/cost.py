"""A latency-bandwidth cost model of all-reduce, fitted to one group (collectives layer).

Pure arithmetic: no I/O. `cost_probe.py` measures a group and builds the model; the
communicator asks it which algorithm and chunk size `auto` stands for at a given size.

The model has seven numbers and a small table, in the style of Thakur, Rabenseifner and
Gropp (2005):

- `alpha_s`: one-way latency of a small message (half a ping-pong's round trip);
- `beta_s`: seconds per byte when every rank sends to its ring neighbour at once (the
  sustained rate, or what a real ring got if that was slower);
- `beta_all_s`: seconds per byte a rank sends when every rank sends to all the others at
  once (several flows share each link: on shaped TCP links this costs more than beta;
  where the CPU is the limit, fewer hops can make it cost less);
- `overhead_s`: CPU time one rank spends per extra message (back-to-back sends);
- `gamma_s`: seconds per byte to reduce one array into another on this machine;
- `copy_s`: seconds per byte to copy received bytes into the result on this machine
  (with gamma, the CPU's share of each byte; where the CPU, not the link, is the limit,
  as on hosts that share cores, it is what the call costs);
- `ranks_per_host`: the most ranks that share one host (and so one network card);
- `raced`: what each algorithm really took on this group at a few sizes (the probe races
  them): (algorithm, bytes, seconds) rows.

With P ranks, n bytes, s = n/P, chunk c and k = ceil(b/c) chunks of a b-byte stream: a
pipelined stage of b bytes takes `stage(b) = max(b*beta, a + c*(beta + gamma))`: the
link stays busy as long as the next stage's first chunk (sent, received, reduced) is in
before the current stage's last one leaves; with one chunk per stage, stages store and
forward. Then

    ring    (P-1) * (stage(s) + stage(s) without gamma) + 2(P-1) k o         # 2(P-1) hops
    mesh    2(P-1) s beta' + a + c (beta' + gamma) + 2(P-1) k o              # 2 hops
    naive   2 (a + (P-1) n beta') + c gamma + 2(P-1) k o                     # rank 0 does all
    tree    lg P (a + n beta + c gamma + k o)  [+ 2 (a + n beta + k o) if P is no power of 2]
    direct  a + (P-1) n (beta' + gamma) + (P-1) k o                          # everyone to all

where beta' is beta_all times `ranks_per_host` when the group spans several hosts (every
rank of a host sends across at once in those algorithms, while the ring crosses each host
boundary once). Every algorithm but the tree also copies what it received into the
result at the end: (P-1)/P n copy for ring and mesh, n copy for naive and direct.

The formulas miss what a given machine adds per message and per hop (wake-ups, a shaper's
burst allowance, cores shared between "hosts"), which decides small arrays. So where the
probe raced an algorithm, the prediction is the measured time: interpolated linearly
between raced sizes (the smallest raced time below them), and above the largest raced
size the formula's growth from there (from the raced size in one chunk per stream, as
raced, to this size in chunks of c), never less than the formula itself.

Where each of H hosts runs the same number L >= 2 of ranks that share its memory, `auto`
also weighs the hierarchical all-reduce (shared memory in each host, L rings of H ranks
on n/L bytes each between hosts, all L through each host's link at once):

    hierarchical  n (2 copy + gamma) + (H-1) (stage'(m/H) + stage'(m/H) without gamma
                  + 2 k o) + (H-1)/H m copy,   m = n/L, stage' with beta L per flow

It is never raced (the probe runs over TCP), so its formula is scaled by how much the
ring's prediction exceeds the ring's own formula at that size (same links and CPUs), and
it is weighed only from the largest raced size up: below, per-message costs that only a
race sees decide (on the namespaced harness, 2 hosts x 2 ranks at 1 Gbit: naive 1.25 ms
against hierarchical 2.05 ms at 4 KiB, hierarchical 7.8 ms against the ring's 12.1 ms at
1 MiB and 156 ms against 216 ms at 16 MiB; benchmarks/hierarchical.py).
Each host link carries 2(H-1)/H n bytes in it, against 2(P-1)/P n for the flat ring, in
2(H-1) steps instead of 2(P-1).

With gamma, copy and o zero and one chunk, the ring's line is Thakur's
2(P-1)a + 2(P-1)/P n beta. A host's ranks share its CPUs as well, which a measurement
between two of them cannot see; so a group on a single host keeps the size table measured
there (`select.py`), and the model decides only across hosts.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ProtocolError
from .select import choose_all_reduce

__all__ = ["CHUNK_CHOICES", "HIERARCHICAL", "Choice", "CostModel", "fit_link"]

#: Chunk sizes `auto` considers (powers of two; the config's own chunk size is added).
CHUNK_CHOICES = tuple(1 << e for e in range(16, 25))  # 64 KiB .. 16 MiB
#: Algorithms the model predicts (those with a formula above) and the probe races.
MODELLED = ("ring", "mesh", "naive", "tree", "direct")
#: Also predicted where ranks share hosts evenly (`AutoChooser.choose(..., hierarchical)`).
HIERARCHICAL = "hierarchical"
_FLOATS = ("alpha_s", "beta_s", "beta_all_s", "overhead_s", "gamma_s", "copy_s")
_MAX_RACED = 64  # rows of measured times a model may carry


def fit_link(
    small_bytes: int, small_rtt_s: float, large_bytes: int, large_rtt_s: float
) -> tuple[float, float]:
    """(alpha, beta) of a link from ping-pong round trips at two message sizes.

    One way, a message of b bytes takes alpha + b*beta, so a round trip twice that. Both
    results are clamped at a tiny positive value: a noisy sample must not give a link
    that is free.
    """
    assert large_bytes > small_bytes >= 0
    beta = (large_rtt_s - small_rtt_s) / 2 / (large_bytes - small_bytes)
    alpha = small_rtt_s / 2 - small_bytes * beta
    return max(alpha, 1e-7), max(beta, 1e-12)


@dataclass(frozen=True, slots=True)
class Choice:
    """What `auto` runs for one size: algorithm, chunk size, predicted seconds."""

    algorithm: str
    chunk_bytes: int
    predicted_s: float


@dataclass(frozen=True, slots=True)
class CostModel:
    """See the module docstring. Every rank holds an identical copy (rank 0's fit)."""

    world_size: int
    hosts: int  # distinct hosts in the group
    ranks_per_host: int
    alpha_s: float
    beta_s: float
    beta_all_s: float
    overhead_s: float
    gamma_s: float
    default_chunk_bytes: int = 4 << 20
    max_chunk_bytes: int = 64 << 20
    copy_s: float = 0.0
    raced: tuple[tuple[str, int, float], ...] = ()  # (algorithm, bytes, seconds)

    def __post_init__(self) -> None:
        assert self.world_size >= 1
        assert 1 <= self.hosts <= self.world_size
        assert 1 <= self.ranks_per_host <= self.world_size
        for name in _FLOATS:
            value = getattr(self, name)
            assert math.isfinite(value), f"{name}={value!r}"
            assert value >= 0, f"{name}={value!r}"
        for algo, nbytes, seconds in self.raced:
            assert algo in MODELLED, algo
            assert nbytes > 0, nbytes
            assert math.isfinite(seconds), seconds
            assert seconds >= 0, seconds

    # -- predictions --------------------------------------------------------------------------

    def predict(self, algorithm: str, nbytes: int, chunk_bytes: int) -> float:
        """Predicted seconds of one all_reduce of nbytes with this algorithm and chunk:
        the measured times where the probe raced it, else the formula (module docstring)."""
        if algorithm == HIERARCHICAL:
            # Never raced (it needs shared memory): its formula, made as much slower than
            # ideal as the ring's measurement is than the ring's formula (same links, CPUs).
            ideal = self.formula("ring", nbytes, chunk_bytes)
            scale = self.predict("ring", nbytes, chunk_bytes) / ideal if ideal > 0 else 1.0
            return self.formula(algorithm, nbytes, chunk_bytes) * max(1.0, scale)
        formula = self.formula(algorithm, nbytes, chunk_bytes)
        points = sorted((b, t) for algo, b, t in self.raced if algo == algorithm)
        if not points or self.world_size == 1:
            return formula
        if nbytes <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in itertools.pairwise(points):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        last, measured = points[-1]  # raced with one chunk per stream: chunk = its size
        growth = formula - self.formula(algorithm, last, last)
        return max(formula, measured + growth)

    def formula(self, algorithm: str, nbytes: int, chunk_bytes: int) -> float:
        """The latency-bandwidth formula's seconds (module docstring), nothing measured."""
        p, n = self.world_size, float(nbytes)
        if p == 1:
            return 0.0
        a, o, beta, gamma = self.alpha_s, self.overhead_s, self.beta_s, self.gamma_s
        gathered = (p - 1) / p * n * self.copy_s  # received bytes copied into the result
        spread = self.beta_all_s * (self.ranks_per_host if self.hosts > 1 else 1)
        s = n / p

        def chunks(b: float) -> tuple[int, float]:  # (chunks of a b-byte stream, their size)
            k = max(1, math.ceil(b / chunk_bytes))
            return k, b / k

        def stage(b: float, c: float, g: float, per_byte: float = beta) -> float:
            return max(b * per_byte, a + c * (per_byte + g))

        if algorithm == HIERARCHICAL:
            # Shared memory in each host (inputs staged, reduced, results copied out: about
            # three passes over n), and between hosts L rings of H ranks, each on n/L bytes,
            # all L through each host's link at once (so beta times L per flow).
            h, per_host = self.hosts, self.ranks_per_host
            local = n * (2 * self.copy_s + gamma)
            if h == 1:
                return local
            m = n / per_host
            k, c = chunks(m / h)
            shared = beta * per_host
            step = stage(m / h, c, gamma, shared) + stage(m / h, c, 0.0, shared) + 2 * k * o
            return local + (h - 1) * step + (h - 1) / h * m * self.copy_s
        if algorithm == "ring":
            k, c = chunks(s)
            return (p - 1) * (stage(s, c, gamma) + stage(s, c, 0.0) + 2 * k * o) + gathered
        if algorithm == "mesh":
            k, c = chunks(s)
            return 2 * (p - 1) * (s * spread + k * o) + a + c * (spread + gamma) + gathered
        if algorithm == "naive":
            k, c = chunks(n)
            return 2 * (a + (p - 1) * (n * spread + k * o)) + c * gamma + n * self.copy_s
        if algorithm == "tree":
            k, c = chunks(n)
            t = (p.bit_length() - 1) * (a + n * beta + c * gamma + k * o)
            if p & (p - 1):
                t += 2 * (a + n * beta + k * o)
            return t
        if algorithm == "direct":
            k, c = chunks(n)
            return a + (p - 1) * (n * (spread + gamma) + k * o) + n * self.copy_s
        raise ValueError(f"no cost formula for all_reduce algorithm {algorithm!r}")

    def chunk_choices(self) -> list[int]:
        """Chunk sizes considered, smallest first (each within the frame limit)."""
        sizes = {c for c in CHUNK_CHOICES if c <= self.max_chunk_bytes}
        sizes.add(self.default_chunk_bytes)
        return sorted(sizes)

    def choose(self, nbytes: int, algorithms: tuple[str, ...] = MODELLED) -> Choice:
        """The algorithm and chunk size with the lowest predicted time at this size.

        Ties go to the earlier algorithm in `algorithms` and the larger chunk (fewer
        messages). A group on one host keeps the measured size table (module docstring).
        """
        if self.hosts == 1:
            algo = choose_all_reduce(nbytes, self.world_size)
            chunk = self.default_chunk_bytes
            return Choice(algo, chunk, self.predict(algo, nbytes, chunk))
        best: Choice | None = None
        largest_raced = max((b for _, b, _ in self.raced), default=0)
        for algo in algorithms:
            if algo == HIERARCHICAL and nbytes < largest_raced:
                continue  # see the module docstring
            for chunk in reversed(self.chunk_choices()):
                t = self.predict(algo, nbytes, chunk)
                if best is None or t < best.predicted_s:
                    best = Choice(algo, chunk, t)
        assert best is not None, "no algorithm to choose from"
        return best

    # -- transport and display ------------------------------------------------------------------

    def to_fields(self) -> dict[str, Any]:
        """A msgpack-able dict (what rank 0 sends to the others)."""
        fields = asdict(self)
        fields["raced"] = [list(row) for row in self.raced]
        return fields

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> CostModel:
        """The model back from `to_fields` (a peer's message: every value is checked)."""
        ints = ("world_size", "hosts", "ranks_per_host", "default_chunk_bytes", "max_chunk_bytes")
        if not isinstance(fields, dict) or set(fields) != {*ints, *_FLOATS, "raced"}:
            raise ProtocolError(f"not a cost model: {fields!r:.200}")
        for name in ints:
            if type(fields[name]) is not int or fields[name] < 1:
                raise ProtocolError(f"cost model: bad {name} {fields[name]!r:.50}")
        for name in _FLOATS:
            if not _seconds(fields[name]):
                raise ProtocolError(f"cost model: bad {name} {fields[name]!r:.50}")
        if not fields["hosts"] <= fields["world_size"] >= fields["ranks_per_host"]:
            raise ProtocolError(f"cost model: inconsistent sizes {fields!r:.200}")
        return cls(**{**fields, "raced": cls.check_raced(fields["raced"])})

    @staticmethod
    def check_raced(rows: object) -> tuple[tuple[str, int, float], ...]:
        """Checked (algorithm, bytes, seconds) rows from a peer's message."""
        if not isinstance(rows, list) or len(rows) > _MAX_RACED:
            raise ProtocolError(f"cost model: bad raced table {rows!r:.200}")
        checked = []
        for row in rows:
            if not (isinstance(row, list | tuple) and len(row) == 3):
                raise ProtocolError(f"cost model: bad raced row {row!r:.100}")
            algo, nbytes, seconds = row
            good = type(nbytes) is int and nbytes >= 1 and _seconds(seconds)
            if algo not in MODELLED or not good:
                raise ProtocolError(f"cost model: bad raced row {row!r:.100}")
            checked.append((algo, nbytes, seconds))
        return tuple(checked)

    def describe(self) -> str:
        """One line with the fitted numbers in readable units."""
        return (
            f"{self.world_size} ranks on {self.hosts} host(s): "
            f"latency {self.alpha_s * 1e6:.0f} us, "
            f"{_rate(self.beta_s)} per link ({_rate(self.beta_all_s)} sending to all), "
            f"{self.overhead_s * 1e6:.1f} us per message, "
            f"reduce {_rate(self.gamma_s)}, copy {_rate(self.copy_s)}"
            + (f", {len(self.raced)} raced times" if self.raced else "")
        )

    def __repr__(self) -> str:
        return f"<CostModel {self.describe()}>"


def _seconds(value: object) -> bool:
    return type(value) is float and math.isfinite(value) and value >= 0


def _rate(seconds_per_byte: float) -> str:
    return f"{1e-9 / seconds_per_byte:.3g} GB/s" if seconds_per_byte > 0 else "free"
