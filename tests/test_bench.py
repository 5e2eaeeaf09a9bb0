"""``batchlab bench``: its method (interleaving, medians with spreads, the load recorded,
the under-load flag, the figures in the JSON) on the fake model with stand-in
micro-benchmarks, and the real ``--quick`` bench end to end. Figures are reported, never
asserted: speed belongs to benchmarks, and this machine is shared."""

import itertools
import json
import math
import os
import random
import time

import pytest
from pathlib import Path

from batchlab import make_engine
from batchlab.measurement import bench
from batchlab.measurement.bench import engines, format_table, run_bench
from batchlab.core.costmodel import CostModel, token_budget_for_slo
from batchlab.core.fake import FakeModel, FakeRunner
from batchlab.measurement.workloads import Workload, WorkloadRequest

NEW_FIGURES = (
    "sgemm_gflops",
    "copy_gbps",
    "prefill_fraction_of_sgemm_bound",
    "decode_fraction_of_bandwidth_bound",
    "chunk_1k_over_chunk_0",
    "no_waste_over_static_tokps",
    "one_row_linears_share_of_decode_step",
    "one_row_linears_mlx_over_numpy",
    "chat_continuous_over_static_tokps",
    "chat_no_waste_over_static_tokps",
    "chat_ours_over_mlxlm_tokps",
    "decode_b1_over_roofline",
    "decode_b8_over_roofline",
    "decode_b16_over_roofline",
)
FRACTIONS = [
    f"{w}_fraction_of_no_waste_{e}"
    for w in ("chat", "high_variance")
    for e in ("static", "continuous", "chunked", "stallfree", "mlx_lm")
]


def test_schedule_interleaves_the_engines_within_each_repetition():
    experiments = [("chat", None, [16]), ("high_variance", None, [8, 16]), ("interference", None, [8])]
    order = bench.schedule(experiments, repetitions=3)
    ours = list(engines(8)) + ["mlx-lm"]
    hv = [(r, w, b, e) for r, w, b, e in order if w == "high_variance"]
    # the sequential baseline opens the first repetition only; then every engine at B=8 and B=16
    assert [e for *_, e in hv].count("sequential") == 1 and hv[0] == (0, "high_variance", 1, "sequential")
    hv = hv[1:]
    per_rep = 2 * len(ours)
    assert len(hv) == 3 * per_rep
    for rep in range(3):
        block = hv[rep * per_rep : (rep + 1) * per_rep]
        assert {r for r, *_ in block} == {rep}  # a repetition finishes before the next starts
        assert [e for *_, e in block] == ours + ours
    inter = [(r, e) for r, w, b, e in order if w == "interference"]
    assert inter == [(rep, e) for rep in range(3) for e in ours]
    chat = [(r, b, e) for r, w, b, e in order if w == "chat"]  # no sequential baseline there
    # the chat workload is one of speculation's: the speculating engine runs after ours
    assert chat == [(rep, 16, e) for rep in range(3) for e in ours[:-1] + [bench.SPEC, "mlx-lm"]]
    # a learner's engine runs beside ours, before mlx-lm, in every repetition
    extra = bench.schedule(experiments, 2, ["mine"])
    assert [e for r, w, b, e in extra if w == "interference"] == 2 * (ours[:-1] + ["mine", "mlx-lm"])
    # speculation-only experiments: the stall-free engine on and off, interleaved, nothing else
    spec = bench.schedule([("echo", None, [16]), ("chat_b1", None, [1])], 3, ["mine"])
    assert spec == [
        (rep, w, b, e)
        for w, b in (("echo", 16), ("chat_b1", 1))
        for rep in range(3)
        for e in ("stallfree", bench.SPEC)
    ]


def test_stallfree_gets_the_budget_its_target_implies():
    from batchlab.core import costmodel
    from batchlab.core.costmodel import CostModel

    cost = CostModel.load()
    for b in (8, 16):
        assert "token_budget" not in engines(b)["stallfree"]  # no hand rule
        assert costmodel.token_budget_for_slo(cost, b, 10.0) > costmodel.token_budget_for_slo(cost, b) > b
    args = bench.engine_args(engines(8)["stallfree"], tbt_slo=0.5)
    if "tbt_slo" in args:  # the scheduler picks its budget from the target itself
        assert args["tbt_slo"] == 0.5 and "token_budget" not in args
    else:
        assert args["token_budget"] == costmodel.token_budget_for_slo(cost, 8, 0.5)
    # an explicit budget wins; engines without a target get nothing added
    assert bench.engine_args(dict(kind="stallfree", max_batch_size=8, token_budget=99))["token_budget"] == 99
    assert bench.engine_args(engines(8)["continuous"], tbt_slo=0.5) == engines(8)["continuous"]


def test_aggregate_gives_medians_and_ranges():
    runs = [
        {
            "workload": "w",
            "batch_size": 8,
            "engine": "static",
            "repetition": r,
            "load_before": 9.0,
            "load_after": 9.0,
            "output_tokens_per_s": v,
            "completed": 32,
            "tbt_p99_s": None,
        }
        for r, v in enumerate([10.0, 30.0, 20.0])
    ]
    (row,) = bench.aggregate(runs)
    assert row["output_tokens_per_s"] == 20.0 and row["spread"]["output_tokens_per_s"] == [10.0, 30.0]
    assert row["completed"] == 32 and row["repetitions"] == 3 and row["tbt_p99_s"] is None
    assert "load_before" not in row and "repetition" not in row


def record(share, load=0.3):
    return {"load_before": load, "load_after": load, "others_cpu_share": share}


def test_under_load_flag():
    # the bench's own threads raise the load average; only other processes' CPU counts
    assert not bench.under_load([record(0.02), record(0.10, load=2.5)])
    assert bench.under_load([record(0.02), record(0.11)])
    # without /proc/stat (macOS): the load average decides
    assert not bench.under_load([record(None, 1.5)]) and bench.under_load([record(None, 1.51)])


def test_others_share(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    # 3 busy CPU-seconds in 1 s on 2 cores, 1.5 of them ours: others took 0.75 of the machine
    assert bench.others_share((100.0, 10.0), (103.0, 11.5), 1.0) == pytest.approx(0.75)
    assert bench.others_share((100.0, 10.0), (101.0, 11.5), 1.0) == 0.0  # clock skew: never < 0
    assert bench.others_share(None, (1.0, 1.0), 1.0) is None


def test_cpu_seconds_counts_this_process():
    before = bench.cpu_seconds()
    if before is None:  # no /proc/stat (macOS): the bench cannot tell others' share, and says so
        assert not Path("/proc/stat").exists()
        assert bench.others_share(None, None, 1.0) is None
        return
    start = time.process_time()
    while time.process_time() - start < 0.3:  # burn 0.3 s of CPU in this process
        pass
    after = bench.cpu_seconds()
    own = after[1] - before[1]
    assert own >= 0.25  # CPU time, not wall time: the 0.3 s burned here are counted (BLAS threads may add)
    assert after[0] - before[0] >= own - 0.05  # the machine was busy at least while we were


class Model(FakeModel):
    info = type("Info", (), dict(name="fake", dtype="int", backend="none"))()


def fake_workloads():
    rng = random.Random(0)
    chat = Workload(
        "chat",
        "fake",
        [
            WorkloadRequest(
                f"c-{i}", [rng.randrange(1, 64) for _ in range(rng.randrange(4, 20))], rng.choice([8, 30, 60])
            )
            for i in range(16)
        ],
    )
    hv = Workload(
        "high_variance",
        "fake",
        [
            WorkloadRequest(
                f"hv-{i}", [rng.randrange(1, 64) for _ in range(rng.randrange(4, 40))], rng.choice([2, 4, 30])
            )
            for i in range(32)
        ],
    )
    short = [WorkloadRequest(f"s-{i}", [rng.randrange(1, 64) for _ in range(8)], 40) for i in range(7)]
    inter = Workload(
        "interference",
        "fake",
        short + [WorkloadRequest("long", [rng.randrange(1, 64) for _ in range(300)], 8, arrival_s=0.01)],
    )
    return [("chat", chat, [16]), ("high_variance", hv, [8, 16]), ("interference", inter, [8])]


def fake_machine(lm):
    """Stand-in micro-benchmarks: fixed numbers, so the figure arithmetic can be checked."""
    return {
        "limits": {
            "sgemm_gflops": 100.0,
            "copy_gbps": 10.0,
            "linear_flops_per_token": 2e8,
            "weight_bytes": 5e8,
            "prefill_bound_tokens_per_s": 500.0,
            "decode_bound_step_s": 0.05,
            "decode_roofline_s": {1: 0.05, 8: 0.05, 16: 0.08},
        },
        "fused_step": {"chunk": 128, "chunk_alone_s": 0.512, "fused_over_chunk_alone": 1.2},
        "chunk_context": {"chunk_1k_over_chunk_0": 1.4},
        "one_row_linears": {"mlx_s": 0.06, "numpy_s": 0.03, "mlx_over_numpy": 2.0},
        "decode_scaling": {
            1: {"step_s": 0.1, "tokens_per_s": 10.0},
            8: {"step_s": 0.16, "tokens_per_s": 50.0},
            16: {"step_s": 0.2, "tokens_per_s": 80.0, "kv_bytes_read": 5e8},
        },
        "microbench_loads": {"limits": record(0.01, load=0.5)},
    }


def stand_in(calls=None):
    """mlx-lm's stand-in: our continuous engine."""

    def run(lm, wl, b, engine_name, progress, runner, tbt_slo=None, extra_engines=None):
        if calls is not None:
            calls.append((wl.name, b, engine_name))
        name = "continuous" if engine_name == "mlx-lm" else engine_name
        return bench.run_engine(
            lm, wl, b, name, progress, runner=runner, tbt_slo=tbt_slo, extra_engines=extra_engines
        )

    return run


def test_bench_on_the_fake_model(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "plan", lambda lm, quick: fake_workloads())
    loads = iter([0.3] * 50 + [1.9] + [0.3] * 1000)  # one run ends at a high load average
    monkeypatch.setattr(os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    ticks = itertools.count()

    def cpu_seconds():  # other processes take 50 CPU-seconds during the sixth run only
        n = next(ticks)
        return n + (50.0 if n >= 11 else 0.0), float(n)

    monkeypatch.setattr(bench, "cpu_seconds", cpu_seconds)
    calls = []
    out = tmp_path / "bench.json"
    result = run_bench(
        Model(),
        json_out=str(out),
        progress=False,
        repetitions=3,
        runner=FakeRunner,
        run=stand_in(calls),
        measure=fake_machine,
    )
    table = format_table(result)
    saved = json.loads(out.read_text())
    assert calls == [(w, b, e) for _, w, b, e in bench.schedule(fake_workloads(), 3)]
    check_runs_and_loads(saved, table, calls)
    check_figures(saved["figures"], saved)
    check_no_waste_figures(saved["figures"], saved)


def check_runs_and_loads(saved, table, calls):
    """Every run recorded with the load around it, and the medians over the repetitions."""
    assert saved["repetitions"] == 3 and len(saved["runs"]) == len(calls)
    for run_ in saved["runs"]:
        assert run_["load_before"] > 0 and run_["load_after"] > 0
        assert run_["completed"] == {"chat": 16, "high_variance": 32}.get(run_["workload"], 8)
    assert [i for i, r in enumerate(saved["runs"]) if r["others_cpu_share"] > 0.1] == [5]
    assert saved["runs"][5]["workload"] == "chat" and "UNDER LOAD" not in table.split("\n")[2]
    assert saved["under_load"] and saved["max_load"] == 1.9
    assert table.startswith("UNDER LOAD (other processes took up to")
    assert "0.3-1.9" in table  # the row of the run that ended at a high load average shows it
    for row in saved["medians"]:
        runs = [
            r
            for r in saved["runs"]
            if (r["workload"], r["batch_size"], r["engine"])
            == (row["workload"], row["batch_size"], row["engine"])
        ]
        values = sorted(r["output_tokens_per_s"] for r in runs)
        assert len(values) == (1 if row["engine"] == "sequential" else 3) == row["repetitions"]
        assert row["output_tokens_per_s"] == values[len(values) // 2]
        assert row["spread"]["output_tokens_per_s"] == [values[0], values[-1]]


def check_figures(figures, saved):
    """The headline figures: every ratio finite, the machine's limits and rooflines as given."""
    for key in (
        (
            "continuous_over_static_tokps",
            "ours_over_mlxlm_tokps",
            "stallfree_p99_tbt_over_decode_step",
            "fused_over_chunk_alone",
            "b16_over_b1_decode",
            "scheduler_overhead_share",
        )
        + NEW_FIGURES
        + tuple(FRACTIONS)
    ):
        assert isinstance(figures[key], float) and math.isfinite(figures[key]), key
    assert figures["decode_b1_over_roofline"] == pytest.approx(0.1 / 0.05)
    assert figures["decode_b8_over_roofline"] == pytest.approx(0.16 / 0.05)
    assert figures["decode_b16_over_roofline"] == pytest.approx(0.2 / 0.08)
    # B=16 reads 0.5 GB of KV beside the 0.5 GB of weights: 0.1 s at 10 GB/s, over the FLOPs' 0.08 s
    assert figures["decode_b16_over_roofline_with_kv"] == pytest.approx(0.2 / 0.1)
    assert "decode_b8_over_roofline_with_kv" not in figures  # no KV bytes measured for it
    assert figures["batch_sizes"] == {"chat": 16, "high_variance": 16, "interference": 8}
    # the budgets the stall-free scheduler chose from its target, read from its traces
    assert figures["stallfree_token_budget"] == {
        str(b): token_budget_for_slo(CostModel.load(), b) for b in (8, 16)
    }
    assert figures["sgemm_gflops"] == 100.0 and figures["copy_gbps"] == 10.0
    assert figures["prefill_fraction_of_sgemm_bound"] == pytest.approx(128 / 0.512 / 500.0)
    assert figures["decode_fraction_of_bandwidth_bound"] == pytest.approx(0.05 / 0.1)
    assert figures["chunk_1k_over_chunk_0"] == 1.4 and figures["b16_over_b1_decode"] == 8.0
    assert figures["one_row_linears_share_of_decode_step"] == pytest.approx(0.06 / 0.1)
    assert figures["one_row_linears_mlx_over_numpy"] == 2.0
    spread = saved["figure_spreads"]["continuous_over_static_tokps"]
    assert spread[0] <= figures["continuous_over_static_tokps"] <= spread[1]


def check_no_waste_figures(figures, saved):
    """No waste: every prompt token at the fused benchmark's chunk rate, then full B=16 steps
    (old names for the prefill-heavy workload, chat_ for the chat one)."""
    for prefix, (name, wl, _) in (("", fake_workloads()[1]), ("chat_", fake_workloads()[0])):
        summary = wl.summary()
        no_waste = summary["output_tokens"] / (
            summary["prompt_tokens"] * 0.512 / 128
            + math.ceil((summary["output_tokens"] - summary["requests"]) / 16) * 0.2
        )
        med = {
            r["engine"]: r["output_tokens_per_s"]
            for r in saved["medians"]
            if (r["workload"], r["batch_size"]) == (name, 16)
        }
        assert figures[f"{prefix}no_waste_over_static_tokps"] == pytest.approx(no_waste / med["static"])
        for e in ("static", "continuous", "stallfree"):
            assert figures[f"{name}_fraction_of_no_waste_{e}"] == pytest.approx(med[e] / no_waste)


def fake_speculation_plan():
    """The fake workloads (the first few requests of each) and speculation's experiments beside
    them: an echo-shaped workload
    (each prompt a passage said twice, so prompt lookup finds drafts) at B=16, and its and
    chat's first two requests at B=1."""
    rng = random.Random(1)
    passages = [[rng.randrange(1, 64) for _ in range(12)] for _ in range(6)]
    echo = Workload("echo", "fake", [WorkloadRequest(f"e-{i}", p + p, 12) for i, p in enumerate(passages)])
    experiments = [(n, wl if n == "interference" else wl.head(6), bs) for n, wl, bs in fake_workloads()]
    chat = experiments[0][1]
    return experiments + bench.speculation_plan(chat, echo, 16, b1_requests=2)


def test_speculation_on_and_off_on_the_fake_model(monkeypatch):
    """The speculating stall-free engine runs beside the plain one on the echo and chat
    workloads, at B=1 and the standard B, and nowhere else; its figures are each repetition's
    ratios and counts, medians over the repetitions; greedy outputs are the same either way."""
    monkeypatch.setattr(bench, "plan", lambda lm, quick: fake_speculation_plan())
    traces = {}

    def recording(lm, wl, b, engine_name, *args):
        trace = stand_in()(lm, wl, b, engine_name, *args)
        traces.setdefault((wl.name, b, engine_name), []).append(trace)
        return trace

    result = run_bench(
        Model(), progress=False, repetitions=3, runner=FakeRunner, run=recording, measure=fake_machine
    )
    spec_runs = {(r["workload"], r["batch_size"]) for r in result["runs"] if r["engine"] == bench.SPEC}
    assert spec_runs == {("chat", 16), ("echo", 16), ("echo_b1", 1), ("chat_b1", 1)}
    only = {(r["workload"], r["engine"]) for r in result["runs"] if r["workload"] in ("echo", "echo_b1")}
    assert only == {(w, e) for w in ("echo", "echo_b1") for e in ("stallfree", bench.SPEC)}
    assert {r["requests"] for n, r in result["workloads"].items() if n.endswith("_b1")} == {2}
    figures = result["figures"]
    for name, b, prefix in (("echo", 16, "echo_b16"), ("echo_b1", 1, "echo_b1"), ("chat_b1", 1, "chat_b1")):
        runs = {
            (r["engine"], r["repetition"]): r
            for r in result["runs"]
            if (r["workload"], r["batch_size"]) == (name, b)
        }
        ratios = sorted(
            runs[(bench.SPEC, k)]["output_tokens_per_s"] / runs[("stallfree", k)]["output_tokens_per_s"]
            for k in range(3)
        )
        assert figures[f"{prefix}_spec_speedup_tokps"] == pytest.approx(ratios[1])
        assert result["figure_spreads"].get(f"{prefix}_spec_speedup_tokps", [ratios[0]] * 2)[
            0
        ] == pytest.approx(ratios[0])
        spec = runs[(bench.SPEC, 0)]
        assert spec["spec_drafted"] > 0 and runs[("stallfree", 0)]["spec_drafted"] == 0
        assert figures[f"{prefix}_spec_acceptance_rate"] == spec["spec_accepted"] / spec["spec_drafted"]
        assert figures[f"{prefix}_spec_passes_per_token"] == pytest.approx(spec["spec_passes_per_token"])
        assert figures[f"{prefix}_spec_tokens_per_verify_row"] == pytest.approx(
            spec["spec_tokens_per_verify_row"]
        )
        assert f"{prefix}_spec_over_mlxlm_tokps" not in figures  # mlx-lm runs on none of these
    assert isinstance(figures["chat_b16_spec_over_mlxlm_tokps"], float)
    # speculation changes how many passes run, never what greedy decoding answers
    for (wl_name, b, engine), runs in traces.items():
        if engine == bench.SPEC:
            for on, off in zip(runs, traces[(wl_name, b, "stallfree")]):
                assert {i: r.output_ids for i, r in on.requests.items()} == {
                    i: r.output_ids for i, r in off.requests.items()
                }
    # the batching figures leave the speculation-only experiments alone
    assert not any(
        k.startswith(("echo_fraction", "echo_b1_", "chat_b1_fraction")) for k in figures if "spec" not in k
    )
    assert bench.SPEC_NOTE in format_table(result)


@pytest.fixture(scope="module")
def text():
    """The course model's real tokenizer (structured output's masks are over token strings)."""
    from batchlab.model.load import load_tokenizer

    return load_tokenizer()


def jsonschema_verdicts(trace, tok, schema):
    """(valid, stopped, cut) of a run's answers by json and jsonschema alone, EOS ids dropped."""
    import jsonschema

    valid = stopped = cut = 0
    for rec in trace.requests.values():
        cut += rec.finish_reason == "length"
        if rec.finish_reason == "stop":
            stopped += 1
            try:
                value = json.loads(tok.decode([t for t in rec.output_ids if t not in tok.eos_token_ids]))
            except ValueError:
                continue
            valid += jsonschema.Draft202012Validator(schema).is_valid(value)
    return valid, stopped, cut


def test_structured_output_on_the_adversarial_fake_model(monkeypatch, text):
    """The structured experiment: the stall-free engine constraining every answer to the
    workload's JSON schema, the same engine on the same prompts unconstrained, and mlx-lm
    (here our continuous engine, unconstrained, EOS honoured: mlx-lm cannot constrain),
    interleaved over the repetitions. On the adversarial fake model (random favourites, EOS
    above all) every constrained answer is valid by jsonschema and the free ones are not; each
    figure is the median of the repetitions' values, computed here from the traces."""
    from batchlab.core.fake import AdversarialRunner
    from batchlab.measurement import driver, workloads

    structured = workloads.structured(text, num_requests=6, max_new_tokens=96)
    experiments = [(n, wl if n == "interference" else wl.head(4), bs) for n, wl, bs in fake_workloads()]
    experiments.append((bench.STRUCTURED, structured, [8]))
    monkeypatch.setattr(bench, "plan", lambda lm, quick: experiments)
    engines_ = (bench.STALLFREE, bench.UNCONSTRAINED, bench.MLXLM)
    assert [(r, e) for r, w, _, e in bench.schedule(experiments, 3, ["mine"]) if w == bench.STRUCTURED] == [
        (rep, e) for rep in range(3) for e in engines_
    ]
    traces, submitted = {}, []

    def run(lm, wl, b, engine_name, progress, runner, *rest):
        if wl.name == bench.STRUCTURED:
            runner = AdversarialRunner
        if wl.name == bench.STRUCTURED and engine_name == bench.MLXLM:
            trace = driver.run_workload(
                make_engine("continuous", lm, runner=runner, max_batch_size=b),
                wl.without_constraints(),
                progress=False,
                stop_at_eos=True,
            )
        else:
            trace = stand_in()(lm, wl, b, engine_name, progress, runner, *rest)
        traces.setdefault(engine_name if wl.name == bench.STRUCTURED else "other", []).append(trace)
        return trace

    original = driver.run_workload

    def watched(engine, wl, **options):  # what the bench's own runs submit
        if wl.name == bench.STRUCTURED:
            submitted.append((wl.requests[0].structured_outputs, options.get("stop_at_eos", False)))
        return original(engine, wl, **options)

    monkeypatch.setattr(driver, "run_workload", watched)
    result = run_bench(
        Model(text=text), progress=False, repetitions=3, runner=FakeRunner, run=run, measure=fake_machine
    )
    # ours: constrained (EOS honoured by the driver), then unconstrained with EOS honoured
    assert submitted[:2] == [({"json": workloads.STRUCTURED_SCHEMA}, False), (None, True)]
    figures, schema = result["figures"], workloads.STRUCTURED_SCHEMA
    verdicts = {e: [jsonschema_verdicts(t, text, schema) for t in traces[e]] for e in engines_}
    assert all(v == stopped == len(structured) for v, stopped, _ in verdicts[bench.STALLFREE])
    assert figures["structured_validity"] == 1.0 and figures["structured_length_cut"] == 0
    for engine, suffix in ((bench.UNCONSTRAINED, "_free"), (bench.MLXLM, "_mlxlm")):
        shares = sorted(v / stopped for v, stopped, _ in verdicts[engine])
        assert figures[f"structured_validity{suffix}"] == shares[1] < 1.0
        assert figures[f"structured_length_cut{suffix}"] == verdicts[engine][0][2]

    def median(values):
        return sorted(values)[1]

    runs = {(r["engine"], r["repetition"]): r for r in result["runs"] if r["workload"] == bench.STRUCTURED}
    for key, figure in (
        ("output_tokens_per_s", "structured_over_free_tokps"),
        ("ttft_p50_s", "structured_over_free_ttft_p50"),
    ):
        ratios = [runs[(bench.STALLFREE, k)][key] / runs[(bench.UNCONSTRAINED, k)][key] for k in range(3)]
        assert figures[figure] == pytest.approx(median(ratios)), figure
    shares = [
        sum(s.mask_s for s in t.steps) / sum(s.end_s - s.start_s for s in t.steps)
        for t in traces[bench.STALLFREE]
    ]
    assert figures["structured_mask_share"] == pytest.approx(median(shares))
    assert 0 < figures["structured_mask_share"] < 1
    assert not any(k.startswith("structured_fraction") for k in figures)  # no batching figures there
    table = format_table(result)
    assert bench.STRUCTURED_NOTE in table and "structured_validity_mlxlm" in table


def test_answer_validity_is_jsonschemas_verdict_and_a_broken_answer_fails(text):
    """The bench's validity of a run: among the answers that ended "stop", the share that
    ``json.loads`` parses and ``jsonschema`` validates (EOS dropped); "length" answers are
    counted apart. Every broken answer below fails, as jsonschema says."""
    import jsonschema

    from batchlab.core.trace import RequestRecord, Trace
    from batchlab.measurement import workloads

    schema = workloads.STRUCTURED_SCHEMA
    spec, eos = {"json": schema}, min(text.eos_token_ids)
    good = '{"title": "Lambdas", "topic": "Python", "keywords": ["lambda", "expression"], "sentences": 3}'
    broken = [
        good[:-1],  # not closed: not JSON
        good.replace('"sentences": 3', '"sentences": 101'),  # out of range
        good.replace('"sentences": 3', '"sentences": "3"'),  # a string, not an integer
        good.replace("}", ', "author": "me"}'),  # nothing else allowed
        good.replace('"topic": "Python", ', ""),  # a required field missing
        good.replace('["lambda", "expression"]', '["a", "b", "c", "d", "e", "f"]'),  # up to 5 keywords
        good.replace('"Lambdas"', '"' + "t" * 61 + '"'),  # a title of at most 60 characters
        "Here is the JSON: " + good,  # prose around it
    ]

    def trace(answers):
        records = {}
        for i, (answer, reason) in enumerate(answers):
            ids = text.encode(answer) + ([eos] if reason == "stop" else [])
            records[f"r{i}"] = RequestRecord(f"r{i}", 5, 96, 0.0, finish_reason=reason, output_ids=ids)
        return Trace("stallfree", 8, requests=records)

    assert bench.answer_validity(trace([(good, "stop")]), text, {"r0": spec}) == (1.0, 0)
    for answer in broken:
        with pytest.raises((ValueError, jsonschema.ValidationError)):  # jsonschema's own verdict
            jsonschema.validate(json.loads(answer), schema)
        assert bench.answer_validity(
            trace([(good, "stop"), (answer, "stop")]), text, dict.fromkeys(["r0", "r1"], spec)
        ) == (0.5, 0), answer
    # an answer cut at max_new_tokens is counted apart, not judged; none that stopped: no share
    cut = trace([(good, "stop"), (good[:20], "length")])
    assert bench.answer_validity(cut, text, dict.fromkeys(["r0", "r1"], spec)) == (1.0, 1)
    assert bench.answer_validity(trace([(good[:20], "length")]), text, {"r0": spec}) == (None, 1)
    # a request without a spec is not judged
    assert bench.answer_validity(trace([(good, "stop"), ("oops", "stop")]), text, {"r0": spec}) == (1.0, 0)


def test_a_learners_engine_runs_beside_ours(monkeypatch):
    from batchlab.core.scheduler import ContinuousScheduler

    class Mine(ContinuousScheduler):
        kind = "mine"

    monkeypatch.setattr(bench, "plan", lambda lm, quick: fake_workloads())
    result = run_bench(
        Model(),
        quick=True,
        progress=False,
        runner=FakeRunner,
        run=stand_in(),
        measure=fake_machine,
        extra_engines={"mine": dict(kind=Mine)},
    )
    mine = [r for r in result["runs"] if r["engine"] == "mine"]
    assert {(r["workload"], r["batch_size"]) for r in mine} == {
        ("chat", 16),
        ("high_variance", 8),
        ("high_variance", 16),
        ("interference", 8),
    }
    assert all(r["completed"] == {"chat": 16, "high_variance": 32}.get(r["workload"], 8) for r in mine)
    assert "chat_fraction_of_no_waste_mine" in result["figures"]
    with pytest.raises(ValueError, match="differ from ours"):
        run_bench(
            Model(),
            quick=True,
            progress=False,
            runner=FakeRunner,
            run=stand_in(),
            measure=fake_machine,
            extra_engines={"static": dict(kind=Mine)},
        )


def test_quiet_run_has_no_load_warning(monkeypatch):
    monkeypatch.setattr(bench, "plan", lambda lm, quick: fake_workloads())
    monkeypatch.setattr(os, "getloadavg", lambda: (2.4, 0.0, 0.0))  # our own threads
    monkeypatch.setattr(bench, "cpu_seconds", lambda: (1.0, 1.0))  # nobody else ran
    result = run_bench(
        Model(), quick=True, progress=False, runner=FakeRunner, run=stand_in(), measure=fake_machine
    )
    assert not result["under_load"] and result["repetitions"] == 1
    assert format_table(result).startswith("median of 1 interleaved repetition(s)")


def test_linear_flops_match_the_models_linear_weights(lm):
    """Independent count: 2 FLOPs per weight of every layer's linear maps, read off the
    loaded model's own parameters (not the config)."""
    from mlx.utils import tree_flatten

    weights = sum(
        v.size
        for name, v in tree_flatten(lm.model.model.parameters())
        if name.startswith("layers.") and name.endswith(".weight") and "norm" not in name
    )
    assert weights > 50_000_000  # the layers' linear maps, not nothing
    assert bench.linear_flops_per_token(lm.args) == 2 * weights


def test_quick_bench_runs_every_engine_and_reports_the_figures(lm_two_layers, tmp_path):
    """Every engine, workload and figure of the quick bench, on the model's first two layers:
    this checks the bench's plumbing, not the figures' values (``batchlab bench`` measures
    those on the whole model)."""
    out = tmp_path / "bench.json"
    traces = {}

    def recording(lm, wl, b, engine_name, *args):  # the bench's own runs, traces kept
        traces[(wl.name, b, engine_name)] = trace = bench.run_engine(lm, wl, b, engine_name, *args)
        return trace

    result = run_bench(lm_two_layers, quick=True, json_out=str(out), progress=False, run=recording)
    print(format_table(result))
    saved = json.loads(out.read_text())
    check_quick_speculation(saved, traces, format_table(result))
    check_quick_structured(saved, traces, format_table(result), lm_two_layers.tokenizer)
    assert saved["figures"] == result["figures"]
    runs = {(r["workload"], r["batch_size"], r["engine"]): r for r in saved["runs"]}
    for name, summary in saved["workloads"].items():
        for (w, b, e), run in runs.items():
            if w == name:
                assert run["completed"] == summary["requests"], (w, b, e)
                if w == bench.STRUCTURED:  # answers end at EOS: max_new_tokens is a cap
                    assert run["output_tokens"] <= summary["output_tokens"], (w, b, e)
                else:
                    assert run["output_tokens"] == summary["output_tokens"], (w, b, e)
    for b in (8, 16):
        for engine in list(engines(b)) + ["mlx-lm"]:
            assert ("high_variance", b, engine) in runs
            assert b == 16 or ("chat", b, engine) in runs
    assert ("high_variance", 1, "sequential") in runs
    for key in (
        (
            "continuous_over_static_tokps",
            "ours_over_mlxlm_tokps",
            "stallfree_p99_tbt_over_decode_step",
            "naive_p99_tbt_over_decode_step",
            "mlxlm_p99_tbt_over_decode_step",
            "fused_over_chunk_alone",
            "b16_over_b1_decode",
            "scheduler_overhead_share",
        )
        + NEW_FIGURES
        + tuple(FRACTIONS)
    ):
        value = saved["figures"][key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    assert (tmp_path / "bench_throughput.png").stat().st_size > 10_000
    assert (tmp_path / "bench_interference_latency.png").stat().st_size > 10_000


def check_quick_speculation(saved, traces, table):
    """Speculation on and off in the quick bench: the echo and chat workloads at B=1 and B=8,
    drafts proposed on the echo workload, greedy outputs the same as without speculation,
    and every speculation figure present."""
    runs = {(r["workload"], r["batch_size"], r["engine"]): r for r in saved["runs"]}
    pairs = [("echo", 8), ("echo_b1", 1), ("chat", 8), ("chat_b1", 1)]
    for name, b in pairs:
        on, off = runs[(name, b, bench.SPEC)], runs[(name, b, "stallfree")]
        assert off["spec_drafted"] == 0 and on["output_tokens"] == off["output_tokens"], name
        prefix = f"{name}_spec" if name.endswith("_b1") else f"{name}_b{b}_spec"
        for key in ("speedup_tokps", "passes_per_token", "tokens_per_verify_row", "acceptance_rate"):
            value = saved["figures"][f"{prefix}_{key}"]
            assert isinstance(value, float) and math.isfinite(value), (prefix, key, value)
        assert 0 < saved["figures"][f"{prefix}_passes_per_token"] <= 1
    for name in ("echo", "echo_b1"):
        b = 8 if name == "echo" else 1
        assert runs[(name, b, bench.SPEC)]["spec_drafted"] > 0, name  # the answers are in the prompts
    assert (
        saved["workloads"]["echo"]["name"] == "echo"
        and saved["workloads"]["echo_b1"]["requests"] == bench.B1_REQUESTS
    )
    assert isinstance(saved["figures"]["chat_b8_spec_over_mlxlm_tokps"], float)
    assert bench.SPEC_NOTE in table
    # speculation changes how many passes run, never what greedy decoding answers
    pairs_seen = 0
    for (wl_name, b, engine), on in traces.items():
        if engine == bench.SPEC:
            off = traces[(wl_name, b, "stallfree")]
            assert {i: r.output_ids for i, r in on.requests.items()} == {
                i: r.output_ids for i, r in off.requests.items()
            }, (wl_name, b)
            pairs_seen += 1
    assert pairs_seen == len(pairs)


def check_quick_structured(saved, traces, table, tok):
    """Structured output in the quick bench: the three engines ran at B=8; the constrained
    answers that ended at EOS are valid by jsonschema (none broke its schema), and every figure
    is what the traces say."""
    from batchlab.measurement import workloads

    schema = workloads.STRUCTURED_SCHEMA
    figures = saved["figures"]
    for engine, suffix in ((bench.STALLFREE, ""), (bench.UNCONSTRAINED, "_free"), (bench.MLXLM, "_mlxlm")):
        trace = traces[(bench.STRUCTURED, 8, engine)]
        valid, stopped, cut = jsonschema_verdicts(trace, tok, schema)
        assert figures[f"structured_validity{suffix}"] == (valid / stopped if stopped else None), engine
        assert figures[f"structured_length_cut{suffix}"] == cut, engine
        for rec in trace.requests.values():  # every engine ends these answers at EOS or the cap
            eos = [i for i, t in enumerate(rec.output_ids) if t in tok.eos_token_ids]
            assert eos == ([len(rec.output_ids) - 1] if rec.finish_reason == "stop" else []), (engine, rec.id)
            assert rec.finish_reason == "stop" or len(rec.output_ids) == rec.max_new_tokens, (engine, rec.id)
    assert figures["structured_validity"] in (1.0, None)
    for key in ("structured_over_free_tokps", "structured_over_free_ttft_p50", "structured_mask_share"):
        assert isinstance(figures[key], float) and figures[key] > 0, key
    assert saved["workloads"][bench.STRUCTURED]["requests"] == 4
    assert bench.STRUCTURED_NOTE in table


def test_mlxlm_peer_ends_constrained_requests_at_eos_unconstrained(lm):
    """mlx-lm cannot constrain: a request with ``structured_outputs`` runs on its prompt alone
    and ends at EOS (what ``mlx_lm.server``, which ignores ``response_format``, answers); one
    without runs past EOS to its length, unless ``stop_at_eos``. The prompt is the structured
    workload's first, whose free answer ends at EOS within 32 tokens."""
    from dataclasses import replace

    from batchlab.measurement import workloads
    from batchlab.measurement.peers import run_mlxlm_workload

    (asked,) = workloads.structured(lm.tokenizer, size="full").head(1).requests
    plain = replace(asked, id="plain", structured_outputs=None, max_new_tokens=32)
    eos = lm.tokenizer.eos_token_ids
    for stop_at_eos in (False, True):
        trace = run_mlxlm_workload(
            lm, Workload("peer", "", [asked, plain]), 2, progress=False, stop_at_eos=stop_at_eos
        )
        free, constrained = trace.requests["plain"], trace.requests[asked.id]
        end = next(i for i, t in enumerate(free.output_ids) if t in eos) + 1
        assert constrained.finish_reason == "stop" and len(constrained.output_ids) == end < 32
        if stop_at_eos:
            assert free.finish_reason == "stop" and free.output_ids == constrained.output_ids
        else:
            assert free.finish_reason == "length" and len(free.output_ids) == 32
            assert free.output_ids[:end] == constrained.output_ids  # the same greedy answer, up to EOS


def test_one_row_linears_times_every_weight_matrix(lm):
    """Every layer's 7 linear maps plus the LM head, both timings positive and finite."""
    from batchlab.measurement import microbench

    out = microbench.one_row_linears(lm, repeats=1)
    assert out["matrices"] == 7 * len(lm.model.model.layers) + 1
    assert out["mlx_s"] > 0 and out["numpy_s"] > 0
    assert out["mlx_over_numpy"] == pytest.approx(out["mlx_s"] / out["numpy_s"])


def test_the_fused_step_bench_gives_each_pass_its_range_over_the_repeats(lm_two_layers):
    """Lesson 5b judges every comparison by each pass's own range over its repeats: the
    median lies in it, and the ratios are of the medians."""
    from batchlab.measurement import microbench

    out = microbench.fused_step_ratio(lm_two_layers, decodes=2, chunk=8, context=16, repeats=3)
    for name in ("chunk_alone", "decode_alone", "fused"):
        lo, hi = out[f"{name}_range_s"]
        assert 0 < lo <= out[f"{name}_s"] <= hi, name
    assert out["fused_over_separate"] == pytest.approx(
        out["fused_s"] / (out["chunk_alone_s"] + out["decode_alone_s"])
    )


def test_a_pools_token_bytes_agree_with_the_formula_for_either_backing():
    """What the bench counts as a decode row's KV reads: one token's keys and values, every
    layer, whether the pool is numpy (the CPU path) or MLX (Metal)."""
    import mlx.core as mx

    from batchlab.model.model_runner import KVPool

    for numpy in (True, False):
        pool = KVPool(30, 4, 16, 3, 64, mx.float32, numpy=numpy)
        assert pool.token_bytes == KVPool.bytes_per_token(30, 3, 64, mx.float32) == 2 * 30 * 3 * 64 * 4


def test_designed_passes_are_built_once_for_the_fit_and_the_microbenchmarks():
    """costfit's passes come from microbench's builder: each row a request of its own with
    the KV blocks its context needs (or more, when asked), handed out in order."""
    from batchlab.measurement import costfit, microbench
    from batchlab.core.kv import BlockManager

    blocks = BlockManager(64, 16)
    chunks = microbench.designed_pass(blocks, [(31, 1), (0, 40)])
    assert [(c.req_id, c.start, len(c.tokens)) for c in chunks] == [("fit-0", 31, 1), ("fit-1", 0, 40)]
    assert [len(c.block_table) for c in chunks] == [2, 3]
    assert chunks[1].tokens[:3] == [2, 3, 4]  # 1 + (row + position) % 1000, as the fit has always sent
    row = microbench.designed_chunk(blocks, "r0", [7], 10, kv_tokens=100)
    assert len(row.block_table) == 7 and not set(row.block_table) & {b for c in chunks for b in c.block_table}
    assert costfit.designed_pass is microbench.designed_pass


def test_only_runs_the_named_experiments_and_an_unknown_name_is_refused(monkeypatch):
    """``run_bench(only=[...])`` (``batchlab bench --only``): the named experiment alone, every
    engine of its own, and its figures (each experiment's, in turn); a name the plan does not
    have is a ValueError that lists the plan's."""
    monkeypatch.setattr(bench, "plan", lambda lm, quick: fake_workloads())
    for kept, *_ in fake_workloads():
        calls = []
        result = run_bench(
            Model(),
            progress=False,
            repetitions=1,
            runner=FakeRunner,
            run=stand_in(calls),
            measure=fake_machine,
            only=[kept],
        )
        assert calls and {w for w, _, _ in calls} == {kept} and set(result["workloads"]) == {kept}
    with pytest.raises(ValueError, match="no experiment named nope; the bench runs"):
        run_bench(Model(), progress=False, run=stand_in([]), measure=fake_machine, only=["nope"])
