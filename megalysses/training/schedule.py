"""Learning-rate schedules: linear warmup, then cosine, linear, constant, or WSD (warmup-stable-decay)."""
from __future__ import annotations

import math

from megalysses.config import OptimizerConfig


def lr_at(step: int, opt: OptimizerConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    if opt.warmup_steps > 0 and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    if opt.schedule == "wsd":
        decay_steps = max(1, int(round(opt.decay_fraction * total_steps)))
        decay_start = max(total_steps - decay_steps, opt.warmup_steps)   # never decay before warmup ends
        decay_steps = max(1, total_steps - decay_start)
        if step < decay_start:
            return opt.lr
        frac = min(1.0, (step - decay_start + 1) / decay_steps)
        return opt.lr + (opt.min_lr - opt.lr) * frac
    span = max(1, total_steps - opt.warmup_steps)
    frac = min(1.0, max(0.0, (step - opt.warmup_steps) / span))
    if opt.schedule == "linear":
        return opt.lr + (opt.min_lr - opt.lr) * frac
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1 + math.cos(math.pi * frac))
