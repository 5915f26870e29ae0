"""tools/preprocess_data.py and tools/build_corpus.py: identical output for any worker count,
malformed lines skipped and reported, .gz and folder inputs, no complete-looking output on failure."""
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from megalysses.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megalysses.data.tokenizer import build_tokenizer
from megalysses.tools import build_corpus, preprocess_data, train_tokenizer



@pytest.fixture(scope="module")
def preprocess():
    return preprocess_data


def texts(n=60, top=0x2FF):
    rng = np.random.default_rng(0)
    return ["".join(chr(c) for c in rng.integers(32, top, size=rng.integers(0, 200))) + f" doc {i}\n"
            for i in range(n)]


def write_jsonl(path, docs):
    lines = [json.dumps({"text": t, "title": f"t{i}"}) for i, t in enumerate(docs)]
    lines[3:3] = ['{"text": broken', '{"title": "no text"}', '{"text": 17, "title": "x"}', "", "[1, 2]"]
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def run(preprocess, inp, prefix, *extra):
    return preprocess.main(["--input", str(inp), "--output-prefix", str(prefix), "--log-interval", "0", *extra])


def read_bytes(prefix):
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def test_workers_give_identical_output_and_skips_are_reported(tmp_path, preprocess, monkeypatch, capsys):
    monkeypatch.setattr(preprocess, "BATCH_DOCS", 4)  # many batches, so 4 workers really interleave
    docs = texts()
    inp = write_jsonl(tmp_path / "in.jsonl", docs)
    one = run(preprocess, inp, tmp_path / "w1", "--append-eod", "--workers", "1")
    err = capsys.readouterr().err
    four = run(preprocess, inp, tmp_path / "w4", "--append-eod", "--workers", "4")
    assert read_bytes(tmp_path / "w1_text_document") == read_bytes(tmp_path / "w4_text_document")
    assert one["documents"] == four["documents"] == len(docs)
    assert one["skipped"] == {"bad JSON": 1, "missing key 'text'": 1, "non-string 'text'": 1,
                              "blank line": 1, "not a JSON object": 1}
    assert "skipped 5 malformed documents" in err and "4: bad JSON" in err
    # the format does not record the tokenizer: the run says which one to train with
    assert ("tokenized with byte (the default: pass --tokenizer-type for another): 259 ids, EOD 257; "
            f"train with pretrain.py --set 'data.paths=[{tmp_path}/w1_text_document]' --set data.tokenizer=byte "
            "--set model.vocab_size=259 (model.vocab_size may be larger)") in err
    for word in ("docs/s", "MB/s", "tokens/s", "ETA"):
        assert word in err
    ds = IndexedDataset(tmp_path / "w1_text_document")
    assert len(ds) == len(docs)
    for i, text in enumerate(docs):
        assert ds[i].tolist() == list(text.encode()) + [257]


def test_gzip_and_multiple_keys(tmp_path, preprocess):
    docs = texts(20)
    run(preprocess, write_jsonl(tmp_path / "in.jsonl", docs), tmp_path / "plain", "--json-keys", "text", "title")
    run(preprocess, write_jsonl(tmp_path / "in.jsonl.gz", docs), tmp_path / "gz", "--json-keys", "text", "title",
        "--workers", "2")
    for key in ("text", "title"):
        assert read_bytes(tmp_path / f"plain_{key}_document") == read_bytes(tmp_path / f"gz_{key}_document")
    titles = IndexedDataset(tmp_path / "plain_title_document")
    assert [bytes(titles[i].astype(np.uint8)).decode() for i in range(len(titles))] == [f"t{i}" for i in range(20)]


def test_folder_input(tmp_path, preprocess):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second")
    (folder / "a.txt").write_text("first")
    (folder / "sub" / "c.txt").write_text("third ✓")
    (folder / "bad.bin").write_bytes(b"\xff\xfe\x00")
    result = run(preprocess, folder, tmp_path / "f", "--append-eod")
    assert result["skipped"] == {"not UTF-8": 1}
    ds = IndexedDataset(tmp_path / "f_text_document")
    got = [bytes(ds[i][:-1].astype(np.uint8)).decode() for i in range(len(ds))]
    assert got == ["first", "second", "third ✓"]


def test_sentencepiece_output_identical_across_workers(tmp_path, preprocess, monkeypatch, capsys):
    monkeypatch.setattr(preprocess, "BATCH_DOCS", 8)
    inp = write_jsonl(tmp_path / "in.jsonl", texts(80, top=0x7F) + ["ünïcødé ✓"])
    model = train_tokenizer.main(["--input", inp, "--model-prefix", str(tmp_path / "sp"),
                                               "--vocab-size", "500", "--byte-fallback", "--num-threads", "1"])
    args = ["--tokenizer-type", "sentencepiece", "--tokenizer-model", model, "--append-eod"]
    run(preprocess, inp, tmp_path / "s1", *args, "--workers", "1")
    assert (f"--set data.tokenizer=sentencepiece --set data.tokenizer_model={model} --set model.vocab_size=500"
            in capsys.readouterr().err)
    run(preprocess, inp, tmp_path / "s3", *args, "--workers", "3")
    assert read_bytes(tmp_path / "s1_text_document") == read_bytes(tmp_path / "s3_text_document")
    assert IndexedDataset(tmp_path / "s1_text_document").dtype == np.uint16
    # the tokenizer that wrote it, recorded beside it: its type, model file and the file's hash, ids, EOD
    recorded = json.loads(Path(f"{tmp_path}/s1_text_document.tokenizer.json").read_text())
    tok = build_tokenizer("sentencepiece", model)
    assert recorded == {"version": 1, "type": "sentencepiece", "vocab_size": 500, "eod": tok.eod_id, "bos": tok.bos_id,
                        "files": [{"name": "sp.model", "sha256": hashlib.sha256(Path(model).read_bytes()).hexdigest()}]}
    run(preprocess, inp, tmp_path / "s1", "--append-eod")                   # written again, by another tokenizer
    assert json.loads(Path(f"{tmp_path}/s1_text_document.tokenizer.json").read_text())["type"] == "byte"


def test_interrupted_run_leaves_nothing_that_looks_complete(tmp_path, preprocess, monkeypatch):
    inp = write_jsonl(tmp_path / "in.jsonl", texts(10))

    def interrupted(self, idx_file):
        raise KeyboardInterrupt

    monkeypatch.setattr(IndexedDatasetBuilder, "finalize", interrupted)
    with pytest.raises(SystemExit, match="error: interrupted: nothing was written"):
        run(preprocess, inp, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_sigterm_ends_with_one_line_and_no_temporary_files(tmp_path):
    """SIGTERM (a scheduler, a `kill`) in the middle of a run with worker processes: one error line, no
    traceback from the main process or the workers, and the temporary outputs removed."""
    inp = write_jsonl(tmp_path / "in.jsonl", texts(200))
    script = ("import sys, time\n"
              "from megalysses.data.indexed import IndexedDatasetBuilder\n"
              "from megalysses.tools import preprocess_data\n"
              "add = IndexedDatasetBuilder.add_documents\n"
              "def slow(self, *a):\n"
              "    add(self, *a)\n"
              "    print('WRITING', file=sys.stderr, flush=True)\n"
              "    time.sleep(60)\n"
              "IndexedDatasetBuilder.add_documents = slow\n"
              "preprocess_data.main(sys.argv[1:])\n")
    p = subprocess.Popen([sys.executable, "-c", script, "--input", inp, "--output-prefix", str(tmp_path / "out"),
                          "--workers", "2", "--append-eod"], stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "WRITING" in p.stderr.readline()
    assert any(n.startswith("out_text_document.tmp-") for n in os.listdir(tmp_path))
    p.send_signal(signal.SIGTERM)
    err = p.stderr.read()
    assert p.wait(timeout=60) == 1
    said = ("error: stopped by SIGTERM: nothing was written (no temporary file is left; the outputs of an earlier "
            "run, if any, are as they were)")
    assert err.strip().splitlines() == [said], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_build_corpus_stdlib(tmp_path):
    result = build_corpus.main(["--stdlib", "--exclude-tests", "--output", str(tmp_path / "c.jsonl")])
    rows = [json.loads(line) for line in open(tmp_path / "c.jsonl", encoding="utf-8")]
    assert len(rows) == result["documents"] > 500
    assert result["empty"] > 0 and all(r["text"].strip() for r in rows)     # empty __init__.py files left out
    paths = [r["path"] for r in rows]
    assert paths == sorted(paths) and "json/decoder.py" in paths
    assert not any("site-packages" in p or p.startswith("test/") for p in paths)
    root = Path(sysconfig.get_paths()["stdlib"])
    row = rows[paths.index("json/decoder.py")]
    assert row["text"] == (root / "json" / "decoder.py").read_text(encoding="utf-8")


@pytest.mark.parametrize("name,compress", [("in.jsonl", gzip.compress), ("in.jsonl.bz2", __import__("bz2").compress),
                                           ("in.xz", __import__("lzma").compress)])
def test_compressed_input_is_recognised_by_its_bytes(tmp_path, preprocess, name, compress):
    docs = texts(12)
    plain = write_jsonl(tmp_path / "plain.jsonl", docs)
    (tmp_path / name).write_bytes(compress(open(plain, "rb").read()))
    run(preprocess, plain, tmp_path / "a")
    run(preprocess, tmp_path / name, tmp_path / "b")
    assert read_bytes(tmp_path / "a_text_document") == read_bytes(tmp_path / "b_text_document")


def test_glob_input_list_documents_and_bos(tmp_path, preprocess):
    for i in range(3):
        (tmp_path / f"shard_{i}.jsonl").write_text(json.dumps({"text": [f"s{i}a", "", f"s{i}b"]}) + "\n"
                                                   + json.dumps({"text": f"doc{i}"}) + "\n")
    result = run(preprocess, tmp_path / "shard_*.jsonl", tmp_path / "g", "--append-eod", "--bos", "256")
    ds = IndexedDataset(tmp_path / "g_text_document")
    assert result["documents"] == 6 and ds.num_documents == 6 and len(ds) == 9   # 2 sentences + 1 per shard
    assert ds[0].tolist() == [256] + list(b"s0a") and ds[1].tolist() == list(b"s0b") + [257]
    assert ds[2].tolist() == [256] + list(b"doc0") + [257]


def test_refused_run_leaves_no_files(tmp_path, preprocess, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"title": "a"}\n{"title": "b"}\n')
    with pytest.raises(SystemExit, match="missing key 'text'.*keys are title"):
        run(preprocess, inp, tmp_path / "out", "--partitions", "2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
