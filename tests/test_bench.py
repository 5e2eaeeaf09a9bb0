"""``batchlab bench --quick`` end to end. Its figures are reported (printed), not asserted:
speed belongs to benchmarks, and this machine is shared. What is checked is that every
run happened, on the same workload, and produced what a correct run must."""

import json
import math

from batchlab.bench import engines, format_table, run_bench


def test_quick_bench_runs_every_engine_and_reports_the_figures(lm, tmp_path):
    out = tmp_path / "bench.json"
    result = run_bench(lm, quick=True, json_out=str(out), progress=False)
    print(format_table(result))
    saved = json.loads(out.read_text())
    assert saved["figures"] == result["figures"]
    runs = {(r["workload"], r["batch_size"], r["engine"]): r for r in saved["runs"]}
    for name, summary in saved["workloads"].items():
        for (w, b, e), run in runs.items():
            if w == name:
                assert run["completed"] == summary["requests"], (w, b, e)
                assert run["output_tokens"] == summary["output_tokens"], (w, b, e)
    for b in (8, 16):
        for engine in list(engines(b)) + ["mlx-lm"]:
            assert ("high_variance", b, engine) in runs
    assert ("high_variance", 1, "sequential") in runs
    for key in ("continuous_over_static_tokps", "ours_over_mlxlm_tokps",
                "stallfree_p99_tbt_over_decode_step", "naive_p99_tbt_over_decode_step",
                "mlxlm_p99_tbt_over_decode_step", "fused_over_chunk_alone", "b16_over_b1_decode",
                "scheduler_overhead_share"):
        value = saved["figures"][key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    assert (tmp_path / "bench_throughput.png").stat().st_size > 10_000
    assert (tmp_path / "bench_interference_latency.png").stat().st_size > 10_000
