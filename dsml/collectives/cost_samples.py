"""Link samples and the cost model fitted to them (collectives layer).

`LinkSample` is what one rank of the probe (cost_probe.py) measured on the link to its
right neighbour, checked when it arrives from a peer; `model_from_samples` is how rank 0
fits one `CostModel` (cost.py) to one sample per ring link. Pure arithmetic: no I/O. The
sizes and counts the fit reads (how large a shift and a race are, how many messages a
burst and chunks a split ring has) are here; the probe takes its samples with them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ProtocolError
from .cost import CostModel

__all__ = ["LinkSample", "model_from_samples"]

_RATE_BYTES = 1 << 20  # larger than a shaper's bucket (tbf: 4 ms of traffic at 1 Gbit)
_RACE_BYTES = 1 << 20
_BURST = 16
_SPLIT = 4  # the ring raced once more with this many chunks per segment


@dataclass(frozen=True, slots=True)
class LinkSample:
    """What one rank measured on the link to its right neighbour (seconds)."""

    small_rtt_s: float  # median round trip of a small message
    burst_s: float  # _BURST small messages sent back to back, until the answer
    shift_s: float  # median gap between two _RATE_BYTES arrivals, all ranks sending right
    chunk_cpu_s: float  # median CPU time per extra message of a shift cut in _PIECES
    ring_s: float  # median time of a _RACE_BYTES ring all-reduce
    mesh_s: float  # median time of a _RACE_BYTES mesh all-reduce
    ring_split_s: float = 0.0  # the same ring with _SPLIT chunks per segment
    #: (algorithm, bytes, median seconds) of every algorithm at each of _RACED_SIZES
    raced: tuple[tuple[str, int, float], ...] = ()

    def to_fields(self) -> dict[str, Any]:
        return {
            "rtt": self.small_rtt_s,
            "burst": self.burst_s,
            "shift": self.shift_s,
            "chunk_cpu": self.chunk_cpu_s,
            "ring": self.ring_s,
            "mesh": self.mesh_s,
            "ring_split": self.ring_split_s,
            "raced": [list(row) for row in self.raced],
        }

    @classmethod
    def from_fields(cls, fields: Any) -> LinkSample:
        """A peer's sample (checked: it arrives over the network)."""
        keys = ("rtt", "burst", "shift", "chunk_cpu", "ring", "mesh", "ring_split")
        if not isinstance(fields, dict) or set(fields) != {*keys, "raced"}:
            raise ProtocolError(f"not a link sample: {fields!r:.200}")
        values = [fields[k] for k in keys]
        if not all(type(v) is float and 0 <= v < 1e4 for v in values):
            raise ProtocolError(f"bad link sample: {fields!r:.200}")
        try:
            raced = CostModel.check_raced(fields["raced"])
        except ProtocolError:
            raise ProtocolError(f"bad link sample: {fields!r:.200}") from None
        rtt, burst, shift, chunk_cpu, ring, mesh, split = values
        return cls(rtt, burst, shift, chunk_cpu, ring, mesh, split, raced)


def model_from_samples(
    samples: Sequence[LinkSample],
    host_keys: Sequence[str],
    gamma_s: float,
    *,
    default_chunk_bytes: int,
    max_chunk_bytes: int,
    copy_s: float = 0.0,
) -> CostModel:
    """Fit the cost model to one sample per ring link (see cost.py for the parameters).

    Latency and per-message time are the median over links (robust to one noisy link);
    the per-byte time is the slowest link's, since a ring step waits for its slowest hop.
    """
    assert samples
    assert len(host_keys) >= 1
    alpha = statistics.median(s.small_rtt_s for s in samples) / 2
    per_message = statistics.median(
        max((s.burst_s - s.small_rtt_s) / (_BURST - 1), s.chunk_cpu_s) for s in samples
    )
    p = len(host_keys)
    volume = 2 * (p - 1) / p * _RACE_BYTES  # bytes each rank sends in a ring or mesh
    ring = max(s.ring_s for s in samples)  # a call lasts as long as its slowest rank
    mesh = max(s.mesh_s for s in samples)
    ring_bw = max(0.0, ring - 2 * (p - 1) * alpha)  # their bandwidth parts
    mesh_bw = max(0.0, mesh - 2 * alpha)
    # The sustained rate of a link, or what the ring really got if that is slower.
    beta = max(max(s.shift_s / _RATE_BYTES for s in samples), ring_bw / volume if p > 1 else 0)
    # Flows to every peer at once: as much dearer (or cheaper) per byte than the ring's
    # one flow as the mesh was, within reason.
    ratio = mesh_bw / ring_bw if ring_bw > 0 else 1.0
    beta_all = beta * min(4.0, max(0.5, ratio))
    counts: dict[str, int] = {}
    for key in host_keys:
        counts[key] = counts.get(key, 0) + 1
    model = CostModel(
        world_size=len(host_keys),
        hosts=len(counts),
        ranks_per_host=max(counts.values()),
        alpha_s=max(alpha, 1e-7),
        beta_s=max(beta, 1e-12),
        beta_all_s=max(beta_all, 1e-12),
        overhead_s=per_message,
        gamma_s=max(gamma_s, 1e-12),
        default_chunk_bytes=default_chunk_bytes,
        max_chunk_bytes=max_chunk_bytes,
        copy_s=max(copy_s, 0.0),
    )
    split = max(s.ring_split_s for s in samples)
    if p > 1 and ring > 0 and split > 0:
        model = replace(model, overhead_s=max(per_message, _chunk_cost(model, ring, split)))
    return replace(model, raced=_slowest(samples, ring, mesh))


def _chunk_cost(model: CostModel, ring_s: float, split_s: float) -> float:
    """The time per extra message that makes the formula's ring lose as much by _SPLIT
    chunks per segment as the raced one did (or gain as much). Where the CPU, not the
    link, is the limit, chunks hide nothing and each costs its wake-ups: this says so."""
    segment = _RACE_BYTES // model.world_size
    free = replace(model, overhead_s=0.0)
    whole = free.formula("ring", _RACE_BYTES, segment)
    chunked = free.formula("ring", _RACE_BYTES, -(-segment // _SPLIT))
    extra_messages = 2 * (model.world_size - 1) * (_SPLIT - 1)
    return max(0.0, (split_s - ring_s) - (chunked - whole)) / extra_messages


def _slowest(
    samples: Sequence[LinkSample], ring_s: float, mesh_s: float
) -> tuple[tuple[str, int, float], ...]:
    """Every raced (algorithm, bytes): the slowest rank's median (a call lasts as long)."""
    slowest: dict[tuple[str, int], float] = {}
    for sample in samples:
        for algo, nbytes, seconds in sample.raced:
            slowest[(algo, nbytes)] = max(seconds, slowest.get((algo, nbytes), 0.0))
    if ring_s > 0 and mesh_s > 0:
        slowest[("ring", _RACE_BYTES)] = ring_s
        slowest[("mesh", _RACE_BYTES)] = mesh_s
    return tuple((algo, nbytes, t) for (algo, nbytes), t in sorted(slowest.items()))
