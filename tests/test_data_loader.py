"""Loader: dp x sp slices reassemble the global batch, resume continues the stream, positions and
document ids over packed documents, padding, samples cut to a curriculum's shorter lengths."""
import itertools

import numpy as np
import pytest
import torch

from megalysses.data.gpt_dataset import GPTDataset, MockGPTDataset
from megalysses.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megalysses.degrees import Degrees
from megalysses.data.loader import (IGNORE_INDEX, BatchFormat, LoaderRank, build_micro_batch, cut_samples,
                                    iterate_micro_batches)
from megalysses.parallel.sequence_layout import SequenceLayout
from tests.fixtures import MOCK_32

SEQ, EOD = 16, 999


class Stream:
    """Sample g is a distinct recognisable window: g * 100 + [0, SEQ], with an EOD every 5th token."""

    seq_len = SEQ

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, g):
        tokens = g * 100 + np.arange(SEQ + 1)
        tokens[(np.arange(SEQ + 1) + g) % 5 == 4] = EOD
        return tokens


def loader(ds, mbs, dp, dp_rank, sp, sp_rank, consumed=0, layout=None, length_at=None, **kw):
    fmt = BatchFormat(EOD, **{"reset_position_ids": True, "document_mask": True, **kw})
    layout = SequenceLayout(Degrees(sp=sp, dp=dp)) if layout is None else layout
    assert (layout.degrees.sp, layout.degrees.dp) == (sp, dp)
    return iterate_micro_batches(ds, mbs, LoaderRank(dp_rank, sp_rank, layout), consumed, fmt,
                                 length_at=length_at)


def reference(tokens):
    """Per-position doc ids and reset positions by a plain loop."""
    doc, pos, docs, positions = 0, 0, [], []
    for j in range(SEQ):
        docs.append(doc)
        positions.append(pos)
        pos += 1
        if tokens[j] == EOD:
            doc, pos = doc + 1, 0
    return docs, positions


@pytest.mark.parametrize("dp,sp,mbs", list(itertools.product((1, 2, 4), (1, 2, 4), (1, 2))))
def test_union_of_rank_slices_is_the_global_batch(dp, sp, mbs):
    ds, gbs, steps = Stream(64), 8, 3
    num_micro = gbs // (mbs * dp)
    pieces = {}  # global sample id -> {sp_rank: tensors}
    for dp_rank, sp_rank in itertools.product(range(dp), range(sp)):
        it = loader(ds, mbs, dp, dp_rank, sp, sp_rank)
        for step in range(steps):
            for micro in range(num_micro):
                batch = next(it)
                assert batch["input_ids"].shape == (mbs, SEQ // sp) and batch["input_ids"].dtype == torch.int64
                assert batch["doc_ids"].shape == (mbs, SEQ) and batch["doc_ids"].dtype == torch.int32
                for row in range(mbs):
                    g = (step * num_micro + micro) * mbs * dp + dp_rank * mbs + row
                    assert step * gbs <= g < (step + 1) * gbs  # the step's global batch, whatever dp is
                    pieces.setdefault(g, {})[sp_rank] = {k: v[row] for k, v in batch.items()}
    assert sorted(pieces) == list(range(steps * gbs))
    for g, parts in pieces.items():
        tokens = ds[g]
        full = {k: torch.cat([parts[r][k] for r in range(sp)]) for k in ("input_ids", "labels", "position_ids")}
        assert full["input_ids"].tolist() == tokens[:SEQ].tolist()
        assert full["labels"].tolist() == tokens[1:].tolist()
        docs, positions = reference(tokens)
        assert full["position_ids"].tolist() == positions
        for r in range(sp):  # every sp rank holds the same full-sequence document ids
            assert parts[r]["doc_ids"].tolist() == docs


def test_same_global_batches_for_dp1_and_dp2():
    ds = Stream(48)

    def step_sets(dp, mbs):
        gbs, out = 8, []
        streams = [loader(ds, mbs, dp, r, 1, 0) for r in range(dp)]
        for _ in range(3):
            seen = []
            for _ in range(gbs // (mbs * dp)):
                for it in streams:
                    seen += [int(x) // 100 for x in next(it)["input_ids"][:, 0]]
            out.append(sorted(seen))
        return out

    assert step_sets(1, 2) == step_sets(2, 2) == step_sets(2, 1) == step_sets(4, 2)


def test_global_positions_without_reset():
    batch = next(loader(Stream(8), 2, 1, 0, 4, 2, reset_position_ids=False, document_mask=False))
    assert "doc_ids" not in batch
    assert batch["position_ids"].tolist() == [list(range(8, 12))] * 2


def test_resume_continues_the_stream():
    ds = MockGPTDataset(40, SEQ, vocab_size=1000, eod_id=EOD, seed=1)
    full = list(loader(ds, 2, 2, 1, 2, 1))
    for consumed in (4, 12, 36):
        resumed = list(loader(ds, 2, 2, 1, 2, 1, consumed=consumed))
        assert len(resumed) == len(full) - consumed // 4
        for a, b in zip(resumed, full[consumed // 4:]):
            assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="not a multiple"):
        next(loader(ds, 2, 2, 1, 2, 1, consumed=6))


def test_padding_and_eod_mask_loss():
    short = np.array([5, 6, EOD, 7, 8])
    batch = build_micro_batch([short], 8, 0, BatchFormat(EOD, reset_position_ids=True, document_mask=True,
                                                             eod_mask_loss=True, pad_id=0))
    assert batch["input_ids"].tolist() == [[5, 6, EOD, 7, 8, 0, 0, 0]]
    assert batch["labels"].tolist() == [[6, EOD, IGNORE_INDEX, 8] + [IGNORE_INDEX] * 4]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    # a length sp does not divide is padded at the end: pad tokens, labels -100, a document of their own
    three = SequenceLayout(Degrees(sp=3))
    parts = [build_micro_batch([short], 8, r, BatchFormat(EOD, True, True, pad_id=0), three) for r in range(3)]
    assert torch.cat([p["input_ids"] for p in parts], 1).tolist() == [[5, 6, EOD, 7, 8, 0, 0, 0, 0]]
    assert torch.cat([p["labels"] for p in parts], 1).tolist() == [[6, EOD, 7, 8] + [IGNORE_INDEX] * 5]
    assert parts[2]["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 3]]


@pytest.mark.parametrize("flag", [True, False])
def test_eod_mask_loss_reaches_training_and_validation_batches(flag):
    from megalysses.config.io import load_config
    from megalysses.training.data import TrainingData
    from megalysses.testing import plan_and_grid

    cfg = load_config(overrides=MOCK_32 + ["training.global_batch_size=2", "training.eval_interval=1",
                                 f"data.eod_mask_loss={str(flag).lower()}"])
    run, grid = plan_and_grid(cfg, torch.device("cpu"))
    data = TrainingData(cfg, grid, run, torch.device("cpu"))
    for batches in (next(data.train_batches(0)), data.valid_batches()):
        at_eod = torch.cat([mb["input_ids"] == data.eod_id for mb in batches])
        labels = torch.cat([mb["labels"] for mb in batches])
        assert at_eod.any() and (labels[at_eod] == IGNORE_INDEX).all().item() == flag
        assert (labels[~at_eod] != IGNORE_INDEX).all()


def test_real_dataset_end_to_end(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "d.bin", np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(50):
        builder.add_document(np.append(rng.integers(0, 250, size=rng.integers(1, 30)), 257))
    builder.finalize(tmp_path / "d.idx")
    gpt = GPTDataset(IndexedDataset(tmp_path / "d"), (0, 50), 32, seed=1)
    rank = LoaderRank(dp_rank=0, sp_rank=1, layout=SequenceLayout(Degrees(sp=2)))
    batches = list(iterate_micro_batches(gpt, 2, rank, 0, BatchFormat(257, True, True)))
    assert len(batches) == len(gpt) // 2
    first = gpt[0].astype(np.int64)
    assert batches[0]["input_ids"][0].tolist() == first[16:32].tolist()
    assert batches[0]["labels"][0].tolist() == first[17:33].tolist()


def _restarting(inputs, n_real):
    """Document ids and reset positions of one sequence by a plain loop: a document starts at the sequence's
    start, after each real EOD and where padding begins (position n_real)."""
    doc, pos, docs, positions, prev_eod = 0, 0, [], [], False
    for j, t in enumerate(inputs):
        if j and (prev_eod or j == n_real):
            doc, pos = doc + 1, 0
        docs.append(doc)
        positions.append(pos)
        pos += 1
        prev_eod = t == EOD and j < n_real
    return docs, positions


@pytest.mark.parametrize("reset,eod_mask_loss", [(True, False), (False, True)])
def test_curriculum_pieces_are_the_sample_cut_with_restarts(reset, eod_mask_loss):
    """At length L a sample of SEQ + 1 tokens is SEQ / L rows: its tokens and labels cut in order, positions
    and documents restarting in each row; a short sample gives padded (and empty) rows."""
    ds = Stream(8)
    samples = [ds[3], ds[6], ds[7][:11]]
    fmt = BatchFormat(EOD, reset, True, eod_mask_loss, pad_id=0)
    full = build_micro_batch(samples, SEQ, 0, fmt)
    for L in (1, 4, 8, 16):
        r = SEQ // L
        got = build_micro_batch(cut_samples(samples, SEQ, L), L, 0, fmt)
        assert got["input_ids"].shape == (len(samples) * r, L)
        for b, sample in enumerate(samples):
            for i in range(r):
                row, cols = b * r + i, slice(i * L, (i + 1) * L)
                assert torch.equal(got["input_ids"][row], full["input_ids"][b, cols]), (L, b, i)
                assert torch.equal(got["labels"][row], full["labels"][b, cols]), (L, b, i)
                n_real = min(max(len(sample) - i * L, 0), L)
                docs, positions = _restarting(got["input_ids"][row].tolist(), n_real)
                assert got["doc_ids"][row].tolist() == docs, (L, b, i)
                assert got["position_ids"][row].tolist() == (positions if reset else list(range(L))), (L, b, i)
    # the labels the loss sees are the sample's, whatever L: the same tokens and the same count
    assert (full["labels"] != IGNORE_INDEX).sum() == (got["labels"] != IGNORE_INDEX).sum() > 0
    with pytest.raises(ValueError, match="does not divide"):
        cut_samples(samples, SEQ, 5)


class Windows:
    """A dataset of length L whose samples are the windows cut_samples makes of `ds`: what the loader gives
    for that length."""

    def __init__(self, ds, length):
        self.ds, self.seq_len, self.r = ds, length, ds.seq_len // length

    def __len__(self):
        return len(self.ds) * self.r

    def __getitem__(self, g):
        s, i = divmod(g, self.r)
        return self.ds[s][i * self.seq_len:(i + 1) * self.seq_len + 1]


def test_curriculum_micro_batches_are_the_loaders_at_each_length():
    """With length_at, chunk c of the stream is the loader's micro-batch of the windows at that length, on
    every (dp, sp) rank of a ring layout (pieces padded to its multiple); a resume continues it exactly."""
    ds = MockGPTDataset(24, SEQ, vocab_size=1000, eod_id=EOD, seed=3)
    mbs, dp, layout = 1, 2, SequenceLayout(Degrees(sp=2, ring=2, dp=2))

    def length_at(first):      # steps of 4 samples: 2 at length 2 (padded to 4), 2 at 8, then 16
        return 2 if first < 8 else 8 if first < 16 else 16

    fmt = BatchFormat(EOD, reset_position_ids=True, document_mask=True)
    for dp_rank, sp_rank in itertools.product(range(dp), range(2)):
        got = list(loader(ds, mbs, dp, dp_rank, 2, sp_rank, length_at=length_at, layout=layout))
        assert len(got) == len(ds) // (mbs * dp)
        for c, batch in enumerate(got):
            L = length_at(c * mbs * dp)
            r = SEQ // L
            assert batch["input_ids"].shape == (mbs * r, layout.padded_len(L) // 2)
            want = next(iterate_micro_batches(Windows(ds, L), mbs * r, LoaderRank(dp_rank, sp_rank, layout),
                                              c * mbs * dp * r, fmt))
            assert batch.keys() == want.keys()
            for k in batch:
                assert torch.equal(batch[k], want[k]), (dp_rank, sp_rank, c, k)
        for consumed in (6, 10):
            resumed = list(loader(ds, mbs, dp, dp_rank, 2, sp_rank, consumed, length_at=length_at, layout=layout))
            assert len(resumed) == len(got) - consumed // 2
            assert all(torch.equal(a[k], b[k]) for a, b in zip(resumed, got[consumed // 2:]) for k in a)


def _dataset(prefix, docs):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for doc in docs:
        builder.add_document(np.append(doc, 257))
    builder.finalize(f"{prefix}.idx")


def test_a_validation_set_of_its_own(tmp_path):
    """data.valid_paths (Megatron-LM's --valid-data-path): validation reads it whole, training the whole of
    data.paths, its last documents too (the default split would leave them to valid and test)."""
    from megalysses.config import ConfigError
    from megalysses.config.io import load_config
    from megalysses.data.indexed import DatasetError
    from megalysses.training.data import TrainingData
    from megalysses.testing import plan_and_grid

    rng = np.random.default_rng(0)
    _dataset(tmp_path / "train", [rng.integers(0, 100, 20) for _ in range(40)] + [np.arange(120, 130)])
    _dataset(tmp_path / "valid", [rng.integers(150, 250, 20) for _ in range(5)])
    _dataset(tmp_path / "tiny", [np.arange(150, 153)])
    base = [f"data.paths=[{tmp_path / 'train'}]", "data.tokenizer=byte", "model.vocab_size=512", "data.seq_len=16",
            "training.global_batch_size=2", "training.micro_batch_size=1", "training.train_steps=4",
            "training.eval_interval=2", "training.eval_steps=2", f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = load_config(overrides=base + [f"data.valid_paths=[{tmp_path / 'valid'}]"])
    run, grid = plan_and_grid(cfg, torch.device("cpu"))
    data = TrainingData(cfg, grid, run, torch.device("cpu"))
    valid = torch.cat([mb["input_ids"] for mb in data.valid_batches()])
    assert len(valid) == 4 and ((valid >= 150) & (valid < 250) | (valid == 257)).all()
    train = np.concatenate([data.train[i] for i in range(len(data.train))])
    assert (train < 130).all() or set(train[train >= 130].tolist()) == {257}
    assert 125 in train                                    # the last document trains
    with pytest.raises(DatasetError, match="data.valid_paths holds too few tokens"):
        tiny = load_config(overrides=base + [f"data.valid_paths=[{tmp_path / 'tiny'}]"])
        TrainingData(tiny, grid, plan_and_grid(tiny, torch.device("cpu"))[0], torch.device("cpu"))
    with pytest.raises(ConfigError, match="data.valid_paths"):
        load_config(overrides=base + ["data.valid_paths=[0.5]"])
