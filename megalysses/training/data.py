"""The trainer's view of the data: global batches as lists of this rank's micro-batches, on its device.

Every dataset is validated when it is opened, on every rank alike (so a bad dataset ends the run
with the same message everywhere, before the first step): the index structure (indexed.py), the
dtype and every token id against the tokenizer's and the model's vocabulary (validate.py, cached),
the tokenizer recorded beside it (data/tokenizer_identity.py; another one than the run's: a warning),
and each micro-batch is checked against the model's vocabulary once more as it is built. Datasets of
conversations (a loss mask beside them) are packed at every length of the curriculum (data/packing.py),
and rank 0 prints what packing did; one whose loss mask marks no token to train on is refused, and a step
whose samples hold none is told in a warning (counted from the packing index on the host, the same on every
rank: nothing is read back from a device).
"""
from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import torch

from megalysses.config import Config
from megalysses.data import (BatchFormat, DatasetError, DatasetOptions, LoaderRank, MockGPTDataset,
                             build_gpt_datasets, iterate_micro_batches)
from megalysses.data.indexed import IndexedDataset
from megalysses.data.loader import HOST_KEYS
from megalysses.data.packing import Packing, describe
from megalysses.data.tokenizer import NullTokenizer, tokenizer_from_config
from megalysses.data.tokenizer_identity import identity_mismatch, read_identity, tokenizer_identity
from megalysses.data.validate import check_dtype_holds, check_token_ids
from megalysses.distributed import print0
from megalysses.grid import ParallelGrid
from megalysses.config.batch_schedule import BatchSizes
from megalysses.plan import RunPlan

Batch = dict[str, torch.Tensor]


class TrainingData:
    """The datasets of a run, read as its plan says: micro-batches of run.micro_batch_size samples on each dp rank,
    each sample split over the sp ranks and padded as run.sequence lays it out (the layout that gave each phase
    of the plan its padded length)."""

    def __init__(self, cfg: Config, grid: ParallelGrid, plan: RunPlan, device: torch.device) -> None:
        d, t = cfg.data, cfg.training
        self.cfg, self.grid, self.plan, self.device = cfg, grid, plan, device
        self.batch_sizes = BatchSizes.from_config(t)      # the batch of each step (a ramp, or constant)
        self.packing_summary: list[str] = []              # what packing did to conversations, in words
        self.empty_steps = 0                              # steps whose samples hold no label that trains
        if d.mock:
            self.eod_id = cfg.model.vocab_size - 1
            n = t.train_steps * t.global_batch_size
            self.train = MockGPTDataset(n, d.seq_len, cfg.model.vocab_size, self.eod_id, t.seed)
            self.valid = MockGPTDataset(max(t.eval_steps, 1) * t.global_batch_size, d.seq_len, cfg.model.vocab_size,
                                        self.eod_id, t.seed + 1)
            return
        try:
            self._build(cfg)
        except DatasetError:
            raise
        except ValueError as e:   # a bad split, blend list, tokenizer model: one message naming it
            raise DatasetError(f"data: {e}") from e
        self.packing_summary = describe([self.train, self.valid])
        if self.packing_summary and d.pack == "ffd" and not (d.document_mask and d.reset_position_ids):
            off = " and ".join(f"data.{k}" for k in ("document_mask", "reset_position_ids") if not getattr(d, k))
            raise DatasetError(f"conversations are packed several to a sequence (data.pack=ffd) but {off} is false: "
                               f"they would attend to each other or continue each other's positions; set it to true "
                               f"(or data.pack=none, one conversation per sequence)")
        for line in self.packing_summary:
            print0(line)

    def _build(self, cfg: Config) -> None:
        d, t, vocab = cfg.data, cfg.training, cfg.model.vocab_size
        tokenizer = tokenizer_from_config(d, vocab)
        if tokenizer.vocab_size > vocab:
            raise DatasetError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size="
                               f"{vocab}: raise model.vocab_size (to a multiple of tp)")
        self.eod_id = tokenizer.eod_id
        identity: list[dict] = []                 # the run tokenizer's, made when a dataset records one

        def validate(ds: IndexedDataset, cache_dir: str) -> None:
            _check_identity(ds.prefix, tokenizer, identity)
            if not isinstance(tokenizer, NullTokenizer):   # its vocabulary is the model's, not the data's maker
                check_dtype_holds(ds, tokenizer.vocab_size, f"data.tokenizer={d.tokenizer}")
            check_token_ids(ds, vocab, cache_dir, "model.vocab_size")
            check_token_ids(ds, tokenizer.vocab_size, cache_dir, f"data.tokenizer={d.tokenizer}",
                            "the data was not made with this tokenizer: set data.tokenizer (and "
                            "data.tokenizer_model) to the one tools/preprocess_data.py used")

        lengths = tuple(sorted({length for _, length in d.seq_len_schedule} | {d.seq_len}))
        options = DatasetOptions(d.cache_dir, validate, d.blend_by_size, Packing(d.pack, d.too_long, lengths))
        evals = t.train_steps // t.eval_interval + 1 if t.eval_interval else 0
        valid_samples = t.eval_steps * t.global_batch_size if evals else None
        train_samples = t.train_steps * t.global_batch_size
        if d.valid_paths:                # a validation set of its own: each set is read whole
            self.train = build_gpt_datasets(d.paths, "1,0,0", d.seq_len, t.seed, (train_samples, None, None),
                                            options)[0]
            self.valid = build_gpt_datasets(d.valid_paths, "0,1,0", d.seq_len, t.seed, (None, valid_samples, None),
                                            options, need_train=False)[1]
            if t.eval_interval and self.valid is None:
                raise DatasetError(f"data.valid_paths holds too few tokens for one sample of data.seq_len={d.seq_len}: "
                                   f"give it more data, or set training.eval_interval=0")
            return
        self.train, self.valid, _ = build_gpt_datasets(
            d.paths, d.split, d.seq_len, t.seed, (train_samples, valid_samples, None), options)
        if t.eval_interval and self.valid is None:
            raise DatasetError(f"training.eval_interval={t.eval_interval} but the split '{d.split}' leaves no "
                               f"validation data: give the valid split a share, give data.valid_paths, or set "
                               f"training.eval_interval=0")

    def _micro_batches(self, dataset, consumed: int, curriculum: bool) -> Iterator[Batch]:
        d, g, plan, step_of = self.cfg.data, self.grid, self.plan, self.batch_sizes.step_of
        phase_at = (lambda first: plan.train_phase(step_of(first)).seq_len) if curriculum else None
        rank = LoaderRank(g.dp_rank, g.sp_rank, plan.sequence)
        fmt = BatchFormat(self.eod_id, d.reset_position_ids, d.document_mask, d.eod_mask_loss,
                          loss_average=d.loss_average)
        for mb in iterate_micro_batches(dataset, plan.micro_batch_size, rank, consumed, fmt, seq_len=d.seq_len,
                                        vocab_size=self.cfg.model.vocab_size, length_at=phase_at):
            yield {k: v if k in HOST_KEYS else v.to(self.device, non_blocking=True) for k, v in mb.items()}

    def train_batches(self, consumed_samples: int) -> Iterator[list[Batch]]:
        """One list of micro-batches per optimizer step, from `consumed_samples` (global) on: as many as the step's
        global batch holds (a batch-size ramp grows it with the samples consumed); step k's samples are cut to
        data.seq_len_at(k) tokens (the sequence-length curriculum)."""
        it = self._micro_batches(self.train, consumed_samples, curriculum=True)
        per_micro = self.plan.samples_per_micro_batch
        while True:
            num_micro = self.plan.micro_batches_of(self.batch_sizes.at(consumed_samples))
            step = [mb for _, mb in zip(range(num_micro), it)]
            if len(step) < num_micro:
                raise DatasetError("the training data ran out before training.train_steps: "
                                   "the sample index was built for fewer samples")
            self._warn_if_nothing_to_train(consumed_samples, num_micro * per_micro)
            consumed_samples += num_micro * per_micro
            yield step

    def _warn_if_nothing_to_train(self, first: int, samples: int) -> None:
        """A warning when the step of samples [first, first + samples) holds no label that carries the loss."""
        if self._step_labels(first, samples) != 0:
            return
        self.empty_steps += 1
        print0(f"warning: step {self.batch_sizes.step_of(first) + 1} trains on nothing: its {samples} samples hold "
               f"no token that carries the loss ({self.empty_steps} such step{'s' if self.empty_steps > 1 else ''} "
               f"so far): its loss and gradients are zero")

    def _step_labels(self, first: int, samples: int) -> Optional[int]:
        """The labels that carry the loss in the global batch of samples [first, first + samples), from the packing
        index (packed conversations); None where the data has no loss mask (every label trains)."""
        labels_of = getattr(self.train, "labels_of", None)
        if labels_of is None:
            return None
        length = self.plan.train_phase(self.batch_sizes.step_of(first)).seq_len
        return labels_of(np.arange(first, first + samples), length)

    def valid_batches(self) -> list[Batch]:
        """The fixed validation set: eval_steps global batches at data.seq_len (at every phase of a curriculum,
        so validation losses compare across it)."""
        it = self._micro_batches(self.valid, 0, curriculum=False)
        return [mb for _, mb in zip(range(self.plan.micro_batches * self.cfg.training.eval_steps), it)]


def _check_identity(prefix: str, tokenizer: object, identity: list[dict]) -> None:
    """A warning (rank 0) when the dataset `prefix` records another tokenizer than the run's (`identity` caches
    the run's, computed once); nothing when it records none."""
    try:
        recorded = read_identity(prefix)
    except ValueError as e:
        print0(f"warning: {e}: the tokenizer that wrote {prefix} is not checked")
        return
    if recorded is None:
        return
    if not identity:
        identity.append(tokenizer_identity(tokenizer))
    line = identity_mismatch(recorded, identity[0], prefix)
    if line:
        print0(f"warning: {line}")

