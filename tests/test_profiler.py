"""The profile section: the torch profiler over a window of steps on the chosen ranks, one Chrome trace each
(steps named), and the watchdog's allowance on every rank, profiled or not, while the window lasts."""
import json
from pathlib import Path

import torch

from megalysses.config import ProfileConfig
from megalysses.testing import run_distributed
from megalysses.training.profiler import PROFILE_ALLOWANCE, StepProfiler
from tests import fixtures

TINY = fixtures.TINY + ["parallel.timeout_seconds=60"]


class Allowances:
    def __init__(self):
        self.given, self.activities = [], []

    def allow(self, factor):
        self.given.append(factor)

    def doing(self, what):
        self.activities.append(what)


def _steps(profiler, steps):
    for n in steps:
        with profiler.step(n):
            torch.ones(8, 8) @ torch.ones(8, 8)
    profiler.close()


def test_every_rank_allows_the_window_and_only_profiled_ranks_write(tmp_path):
    """Window 3-4: the allowance from the warm-up step 2 until step 5 starts, on a profiled and an unprofiled
    rank; a run that stops inside the window (after step 3) writes the steps it recorded."""
    cfg = ProfileConfig(start_step=3, end_step=4, ranks=[1])
    for rank in (0, 1):
        dog = Allowances()
        _steps(StepProfiler(cfg, rank, tmp_path, torch.device("cpu"), dog), range(1, 7))
        assert dog.given == [1.0, PROFILE_ALLOWANCE, PROFILE_ALLOWANCE, PROFILE_ALLOWANCE, 1.0, 1.0]
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["rank1.steps3-4.pt.trace.json"]
    assert dog.activities == ["writing the profiler trace of steps 3-4 (rank1.steps3-4.pt.trace.json)"]
    _steps(StepProfiler(cfg, 1, tmp_path / "stopped", torch.device("cpu")), range(1, 4))
    assert [p.name for p in (tmp_path / "stopped" / "profile").iterdir()] == ["rank1.steps3-3.pt.trace.json"]


def _train(rank, world, run):
    from megalysses.tools import pretrain

    pretrain.destroy_distributed = lambda: None          # the test's process group outlives the run
    overrides = TINY + ["parallel.sp=2", "training.train_steps=3", "profile.start_step=2", "profile.end_step=3",
                        "profile.ranks=[1]", f"logging.run_dir={run}"]
    return pretrain.main([a for o in overrides for a in ("--set", o)])


def test_a_run_profiles_its_window_on_the_chosen_rank(tmp_path):
    run = tmp_path / "run"
    assert run_distributed(_train, 2, tmp_path, args=(str(run),)) == [0, 0]
    (trace,) = (run / "profile").iterdir()
    assert trace.name == "rank1.steps2-3.pt.trace.json"
    events = json.loads(Path(trace).read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"step 2", "step 3"} <= names and "step 1" not in names and "aten::mm" in names
