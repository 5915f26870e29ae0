"""Metrics sinks: TensorBoard event files carry the scalars of metrics.jsonl; a missing package is a config error."""
import math
import statistics
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megalysses.config import ConfigError
from megalysses.config.io import load_config
from megalysses.grid import ParallelGrid
from megalysses.plan.flops import flops_per_token, peak_tflops
from megalysses.training import metrics
from megalysses.training.loop import train
from megalysses.testing import resolve_run
from megalysses.config.checks import check_logging_backends
from tests.fixtures import MOCK_32, SMALL_MODEL
from tests.fixtures import metrics as metrics_rows

TINY = MOCK_32 + SMALL_MODEL + ["model.attention_backend=sdpa", "training.global_batch_size=4",
                                "training.micro_batch_size=1", "training.train_steps=4", "logging.log_interval=2",
                                "training.eval_interval=4", "training.eval_steps=1", "parallel.timeout_seconds=60"]


def _logged(run):
    """The step rows of metrics.jsonl as {name: [(step, value), ...]}, None values left out (the start
    marks, `{"event": "start", ...}`, are not scalars)."""
    points: dict[str, list[tuple[int, float]]] = {}
    for rec in metrics_rows(run):
        if "event" in rec:
            continue
        for key, value in rec.items():
            if key != "step" and value is not None:
                points.setdefault(key, []).append((rec["step"], value))
    return points


def test_tensorboard_holds_the_logged_scalars(tmp_path, world_of_one):
    run = tmp_path / "run"
    cfg = load_config(overrides=TINY + [f"logging.run_dir={run}", "logging.tensorboard=true"])
    grid = ParallelGrid()
    train(cfg, resolve_run(cfg, torch.device("cpu"), grid), grid, torch.device("cpu"))
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    want = _logged(run)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss"} <= want.keys()
    assert [s for s, _ in want["loss"]] == [2, 4] and [s for s, _ in want["val_loss"]] == [4]

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == want.keys()   # mfu is None on CPU: absent from both
    for key, points in want.items():
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in points], key
        for (_, g), (_, w) in zip(got, points, strict=True):
            assert math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-12), (key, g, w)


def test_only_rank0_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "is_rank0", lambda: False)
    cfg = load_config(overrides=TINY + [f"logging.run_dir={tmp_path}/run", "logging.tensorboard=true"])
    logger = metrics.MetricsLogger(cfg, tmp_path / "run", 2, torch.device("cpu"), total_steps=4)
    logger.step(2, 1.0, 1e-3, 0.5, 64, 32)
    logger.eval(2, 1.0)
    logger.close()
    assert not (tmp_path / "run").exists()


def test_missing_logging_packages_are_config_errors(monkeypatch):
    def cfg(*overrides):
        return load_config(overrides=["data.mock=true", *overrides])

    check_logging_backends(cfg("logging.tensorboard=true"))   # installed with the test extra
    monkeypatch.setitem(sys.modules, "tensorboard", None)     # as if the package were absent
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    check_logging_backends(cfg("logging.tensorboard=false"))
    with pytest.raises(ConfigError, match=r"logging.tensorboard=true needs tensorboard: pip install "
                                          r"'megalysses\[tensorboard\]'"):
        check_logging_backends(cfg("logging.tensorboard=true"))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"logging.wandb_mode=offline needs wandb"):
        check_logging_backends(cfg("logging.wandb_mode=offline"))


def test_flops_follow_each_steps_sequence_length(tmp_path, monkeypatch):
    """With a curriculum the attention FLOPs of every step use that step's length, also when one logged
    interval spans two lengths; the record carries the length of its step."""
    cfg = load_config(overrides=TINY + [f"logging.run_dir={tmp_path}/run", "data.seq_len_schedule=[[0, 8], [3, 32]]"])
    clock = iter([0.0, 2.0, 4.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    logger = metrics.MetricsLogger(cfg, tmp_path / "run", 2, torch.device("cpu"), total_steps=4)
    tokens = cfg.training.global_batch_size * cfg.data.seq_len
    for step, length in ((1, 8), (2, 8), (3, 8), (4, 32)):
        logger.step(step, 1.0, 1e-3, 0.5, tokens, length)
    logger.close()
    rows = metrics_rows(tmp_path / "run")
    assert [(r["step"], r["seq_len"]) for r in rows] == [(2, 8), (4, 32)]
    fpt = flops_per_token
    assert fpt(cfg.model, 32) > fpt(cfg.model, 8)
    want = [2 * tokens * fpt(cfg.model, 8), tokens * (fpt(cfg.model, 8) + fpt(cfg.model, 32))]
    for row, flops in zip(rows, want):
        assert math.isclose(row["tflops_per_device"], flops / 2.0 / 2 / 1e12, rel_tol=1e-12)
        assert math.isclose(row["tokens_per_s"], 2 * tokens / 2.0, rel_tol=1e-12)


def test_peak_tflops_by_device_name(monkeypatch):
    for name, peak in (("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
                       ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla T4", None)):
        assert peak_tflops(0.0, name) == peak, name
        assert peak_tflops(0.0, name, "float32") is None      # the bf16 peak is no measure of fp32 work
    assert peak_tflops(500.0, "NVIDIA H100 80GB HBM3") == 500.0 and peak_tflops(0.0, None) is None
    cuda = torch.device("cuda", 0)       # a run reads its device's name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 PCIe")
    assert metrics.peak_for(0.0, cuda, torch.bfloat16) == 756.0 and metrics.peak_for(0.0, cuda, torch.float32) is None


def test_the_busy_clock_counts_between_blocking_collectives(monkeypatch):
    """BusyClock on the CPU: host time from leaving a collective (start) to entering the next (stop), a step's
    mean at a logging step; train_step stops it at its token count and, without tp and sp, starts it again until
    its loss's all-reduce."""
    from types import SimpleNamespace

    from megalysses.training import step

    clock = iter([0.0, 1.0, 2.0, 5.0, 6.0, 7.0, 8.0, 10.0])
    monkeypatch.setattr(step.time, "perf_counter", lambda: next(clock))
    busy = step.BusyClock(torch.device("cpu"))
    assert busy.take(1) is None
    busy.stop()                         # not started: nothing counted
    for _ in range(2):
        busy.start()
        busy.stop()
    assert busy.take(2) == 2.0          # (1 - 0) + (5 - 2) over two steps
    with busy.measuring():
        busy.start()                                        # 6
        step._busy(False, SimpleNamespace(tp_size=2, sp_size=1))   # 7: the token count
        step._busy(True, SimpleNamespace(tp_size=2, sp_size=1))    # with tp: not started again
        step._busy(False, SimpleNamespace(tp_size=2, sp_size=1))
    assert busy.take(1) == 1.0
    step._busy(True, SimpleNamespace(tp_size=1, sp_size=1))        # no clock measuring: nothing
    with busy.measuring():
        step._busy(True, SimpleNamespace(tp_size=1, sp_size=1))    # 8
        step._busy(False, SimpleNamespace(tp_size=1, sp_size=1))   # 10: the loss
    assert busy.take(1) == 2.0


def test_a_read_back_gathers_the_busy_times_in_its_one_all_reduce(world_of_one):
    tally = metrics.StepTally(torch.device("cpu"))
    figures = torch.tensor([1.5, 64.0, 0.5, 0.0], dtype=torch.float64)
    tally.add(figures, 1)
    back = tally.read((False, True), 0.25)
    assert back.busy == (0.25,) and back.stop == (False, True) and (back.loss, back.tokens) == (1.5, 64.0)
    tally.add(figures, 2)
    assert tally.read((False, False)).busy == ()            # nothing measured


def test_the_slowest_rank_of_its_stage_is_named_when_the_others_waited_long_enough():
    """A rank is judged against the median of the other ranks of its pipeline stage, and named when they waited
    for it more than logging.straggler_warn_fraction of the step time."""
    hosts = ["a", "b", "c", "d"]
    busy = (0.010, 0.012, 0.510, 0.011)
    spread = metrics.Spread(busy, stage_ranks=4)
    assert spread.fields() == {"busy_s_min": 0.010, "busy_s_median": statistics.median(busy), "busy_s_max": 0.510,
                               "busy_slowest_rank": 2}
    line = spread.warning(1.0, 0.2, hosts)
    assert line.startswith("warning: rank 2 (host c) is a straggler: busy 0.510 s"), line
    assert "the others' median 0.011 s" in line and "50% of the step time 1.000 s" in line, line
    assert spread.warning(1.0, 0.6, hosts) is None and spread.warning(1.0, 0.0, hosts) is None
    # two stages of two ranks: stage 1 is busier by its place in the pipeline, not slower; then its rank 3 is
    assert metrics.Spread((0.1, 0.1, 0.6, 0.6), stage_ranks=2).warning(1.0, 0.2, hosts) is None
    assert "rank 3 (host d)" in metrics.Spread((0.1, 0.1, 0.6, 0.9), stage_ranks=2).warning(1.0, 0.2, hosts)
    assert metrics.Spread((0.1, 0.9), stage_ranks=1).warning(1.0, 0.2, hosts) is None    # alone in its stage


def test_the_spread_is_logged_and_a_straggler_warned_after_the_first_logged_step(tmp_path, monkeypatch, capsys):
    cfg = load_config(overrides=TINY + [f"logging.run_dir={tmp_path}/run"])
    clock = iter([0.0, 1.0, 2.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    logger = metrics.MetricsLogger(cfg, tmp_path / "run", 2, torch.device("cpu"), total_steps=4)
    logger.hosts = ["a", "b"]
    for step in range(1, 5):
        if logger.due(step):
            logger.note_busy((0.05, 0.45))
        logger.step(step, 1.0, 1e-3, 0.5, 64, 32)
    logger.close()
    rows = metrics_rows(tmp_path / "run")
    assert [(r["step"], r["busy_slowest_rank"], r["busy_s_max"], r["busy_s_min"]) for r in rows] == [
        (2, 1, 0.45, 0.05), (4, 1, 0.45, 0.05)]
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and warned[0].startswith("warning: rank 1 (host b) is a straggler"), warned
    assert "80% of the step time 0.500 s" in warned[0], warned      # waited 0.4 s of a 0.5 s step


def test_a_run_logs_its_busy_time(tmp_path, world_of_one):
    run = tmp_path / "run"
    cfg, grid, cpu = load_config(overrides=TINY + [f"logging.run_dir={run}"]), ParallelGrid(), \
        torch.device("cpu")
    train(cfg, resolve_run(cfg, cpu, grid), grid, cpu)
    rows = [r for r in metrics_rows(run) if "loss" in r]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["busy_slowest_rank"] == 0 and r["busy_s_min"] == r["busy_s_median"] == r["busy_s_max"], r
        assert 0 < r["busy_s_max"] < r["step_time_s"], r


def test_on_a_gpu_the_busy_clock_reads_only_the_events_the_device_has_passed(monkeypatch):
    """BusyClock on CUDA (timing events, faked here): a pair whose end the device has not reached is not waited
    for, but counted at the next take."""
    from megalysses.training import step

    times = iter([0.0, 1.0, 2.0, 4.0, 5.0, 8.0])
    events = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.t, self.done = None, True
            events.append(self)

        def record(self) -> None:
            self.t = next(times)

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end: "Event") -> float:
            assert self.done and end.done
            return (end.t - self.t) * 1e3            # milliseconds, as torch's

    monkeypatch.setattr(step.torch.cuda, "Event", Event)
    busy = step.BusyClock(torch.device("cuda"))
    for _ in range(3):
        busy.start()
        busy.stop()
    events[-1].done = False                 # the device is still before the last stop
    assert busy.take(3) == 1.0              # (1 - 0) + (4 - 2) over three steps, no wait
    events[-1].done = True
    assert busy.take(1) == 3.0              # (8 - 5), counted now
