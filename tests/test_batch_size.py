"""Batch-size ramp-up (training.rampup_batch_size, batch_size_schedule): Megatron-LM's arithmetic, every layout
accumulating the ramped batches as one process does, and a resume mid-ramp repeating the uninterrupted run."""
import json
from pathlib import Path

import pytest
import torch

from megalysses.config import ConfigError, TrainingConfig
from megalysses.config.io import load_config
from megalysses.testing import run_distributed
from megalysses.config.batch_schedule import BatchSizes, rampup_levels
from megalysses.training.schedule import lr_at, lr_progress
from test_curriculum import _recording_worker
from tests.fixtures import TRAIN_PARITY, full_weights, losses, step_rows
from tests.parity import check_run, logged


def megatron_ramp(start, increment, samples, final, consumed):
    """Megatron-LM's --rampup-batch-size rule, transcribed as a reference: the batch after `consumed` samples."""
    if consumed > samples:
        return final
    per_increment = samples / ((final - start) // increment)
    return start + int(consumed / per_increment) * increment


@pytest.mark.parametrize("ramp", [(16, 16, 5859375, 1536), (4, 2, 10, 8), (3, 1, 2, 10), (2, 2, 12, 8),
                                  (8, 4, 97, 64), (1, 1, 7, 4)])
def test_rampup_follows_megatron(ramp):
    start, increment, samples, final = ramp
    sizes = BatchSizes(rampup_levels(start, increment, samples, final))
    probes = set(range(0, min(samples + 40, 5000)))
    probes |= {c + d for c, _ in sizes.levels for d in (-1, 0, 1) if c + d >= 0}
    probes |= set(range(0, samples + 2, max(samples // 997, 1)))
    for consumed in sorted(probes):
        assert sizes.at(consumed) == megatron_ramp(start, increment, samples, final, consumed), consumed
    assert sizes.at(0) == start and sizes.at(samples + 1) == final and sizes.ramped


def test_step_of_follows_the_steps():
    """Each stream sample belongs to the step whose batch takes it, the batch set by the samples before it."""
    for sizes in (BatchSizes(rampup_levels(2, 2, 12, 8)), BatchSizes([(0, 3), (5, 6), (7, 2), (30, 9)]),
                  BatchSizes([(0, 4)])):
        consumed = 0
        for step in range(40):
            batch = sizes.at(consumed)
            assert [sizes.step_of(s) for s in range(consumed, consumed + batch)] == [step] * batch
            consumed += batch


def test_lr_advances_by_samples_during_a_ramp():
    """With a ramp the schedule stands at samples / final batch, as Megatron-LM counts it; without, at the step."""
    t = TrainingConfig(global_batch_size=8, rampup_batch_size=[2, 2, 12], train_steps=10)
    assert lr_progress(t, 3, 8) == 1.0 and lr_progress(TrainingConfig(global_batch_size=8), 3, 8) == 3.0
    cfg = load_config(overrides=["data.mock=true", "optimizer.warmup_steps=4", "optimizer.warmup_init=0",
                                 "optimizer.lr=1"])
    assert lr_at(3, cfg.optimizer, 10, 1.0) == pytest.approx(0.25)      # a quarter of warmup, not three quarters


@pytest.mark.parametrize("overrides,message", [
    (["training.rampup_batch_size=[2, 2]"], r"rampup_batch_size=\[2, 2\]: give \[start, increment, samples\]"),
    (["training.rampup_batch_size=[0, 2, 10]"], r"three numbers >= 1"),
    (["training.rampup_batch_size=[3, 2, 10]"], r"8 - start a multiple of 2"),
    (["training.rampup_batch_size=[8, 2, 10]"], r"start must be below 8"),
    (["training.batch_size_schedule=[[1, 2], [10, 8]]"], r"must start at sample 0: make it \[0, 2\]"),
    (["training.batch_size_schedule=[[0, 2], [10, 4], [10, 8]]"], r"strictly increasing from_sample"),
    (["training.batch_size_schedule=[[0, 2], [10, 4]]"], r"ends at batch 4 but training.global_batch_size=8"),
    (["training.batch_size_schedule=[[0, 2, 1]]"], r"\[from_sample, batch\] pair"),
    (["training.batch_size_schedule=[[0, 0], [5, 8]]"], r"batch 0 must be >= 1"),
    (["training.batch_size_schedule=[[0, 2], [5, 8]]", "training.rampup_batch_size=[2, 2, 10]"], r"both set"),
])
def test_bad_ramps_are_one_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(overrides=["data.mock=true", "training.global_batch_size=8"] + overrides)
    assert "\n" not in str(e.value)


def test_every_ramped_batch_fits_the_layout():
    from megalysses.config.checks import validate_config

    cfg = load_config(overrides=["data.mock=true", "training.global_batch_size=8",
                                 "training.rampup_batch_size=[2, 2, 12]"])
    validate_config(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"global batch 2 is not divisible by micro_batch_size=1 \* dp=4"):
        validate_config(cfg, world_size=4)


# 6 steps of batches 2, 2, 4, 6, 8, 8 (Megatron-LM's ramp from 2 by 2 over 12 samples to 8); with a curriculum
# of 16 tokens for steps 1-3, so the length follows the steps a ramp makes of the samples
RAMP = ["training.global_batch_size=8", "training.rampup_batch_size=[2, 2, 12]", "training.train_steps=6",
        "optimizer.warmup_steps=2", "optimizer.warmup_init=0", "training.eval_interval=0",
        "data.seq_len_schedule=[[0, 16], [3, 32]]"]
BATCHES = [2, 2, 4, 6, 8, 8]


def _consumed(run: Path, step: int) -> int:
    return json.loads((run / "checkpoints" / f"step_{step:07d}" / "meta.json").read_text())["consumed_samples"]


def test_ramp_parity_and_resume(tmp_path):
    """sp2 accumulates every micro-batch on one data-parallel rank (2, 2, 4, 6, 8, 8 of them), dp2 half as many,
    pp2 through the pipeline: all train as one process would. A run stopped mid-ramp (step 3, 8 samples in)
    resumes bit for bit at the same layout, and at another one up to fp32 reassociation."""
    sp2, dp2, pp2 = tmp_path / "sp2", tmp_path / "dp2", tmp_path / "pp2"
    split, cross = tmp_path / "split", tmp_path / "cross"
    runs = [(str(sp2), RAMP + ["parallel.sp=2"]), (str(dp2), RAMP), (str(pp2), RAMP + ["parallel.pp=2"]),
            (str(split), RAMP + ["training.exit_at_step=3"]), (str(split), RAMP),
            (str(cross), RAMP + ["parallel.pp=2", f"checkpoint.load={split}/checkpoints/step_0000003"])]
    per_rank = run_distributed(_recording_worker, 2, tmp_path, args=(runs,), timeout=400)
    weights = [full_weights([r[i] for r in per_rank]) for i in range(len(runs))]

    # each step takes its batch as micro-batches of one sample per dp rank (steps 1-3 cut into 2 x 16 tokens)
    shapes = [[(2, 16)] * (b // 2) if k < 3 else [(1, 32)] * (b // 2) for k, b in enumerate(BATCHES)]
    assert per_rank[0][1]["shapes"] == per_rank[1][1]["shapes"] == shapes
    assert per_rank[0][2]["shapes"] == [[(2, 16)] * b if k < 3 else [(1, 32)] * b for k, b in enumerate(BATCHES)]
    assert "global batch 6 from step 4 (3 micro-batches per step; ramping up to 8)" in per_rank[0][1]["printed"]

    assert _consumed(split, 3) == sum(BATCHES[:3]) and _consumed(split, 6) == sum(BATCHES)
    rows = step_rows(dp2)
    cfg = load_config(overrides=TRAIN_PARITY + RAMP)
    consumed = [sum(BATCHES[:k]) for k in range(6)]
    assert [r["lr"] for r in rows] == [lr_at(k, cfg.optimizer, 6, lr_progress(cfg.training, k, c))
                                       for k, c in enumerate(consumed)]
    assert [r["seq_len"] for r in rows] == [16, 16, 16, 32, 32, 32]

    for run, w in ((dp2, weights[1]), (pp2, weights[2])):      # the ramped run at sp2 as the reference
        check_run(logged(sp2, weights[0]), logged(run, w), run.name, steps=6, quantities=("losses", "weights"))
    assert losses(split) == losses(dp2), "a resume mid-ramp is not bit for bit"
    for name, t in weights[1].items():
        assert torch.equal(weights[4][name], t), f"{name} differs after a resume mid-ramp"
    for a, b in zip(losses(cross), losses(dp2)[3:]):
        assert abs(a - b) <= 1e-5 * abs(b), f"resumed at pp2: loss {a} != {b}"
