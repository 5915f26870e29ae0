"""The global batch of every step: constant (training.global_batch_size), or ramped up by the samples consumed,
with Megatron-LM's --rampup-batch-size (training.rampup_batch_size) or --step-batch-size-schedule
(training.batch_size_schedule) arithmetic.

    sizes = BatchSizes.from_config(cfg.training)
    sizes.at(consumed)       # the global batch of the step that starts once `consumed` samples are consumed
    sizes.step_of(sample)    # the step (from 0) whose batch holds sample `sample` of the stream
    sizes.levels             # [(from_sample, batch), ...], from sample 0

A step's batch depends only on the samples consumed before it, and checkpoints record those, so a run
resumed anywhere takes the batches the uninterrupted run takes. The stream of samples is the same as without
a ramp: a step of batch b is the next b samples (data/loader.py), b / (micro_batch_size * dp) micro-batches.
"""
from __future__ import annotations

import bisect
import math

from megalysses.config import TrainingConfig


def rampup_levels(start: int, increment: int, samples: int, final: int) -> list[tuple[int, int]]:
    """Megatron-LM's ramp as levels: after c samples the batch is `final` when c > samples, else
    start + int(c / (samples / n)) * increment with n = (final - start) // increment increments (its float
    arithmetic, so the level boundaries are the samples where Megatron-LM's batch changes)."""
    n = (final - start) // increment
    per = samples / n
    levels = [(0, start)]
    for i in range(1, n + 1):
        c = max(0, math.ceil(i * per) - 1)       # the first c with int(c / per) >= i
        while int(c / per) < i:
            c += 1
        if c > samples:
            break
        if c == levels[-1][0]:
            levels.pop()
        levels.append((c, start + i * increment))
    if levels[-1][1] != final:
        levels.append((samples + 1, final))
    return levels


class BatchSizes:
    def __init__(self, levels: list[tuple[int, int]]) -> None:
        self.levels = [(int(s), int(b)) for s, b in levels]
        self._starts = [s for s, _ in self.levels]

    @classmethod
    def from_config(cls, t: TrainingConfig) -> "BatchSizes":
        if t.rampup_batch_size:
            return cls(rampup_levels(*t.rampup_batch_size, t.global_batch_size))
        if t.batch_size_schedule:
            return cls([(s, b) for s, b in t.batch_size_schedule])
        return cls([(0, t.global_batch_size)])

    @property
    def ramped(self) -> bool:
        return len(self.levels) > 1

    def at(self, consumed: int) -> int:
        """The global batch of the step that starts after `consumed` samples."""
        return self.levels[bisect.bisect_right(self._starts, consumed) - 1][1]

    def step_of(self, sample: int) -> int:
        """The step (counted from 0) whose batch holds stream sample `sample`."""
        step, start = 0, 0                   # the first sample of the next step
        for i, (_, batch) in enumerate(self.levels):
            end = self.levels[i + 1][0] if i + 1 < len(self.levels) else math.inf
            count = max(0, -(-(end - start) // batch)) if end != math.inf else math.inf
            if sample < start + count * batch:
                return step + (sample - start) // batch
            step, start = step + count, start + count * batch
        raise AssertionError("the last level is unbounded")

    def batches(self) -> list[int]:
        """Every distinct global batch size."""
        return sorted({b for _, b in self.levels})


def batch_line(step: int, batch: int, sizes: BatchSizes, per_micro: int) -> str:
    """The batch size of the step after `step` completed steps, in words (printed by the loop when it changes);
    `per_micro`: samples per micro-batch over the dp ranks."""
    final = sizes.levels[-1][1]
    stage = "the final batch" if batch == final else f"ramping up to {final}"
    return (f"global batch {batch} from step {step + 1} ({batch // per_micro} micro-batches per step; "
            f"{stage})")
