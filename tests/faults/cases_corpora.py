"""Bad zstd, Parquet, Arrow and `datasets` inputs given to tools/preprocess_data.py and tools/train_tokenizer.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from tests.faults.cases_preprocess import GOOD, LINES, folder, jsonl, preprocess
from tests.faults.cases_tokenizer import train
from tests.faults.corpus import Case

ROWS = [json.loads(line) for line in LINES]


def parquet(rows: list[dict] = ROWS, name: str = "in.parquet", cut: int = 0, schema: dict | None = None
            ) -> Callable[[Path], str]:
    def build(tmp: Path) -> str:
        import pyarrow as pa
        import pyarrow.parquet as pq
        columns = {k: [r[k] for r in rows] for k in (schema or rows[0])}
        table = pa.table({k: pa.array(v, (schema or {}).get(k)) for k, v in columns.items()})
        pq.write_table(table, tmp / name, row_group_size=5)
        if cut:
            data = (tmp / name).read_bytes()
            (tmp / name).write_bytes(data[:-cut])
        return str(tmp / name)
    return build


def dataset(state: bytes | None = None, drop_shard: bool = False, splits: bool = False) -> Callable[[Path], str]:
    """A `datasets` folder as Dataset.save_to_disk writes it (two Arrow streams), or a DatasetDict of them."""
    def build(tmp: Path) -> str:
        import pyarrow as pa
        root = tmp / "ds"
        target = root / "train" if splits else root
        target.mkdir(parents=True)
        table = pa.table({"text": [r["text"] for r in ROWS]})
        names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
        for i, name in enumerate(names):
            with pa.ipc.new_stream(target / name, table.schema) as w:
                w.write_table(table.slice(10 * i, 10))
        (target / "dataset_info.json").write_text("{}")
        (target / "state.json").write_bytes(state if state is not None else json.dumps(
            {"_data_files": [{"filename": n} for n in names]}).encode())
        if drop_shard:
            (target / names[1]).unlink()
        if splits:
            (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
        return str(root)
    return build


def arrow_stream_cut(tmp: Path) -> str:
    folder = Path(dataset()(tmp))
    shard = folder / "data-00001-of-00002.arrow"
    shard.write_bytes(shard.read_bytes()[:-100])
    return str(shard)


def zstd(data: bytes, cut: int = 0, flip: bool = False) -> Callable[[Path], str]:
    def build(tmp: Path) -> str:
        import zstandard
        blob = bytearray(zstandard.ZstdCompressor().compress(data))
        if flip:
            blob[len(blob) // 2] ^= 0xFF
        (tmp / "in.jsonl.zst").write_bytes(bytes(blob[:len(blob) - cut]))
        return str(tmp / "in.jsonl.zst")
    return build


def without(module: str, source: Callable[[Path], str]) -> Callable[[Path], int]:
    """preprocess the input source(tmp) as if the optional package `module` were not installed."""
    def run(tmp: Path) -> int:
        path = source(tmp)
        saved = {k: v for k, v in sys.modules.items() if k == module or k.startswith(module + ".")}
        sys.modules[module] = None   # type: ignore[assignment]: import then raises ImportError
        try:
            return preprocess(lambda _: path)(tmp)
        finally:
            del sys.modules[module]
            sys.modules.update(saved)
    return run


def mixed_folder(tmp: Path) -> str:
    root = Path(folder({"README.md": b"# a dataset card"})(tmp))
    parquet(name="texts/shard.parquet")(tmp)
    return str(root)


BIG = GOOD.encode() * 50

CASES = [
    Case("preprocess/parquet_wrong_column", preprocess(parquet(), "--json-keys", "content"), "no column 'content'"),
    Case("preprocess/parquet_number_column", preprocess(parquet(rows=[{"n": i} for i in range(5)])),
         "no column 'text'"),
    Case("preprocess/parquet_non_text_column", preprocess(parquet(rows=[{"text": i} for i in range(5)])),
         "holds int64, not text"),
    Case("preprocess/parquet_empty", preprocess(parquet(rows=[], schema={"text": "string"})), "holds no rows"),
    Case("preprocess/parquet_truncated", preprocess(parquet(cut=40)), "truncated Parquet"),
    Case("preprocess/parquet_named_but_text", preprocess(jsonl(GOOD, "in.parquet"), "--json-keys", "body"),
         "missing key 'body'"),
    Case("preprocess/parquet_without_pyarrow", without("pyarrow", parquet()), "pip install pyarrow"),
    Case("preprocess/arrow_stream_truncated", preprocess(arrow_stream_cut), "truncated Arrow"),
    Case("preprocess/datasets_dict_folder", preprocess(dataset(splits=True)), "pass the folder of one split"),
    Case("preprocess/datasets_folder_lacks_a_shard", preprocess(dataset(drop_shard=True)), "lacks its Arrow files"),
    Case("preprocess/datasets_state_garbage", preprocess(dataset(state=b"{not json")), "state.json"),
    Case("preprocess/datasets_folder_wrong_column", lambda tmp: preprocess(dataset(), "--json-keys", "content")(tmp),
         "no column 'content'"),
    Case("preprocess/folder_mixes_parquet_and_text", preprocess(mixed_folder), "mixes"),
    Case("preprocess/zstd_truncated", preprocess(zstd(BIG, cut=20)), "truncated zstd"),
    Case("preprocess/zstd_corrupt", preprocess(zstd(BIG, flip=True)), "corrupt or truncated zstd"),
    Case("preprocess/zstd_without_zstandard", without("zstandard", zstd(BIG)), "pip install zstandard"),
    Case("tokenizer/parquet_wrong_column", train(parquet(), "--json-key", "body"), "no column 'body'"),
    Case("tokenizer/parquet_empty", train(parquet(rows=[], schema={"text": "string"})), "holds no rows"),
    Case("tokenizer/datasets_dict_folder", train(dataset(splits=True)), "DatasetDict"),
    Case("tokenizer/zstd_truncated", train(zstd(BIG, cut=20)), "truncated zstd"),
    Case("tokenizer/arrow_stream_truncated", train(arrow_stream_cut), "truncated Arrow"),
]
