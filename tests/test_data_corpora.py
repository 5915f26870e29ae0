"""The corpora users bring: zstd JSON Lines, Parquet, Arrow files and streams, `datasets` folders and folders of
shards give the same tokens as the same documents in plain JSON Lines, for any --workers, in preprocess_data and
train_tokenizer; they are read as a stream, and damage is one error naming the file."""
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megalysses.data.columnar import read_records
from megalysses.data import columnar, text_input
from megalysses.data.text_input import InputError, Position, read_lines
from megalysses.tools import preprocess_data, train_tokenizer


def documents(n=120):
    """Texts of varied lengths and scripts, an empty one, and one that is not a string (null: skipped and
    counted, in every format)."""
    rng = np.random.default_rng(1)
    docs = ["".join(chr(c) for c in rng.integers(32, 0x2FF, size=rng.integers(0, 150))) + f" doc {i}\n"
            for i in range(n)]
    docs[9], docs[17] = "", None
    return docs, [f"title {i}" for i in range(n)]


def write_jsonl(path, docs, titles):
    path.write_text("".join(json.dumps({"text": d, "title": t, "id": i}) + "\n"
                            for i, (d, t) in enumerate(zip(docs, titles))))
    return path


def corpora(tmp: Path) -> tuple[dict, Path]:
    """({format: --input} for the same documents, the JSON Lines file of those documents)."""
    docs, titles = documents()
    plain = write_jsonl(tmp / "plain.jsonl", docs, titles)
    raw = plain.read_bytes()
    half = raw.index(b"\n", len(raw) // 2) + 1
    frames = zstandard.ZstdCompressor().compress(raw[:half]) + zstandard.ZstdCompressor(level=9).compress(raw[half:])
    (tmp / "c.jsonl.zst").write_bytes(frames)                      # two frames, as pzstd and zstd -T write
    rows = pa.table({"text": docs, "title": titles, "id": list(range(len(docs)))})
    pq.write_table(rows, tmp / "c.parquet", row_group_size=25)
    with pa.ipc.new_file(tmp / "c.arrow", rows.schema) as w:      # an Arrow IPC file
        for batch in rows.to_batches(max_chunksize=30):
            w.write_batch(batch)
    ds = tmp / "dataset"                                            # Dataset.save_to_disk's layout (datasets 5):
    ds.mkdir()                                                      # Arrow IPC streams listed in state.json
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for shard, name in zip([rows.slice(0, 50), rows.slice(50)], names):
        with pa.ipc.new_stream(ds / name, rows.schema) as w:
            for batch in shard.to_batches(max_chunksize=20):
                w.write_batch(batch)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": None}))
    (ds / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string", "_type": "Value"}}}))
    shards = tmp / "shards"                                         # a folder of Parquet shards, as FineWeb ships
    (shards / "b").mkdir(parents=True)
    (shards / ".cache").mkdir()
    (shards / ".cache" / "download.lock").write_text("hidden files are not data")
    pq.write_table(rows.slice(0, 70), shards / "a_000.parquet")
    pq.write_table(rows.slice(70), shards / "b" / "b_000.parquet")
    return {"jsonl": plain, "zstd": tmp / "c.jsonl.zst", "parquet": tmp / "c.parquet", "arrow": tmp / "c.arrow",
            "datasets folder": ds, "parquet folder": shards, "parquet glob": str(shards / "**" / "*.parquet")}, plain


def preprocess(inp, prefix, *extra):
    return preprocess_data.main(["--input", str(inp), "--output-prefix", str(prefix), "--log-interval", "0",
                                 "--append-eod", *extra])


def output(prefix, key="text"):
    return Path(f"{prefix}_{key}_document.bin").read_bytes(), Path(f"{prefix}_{key}_document.idx").read_bytes()


def test_every_format_gives_the_tokens_of_its_json_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(preprocess_data, "BATCH_DOCS", 16)       # many batches: the 3 workers interleave
    inputs, plain = corpora(tmp_path)
    keys = ["--json-keys", "text", "title"]
    want = preprocess(plain, tmp_path / "want", *keys)
    assert want["skipped"] == {"non-string 'text'": 1} and want["empty"] == 1
    for name, inp in inputs.items():
        for workers in ("1", "3"):
            got = preprocess(inp, tmp_path / "got", *keys, "--workers", workers)
            for key in ("text", "title"):
                assert output(tmp_path / "got", key) == output(tmp_path / "want", key), (name, workers, key)
            assert (got["documents"], got["skipped"], got["empty"]) == (want["documents"], want["skipped"],
                                                                        want["empty"]), name


def test_list_columns_are_pre_split_documents(tmp_path):
    """A list<string> column is what a JSON list of strings is: one sequence per non-empty string."""
    docs = [["a first sentence", "", "a second"], [], ["one"], None, ["x", None]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"text": pa.array(docs, pa.list_(pa.string()))}), tmp_path / "in.parquet")
    want = preprocess(tmp_path / "in.jsonl", tmp_path / "want")
    got = preprocess(tmp_path / "in.parquet", tmp_path / "got")
    assert output(tmp_path / "got") == output(tmp_path / "want")
    assert got["skipped"] == want["skipped"] == {"non-string 'text'": 2} and got["empty"] == want["empty"] == 1


def test_train_tokenizer_reads_every_format_alike(tmp_path, capsys):
    inputs, plain = corpora(tmp_path)
    models = {}
    for name in ("jsonl", "zstd", "parquet", "arrow", "datasets folder", "parquet folder"):
        model = train_tokenizer.main(["--input", str(inputs[name]), "--model-prefix", str(tmp_path / "tok"),
                                      "--vocab-size", "1100", "--byte-fallback", "--num-threads", "1",
                                      "--log-interval", "40"])
        models[name] = Path(model).read_bytes()
        err = capsys.readouterr().err
        assert "docs/s" in err and "MB/s" in err and "ETA" in err and "\nread: 118 docs" in err, err
    assert all(m == models["jsonl"] for m in models.values()), [n for n, m in models.items() if m != models["jsonl"]]


def test_inputs_are_streamed_not_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(text_input, "ZSTD_READ", 4096)            # small files read as large ones are
    monkeypatch.setattr(columnar, "BATCH_ROWS", 10)
    inputs, _ = corpora(tmp_path)
    for name in ("zstd", "parquet", "arrow", "datasets folder"):
        path = Path(inputs[name])
        path = sorted(path.glob("*.arrow"))[0] if path.is_dir() else path
        kind = {"zstd": None, "parquet": "parquet"}.get(name, "arrow")
        position = Position()
        reader = read_lines(str(path), position) if kind is None else read_records(str(path), kind, ["text"],
                                                                                    position)
        seen = set()
        for _ in reader:
            seen.add(position.done)
        assert len(seen) >= 2 and min(seen) < path.stat().st_size, (name, seen)  # read in pieces, not at once


def test_damaged_and_unreadable_inputs_name_the_file(tmp_path, monkeypatch):
    inputs, _ = corpora(tmp_path)
    data = Path(inputs["zstd"]).read_bytes()
    (tmp_path / "cut.jsonl.zst").write_bytes(data[:-40])          # ends inside its last frame
    with pytest.raises(SystemExit, match=r"cut.jsonl.zst: corrupt or truncated zstd data after \d+ lines"):
        preprocess(tmp_path / "cut.jsonl.zst", tmp_path / "out")
    parquet = Path(inputs["parquet"]).read_bytes()
    (tmp_path / "cut.parquet").write_bytes(parquet[:len(parquet) // 2])
    with pytest.raises(SystemExit, match="cut.parquet: corrupt or truncated Parquet data"):
        preprocess(tmp_path / "cut.parquet", tmp_path / "out")
    assert not list(tmp_path.glob("out*"))
    monkeypatch.setitem(sys.modules, "zstandard", None)             # the optional packages absent
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(InputError, match="c.jsonl.zst: zstd-compressed data needs the zstandard package: pip install"):
        list(read_lines(str(inputs["zstd"])))
    with pytest.raises(SystemExit, match="c.parquet: reading Parquet data needs pyarrow: pip install pyarrow"):
        preprocess(inputs["parquet"], tmp_path / "out")
