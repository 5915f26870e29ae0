"""Learning-rate schedules: linear warmup, then cosine, linear, constant, or WSD (warmup-stable-decay).

    lr = lr_at(step, cfg.optimizer, cfg.training.train_steps, lr_progress(cfg.training, step, consumed))

The schedule is a function of how far training has come, in steps. Without a batch-size ramp that is the
step; with one (training.rampup_batch_size / batch_size_schedule) it is the samples consumed divided by
the final global batch size, as Megatron-LM advances its schedule by samples, so the smaller batches of
the ramp move the learning rate less.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from megalysses.config import OptimizerConfig, TrainingConfig

# the share of (lr - min_lr) left after a fraction r of a WSD decay, each style as Megatron-LM defines it
WSD_DECAY: dict[str, Callable[[float], float]] = {
    "linear": lambda r: 1.0 - r,
    "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
    "exponential": lambda r: 2.0 * math.pow(0.5, r) - 1.0,
    "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
}


def lr_progress(t: TrainingConfig, step: int, consumed_samples: int) -> float:
    """How far the schedule has come before the step after `step` completed steps: the step itself, or with a
    batch-size ramp the samples consumed in units of the final global batch."""
    if t.rampup_batch_size or t.batch_size_schedule:
        return consumed_samples / t.global_batch_size
    return float(step)


def lr_at(step: int, opt: OptimizerConfig, total_steps: int, progress: Optional[float] = None) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`; `progress` (default: `step`) is where
    the schedule stands before it (see lr_progress)."""
    k = float(step) if progress is None else progress
    warmup, decay = opt.warmup_steps, opt.decay_steps or total_steps
    if warmup > 0:
        if opt.warmup_init is not None and k <= warmup:     # Megatron-LM's: step k at init + (lr - init) k / W
            return opt.warmup_init + (opt.lr - opt.warmup_init) * k / warmup
        if opt.warmup_init is None and k < warmup:          # step k at lr (k + 1) / W
            return opt.lr * min(1.0, (k + 1) / warmup)
    if opt.schedule == "constant":
        return opt.lr
    if opt.schedule == "wsd":
        return _wsd(k, opt, warmup, decay)
    frac = min(1.0, max(0.0, (k - warmup) / max(1, decay - warmup)))
    if opt.schedule == "linear":
        return opt.lr + (opt.min_lr - opt.lr) * frac
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1 + math.cos(math.pi * frac))


def _wsd(k: float, opt: OptimizerConfig, warmup: int, decay: int) -> float:
    if opt.wsd_decay_steps:                 # Megatron-LM's count: the steps after decay - n decay over n steps
        start = decay - opt.wsd_decay_steps
        if k <= start:
            return opt.lr
        frac = min(1.0, (k - start) / opt.wsd_decay_steps)
        return opt.min_lr + WSD_DECAY[opt.wsd_decay_style](frac) * (opt.lr - opt.min_lr)
    steps = max(1, int(round(opt.decay_fraction * decay)))
    start = max(decay - steps, warmup)      # never decay before warmup ends
    steps = max(1, decay - start)
    if k < start:
        return opt.lr
    frac = min(1.0, (k - start + 1) / steps)    # the last step of the decay trains at min_lr
    if opt.wsd_decay_style == "linear":
        return opt.lr + (opt.min_lr - opt.lr) * frac
    return opt.min_lr + WSD_DECAY[opt.wsd_decay_style](frac) * (opt.lr - opt.min_lr)
