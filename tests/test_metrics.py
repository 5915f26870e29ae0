"""Metrics sinks: TensorBoard event files carry the scalars of metrics.jsonl; a missing package is a config error."""
import math
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
    grid = ParallelGrid(tp=1, sp=1, pp=1)
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
