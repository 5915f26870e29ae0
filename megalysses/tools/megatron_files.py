"""What converting a Megatron-LM command line reads besides the command line, and Megatron-LM's arithmetic for
it: the tokenizer (for the vocabulary size), the .idx files of an unweighted blend (for the shares by size), a
--step-batch-size-schedule string, and the steps that --train-samples makes through a batch-size ramp.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Optional

from megalysses.tools.megatron_script import MegatronArgsError


def tokenizer_size(kind: str, model: Optional[str], vocab_file: Optional[str], merge_file: Optional[str],
                   vocab_size: Optional[int], read_files: bool, note: Callable[[str], None],
                   told: Optional[int] = None) -> int:
    """The vocabulary size Megatron-LM takes: the tokenizer's, or --vocab-size for NullTokenizer. `told`: the size
    the converter was given for a tokenizer whose files are not here."""
    from megalysses.data.tokenizer import TokenizerError, build_tokenizer, canonical_kind

    try:
        canonical = canonical_kind(kind)
    except TokenizerError as e:
        raise MegatronArgsError(f"--tokenizer-type {kind}: {e}") from None
    if canonical == "null":
        if not vocab_size:
            raise MegatronArgsError("--vocab-size is missing: NullTokenizer takes its size from it")
        return vocab_size
    fallback = told or vocab_size
    if not read_files:
        if not fallback:
            raise MegatronArgsError(f"the size of the {kind} is unknown: give the converter --vocab-size N")
        return fallback
    try:
        size = build_tokenizer(kind, model, vocab_file=vocab_file, merge_file=merge_file, need_eod=False).vocab_size
    except (TokenizerError, OSError) as e:
        if fallback:
            note(f"the tokenizer cannot be read here ({' '.join(str(e).split())[:160]}): model.vocab_size is "
                 f"{fallback}; check it is the tokenizer's size")
            return fallback
        raise MegatronArgsError(f"cannot read the tokenizer for model.vocab_size: {' '.join(str(e).split())[:200]}; "
                                f"convert where the tokenizer files are, or give the converter --vocab-size N") \
            from None
    if told and told != size:
        note(f"--vocab-size {told} given to the converter, but the tokenizer has {size}: model.vocab_size={size}")
    if vocab_size and vocab_size != size:
        note(f"--vocab-size {vocab_size} is not what Megatron-LM reads with {kind}: model.vocab_size={size}, the "
             f"tokenizer's size")
    return size


def blend_shares(paths: list[str], split: str, seq_len: int) -> str:
    """A note with the shares an unweighted blend takes by size (the train split), from the .idx files."""
    from megalysses.data.build import epoch_samples
    from megalysses.data.gpt_dataset import split_ranges
    from megalysses.data.indexed import DatasetError, IndexedDataset

    sizes = []
    for p in paths:
        try:
            ds = IndexedDataset(p)
        except (DatasetError, OSError):
            return (f"--data-path: an unweighted blend of {len(paths)} datasets, weighed by size "
                    f"(data.blend_by_size); {p}.idx is not readable here, so the shares are computed when training "
                    f"opens them")
        sizes.append(epoch_samples(ds, split_ranges(split, len(ds))[0], seq_len))
    total = sum(sizes) or 1
    shares = ", ".join(f"{p} {100 * n / total:.1f}%" for p, n in zip(paths, sizes))
    return f"--data-path: an unweighted blend weighed by size (data.blend_by_size), the training shares {shares}"


_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def step_schedule(text: str, seq_len: int) -> list[tuple[int, int]]:
    """--step-batch-size-schedule "0:16 2.4B:320 ...": [(from_sample, batch)], its token thresholds turned into
    samples of seq_len tokens as Megatron-LM turns them (it always passes --seq-length)."""
    def number(s: str) -> int:
        s = s.strip().upper()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:E[+-]?[0-9]+)?)([KMBT]?)", s)
        if not m:
            raise MegatronArgsError(f"--step-batch-size-schedule: {s!r} is not a number (K, M, B, T suffixes allowed)")
        return int(float(m.group(1)) * _SUFFIX.get(m.group(2), 1))

    levels = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise MegatronArgsError(f"--step-batch-size-schedule: entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold, batch = entry.split(":", 1)
        levels.append((number(threshold) // seq_len, number(batch)))
    levels.sort()
    if not levels or levels[0][0] != 0:
        raise MegatronArgsError(f"--step-batch-size-schedule {text!r}: the first entry must start at 0")
    if any(a[0] == b[0] for a, b in zip(levels, levels[1:])) or any(b < 1 for _, b in levels):
        raise MegatronArgsError(f"--step-batch-size-schedule {text!r}: thresholds must differ and batches be >= 1")
    return levels


def rampup_train_iters(train_samples: int, gbs: int, ramp: Optional[list[int]],
                       levels: Optional[list[tuple[int, int]]]) -> int:
    """The steps Megatron-LM runs for --train-samples: samples // global batch; through a step schedule, the steps
    until train_samples are consumed; through --rampup-batch-size, the ramp's steps (until its samples or
    train_samples are passed) then whole global batches, as its update_train_iters counts them."""
    if levels:
        steps, consumed = 0, 0
        for i, (_start, batch) in enumerate(levels):
            end = min(levels[i + 1][0] if i + 1 < len(levels) else math.inf, train_samples)
            if consumed < end:
                n = math.ceil((end - consumed) / batch)
                steps, consumed = steps + n, consumed + n * batch
        return steps
    if not ramp:
        return train_samples // gbs
    from megalysses.config.batch_schedule import BatchSizes, rampup_levels

    sizes = BatchSizes(rampup_levels(ramp[0], ramp[1], ramp[2], gbs))
    steps, consumed = 0, 0
    while consumed <= ramp[2] and consumed <= train_samples:
        consumed += sizes.at(consumed)
        steps += 1
    if train_samples > consumed:
        steps += (train_samples - consumed) // gbs
    return steps
