"""A new user's run of the course in JupyterLab, recorded (issue 20: "done when").

    .venv/bin/python tests/new_user_run.py --out docs/results/new_user_run.md

What a new learner does, all inside a temporary folder (nothing is written anywhere else,
except ``--out`` and its screenshots in ``<out without .md>/``):

1. A fresh clone of this repository (its HEAD), and the learner's own command in it:
   ``batchlab lessons --no-browser`` (JupyterLab on 127.0.0.1, a random token),
   which copies the learner copies into ``my-course/``. The clone's ``src/`` comes first on
   ``PYTHONPATH`` (the kernels inherit it), so the clone's batchlab is what runs; the
   environment is this repository's ``.venv``. HOME and every Jupyter folder point into
   the temporary folder, so no user state leaks in.
2. Debian's Chromium, driven by Playwright, opens lessons 1, 2, 4, 5a, 6, 7, 8, 9 and 10 in turn from
   ``my-course/``; in each, the learner's piece is typed into its ``%%piece`` cell in place
   of the empty exercise (the pieces of ``tests/learner_pieces.py``; a piece not there --
   lesson 6's ``MyEngine`` -- is the solved lesson's), then Run > Run All Cells, and the
   rendered outputs are read once the kernel is idle: the piece file written
   (``my-course/my_engine/<piece>.py``, compared with what was typed), the piece
   checker's verdict, every "Using your ..." line, any "stands in" line and any error
   cell. The lesson's smaller exercises are left empty, as a learner may leave them: their
   checkers say "not written yet" (reported, not a failure).
3. Nothing is lost on a re-run: the start command again (copies nothing, changes
   nothing), ``--refresh 02_continuous_batching`` (the learner's copy set aside, the
   engine untouched), the fresh copy's stub cell run over the written piece (must not
   replace it), a changed piece written (the old one kept in ``my_engine/.history/``, one
   line saying so), and the same piece again (unchanged, nothing kept).

Exit status 0 when everything passed, 1 otherwise; the transcript says which and why.
JupyterLab and Chromium are always stopped at the end. Not a pytest module (no ``test_``
prefix): a recorded script, a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import platform
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from jupyterlab_driver import (  # noqa: E402
    free_port,
    isolated_env,
    launch_chromium,
    missing,
    open_notebook,
    menu,
    run_all_cells,
    shut_down_kernels,
    stop,
    wait_until_serving,
    IDLE,
)

REPO = HERE.parent
PIECES_FILE = HERE / "learner_pieces.py"
# (lesson, notebook, piece module, the classes whose "Using your ..." line the lesson must show)
LESSONS = [
    ("1", "01_static_batching", "static", ["MyStaticScheduler"]),
    ("2", "02_continuous_batching", "continuous", ["MyContinuousScheduler"]),
    ("4", "04_chunked_prefill", "chunked", ["MyChunkedScheduler"]),
    ("5a", "05a_the_token_budget", "stallfree", ["MyStallFreeScheduler"]),
    ("6", "06_the_poll_interface", "front", ["MyStallFreeScheduler", "MyEngine"]),
    ("7", "07_serving", "server", ["MyStallFreeScheduler", "MyEngine", "MyServer"]),
    ("8", "08_memory", "memory", ["MyMemoryScheduler", "MyVictimPolicy"]),
    ("9", "09_policies_and_overload", "policy", ["MyMemoryScheduler", "MyAdmission"]),
    (
        "10",
        "10_priorities_and_the_finish_line",
        "aging",
        ["MyMemoryScheduler", "MyAdmission", "MyAgingPolicy", "MyEngine"],
    ),
    ("11", "11_speculative_decoding", "speculative", ["MySpeculativeScheduler"]),
    ("12", "12_structured_output", "structured", ["MyMemoryScheduler", "MyStructuredEngine"]),
]
RERUN_LESSON = "02_continuous_batching"
SCREENSHOTS = {"02_continuous_batching", "08_memory"}  # + the re-run's stub cell: 3 PNGs
STUB = re.compile(
    r'^(?P<indent>[ \t]*)# YOUR CODE HERE\n[ \t]*raise NotImplementedError\("(?P<name>\w+) is not written yet"\)',
    re.M,
)
FALLBACK = re.compile(r"stands in|in its place")  # a reference standing in for a piece


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# The learner's pieces, as they would type them into the %%piece cells


def _text(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _methods() -> dict[tuple[str, str], str]:
    """(class, method) -> the method's body (dedented) in tests/learner_pieces.py."""
    source = PIECES_FILE.read_text(encoding="utf-8")
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, ast.FunctionDef):
                    body = "\n".join(lines[f.body[0].lineno - 1 : f.end_lineno])
                    found[(node.name, f.name)] = textwrap.dedent(body)
    return found


def _solutions(solved_cell: str) -> list[str]:
    """The solution regions of a solved lesson's cell, as they stand there (indented)."""
    regions, inside = [], None
    for line in solved_cell.split("\n"):
        if line.strip() == "### BEGIN SOLUTION":
            inside = []
        elif line.strip() == "### END SOLUTION":
            regions.append("\n".join(inside))
            inside = None
        elif inside is not None:
            inside.append(line)
    return regions


def piece_cell(stub_cell: str, solved_cell: str, methods: dict) -> tuple[str, list[str]]:
    """The learner copy's exercise cell with every ``# YOUR CODE HERE`` stub replaced by the
    learner's code; and where each filled method came from."""
    regions = _solutions(solved_cell)
    out, pos, sources = [], 0, []
    for k, stub in enumerate(STUB.finditer(stub_cell)):
        before = stub_cell[: stub.start()]
        classes = re.findall(r"^class (\w+)", before, re.M)
        cls, name, indent = (classes[-1] if classes else ""), stub["name"], stub["indent"]
        body = methods.get((cls, name))
        if body is not None:
            code = textwrap.indent(body, indent)
            sources.append(f"{cls}.{name}: tests/learner_pieces.py")
        else:
            code = regions[k]
            sources.append(f"{cls}.{name}: the solved lesson's")
        out += [stub_cell[pos : stub.start()], code]
        pos = stub.end()
    out.append(stub_cell[pos:])
    return "".join(out), sources


def file_body(cell_text: str) -> str:
    """What ``%%piece`` writes for a cell: everything after the magic line."""
    return cell_text.split("\n", 1)[1]


# ---------------------------------------------------------------------------------------
# The browser side


CELLS = ".jp-Notebook .jp-Cell"
_PROMPTS_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')].map(c =>
    c.classList.contains('jp-CodeCell') ? (c.querySelector('.jp-InputPrompt')?.textContent || '').trim() : null)"""
_OUTPUTS_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')].map(c =>
    [...c.querySelectorAll('.jp-OutputArea-output')].map(o => [
        o.getAttribute('data-mime-type') || o.querySelector('[data-mime-type]')?.getAttribute('data-mime-type') || '',
        o.textContent]))"""


def wait_for_cells(page, expected: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while page.locator(CELLS).count() != expected:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the page shows {page.locator(CELLS).count()} cells, the notebook has {expected}"
            )
        time.sleep(0.5)


def wait_until_run(page, upto: int | None, deadline_s: float, what: str) -> None:
    """Wait until every code cell (of the first ``upto`` cells) has run: a number in its
    prompt, none queued or running ([*]), and the kernel idle, twice in a row. Raises
    TimeoutError at the deadline."""
    start = time.monotonic()
    seen_busy, calm, last_note = False, 0, start
    while True:
        prompts = [p for p in page.evaluate(_PROMPTS_JS)[:upto] if p is not None]
        busy = any("*" in p for p in prompts)
        seen_busy |= busy
        done = sum(bool(re.fullmatch(r"\[\d+\]:?", p)) for p in prompts)
        idle = page.locator(".jp-StatusBar-Widget").get_by_text(IDLE).count() > 0
        if (seen_busy or done == len(prompts)) and not busy and idle:
            calm += 1
            if calm >= 2:
                return
        else:
            calm = 0
        now = time.monotonic()
        if now - start > deadline_s:
            raise TimeoutError(
                f"{what}: not finished after {deadline_s:.0f} s ({done}/{len(prompts)} cells run)"
            )
        if now - last_note > 30:
            log(f"  {what}: {done}/{len(prompts)} code cells run, {now - start:.0f} s")
            last_note = now
        time.sleep(1.0)


def run_one_cell(page, cell, deadline_s: float = 120) -> None:
    """Run one cell (already selected or in edit mode) with Ctrl+Enter; wait for its new number."""
    prompt = cell.locator(".jp-InputPrompt").first
    before = (prompt.text_content() or "").strip()
    page.keyboard.press("Control+Enter")
    start = time.monotonic()
    while True:
        now = (prompt.text_content() or "").strip()
        if re.fullmatch(r"\[\d+\]:?", now) and now != before:
            return
        if time.monotonic() - start > deadline_s:
            raise TimeoutError(f"a cell did not finish in {deadline_s:.0f} s (prompt {now!r})")
        time.sleep(0.3)


def select(cell) -> None:
    cell.locator(".jp-InputPrompt").first.click()


def type_into(page, cell, text: str) -> None:
    """Click into the cell's editor, select everything and type ``text`` over it (one
    insertion: no auto-indent)."""
    cell.locator(".cm-content").first.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(text)


def stdout_lines(outputs: list) -> list[str]:
    """The lines of a cell's printed (stdout / plain text) outputs."""
    lines = []
    for mime, text in outputs:
        if mime in ("application/vnd.jupyter.stdout", "text/plain", ""):
            lines += [line.strip() for line in text.splitlines() if line.strip()]
    return lines


def save(page, path: Path, timeout_s: float = 30) -> bool:
    """Save the notebook as a learner does (Ctrl+S); True once the file on disk changed."""
    before = path.stat().st_mtime_ns
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.stat().st_mtime_ns != before:
            time.sleep(0.5)  # let the write finish
            return True
        time.sleep(0.3)
    return False


def screenshot(page, cells, first: int, last: int, path: Path) -> None:
    """A small PNG of cells first..last (the checker's verdict down to "Using your ...")."""
    cells.nth(first).scroll_into_view_if_needed()
    page.evaluate("() => new Promise(r => setTimeout(r, 300))")
    boxes = [cells.nth(i).bounding_box() for i in range(first, last + 1)]
    boxes = [b for b in boxes if b]
    if not boxes:
        return
    x0, y0 = min(b["x"] for b in boxes), min(b["y"] for b in boxes)
    x1 = max(b["x"] + b["width"] for b in boxes)
    y1 = min(max(b["y"] + b["height"] for b in boxes), y0 + 640)
    path.parent.mkdir(parents=True, exist_ok=True)
    height = (page.viewport_size or {}).get("height", 0)
    if y1 - max(y0, 0) < 20 or y0 >= height:  # outside the viewport (a windowed notebook): the verdict alone
        cells.nth(first).screenshot(path=str(path))
    else:
        page.screenshot(
            path=str(path), clip={"x": x0, "y": max(y0, 0), "width": x1 - x0, "height": y1 - max(y0, 0)}
        )
    try:  # fewer colours: a much smaller file, as readable
        from PIL import Image

        Image.open(path).convert("RGB").quantize(colors=48).save(path, optimize=True)
    except ImportError:
        pass


# ---------------------------------------------------------------------------------------
# One lesson


@dataclass
class LessonResult:
    lesson: str
    name: str
    piece: str
    seconds: float = 0.0
    piece_file: str = ""
    file_matches: bool = False
    filled_from: list[str] = field(default_factory=list)
    saved_line: list[str] = field(default_factory=list)
    verdict: list[str] = field(default_factory=list)
    using: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    other_verdicts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    not_run: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def run_lesson(
    ctx, lesson, name, piece, expect_using, course: Path, solved: Path, methods, shots: Path | None
):
    result = LessonResult(lesson, name, piece)
    nb_path = course / f"{name}.ipynb"
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    cells_src = [(c["cell_type"], _text(c)) for c in nb["cells"]]
    magic = f"%%piece my_engine/{piece}.py"
    piece_idx = next(i for i, (t, s) in enumerate(cells_src) if t == "code" and s.startswith(magic))
    code_after = [i for i in range(piece_idx + 1, len(cells_src)) if cells_src[i][0] == "code"]
    checker_idx = code_after[0]
    choose_idx = next((i for i in code_after if "course.choose(" in cells_src[i][1]), checker_idx)
    solved_nb = json.loads((solved / f"{name}.ipynb").read_text(encoding="utf-8"))
    solved_cell = next(_text(c) for c in solved_nb["cells"] if _text(c).startswith(magic))
    text, result.filled_from = piece_cell(cells_src[piece_idx][1], solved_cell, methods)

    page = ctx.new_page()
    try:
        open_notebook(page, ctx.url, nb_path.name, ctx.token, reset=True, timeout_ms=90_000)
        cells = page.locator(CELLS)
        wait_for_cells(page, len(cells_src))
        type_into(page, cells.nth(piece_idx), text)
        start = time.monotonic()
        run_all_cells(page)
        wait_until_run(page, None, ctx.lesson_timeout, f"lesson {lesson}")
        result.seconds = time.monotonic() - start
        outputs = page.evaluate(_OUTPUTS_JS)
        if not save(page, nb_path):
            result.problems.append("Ctrl+S did not save the notebook")
        if shots is not None and name in SCREENSHOTS:
            screenshot(page, cells, checker_idx, choose_idx, shots / f"lesson{lesson}.png")
    except Exception as e:  # noqa: BLE001 -- record it, go on with the next lesson
        result.problems.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        try:
            outputs = page.evaluate(_OUTPUTS_JS)
        except Exception:  # noqa: BLE001 -- a page that crashed
            outputs = []
        if ctx.keep_dir:
            try:
                page.screenshot(path=str(ctx.keep_dir / f"failure-{name}.png"))
            except Exception:  # noqa: BLE001
                pass
    finally:
        page.close()
        shut_down_kernels(ctx.url, ctx.token)

    file = course / "my_engine" / f"{piece}.py"
    result.piece_file = f"my-course/my_engine/{piece}.py"
    if file.exists():
        result.file_matches = file.read_text(encoding="utf-8").rstrip() == file_body(text).rstrip()
        if not result.file_matches:
            result.problems.append(f"{result.piece_file} differs from the piece typed into the cell")
    else:
        result.problems.append(f"{result.piece_file} was not written")
    per_cell = [stdout_lines(o) for o in outputs] if outputs else []
    if per_cell:
        result.saved_line = per_cell[piece_idx]
        result.verdict = [line for line in per_cell[checker_idx] if line[:1] in "✓✗"]
        for i, lines in enumerate(per_cell):
            result.using += [line for line in lines if "Using your" in line]
            result.fallbacks += [line for line in lines if FALLBACK.search(line)]
            if i != checker_idx:
                result.other_verdicts += [line for line in lines if line[:1] in "✓✗"]
    # the saved notebook: error cells and cells that never ran
    saved = json.loads(nb_path.read_text(encoding="utf-8"))
    for c in saved["cells"]:
        if c["cell_type"] != "code":
            continue
        if c.get("execution_count") is None:
            result.not_run += 1
        for o in c.get("outputs", []):
            if o.get("output_type") == "error":
                result.errors.append(f"{o.get('ename')}: {o.get('evalue')}")
    if not result.verdict:
        result.problems.append("no checker verdict under the piece")
    elif not result.verdict[0].startswith("✓") or any(v.startswith("✗") for v in result.verdict):
        result.problems.append("the piece's checker shows ✗")
    for cls in expect_using:
        if not any(f"Using your {cls}" in line for line in result.using):
            result.problems.append(f'no "Using your {cls}" line')
    if result.fallbacks:
        result.problems.append("a reference stands in for a piece")
    if result.errors:
        result.problems.append(f"{len(result.errors)} error cell(s)")
    if result.not_run:
        result.problems.append(f"{result.not_run} code cell(s) not run")
    return result, text


# ---------------------------------------------------------------------------------------
# Nothing lost on a re-run


def tree_hashes(folder: Path, pattern: str) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.glob(pattern))
        if p.is_file() and "__pycache__" not in p.parts
    }


@dataclass
class Check:
    what: str
    ok: bool
    printed: list[str]
    detail: str = ""


def rerun_checks(ctx, course: Path, typed: str, command) -> list[Check]:
    checks = []
    engine = course / "my_engine"
    name = RERUN_LESSON
    piece = "continuous"
    file = engine / f"{piece}.py"
    notebooks_before = tree_hashes(course, "*.ipynb")
    engine_before = tree_hashes(engine, "**/*.py")

    # the start command again: copies nothing, changes nothing
    out = command(["--no-lab"])
    same = (
        tree_hashes(course, "*.ipynb") == notebooks_before and tree_hashes(engine, "**/*.py") == engine_before
    )
    checks.append(
        Check(
            "`batchlab lessons` again (a second start)",
            same and "(0 copied now" in out,
            [line for line in out.splitlines() if line.startswith("your lessons")],
            "every notebook in my-course/ and every file in my_engine/ unchanged"
            if same
            else "files changed",
        )
    )

    # --refresh: the learner's copy set aside with their work in it, my_engine/ untouched
    out = command(["--refresh", name, "--no-lab"])
    old = course / f"{name}.old-1.ipynb"
    kept_work = old.exists() and any(
        _text(c) == typed for c in json.loads(old.read_text(encoding="utf-8"))["cells"]
    )
    fresh = json.loads((course / f"{name}.ipynb").read_text(encoding="utf-8"))
    fresh_piece = next(
        i for i, c in enumerate(fresh["cells"]) if _text(c).startswith(f"%%piece my_engine/{piece}.py")
    )
    fresh_is_stub = bool(STUB.search(_text(fresh["cells"][fresh_piece])))
    untouched = tree_hashes(engine, "**/*.py") == engine_before
    checks.append(
        Check(
            f"`batchlab lessons --refresh {name}`",
            kept_work and fresh_is_stub and untouched,
            [line for line in out.splitlines() if line.startswith("your lessons")],
            f"{old.name} holds the typed piece: {kept_work}; the fresh copy's piece cell is the empty "
            f"exercise: {fresh_is_stub}; my_engine/ unchanged: {untouched}",
        )
    )

    written = file.read_text(encoding="utf-8")
    history = engine / ".history"
    page = ctx.new_page()
    try:
        open_notebook(page, ctx.url, f"{name}.ipynb", ctx.token, reset=True, timeout_ms=90_000)
        cells = page.locator(CELLS)
        wait_for_cells(page, len(fresh["cells"]))
        kinds = [c["cell_type"] for c in fresh["cells"]]
        code_after = [i for i in range(fresh_piece + 1, len(kinds)) if kinds[i] == "code"]
        checker_idx = code_after[0]
        choose_idx = next(i for i in code_after if "course.choose(" in _text(fresh["cells"][i]))

        # (a) the fresh copy run down to "Using your ...": its stub cell must not replace the piece
        select(cells.nth(choose_idx + 1))
        menu(page, "Run", "Run All Above Selected Cell")
        wait_until_run(page, choose_idx + 1, ctx.lesson_timeout, "the refreshed lesson 2")
        outputs = page.evaluate(_OUTPUTS_JS)
        printed = stdout_lines(outputs[fresh_piece])
        verdict = [line for line in stdout_lines(outputs[checker_idx]) if line[:1] in "✓✗"]
        using = [line for line in stdout_lines(outputs[choose_idx]) if "Using your" in line]
        same_file = file.read_text(encoding="utf-8") == written
        no_history = not history.exists() or not any(history.glob(f"{piece}.*.py"))
        checks.append(
            Check(
                "the refreshed copy's empty exercise cell, run over the written piece",
                same_file
                and no_history
                and any("did not replace it" in line for line in printed)
                and bool(verdict)
                and verdict[0].startswith("✓")
                and bool(using),
                printed + verdict + using,
                f"my_engine/{piece}.py unchanged: {same_file}; nothing new in .history/: {no_history}",
            )
        )
        if ctx.shots is not None:
            screenshot(page, cells, fresh_piece, fresh_piece, ctx.shots / "rerun_stub_cell.png")

        # (b) a changed version: the old one kept in .history/, one line saying so
        changed = typed.replace('\n"""', '\n# my second try: the same rules, with this comment added\n"""', 1)
        if changed == typed:
            changed = typed + "\n# my second try: a comment added\n"
        type_into(page, cells.nth(fresh_piece), changed)
        run_one_cell(page, cells.nth(fresh_piece))
        printed = stdout_lines(page.evaluate(_OUTPUTS_JS)[fresh_piece])
        kept = history / f"{piece}.1.py"
        kept_ok = kept.exists() and kept.read_text(encoding="utf-8") == written
        new_ok = file.read_text(encoding="utf-8").rstrip() == file_body(changed).rstrip()
        for i in (checker_idx, choose_idx):
            select(cells.nth(i))
            run_one_cell(page, cells.nth(i))
        outputs = page.evaluate(_OUTPUTS_JS)
        verdict = [line for line in stdout_lines(outputs[checker_idx]) if line[:1] in "✓✗"]
        using = [line for line in stdout_lines(outputs[choose_idx]) if "Using your" in line]
        checks.append(
            Check(
                "a changed piece (a comment added) written over the old one",
                kept_ok
                and new_ok
                and len(printed) == 1
                and "previous version is kept as my_engine/.history/continuous.1.py" in printed[0]
                and bool(verdict)
                and verdict[0].startswith("✓")
                and bool(using),
                printed + verdict + using,
                f"my_engine/.history/{piece}.1.py holds the first version: {kept_ok}; "
                f"my_engine/{piece}.py holds the changed one: {new_ok}",
            )
        )

        # (c) the same version again: unchanged, nothing more kept
        select(cells.nth(fresh_piece))
        run_one_cell(page, cells.nth(fresh_piece))
        printed = stdout_lines(page.evaluate(_OUTPUTS_JS)[fresh_piece])
        kept_files = sorted(p.name for p in history.glob(f"{piece}.*.py"))
        checks.append(
            Check(
                "the same piece run again",
                any("already this version (unchanged)" in line for line in printed)
                and kept_files == [f"{piece}.1.py"],
                printed,
                f"my_engine/.history/ holds {', '.join(kept_files) or 'nothing'}",
            )
        )
    except Exception as e:  # noqa: BLE001
        checks.append(
            Check("the re-run in the browser", False, [], f"{type(e).__name__}: {e}".splitlines()[0])
        )
    finally:
        page.close()
        shut_down_kernels(ctx.url, ctx.token)

    # every piece of the run still there, as written
    pieces = sorted(p.name for p in engine.glob("*.py") if p.name != "__init__.py")
    want = sorted(f"{p}.py" for _, _, p, _ in LESSONS)
    checks.append(
        Check(
            "my_engine/ at the end",
            pieces == want,
            [],
            f"{', '.join(pieces)}; .history/: {', '.join(sorted(p.name for p in history.glob('*.py'))) or 'empty'}",
        )
    )
    return checks


# ---------------------------------------------------------------------------------------
# The run


@dataclass
class Context:
    url: str
    token: str
    lesson_timeout: float
    shots: Path | None
    keep_dir: Path | None
    browser_context: object = None

    def new_page(self):
        page = self.browser_context.new_page()
        page.on("dialog", lambda d: d.accept())
        return page


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    return {"cpu": cpu, "cores": os.cpu_count(), "system": f"{platform.system()} {platform.release()}"}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def kill_leftovers(marker: str) -> list[int]:
    """Processes this run started that outlived the server (a kernel, whose command line
    names a file in the run's temporary folder): end them by id."""
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
            except ProcessLookupError:
                pass
    return killed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="the Markdown transcript to write")
    parser.add_argument(
        "--lesson-timeout", type=float, default=360, help="seconds a lesson may take (default 360)"
    )
    parser.add_argument("--no-screenshots", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (printed) for a look")
    args = parser.parse_args(argv)
    if why := missing():
        print(f"new_user_run: {why}", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    out = args.out.resolve()
    shots = None if args.no_screenshots else out.with_suffix("")
    tmp = Path(tempfile.mkdtemp(prefix="batchlab-new-user-"))
    began = datetime.datetime.now(datetime.timezone.utc)
    load_before = uptime()
    results: list[LessonResult] = []
    checks: list[Check] = []
    notes: list[str] = []
    start_lines: list[str] = []
    server = None
    t_all = time.monotonic()
    try:
        clone = tmp / "batchlab"
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
        commit = subprocess.run(
            ["git", "-C", str(clone), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        home = tmp / "home"
        home.mkdir()
        base = {
            **os.environ,
            "HOME": str(home),
            "PYTHONPATH": str(clone / "src"),
            "IPYTHONDIR": str(home / ".ipython"),
        }
        base.pop("XDG_CACHE_HOME", None)
        env = isolated_env(tmp / "jupyter", base=base)
        python = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable

        def lessons_command(extra: list[str]) -> str:
            done = subprocess.run(
                [python, "-m", "batchlab.cli", "lessons", *extra],
                cwd=clone,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if done.returncode != 0:
                raise RuntimeError(
                    f"batchlab lessons {' '.join(extra)} exited {done.returncode}: {done.stderr[-500:]}"
                )
            return done.stdout

        token, port = secrets.token_hex(16), free_port()
        url = f"http://127.0.0.1:{port}"
        jlog = tmp / "jupyterlab.log"
        command = [
            python,
            "-m",
            "batchlab.cli",  # the README's `batchlab lessons`, the clone's code first on PYTHONPATH
            "lessons",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
        ]
        log(f"cloned {commit}; starting: batchlab lessons --no-browser --port={port} ...")
        with jlog.open("w") as handle:
            server = subprocess.Popen(
                command,
                cwd=clone,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_until_serving(url, server, jlog, timeout=90, token=token)
        start_lines = [line for line in jlog.read_text().splitlines() if line.startswith("your ")]
        course = clone / "my-course"
        copied = sorted(p.name for p in course.glob("*.ipynb"))
        if len(copied) != len(list((clone / "notebooks" / "learner").glob("*.ipynb"))):
            notes.append(f"my-course/ holds {len(copied)} lessons, notebooks/learner/ more")
        if (course / "my_engine").exists():
            notes.append("my-course/my_engine/ existed before any lesson ran")
        methods = _methods()
        ctx = Context(url, token, args.lesson_timeout, shots, tmp if args.keep else None)
        with sync_playwright() as p:
            browser = launch_chromium(p, env={**os.environ, "HOME": str(home)})
            try:
                ctx.browser_context = browser.new_context(viewport={"width": 1280, "height": 900})
                version = browser.version
                for lesson, name, piece, expect in LESSONS:
                    log(f"lesson {lesson}: {name}")
                    result, typed = run_lesson(
                        ctx, lesson, name, piece, expect, course, clone / "notebooks", methods, shots
                    )
                    log(
                        f"  {'PASS' if result.passed else 'FAIL'} in {result.seconds:.0f} s {'; '.join(result.problems)}"
                    )
                    results.append(result)
                    if name == RERUN_LESSON:
                        typed_rerun = typed
                log("re-run checks")
                checks = rerun_checks(ctx, course, typed_rerun, lessons_command)
                for c in checks:
                    log(f"  {'ok' if c.ok else 'FAILED'}: {c.what}")
            finally:
                browser.close()
    except Exception as e:  # noqa: BLE001 -- the transcript says what went wrong
        notes.append(f"the run stopped: {type(e).__name__}: {e}".splitlines()[0])
        traceback.print_exc()
        commit = locals().get("commit", "?")
        version = locals().get("version", "?")
    finally:
        if server is not None:
            try:
                shut_down_kernels(url, token)
            except OSError:
                pass
            stop(server)
        leftovers = kill_leftovers(str(tmp))
        if leftovers:
            notes.append(f"ended {len(leftovers)} process(es) that outlived JupyterLab: {leftovers}")
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    minutes = (time.monotonic() - t_all) / 60
    passed = (
        len(results) == len(LESSONS)
        and all(r.passed for r in results)
        and bool(checks)
        and all(c.ok for c in checks)
        and not any(n.startswith("the run stopped") for n in notes)
    )
    write_transcript(
        out,
        began,
        load_before,
        uptime(),
        commit,
        version,
        start_lines,
        results,
        checks,
        notes,
        passed,
        minutes,
        shots,
    )
    log(f"{'PASS' if passed else 'FAIL'} in {minutes:.1f} min; wrote {out}")
    return 0 if passed else 1


def write_transcript(
    out,
    began,
    load_before,
    load_after,
    commit,
    version,
    start_lines,
    results,
    checks,
    notes,
    passed,
    minutes,
    shots,
) -> None:
    m = machine()
    lines = [
        "# A new user's run of the lessons in JupyterLab",
        "",
        f"Recorded by `tests/new_user_run.py` ({'PASS' if passed else 'FAIL'}, {minutes:.1f} min in all). "
        "A fresh clone, the learner's own command `batchlab lessons --no-browser` (JupyterLab on "
        "127.0.0.1 with a token), and Debian's Chromium driven by Playwright: in each lesson the learner's piece "
        "is typed into its `%%piece` cell over the empty exercise, then Run > Run All Cells; the lines below "
        "are read from the rendered outputs. The smaller exercises at a lesson's end are left empty, as a "
        "learner may leave them.",
        "",
        f"- date: {began:%Y-%m-%d %H:%M} UTC; commit {commit}",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['system']}; Chromium {version}",
        f"- load before: `{load_before}`",
        f"- load after: `{load_after}`",
        f"- **overall: {'PASS' if passed else 'FAIL'}**",
        "",
        "The start command printed:",
        "",
        "```text",
        *start_lines,
        "```",
        "",
        "## The lessons",
        "",
        "| lesson | time | piece file | checker | using | result |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.lesson} `{r.name}` | {r.seconds:.0f} s | `{r.piece_file}` "
            f"({'as typed' if r.file_matches else 'NOT as typed'}) | "
            f"{'✓' if r.verdict and r.verdict[0].startswith('✓') else '✗'} | {len(r.using)} line(s) | "
            f"{'PASS' if r.passed else 'FAIL: ' + '; '.join(r.problems)} |"
        )
    for r in results:
        lines += ["", f"### Lesson {r.lesson} · `{r.name}` ({r.seconds:.0f} s)", ""]
        lines.append(f"Typed: {'; '.join(r.filled_from)}.")
        lines += ["", "```text", *r.saved_line, *r.verdict, *r.using, *r.fallbacks, "```"]
        if r.other_verdicts:
            lines += ["", "The smaller exercises (left empty):", "", "```text", *r.other_verdicts, "```"]
        if r.errors:
            lines += ["", "Error cells:", "", "```text", *r.errors, "```"]
        if r.problems:
            lines += ["", f"**FAIL**: {'; '.join(r.problems)}"]
        if shots is not None and (shots / f"lesson{r.lesson}.png").exists():
            rel = os.path.relpath(shots / f"lesson{r.lesson}.png", out.parent)
            lines += ["", f"![lesson {r.lesson}: the checker's verdict and the Using-your line]({rel})"]
    lines += ["", "## Nothing lost on a re-run", ""]
    for c in checks:
        lines += [f"- {'ok' if c.ok else '**FAILED**'}: {c.what}. {c.detail}"]
        if c.printed:
            lines += ["", "  ```text", *[f"  {p}" for p in c.printed], "  ```", ""]
    if shots is not None and (shots / "rerun_stub_cell.png").exists():
        rel = os.path.relpath(shots / "rerun_stub_cell.png", out.parent)
        lines += ["", f"![the refreshed copy's empty exercise cell, run over the written piece]({rel})"]
    if notes:
        lines += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
