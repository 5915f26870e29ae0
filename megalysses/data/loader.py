"""Micro-batches for one rank of the (dp, sp) grid, straight from the sample stream.

    fmt = BatchFormat(eod_id=tok.eod_id, reset_position_ids=True, document_mask=True)
    rank = LoaderRank(dp_rank=1, sp_rank=0, layout=SequenceLayout(Degrees(sp=2, dp=4)))
    for batch in iterate_micro_batches(train, micro_batch_size=2, rank=rank,
                                       consumed_samples=step * global_batch_size, fmt=fmt):
        batch["input_ids"]     # (B, S/sp) int64   this rank's contiguous slice of each sample
        batch["labels"]        # (B, S/sp) int64   next token, -100 where there is none (padding)
        batch["position_ids"]  # (B, S/sp) int64   global positions (or per-document, see below)
        batch["doc_ids"]       # (B, S)    int32   document id of every position of the FULL sequence
        batch["cu_seqlens"]    # (D + 1,)  int32   the D documents' cumulative lengths over the flattened batch
        batch["longest_document"]  # (B,)  int32   each row's longest document: stays in host memory (HOST_KEYS)

The document boundaries are known here, on the host: variable-length attention takes them as they are
(kernels/attention.py Documents) and reads nothing back from the device.

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

Packed conversations (a dataset with a loss mask, packing.py). A sample is seq_len / L rows of whole
documents (PackedRow): each document starts a document of its own (positions restart, the document mask
separates it), padding too; a label carries the loss where the loss mask marks its token and -100
elsewhere. With loss_average "document", `loss_weights` (B, S/sp) float32 gives each label 1 / (the labels
of its document), and the loss divides by their global sum, the number of documents, instead of the labels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from megalysses.data.indexed import DatasetError
from megalysses.data.packing import PackedRow, cut_window, sample_rows
from megalysses.parallel.sequence_layout import SequenceLayout, shard_sample

IGNORE_INDEX = -100
HOST_KEYS = ("longest_document",)     # a micro-batch's tensors that stay in host memory when the rest go to the GPU


@dataclass(frozen=True)
class BatchFormat:
    """How samples become a micro-batch's tensors, the same on every rank (the data section's settings)."""

    eod_id: int                         # the token that ends a document; a new one starts after it
    reset_position_ids: bool            # positions restart at each document
    document_mask: bool                 # the batch carries doc_ids (attention stays within a document)
    eod_mask_loss: bool = False         # mask the label predicted from each EOD of a window
    pad_id: Optional[int] = None        # what short samples are padded with (default eod_id)
    loss_average: str = "token"         # "document": loss_weights give each document the same weight


@dataclass(frozen=True)
class LoaderRank:
    """Which micro-batches, and which positions of them, one rank of the (dp, sp) grid reads: the sequence layout
    (and through it the degrees) is the run plan's (RunPlan.sequence), the ranks the grid's."""

    dp_rank: int = 0
    sp_rank: int = 0
    layout: SequenceLayout = SequenceLayout()

    @property
    def dp_size(self) -> int:
        return self.layout.degrees.dp


def build_micro_batch(samples: Sequence[np.ndarray | PackedRow], seq_len: int, sp_rank: int, fmt: BatchFormat,
                      layout: Optional[SequenceLayout] = None) -> dict[str, torch.Tensor]:
    """Turn samples into this sp rank's tensors: windows of (up to) seq_len + 1 tokens, or PackedRows of up
    to seq_len tokens (whole documents whose labels carry the loss where the row's loss mask says).

    Shorter samples are padded with fmt.pad_id (default eod_id) and their missing labels are -100;
    fmt.eod_mask_loss also masks the label predicted from each EOD of a window (the first token of the next
    document). layout (the run plan's RunPlan.sequence; default: one sp rank) says which positions this rank keeps
    and the multiple the sequence is padded to. loss_average "document" adds `loss_weights`: 1 / (the labels of its
    document) on each label, so that each document weighs the same in the loss.
    """
    eod_id, eod_mask_loss = fmt.eod_id, fmt.eod_mask_loss
    layout = SequenceLayout() if layout is None else layout
    sp_size = layout.degrees.sp
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} outside [0, {sp_size})")
    batch = len(samples)
    pad = eod_id if fmt.pad_id is None else fmt.pad_id
    tokens = np.full((batch, seq_len + 1), pad, dtype=np.int64)
    trained = np.zeros((batch, seq_len), dtype=bool)     # label t (token t + 1) carries the loss
    starts = np.zeros((batch, seq_len), dtype=bool)      # a document starts at position t
    for b, sample in enumerate(samples):
        fill = _fill_packed if isinstance(sample, PackedRow) else _fill_window
        fill(sample, tokens[b], trained[b], starts[b], eod_id, eod_mask_loss)
    positions = np.arange(seq_len)
    inputs, labels = tokens[:, :-1], np.where(trained, tokens[:, 1:], IGNORE_INDEX)
    starts[:, 0] = True
    if fmt.reset_position_ids:
        doc_start = np.maximum.accumulate(np.where(starts, positions[None, :], 0), axis=1)
        pos = positions[None, :] - doc_start
    else:
        pos = np.broadcast_to(positions, (batch, seq_len))
    doc_ids = np.cumsum(starts, axis=1, dtype=np.int32) - 1
    weights = _document_weights(trained, doc_ids) if fmt.loss_average == "document" else None
    shard = shard_sample(layout, sp_rank, inputs, labels, np.asarray(pos), doc_ids if fmt.document_mask else None,
                         pad, weights)
    if fmt.document_mask:
        shard.update(_document_bounds(shard["doc_ids"]))
    return {k: torch.from_numpy(v) for k, v in shard.items()}


def _document_bounds(doc_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The documents of the (padded) doc ids (B, S), as variable-length attention takes them: their cumulative
    lengths over the flattened batch (kernels/attention.py doc_ids_to_cu_seqlens's) and each row's longest."""
    starts = np.ones(doc_ids.shape, dtype=bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = np.flatnonzero(starts)
    cu = np.append(first, doc_ids.size).astype(np.int32)
    ends = np.append(first[1:], doc_ids.size)
    row = first // doc_ids.shape[1]
    longest = np.zeros(len(doc_ids), dtype=np.int32)
    np.maximum.at(longest, row, (ends - first).astype(np.int32))
    return {"cu_seqlens": cu, "longest_document": longest}


def _fill_window(sample: np.ndarray, tokens: np.ndarray, trained: np.ndarray, starts: np.ndarray, eod_id: int,
                 eod_mask_loss: bool) -> None:
    """A window of concatenated documents: every label trains; a document starts after each EOD, and padding
    is a document of its own."""
    n = min(len(sample), len(tokens))
    m = min(n, len(starts))                 # real inputs
    tokens[:n] = sample[:n]
    trained[:max(n - 1, 0)] = True
    is_eod = tokens[:m] == eod_id
    if eod_mask_loss:
        trained[:m] &= ~is_eod
    starts[1:m] = is_eod[:m - 1]
    if n < len(starts):
        starts[n] = True


def _fill_packed(row: PackedRow, tokens: np.ndarray, trained: np.ndarray, starts: np.ndarray, eod_id: int,
                 eod_mask_loss: bool) -> None:
    """Whole documents back to back: label t trains when token t + 1 carries the loss and is in t's document;
    each document starts its own, and so does the padding after them."""
    n = min(len(row.tokens), len(trained))
    tokens[:n] = row.tokens[:n]
    begin = np.cumsum(row.doc_lengths)[:-1]
    starts[begin[begin < len(starts)]] = True
    if n < len(starts):
        starts[n] = True
    if n > 1:
        trained[:n - 1] = row.loss[1:n] & ~starts[1:n]


def _document_weights(trained: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
    """1 / (labels that carry the loss in the label's document), on each such label; 0 elsewhere."""
    weights = np.zeros(trained.shape, dtype=np.float32)
    for b in range(len(trained)):
        counts = np.bincount(doc_ids[b][trained[b]], minlength=int(doc_ids[b][-1]) + 1)
        weights[b][trained[b]] = 1.0 / counts[doc_ids[b][trained[b]]]
    return weights


def cut_samples(samples: Sequence[np.ndarray], seq_len: int, piece_len: int) -> list[np.ndarray]:
    """Cut each sample of (up to) seq_len + 1 tokens into seq_len // piece_len samples of piece_len + 1 tokens,
    in order: piece i holds tokens [i * L, (i + 1) * L] (inputs i*L .. (i+1)*L - 1, labels one further), so
    consecutive pieces overlap by one token and their labels are exactly the sample's. A short sample gives
    short (or empty) pieces, padded as any short sample is."""
    if piece_len < 1 or seq_len % piece_len:
        raise ValueError(f"piece length {piece_len} does not divide seq_len={seq_len}")
    return [piece for sample in samples for piece in cut_window(sample, seq_len, piece_len)]


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


def iterate_micro_batches(dataset: Any, micro_batch_size: int, rank: LoaderRank, consumed_samples: int,
                          fmt: BatchFormat, seq_len: Optional[int] = None, vocab_size: Optional[int] = None,
                          length_at: Optional[Callable[[int], int]] = None) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this rank's micro-batches from `consumed_samples` on, until the dataset cannot fill a
    whole chunk of micro_batch_size * dp_size samples. `dataset[g]` is sample g of the stream (seq_len
    + 1 tokens); seq_len defaults to `dataset.seq_len`. With vocab_size, a sample holding a token id
    outside [0, vocab_size) raises DatasetError instead of reaching the model.
    With `length_at`, the chunk of samples from stream index g on trains at length length_at(g), a divisor
    of seq_len: its samples are cut into pieces of that length (cut_samples), or, from a dataset of packed
    conversations, read at that length (packing.sample_rows)."""
    dp_rank, dp_size = rank.dp_rank, rank.dp_size
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
        length = seq_len if length_at is None else length_at(c * chunk)
        if length != seq_len and seq_len % length:
            raise ValueError(f"piece length {length} does not divide seq_len={seq_len}")
        rows = [sample_rows(dataset, g, seq_len, length) for g in ids]
        if vocab_size is not None:
            check_sample_ids([np.concatenate([getattr(r, "tokens", r) for r in sample]) for sample in rows], ids,
                             vocab_size)
        yield build_micro_batch([r for sample in rows for r in sample], length, rank.sp_rank, fmt, rank.layout)
        c += 1
