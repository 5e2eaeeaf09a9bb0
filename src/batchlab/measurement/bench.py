"""``batchlab bench``: every engine of ours and mlx-lm's BatchGenerator on the same
workloads, in one run, so the ratios between them are fair on a noisy machine.

The standard mode (the default) runs every engine once per repetition, interleaved, three
repetitions, and reports each figure as the median with its spread, the load average
around every run and the share of the CPUs other processes took during it, and the
machine's limits (sgemm and memory copy rates) with how close
prefill and decode come to them. ``--quick`` is a smoke run: small workloads, once.

Speculative decoding by prompt lookup runs on and off, side by side: the stall-free engine
and the same engine drafting ``SPEC_TOKENS`` tokens a decode row (``stallfree-spec``), on the
echo workload (the answer is in the prompt) and the chat workload, at B=1 and at the standard
batch size.

Structured output runs on the structured workload (each prompt asks for a JSON record and
carries its schema): the stall-free engine constraining every answer to the schema, the same
engine on the same prompts unconstrained (``stallfree-unconstrained``, EOS honoured), and
mlx-lm, which cannot constrain (EOS honoured). The figures say how many answers are valid JSON
of the schema (by ``json`` and ``jsonschema``) and what the constraint costs.

Prints a table, writes a JSON with every run's metrics plus the headline ``figures``,
and saves plots (of the first repetition) next to the JSON.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import time
from pathlib import Path

from mlx.utils import tree_flatten

from . import driver, microbench, workloads
from ..core import metrics
from ..core.engine import make_engine, scheduler_class
from ..core.scheduler import (
    KINDS,
    ContinuousScheduler,
    SequentialScheduler,
    StallFreeScheduler,
    StaticScheduler,
)
from ..core.structured import ll_tokenizer, violation
from ..model.load import LoadedModel
from .peers import run_mlxlm_workload
from ..core.trace import Trace

CHUNK = ContinuousScheduler.bench_variants["chunked"]["prefill_step"]  # its prefill_step
PREFILL_HEAVY = "high_variance"  # the workload whose figures keep their old, unprefixed names
# kind names as the registry's classes carry them (the bench's figures name these engines)
SEQUENTIAL, STATIC = SequentialScheduler.kind, StaticScheduler.kind
CONTINUOUS, STALLFREE = ContinuousScheduler.kind, StallFreeScheduler.kind
MLXLM = "mlx-lm"  # the peer, mlx-lm's BatchGenerator: not a kind of ours

# Speculative decoding by prompt lookup, on and off: the stall-free engine beside itself with
# SPEC_TOKENS draft tokens a decode row (prompt lookup's n-grams at their defaults, 1 to 4).
SPEC = f"{STALLFREE}-spec"
SPEC_TOKENS = 3
ECHO = "echo"  # the workload whose answers are in their prompts
SPEC_WORKLOADS = (ECHO, "chat")  # speculation on and off, at B=1 and the standard B
B1_REQUESTS = 4  # a B=1 run takes the first few requests: all of them, one at a time, take minutes
SPEC_NOTE = "mlx-lm has no prompt lookup: its rows never speculate"

# Structured output: the stall-free engine with every answer constrained to its JSON schema,
# beside itself on the same prompts unconstrained, and mlx-lm (which cannot constrain); all
# end at EOS.
STRUCTURED = "structured"  # the experiment and its workload
UNCONSTRAINED = f"{STALLFREE}-unconstrained"
STRUCTURED_NOTE = (
    "mlx-lm cannot constrain an answer (BatchGenerator has no masks; mlx_lm.server ignores "
    "response_format): on the structured workload it answers the same prompts freely, ending at EOS"
)


def engines(batch_size: int) -> dict[str, dict]:
    """Our engine configurations at one batch size (name -> make_engine arguments), from
    the registry: every kind's ``bench_variants``. The stall-free engine gets no token
    budget: it takes the one its TBT target implies, and its trace records it."""
    return {
        name: dict(kind=kind, max_batch_size=batch_size, **options)
        for kind, cls in KINDS.items()
        for name, options in cls.bench_variants.items()
    }


def spec_engines(batch_size: int) -> dict[str, dict]:
    """The speculating engine at one batch size (name -> make_engine arguments): the bench
    declares it here, beside the registry's variants; it runs only where ``engines_for`` says."""
    return {SPEC: dict(kind=STALLFREE, max_batch_size=batch_size, num_speculative_tokens=SPEC_TOKENS)}


def b1(name: str) -> str:
    """The experiment of ``name``'s first ``B1_REQUESTS`` requests at B=1 (speculation only)."""
    return f"{name}_b1"


def spec_only(name: str) -> bool:
    """Whether experiment ``name`` runs only the stall-free engine with speculation and without:
    the echo workload, and every workload's B=1 experiment."""
    return name == ECHO or name in {b1(w) for w in SPEC_WORKLOADS}


def engines_for(name: str, batch_size: int, extra: list[str] = ()) -> list[str]:
    """The engines that run experiment ``name`` at ``batch_size``, in the order they run: ours
    (the speculating one after them where the workload is one of ``SPEC_WORKLOADS``), then
    ``extra`` (a learner's) and mlx-lm; a speculation-only experiment runs the stall-free
    engine on and off, nothing else; the structured one the stall-free engine constrained and
    unconstrained, then mlx-lm."""
    if spec_only(name):
        return [STALLFREE, SPEC]
    if name == STRUCTURED:
        return [STALLFREE, UNCONSTRAINED, MLXLM]
    ours = [*engines(batch_size), *([SPEC] if name in SPEC_WORKLOADS else [])]
    return [*ours, *extra, MLXLM]


def engine_args(config: dict, tbt_slo: float | None = None) -> dict:
    """make_engine arguments for one configuration: ``tbt_slo`` goes to every scheduler that
    takes it."""
    args = dict(config)
    options = scheduler_class(args["kind"]).option_defaults()
    if "tbt_slo" in options:
        if tbt_slo is not None:
            args.setdefault("tbt_slo", tbt_slo)
    return args


LOAD_THRESHOLD = 1.5  # without /proc/stat: a load average above this marks the bench
OTHERS_THRESHOLD = 0.10  # other processes taking more of the CPUs during a run mark the bench


def plan(lm: LoadedModel, quick: bool) -> list[tuple[str, workloads.Workload, list[int]]]:
    """(name, workload, batch sizes) of every experiment: the chat-shaped workload (answers
    longer than questions: decode-bound), the prefill-heavy one (short answers) and the
    interference one (long prompts arriving while short ones decode). The standard workloads
    have >= 32 requests, so static batching at B=16 runs several batches, not one. Then the
    speculation experiments (``speculation_plan``) and the structured-output one."""
    tok = lm.tokenizer
    if quick:
        chat = workloads.chat(tok, num_requests=4, mean_output=8, max_output=16)
        echo = workloads.echo(tok, num_requests=4, output_range=(8, 12), prompt_range=(80, 112))
        # room for the 4 records (55-70 tokens on the course model): a smoke run shows validity
        structured = workloads.structured(tok, num_requests=4, max_new_tokens=72)
        return [  # a smoke run: every engine and figure once, on workloads a few seconds long
            ("chat", chat, [8]),
            (
                PREFILL_HEAVY,
                workloads.high_variance(tok, num_requests=6, mean_output=6, max_output=12),
                [8, 16],
            ),
            (
                "interference",
                workloads.interference(tok, batch_size=8, num_long=1, long_range=(512, 544), long_output=8),
                [8],
            ),
            *speculation_plan(chat, echo, 8),
            (STRUCTURED, structured, [8]),
        ]
    # Sized for <= 25 minutes on a quiet 2-core CPU with three repetitions: 32 chat requests
    # (answers averaging 70 tokens) are two static batches at B=16, 48 short-answer requests
    # three; ShareGPT's arrivals span over a minute a run, so it is left to `batchlab run`
    # and the serving benchmark. The speculation experiments (the speculating engine on chat,
    # the echo workload, both at B=1) come on top of that budget, and so does the structured
    # one (16 JSON records of at most 96 tokens, three engines: about a minute a repetition).
    chat = workloads.chat(tok, num_requests=32)
    return [
        ("chat", chat, [16]),
        (PREFILL_HEAVY, workloads.high_variance(tok, num_requests=48, mean_output=16, max_output=64), [16]),
        ("interference", workloads.interference(tok, batch_size=8, num_long=2, long_range=(512, 1024)), [8]),
        *speculation_plan(chat, workloads.echo(tok, size="full"), 16),
        (STRUCTURED, workloads.structured(tok, size="full"), [16]),
    ]


def speculation_plan(chat, echo, batch_size: int, b1_requests: int = B1_REQUESTS) -> list:
    """The speculation experiments beside ``plan``'s: the echo workload at ``batch_size`` (the
    chat workload's own runs there get the speculating engine too), and both workloads' first
    ``b1_requests`` requests at B=1. Each runs the stall-free engine on and off only."""
    return [
        (ECHO, echo, [batch_size]),
        (b1(ECHO), echo.head(b1_requests), [1]),
        (b1("chat"), chat.head(b1_requests), [1]),
    ]


def schedule(experiments, repetitions: int, extra: list[str] = ()) -> list[tuple[int, str, int, str]]:
    """Every run as (repetition, workload, batch size, engine), engines interleaved: each
    repetition runs every engine once (A B C A B C ...), so a slow minute of a shared machine
    spreads over all engines instead of landing on one. ``extra``: more engines' names (a
    learner's), run after ours (``engines_for``: who runs where). The sequential baseline runs
    in the first repetition only:
    no figure is a ratio to it, it is a table row (the no-batching reference), and it is the
    slowest run of the prefill-heavy workload."""
    order = []
    for name, _, batch_sizes in experiments:
        baseline = [(1, SEQUENTIAL)] if name == PREFILL_HEAVY else []  # it has no batch size
        runs = baseline + [(b, e) for b in batch_sizes for e in engines_for(name, b, extra)]
        order += [
            (rep, name, b, e)
            for rep, (b, e) in driver.interleaved_order(runs, repetitions)
            if rep == 0 or (b, e) not in baseline
        ]
    return order


def _itself(value):
    return value


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (workload, batch size, engine): each numeric metric's median over the
    repetitions, with its spread under ``spread`` as [min, max]."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["workload"], run["batch_size"], run["engine"]), []).append(run)
    rows = []
    for (name, b, engine), group in groups.items():
        row = {"workload": name, "batch_size": b, "engine": engine, "repetitions": len(group), "spread": {}}
        for key, value in group[0].items():
            if (
                key in row
                or key in ("repetition", "load_before", "load_after")
                or isinstance(value, bool)
                or not isinstance(value, (int, float, type(None)))
            ):
                continue
            row[key], span = metrics.median_range([r.get(key) for r in group], _itself)
            if span is not None:
                row["spread"][key] = list(span)
        rows.append(row)
    return rows


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU-seconds every core has spent busy since boot, counting time the hypervisor
    stole; CPU-seconds this process and its children have used), or None without
    ``/proc/stat`` (macOS). Differences over a run give what other processes took: a load
    average cannot tell, since it counts this process's own threads."""
    try:
        with open("/proc/stat") as f:
            ticks = [
                int(x) for x in f.readline().split()[1:9]
            ]  # user nice system idle iowait irq softirq steal
    except OSError:
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    own = sum(
        getattr(resource.getrusage(who), field)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for field in ("ru_utime", "ru_stime")
    )
    return busy, own


def others_share(before, after, seconds: float) -> float | None:
    """The share of all CPUs that other processes used between two ``cpu_seconds()``."""
    if before is None or after is None or seconds <= 0:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / (seconds * (os.cpu_count() or 1))


def watched(measure, *args):
    """``measure(*args)`` with the load around it: its result and a record of the load
    average before and after and the CPU share other processes took meanwhile."""
    load, cpu, start = os.getloadavg()[0], cpu_seconds(), time.perf_counter()
    result = measure(*args)
    share = others_share(cpu, cpu_seconds(), time.perf_counter() - start)
    return result, {"load_before": load, "load_after": os.getloadavg()[0], "others_cpu_share": share}


def under_load(records: list[dict]) -> bool:
    """True when other processes took more than ``OTHERS_THRESHOLD`` of the CPUs during any
    run; where that cannot be measured, when a load average exceeded ``LOAD_THRESHOLD``."""
    shares = [r["others_cpu_share"] for r in records if r.get("others_cpu_share") is not None]
    if shares:
        return max(shares) > OTHERS_THRESHOLD
    return any(r[k] > LOAD_THRESHOLD for r in records for k in ("load_before", "load_after"))


def run_engine(
    lm,
    wl: workloads.Workload,
    batch_size: int,
    engine_name: str,
    progress: bool,
    runner=None,
    tbt_slo: float | None = None,
    extra_engines: dict[str, dict] | None = None,
) -> Trace:
    """One run of one engine on one workload (a fresh engine: no state carries over).
    ``extra_engines``: name -> make_engine arguments (with ``kind``, a name or a Scheduler
    subclass) of engines beside ours; ``max_batch_size`` defaults to the run's. Requests with
    ``structured_outputs`` are constrained on our engines and end at EOS; ``UNCONSTRAINED`` is
    the stall-free engine on the same prompts without the constraint, EOS honoured; mlx-lm
    cannot constrain, and honours EOS on those requests."""
    if engine_name == MLXLM:
        return run_mlxlm_workload(lm, wl, batch_size, progress=progress)
    options = {}
    if engine_name == UNCONSTRAINED:
        engine_name, wl, options = STALLFREE, wl.without_constraints(), dict(stop_at_eos=True)
    if engine_name == SEQUENTIAL:
        config = dict(kind=SEQUENTIAL)
    elif extra_engines and engine_name in extra_engines:
        config = {"max_batch_size": batch_size, **extra_engines[engine_name]}
    else:
        config = {**engines(batch_size), **spec_engines(batch_size)}[engine_name]
    args = engine_args(config, tbt_slo)
    return driver.run_workload(
        make_engine(args.pop("kind"), lm, runner=runner, **args), wl, progress=progress, **options
    )


DECODE_BATCHES = (1, 8, 16)  # decode steps timed on our runner, each against its roofline


def measure_machine(lm: LoadedModel) -> dict:
    """The micro-benchmarks and the machine's limits, each with the load around it."""
    out = {"microbench_loads": {}}
    for key, measure in [
        ("limits", machine_limits),
        ("fused_step", microbench.fused_step_ratio),
        ("chunk_context", microbench.chunk_context_ratio),
        ("one_row_linears", microbench.one_row_linears),
        ("decode_scaling", lambda lm: microbench.decode_scaling(lm, list(DECODE_BATCHES))),
    ]:
        out[key], out["microbench_loads"][key] = watched(measure, lm)
    return out


def linear_flops_per_token(args) -> int:
    """FLOPs of one token through every layer's linear maps (q, k, v, o projections; gate,
    up, down), from the model's config: 2 per weight. The LM head is left out: a prefill
    chunk runs it once, for its last token only."""
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    per_layer = (
        args.hidden_size * head_dim * (2 * heads + 2 * kv_heads)
        + 3 * args.hidden_size * args.intermediate_size
    )
    return 2 * args.num_hidden_layers * per_layer


def head_flops_per_token(args) -> int:
    """FLOPs of the LM head for one sampled row: 2 per weight of the vocab x hidden matrix."""
    return 2 * args.vocab_size * args.hidden_size


def machine_limits(lm: LoadedModel) -> dict:
    """What this machine can do at best: sgemm GFLOP/s and memory copy GB/s, and from them
    the model's bounds: prefill tokens/s if every linear layer ran at the sgemm rate, the
    B=1 decode step if reading every weight once ran at the copy rate, and each timed decode
    step's roofline: max(its linear + LM-head FLOPs / sgemm, the weights' bytes / copy)."""
    flops_per_token = linear_flops_per_token(lm.args)
    head = head_flops_per_token(lm.args)
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))
    sgemm = microbench.sgemm_gflops()
    copy = microbench.copy_gbps()
    return {
        "sgemm_gflops": sgemm,
        "copy_gbps": copy,
        "linear_flops_per_token": flops_per_token,
        "head_flops_per_token": head,
        "weight_bytes": weight_bytes,
        "prefill_bound_tokens_per_s": sgemm * 1e9 / flops_per_token,
        "decode_bound_step_s": weight_bytes / (copy * 1e9),
        "decode_roofline_s": {
            b: max(b * (flops_per_token + head) / (sgemm * 1e9), weight_bytes / (copy * 1e9))
            for b in DECODE_BATCHES
        },
    }


def run_experiments(lm, experiments, repetitions, run, progress, runner, tbt_slo, extra_engines):
    """Every (workload, batch size, engine) run ``repetitions`` times in the interleaved order
    of ``schedule``: one summary row per run (with the machine's load around it), and each
    repetition's traces by (workload, batch size, engine)."""
    by_name = {name: wl for name, wl, _ in experiments}
    runs: list[dict] = []
    traces: list[dict[tuple[str, int, str], Trace]] = [{} for _ in range(repetitions)]
    for rep, name, b, engine_name in schedule(experiments, repetitions, list(extra_engines)):
        trace, load = watched(
            run, lm, by_name[name], b, engine_name, progress, runner, tbt_slo, extra_engines
        )
        traces[rep][(name, b, engine_name)] = trace
        summary = {"workload": name, "batch_size": b, "engine": engine_name, "repetition": rep}
        runs.append({**summary, **load, **metrics.summarize(trace)})
    return runs, traces


def median_figures(per_rep: list[dict]) -> tuple[dict, dict]:
    """Each figure's median over the repetitions, with its range where it varies; a name or
    a setting takes its most common value."""
    figures, spreads = {}, {}
    for key, value in per_rep[0].items():
        if isinstance(value, float) or value is None:
            figures[key], span = metrics.median_range([f[key] for f in per_rep], _itself)
            if span is not None:
                spreads[key] = list(span)
        else:
            values = [json.dumps(f[key]) for f in per_rep]
            figures[key] = json.loads(max(set(values), key=values.count))
    return figures, spreads


def run_bench(
    lm: LoadedModel,
    quick: bool = False,
    json_out: str | None = None,
    progress: bool = True,
    repetitions: int | None = None,
    runner=None,
    run=run_engine,
    measure=measure_machine,
    tbt_slo: float | None = None,
    extra_engines: dict[str, dict] | None = None,
    only: list[str] | None = None,
) -> dict:
    """Every engine on every workload, interleaved, ``repetitions`` times (1 with ``quick``,
    else 3); ``run`` and ``measure`` are the run of one engine and the micro-benchmarks
    (tests pass stand-ins). ``tbt_slo`` (seconds) goes to every engine that takes a TBT
    target (the stall-free one picks its budget from it; None: its default target);
    ``extra_engines`` (name -> make_engine arguments, ``kind`` a name or a Scheduler
    subclass) run beside ours in every repetition, e.g. a learner's engine. ``only`` keeps the
    experiments of those names (``plan``'s: chat, high_variance, interference, echo, echo_b1,
    chat_b1, structured), a shorter road to one figure; an unknown name is a ValueError."""
    started = time.time()
    repetitions = repetitions or (1 if quick else 3)
    extra_engines = dict(extra_engines or {})
    clash = set(extra_engines) & {SEQUENTIAL, MLXLM, UNCONSTRAINED, *engines(1), *spec_engines(1)}
    if clash:
        raise ValueError(f"extra engine names must differ from ours: {', '.join(sorted(clash))}")
    experiments = plan(lm, quick)
    if only:
        names = [name for name, _, _ in experiments]
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ValueError(f"no experiment named {', '.join(unknown)}; the bench runs {', '.join(names)}")
        experiments = [e for e in experiments if e[0] in only]
    if any(name == STRUCTURED for name, _, _ in experiments):
        # llguidance's view of the tokenizer is built once a process (about 0.2 s) and kept: a
        # server pays it at its first constrained request, not in every request's TTFT
        ll_tokenizer(lm.tokenizer)
    runs, traces = run_experiments(
        lm, experiments, repetitions, run, progress, runner, tbt_slo, extra_engines
    )
    machine = measure(lm)
    per_rep = [headline_figures(t, experiments, machine, list(extra_engines), lm.tokenizer) for t in traces]
    figures, spreads = median_figures(per_rep)
    figures["stallfree_token_budget"] = stallfree_budgets(traces[0])
    result = {
        "machine": f"{platform.system()} {platform.machine()}",
        "quick": quick,
        "repetitions": repetitions,
        "model": lm.info.name,
        "dtype": lm.info.dtype,
        "backend": lm.info.backend,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": time.time() - started,
        **load_summary(runs + list(machine.get("microbench_loads", {}).values())),
        "workloads": {name: wl.summary() for name, wl, _ in experiments},
        "tbt_slo": tbt_slo,
        "extra_engines": sorted(extra_engines),
        "runs": runs,
        "medians": aggregate(runs),
        **machine,
        "figures": figures,
        "figure_spreads": spreads,
    }
    if json_out:
        write_result(result, traces[0], json_out)
    return result


def stallfree_budgets(traces: dict[tuple[str, int, str], Trace]) -> dict[str, int]:
    """The token budget of each stall-free run by batch size, as the scheduler chose it
    (from its TBT target); the speculating engine's is the same (its drafts are paid from it)."""
    return {
        str(b): trace.token_budget
        for (_, b, engine_name), trace in sorted(traces.items())
        if engine_name == STALLFREE
    }


def load_summary(records: list[dict]) -> dict:
    """The load around every run and micro-benchmark: the thresholds, the highest load
    average and CPU share of other processes, and whether the bench ran under load."""
    shares = [r["others_cpu_share"] for r in records if r.get("others_cpu_share") is not None]
    return {
        "load_threshold": LOAD_THRESHOLD,
        "others_threshold": OTHERS_THRESHOLD,
        "max_load": max(r[k] for r in records for k in ("load_before", "load_after")),
        "max_others_cpu_share": max(shares) if shares else None,
        "under_load": under_load(records),
    }


def write_result(result: dict, traces: dict[tuple[str, int, str], Trace], json_out: str) -> None:
    """The bench's JSON at ``json_out``, and the plots of ``traces`` (one repetition's) beside it."""
    out = Path(json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    save_plots(traces, out.with_suffix(""))


def _ratio(a, b):
    return a / b if a is not None and b else None


def headline_figures(traces, experiments, machine: dict, extra: list[str] = (), tokenizer=None) -> dict:
    """The ratios the README quotes, from one repetition's runs and the micro-benchmarks
    (``measure_machine``) of this same invocation: batching figures for every workload but
    the interference one, the speculation-only ones and the structured one, the interference
    workload's latency figures, speculation on and off, structured output (its answers read
    with ``tokenizer``), the machine's limits, and each decode step against its roofline."""
    figures = {}
    for name, wl, batch_sizes in experiments:
        if not name.startswith("interference") and not spec_only(name) and name != STRUCTURED:
            figures.update(batching_figures(traces, name, wl, max(batch_sizes), machine, extra))
    figures.update(interference_figures(traces, experiments))
    figures.update(speculation_figures(traces, experiments))
    figures.update(structured_figures(traces, experiments, tokenizer))
    figures.update(machine_figures(machine))
    heavy = next((bs for n, _, bs in experiments if n == PREFILL_HEAVY), None)
    if heavy is not None:  # not run (``only``)
        figures["scheduler_overhead_share"] = metrics.scheduler_share(
            traces[(PREFILL_HEAVY, max(heavy), STALLFREE)]
        )
    figures.update(roofline_figures(machine))
    figures["batch_sizes"] = {name: max(bs) for name, _, bs in experiments}
    return figures


def no_waste_tokps(wl: workloads.Workload, b: int, machine: dict) -> float | None:
    """What an engine with no padding and every slot full would reach: each prompt token at
    the measured prefill rate, then full-batch decode steps. An estimate of the ceiling for
    any batching engine (a fused step's decode rows ride a little cheaper), so every engine
    can be read as a fraction of it."""
    fused, summary = machine["fused_step"], wl.summary()
    full_step = {int(k): v for k, v in machine["decode_scaling"].items()}.get(b, {}).get("step_s")
    if not full_step:
        return None
    seconds = (
        summary["prompt_tokens"] * fused["chunk_alone_s"] / fused["chunk"]
        + math.ceil((summary["output_tokens"] - summary["requests"]) / b) * full_step
    )
    return summary["output_tokens"] / seconds


def batching_figures(traces, name: str, wl: workloads.Workload, b: int, machine: dict, extra) -> dict:
    """One workload's throughput figures at its largest batch size, named by workload
    (``chat_...``); the prefill-heavy workload's keep their old, unprefixed names."""

    def tokps(engine):
        key = (name, b, engine)
        return metrics.output_tokens_per_s(traces[key]) if key in traces else None

    prefix = "" if name == PREFILL_HEAVY else f"{name}_"
    ours = {e: tokps(e) for e in engines(b)}
    best = max(ours, key=lambda e: ours[e] or 0)
    no_waste = no_waste_tokps(wl, b, machine)
    figures = {
        f"{prefix}continuous_over_static_tokps": _ratio(ours[CONTINUOUS], ours[STATIC]),
        f"{prefix}no_waste_over_static_tokps": _ratio(no_waste, ours[STATIC]),
        f"{prefix}ours_over_mlxlm_tokps": _ratio(ours[best], tokps(MLXLM)),
        f"{prefix}ours_best_engine": best,
    }
    for e in [*engines(b), *extra, MLXLM]:
        figures[f"{name}_fraction_of_no_waste_{e.replace('-', '_')}"] = _ratio(tokps(e), no_waste)
    return figures


def interference_figures(traces, experiments) -> dict:
    """The interference workload: p99 time between tokens of the naive (continuous),
    stall-free and mlx-lm engines in decode steps, and what stall-free costs in throughput."""
    found = next((x for x in experiments if x[0].startswith("interference")), None)
    if found is None:  # not run (``only``)
        return {}
    name, _, (b, *_) = found
    # decode step: median decode-only step of the naive engine with every short request decoding
    step = metrics.decode_step_s(traces[(name, b, CONTINUOUS)], b - 1)

    def p99_over_step(engine):
        return _ratio(metrics.percentile(metrics.tbt_values(traces[(name, b, engine)]), 99), step)

    return {
        "stallfree_p99_tbt_over_decode_step": p99_over_step(STALLFREE),
        "naive_p99_tbt_over_decode_step": p99_over_step(CONTINUOUS),
        "mlxlm_p99_tbt_over_decode_step": p99_over_step(MLXLM),
        "stallfree_tokps_over_naive": _ratio(
            metrics.output_tokens_per_s(traces[(name, b, STALLFREE)]),
            metrics.output_tokens_per_s(traces[(name, b, CONTINUOUS)]),
        ),
        "decode_step_s": step,
    }


def speculation_figures(traces, experiments) -> dict:
    """Speculation on against off, for every experiment and batch size where both ran, named
    ``<workload>_b<B>_spec_...``: the share of drafts accepted, the tokens a verify row yields
    (1 + its accepted drafts), decode rows per output token, and the speed-up (output tokens/s
    with speculation over without, this repetition; the bench reports the median over
    repetitions); where mlx-lm ran too (chat at the standard B), speculation's tokens/s over
    mlx-lm's, which never speculates."""
    figures = {}
    for name, _, batch_sizes in experiments:
        for b in batch_sizes:
            on, off = traces.get((name, b, SPEC)), traces.get((name, b, STALLFREE))
            if on is None or off is None:
                continue
            prefix = f"{name if name.endswith(f'_b{b}') else f'{name}_b{b}'}_spec"
            spec = metrics.speculation(on)
            figures[f"{prefix}_acceptance_rate"] = spec["spec_acceptance_rate"]
            figures[f"{prefix}_tokens_per_verify_row"] = spec["spec_tokens_per_verify_row"]
            figures[f"{prefix}_passes_per_token"] = spec["spec_passes_per_token"]
            on_tokps = metrics.output_tokens_per_s(on)
            figures[f"{prefix}_speedup_tokps"] = _ratio(on_tokps, metrics.output_tokens_per_s(off))
            if (name, b, MLXLM) in traces:
                figures[f"{prefix}_over_mlxlm_tokps"] = _ratio(
                    on_tokps, metrics.output_tokens_per_s(traces[(name, b, MLXLM)])
                )
    return figures


def structured_figures(traces, experiments, tokenizer) -> dict:
    """Structured output on the structured workload at its batch size, from one repetition:
    ``structured_validity``, the share of the constrained engine's answers that ended at EOS
    ("stop") and are valid (``answer_validity``), and ``structured_length_cut``, how many
    ended at ``max_new_tokens`` instead; the same for the stall-free engine on the same prompts
    unconstrained (``_free``) and for mlx-lm, which cannot constrain (``_mlxlm``); the
    constrained engine's output tokens/s and TTFT p50 over the unconstrained one's (its TTFT
    includes compiling each request's grammar at submit); and ``structured_mask_share``, the
    constrained run's time filling masks over its steps' time (our engine fills them before
    the pass, so that time is on every step's path)."""
    found = next(((wl, max(bs)) for name, wl, bs in experiments if name == STRUCTURED), None)
    if found is None:
        return {}
    wl, b = found
    specs = {r.id: r.structured_outputs for r in wl.requests}
    figures = {}
    for engine, suffix in ((STALLFREE, ""), (UNCONSTRAINED, "_free"), (MLXLM, "_mlxlm")):
        trace = traces.get((STRUCTURED, b, engine))
        if trace is not None:
            validity, cut = answer_validity(trace, tokenizer, specs)
            figures[f"structured_validity{suffix}"] = validity
            figures[f"structured_length_cut{suffix}"] = cut
    on, off = traces.get((STRUCTURED, b, STALLFREE)), traces.get((STRUCTURED, b, UNCONSTRAINED))
    if on is not None and off is not None:
        figures["structured_over_free_tokps"] = _ratio(
            metrics.output_tokens_per_s(on), metrics.output_tokens_per_s(off)
        )
        figures["structured_over_free_ttft_p50"] = _ratio(
            metrics.percentile(metrics.ttft_values(on), 50), metrics.percentile(metrics.ttft_values(off), 50)
        )
    if on is not None:
        figures["structured_mask_share"] = _ratio(
            sum(s.mask_s for s in on.steps), sum(s.end_s - s.start_s for s in on.steps)
        )
    return figures


def answer_text(tokenizer, token_ids) -> str:
    """An answer's text: its tokens decoded, EOS ids dropped."""
    eos = tokenizer.eos_token_ids
    return tokenizer.decode([t for t in token_ids if t not in eos])


def answer_valid(text: str, spec: dict) -> bool:
    """Whether ``text`` matches ``spec`` (``structured.violation``: references outside the
    engine's grammar library)."""
    return violation(spec, text) is None


def answer_validity(trace: Trace, tokenizer, specs: dict[str, dict | None]) -> tuple[float | None, int]:
    """(the share of the answers that ended "stop" whose text matches their request's spec
    in ``specs``, by id (None: no answer ended "stop"); how many answers ended "length").
    Requests without a spec are left out: the unconstrained runs are judged by the spec their
    prompt came with."""
    stopped = valid = cut = 0
    for rid, rec in trace.requests.items():
        spec = specs.get(rid)
        if spec is None:
            continue
        if rec.finish_reason == "length":
            cut += 1
        elif rec.finish_reason == "stop":
            stopped += 1
            valid += answer_valid(answer_text(tokenizer, rec.output_ids), spec)
    return (valid / stopped if stopped else None), cut


def machine_figures(machine: dict) -> dict:
    """The machine's limits and how far our passes are from them."""
    fused, limits = machine["fused_step"], machine["limits"]
    scaling = {int(b): v for b, v in machine["decode_scaling"].items()}
    return {
        "fused_over_chunk_alone": fused["fused_over_chunk_alone"],
        "b16_over_b1_decode": _ratio(scaling[16]["tokens_per_s"], scaling[1]["tokens_per_s"]),
        "chunk_1k_over_chunk_0": machine["chunk_context"]["chunk_1k_over_chunk_0"],
        "sgemm_gflops": limits["sgemm_gflops"],
        "copy_gbps": limits["copy_gbps"],
        # prefill tokens/s (the fused benchmark's chunk alone) over the sgemm-bound rate
        "prefill_fraction_of_sgemm_bound": _ratio(
            fused["chunk"] / fused["chunk_alone_s"], limits["prefill_bound_tokens_per_s"]
        ),
        "decode_fraction_of_bandwidth_bound": _ratio(limits["decode_bound_step_s"], scaling[1]["step_s"]),
        # why B=1 decode is far from the bound: its share in MLX's one-row matmuls, and
        # how much slower those are than numpy's GEMV on the same weights
        "one_row_linears_share_of_decode_step": _ratio(
            machine["one_row_linears"]["mlx_s"], scaling[1]["step_s"]
        ),
        "one_row_linears_mlx_over_numpy": machine["one_row_linears"]["mlx_over_numpy"],
    }


def roofline_figures(machine: dict) -> dict:
    """Each decode step of our runner as a multiple of its roofline, and of the roofline once
    the rows' KV reads count too."""
    limits = machine["limits"]
    scaling = {int(b): v for b, v in machine["decode_scaling"].items()}
    roofline = {int(b): v for b, v in limits.get("decode_roofline_s", {}).items()}
    figures = {}
    for b in sorted(roofline):
        if b in scaling:
            figures[f"decode_b{b}_over_roofline"] = _ratio(scaling[b]["step_s"], roofline[b])
            if "kv_bytes_read" in scaling[b]:
                with_kv = (limits["weight_bytes"] + scaling[b]["kv_bytes_read"]) / (limits["copy_gbps"] * 1e9)
                figures[f"decode_b{b}_over_roofline_with_kv"] = _ratio(
                    scaling[b]["step_s"], max(roofline[b], with_kv)
                )
    return figures


def format_table(result: dict) -> str:
    """The medians over the repetitions, each with its min-max spread, under a header that
    says the repetitions and the load (and warns when the machine was loaded)."""
    rows = table_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    note = [SPEC_NOTE] if any("_spec_" in k for k in result["figures"]) else []
    note += [STRUCTURED_NOTE] if any(k.startswith("structured_") for k in result["figures"]) else []
    return (
        "\n".join([table_header(result), *lines, "", *figure_lines(result), *note]) + "\n(times in seconds)"
    )


TABLE_COLUMNS = [  # (heading, summary key, format)
    ("workload", "workload", "{}"),
    ("B", "batch_size", "{}"),
    ("engine", "engine", "{}"),
    ("tok/s", "output_tokens_per_s", "{:.1f}"),
    ("TTFT p50", "ttft_p50_s", "{:.2f}"),
    ("TTFT p99", "ttft_p99_s", "{:.2f}"),
    ("TBT p50", "tbt_p50_s", "{:.3f}"),
    ("TBT p99", "tbt_p99_s", "{:.3f}"),
    ("TBT max", "tbt_max_s", "{:.3f}"),
    ("occupancy", "slot_occupancy", "{:.0%}"),
]


def table_rows(result: dict) -> list[list[str]]:
    """The table's cells: the headings, then one row per median row, each figure with its
    min-max spread, and the load around that row's runs."""

    def cell(row, key, fmt):
        if row.get(key) is None:
            return "-"
        low, high = row["spread"].get(key, (row[key], row[key]))
        text = fmt.format(row[key])
        return text if low == high or fmt == "{}" else f"{text} ({fmt.format(low)}-{fmt.format(high)})"

    def load(row):  # load averages at the start and end of this row's runs; others' CPU share
        runs = [
            r
            for r in result["runs"]
            if (r["workload"], r["batch_size"], r["engine"])
            == (row["workload"], row["batch_size"], row["engine"])
        ]
        values = [r[k] for r in runs for k in ("load_before", "load_after")]
        shares = [r["others_cpu_share"] for r in runs if r.get("others_cpu_share") is not None]
        return [f"{min(values):.1f}-{max(values):.1f}", f"{max(shares):.0%}" if shares else "-"]

    rows = [[h for h, _, _ in TABLE_COLUMNS] + ["load", "others"]]
    return rows + [
        [cell(row, k, fmt) for _, k, fmt in TABLE_COLUMNS] + load(row) for row in result["medians"]
    ]


def table_header(result: dict) -> str:
    """What the table shows: the repetitions and the load, with a warning under load."""
    header = (
        f"median of {result['repetitions']} interleaved repetition(s), (min-max), the "
        f"sequential baseline one run; "
        f"load: load average (1 min) at the start and end of the runs; others: the most "
        f"of the CPUs other processes took during one of them"
    )
    if result["under_load"]:
        why = (
            f"other processes took up to {result['max_others_cpu_share']:.0%} of the CPUs "
            f"during a run, > {result['others_threshold']:.0%}"
            if result.get("max_others_cpu_share") is not None
            else f"load average up to {result['max_load']:.2f} > {result['load_threshold']}"
        )
        header = f"UNDER LOAD ({why}): absolute times are unreliable, ratios less so. " + header
    return header


def figure_lines(result: dict) -> list[str]:
    """One line per headline figure, with its min-max spread where the repetitions differ."""
    lines = []
    for k, v in result["figures"].items():
        spread = result["figure_spreads"].get(k)
        text = f"{v:.3f}" if isinstance(v, float) else f"{v}"
        if spread and spread[0] != spread[1]:
            text += f" ({spread[0]:.3f}-{spread[1]:.3f})"
        lines.append(f"{k:38s} {text}")
    return lines


def save_plots(traces, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .. import viz

    paths = []
    fig, ax = plt.subplots(figsize=(10, 4))
    labels, values = [], []
    for (name, b, engine), trace in traces.items():
        labels.append(f"{name}\nB={b} {engine}")
        values.append(metrics.output_tokens_per_s(trace) or 0)
    ax.bar(range(len(values)), values, color=[viz.request_color(f"req-{i % 8}") for i in range(len(values))])
    ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput of every run")
    fig.tight_layout()
    paths.append(stem.parent / f"{stem.name}_throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    inter = {f"B={b} {e}": t for (n, b, e), t in traces.items() if n.startswith("interference")}
    if inter:
        fig = viz.plot_latency_cdfs(inter)
        paths.append(stem.parent / f"{stem.name}_interference_latency.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
