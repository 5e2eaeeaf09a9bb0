"""The simulator's cost model against the REAL engine: an accuracy check, not a speed test.

A short real workload runs on the stall-free engine; every forward pass the engine asks
for is timed, and the cost model's prediction for the same chunks is compared with it.
The median relative error must stay within what ``fit-cost`` reported, with a margin.
The model is fitted here, on this machine, by the same function as ``batchlab fit-cost``:
the committed ``data/cost_model.json`` describes the machine the lessons were run on, and a
faster or slower machine would make its absolute times wrong (that is not the model's error).

The machine is shared, so each pass is timed the way ``fit-cost`` times its passes:
the engine's pass runs, then runs twice more on the same chunks (rewriting identical
keys and values), and the fastest run counts. The tokens are those of the first run.
"""

import time

import numpy as np
import pytest

from batchlab import driver, make_engine, workloads
from batchlab.model_runner import ModelRunner
from batchlab.costfit import fit_cost_model
from batchlab.costmodel import CostModel
from batchlab.simulator import VirtualClock, sim_runner, simulate

MARGIN = 0.15  # allowed on top of twice the reported held-out median error


class TimedRunner(ModelRunner):
    def __init__(self, lm, num_blocks, block_size):
        super().__init__(lm, num_blocks, block_size)
        self.timed: list[tuple[list, float]] = []

    def forward(self, chunks):
        best, logits = np.inf, None
        for _ in range(3):
            start = time.perf_counter()
            out = super().forward(chunks)
            best = min(best, time.perf_counter() - start)
            logits = out if logits is None else logits
        self.timed.append((list(chunks), best))
        return logits


def test_cost_model_predicts_real_forward_passes(lm):
    cost = fit_cost_model(lm, reps=2, progress=False)
    engine = make_engine("stallfree", lm, max_batch_size=8, token_budget=128, runner=TimedRunner)
    workload = workloads.mixed(lm, seed=5, num_requests=8).capped(12)
    trace = driver.run_workload(engine, workload, progress=False)
    assert all(len(r.output_ids) == r.max_new_tokens for r in trace.requests.values())
    passes = engine.runner.timed
    kinds = {("decode" if all(len(c.tokens) == 1 for c in ch) else
              "prefill" if all(len(c.tokens) > 1 for c in ch) else "hybrid") for ch, _ in passes}
    assert kinds == {"decode", "prefill", "hybrid"}, "the workload should exercise every kind of pass"
    measured = np.array([t for _, t in passes])
    predicted = np.array([cost.predict(ch) for ch, _ in passes])
    errors = np.abs(predicted - measured) / measured
    median = float(np.median(errors))
    bound = 2 * cost.error["median"] + MARGIN
    print(f"\n{len(passes)} real passes: median relative error {median:.1%} "
          f"(p90 {np.percentile(errors, 90):.1%}); the fit reported {cost.error['median']:.1%} "
          f"held out; bound {bound:.1%}")
    assert median <= bound

    # The simulator drives the same scheduler: on the same workload it plans the same steps.
    clock = VirtualClock()
    sim = make_engine("stallfree", lm, max_batch_size=8, token_budget=128,
                      runner=sim_runner(cost, clock), clock=clock)
    simulated = simulate(sim, workload)

    def plan(t):
        return [(s.decoded, s.prefill) for s in t.steps]

    assert plan(simulated) == plan(trace)


@pytest.mark.slow
def test_fit_cost_command_writes_a_model_the_simulator_loads(tmp_path, capsys):
    from batchlab.cli import main

    out = tmp_path / "cost.json"
    assert main(["fit-cost", "--quick", "--reps", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held-out relative error: median" in printed and f"wrote {out}" in printed
    model = CostModel.load(out)
    assert set(model.error) == {"median", "p90", "max"}
    assert model.meta["command"] == f"batchlab fit-cost --quick --reps 1 --json {out}"
    assert model.meta["passes_fitted"] + model.meta["passes_held_out"] == len(model.meta["passes"])


def test_fit_cost_refuses_zero_reps():
    import pytest

    from batchlab.cli import main

    with pytest.raises(SystemExit, match="--reps must be >= 1"):
        main(["fit-cost", "--reps", "0"])
