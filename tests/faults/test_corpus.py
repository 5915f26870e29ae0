"""The bad-input corpus (corpus.py): enough cases, none accepted silently, nearly all answered with one
message naming the problem and no traceback."""
import pytest

from tests.faults.corpus import Case, all_cases, judge, run_case, summary, table

MIN_CASES = 200
MIN_HANDLED = 0.97


def test_judge_tells_handled_from_the_rest():
    c = Case("x/y", lambda tmp: 1, "vocab")
    assert judge(c, 1, "error: model.vocab_size=0 is out of range\n") == "handled"
    assert judge(c, 2, "prog: error: argument --vocab-size: invalid int value\n") == "handled"
    assert judge(c, 2, "config error: model.vocab_size: expected an integer\n") == "handled"
    assert judge(c, 0, "") == "silent"
    assert judge(c, 1, "Traceback (most recent call last):\n  ...\nerror: vocab\n") == "traceback"
    assert judge(c, 1, "error: vocab\nerror: vocab again\n") == "several messages"
    assert judge(c, 1, "error: something else\n") == "vague"
    assert judge(c, 1, "it broke\n") == "no message"


def test_run_case_catches_exits_and_exceptions(tmp_path):
    def boom(tmp):
        raise ValueError("x")
    assert run_case(Case("x/raise", boom, "x"), tmp_path).verdict == "traceback"
    assert run_case(Case("x/exit", lambda tmp: (_ for _ in ()).throw(SystemExit(0)), "x"), tmp_path).verdict == "silent"


def test_the_corpus(tmp_path, capsys):
    outcomes = [run_case(c, tmp_path) for c in all_cases()]
    with capsys.disabled():                     # the counts go to the terminal (the CI log), captured or not
        print("\nthe bad-input corpus (python tests/faults/corpus.py):\n" + table(outcomes))
    s = summary(outcomes)
    bad = [f"{o.verdict}: {o.case.name}: {o.output.strip()[-300:]}" for o in outcomes if o.verdict != "handled"]
    assert s["silent"] == 0, "accepted silently:\n" + "\n".join(b for b in bad if b.startswith("silent"))
    assert s["traceback"] == 0, "tracebacks:\n" + "\n".join(b for b in bad if b.startswith("traceback"))
    if s["cases"] < MIN_CASES:
        pytest.fail(f"the corpus has {s['cases']} cases, fewer than {MIN_CASES}")
    assert s["handled"] >= MIN_HANDLED * s["cases"], "\n".join(bad)
