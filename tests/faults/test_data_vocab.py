"""Out-of-range token ids never train, at any layout: at tp=2 the vocab-parallel embedding would
silently mask them, and at pp, sp and dp the ranks that hold no embedding or other samples would
never see them; every rank refuses the dataset with the same message before the first step, and a
dataset within the vocabulary trains. (tp=1, a world of one, is in the corpus: data/token_id_*.)
The check is made each time a dataset is opened: its cached result does not hide a file changed in
place."""
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megalysses.data.indexed import IndexedDatasetBuilder
from megalysses.testing import run_distributed

TINY = ["data.mock=false", "data.seq_len=32", "model.vocab_size=512", "model.hidden_size=32", "model.num_layers=2",
        "model.num_heads=4", "training.global_batch_size=2", "training.micro_batch_size=1", "training.train_steps=1",
        "checkpoint.load=none", "data.split=100,0,0", "data.tokenizer=NullTokenizer"]
LAYOUTS = {"tp2": ["parallel.tp=2"], "sp2": ["parallel.sp=2"], "pp2": ["parallel.pp=2"], "dp2": []}


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
    from megalysses.config.io import load_config
    from megalysses.data import DatasetError
    from megalysses.testing import plan_and_grid
    from megalysses.training.loop import train

    def go(layout: str, name: str, data: str) -> object:
        cfg = load_config(None, TINY + LAYOUTS[layout] + [f"data.paths={tmp}/{data}",
                                                         f"logging.run_dir={tmp}/run_{layout}_{name}"])
        try:
            run, grid = plan_and_grid(cfg, torch.device("cpu"))
            return train(cfg, run, grid, torch.device("cpu"))["step"]
        except DatasetError as e:
            return str(e)

    out = {}
    for layout in LAYOUTS:
        for name in ("past_vocab", "negative", "good"):
            out[layout, name] = go(layout, name, name)
    if rank == 0:        # "good" changed in place after its range was cached: same size, a later mtime
        dataset(Path(tmp) / "good", [600], np.uint16)
        stat = os.stat(f"{tmp}/good.bin")
        os.utime(f"{tmp}/good.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    dist.barrier()
    out["tp2", "changed"] = go("tp2", "changed", "good")
    return out


def test_out_of_range_ids_never_train_at_any_layout(tmp_path):
    dataset(tmp_path / "past_vocab", [700, 2047], np.uint16)
    dataset(tmp_path / "negative", [-1], np.int32)
    dataset(tmp_path / "good", [511], np.uint16)
    results = run_distributed(train_on, world=2, tmp_dir=tmp_path, args=(str(tmp_path),))
    assert results[0] == results[1]
    seen = results[0]
    for layout in LAYOUTS:
        past, negative = seen[layout, "past_vocab"], seen[layout, "negative"]
        assert "token id 700 (document 11" in past and "model.vocab_size" in past, (layout, past)
        assert "negative token id -1 (document 11" in negative, (layout, negative)
        assert seen[layout, "good"] == 1, (layout, seen[layout, "good"])
        for name in ("past_vocab", "negative"):   # refused when opened: no step taken, nothing logged
            metrics = tmp_path / f"run_{layout}_{name}" / "metrics.jsonl"
            assert not metrics.exists() or not metrics.read_text().strip()
    assert "token id 600 (document 11" in seen["tp2", "changed"], seen["tp2", "changed"]
    assert any(name.endswith("-range.npy") for name in os.listdir(tmp_path / "index_cache")), "no cached range"
