"""One registry: a scheduler class carries its kind name, description and options, and
everything else reads them -- make_engine, every command's ``--engine`` (a kind or
``module:Class``), its flags, ``batchlab demo``, the bench and the README's kinds table.

The test that matters most defines a NEW kind in a module of its own (in a temporary
folder, as a learner's ``my_engine/`` would be) and runs it through all of them, with no
other file edited.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import batchlab
from batchlab import cli, make_engine
from batchlab.core.engine import scheduler_class
from batchlab.core.fake import FakeModel, FakeRunner, reference_output
from batchlab.core.scheduler import KINDS, Option

README = Path(__file__).resolve().parents[1] / "README.md"

NEW_KIND = '''
from batchlab.core.policies import PriorityPolicy
from batchlab.core.request import State
from batchlab.core.scheduler import ContinuousScheduler, Option


class OldestGivesWay(PriorityPolicy):
    def victim(self, running):
        return running[0]


class LongestFirst(ContinuousScheduler):
    """Continuous batching that admits the longest waiting prompt first."""

    kind = "longest-first"
    description = "continuous batching that admits the longest waiting prompt first"
    options = {"min_prompt": Option(int, "prompts shorter than this wait behind longer ones")}

    def __init__(self, blocks, clock, max_batch_size=8, prefill_step=None, min_prompt=0,
                 policy=None):
        super().__init__(blocks, clock, max_batch_size, prefill_step, policy)
        self.min_prompt = min_prompt

    def admit(self):
        if self.queue and not self.in_state(State.PREFILLING, State.AWAITING_SLOT):
            req = max(self.queue, key=lambda r: (r.prefill_len >= self.min_prompt, r.prefill_len))
            if self.fits(req, self.prefill_step):
                self.start(req, self.prefill_step)
'''


@pytest.fixture
def new_kind(tmp_path, monkeypatch):
    """The new kind's module in a temporary folder, which is the current folder."""
    (tmp_path / "mykinds.py").write_text(NEW_KIND)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield scheduler_class("mykinds:LongestFirst")
    sys.modules.pop("mykinds", None)


# -- the registry itself ------------------------------------------------------------------------
def test_every_shipped_kind_describes_itself_and_every_option():
    assert list(KINDS) == ["sequential", "static", "continuous", "stallfree"]
    for kind, cls in KINDS.items():
        assert cls.kind == kind and cls.description, kind
        for name, (default, option) in cls.option_specs().items():
            if name == "policy":  # an object, not a command-line value
                assert option is None
                continue
            assert isinstance(option, Option) and option.help, f"{kind}.{name} has no help text"


def test_the_flags_come_from_the_registry():
    text = cli.build_parser().format_help()
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    serve_help = sub.choices["serve"].format_help()
    for cls in KINDS.values():
        for name, (_, option) in cls.option_specs().items():
            if option is not None:
                assert f"--{name.replace('_', '-')}" in serve_help, name
    assert "kinds" in text


def test_the_readme_kinds_table_is_the_registry():
    readme = README.read_text()
    assert cli.kinds_table() in readme, (
        "the README's kinds table differs from `batchlab kinds`; paste its output into the README"
    )


def test_bad_engine_specs_say_what_is_wrong(tmp_path, monkeypatch):
    (tmp_path / "broken.py").write_text("def oops(:\n")
    (tmp_path / "notone.py").write_text("class Thing:\n    pass\nvalue = 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "nope": "unknown engine kind 'nope'",
        "nosuchmodule:X": "there is no module 'nosuchmodule' here",
        "broken:X": "importing broken raised SyntaxError",
        "notone:Missing": "notone defines no 'Missing'",
        "notone:Thing": "Thing is a class, not a Scheduler subclass",
        "notone:value": "value is a int, not a Scheduler subclass",
        "notone:": "write module:Class",
    }
    for spec, says in cases.items():
        with pytest.raises(ValueError, match=re.escape(says)):
            scheduler_class(spec)
        with pytest.raises(SystemExit, match=re.escape(says)):
            cli.main(["serve", "--engine", spec])
    for name in ("broken", "notone"):
        sys.modules.pop(name, None)


# -- a new kind is one class -----------------------------------------------------------------
def test_a_new_kind_runs_through_make_engine_and_its_option_is_a_flag(new_kind):
    assert new_kind.kind not in KINDS and new_kind not in KINDS.values()  # shipped kinds only
    engine = make_engine(
        "mykinds:LongestFirst", FakeModel(), runner=FakeRunner, max_batch_size=2, min_prompt=3
    )
    prompts = {"short": [5, 6], "long": list(range(1, 30)), "mid": list(range(3, 12))}
    for rid, prompt in prompts.items():
        engine.submit(prompt, max_new_tokens=4, ignore_eos=True, request_id=rid)
    engine.run_until_idle()
    for rid, prompt in prompts.items():
        assert engine.trace.requests[rid].output_ids == reference_output(prompt, 4, 64, frozenset())
    first = [rid for s in engine.trace.steps for rid, start, _ in s.prefill if start == 0]
    assert first == ["long", "mid", "short"]  # its own admission order, not first come
    sub = next(a for a in cli.build_parser(new_kind)._actions if a.dest == "command")
    assert "--min-prompt" in sub.choices["serve"].format_help()
    with pytest.raises(ValueError, match="min_prompt does not apply to the continuous engine"):
        make_engine("continuous", FakeModel(), runner=FakeRunner, min_prompt=3)


def test_a_learners_policy_from_the_command_line(new_kind):
    args = cli.build_parser(new_kind).parse_args(
        [
            "serve",
            "--engine",
            "mykinds:LongestFirst",
            "--policy",
            "mykinds:OldestGivesWay",
            "--min-prompt",
            "2",
        ]
    )
    options = cli.engine_options(args)
    assert type(options["policy"]).__name__ == "OldestGivesWay" and options["min_prompt"] == 2
    engine = make_engine(new_kind, FakeModel(), runner=FakeRunner, **options)
    assert engine.scheduler.policy is options["policy"]
    with pytest.raises(SystemExit, match="not a subclass of Policy"):
        cli.main(["serve", "--engine", "mykinds:LongestFirst", "--policy", "mykinds:LongestFirst"])


def test_a_policys_arguments_from_the_command_line():
    """``--policy-arg NAME=VALUE`` makes the --policy class with that argument (an aging policy's
    ``age_s``), and says what is wrong with one the class does not take or cannot parse."""
    args = cli.build_parser().parse_args(
        ["serve", "--policy", "learner_pieces:MyAgingPolicy", "--policy-arg", "age_s=12.5"]
    )
    assert cli.engine_options(args)["policy"].age_s == 12.5
    for settings, says in [
        (["--policy-arg", "speed=3"], "unexpected keyword argument 'speed'"),
        (["--policy-arg", "age_s"], "write NAME=VALUE"),
        (["--policy-arg", "age_s=0"], "age_s must be a number of seconds > 0"),
    ]:
        with pytest.raises(SystemExit, match=re.escape(says)):
            cli.main(["serve", "--policy", "learner_pieces:MyAgingPolicy", *settings])
    with pytest.raises(SystemExit, match="--policy-arg needs --policy"):
        cli.main(["serve", "--policy-arg", "age_s=3"])


def test_a_learners_front_and_shedding_from_the_command_line():
    """``batchlab serve --front ... --shedding ... --max-wait S`` hands the learner's classes
    to the server, which builds the engine with them (the real server: the test below)."""
    import learner_pieces

    args = cli.build_parser().parse_args(
        [
            "serve",
            "--front",
            "learner_pieces:MyEngine",
            "--shedding",
            "learner_pieces:MyAdmission",
            "--max-wait",
            "5",
            "--server",
            "learner_pieces:MyServer",
        ]
    )
    pieces = cli.serve_pieces(args)
    assert pieces == {
        "engine_class": learner_pieces.MyEngine,
        "shedding": learner_pieces.MyAdmission,
        "server_class": learner_pieces.MyServer,
        "max_wait_s": 5.0,
    }
    for flag, spec, base in [
        ("--front", "learner_pieces:MyAdmission", "EngineBase"),
        ("--shedding", "learner_pieces:MyEngine", "AdmissionBase"),
        ("--server", "learner_pieces:MyEngine", "ServerBase"),
    ]:
        with pytest.raises(SystemExit, match=f"not a subclass of {base}"):
            cli.main(["serve", flag, spec])


def test_a_new_kind_in_the_demo(new_kind):
    from test_demo import CharTokenizer, Terminal  # the demo's own fake tokenizer and terminal
    from types import SimpleNamespace

    lm = SimpleNamespace(
        tokenizer=CharTokenizer(), vocab_size=64, max_seq_len=2048, info=SimpleNamespace(name="fake-model")
    )
    summary = batchlab.demo.play(
        lm, "mykinds:LongestFirst", 6, out=Terminal(), runner=FakeRunner, max_batch_size=3, min_prompt=2
    )
    assert summary.startswith("The longest-first engine answered 6 requests")
    assert "admits the longest waiting prompt first" in " ".join(summary.split())


def test_a_new_kind_in_the_bench_command(new_kind, monkeypatch):
    """``batchlab bench --engine mykinds:LongestFirst`` hands the class to the bench, which
    builds it like its own engines (the bench itself is run by tests/test_bench.py)."""
    import batchlab.measurement.bench as bench
    import batchlab.model.load as model

    seen = {}

    def run_bench(lm, quick=False, json_out=None, **kwargs):
        seen.update(kwargs)
        return {}

    monkeypatch.setattr(bench, "run_bench", run_bench)
    monkeypatch.setattr(bench, "format_table", lambda result: "")
    monkeypatch.setattr(model, "load_model", lambda path=None, dtype=None: FakeModel())
    assert cli.main(["bench", "--quick", "--engine", "mykinds:LongestFirst", "--tbt-slo", "0.2"]) == 0
    assert seen["tbt_slo"] == 0.2
    options = seen["extra_engines"]["longest-first"]
    assert options["kind"] is new_kind
    engine = make_engine(**options, lm=FakeModel(), runner=FakeRunner, max_batch_size=2)
    rid = engine.submit([1, 2, 3], max_new_tokens=3, ignore_eos=True)
    engine.run_until_idle()
    assert engine.poll(rid)[1:] == ("done", "length")


@pytest.mark.slow
def test_a_new_kind_serves_the_openai_client(new_kind, lm):
    """``batchlab serve --engine mykinds:LongestFirst`` from the folder holding the module,
    as a real server process, answering the ``openai`` client like the reference engine."""
    from openai import OpenAI

    from batchlab import generate
    from batchlab.serving.serverprocs import batchlab_spec, running

    spec = batchlab_spec(2, 16, "mykinds:LongestFirst", "--min-prompt", "4")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with running(spec) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    expected = generate(lm, messages, max_new_tokens=12)
    assert reply.choices[0].message.content == expected.text


@pytest.mark.slow
def test_the_server_runs_the_learners_whole_engine(lm):
    """The served engine is the learner's whole engine, as the finish line runs it: every piece,
    from lesson 1's finishing rules to lesson 10's aging policy, inside the learner's front with
    the learner's shedding consulted each step, and each answer streamed by the learner's
    server (lesson 7); it answers as the reference engine does."""
    import inspect
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    import learner_pieces as L
    from batchlab import generate
    from batchlab.serving.launch import serve_in_thread

    calls: dict[str, int] = {}

    def counted(cls, *names):
        """``cls`` with each of ``names`` counting its calls (the learner's own code still runs)."""

        def wrap(name):
            if inspect.isasyncgenfunction(getattr(cls, name)):

                async def stream(self, *args, **kwargs):
                    calls[name] = calls.get(name, 0) + 1
                    async for item in getattr(super(made, self), name)(*args, **kwargs):
                        yield item

                return stream

            def method(self, *args, **kwargs):
                calls[name] = calls.get(name, 0) + 1
                return getattr(super(made, self), name)(*args, **kwargs)

            return method

        made = type(cls.__name__, (cls,), {name: wrap(name) for name in names})
        return made

    Scheduler = counted(L.MyMemoryScheduler, "finish_reason", "admit_next", "chunk", "plan", "fits", "grow")
    Aging = counted(L.MyAgingPolicy, "next_queued")
    Front = counted(L.MyEngine, "poll")
    Shedding = counted(L.MyAdmission, "to_shed")
    Streams = counted(L.MyServer, "events")
    questions = ["What is the capital of France?", "Name a colour.", "Count to five."]
    server = serve_in_thread(
        lm,
        Scheduler,
        engine_class=Front,
        shedding=Shedding,
        max_wait_s=600.0,
        server_class=Streams,
        policy=Aging(),
        max_batch_size=2,
        token_budget=32,
    )
    try:
        assert isinstance(server.engine, Front) and isinstance(server.engine.scheduler, Scheduler)
        assert isinstance(server.engine.scheduler.policy, Aging)
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")

        def ask(question):
            messages = [{"role": "user", "content": question}]
            if question.startswith("Name"):  # one answer streamed, event by event
                chunks = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=12, temperature=0, stream=True
                )
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
            return reply.choices[0].message.content

        with ThreadPoolExecutor(len(questions)) as pool:
            replies = list(pool.map(ask, questions))
    finally:
        server.stop()
    for question, reply in zip(questions, replies):
        assert reply == generate(lm, [{"role": "user", "content": question}], max_new_tokens=12).text
    pieces = [
        "finish_reason",
        "admit_next",
        "chunk",
        "plan",
        "fits",
        "grow",
        "next_queued",
        "poll",
        "to_shed",
        "events",
    ]
    assert not [name for name in pieces if not calls.get(name)], calls


def test_the_command_line_runs_a_learner_module_from_the_current_folder(tmp_path):
    """A fresh process (as a learner runs it): ``batchlab kinds`` works anywhere and a
    module:Class in the current folder is found without installing anything."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mine.py").write_text(textwrap.dedent(NEW_KIND))
    code = (
        "import sys; from batchlab.core.engine import scheduler_class; "
        "print(scheduler_class('pkg.mine:LongestFirst').kind)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "longest-first"
