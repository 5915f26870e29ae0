"""Out-of-range token ids never train, at tp=2 too, where the vocab-parallel embedding would silently
mask them: every rank refuses the dataset with the same message before the first step, and a dataset
within the vocabulary trains."""
import json
from pathlib import Path

import numpy as np
import torch

from megalysses.data.indexed import IndexedDatasetBuilder
from megalysses.testing import run_distributed

TINY = ["data.mock=false", "data.seq_len=32", "model.vocab_size=512", "model.hidden_size=32", "model.num_layers=1",
        "model.num_heads=4", "training.global_batch_size=2", "training.micro_batch_size=1", "training.train_steps=1",
        "parallel.tp=2", "checkpoint.load=none", "data.split=100,0,0", "data.tokenizer=NullTokenizer"]


def dataset(prefix: Path, ids: list[int], dtype: type) -> str:
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for d in range(30):
        doc = rng.integers(0, 500, size=20)
        if d == 11:
            doc[5:5 + len(ids)] = ids
        builder.add_document(doc)
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def train_on(rank: int, world: int, tmp: str) -> dict:
    from megalysses.config import load_config
    from megalysses.data import DatasetError
    from megalysses.grid import ParallelGrid
    from megalysses.training.loop import train

    grid = ParallelGrid(tp=2)
    out = {}
    for name in ("past_vocab", "negative", "good"):
        cfg = load_config(None, TINY + [f"data.paths={tmp}/{name}", f"logging.run_dir={tmp}/run_{name}"])
        try:
            out[name] = train(cfg, grid, torch.device("cpu"))["step"]
        except DatasetError as e:
            out[name] = str(e)
    return out


def test_out_of_range_ids_never_train_at_tp2(tmp_path):
    dataset(tmp_path / "past_vocab", [700, 2047], np.uint16)
    dataset(tmp_path / "negative", [-1], np.int32)
    dataset(tmp_path / "good", [511], np.uint16)
    results = run_distributed(train_on, world=2, tmp_dir=tmp_path, args=(str(tmp_path),))
    assert results[0] == results[1]
    assert "token id 700" in results[0]["past_vocab"] and "model.vocab_size" in results[0]["past_vocab"]
    assert "negative token id -1" in results[0]["negative"]
    assert results[0]["good"] == 1
    for name in ("past_vocab", "negative"):   # refused before any step was taken or logged
        metrics = tmp_path / f"run_{name}" / "metrics.jsonl"
        assert not metrics.exists() or not [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
