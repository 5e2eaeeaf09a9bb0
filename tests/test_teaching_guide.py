"""docs/teaching.md against the solved lessons: its answer key covers every "Predict first" and
every numbered question, and every figure of its run sheet is in the lesson's outputs.

Reads the committed notebooks (JSON) only: fast, no model, nothing executed. The lessons are
re-executed from time to time, so the run sheet's *exact* rows are figures that do not depend on
the machine (step counts, fake-model schedules, lesson 9's simulation, a recorded file) and its
*about* rows are timings, checked within a factor of 2.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "teaching.md"
LESSONS = {
    (str(int(m[1])) + m[2]): path
    for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
    if (m := re.match(r"(\d+)([a-z]?)_", path.name))
}
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
ENTRY = re.compile(r'^- \*\*Lesson (\w+), (predict|question (\d+)):\*\* "([^"]+)"', re.M)


def plain(text: str) -> str:
    """Without Markdown emphasis and code marks, whitespace runs as one space."""
    return " ".join(re.sub(r"[*`]", "", text).split())


def cells(lesson: str, kind: str) -> list[dict]:
    nb = json.loads(LESSONS[lesson].read_text(encoding="utf-8"))
    return [c for c in nb["cells"] if c["cell_type"] == kind]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def output_text(lesson: str) -> str:
    """What the lesson printed: streams, Markdown results, and plain reprs of the rest."""
    parts = []
    for cell in cells(lesson, "code"):
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                parts.append("".join(out["text"]))
            elif "data" in out:
                data = out["data"]
                parts.append("".join(data.get("text/markdown") or data.get("text/plain", "")))
    return plain("\n".join(parts))


def guide_section(title: str) -> str:
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def predict_questions(lesson: str) -> list[str]:
    """Each "Predict first" paragraph of the lesson, from the words "Predict first" on."""
    found = []
    for cell in cells(lesson, "markdown"):
        text = source(cell)
        for m in re.finditer(r"Predict first", text):
            found.append(plain(text[m.start() :].split("\n\n")[0]))
    return found


def numbered_questions(lesson: str) -> dict[int, str]:
    """The items of the lesson's "**Questions**" list, inline "(1) ..." or one "1. ..." a line."""
    items = {}
    for cell in cells(lesson, "markdown"):
        text = source(cell)
        if "**Questions" not in text:
            continue
        block = text[text.index("**Questions") :].split("\n\n")[0]
        marks = list(re.finditer(r"\((\d+)\)|^(\d+)\.\s", block, re.M))
        for m, nxt in zip(marks, marks[1:] + [None]):
            items[int(m[1] or m[2])] = plain(block[m.end() : nxt.start() if nxt else None])
    return items


def key_entries() -> list[tuple[str, str, int | None, str]]:
    """(lesson, "predict" or "question", question number, quote) for every answer-key entry."""
    return [
        (m[1], "predict" if m[2] == "predict" else "question", int(m[3]) if m[3] else None, plain(m[4]))
        for m in ENTRY.finditer(guide_section("Answer key"))
    ]


def test_every_predict_first_has_an_answer():
    entries = key_entries()
    missing, stale = [], []
    for lesson in LESSONS:
        questions = predict_questions(lesson)
        quotes = [q for les, kind, _, q in entries if les == lesson and kind == "predict"]
        missing += [f"lesson {lesson}: {q[:70]}" for q in questions if not any(x in q for x in quotes)]
        stale += [f"lesson {lesson}: {x!r}" for x in quotes if not any(x in q for q in questions)]
    assert sum(len(predict_questions(les)) for les in LESSONS) >= 10, "found too few Predict first cells"
    assert not missing, "Predict first questions without an answer in docs/teaching.md: " + "; ".join(missing)
    assert not stale, "answer-key quotes found in no Predict first question: " + "; ".join(stale)


def test_every_numbered_question_has_an_answer():
    entries = {(les, n): q for les, kind, n, q in key_entries() if kind == "question"}
    missing, wrong = [], []
    for lesson in LESSONS:
        for n, text in numbered_questions(lesson).items():
            if (lesson, n) not in entries:
                missing.append(f"lesson {lesson}, question {n}")
            elif entries[(lesson, n)] not in text:
                wrong.append(f"lesson {lesson}, question {n}: {entries[(lesson, n)]!r} not in {text[:70]!r}")
    asked = {(les, n) for les in LESSONS for n in numbered_questions(les)}
    assert len(asked) >= 10, "found too few numbered questions"
    assert not missing, "questions without an answer: " + "; ".join(missing)
    assert not wrong, "; ".join(wrong)
    assert set(entries) <= asked, f"answers to questions no lesson asks: {sorted(set(entries) - asked)}"


def run_sheet() -> list[dict]:
    rows = []
    for line in guide_section("Run sheet").splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) == 5 and cols[0] in LESSONS:
            label = re.fullmatch(r"`([^`]+)`", cols[2])
            assert label, f"run sheet: the third column is not one code span: {line}"
            rows.append({"lesson": cols[0], "label": label[1], "figure": cols[3], "check": cols[4]})
    return rows


def label_pattern(label: str) -> re.Pattern:
    """The printed words, "…" skipping any text; a part that starts or ends with a letter or
    digit must start or end a word there."""
    parts = []
    for part in (p.strip() for p in plain(label).split("…")):
        pat = r"\s+".join(re.escape(w) for w in part.split())
        if re.match(r"\w", part):
            pat = r"(?<![\w.])" + pat
        if re.search(r"\w$", part):
            pat += r"(?![\w])"
        parts.append(pat)
    return re.compile(r".*?".join(parts), re.S)


def test_run_sheet_is_there():
    rows = run_sheet()
    assert {r["lesson"] for r in rows} == set(LESSONS), "every lesson needs a row in the run sheet"
    assert {r["check"] for r in rows} == {"exact", "about"}


@pytest.mark.parametrize("row", run_sheet(), ids=lambda r: f"{r['lesson']}:{r['label']}")
def test_run_sheet_figure_is_printed(row):
    text = output_text(row["lesson"])
    found = label_pattern(row["label"]).search(text)
    assert found, f"lesson {row['lesson']} prints no {row['label']!r}"
    printed = NUMBER.search(text, found.end())
    assert printed, f"lesson {row['lesson']}: no number after {row['label']!r}"
    quoted = NUMBER.search(row["figure"])
    assert quoted, f"run sheet: no number in {row['figure']!r}"
    got, want = printed[0].replace(",", ""), quoted[0].replace(",", "")
    context = text[found.start() : printed.end() + 20]
    if row["check"] == "exact":
        assert got == want, f"lesson {row['lesson']} now prints {got}, the run sheet says {want}: {context!r}"
    else:
        assert row["check"] == "about", row
        ok = 0.5 <= float(got) / float(want) <= 2 if float(want) else float(got) == 0
        assert ok, (
            f"lesson {row['lesson']} now prints {got}, more than a factor of 2 from the run sheet's {want}: "
            f"{context!r}"
        )
