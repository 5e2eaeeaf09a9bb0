"""The shape of the code: policy never touches MLX, imports run one way.

These guard the split that the course teaches (scheduler = policy in plain Python,
runner = mechanism on MLX), so that a learner's scheduler and the scheduler tests run
anywhere, and so that following a request through the code never climbs back up.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import batchlab

PACKAGE = Path(batchlab.__file__).parent
# The jobs, from the bottom up: a room imports only from rooms at or below its own.
LAYERS = ["_blas", "core", "model", "viz", "measurement", "serving", "course", "demo", "cli"]
CORE = sorted(
    ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    for p in (PACKAGE / "core").rglob("*.py")
)
# beyond the core, what also runs without MLX: the simulator and what it needs
PURE = CORE + ["measurement.simulator", "measurement.workloads", "measurement.driver"]


def test_policy_modules_run_without_mlx():
    """Import the pure modules and run a fake-model engine with MLX made unimportable."""
    script = textwrap.dedent(f"""
        import importlib.abc, sys

        class NoMLX(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("mlx", "mlx_lm"):
                    raise ImportError("MLX is blocked in this test: " + name)

        sys.meta_path.insert(0, NoMLX())
        for name in {PURE!r}:
            __import__("batchlab." + name)
        from batchlab import make_engine
        from batchlab.core.fake import FakeModel, reference_output
        engine = make_engine("stallfree", FakeModel(), max_batch_size=2)  # its default runner
        rid = engine.submit([5, 6, 7], max_new_tokens=6, ignore_eos=True)
        engine.run_until_idle()
        tokens, status, reason = engine.poll(rid)
        assert tokens == reference_output([5, 6, 7], 6, 64, frozenset()), tokens
        assert (status, reason) == ("done", "length")
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm")))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _module_of(path: Path) -> list[str]:
    return ["batchlab", *path.relative_to(PACKAGE).with_suffix("").parts]


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of everything ``path`` imports, at any depth of the file: relative
    imports resolved (``from ..kv import X`` in ``core/scheduler/base.py`` is
    ``batchlab.core.kv``), ``from . import x`` read as the module ``x``."""
    here = _module_of(path)
    package = here[:-1] if here[-1] != "__init__" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                found.add(".".join(base + [node.module]))
            else:
                found.update(".".join(base + [a.name]) for a in node.names)
    return found


def _room(module: str) -> str | None:
    """The job a batchlab module belongs to: its first part under ``batchlab``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "batchlab" and len(parts) > 1 else None


def _imports(path: Path) -> set[str]:
    """The rooms of batchlab that ``path`` imports."""
    return {r for r in map(_room, _imported_modules(path)) if r}


def _module_graph() -> dict[str, set[str]]:
    """Module to the batchlab modules it imports, each module named by its path."""
    graph = {}
    modules = {".".join(_module_of(p)).removesuffix(".__init__") for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(_module_of(path)).removesuffix(".__init__")
        targets = set()
        for imported in _imported_modules(path):
            while imported not in modules and "." in imported:  # a name in a module
                imported = imported.rsplit(".", 1)[0]
            if imported.startswith("batchlab.") and imported != name:
                targets.add(imported)
        if name != "batchlab":
            graph[name] = targets - {"batchlab"}
    return graph


def test_every_room_is_in_the_layer_order():
    rooms = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*")}
    rooms -= {"__init__", "__pycache__", "data"}
    assert rooms == set(LAYERS), f"rooms not in LAYERS, or gone: {rooms ^ set(LAYERS)}"


def test_no_import_climbs_to_a_higher_room():
    """core < model < viz < measurement < serving < course < demo < cli: following a request
    down the code never climbs back up, and the core is the engine alone."""
    for path in PACKAGE.rglob("*.py"):
        room = _room(".".join(_module_of(path)))
        if room in (None, "__init__"):
            continue
        for other in _imports(path):
            assert LAYERS.index(other) <= LAYERS.index(room), (
                f"{path.relative_to(PACKAGE)} ({room}) imports from {other}, a higher room"
            )


def test_the_core_imports_no_mlx_and_nothing_outside_itself():
    """Read from the source (function-level imports included): the core's only batchlab
    imports are the core, and it never names mlx or mlx_lm."""
    for path in (PACKAGE / "core").rglob("*.py"):
        for module in _imported_modules(path):
            assert module.split(".")[0] not in ("mlx", "mlx_lm"), f"{path.name} imports {module}"
            if module.startswith("batchlab"):
                assert _room(module) == "core", f"{path.relative_to(PACKAGE)} imports {module}"


def test_import_graph_has_no_cycle():
    graph = _module_graph()
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_engine_never_calls_the_block_manager():
    """KV blocks have one owner, the scheduler: the Engine class never reaches a block
    manager (``make_engine`` only builds one and hands it to the scheduler)."""
    tree = ast.parse((PACKAGE / "core" / "engine.py").read_text())
    engines = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("EngineBase", "Engine")]
    assert len(engines) == 2
    names = {n.attr for e in engines for n in ast.walk(e) if isinstance(n, ast.Attribute)} | {
        n.id for e in engines for n in ast.walk(e) if isinstance(n, ast.Name)
    }
    assert not names & {"blocks", "BlockManager", "ensure", "release", "cache_full_blocks"}


def test_public_names_stay_what_they_name_after_every_submodule_is_imported():
    """``batchlab.generate`` is the function even once ``batchlab``'s submodules are loaded
    (a submodule of the same name would replace it on the package)."""
    import importlib
    import types

    for path in PACKAGE.rglob("*.py"):
        importlib.import_module(".".join(_module_of(path)).removesuffix(".__init__"))
    for name in batchlab.__all__:
        assert not isinstance(getattr(batchlab, name), types.ModuleType), name


def test_the_readme_code_map_is_generated_from_the_tree():
    """The README's code map is exactly what ``scripts/code_map.py`` makes of the tree today
    (every room in the layer order, every module once), so it cannot drift from the code."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("code_map", root / "scripts" / "code_map.py")
    code_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code_map)
    assert code_map.LAYERS == LAYERS
    table = code_map.code_map()
    assert table in (root / "README.md").read_text(), "run: .venv/bin/python scripts/code_map.py --write"
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 2 and rel.name != "__init__.py":  # a room's module: its own row
            assert f"| `{rel.as_posix()}` |" in table, rel
        elif len(rel.parts) == 3 and rel.name != "__init__.py":  # in its subpackage's row
            assert f"`{rel.stem}`" in table, rel


LONGEST_SERVING_FUNCTION = 60  # issue 42: server.py's five jobs were split by job, none over 60 lines


def test_no_function_in_serving_is_over_60_lines():
    """A reader of the server meets functions that fit on a screen: none in ``serving/`` is over
    ``LONGEST_SERVING_FUNCTION`` lines (decorators left out, its docstring counted)."""
    long = [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted((PACKAGE / "serving").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > LONGEST_SERVING_FUNCTION
    ]
    assert not long, f"functions in serving/ over {LONGEST_SERVING_FUNCTION} lines: {long}"


def test_a_kind_writes_planning_only():
    """One flow: the shipped kinds override none of the shared steps of a pass (preparing
    it, its result, leaving), and keep no containers of requests of their own -- who is
    prefilling, awaiting or decoding is read from the requests."""
    from batchlab.core.fake import TickClock
    from batchlab.core.kv import BlockManager
    from batchlab.core.scheduler import KINDS, Scheduler

    shared = ("passes", "prepare", "postprocess", "fail", "remove", "release", "begin", "add", "has_work")
    base = set(vars(Scheduler(BlockManager(4, 4), TickClock())))
    for kind, cls in KINDS.items():
        for klass in cls.__mro__[: cls.__mro__.index(Scheduler)]:
            overridden = [name for name in shared if name in vars(klass)]
            assert not overridden, f"{kind}: {klass.__name__} overrides {overridden}"
        sched = cls(BlockManager(4, 4), TickClock())
        extra = {k: v for k, v in vars(sched).items() if k not in base}
        containers = [
            k for k, v in extra.items() if isinstance(v, (list, dict, set, tuple)) or hasattr(v, "popleft")
        ]
        assert not containers, f"{kind} keeps its own containers: {containers}"


ROAD_FILES = (
    14  # issue 42: 24 before the merges of stop 54 (finishing, on_demand, auth), 21 before stop 55 (loop),
    # 20 before stop 56 (the road now ends with the answer: the server's shutdown is not on it), 19 before
    # stop 57 (attention went to the two files that call it: numpy's to cpu_llama, MLX's to model_runner),
    # 18 before stop 59 (sampling and the shared argument checks joined the request, the Batch the
    # scheduler base, the stall-free kind the continuous one it inherits)
)


def test_a_streamed_chat_completion_runs_code_in_few_files(lm_two_layers):
    """The road of one request: trace which of the package's files run code while an
    in-process server answers one streamed chat completion (after a first request has done
    every lazy import). A new file on the road fails this until ``ROAD_FILES`` is raised on
    purpose. ``pytest tests/test_structure.py -k few_files -s`` prints the files."""
    import collections
    import json
    import threading
    import urllib.request

    from batchlab.serving.launch import serve_in_thread

    root = str(PACKAGE)
    hits: dict[str, set] = collections.defaultdict(set)

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(root):
            hits[name].add(frame.f_code.co_name)

    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "stream": True}
    ).encode()

    def send(url: str) -> list[bytes]:
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read().splitlines()

    threading.settrace(tracer)  # the server's threads start after this, traced
    try:
        with serve_in_thread(lm_two_layers, "stallfree") as server:
            send(server.base_url)
            hits.clear()
            sys.settrace(tracer)
            lines = send(server.base_url)
            sys.settrace(None)
            # the road ends with the answer: the server's shutdown is not part of it
            road = {str(Path(f).relative_to(PACKAGE)): sorted(names) for f, names in list(hits.items())}
    finally:
        threading.settrace(None)
        sys.settrace(None)
    for path, names in sorted(road.items()):
        print(f"{path}: {', '.join(names)}")
    assert b"data: [DONE]" in [x.strip() for x in lines]  # the stream ran to its end
    assert {
        "core/engine.py",
        "serving/app.py",
        "core/scheduler/continuous.py",
        "model/model_runner.py",
    } <= set(road)
    assert len(road) <= ROAD_FILES, f"{len(road)} files on a request's road: {sorted(road)}"
