"""The soak benchmark in small: a job killed with kill -9 at a step and during a save resumes every time
from a checkpoint that verifies, and ends with the uninterrupted run's losses, bit for bit."""
import importlib.util

from tests.faults.launch import ROOT


def test_small_soak(tmp_path):
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    result = soak.soak(kills=2, nproc=1, tp=1, seed=1, work=tmp_path, timeout=120, steps=8)
    assert [r["mode"] for r in result["kills"]] == ["step", "save"]
    assert result["during_saves"] >= 1 and result["all_verify"], result["kills"]
    assert result["launches"] == 3 and result["resumed_from_latest"]
    assert result["identical_losses"] == result["identical_grad_norms"] == result["steps_compared"] == 8
