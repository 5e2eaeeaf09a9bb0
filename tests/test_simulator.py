"""The simulator: the same schedulers on a virtual clock and a fitted cost model."""

import time

import numpy as np
import pytest

from batchlab.core.costmodel import CostModel
from batchlab.measurement.simulator import (
    VirtualClock,
    make_sim_engine,
    queue_timeline,
    service_rate,
    simulate,
)
from batchlab.measurement.workloads import synthetic_workload

COST = CostModel.load()  # this machine's committed fit
OPTIONS = dict(max_batch_size=16, token_budget=256)


def test_the_committed_cost_model_is_usable():
    assert COST.error["median"] < COST.error["p90"] <= COST.error["max"]
    one = COST.predict([])  # an empty pass costs the fixed overhead only
    assert one == pytest.approx(max(COST.coefficients["passes"], 0.0))
    from batchlab.core.runner import Chunk

    small = COST.predict([Chunk("a", [1], 10, [])])
    big = COST.predict([Chunk(f"r{i}", [1], 500, []) for i in range(16)] + [Chunk("p", [1] * 256, 0, [])])
    assert 0 < small < big  # more work costs more time


def test_bad_cost_model_is_refused():
    with pytest.raises(ValueError, match="lacks coefficients for tokens"):
        CostModel({"passes": 1.0})


def test_virtual_clock_moves_only_forward():
    clock = VirtualClock()
    clock.advance(1.5)
    clock.advance_to(1.0)  # already later: no change
    assert clock() == 1.5
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_simulation_is_deterministic_and_complete():
    workload = synthetic_workload(100, rate=1.5, seed=7)
    a = simulate(make_sim_engine("stallfree", COST, **OPTIONS), workload)
    b = simulate(make_sim_engine("stallfree", COST, **OPTIONS), workload)
    assert a.to_json() == b.to_json()
    assert all(
        len(r.output_ids) == r.max_new_tokens and r.finish_reason == "length" for r in a.requests.values()
    )
    # every step's time is what the cost model charged for its passes, no more
    assert all(s.end_s - s.start_s == pytest.approx(s.forward_s) for s in a.steps)
    assert sorted(a.requests) == sorted(r.id for r in workload)


@pytest.mark.parametrize(
    "kind,options", [("stallfree", OPTIONS), ("continuous", dict(max_batch_size=16, prefill_step=128))]
)
def test_queue_is_bounded_below_capacity_and_grows_above(kind, options):
    mu = service_rate(synthetic_workload(400, rate=1.0, seed=1), kind, COST, **options)

    def queue_thirds(load):
        trace = simulate(
            make_sim_engine(kind, COST, **options), synthetic_workload(300, rate=load * mu, seed=2)
        )
        t, q = queue_timeline(trace)
        last_arrival = max(r.arrival_s for r in trace.requests.values())
        q = q[t <= last_arrival]  # while requests still arrive
        thirds = np.array_split(q, 3)
        return [float(x.mean()) for x in thirds], int(q.max())

    low, low_max = queue_thirds(0.5)
    high, high_max = queue_thirds(1.5)
    assert low_max < 40 and low[2] < 10, f"λ = μ/2: queue should stay short, got {low}"
    assert high[0] < high[1] < high[2] and high[2] > 5 * max(low[2], 1), (
        f"λ = 1.5 μ: queue should keep growing, got {high}"
    )


@pytest.mark.slow
def test_ten_thousand_requests():
    mu = service_rate(synthetic_workload(400, rate=1.0, seed=1), "stallfree", COST, **OPTIONS)
    workload = synthetic_workload(10_000, rate=0.9 * mu, seed=0)  # busy, but not overloaded
    engine = make_sim_engine("stallfree", COST, **OPTIONS)
    start = time.perf_counter()
    trace = simulate(engine, workload)
    print(
        f"\n10,000 simulated requests ({len(trace.steps)} steps, {engine.clock():.0f} virtual s) "
        f"in {time.perf_counter() - start:.1f} s of wall time"
    )
    assert len(trace.requests) == 10_000
    assert engine.finished_by_reason == {"length": 10_000}
