"""tools/merge_datasets.py: shards preprocessed one by one and merged are, byte for byte, the dataset that
preprocessing all their inputs in one run writes; dtypes must match; nothing is left behind by a merge
that fails or is interrupted; progress is reported."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megalysses.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megalysses.tools import merge_datasets, preprocess_data

ROOT = Path(__file__).resolve().parent.parent


def shard_inputs(folder: Path, n: int = 3) -> list[Path]:
    """n JSON Lines shards with plain, empty and pre-split documents (documents of 0, 1 and 3 sequences)."""
    rng = np.random.default_rng(2)
    folder.mkdir()
    paths = []
    for s in range(n):
        docs = ["".join(chr(c) for c in rng.integers(32, 0x2FF, size=rng.integers(1, 90))) for _ in range(25 + 7 * s)]
        docs[3], docs[8] = "", [f"shard {s} first", "", f"shard {s} second", "third"]
        paths.append(folder / f"shard_{s:02d}.jsonl")
        paths[-1].write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return paths


def preprocess(inp, prefix, *extra):
    return preprocess_data.main(["--input", str(inp), "--output-prefix", str(prefix), "--log-interval", "0",
                                 "--append-eod", *extra])


def files(prefix) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def test_merged_shards_equal_one_preprocessing_run(tmp_path, capsys):
    inputs = shard_inputs(tmp_path / "raw")
    for path in inputs:                                             # one machine per shard
        preprocess(path, tmp_path / "shards" / path.stem)
    (tmp_path / "shards" / "README.md").write_text("not a dataset")
    preprocess(str(tmp_path / "raw" / "shard_*.jsonl"), tmp_path / "whole")    # all of it in one run
    capsys.readouterr()
    out = tmp_path / "merged" / "corpus_text_document"
    result = merge_datasets.main(["--input", str(tmp_path / "shards"), "--output-prefix", str(out)])
    assert files(out) == files(tmp_path / "whole_text_document")
    ds = IndexedDataset(out)
    assert result["documents"] == ds.num_documents == 25 + 32 + 39 and result["datasets"] == 3
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("[")] == [
        f"[{i}/3] shard_{i - 1:02d}_text_document" for i in (1, 2, 3)]
    for word in ("docs/s", "MB/s", "tokens/s", "ETA"):
        assert word in lines[1], lines[1]
    # each line counts its own shard, then what is merged so far
    shard_1 = IndexedDataset(tmp_path / "shards" / "shard_01_text_document")
    assert f"shard_01_text_document: 32 docs, {shard_1.num_tokens:,} tokens; merged so far: 57 docs |" in err, err
    assert "done: " in err and "1 files of" in err and "README.md" in err
    assert sorted(p.name for p in out.parent.iterdir()) == ["corpus_text_document.bin", "corpus_text_document.idx",
                                                            "corpus_text_document.tokenizer.json"]
    # the shards' tokenizer goes beside the merged dataset (a shard that records none: the merge records none)
    shard = tmp_path / "shards" / "shard_00_text_document.tokenizer.json"
    assert (out.parent / "corpus_text_document.tokenizer.json").read_bytes() == shard.read_bytes()
    shard.unlink()
    merge_datasets.main(["--input", str(tmp_path / "shards"), "--output-prefix", str(out)])
    assert "records no tokenizer" in capsys.readouterr().err
    assert sorted(p.name for p in out.parent.iterdir()) == ["corpus_text_document.bin", "corpus_text_document.idx"]


def test_megatron_command_line_and_name_order(tmp_path, capsys):
    """The command as Megatron-LM's tools/merge_datasets.py takes it, through the script; shards merge in the
    sorted order of their names, which a note points out when numbers are not zero-padded."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for n in (2, 10):
        builder = IndexedDatasetBuilder(folder / f"part_{n}.bin", np.uint16)
        builder.add_document([n, n + 1])
        builder.finalize(folder / f"part_{n}.idx")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "merge_datasets.py"), "--input", str(folder),
                        "--output-prefix", str(tmp_path / "merged")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "in which part_10 comes before part_2" in r.stderr
    assert IndexedDataset(tmp_path / "merged")[0].tolist() == [10, 11]


def test_refusals_leave_nothing_behind(tmp_path, monkeypatch):
    folder = tmp_path / "shards"
    folder.mkdir()
    for name, dtype in (("a", np.uint16), ("b", np.int32)):
        builder = IndexedDatasetBuilder(folder / f"{name}.bin", dtype)
        builder.add_document([1, 2, 3])
        builder.finalize(folder / f"{name}.idx")
    out = tmp_path / "out" / "merged"
    with pytest.raises(SystemExit, match=r"b.idx holds int32 tokens but .*a.idx holds uint16: datasets of different "
                                         r"dtypes .* cannot be merged"):
        merge_datasets.main(["--input", str(folder), "--output-prefix", str(out)])
    (folder / "b.idx").unlink()
    with pytest.raises(SystemExit, match=r"b.bin has no b.idx beside it"):
        merge_datasets.main(["--input", str(folder), "--output-prefix", str(out)])
    (folder / "b.bin").unlink()
    assert not out.parent.exists()
    # an interrupted merge: no temporary file, and the earlier output as it was
    merge_datasets.main(["--input", str(folder), "--output-prefix", str(out)])
    before = files(out)

    def interrupted(self, idx_file):
        raise KeyboardInterrupt

    monkeypatch.setattr(IndexedDatasetBuilder, "finalize", interrupted)
    with pytest.raises(SystemExit, match="error: interrupted: nothing was written"):
        merge_datasets.main(["--input", str(folder), "--output-prefix", str(out)])
    assert files(out) == before and sorted(p.name for p in out.parent.iterdir()) == ["merged.bin", "merged.idx"]
