"""Conversations packed whole (data/packing.py) and their micro-batches (data/loader.py): first fit equals the
plain algorithm, every conversation lands once per epoch in one sequence, too-long conversations are dropped,
truncated or refused and counted, the index is cached and deterministic, blends mix packed and plain samples,
and a micro-batch keeps conversations apart (labels, documents, positions, weights) whatever the sp layout."""
import numpy as np
import pytest

from chat_data import write_conversations
from megalysses.data.blend import BlendedDataset
from megalysses.data.build import DatasetOptions, build_gpt_datasets
from megalysses.data.gpt_dataset import GPTDataset
from megalysses.data.indexed import DatasetError, IndexedDataset, loss_mask_prefix
from megalysses.data.loader import IGNORE_INDEX, BatchFormat, LoaderRank, build_micro_batch, iterate_micro_batches
from megalysses.data.packing import (MaskedDataset, Packing, PackedConversations, PackedRow, first_fit,
                                     open_loss_mask)
from megalysses.degrees import Degrees
from megalysses.parallel.sequence_layout import SequenceLayout


def plain_first_fit(sizes, capacity):
    room, out = [], []
    for s in sizes:
        k = next((i for i, r in enumerate(room) if r >= s), len(room))
        if k == len(room):
            room.append(capacity)
        room[k] -= s
        out.append(k)
    return out


def test_first_fit_is_the_plain_algorithm():
    rng = np.random.default_rng(0)
    for n, cap in ((1, 5), (7, 10), (200, 64), (513, 1000)):
        sizes = rng.integers(1, cap + 1, n)
        assert first_fit(sizes, cap).tolist() == plain_first_fit(sizes.tolist(), cap)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    prefix = write_conversations(tmp_path_factory.mktemp("chats") / "c_text_document", count=60, longest=40)
    ds = IndexedDataset(prefix)
    return ds, open_loss_mask(ds, loss_mask_prefix(prefix))


def packed(chats, tmp_path=None, **kw):
    ds, mask = chats
    args = dict(seq_len=32, seed=3, num_samples=None, cache_dir=str(tmp_path) if tmp_path else None)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    return PackedConversations(MaskedDataset(ds, mask), (0, len(ds)), packing=Packing(**kw), **args)


@pytest.mark.parametrize("mode", ["ffd", "none"])
@pytest.mark.parametrize("too_long", ["drop", "truncate"])
def test_each_conversation_once_per_epoch_whole_or_as_told(chats, tmp_path, mode, too_long):
    ds, mask = chats
    p = packed(chats, tmp_path, mode=mode, too_long=too_long, lengths=(16, 32))
    lengths = np.asarray(ds.sequence_lengths)
    for length in (16, 32):
        rows = p.sequences(length)
        k = 32 // length
        assert [r.tokens.tolist() for i in range(len(p)) for r in p.rows(i, length)] == \
            [r.tokens.tolist() for r in rows[:len(p) * k]]
        assert all(len(r.tokens) <= length and r.doc_lengths.sum() == len(r.tokens) for r in rows)
        if mode == "none":
            assert all(len(r.doc_lengths) == 1 for r in rows)
        # every conversation that fits appears once, whole, its loss mask beside it
        seen = sorted(tuple(r.tokens[a:a + n]) for r in rows
                      for a, n in zip(np.cumsum(r.doc_lengths) - r.doc_lengths, r.doc_lengths))
        fits = [i for i in range(len(ds)) if lengths[i] <= length]
        cut = [i for i in range(len(ds)) if lengths[i] > length and mask[i][1:length].any()]
        want = [tuple(ds[i]) for i in fits] + ([tuple(ds[i][:length]) for i in cut] if too_long == "truncate" else [])
        assert seen == sorted(want)
        losses = {tuple(r.tokens[a:a + n]): tuple(r.loss[a:a + n]) for r in rows
                  for a, n in zip(np.cumsum(r.doc_lengths) - r.doc_lengths, r.doc_lengths)}
        assert all(losses[tuple(ds[i])] == tuple(mask[i].astype(bool)) for i in fits)
        line = next(x for x in p.summary() if f" at {length} tokens" in x)
        words = f"{len(cut)} truncated" if too_long == "truncate" else f"{len(ds) - len(fits)} longer dropped"
        assert words in line and f"packed {mode}" in line
    # first fit decreasing fills more of each sequence than one conversation each
    if mode == "ffd":
        assert len(p.rows(0, 16)) == 2 and sum(len(r.tokens) for r in p.rows(0, 32)) > 24


def test_the_index_is_cached_and_deterministic_and_epochs_repeat(chats, tmp_path):
    a = packed(chats, tmp_path, num_samples=40, lengths=(16,))
    files = sorted(f.name for f in tmp_path.iterdir())
    b = packed(chats, tmp_path, num_samples=40, lengths=(16,))
    assert sorted(f.name for f in tmp_path.iterdir()) == files and any("packed16" in f for f in files)
    assert len(a) >= 40
    for i in (0, 17, 39):
        for x, y in zip(a.rows(i, 16), b.rows(i, 16)):
            assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.loss, y.loss)
    other = packed(chats, None, num_samples=40, lengths=(16,), seed=4)
    assert not np.array_equal(a.rows(0, 32)[0].tokens, other.rows(0, 32)[0].tokens)


def test_too_long_error_and_a_mask_that_does_not_match(chats, tmp_path):
    with pytest.raises(DatasetError, match="longer than the sequences of 16 tokens.*data.too_long"):
        packed(chats, too_long="error", lengths=(16,))
    ds, _ = chats
    other = IndexedDataset(write_conversations(tmp_path / "other_text_document", count=5))
    with pytest.raises(DatasetError, match="does not match"):
        open_loss_mask(ds, loss_mask_prefix(other.prefix))
    with pytest.raises(DatasetError, match="holds uint8"):
        open_loss_mask(ds, ds.prefix)


def test_blend_of_conversations_and_plain_documents(chats, tmp_path):
    ds, _ = chats
    rng = np.random.default_rng(1)
    from megalysses.data.indexed import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(tmp_path / "plain_text_document.bin", np.uint16)
    for _ in range(30):
        builder.add_document(np.append(rng.integers(0, 100, 20), 127))
    builder.finalize(tmp_path / "plain_text_document.idx")
    train, _, _ = build_gpt_datasets(["0.5", ds.prefix, "0.5", str(tmp_path / "plain_text_document")], "1,0,0", 32,
                                     seed=1, num_samples=(20, None, None),
                                     options=DatasetOptions(str(tmp_path / "cache"), packing=Packing(lengths=(16, 32))))
    assert isinstance(train, BlendedDataset)
    kinds = {type(d) for d in train.datasets}
    assert kinds == {PackedConversations, GPTDataset}
    for i in range(20):
        rows = train.rows(i, 16)
        assert len(rows) == 2
        assert all(isinstance(r, PackedRow) for r in rows) or all(len(r) == 17 for r in rows)
    fmt = BatchFormat(eod_id=127, reset_position_ids=True, document_mask=True)
    batches = list(iterate_micro_batches(train, 2, LoaderRank(), 0, fmt, length_at=lambda g: 16 if g < 10 else 32))
    assert [tuple(b["input_ids"].shape) for b in batches] == [(4, 16)] * 5 + [(2, 32)] * 5
    assert train.labels_of(np.arange(20), 16) is None                # windows: every label trains
    options = DatasetOptions(str(tmp_path / "cache2"), packing=Packing(lengths=(16, 32)))
    twice, _, _ = build_gpt_datasets(["0.5", ds.prefix, "0.5", ds.prefix], "1,0,0", 32, seed=1,
                                     num_samples=(20, None, None), options=options)
    for length in (16, 32):
        held = [int((build_micro_batch(twice.rows(i, length), length, 0, fmt)["labels"]
                     != IGNORE_INDEX).sum()) for i in range(20)]
        assert twice.labels_of(np.arange(20), length) == sum(held) and twice.labels_of(np.array([3]), length) == held[3]


def test_a_micro_batch_keeps_conversations_apart():
    row = PackedRow(np.array([5, 6, 7, 8, 9, 10, 11]), np.array([0, 0, 1, 1, 0, 1, 1], bool), np.array([4, 3]))
    window = np.array([1, 2, 99, 3, 4, 5, 6, 7, 8])          # a window of plain documents, 99 = EOD
    full = build_micro_batch([row, window], 8, 0, BatchFormat(eod_id=99, reset_position_ids=True,
                                                                 document_mask=True, pad_id=0))
    m = IGNORE_INDEX
    assert full["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 0], [1, 2, 99, 3, 4, 5, 6, 7]]
    # a label trains where its token carries the loss, inside its conversation; never across one, nor padding
    assert full["labels"].tolist() == [[m, 7, 8, m, 10, 11, m, m], [2, 99, 3, 4, 5, 6, 7, 8]]
    assert full["doc_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 2], [0, 0, 0, 1, 1, 1, 1, 1]]
    assert full["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 0, 1, 2, 3, 4]]
    by_document = BatchFormat(99, True, True, pad_id=0, loss_average="document")
    weighted = build_micro_batch([row, window], 8, 0, by_document)
    w = weighted["loss_weights"]
    assert w[0].tolist() == [0, 0.5, 0.5, 0, 0.5, 0.5, 0, 0]
    assert w[1].tolist() == pytest.approx([1 / 3] * 3 + [0.2] * 5)
    # sharded over a ring of 2 (zigzag) and Ulysses: each rank's positions of the same arrays
    layout = SequenceLayout(Degrees(sp=4, ring=2))
    for r in range(4):
        part = build_micro_batch([row, window], 8, r, by_document, layout)
        keep = layout.positions(8, r)
        for key in ("input_ids", "labels", "position_ids", "loss_weights"):
            assert part[key].tolist() == weighted[key][:, keep].tolist(), key
        assert part["doc_ids"].tolist() == weighted["doc_ids"].tolist()


def _mask_rewritten(prefix: str, keep) -> None:
    """The loss mask of `prefix` rewritten: conversation i keeps its mask where keep(i, its mask) says, else 0."""
    from megalysses.data.indexed import IndexedDatasetBuilder

    old = IndexedDataset(loss_mask_prefix(prefix))
    masks = [np.where(keep(i, old[i]), old[i], 0).astype(np.uint8) for i in range(len(old))]
    del old
    builder = IndexedDatasetBuilder(f"{loss_mask_prefix(prefix)}.bin", np.uint8)
    for m in masks:
        builder.add_document(m)
    builder.finalize(f"{loss_mask_prefix(prefix)}.idx")


@pytest.mark.parametrize("too_long", ["drop", "truncate"])
def test_the_labels_that_train_are_counted_from_the_index_as_the_micro_batches_hold_them(chats, tmp_path, too_long):
    p = packed(chats, tmp_path, too_long=too_long, lengths=(8, 16, 32), num_samples=12)
    for length in (8, 16, 32):
        for i in range(len(p)):
            batch = build_micro_batch(p.rows(i, length), length, 0, BatchFormat(127, True, True))
            assert p.labels_of(np.array([i]), length) == int((batch["labels"] != IGNORE_INDEX).sum())
        assert p.labels_of(np.arange(3), length) == sum(p.labels_of(np.array([i]), length) for i in range(3))


def test_conversations_with_nothing_to_train_on_are_refused(tmp_path):
    zeros = write_conversations(tmp_path / "zeros_text_document", count=20, longest=30)
    _mask_rewritten(zeros, lambda i, m: False)
    ds = IndexedDataset(zeros)
    with pytest.raises(DatasetError, match="no token of its conversations carries the loss: .* marks none"):
        PackedConversations(MaskedDataset(ds, open_loss_mask(ds, loss_mask_prefix(zeros))), (0, len(ds)), 32, seed=1)
    late = write_conversations(tmp_path / "late_text_document", count=20, shortest=20, longest=40)
    _mask_rewritten(late, lambda i, m: np.arange(len(m)) >= 12)       # every answer past the first 12 tokens
    ds = IndexedDataset(late)
    with pytest.raises(DatasetError, match="in the first 8 tokens of each .data.too_long=truncate"):
        PackedConversations(MaskedDataset(ds, open_loss_mask(ds, loss_mask_prefix(late))), (0, len(ds)), 32, seed=1,
                            packing=Packing(too_long="truncate", lengths=(8, 32)))


def test_a_step_with_nothing_to_train_on_is_told_with_the_count(tmp_path, capsys):
    """Half the conversations carry no loss: the steps whose one sample holds only those are named, counted."""
    import torch

    from megalysses.config.io import load_config
    from megalysses.training.data import TrainingData
    from megalysses.testing import plan_and_grid

    prefix = write_conversations(tmp_path / "half_text_document", count=40)
    _mask_rewritten(prefix, lambda i, m: i % 2 == 0)
    cfg = load_config(overrides=["data.mock=false", f"data.paths=[{prefix}]", "data.tokenizer=NullTokenizer",
                                 "model.vocab_size=128", "data.seq_len=32", "data.pack=none", "data.split=100,0,0",
                                 "training.global_batch_size=1", "training.micro_batch_size=1",
                                 "training.train_steps=12", "training.eval_interval=0",
                                 f"data.cache_dir={tmp_path / 'cache'}"])
    run, grid = plan_and_grid(cfg, torch.device("cpu"))
    data = TrainingData(cfg, grid, run, torch.device("cpu"))
    capsys.readouterr()
    steps = [labels for _, labels in zip(range(12), ((mb["labels"] != IGNORE_INDEX).sum().item()
                                                      for batch in data.train_batches(0) for mb in batch))]
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: step")]
    empty = [k + 1 for k, n in enumerate(steps) if n == 0]
    assert empty and len(empty) < 12, steps                       # some steps train on nothing, others do not
    assert warned == [f"warning: step {s} trains on nothing: its 1 samples hold no token that carries "
                                   f"the loss ({n} such step{'s' if n > 1 else ''} so far): its loss and gradients "
                                   f"are zero" for n, s in enumerate(empty, 1)]
