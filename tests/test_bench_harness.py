"""benchmarks/harness.py: the scripts in benchmarks/ print by default and write only into an --out-dir they are
given or, with --record, into benchmarks/results/; a child process and everything it started end at its
time bound, keeping the output it had written."""
import argparse
import ast
import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name not in ("__init__.py", "harness.py")
                 and "__main__" in p.read_text())


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_writes_only_where_it_is_told(script):
    """Every script takes --out-dir / --record (harness.add_output_args), has no --json of its own, and writes
    no file except through harness.write_text (a method .write_text/.write_bytes or open(..., "w") would
    write wherever its path points)."""
    tree = ast.parse(script.read_text())
    names = {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in _calls(tree)
             if isinstance(c.func, (ast.Name, ast.Attribute))}
    assert "add_output_args" in names and "output_dir" in names, script.name
    flags = [c.args[0].value for c in _calls(tree) if isinstance(c.func, ast.Attribute)
             and c.func.attr == "add_argument" and c.args and isinstance(c.args[0], ast.Constant)]
    assert "--json" not in flags and "--out-dir" not in flags, (script.name, flags)   # the harness's only
    for c in _calls(tree):
        if isinstance(c.func, ast.Attribute) and c.func.attr in ("write_text", "write_bytes"):
            pytest.fail(f"{script.name}:{c.lineno} writes with .{c.func.attr}(): use harness.write_text")
        if isinstance(c.func, ast.Name) and c.func.id == "open" and any(
                isinstance(a, ast.Constant) and isinstance(a.value, str) and set(a.value) & set("wax")
                for a in c.args[1:] + [k.value for k in c.keywords if k.arg == "mode"]):
            pytest.fail(f"{script.name}:{c.lineno} opens a file for writing: use harness.write_text")


def test_output_dir_is_none_by_default_and_record_refuses_a_smoke_run(tmp_path, capsys):
    p = argparse.ArgumentParser()
    harness.add_output_args(p, name="x")
    assert harness.output_dir(p, p.parse_args([])) is None
    assert harness.output_dir(p, p.parse_args(["--out-dir", str(tmp_path)])) == tmp_path
    assert harness.output_dir(p, p.parse_args(["--record"])) == ROOT / "benchmarks" / "results"
    with pytest.raises(SystemExit):
        harness.output_dir(p, p.parse_args(["--record"]), smoke=True)
    assert "--record keeps real measurements" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--record", "--out-dir", str(tmp_path)])
    out = harness.write_text(tmp_path / "new", "a.json", "{}")
    assert out.read_text() == "{}" and sorted(os.listdir(tmp_path / "new")) == ["a.json"]


def test_run_bounded_kills_the_child_and_what_it_started(tmp_path):
    """At the bound the child and its own children die (a hang of pytest's ranks or of a compile worker would
    otherwise keep the GPU), and what the child printed before is kept."""
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); "
              f"time.sleep(60)")
    start = time.monotonic()
    done = harness.run_bounded([sys.executable, "-c", script], timeout=3.0)
    assert done.timed_out and done.returncode is None and time.monotonic() - start < 15
    assert "started" in done.stdout
    grandchild = int(pid_file.read_text())
    for _ in range(50):                        # SIGKILL is delivered at once; reaping by init may lag a moment
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        stat = Path(f"/proc/{grandchild}/stat")
        if stat.exists() and stat.read_text().split()[2] == "Z":     # dead, not yet reaped
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the grandchild {grandchild} outlived the bound")
    code = "import sys; print('out'); print('bad', file=sys.stderr); sys.exit(3)"
    ok = harness.run_bounded([sys.executable, "-c", code], timeout=30)
    assert (ok.returncode, ok.stdout, ok.last_line(), ok.timed_out) == (3, "out\n", "bad", False)
    assert harness.run_bounded([sys.executable, "-c", "print(1)"], None).stdout == "1\n"     # no limit
