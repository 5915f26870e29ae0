"""benchmarks/bench_gpu.py stays runnable without a GPU: --smoke trains a tiny shape end to end in
separate processes (megalysses and transformers rows), and the bisection finds the longest length."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
bench_gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_gpu)


@pytest.mark.parametrize("limit", [1, 7, 8, 13, 64])
def test_longest_fitting_bisection(limit):
    asked = []

    def fits(n):
        asked.append(n)
        return n <= limit * 8
    good, bad, stopped = bench_gpu.longest_fitting(fits, 8, 64 * 8, 8)
    assert good == min(limit, 64) * 8 and bad == (None if limit >= 64 else good + 8) and stopped is None
    assert len(asked) <= 1 + 6 + 5                  # lo, doubling to 64 at most, then bisecting an octave
    assert len(asked) == len(set(asked)) and max(asked) <= 2 * limit * 8   # never far past the limit
    assert bench_gpu.longest_fitting(lambda n: False, 8, 64, 8) == (None, 8, None)


def test_bisection_stops_at_the_time_budget_with_the_interval_it_has():
    asked = []

    def fits(n):
        asked.append(n)
        return n <= 100 * 8
    good, bad, stopped = bench_gpu.longest_fitting(fits, 8, 1024 * 8, 8, out_of_time=lambda: len(asked) >= 4)
    assert len(asked) == 4 and good <= 100 * 8 < bad and bad - good > 8 and stopped == "time budget"
    assert bench_gpu.longest_text(good, bad, 8, 1024 * 8, stopped) == \
        f"{good:,d} to {bad - 8:,d} (the time budget ended the search)"
    assert bench_gpu.longest_text(good, good + 8, 8, 1024 * 8) == f"{good:,d}"
    assert bench_gpu.longest_text(None, 8, 8, 64) == "none (not even 8)"


@pytest.mark.parametrize("unknown_at", [8, 32 * 8, 24 * 8, 28 * 8])
def test_bisection_stops_at_a_probe_that_cannot_tell(unknown_at):
    """A probe that timed out or failed (fits() is None) says nothing about memory: the search ends there
    with the interval it has, not narrowed as if that length ran out of memory."""
    limit, asked = 30 * 8, []

    def fits(n):
        asked.append(n)
        return None if n == unknown_at else n <= limit
    # the budget ending during that probe (it was killed at the deadline) is reported as the budget
    assert bench_gpu.longest_fitting(fits, 8, 64 * 8, 8, out_of_time=lambda: unknown_at in asked)[2] == "time budget"
    asked.clear()
    good, bad, stopped = bench_gpu.longest_fitting(fits, 8, 64 * 8, 8)
    assert asked[-1] == unknown_at and asked.count(unknown_at) == 1 and stopped == "unknown"
    text = bench_gpu.longest_text(good, bad, 8, 64 * 8, stopped)
    if unknown_at == 8:                             # nothing learnt
        assert (good, bad) == (None, None) and text.startswith("not known")
        return
    assert good <= limit < bad and bad - good > 8   # the interval still holds the answer
    # lo, doubling to 16*8 (fit) and 32*8 (too long), then the bisection probes 24*8 (fit), 28*8, ...; an unknown
    # doubling probe leaves the answer anywhere up to the bound
    assert (good, bad) == {32 * 8: (16 * 8, 65 * 8), 24 * 8: (16 * 8, 32 * 8), 28 * 8: (24 * 8, 32 * 8)}[unknown_at]
    assert text == f"{good:,d} to {bad - 8:,d} (a longer run did not finish within the child timeout or failed)"


def test_smoke_run(tmp_path):
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--smoke", "--lengths", "64",
                        "--frameworks", "megalysses", "transformers", "--longest-max", "128", "--steps", "2",
                        "--warmup", "1", "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "three_way_smoke.json").read_text())
    rows = {row["framework"]: row for row in result["rows"]}
    assert set(rows) == {"megalysses", "transformers"}
    for row in rows.values():
        assert row["fits"] and row["tokens_per_s"] > 0 and row["loss"] == row["loss"], row
    assert result["longest"] == {fw: {"good": 128, "bad": None, "stopped": None}
                                 for fw in ("megalysses", "transformers")}
    assert result["versions"]["torch"] and "| 64 | megalysses |" in (tmp_path / "three_way_smoke.md").read_text()


def test_time_budget_ends_the_run_with_what_it_has(tmp_path):
    """A budget too short for one run: the run started is stopped at the budget, the rest are reported as
    not run, the search is not started, and the tables are still written."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--smoke", "--lengths", "64", "128",
                        "--frameworks", "megalysses", "--time-budget", "0.5", "--out-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "three_way_smoke.json").read_text())
    assert [(row["seq_len"], row["error"]) for row in result["rows"]] == [
        (64, "timed out"), (128, "not run: the time budget ended")]
    assert result["longest"] == {"megalysses": {"good": None, "bad": None, "stopped": "time budget"}}
    assert "not searched (the time budget ended first)" in (tmp_path / "three_way_smoke.md").read_text()


def test_kept_attention_is_tried_only_where_attention_runs_on_sdpa(monkeypatch):
    import torch

    from megalysses.plan import run_plan

    cpu = bench_gpu.settings_of("megalysses", bench_gpu.LLAMA_1B, torch.device("cpu"), torch.float32)
    assert cpu == bench_gpu.SETTINGS["megalysses"] and any(s.get("keep_attn") for s in cpu)
    monkeypatch.setattr(run_plan, "choose_attention", lambda *a, **k: ("flash", "installed"))
    flash = bench_gpu.settings_of("megalysses", bench_gpu.LLAMA_1B, torch.device("cpu"), torch.float32)
    assert flash and not any(s.get("keep_attn") for s in flash)
    assert bench_gpu.settings_of("liger", bench_gpu.LLAMA_1B, torch.device("cpu"), torch.float32) == \
        bench_gpu.SETTINGS["liger"]
