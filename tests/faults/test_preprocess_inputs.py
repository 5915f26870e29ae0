"""Legal preprocess inputs that once went wrong without a word: gzip data whose name does not say so
(it gave an empty dataset and exit 0) is read as gzip, and documents that tokenize to nothing are
written as Megatron-LM writes them, with one warning."""
import gzip
import json
from pathlib import Path

from megalysses.data.indexed import IndexedDataset
from megalysses.tools import preprocess_data

DOCS = [f"document {i}: some text" for i in range(12)]


def _preprocess(inp: Path, prefix: Path) -> dict:
    return preprocess_data.main(["--input", str(inp), "--output-prefix", str(prefix), "--log-interval", "0",
                                 "--append-eod"])


def _ids(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(f"{prefix}_text_document")
    return [ds[i].tolist() for i in range(len(ds))]


def test_gzip_data_without_gz_suffix_is_read_as_gzip(tmp_path):
    text = "".join(json.dumps({"text": d}) + "\n" for d in DOCS)
    (tmp_path / "plain.jsonl").write_text(text)
    (tmp_path / "packed.jsonl").write_bytes(gzip.compress(text.encode()))     # gzip bytes, a .jsonl name
    _preprocess(tmp_path / "plain.jsonl", tmp_path / "plain")
    result = _preprocess(tmp_path / "packed.jsonl", tmp_path / "packed")
    assert result["documents"] == len(DOCS) and result["skipped"] == {}
    assert _ids(tmp_path / "packed") == _ids(tmp_path / "plain")
    assert _ids(tmp_path / "plain")[3] == list(DOCS[3].encode()) + [257]       # byte tokenizer, then the EOD


def test_empty_documents_are_written_with_one_warning(tmp_path, capsys):
    docs = DOCS[:4] + ["", ""] + DOCS[4:6]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    result = _preprocess(tmp_path / "in.jsonl", tmp_path / "out")
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "2 documents are empty after tokenization (first: document 5)" in warnings[0], err
    # (documents count from 1, as the lines of the input do)
    assert "error" not in err.lower()
    assert result["documents"] == len(docs) and result["empty"] == 2
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert ds.num_documents == len(docs) and len(ds) == len(docs) - 2    # two documents of no sequences
    assert ds.document_indices[4] == ds.document_indices[5] == ds.document_indices[6] == 4
    assert ds[4].tolist() == list(DOCS[4].encode()) + [257]
