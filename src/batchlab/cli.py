"""The ``batchlab`` command: info, generate (and more as the course grows)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _cmd_info(args) -> int:
    import importlib.metadata as md
    import platform

    from . import _blas
    import mlx.core as mx
    from .model import backend, load_model

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    print(f"batchlab   {version('batchlab')}   python {platform.python_version()}  "
          f"({platform.system()} {platform.machine()})")
    print(f"mlx        {mx.__version__}   mlx-lm {version('mlx-lm')}   tokenizers {version('tokenizers')}")
    print(f"backend    {backend()}  (default device: {mx.default_device()})")
    print(f"BLAS       {_blas.STATUS.name}")
    print(f"           {_blas.STATUS.path or '-'}: {_blas.STATUS.note}")
    print(f"sgemm      {_sgemm_gflops():.1f} GFLOP/s (float32 576x1536 by 64 rows; "
          f"reference BLAS gives ~5 here)")
    lm = load_model(args.model)
    i = lm.info
    print(f"model      {i.name}: {i.parameters / 1e6:.1f}M parameters, {i.dtype}, "
          f"context {i.context_length}, on {i.backend}")
    print(f"           {i.source}")
    return 0


def _sgemm_gflops() -> float:
    import mlx.core as mx

    a, b = mx.random.normal((576, 1536)), mx.random.normal((64, 576))
    mx.eval(b @ a)
    start, n = time.perf_counter(), 50
    for _ in range(n):
        mx.eval(b @ a)
    return n * 2 * 576 * 1536 * 64 / (time.perf_counter() - start) / 1e9


def read_requests(path: Path, lm) -> list[dict]:
    """Parse an input JSONL file into [{'id', 'prompt_ids'}]; errors name the line."""
    from .prompts import prompt_ids

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


def _cmd_generate(args) -> int:
    from .generate import generate
    from .model import load_model

    lm = load_model(args.model)
    requests = read_requests(Path(args.input), lm)
    with open(args.output, "w") as out:
        for req in requests:
            g = generate(lm, req["prompt_ids"], args.max_new_tokens, temperature=args.temperature,
                         top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
            out.write(json.dumps({"id": req["id"], "token_ids": g.token_ids, "text": g.text,
                                  "finish_reason": g.finish_reason, "ttft_s": g.ttft_s,
                                  "token_times_s": g.token_times_s}) + "\n")
    print(f"wrote {len(requests)} results to {args.output}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchlab", description=__doc__)
    parser.add_argument("--model", default=None,
                        help="an mlx-lm model folder or hub id (default: the embedded SmolLM2-135M-Instruct)")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="versions, backend, BLAS in use, and the model")

    gen = sub.add_parser("generate", help="generate for every request of a JSONL file")
    gen.add_argument("--engine", choices=["sequential"], default="sequential")
    gen.add_argument("--max-new-tokens", type=int, required=True)
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS tokens")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--input", required=True, help='JSONL: {"id", "prompt_ids"|"prompt"|"messages"}')
    gen.add_argument("--output", required=True, help="JSONL results, one line per request")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"info": _cmd_info, "generate": _cmd_generate}[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"batchlab {args.command}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
