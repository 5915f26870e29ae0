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
    got = bench_gpu.longest_fitting(fits, 8, 64 * 8, 8)
    assert got == min(limit, 64) * 8
    assert len(asked) <= 2 + 6                      # lo, hi, then log2(64) probes
    assert bench_gpu.longest_fitting(lambda n: False, 8, 64, 8) is None


def test_smoke_run(tmp_path):
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--smoke", "--lengths", "64",
                        "--frameworks", "megalysses", "transformers", "--longest-max", "128", "--steps", "2",
                        "--warmup", "1", "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "gpu_smoke.json").read_text())
    rows = {row["framework"]: row for row in result["rows"]}
    assert set(rows) == {"megalysses", "transformers"}
    for row in rows.values():
        assert row["fits"] and row["tokens_per_s"] > 0 and row["loss"] == row["loss"], row
    assert result["longest"] == {"megalysses": 128, "transformers": 128}
    assert result["versions"]["torch"] and "| 64 | megalysses |" in (tmp_path / "gpu_smoke.md").read_text()
