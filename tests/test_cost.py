"""The all-reduce cost model: formulas, fitting, and the choice `auto` makes from them."""

from __future__ import annotations

import dataclasses

import pytest

from dsml.collectives.cost import CHUNK_CHOICES, HIERARCHICAL, MODELLED, CostModel, fit_link
from dsml.collectives.cost_probe import LinkSample, model_from_samples
from dsml.collectives.select import choose_all_reduce
from dsml.errors import ProtocolError

KiB, MiB = 1024, 1 << 20
SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]


def model(p: int = 4, **kw: float | int) -> CostModel:
    """A group of p hosts linked at 1 Gbit with 100 us latency, unless told otherwise."""
    fields: dict[str, float | int] = {
        "world_size": p,
        "hosts": p,
        "ranks_per_host": 1,
        "alpha_s": 100e-6,
        "beta_s": 8e-9,
        "beta_all_s": 9e-9,
        "overhead_s": 10e-6,
        "gamma_s": 0.5e-9,
    }
    fields.update(kw)
    return CostModel(**fields)  # type: ignore[arg-type]


def test_fit_link_recovers_latency_and_per_byte_time_from_two_round_trips() -> None:
    alpha, beta = 50e-6, 2e-9
    small, large = 64, 1 << 20
    a, b = fit_link(small, 2 * (alpha + small * beta), large, 2 * (alpha + large * beta))
    assert a == pytest.approx(alpha)
    assert b == pytest.approx(beta)


def test_fit_link_never_returns_a_free_link_from_noisy_samples() -> None:
    a, b = fit_link(64, 1e-3, 1 << 20, 0.5e-3)  # the large round trip came back faster
    assert a > 0
    assert b > 0


@pytest.mark.parametrize("p", [2, 3, 4, 7])
def test_ring_prediction_without_overheads_is_thakurs_formula(p: int) -> None:
    m = model(p, overhead_s=0.0, gamma_s=0.0)
    n = 8 * MiB
    expected = 2 * (p - 1) * m.alpha_s + 2 * (p - 1) / p * n * m.beta_s
    assert m.predict("ring", n, n) == pytest.approx(expected)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_recursive_doubling_prediction_is_log_p_whole_array_exchanges(p: int) -> None:
    m = model(p, overhead_s=0.0, gamma_s=0.0)
    n = MiB
    rounds = p.bit_length() - 1
    assert m.predict("tree", n, n) == pytest.approx(rounds * (m.alpha_s + n * m.beta_s))


def test_non_power_of_two_tree_pays_two_extra_hops() -> None:
    m = model(3, overhead_s=0.0, gamma_s=0.0)
    n = MiB
    assert m.predict("tree", n, n) == pytest.approx(3 * (m.alpha_s + n * m.beta_s))


def test_naive_grows_linearly_with_the_group_for_large_arrays() -> None:
    n = 16 * MiB
    t4, t8 = model(4).predict("naive", n, 4 * MiB), model(8).predict("naive", n, 4 * MiB)
    assert t8 / t4 == pytest.approx(7 / 3, rel=0.01)


def test_a_one_rank_group_predicts_no_time() -> None:
    assert model(1, hosts=1).predict("ring", MiB, MiB) == 0.0


def test_unknown_algorithm_has_no_prediction() -> None:
    with pytest.raises(ValueError, match="no cost formula"):
        model().predict("carrier-pigeon", MiB, MiB)


def test_more_messages_cost_more_when_each_has_an_overhead() -> None:
    m = model(gamma_s=0.0)
    assert m.predict("ring", 64 * MiB, 64 * KiB) > m.predict("ring", 64 * MiB, 4 * MiB)


def test_chunks_keep_the_ring_busy_where_one_chunk_per_step_stores_and_forwards() -> None:
    m = model(overhead_s=0.0)
    p, n = m.world_size, 64 * MiB
    assert m.predict("ring", n, MiB) == pytest.approx(2 * (p - 1) * n / p * m.beta_s)
    assert m.predict("ring", n, 64 * MiB) > m.predict("ring", n, MiB)


def test_the_best_ring_chunk_balances_message_overhead_against_pipelining() -> None:
    m = model(world_size=4, overhead_s=70e-6, alpha_s=300e-6)
    chunk = m.choose(16 * MiB, ("ring",)).chunk_bytes
    assert 64 * KiB < chunk < 4 * MiB


def test_slow_links_choose_bandwidth_optimal_algorithms_for_large_arrays() -> None:
    m = model()
    for n in (MiB, 16 * MiB, 64 * MiB):
        assert m.choose(n).algorithm in ("ring", "mesh")


def test_high_latency_chooses_few_hops_for_small_arrays() -> None:
    m = model(alpha_s=1e-3)
    assert m.choose(4 * KiB).algorithm in ("direct", "tree", "mesh")
    assert m.choose(4 * KiB).algorithm != "ring"


def test_many_ranks_on_a_high_latency_network_avoid_the_ring_for_small_arrays() -> None:
    m = model(16, alpha_s=500e-6)
    assert m.choose(16 * KiB).algorithm != "ring"


def test_the_choice_is_the_minimum_of_the_predictions() -> None:
    m = model()
    for n in SIZES:
        choice = m.choose(n)
        for algo in ("ring", "mesh", "naive", "tree", "direct"):
            for chunk in m.chunk_choices():
                assert choice.predicted_s <= m.predict(algo, n, chunk)
        assert choice.predicted_s == m.predict(choice.algorithm, n, choice.chunk_bytes)


def test_chunk_choices_respect_the_frame_limit_and_include_the_configured_chunk() -> None:
    m = model(default_chunk_bytes=3 * MiB, max_chunk_bytes=4 * MiB)
    chunks = m.chunk_choices()
    assert 3 * MiB in chunks
    assert max(chunks) <= 4 * MiB
    assert min(chunks) == CHUNK_CHOICES[0]


def test_a_single_host_group_keeps_the_size_table_measured_on_one_host() -> None:
    m = model(4, hosts=1, ranks_per_host=4)
    for n in SIZES:
        assert m.choose(n).algorithm == choose_all_reduce(n, 4)
        assert m.choose(n).chunk_bytes == m.default_chunk_bytes


def test_ranks_sharing_a_host_make_all_to_all_traffic_dearer_than_the_ring() -> None:
    alone, shared = model(8, hosts=8), model(8, hosts=2, ranks_per_host=4)
    n = 16 * MiB
    assert shared.predict("mesh", n, MiB) > alone.predict("mesh", n, MiB)
    assert shared.predict("ring", n, MiB) == alone.predict("ring", n, MiB)


def test_a_model_survives_the_trip_to_the_other_ranks_unchanged() -> None:
    m = model()
    assert CostModel.from_fields(m.to_fields()) == m


@pytest.mark.parametrize(
    "change",
    [
        {"alpha_s": -1.0},
        {"beta_s": float("nan")},
        {"gamma_s": "fast"},
        {"world_size": 0},
        {"hosts": 9},
        {"ranks_per_host": True},
        {"extra": 1},
    ],
)
def test_a_malformed_model_from_a_peer_is_a_protocol_error(change: dict[str, object]) -> None:
    fields = {**model().to_fields(), **change}
    with pytest.raises(ProtocolError):
        CostModel.from_fields(fields)


def test_a_model_describes_itself_in_readable_units() -> None:
    text = repr(model())
    assert "100 us" in text
    assert "0.125 GB/s" in text
    assert "4 ranks on 4 host(s)" in text


def sample(
    rtt: float,
    burst: float,
    shift: float,
    *,
    chunk_cpu: float = 0.0,
    ring: float = 0.0,
    mesh: float = 0.0,
    ring_split: float = 0.0,
    raced: tuple[tuple[str, int, float], ...] = (),
) -> LinkSample:
    return LinkSample(rtt, burst, shift, chunk_cpu, ring, mesh, ring_split, raced)


def fit(samples: list[LinkSample], hosts: int | list[str] = 3) -> CostModel:
    keys = hosts if isinstance(hosts, list) else [f"h{i}" for i in range(hosts)]
    return model_from_samples(samples, keys, 1e-9, default_chunk_bytes=MiB, max_chunk_bytes=MiB)


def test_fitting_takes_median_latency_and_the_slowest_links_sustained_rate() -> None:
    m = fit([sample(200e-6, 500e-6, 5e-3), sample(210e-6, 500e-6, 9e-3), sample(1e-3, 2e-3, 5e-3)])
    assert m.alpha_s == pytest.approx(105e-6)
    assert m.beta_s == pytest.approx(9e-3 / MiB)  # gaps between arrivals of 1 MiB messages
    assert m.overhead_s == pytest.approx((500e-6 - 200e-6) / 15)  # median of the links


def test_a_ring_slower_than_the_links_rate_sets_the_per_byte_time() -> None:
    rtt = 200e-6  # alpha 100 us
    ring = 4 * 100e-6 + 4 / 3 * MiB * 20e-9  # P=3: 2(P-1) hops and 2(P-1)/P MiB at 20 ns
    m = fit([sample(rtt, rtt, 8e-3, ring=ring, mesh=ring)] * 3)
    assert m.beta_s == pytest.approx(20e-9)


def test_a_mesh_slower_than_the_ring_makes_flows_to_all_dearer_per_byte() -> None:
    rtt = 200e-6
    volume = 4 / 3 * MiB
    ring = 4 * 100e-6 + volume * 10e-9
    mesh = 2 * 100e-6 + volume * 15e-9
    m = fit([sample(rtt, rtt, 10e-9 * MiB, ring=ring, mesh=mesh)] * 3)
    assert m.beta_s == pytest.approx(10e-9)
    assert m.beta_all_s == pytest.approx(15e-9)


def test_the_cpu_cost_of_large_messages_counts_when_it_exceeds_the_small_ones() -> None:
    m = fit([sample(100e-6, 100e-6 + 15 * 20e-6, 1e-3, chunk_cpu=150e-6)] * 2, 2)
    assert m.overhead_s == pytest.approx(150e-6)


def test_fitting_counts_ranks_that_share_a_host() -> None:
    m = fit([sample(1e-4, 2e-4, 1e-3)] * 5, ["x", "x", "y", "x", "y"])
    assert (m.world_size, m.hosts, m.ranks_per_host) == (5, 2, 3)


def test_a_malformed_link_sample_from_a_peer_is_a_protocol_error() -> None:
    good = sample(1e-4, 2e-4, 1e-3, ring=1e-2, mesh=2e-2).to_fields()
    assert LinkSample.from_fields(good) == sample(1e-4, 2e-4, 1e-3, ring=1e-2, mesh=2e-2)
    raced = {**good, "raced": [["naive", 4096, 1e-3]]}
    assert LinkSample.from_fields(raced).raced == (("naive", 4096, 1e-3),)
    bad_rows = {**good, "raced": [["naive", -1, 1e-3]]}
    for bad in (
        {**good, "rtt": -1.0},
        {**good, "shift": 1},
        {"rtt": 1.0},
        [1.0, 2.0, 3.0],
        bad_rows,
    ):
        with pytest.raises(ProtocolError):
            LinkSample.from_fields(bad)


def test_models_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        model().alpha_s = 1.0  # type: ignore[misc]


def raced(p: int = 4, **times: dict[int, float]) -> CostModel:
    """The default model with measured times: raced(ring={4096: 1e-3, ...}, ...)."""
    rows = tuple((algo, n, t) for algo, by_size in times.items() for n, t in by_size.items())
    return dataclasses.replace(model(p), raced=rows)


def test_where_an_algorithm_was_raced_its_measured_time_is_the_prediction() -> None:
    m = raced(naive={4 * KiB: 1e-3, 64 * KiB: 2e-3})
    assert m.predict("naive", 4 * KiB, MiB) == pytest.approx(1e-3)
    assert m.predict("naive", KiB, MiB) == pytest.approx(1e-3)  # below: the smallest's
    assert m.predict("naive", 34 * KiB, MiB) == pytest.approx(1.5e-3)  # linear between
    assert m.predict("tree", 4 * KiB, MiB) == m.formula("tree", 4 * KiB, MiB)  # not raced


def test_above_the_largest_raced_size_the_formula_grows_from_the_measured_time() -> None:
    m = raced(ring={MiB: 50e-3})  # far slower than the formula's ring at 1 MiB
    n = 16 * MiB
    growth = m.formula("ring", n, 256 * KiB) - m.formula("ring", MiB, MiB)  # raced in one
    assert m.predict("ring", n, 256 * KiB) == pytest.approx(50e-3 + growth)
    fast = raced(ring={MiB: 1e-6})  # faster than the formula: never below the formula
    assert fast.predict("ring", n, MiB) == pytest.approx(fast.formula("ring", n, MiB))


def test_auto_runs_the_fastest_raced_algorithm_at_a_raced_size() -> None:
    # naive's formula is the worst at 64 KiB, but here it was the fastest, as it is where
    # a shaper's burst allowance lets rank 0's traffic through at once
    m = raced(
        naive={64 * KiB: 1.7e-3},
        tree={64 * KiB: 2.9e-3},
        direct={64 * KiB: 2.6e-3},
        mesh={64 * KiB: 3.0e-3},
        ring={64 * KiB: 3.6e-3},
    )
    assert m.formula("naive", 64 * KiB, MiB) > m.formula("tree", 64 * KiB, MiB)
    choice = m.choose(64 * KiB)
    assert (choice.algorithm, choice.predicted_s) == ("naive", pytest.approx(1.7e-3))
    assert choice.chunk_bytes == max(m.chunk_choices())  # raced with one chunk per stream


def test_copying_the_gathered_result_costs_its_bytes() -> None:
    cheap, dear = model(copy_s=0.0), model(copy_s=1e-9)
    n = 16 * MiB
    assert dear.predict("ring", n, MiB) - cheap.predict("ring", n, MiB) == pytest.approx(
        3 / 4 * n * 1e-9
    )
    assert dear.predict("tree", n, MiB) == cheap.predict("tree", n, MiB)


def test_a_model_with_raced_times_survives_the_trip_to_the_other_ranks() -> None:
    m = raced(ring={4 * KiB: 1e-3, MiB: 12e-3}, naive={4 * KiB: 0.5e-3})
    assert CostModel.from_fields(m.to_fields()) == m


@pytest.mark.parametrize(
    "rows",
    [
        [["carrier-pigeon", 4096, 1e-3]],
        [["ring", 0, 1e-3]],
        [["ring", 4096, -1.0]],
        [["ring", 4096]],
        "ring",
        [["ring", 4096, 1e-3]] * 65,
    ],
)
def test_a_malformed_raced_table_from_a_peer_is_a_protocol_error(rows: object) -> None:
    with pytest.raises(ProtocolError):
        CostModel.from_fields({**model().to_fields(), "raced": rows})


def test_a_ring_that_chunks_slowed_down_raises_the_per_message_time() -> None:
    rtt = 200e-6
    volume = 4 / 3 * MiB  # P=3
    ring = 4 * 100e-6 + volume * 10e-9
    quiet = fit([sample(rtt, rtt, 10e-9 * MiB, ring=ring, mesh=ring, ring_split=ring / 2)] * 3)
    busy = fit([sample(rtt, rtt, 10e-9 * MiB, ring=ring, mesh=ring, ring_split=3 * ring)] * 3)
    assert quiet.overhead_s == pytest.approx(0.0, abs=1e-9)
    extra_messages = 2 * 2 * 3  # 2(P-1) streams, 3 more chunks each
    assert busy.overhead_s > 2 * ring / extra_messages  # at least what the chunks lost
    n, small, large = 16 * MiB, 64 * KiB, MiB
    assert quiet.predict("ring", n, small) <= quiet.predict("ring", n, large)  # chunks help
    assert busy.predict("ring", n, small) > busy.predict("ring", n, large)  # they cost


def test_the_fit_keeps_every_raced_time_at_the_slowest_ranks_value() -> None:
    rows_a = (("naive", 4096, 1e-3), ("tree", 4096, 2e-3))
    rows_b = (("naive", 4096, 3e-3), ("tree", 4096, 1e-3))
    m = fit([sample(1e-4, 2e-4, 1e-3, raced=rows_a), sample(1e-4, 2e-4, 1e-3, raced=rows_b)], 2)
    assert set(m.raced) == {("naive", 4096, 3e-3), ("tree", 4096, 2e-3)}


def test_hierarchical_puts_fewer_bytes_on_host_links_than_the_flat_ring_for_large_arrays() -> None:
    m = model(4, hosts=2, ranks_per_host=2)
    for n in (16 * MiB, 64 * MiB):
        hier = m.predict(HIERARCHICAL, n, MiB)
        assert hier < m.predict("ring", n, MiB)
        # link-bound: 2(H-1)/H n = n bytes per host link against the ring's 1.5 n
        assert hier == pytest.approx(n * m.beta_s, rel=0.15)


def test_auto_weighs_hierarchical_only_when_the_caller_can_run_it() -> None:
    m = model(4, hosts=2, ranks_per_host=2)
    n = 64 * MiB
    assert m.choose(n, (*MODELLED, HIERARCHICAL)).algorithm == HIERARCHICAL
    assert m.choose(n).algorithm != HIERARCHICAL


def test_hierarchical_is_as_much_slower_than_its_formula_as_the_raced_ring() -> None:
    plain = model(4, hosts=2, ranks_per_host=2)
    n = MiB
    ring_formula = plain.formula("ring", n, n)
    raced = dataclasses.replace(plain, raced=(("ring", n, 3 * ring_formula),))
    assert raced.predict("ring", n, n) == pytest.approx(3 * ring_formula)
    assert raced.predict(HIERARCHICAL, n, n) == pytest.approx(3 * plain.formula(HIERARCHICAL, n, n))


def test_hierarchical_is_weighed_only_from_the_largest_raced_size_up() -> None:
    plain = model(4, hosts=2, ranks_per_host=2)
    rows = tuple((a, b, plain.formula(a, b, b)) for a in MODELLED for b in (4 * KiB, MiB))
    raced = dataclasses.replace(plain, raced=rows)
    both = (*MODELLED, HIERARCHICAL)
    assert raced.choose(4 * KiB, both).algorithm != HIERARCHICAL
    assert raced.choose(MiB, both).algorithm == HIERARCHICAL
    assert raced.choose(64 * MiB, both).algorithm == HIERARCHICAL
