"""Data-pipeline benchmark: preprocessing throughput and GPT index build time.

    python benchmarks/bench_data.py [--corpus data/stdlib.jsonl] [--index-docs 10000000] \
        [--json benchmarks/results/data.json]

1. Preprocessing: tools/preprocess_data.py on the stdlib corpus (built with tools/build_corpus.py
   when --corpus is not given) at 1 and 2 workers, with the byte tokenizer and with a sentencepiece
   BPE model trained on the same corpus by tools/train_tokenizer.py.
2. Index build: document, sample and shuffle indices for a synthetic dataset given only by its
   document lengths (default 10M documents of 1..1999 tokens, about 10 billion tokens, seq_len 4096),
   plus the cache-key hash, the cache write and the mmap reload.
3. Blending: blend indices for millions of samples.
Prints a markdown table and writes the numbers as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from megalysses.data.blend import blend_indices
from megalysses.data.cache import cached_arrays, hash_key
from megalysses.data.gpt_dataset import build_gpt_indices

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # preprocessing workers look functions up by module name
    spec.loader.exec_module(module)
    return module


def bench_preprocess(corpus: str, work: Path, vocab_size: int) -> list[dict]:
    preprocess = load_tool("preprocess_data")
    start = time.time()
    model = load_tool("train_tokenizer").main(["--input", corpus, "--model-prefix", str(work / "sp"),
                                               "--vocab-size", str(vocab_size), "--byte-fallback"])
    rows = [{"name": f"train sentencepiece BPE (vocab {vocab_size})", "seconds": time.time() - start}]
    for kind, extra in (("byte", []), ("sentencepiece", ["--tokenizer-model", model])):
        for workers in (1, 2):
            with contextlib.redirect_stderr(io.StringIO()):
                r = preprocess.main(["--input", corpus, "--output-prefix", str(work / f"{kind}{workers}"),
                                     "--append-eod", "--workers", str(workers), "--tokenizer-type", kind, *extra])
            rows.append({"name": f"preprocess {kind}, {workers} worker(s)", "seconds": r["seconds"],
                         "tokens": r["tokens"], "tokens_per_s": r["tokens"] / r["seconds"],
                         "mb_per_s": r["bytes"] / r["seconds"] / 1e6, "documents": r["documents"]})
    return rows


def bench_index(num_docs: int, seq_len: int, work: Path) -> list[dict]:
    lengths = np.random.default_rng(0).integers(1, 2000, size=num_docs).astype(np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    rows = []
    start = time.time()
    key = {"lengths": lengths, "seq_len": seq_len, "seed": 1234, "num_epochs": 1}
    hash_key(key)
    rows.append({"name": f"hash {num_docs:,} document lengths (cache key)", "seconds": time.time() - start})
    start = time.time()
    arrays = build_gpt_indices(lengths, 0, seq_len, seed=1234, num_epochs=1)
    build_s = time.time() - start
    rows.append({"name": f"build doc/sample/shuffle indices: {tokens / 1e9:.2f}B tokens, {num_docs:,} docs, "
                         f"seq_len {seq_len} -> {len(arrays['shuffle']):,} samples",
                 "seconds": build_s, "tokens_per_s": tokens / build_s})
    cache = str(work / "cache")
    start = time.time()
    cached_arrays(cache, "bench", key, lambda: arrays, ["doc", "sample", "shuffle"])
    rows.append({"name": "write the cache (tmp file + os.replace)", "seconds": time.time() - start})
    start = time.time()
    loaded = cached_arrays(cache, "bench", key, lambda: {}, ["doc", "sample", "shuffle"])
    assert all(np.array_equal(loaded[k][:1000], arrays[k][:1000]) for k in arrays)
    rows.append({"name": "load the cache (hash + mmap)", "seconds": time.time() - start})
    rows.append({"name": "process peak RSS (GiB)",
                 "value": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
    return rows


def bench_blend() -> list[dict]:
    rows = []
    for weights, size in (([0.7, 0.3], 10_000_000), ([0.5, 0.2, 0.15, 0.1, 0.05], 2_000_000)):
        start = time.time()
        blend_indices(weights, size)
        rows.append({"name": f"blend {len(weights)} datasets, {size:,} samples", "seconds": time.time() - start})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| measurement | seconds | tokens/s | MB/s |", "|---|---:|---:|---:|"]
    for r in rows:
        secs = f"{r['seconds']:.2f}" if "seconds" in r else f"{r['value']:.2f} (value)"
        tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else ""
        mbs = f"{r['mb_per_s']:.1f}" if "mb_per_s" in r else ""
        lines.append(f"| {r['name']} | {secs} | {tps} | {mbs} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=None, help="jsonl corpus (default: build the stdlib corpus in a temp dir)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--index-docs", type=int, default=10_000_000)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--json", default="benchmarks/results/data.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = args.corpus
        if corpus is None:
            corpus = str(work / "stdlib.jsonl")
            with contextlib.redirect_stderr(io.StringIO()):
                load_tool("build_corpus").main(["--stdlib", "--output", corpus])
        rows = bench_preprocess(corpus, work, args.vocab_size)
        rows += bench_index(args.index_docs, args.seq_len, work)
        rows += bench_blend()
        info = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
                "corpus": args.corpus or "stdlib (tools/build_corpus.py --stdlib)",
                "corpus_mb": os.path.getsize(corpus) / 1e6}
    print(f"corpus: {info['corpus']}, {info['corpus_mb']:.1f} MB jsonl; {info['cpus']} CPUs, Python {info['python']}")
    print(table(rows))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    print(f"\nwrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
