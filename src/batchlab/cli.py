"""The ``batchlab`` command: info, kinds, generate, demo, serve, loadgen, export-mlx, bench, fit-cost."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .core.engine import KINDS, EngineFailing, scheduler_class
from .core.scheduler import Option


def _cmd_info(args) -> int:
    import importlib.metadata as md
    import platform

    from . import _blas
    import mlx.core as mx
    from .measurement.microbench import copy_gbps, sgemm_gflops
    from .model.backend import describe as describe_path
    from .model.load import backend, load_model

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    print(
        f"batchlab   {version('batchlab')}   python {platform.python_version()}  "
        f"({platform.system()} {platform.machine()})"
    )
    print(f"mlx        {mx.__version__}   mlx-lm {version('mlx-lm')}   tokenizers {version('tokenizers')}")
    print(f"backend    {backend()}  (default device: {mx.default_device()})")
    print(f"path       {describe_path()}")
    blas = _blas.STATUS
    print(f"BLAS       {blas.name}  (MLX's matmuls on the CPU)")
    print(f"           {blas.path or '-'}: {blas.note}")
    if blas.core:
        print(f"kernel     {blas.core}: {blas.core_reason}")
    where = f"on the {backend()}" + (f", {blas.core} kernel" if blas.core and backend() == "cpu" else "")
    print(f"sgemm      {sgemm_gflops():.1f} GFLOP/s (float32 576x1536 by 64 rows, {where})")
    print(f"copy       {copy_gbps():.1f} GB/s (read + written; {where.split(',')[0]})")
    lm = load_model(args.model)
    i = lm.info
    print(
        f"model      {i.name}: {i.parameters / 1e6:.1f}M parameters, {i.dtype}, "
        f"context {i.context_length}, on {i.backend}"
    )
    print(f"           {i.source}")
    return 0


def read_requests(path: Path, lm) -> list[dict]:
    """Parse an input JSONL file into [{'id', 'prompt_ids'}]; errors name the line."""
    from .model.prompts import prompt_ids

    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict) or "id" not in item:
                raise ValueError('each line must be an object with an "id"')
            given = [k for k in ("prompt_ids", "prompt", "messages") if k in item]
            if len(given) != 1:
                raise ValueError('give exactly one of "prompt_ids", "prompt" or "messages"')
            prompt = item[given[0]]
            if given[0] == "prompt" and not isinstance(prompt, str):
                raise ValueError('"prompt" must be a string')
            if given[0] == "messages" and not (isinstance(prompt, list) and prompt):
                raise ValueError('"messages" must be a non-empty list of {"role", "content"}')
            if given[0] == "prompt_ids" and not isinstance(prompt, list):
                raise ValueError('"prompt_ids" must be a list of token ids')
            requests.append({"id": item["id"], "prompt_ids": prompt_ids(lm, prompt)})
        except ValueError as e:  # json.JSONDecodeError is a ValueError too
            raise SystemExit(f"{path}:{number}: {e}") from None
    return requests


ENGINE_FLAG_ALIASES = {"max_batch_size": ("--batch-size",)}  # the flag users know


def scheduler_flags(classes) -> dict[str, tuple[type, str]]:
    """Every described option of these scheduler classes: name -> (type, help), the help
    naming the kinds that take it. The command line's engine flags come from here."""
    flags: dict[str, tuple[type, str, list[str]]] = {}
    for cls in classes:
        for name, (default, option) in cls.option_specs().items():
            if option is None:  # undescribed (a learner's own): a flag if its default is a number
                if isinstance(default, bool) or not isinstance(default, (int, float)):
                    continue
                option = Option(type(default), f"an option of {cls.__name__} (default {default})")
            kinds = flags.setdefault(name, (option.type, option.help, []))[2]
            kinds.append(cls.kind)
    return {name: (t, f"{h} [{', '.join(kinds)}]") for name, (t, h, kinds) in flags.items()}


def kinds_table() -> str:
    """The registry as a Markdown table (``batchlab kinds``; the README's kinds table)."""
    rows = ["| kind | options (default) | what it does |", "|---|---|---|"]
    for kind, cls in KINDS.items():
        opts = [
            f"`{name}` ({'—' if default is None else default})"
            for name, (default, option) in cls.option_specs().items()
            if option is not None
        ]
        rows.append(f"| `{kind}` | {', '.join(opts) or '—'} | {cls.description} |")
    return "\n".join(rows)


def _cmd_kinds(args) -> int:
    print(kinds_table())
    return 0


def engine_options(args) -> dict:
    """The make_engine options the user actually gave (the rest keep their defaults)."""
    options = {
        name: getattr(args, name)
        for name in getattr(args, "scheduler_options", ())
        if getattr(args, name, None) is not None
    }
    if getattr(args, "num_kv_blocks", None) is not None:
        options["num_kv_blocks"] = args.num_kv_blocks
    if getattr(args, "enable_prefix_cache", False):
        options["enable_prefix_cache"] = True
    if getattr(args, "policy", None):
        options["policy"] = policy_from(args.policy, getattr(args, "policy_arg", None) or [])
    elif getattr(args, "policy_arg", None):
        raise ValueError("--policy-arg needs --policy: it sets an argument of that class")
    return options


def class_from(spec: str, flag: str, base: type) -> type:
    """A subclass of ``base`` named as module:Class, imported from the current folder
    (e.g. the learner's ``my_engine.front:MyEngine``)."""
    from .core.engine import import_from_here

    found = import_from_here(spec, flag)
    if not (isinstance(found, type) and issubclass(found, base)):
        raise ValueError(f"{flag} {spec}: not a subclass of {base.__name__}")
    return found


def policy_from(spec: str, settings: list[str] = ()):
    """A ``Policy`` subclass named as module:Class (e.g. the learner's
    ``my_engine.aging:MyAgingPolicy``), made with ``settings``: ``NAME=VALUE`` strings
    (``--policy-arg age_s=10``), each value a number where it reads as one."""
    from .core.policies import Policy

    cls = class_from(spec, "--policy", Policy)
    kwargs = {}
    for setting in settings:
        name, eq, value = setting.partition("=")
        if not eq or not name.isidentifier():
            raise ValueError(f"--policy-arg {setting!r}: write NAME=VALUE, e.g. age_s=10")
        try:
            kwargs[name] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # an argument the class does not take
        raise ValueError(f"--policy {spec} with {', '.join(settings)}: {e}") from e


SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
SPECULATIVE_EXAMPLE = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
)


def speculative_options(text: str | None, scheduler_cls, given: dict | None = None) -> dict:
    """``--speculative-config JSON`` in vLLM's form, as the engine options it stands for:
    ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
    "prompt_lookup_min": 1}`` is speculative decoding by prompt lookup with those three
    options (the stall-free kind's). As in vLLM, ``num_speculative_tokens`` is required, a
    missing ``prompt_lookup_min`` or ``prompt_lookup_max`` takes the other's value, and with
    neither both are 5. Only the "ngram" method exists here (there is no draft model); another
    method, a key this server does not know, a value that is not a whole number, a setting
    that ``given`` (the flags) already sets otherwise, or a kind that does not speculate is a
    ``ValueError`` that says so."""
    if text is None:
        return {}
    flag = "--speculative-config"
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not JSON ({e}); write e.g. '{SPECULATIVE_EXAMPLE}'") from None
    if not isinstance(config, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. '{SPECULATIVE_EXAMPLE}'")
    unknown = [key for key in config if key not in SPECULATIVE_KEYS]
    if unknown:
        raise ValueError(
            f"{flag}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"this server takes {', '.join(SPECULATIVE_KEYS)}"
        )
    if "method" not in config:
        raise ValueError(f'{flag}: "method" is required; the one method here is "ngram" (prompt lookup)')
    if config["method"] != "ngram":
        raise ValueError(
            f"{flag}: method {config['method']!r} is not supported; the one method here is "
            f'"ngram" (prompt lookup: drafts from the request\'s own tokens, no draft model)'
        )
    if "num_speculative_tokens" not in config:
        raise ValueError(f"{flag}: \"num_speculative_tokens\" is required, e.g. '{SPECULATIVE_EXAMPLE}'")
    low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    options = {
        "num_speculative_tokens": config["num_speculative_tokens"],
        "prompt_lookup_min": low if low is not None else high if high is not None else 5,
        "prompt_lookup_max": high if high is not None else low if low is not None else 5,
    }
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag}: {key} must be a whole number >= 1, got {value!r}")
    if options["prompt_lookup_min"] > options["prompt_lookup_max"]:
        raise ValueError(
            f"{flag}: prompt_lookup_min ({options['prompt_lookup_min']}) must be <= "
            f"prompt_lookup_max ({options['prompt_lookup_max']})"
        )
    if not set(options) <= set(scheduler_cls.option_defaults()):
        raise ValueError(
            f"{flag}: the {getattr(scheduler_cls, 'kind', scheduler_cls.__name__)} engine does not "
            f"speculate; speculative decoding runs on the stall-free kind (--engine stallfree)"
        )
    for key, value in options.items():
        if (given or {}).get(key, value) != value:
            raise ValueError(f"{flag} sets {key} to {value}, but --{key.replace('_', '-')} says {given[key]}")
    return options


def serve_pieces(args) -> dict:
    """``batchlab serve``'s learner pieces beyond the scheduler: ``--front`` (an
    ``EngineBase`` subclass: submit, poll and cancel), ``--server`` (a ``ServerBase``
    subclass: each request's stream) and ``--shedding`` (an ``AdmissionBase`` subclass)
    with its ``--max-wait``."""
    from .core.engine import EngineBase
    from .core.policies import AdmissionBase
    from .serving.server import ServerBase

    pieces = {"max_wait_s": args.max_wait}
    if args.front:
        pieces["engine_class"] = class_from(args.front, "--front", EngineBase)
    if args.server:
        pieces["server_class"] = class_from(args.server, "--server", ServerBase)
    if args.shedding:
        pieces["shedding"] = class_from(args.shedding, "--shedding", AdmissionBase)
    return pieces


def _cmd_generate(args) -> int:
    from .core.engine import make_engine
    from .model.load import load_model
    from .core.request import SamplingParams

    SamplingParams(args.temperature, args.top_p, 0, args.seed)  # bad flags: said before the model loads
    if args.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {args.max_new_tokens}")
    if not Path(args.input).is_file():
        raise FileNotFoundError(f"No such file: {args.input}")
    lm = load_model(args.model)
    requests = read_requests(Path(args.input), lm)
    engine = make_engine(args.scheduler_cls, lm, **engine_options(args))
    ids = [
        engine.submit(
            r["prompt_ids"],
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        for r in requests
    ]
    while engine.step():  # every answer is written, even where the engine fails (said below)
        pass
    with open(args.output, "w") as out:
        for req, rid in zip(requests, ids):
            tokens, _, reason = engine.poll(rid)
            rec = engine.trace.requests[rid]
            out.write(
                json.dumps(
                    {
                        "id": req["id"],
                        "token_ids": tokens,
                        "text": lm.tokenizer.decode(tokens, skip_special_tokens=True),
                        "finish_reason": reason,
                        "ttft_s": None if rec.first_token_s is None else rec.first_token_s - rec.arrival_s,
                        "token_times_s": [t - rec.arrival_s for t in rec.token_times_s],
                    }
                )
                + "\n"
            )
    stats = engine.stats()
    print(
        f"wrote {len(requests)} results to {args.output}: {stats['output_tokens']} tokens in "
        f"{stats['elapsed_s']:.1f} s ({stats['output_tokens_per_s']:.1f} tokens/s, "
        f"{args.scheduler_cls.kind})",
        file=sys.stderr,
    )
    if engine.failing:
        print(f"error: {engine.failing}", file=sys.stderr)
        return 1
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args.scheduler_cls, args.model, requests=args.requests, **engine_options(args))


def _cmd_serve(args) -> int:
    from .model.load import load_model
    from .serving.launch import check_exposure, serve

    check_exposure(args.host, args.api_key, args.insecure)  # before the model takes its seconds to load
    options = engine_options(args) | serve_pieces(args)  # a bad class fails before the model loads, too
    options |= speculative_options(args.speculative_config, args.scheduler_cls, options)
    serve(
        load_model(args.model),
        args.scheduler_cls,
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        api_key=args.api_key,
        insecure=args.insecure,
        max_running_per_user=args.max_running_per_user,
        show_prompts=args.show_prompts,
        **options,
    )
    return 0


def loadgen_workload(name: str, tokenizer, size: str, requests: int | None, seed: int):
    """The workload ``batchlab loadgen`` sends: ``name`` at ``size``, its first ``requests``."""
    from .measurement.workloads import make_workload

    options = {"seed": seed} if name == "mixed" else {"seed": seed, "size": size}
    if name == "mixed" and requests is not None:
        options["num_requests"] = requests
    workload = make_workload(name, tokenizer, **options)
    if requests is not None:
        if requests < 1 or requests > len(workload):
            raise ValueError(
                f"--requests must be between 1 and {len(workload)} for the {name} "
                f"workload at size {size}" + (" (try --size full)" if size == "quick" else "")
            )
        workload = workload.head(requests)
    return workload


def _cmd_loadgen(args) -> int:
    from .serving.loadgen import run_loadgen
    from .model.load import load_model

    workload = loadgen_workload(
        args.workload, load_model(args.model).tokenizer, args.size, args.requests, args.seed
    )
    result = run_loadgen(
        args.base_url,
        workload,
        model=args.served_model,
        concurrency=args.concurrency,
        rate=args.rate,
        seed=args.seed,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
        usage=not args.no_usage,
        api_key=args.api_key,
        user=args.user,
        extra_body={"ignore_eos": True} if args.ignore_eos else None,
    )
    print(result.table())
    if args.json:
        result.write_json(args.json)
        print(f"\nwrote {args.json}")
    return 0


def _cmd_export_mlx(args) -> int:
    from .model.export import export_mlx
    from .model.load import load_model

    out = export_mlx(load_model(args.model), args.dir)
    print(f"wrote an mlx-lm model folder to {out}; serve it with: mlx_lm.server --model {out}")
    return 0


def _cmd_bench(args) -> int:
    from .measurement.bench import format_table, run_bench
    from .model.load import load_model

    extra = {name: {"kind": cls} for name, cls in (args.engines or {}).items()}
    result = run_bench(
        load_model(args.model),
        quick=args.quick,
        json_out=args.json,
        **({"extra_engines": extra} if extra else {}),
        **({"tbt_slo": args.tbt_slo} if args.tbt_slo is not None else {}),
        **({"repetitions": args.repetitions} if args.repetitions is not None else {}),
        **({"only": args.only} if args.only else {}),
    )
    print(format_table(result))
    if args.json:
        print(f"\nwrote {args.json} (and plots beside it)")
    return 0


def _cmd_fit_cost(args) -> int:
    from .measurement.costfit import fit_cost_model
    from .model.load import load_model

    if args.reps < 1:
        raise ValueError("--reps must be >= 1")
    model = fit_cost_model(
        load_model(args.model), quick=args.quick, reps=args.reps, command=args.command_line
    )
    print(
        f"held-out relative error: median {model.error['median']:.1%}, "
        f"p90 {model.error['p90']:.1%}, max {model.error['max']:.1%} "
        f"({model.meta['passes_held_out']} passes; fitted on {model.meta['passes_fitted']})"
    )
    print("seconds per unit of each feature:")
    for name, value in model.coefficients.items():
        print(f"  {name:<18} {value: .3e}")
    if args.json:
        Path(args.json).write_text(model.to_json() + "\n")
        print(f"wrote {args.json}")
    return 0


def _add_engine_options(parser, default: str, extra=None):
    """``--engine`` (a kind or module:Class) and one flag per scheduler option, from the
    registry (plus the options of ``extra``, a class named with module:Class)."""
    parser.add_argument(
        "--engine",
        default=default,
        metavar="KIND|module:Class",
        help=f"the scheduler: {', '.join(KINDS)} (default {default}), or your own "
        f"class as module:Class, imported from the current folder",
    )
    classes = [*KINDS.values(), *([extra] if extra is not None and extra not in KINDS.values() else [])]
    flags = scheduler_flags(classes)
    for name, (value_type, text) in flags.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            *ENGINE_FLAG_ALIASES.get(name, ()),
            dest=name,
            type=value_type,
            default=None,
            help=text,
        )
    parser.set_defaults(scheduler_options=tuple(flags))
    parser.add_argument(
        "--policy",
        default=None,
        metavar="module:Class",
        help="who is served next and who gives way (kinds that take a policy): your "
        "Policy subclass, e.g. my_engine.memory:MyVictimPolicy",
    )
    parser.add_argument(
        "--policy-arg",
        action="append",
        default=None,
        metavar="NAME=VALUE",
        help="an argument of the --policy class (repeat for several), e.g. age_s=10 for an aging policy",
    )
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks of 16 tokens (default: ~1k tokens a slot); a small pool preempts",
    )
    parser.add_argument(
        "--enable-prefix-cache",
        action="store_true",
        help="kinds that take KV on demand: share the KV blocks of repeated prompt prefixes",
    )


def build_parser(extra=None) -> argparse.ArgumentParser:
    """The whole command line; ``extra`` is a scheduler class named with module:Class,
    whose own options then get flags too."""
    parser = argparse.ArgumentParser(prog="batchlab", description=__doc__)
    parser.add_argument(
        "--model",
        default=None,
        help="an mlx-lm model folder or hub id (default: the embedded SmolLM2-135M-Instruct)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="versions, backend, BLAS in use, and the model")
    sub.add_parser("kinds", help="the engine kinds, their options and what each does (Markdown)")
    sub.add_parser("lessons", help="the course: JupyterLab on your own copy of the lessons (--help for more)")

    _generate_parser(sub, extra)
    _demo_parser(sub, extra)
    _serve_parser(sub, extra)
    _loadgen_parser(sub)
    _bench_parser(sub)
    _fit_cost_parser(sub)
    _export_parser(sub)
    return parser


def _generate_parser(sub, extra) -> None:
    """``batchlab generate``: every request of a JSONL file through one engine."""
    gen = sub.add_parser("generate", help="generate for every request of a JSONL file")
    _add_engine_options(gen, "sequential", extra)
    gen.add_argument("--max-new-tokens", type=int, required=True)
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS tokens")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--input", required=True, help='JSONL: {"id", "prompt_ids"|"prompt"|"messages"}')
    gen.add_argument("--output", required=True, help="JSONL results, one line per request")


def _demo_parser(sub, extra) -> None:
    """``batchlab demo``: an engine batching requests live in the terminal."""
    demo = sub.add_parser("demo", help="watch an engine (default: stall-free) batch requests live, in 80x24")
    _add_engine_options(demo, "stallfree", extra)
    demo.add_argument("--requests", type=int, default=10)


def _serve_parser(sub, extra) -> None:
    """``batchlab serve``: the OpenAI-compatible streaming server."""
    srv = sub.add_parser("serve", help="an OpenAI-compatible streaming server")
    _add_engine_options(srv, "stallfree", extra)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    srv.add_argument(
        "--max-wait",
        type=float,
        default=None,
        metavar="S",
        help="shed a request still waiting to start after S s",
    )
    srv.add_argument(
        "--front", metavar="MODULE:CLASS", help="your submit/poll/cancel front, e.g. my_engine.front:MyEngine"
    )
    srv.add_argument(
        "--server",
        metavar="MODULE:CLASS",
        help="your request streams (events), e.g. my_engine.server:MyServer",
    )
    srv.add_argument(
        "--shedding", metavar="MODULE:CLASS", help="your shedding policy, e.g. my_engine.policy:MyAdmission"
    )
    srv.add_argument(
        "--api-key",
        default=os.environ.get("BATCHLAB_API_KEY"),
        metavar="KEY",
        help="every /v1 request must send 'Authorization: Bearer KEY' "
        "(default: $BATCHLAB_API_KEY); needed to listen beyond 127.0.0.1",
    )
    srv.add_argument(
        "--insecure",
        action="store_true",
        help="listen beyond 127.0.0.1 without an API key (a network that is yours alone)",
    )
    srv.add_argument(
        "--max-running-per-user",
        type=int,
        default=None,
        metavar="N",
        help="at most N unfinished requests per OpenAI 'user' (429 beyond; "
        "requests without a user count as one user)",
    )
    srv.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding in vLLM's form, by prompt lookup (the stall-free kind): "
        f"e.g. '{SPECULATIVE_EXAMPLE}'",
    )
    srv.add_argument(
        "--show-prompts",
        action="store_true",
        help="show the end of each prompt on /dashboard (default: no prompt text)",
    )


def _loadgen_parser(sub) -> None:
    """``batchlab loadgen``: a workload against any OpenAI-compatible server."""
    load = sub.add_parser("loadgen", help="measure any OpenAI-compatible server with a workload")
    load.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    load.add_argument(
        "--model",
        dest="served_model",
        default=None,
        metavar="NAME",
        help="the model name to ask for (default: the first at /v1/models)",
    )
    load.add_argument(
        "--workload", default="mixed", choices=["mixed", "high_variance", "sharegpt", "interference", "echo"]
    )
    load.add_argument("--size", default="quick", choices=["quick", "full"])
    load.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson arrivals, requests per second (default: all at once)",
    )
    load.add_argument("--concurrency", type=int, default=None, help="most requests in flight")
    load.add_argument("--requests", type=int, default=None, help="send only the first N")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--slo-ttft", type=float, default=None, help="goodput: TTFT limit (s)")
    load.add_argument("--slo-tpot", type=float, default=None, help="goodput: TPOT limit (s)")
    load.add_argument(
        "--no-usage",
        action="store_true",
        help="do not ask for usage (for servers that refuse stream_options)",
    )
    load.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send vLLM's ignore_eos: every answer runs to its max_tokens (where the server honours it)",
    )
    load.add_argument("--json", metavar="OUT", help="write the summary and every request here")
    load.add_argument(
        "--user",
        default=None,
        metavar="NAME",
        help="send this OpenAI 'user' with every request (the dashboard's label)",
    )
    load.add_argument(
        "--api-key",
        default=os.environ.get("BATCHLAB_API_KEY", "unused"),
        metavar="KEY",
        help="the server's API key (default: $BATCHLAB_API_KEY)",
    )


def _bench_parser(sub) -> None:
    """``batchlab bench``: every engine side by side, against the machine's limits."""
    bench = sub.add_parser(
        "bench",
        help="every engine and mlx-lm's BatchGenerator, side by "
        "side (interleaved repetitions, medians, the machine's limits)",
    )
    bench.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KIND|module:Class",
        dest="engines",
        help="also run this engine (your own as module:Class) beside ours and mlx-lm's; repeat for several",
    )
    bench.add_argument(
        "--tbt-slo",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the stall-free engines' time-between-tokens target (their budget "
        "is chosen from it; default: a multiple of the decode step)",
    )
    bench.add_argument(
        "--repetitions",
        type=int,
        default=None,
        metavar="N",
        help="interleaved repetitions of every engine (default 3; 1 with --quick)",
    )
    bench.add_argument("--quick", action="store_true", help="a smoke run: small workloads, each engine once")
    bench.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="EXPERIMENT",
        help="run only this experiment (chat, high_variance, interference, echo, echo_b1, chat_b1, "
        "structured); repeat for several",
    )
    bench.add_argument("--json", metavar="OUT", help="write results here, plots beside it")


def _fit_cost_parser(sub) -> None:
    """``batchlab fit-cost``: the simulator's cost model, fitted to the real model."""
    fit = sub.add_parser(
        "fit-cost", help="time the real model on designed batches; fit the simulator's cost model"
    )
    fit.add_argument(
        "--json", metavar="OUT", help="write the fitted model here (e.g. src/batchlab/data/cost_model.json)"
    )
    fit.add_argument("--quick", action="store_true", help="a third of the designed passes")
    fit.add_argument("--reps", type=int, default=3, help="timed runs per pass (the fastest is kept)")


def _export_parser(sub) -> None:
    """``batchlab export-mlx``: the model as an mlx-lm folder."""
    exp = sub.add_parser("export-mlx", help="write the model as an mlx-lm folder (for mlx_lm.server)")
    exp.add_argument("dir")


def _engine_spec(argv: list[str]) -> str | None:
    """The ``--engine`` value on a command line, if one is given as module:Class."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    return next((spec for spec in known.engine if ":" in spec), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lessons"]:  # the course: its options, and JupyterLab's after them
        from .course import lessons

        return lessons.main(argv[1:])
    command = next((a for a in argv if not a.startswith("-")), "batchlab")
    try:
        spec = _engine_spec(argv)
        extra = scheduler_class(spec) if spec else None  # its own options become flags
        args = build_parser(extra).parse_args(argv)
        args.command_line = "batchlab " + " ".join(argv)
        if isinstance(getattr(args, "engine", None), str):
            args.scheduler_cls = scheduler_class(args.engine)
        if getattr(args, "engines", None):  # bench: name -> class (module:Class by its kind)
            classes = [scheduler_class(e) for e in args.engines]
            args.engines = {cls.kind if ":" in e else e: cls for e, cls in zip(args.engines, classes)}
        handler = {
            "info": _cmd_info,
            "kinds": _cmd_kinds,
            "generate": _cmd_generate,
            "demo": _cmd_demo,
            "serve": _cmd_serve,
            "loadgen": _cmd_loadgen,
            "export-mlx": _cmd_export_mlx,
            "bench": _cmd_bench,
            "fit-cost": _cmd_fit_cost,
        }[args.command]
        return handler(args)
    except (ValueError, FileNotFoundError, EngineFailing) as e:  # said plainly, exit status 1
        raise SystemExit(f"batchlab {command}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
