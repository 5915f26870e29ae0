"""Micro-batches for one rank of the (dp, sp) grid, straight from the sample stream.

    for batch in iterate_micro_batches(train, micro_batch_size=2, dp_rank=1, dp_size=4, sp_rank=0,
                                       sp_size=2, consumed_samples=step * global_batch_size,
                                       eod_id=tok.eod_id, reset_position_ids=True, document_mask=True):
        batch["input_ids"]     # (B, S/sp) int64   this rank's contiguous slice of each sample
        batch["labels"]        # (B, S/sp) int64   next token, -100 where there is none (padding)
        batch["position_ids"]  # (B, S/sp) int64   global positions (or per-document, see below)
        batch["doc_ids"]       # (B, S)    int32   document id of every position of the FULL sequence

Global order. The stream is consumed in chunks of micro_batch_size * dp_size samples; in chunk c,
dp rank r takes samples c * mbs * dp + r * mbs + [0, mbs), i.e. sample g goes to dp rank
(g // mbs) % dp as micro-batch g // (mbs * dp) of that rank. A step of global_batch_size samples
(a multiple of mbs * dp) is therefore always samples [step * gbs, (step + 1) * gbs) of the stream,
whatever dp and mbs are: dp=2 with k micro-batches sees the same global batch as dp=1 with 2k.
Resuming at consumed_samples (global, a multiple of mbs * dp) continues the exact same stream.

Sequence parallelism. Every sp rank reads the same samples (mmap, cheap) and keeps its own positions
(`SequenceLayout`: a contiguous slice [sp_rank * S/sp, (sp_rank + 1) * S/sp) for Ulysses alone, zigzag
chunks with a ring); document ids and reset positions are computed over the full sample first, so
nothing is all-gathered. A length the layout does not divide is padded at the end (labels -100). A new
document starts after each EOD token.

Sequence-length curriculum (data.seq_len_schedule). `length_at(g)` gives the length L (a divisor of
seq_len) at which the chunk starting at stream sample g trains; each sample of seq_len + 1 tokens is then
cut into seq_len / L samples of L + 1 tokens (`cut_samples`), which become the micro-batch like any
samples: mbs * seq_len / L rows of L tokens, the same tokens and labels, positions and documents
restarting in each piece. The stream, and so a resume, does not depend on the schedule.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from megalysses.data.indexed import DatasetError
from megalysses.parallel.sequence_layout import SequenceLayout, shard_sample

IGNORE_INDEX = -100


def build_micro_batch(samples: Sequence[np.ndarray], seq_len: int, sp_rank: int, sp_size: int, eod_id: int,
                      reset_position_ids: bool, document_mask: bool, eod_mask_loss: bool = False,
                      pad_id: Optional[int] = None, layout: Optional[SequenceLayout] = None) -> dict[str, torch.Tensor]:
    """Turn samples of (up to) seq_len + 1 tokens into this sp rank's tensors.

    Shorter samples are padded with pad_id (default eod_id) and their missing labels are -100;
    eod_mask_loss also masks the label predicted from each EOD (the first token of the next document).
    layout (default: Ulysses over sp_size ranks) says which positions this rank keeps and the multiple
    the sequence is padded to.
    """
    layout = SequenceLayout(sp=sp_size) if layout is None else layout
    if layout.sp != sp_size:
        raise ValueError(f"the sequence layout is for sp={layout.sp}, not sp_size={sp_size}")
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} outside [0, {sp_size})")
    batch = len(samples)
    pad = eod_id if pad_id is None else pad_id
    tokens = np.full((batch, seq_len + 1), pad, dtype=np.int64)
    lengths = np.empty(batch, dtype=np.int64)
    for b, sample in enumerate(samples):
        n = min(len(sample), seq_len + 1)
        tokens[b, :n] = sample[:n]
        lengths[b] = n
    positions = np.arange(seq_len)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].copy()
    real = positions[None, :] < lengths[:, None]
    labels[positions[None, :] >= lengths[:, None] - 1] = IGNORE_INDEX
    is_eod = (inputs == eod_id) & real
    if eod_mask_loss:
        labels[is_eod] = IGNORE_INDEX

    starts = np.zeros((batch, seq_len), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = is_eod[:, :-1] | (positions[None, 1:] == lengths[:, None])  # after an EOD, or padding
    if reset_position_ids:
        doc_start = np.maximum.accumulate(np.where(starts, positions[None, :], 0), axis=1)
        pos = positions[None, :] - doc_start
    else:
        pos = np.broadcast_to(positions, (batch, seq_len))

    doc_ids = np.cumsum(starts, axis=1, dtype=np.int32) - 1 if document_mask else None
    shard = shard_sample(layout, sp_rank, inputs, labels, np.asarray(pos), doc_ids, pad)
    return {k: torch.from_numpy(v) for k, v in shard.items()}


def cut_samples(samples: Sequence[np.ndarray], seq_len: int, piece_len: int) -> list[np.ndarray]:
    """Cut each sample of (up to) seq_len + 1 tokens into seq_len // piece_len samples of piece_len + 1 tokens,
    in order: piece i holds tokens [i * L, (i + 1) * L] (inputs i*L .. (i+1)*L - 1, labels one further), so
    consecutive pieces overlap by one token and their labels are exactly the sample's. A short sample gives
    short (or empty) pieces, padded as any short sample is."""
    if piece_len < 1 or seq_len % piece_len:
        raise ValueError(f"piece length {piece_len} does not divide seq_len={seq_len}")
    return [sample[i * piece_len:(i + 1) * piece_len + 1] for sample in samples
            for i in range(seq_len // piece_len)]


def check_sample_ids(samples: Sequence[np.ndarray], ids: Sequence[int], vocab_size: int) -> None:
    """Raise DatasetError when a sample holds a token id outside [0, vocab_size)."""
    for g, sample in zip(ids, samples):
        if len(sample) and (int(sample.min()) < 0 or int(sample.max()) >= vocab_size):
            bad = sample[(sample < 0) | (sample >= vocab_size)][0]
            raise DatasetError(f"sample {g} of the stream holds token id {int(bad)}, outside the model's vocabulary "
                               f"[0, {vocab_size}) (model.vocab_size): the data does not belong to this model; "
                               f"re-tokenize it or fix model.vocab_size")


def rank_sample_ids(chunk: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Global stream indices of dp rank `dp_rank`'s micro-batch number `chunk` (from the stream start)."""
    first = chunk * micro_batch_size * dp_size + dp_rank * micro_batch_size
    return range(first, first + micro_batch_size)


def iterate_micro_batches(dataset: Any, micro_batch_size: int, dp_rank: int, dp_size: int, sp_rank: int,
                          sp_size: int, consumed_samples: int, eod_id: int, reset_position_ids: bool,
                          document_mask: bool, seq_len: Optional[int] = None, eod_mask_loss: bool = False,
                          pad_id: Optional[int] = None, vocab_size: Optional[int] = None,
                          layout: Optional[SequenceLayout] = None,
                          length_at: Optional[Callable[[int], int]] = None) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this rank's micro-batches from `consumed_samples` on, until the dataset cannot fill a
    whole chunk of micro_batch_size * dp_size samples. `dataset[g]` is sample g of the stream (seq_len
    + 1 tokens); seq_len defaults to `dataset.seq_len`; layout as for build_micro_batch. With vocab_size,
    a sample holding a token id outside [0, vocab_size) raises DatasetError instead of reaching the model.
    With `length_at`, the chunk of samples from stream index g on trains at length length_at(g), a divisor
    of seq_len: its samples are cut into pieces of that length (cut_samples)."""
    if micro_batch_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"bad data-parallel position: micro_batch_size={micro_batch_size}, "
                         f"dp_rank={dp_rank}, dp_size={dp_size}")
    chunk = micro_batch_size * dp_size
    if consumed_samples % chunk:
        raise DatasetError(f"consumed_samples={consumed_samples} is not a multiple of micro_batch_size * dp_size "
                           f"= {micro_batch_size} * {dp_size}: resume with a global_batch_size that the "
                           f"checkpoint's consumed samples are a multiple of")
    seq_len = dataset.seq_len if seq_len is None else seq_len
    c = consumed_samples // chunk
    while (c + 1) * chunk <= len(dataset):
        ids = rank_sample_ids(c, micro_batch_size, dp_rank, dp_size)
        samples = [dataset[g] for g in ids]
        if vocab_size is not None:
            check_sample_ids(samples, ids, vocab_size)
        length = seq_len if length_at is None else length_at(c * chunk)
        if length != seq_len:
            samples = cut_samples(samples, seq_len, length)
        yield build_micro_batch(samples, length, sp_rank, sp_size, eod_id, reset_position_ids,
                                document_mask, eod_mask_loss, pad_id, layout)
        c += 1
