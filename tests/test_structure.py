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
PURE = [
    "batch",
    "runner",
    "request",
    "scheduler",
    "kv",
    "policies",
    "sampling",
    "trace",
    "fake",
    "engine",
    "simulator",
    "workloads",
    "metrics",
    "costmodel",
    "driver",
]


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
        from batchlab.fake import FakeModel, FakeRunner, reference_output
        engine = make_engine("stallfree", FakeModel(), runner=FakeRunner, max_batch_size=2)
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


def _imports(path: Path) -> set[str]:
    """batchlab modules that ``path`` imports (relative imports, any depth of the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("batchlab."):
            found.add(node.module.split(".")[1])
    return found


def _module_graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        name = rel.parts[0].removesuffix(".py")
        if name == "__init__" and len(rel.parts) == 1:
            continue
        graph.setdefault(name, set()).update(_imports(path) - {name})
    return graph


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
    tree = ast.parse((PACKAGE / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    names = {n.attr for n in ast.walk(engine) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(engine) if isinstance(n, ast.Name)
    }
    assert not names & {"blocks", "BlockManager", "ensure", "release", "cache_full_blocks"}


def test_public_names_stay_what_they_name_after_every_submodule_is_imported():
    """``batchlab.generate`` is the function even once ``batchlab``'s submodules are loaded
    (a submodule of the same name would replace it on the package)."""
    import importlib
    import types

    for path in PACKAGE.glob("*.py"):
        if path.stem != "__init__":
            importlib.import_module(f"batchlab.{path.stem}")
    for name in batchlab.__all__:
        assert not isinstance(getattr(batchlab, name), types.ModuleType), name


def test_the_readme_code_map_lists_every_module_once():
    """The README's "How the code is split" table names every module and package of
    ``src/batchlab`` exactly once, and nothing that is not there."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("How the code is split") : readme.index("Engine kinds and their options")]
    listed = re.findall(r"^\| `([\w/]+(?:\.py)?)` \|", table, re.M)
    tree = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"} | {
        p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")
    }
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert not tree - set(listed), f"not in the README's code map: {sorted(tree - set(listed))}"
    assert not set(listed) - tree, f"in the code map but not in the tree: {sorted(set(listed) - tree)}"


def test_a_kind_writes_planning_only():
    """One flow: the shipped kinds override none of the shared steps of a pass (preparing
    it, its result, leaving), and keep no containers of requests of their own -- who is
    prefilling, awaiting or decoding is read from the requests."""
    from batchlab.fake import TickClock
    from batchlab.kv import BlockManager
    from batchlab.scheduler import KINDS, Scheduler

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
