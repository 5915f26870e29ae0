"""The learning-rate settings Megatron-LM recipes rely on: decay over a set number of steps (decay_steps), warmup
from warmup_init, and WSD's decay styles counted as Megatron-LM counts --lr-wsd-decay-iters. The references are
the formulas of Megatron-LM's OptimizerParamScheduler, written out here."""
import math

import pytest

from megalysses.config import ConfigError, OptimizerConfig
from megalysses.config.io import load_config
from megalysses.training.schedule import lr_at

LR, MIN = 1.0, 0.1


def megatron_lr(k, style, warmup, decay, init=0.0, wsd=0, wsd_style="exponential"):
    """Megatron-LM's learning rate after k steps (its num_steps, in steps of a constant batch)."""
    if warmup > 0 and k <= warmup:
        return init + (LR - init) * k / warmup
    if style == "constant":
        return LR
    if k > decay:
        return MIN
    ratio = (k - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        start = decay - wsd
        r = (k - start) / wsd
        coeff = 1.0 if k <= start else {"linear": 1 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1),
                                         "exponential": 2 * 0.5 ** r - 1, "minus_sqrt": 1 - math.sqrt(r)}[wsd_style]
    return MIN + coeff * (LR - MIN)


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_decay_steps_and_warmup_from_zero(style):
    """decay_steps = Megatron-LM's --lr-decay-iters: min_lr after it, however long training runs on."""
    opt = OptimizerConfig(lr=LR, min_lr=MIN, warmup_steps=5, warmup_init=0.0, decay_steps=40, schedule=style)
    got = [lr_at(k, opt, 60) for k in range(60)]
    assert got == pytest.approx([megatron_lr(k, style, 5, 40) for k in range(60)], abs=1e-12)
    assert got[0] == 0.0 and got[5] == LR                          # the first step trains at 0, step 6 at lr
    if style != "constant":
        assert got[40:] == [pytest.approx(MIN)] * 20


@pytest.mark.parametrize("wsd_style", ["exponential", "linear", "cosine", "minus_sqrt"])
def test_wsd_decay_styles(wsd_style):
    opt = OptimizerConfig(lr=LR, min_lr=MIN, warmup_steps=4, warmup_init=0.0, decay_steps=50, schedule="wsd",
                          wsd_decay_steps=20, wsd_decay_style=wsd_style)
    got = [lr_at(k, opt, 55) for k in range(55)]
    assert got == pytest.approx([megatron_lr(k, "wsd", 4, 50, wsd=20, wsd_style=wsd_style) for k in range(55)],
                                abs=1e-12)
    assert got[30] == LR and got[31] < LR and got[50] == pytest.approx(MIN)    # stable to step 31, then down
    assert all(b <= a for a, b in zip(got[4:], got[5:]))


def test_the_styles_differ_halfway():
    """Halfway through the decay: exponential keeps 2 * 0.5^0.5 - 1 = 0.414 of (lr - min_lr), minus_sqrt 0.293."""
    half = {}
    for style in ("exponential", "linear", "cosine", "minus_sqrt"):
        opt = OptimizerConfig(lr=LR, min_lr=MIN, warmup_steps=0, decay_steps=20, schedule="wsd", wsd_decay_steps=10,
                              wsd_decay_style=style)
        half[style] = (lr_at(15, opt, 20) - MIN) / (LR - MIN)
    assert half == pytest.approx({"exponential": math.sqrt(2) - 1, "linear": 0.5, "cosine": 0.5,
                                  "minus_sqrt": 1 - math.sqrt(0.5)})


def test_native_warmup_and_wsd_keep_their_arithmetic():
    """Without warmup_init the first step trains at lr / warmup_steps; decay_fraction's WSD ends on the last step."""
    opt = OptimizerConfig(lr=LR, min_lr=MIN, warmup_steps=4, schedule="wsd", decay_fraction=0.5)
    got = [lr_at(k, opt, 20) for k in range(20)]
    assert got[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and got[-1] == pytest.approx(MIN)
    assert got[10] == pytest.approx(LR - (LR - MIN) / 10)               # linear, the first decay step counted


@pytest.mark.parametrize("overrides,message", [
    (["optimizer.decay_steps=50", "optimizer.warmup_steps=50"], "decay_steps=50 is not after optimizer.warmup_steps"),
    (["optimizer.schedule=wsd", "optimizer.wsd_decay_steps=950"], "wsd_decay_steps=950 is more than the 900 steps"),
    (["optimizer.decay_steps=-1"], "optimizer.decay_steps=-1 is out of range"),
    (["optimizer.warmup_init=-0.1"], "optimizer.warmup_init=-0.1 is out of range"),
    (["optimizer.wsd_decay_style=step"], "optimizer.wsd_decay_style: 'step' is not one of"),
])
def test_bad_schedule_settings(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["data.mock=true"] + overrides)
