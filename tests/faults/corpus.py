"""The bad-input corpus: every case feeds one bad input (a config, a dataset, a tokenizer, a checkpoint,
a tool argument) to the code a user runs, in-process, and is judged by what the user sees.

A case is handled when the run
    - exits with a non-zero status (SystemExit codes and main()'s return value both count),
    - prints exactly one line starting with "error:" (or "<prog>: error:", argparse's form, or
      "<word> error:") whose text contains the case's `expect` fragment, and
    - prints no Python traceback.
It is accepted silently when it exits 0. Anything else (a traceback, several messages, a message that
does not name the problem) is a failure to handle it.

Cases live in the cases_*.py modules of this folder, each exposing `CASES: list[Case]`.

    python tests/faults/corpus.py            # runs every case, prints a table and the totals
    python tests/faults/corpus.py config     # only the cases whose name starts with "config"
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
ERROR_LINE = re.compile(r"^(?:[\w.\-]+(?: [\w\-]+)?: )?(?:\w+ )?error: ")


@dataclass
class Case:
    name: str
    """Unique, "<area>/<what>", e.g. "config/num_kv_heads_zero"."""
    run: Callable[[Path], Optional[int]]
    """Runs the bad input in-process inside a fresh temporary directory (given); returns the exit status,
    or raises SystemExit like a console script."""
    expect: str
    """A fragment (case-insensitive) the one error line must contain: what names the problem."""


@dataclass
class Outcome:
    case: Case
    status: int
    output: str
    verdict: str      # "handled", "silent" (exit 0), "traceback", "no message", "several messages", "vague"


def judge(case: Case, status: int, output: str) -> str:
    if status == 0:
        return "silent"
    if "Traceback (most recent call last)" in output:
        return "traceback"
    errors = [line for line in output.splitlines() if ERROR_LINE.match(line.strip())]
    if not errors:
        return "no message"
    if len(errors) > 1:
        return "several messages"
    return "handled" if case.expect.lower() in errors[0].lower() else "vague"


def run_case(case: Case, tmp_root: Optional[Path] = None) -> Outcome:
    """Run one case with stdout and stderr captured together."""
    buf = io.StringIO()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="case-", dir=tmp_root) as tmp:
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                try:
                    status = case.run(Path(tmp))
                except SystemExit as e:
                    code = e.code
                    status = code if isinstance(code, int) else (0 if code is None else 1)
                    if isinstance(code, str):
                        print(code, file=sys.stderr)
                except BaseException:  # noqa: BLE001 - an escaping exception is what a user would see
                    traceback.print_exc()
                    status = 1
        finally:
            os.chdir(cwd)
    status = 0 if status is None else int(status)
    return Outcome(case, status, buf.getvalue(), judge(case, status, buf.getvalue()))


def all_cases(prefix: str = "") -> list[Case]:
    cases: list[Case] = []
    for path in sorted(HERE.glob("cases_*.py")):
        module = importlib.import_module(f"tests.faults.{path.stem}")
        cases += module.CASES
    names = [c.name for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate case names: {sorted(dup)}")
    return [c for c in cases if c.name.startswith(prefix)]


def summary(outcomes: list[Outcome]) -> dict:
    verdicts = [o.verdict for o in outcomes]
    return {"cases": len(outcomes), "handled": verdicts.count("handled"), "silent": verdicts.count("silent"),
            "traceback": verdicts.count("traceback"),
            "other": len(outcomes) - verdicts.count("handled") - verdicts.count("silent") - verdicts.count("traceback")}


def table(outcomes: list[Outcome]) -> str:
    """The counts per area and in total, then one line per case that was not handled."""
    areas = sorted({o.case.name.split("/")[0] for o in outcomes})
    lines = [f"{'area':<14} {'cases':>6} {'handled':>8} {'silent':>7} {'traceback':>10} {'other':>6}"]
    for area in areas + ["total"]:
        s = summary([o for o in outcomes if area == "total" or o.case.name.split("/")[0] == area])
        lines.append(f"{area:<14} {s['cases']:>6} {s['handled']:>8} {s['silent']:>7} {s['traceback']:>10} "
                     f"{s['other']:>6}")
    for o in outcomes:
        if o.verdict != "handled":
            last = o.output.strip().splitlines()[-1:] or [""]
            lines.append(f"  {o.verdict:<16} {o.case.name}: exit {o.status}: {last[0][:160]}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(table([run_case(c) for c in all_cases(argv[0] if argv else "")]))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    sys.exit(main())
