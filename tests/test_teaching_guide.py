"""docs/teaching.md against the solved lessons: its answer key covers every "Predict first" and
every numbered question; every figure of its run sheet is in the lesson's outputs; the figures
its misconceptions, answer key and 90-minute path quote with a unit are printed by the lesson
they cite; its time table's run column is each lesson's recorded run; the 90-minute and half-day
paths add up to the time table's reading and exercises.

Reads the committed notebooks (JSON) only: fast, no model, nothing executed. The lessons are
re-executed from time to time, so the run sheet's *exact* rows are figures that do not depend on
the machine (step counts, fake-model schedules, lesson 9's simulation, a recorded file) and its
*about* rows are timings, checked within a factor of 2.
"""

import datetime
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


# --- Figures quoted in prose: the time table, the 90-minute path, misconceptions, answer key ---

# A number with a unit, as the guide quotes figures ("2.0x", "390 ms", "61 %", "0.92 μ", "832 tokens").
UNIT = (
    r"tokens/s|tok/s|GFLOP/s|GB/s|ms|s|%|x|×|times|decode steps|empty slot-steps|slot-steps|steps|blocks|tokens|"
    r"requests|minutes|KiB|MiB|μ|preemptions"
)
FIGURE = r"(?<![\w.\-\[:])\d+(?:,\d{3})*(?:\.\d+)?"
WITH_UNIT = r"\s?(?:" + UNIT + r")(?![\w/])"
# A run of figures sharing a unit: "2639 ms, against 390 ms", "39.9 to 32.1 tokens/s",
# "1.1 to 1.6 times", "(5.7 times against 1.7)". Each number of a run with a unit is quoted.
RUN = re.compile(
    f"{FIGURE}(?:{WITH_UNIT})?(?:(?:,? against |,? to | and | or | → |, ){FIGURE}(?:{WITH_UNIT})?)*"
)
CITATION = re.compile(r"\b[Ll]esson (\d+[ab]?)\b")

# Figures the guide may quote that no lesson prints: definitions, or arithmetic on printed figures.
# (lesson, number): why. Keep it short; every entry must still be quoted somewhere (checked).
NOT_PRINTED = {
    ("6", "40"): "answer key: the question's 'forty times less often' (printed too, by chance)",
    ("6", "0.2"): "answer key: 40 × the printed 5 ms poll interval",
}


def printed_numbers(lesson: str) -> str:
    """The lesson's printed output with thousands separators dropped."""
    return re.sub(r"(?<=\d),(?=\d{3})", "", output_text(lesson))


def is_printed(lesson: str, number: str) -> bool:
    number = number.replace(",", "")
    return re.search(r"(?<![\d.])" + re.escape(number) + r"(?!\d|\.\d)", printed_numbers(lesson)) is not None


def quoted_figures(text: str) -> list[str]:
    """Numbers quoted with a unit, outside quoted questions and code spans."""
    text = re.sub(r'^\*\*[^*]+\*\* "[^"]+"', "", text)  # an answer's quoted question
    text = re.sub(r'^\*"[^"]+"\*', "", text)  # a misconception's quoted claim
    found = []
    for run in RUN.finditer(plain(text)):
        if re.search(WITH_UNIT, run[0]):
            found += re.findall(FIGURE, run[0])
    return found


def bullets(section: str) -> list[str]:
    """The section's top-level "- " items, continuation lines joined."""
    items = re.split(r"\n- ", "\n" + guide_section(section).split("\n- ", 1)[-1])
    return [" ".join(item.split()) for item in items if item.strip()]


def misconception_claims() -> list[tuple[str, str, str]]:
    """(lesson, number, clause) for each figure of a misconception: a clause (sentence or
    semicolon part) checks against the lesson it cites, or the last one cited before it in the
    bullet, or else the bullet's first citation."""
    found = []
    for item in bullets("Common misconceptions"):
        cited = CITATION.findall(item)
        if not cited:
            continue
        last = None
        for clause in re.split(r"(?<=[.;])\s+", item):
            here = CITATION.findall(clause)
            last = here[-1] if here else last
            found += [(last or cited[0], n, clause) for n in quoted_figures(clause)]
    return found


def answer_claims() -> list[tuple[str, str, str]]:
    """(lesson, number, entry) for each figure of an answer-key entry, against its own lesson."""
    found = []
    for item in bullets("Answer key"):
        m = re.match(r"\*\*Lesson (\w+),", item)
        if m:
            found += [(m[1], n, item) for n in quoted_figures(item)]
    return found


def unprinted(claims: list[tuple[str, str, str]]) -> list[str]:
    return [
        f"lesson {lesson} prints no {number}: {text[:110]!r}"
        for lesson, number, text in claims
        if (lesson, number.replace(",", "")) not in NOT_PRINTED and not is_printed(lesson, number)
    ]


def test_misconception_figures_are_printed():
    claims = misconception_claims()
    assert len(claims) >= 15, f"found too few figures in the misconceptions: {claims}"
    bad = unprinted(claims)
    assert not bad, "misconceptions quote figures their lesson does not print:\n" + "\n".join(bad)


def test_answer_key_figures_are_printed():
    claims = answer_claims()
    assert len(claims) >= 60, f"found too few figures in the answer key: {len(claims)}"
    bad = unprinted(claims)
    assert not bad, "the answer key quotes figures its lesson does not print:\n" + "\n".join(bad)


def test_not_printed_allowlist_is_used():
    quoted = {(les, n.replace(",", "")) for les, n, _ in misconception_claims() + answer_claims()}
    quoted |= {(les, n.replace(",", "")) for les, n, _ in path_claims()}
    assert set(NOT_PRINTED) <= quoted, f"allowlisted but not quoted: {sorted(set(NOT_PRINTED) - quoted)}"


def run_seconds(lesson: str) -> float:
    """Wall time from the first cell's start to the last cell's reply, as recorded (as in
    test_lesson_prose)."""
    times = [
        c["metadata"]["execution"]
        for c in cells(lesson, "code")
        if "shell.execute_reply" in c["metadata"].get("execution", {})
    ]
    return (recorded(times[-1]["shell.execute_reply"]) - first_start(lesson)).total_seconds()


def recorded(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def first_start(lesson: str):
    first = next(c["metadata"]["execution"] for c in cells(lesson, "code") if "execution" in c["metadata"])
    return recorded(first.get("iopub.execute_input", first.get("iopub.status.busy")))


def time_table() -> dict[str, dict]:
    rows = {}
    for line in guide_section("Time per lesson").splitlines():
        m = re.match(
            r"\| (\w+) · [^|]+\| (\d+) min \| (\d+) min[^|]*\| about (\d+) s[^|]*\| about (\d+) s[^|]*\|$",
            line,
        )
        if m:
            rows[m[1]] = {"reading": int(m[2]), "exercises": int(m[3]), "run": int(m[4]), "apple": int(m[5])}
    return rows


def test_time_table_run_column_is_the_recorded_run():
    table = time_table()
    assert set(table) == set(LESSONS), "every lesson needs a row in the time table"
    off = [
        f"lesson {les}: the table says about {row['run']} s, the committed run took {run_seconds(les):.1f} s"
        for les, row in table.items()
        if abs(row["run"] - run_seconds(les)) > 0.1 * run_seconds(les)
    ]
    assert not off, "; ".join(off)


def test_apple_silicon_column_follows_its_stated_method():
    """About half the 2-core run; lesson 5a (fake model, simulator) the same."""
    wrong = []
    for les, row in time_table().items():
        low, high = (0.9, 1.1) if les == "5a" else (0.4, 0.65)
        if not low <= row["apple"] / row["run"] <= high:
            wrong.append(f"lesson {les}: {row['apple']} s against {row['run']} s")
    assert not wrong, "; ".join(wrong)


def test_recording_paragraph_matches_the_committed_run():
    text = plain(guide_section("Time per lesson"))
    machine = re.search(r"sgemm at (\d+) GFLOP/s and a copy at ([\d.]+) GB/s", text)
    assert machine, "quote lesson 0's sgemm and copy figures"
    printed = re.search(r"this machine: peak (\d+) GFLOP/s, bandwidth ([\d.]+) GB/s", output_text("0"))
    assert machine.groups() == printed.groups(), f"lesson 0 printed {printed[0]!r}"
    total = re.search(r"took (\d+) s of cell time", text)
    assert total, "state the cell time of the whole course"
    assert int(total[1]) == round(sum(run_seconds(les) for les in LESSONS))
    when = r"(\d{4}-\d\d-\d\d) (\d\d:\d\d)"
    window = re.search(rf"recorded from {when} to {when} UTC", text)
    assert window, (
        "state when the runs were recorded: 'recorded from YYYY-MM-DD HH:MM to YYYY-MM-DD HH:MM UTC'"
    )
    start = min(first_start(les) for les in LESSONS)
    end = max(first_start(les).timestamp() + run_seconds(les) for les in LESSONS)
    assert start.strftime("%Y-%m-%d %H:%M") == f"{window[1]} {window[2]}"
    last = recorded(f"{window[3]}T{window[4]}:00Z").timestamp()
    assert last + 59 >= end > last - 60, "the window ends with the last lesson's run"


def ninety_minute_path() -> tuple[str, list[tuple[int, str, str]]]:
    text = guide_section("Two paths")
    part = text[text.index("**90 minutes") : text.index("**Half a day")]
    rows = []
    for line in part.splitlines():
        m = re.match(r"\| (\d+) \|([^|]*)\|([^|]*)\|$", line)
        if m:
            rows.append((int(m[1]), m[2].strip(), m[3].strip()))
    return plain(part), rows


def path_claims() -> list[tuple[str, str, str]]:
    """(lesson, number, cell) for the figures of the path's "if late" column."""
    return [
        (lesson[1], n, late)
        for _, what, late in ninety_minute_path()[1]
        if (lesson := re.match(r"lesson (\w+)", what))
        for n in quoted_figures(late)
    ]


def test_ninety_minute_path_agrees_with_the_time_table():
    table = time_table()
    text, rows = ninety_minute_path()
    stated = re.search(r"(\d+) minutes of plan, (\d+) of buffer", text)
    assert stated and rows, "state the plan and buffer, and give the path's table"
    assert sum(m for m, _, _ in rows) == 90 == int(stated[1]) + int(stated[2])
    assert [m for m, what, _ in rows if what.strip() == "buffer"] == [int(stated[2])]
    wrong = []
    for minutes, what, _ in rows:
        m = re.match(r"lesson (\w+) in full", what)
        if m:
            want = table[m[1]]["reading"] + table[m[1]]["exercises"]
            wrong += [f"{what}: {minutes} min, the table says {want}"] if minutes != want else []
        elif what.strip() != "buffer" and "our estimate" not in what:
            wrong.append(f"{what}: neither a whole lesson (the table's time) nor marked 'our estimate'")
    # the lessons said not to fit, with the table's minutes
    cut = re.search(r"Lessons ([^.]*) do not fit", text)
    assert cut, "say which lessons do not fit"
    for les, minutes in re.findall(r"(\d+[ab]?) \((\d+)", cut[1]):
        want = table[les]["reading"] + table[les]["exercises"]
        wrong += [f"lesson {les}: {minutes} min, the table says {want}"] if int(minutes) != want else []
        assert int(minutes) > int(stated[2]), f"lesson {les} would fit in the buffer"
    assert not wrong, "; ".join(wrong)
    bad = unprinted(path_claims())
    assert not bad, "the path's 'if late' figures are not the lessons' printed ones:\n" + "\n".join(bad)


def test_half_day_path_agrees_with_the_time_table():
    text = plain(guide_section("Two paths"))
    stated = re.search(r"Half a day \((\d+) minutes by the time table", text)
    assert stated, "state the half day's minutes by the time table"
    table = time_table()
    want = sum(
        table[les]["reading"] + table[les]["exercises"] for les in ("0", "1", "2", "3", "4", "5a", "5b", "7")
    )
    assert int(stated[1]) == want, f"the half day (lessons 0-5b and 7) takes {want} minutes by the table"
