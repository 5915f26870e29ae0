"""Data-pipeline benchmark: preprocessing throughput, GPT index build time beside megatron-core's C++
helper, blending.

    python benchmarks/bench_data.py [--corpus data/stdlib.jsonl] [--index-docs 10000000] [--repeats 3]
                                    [--out-dir DIR | --record]

1. Preprocessing: tools/preprocess_data.py on the stdlib corpus (built with tools/build_corpus.py
   when --corpus is not given) at 1 and 2 workers, with the byte tokenizer and with a sentencepiece
   BPE model trained on the same corpus by tools/train_tokenizer.py.
2. Index build for a synthetic dataset given only by its document lengths (default 10M documents of
   1..1999 tokens, about 10 billion tokens, seq_len 4096, one epoch): the document, sample and shuffle
   indices, whole and stage by stage. When megatron-core's compiled helper is importable
   (`megatron.core.datasets.helpers_cpp`, or a `helpers_cpp` module on PYTHONPATH built from
   megatron/core/datasets/helpers.cpp), megatron-core's own path is timed beside ours, stage by stage
   (numpy RandomState shuffles of the documents and of the samples around the C++ build_sample_idx),
   after checking that both sample indices are equal. Each timing is the best of --repeats runs, ours
   and megatron-core's interleaved. Also: the cache-key hash, the cache write, the mmap reload.
3. Blending: blend indices for millions of samples.
Prints a markdown table; with --out-dir (or --record: benchmarks/results/) writes the numbers as data.json.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, output_dir, write_text  # noqa: E402
from megalysses.data.blend import blend_indices  # noqa: E402
from megalysses.data.cache import cached_arrays, hash_key  # noqa: E402
from megalysses.data.gpt_dataset import build_gpt_indices, sample_index, shuffle_samples, shuffled_documents  # noqa: E402
from megalysses.tools import build_corpus, preprocess_data, train_tokenizer  # noqa: E402


def megatron_helper() -> Optional[Any]:
    """megatron-core's compiled helpers module, or None when it is not importable."""
    for name in ("megatron.core.datasets.helpers_cpp", "helpers_cpp"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "build_sample_idx_int32"):
            return module
    return None


def best_of(repeats: int, *fns: Callable[[], Any]) -> list[float]:
    """The best wall time of each function over `repeats` rounds, the functions interleaved in each round."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def bench_preprocess(corpus: str, work: Path, vocab_size: int) -> list[dict]:
    start = time.time()
    with contextlib.redirect_stderr(io.StringIO()):
        model = train_tokenizer.main(["--input", corpus, "--model-prefix", str(work / "sp"),
                                      "--vocab-size", str(vocab_size), "--byte-fallback"])
    rows = [{"name": f"train sentencepiece BPE (vocab {vocab_size})", "seconds": time.time() - start}]
    for kind, extra in (("byte", []), ("sentencepiece", ["--tokenizer-model", model])):
        for workers in (1, 2):
            with contextlib.redirect_stderr(io.StringIO()):
                r = preprocess_data.main(["--input", corpus, "--output-prefix", str(work / f"{kind}{workers}"),
                                          "--append-eod", "--workers", str(workers), "--tokenizer-type", kind,
                                          "--log-interval", "100000000", *extra])
            rows.append({"name": f"preprocess {kind}, {workers} worker(s)", "seconds": r["seconds"],
                         "tokens": r["tokens"], "tokens_per_s": r["tokens"] / r["seconds"],
                         "mb_per_s": r["bytes"] / r["seconds"] / 1e6, "documents": r["documents"]})
    return rows


def bench_index(num_docs: int, seq_len: int, work: Path, repeats: int) -> list[dict]:
    lengths = np.random.default_rng(0).integers(1, 2000, size=num_docs).astype(np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    num_samples = (tokens - 1) // seq_len
    helper = megatron_helper()
    doc, stream = shuffled_documents(lengths, 0, 1, np.random.default_rng(1234))

    # ours, stage by stage, as build_gpt_indices runs them
    def ours_documents() -> tuple:
        return shuffled_documents(lengths, 0, 1, np.random.default_rng(1234))

    def ours_samples() -> np.ndarray:
        return sample_index(stream, seq_len, num_samples)

    def ours_samples_from_order() -> np.ndarray:     # given only the document order, as the helper is
        return sample_index(np.take(lengths, doc), seq_len, num_samples)

    def ours_shuffle() -> np.ndarray:
        return shuffle_samples(num_samples, seq_len, tokens, 1, np.random.default_rng(1))

    def ours_full() -> dict:
        return build_gpt_indices(lengths, 0, seq_len, seed=1234, num_epochs=1)

    # megatron-core's GPTDataset path for one epoch: numpy RandomState shuffles around the C++ helper
    def megatron_documents() -> np.ndarray:
        order = np.arange(num_docs, dtype=np.int32)
        np.random.RandomState(1234).shuffle(order)
        return order

    def megatron_samples() -> np.ndarray:
        return helper.build_sample_idx_int32(lengths, doc, seq_len, 1, tokens, True, 1)

    def megatron_shuffle() -> np.ndarray:
        order = np.arange(num_samples, dtype=np.uint32)
        np.random.RandomState(1).shuffle(order)
        return order

    def megatron_full() -> tuple:
        state = np.random.RandomState(1234)
        order = np.arange(num_docs, dtype=np.int32)
        state.shuffle(order)
        sample = helper.build_sample_idx_int32(lengths, order, seq_len, 1, tokens, True, 1)
        shuffle = np.arange(len(sample) - 1, dtype=np.uint32)
        state.shuffle(shuffle)
        return order, sample, shuffle

    stages = [("document + sample + shuffle indices", ours_full, megatron_full),
              ("  1. document order (and, ours, the lengths in stream order)", ours_documents, megatron_documents),
              ("  2. sample index from stage 1 (megatron-core: the C++ build_sample_idx)", ours_samples,
               megatron_samples),
              ("  2'. sample index from the document order alone (a gather of the lengths first)",
               ours_samples_from_order, megatron_samples),
              ("  3. sample shuffle", ours_shuffle, megatron_shuffle)]
    if helper is not None:   # the same rows, or no comparison
        np.testing.assert_array_equal(ours_samples(), megatron_samples())
    rows = []
    what = f"{tokens / 1e9:.2f}B tokens, {num_docs:,} docs, seq_len {seq_len} -> {num_samples:,} samples"
    for name, ours, theirs in stages:
        times = best_of(repeats, ours, theirs) if helper is not None else best_of(repeats, ours) + [None]
        rows.append({"name": name + (f": {what}" if not name.startswith(" ") else ""), "seconds": times[0],
                     "peer_seconds": times[1]})
    rows[0]["tokens_per_s"] = tokens / rows[0]["seconds"]
    key = {"lengths": lengths, "seq_len": seq_len, "seed": 1234, "num_epochs": 1}
    start = time.perf_counter()
    hash_key(key)
    rows.append({"name": f"hash {num_docs:,} document lengths (cache key)", "seconds": time.perf_counter() - start})
    arrays = ours_full()
    cache = str(work / "cache")
    start = time.perf_counter()
    cached_arrays(cache, "bench", key, lambda: arrays, ["doc", "sample", "shuffle"])
    rows.append({"name": "write the cache (tmp file + os.replace)", "seconds": time.perf_counter() - start})
    start = time.perf_counter()
    loaded = cached_arrays(cache, "bench", key, lambda: {}, ["doc", "sample", "shuffle"])
    assert all(np.array_equal(loaded[k][:1000], arrays[k][:1000]) for k in arrays)
    rows.append({"name": "load the cache (hash + mmap)", "seconds": time.perf_counter() - start})
    rows.append({"name": "process peak RSS (GiB)",
                 "value": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
    return rows


def bench_blend() -> list[dict]:
    rows = []
    for weights, size in (([0.7, 0.3], 10_000_000), ([0.5, 0.2, 0.15, 0.1, 0.05], 2_000_000)):
        start = time.perf_counter()
        blend_indices(weights, size)
        rows.append({"name": f"blend {len(weights)} datasets, {size:,} samples",
                     "seconds": time.perf_counter() - start})
    return rows


def table(rows: list[dict], peer: bool) -> str:
    head = "| measurement | seconds |" + (" megatron-core (C++ helper) |" if peer else "") + " tokens/s | MB/s |"
    lines = [head, "|---|---:|" + ("---:|" if peer else "") + "---:|---:|"]
    for r in rows:
        secs = f"{r['seconds']:.3f}" if "seconds" in r else f"{r['value']:.2f} (value)"
        other = f" {r['peer_seconds']:.3f} |" if r.get("peer_seconds") is not None else " |"
        tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else ""
        mbs = f"{r['mb_per_s']:.1f}" if "mb_per_s" in r else ""
        lines.append(f"| {r['name']} | {secs} |" + (other if peer else "") + f" {tps} | {mbs} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=None, help="jsonl corpus (default: build the stdlib corpus in a temp dir)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--index-docs", type=int, default=10_000_000)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3, help="index timings: best of this many interleaved runs")
    p.add_argument("--skip-preprocess", action="store_true", help="only the index and blend measurements")
    add_output_args(p)
    args = p.parse_args()
    folder = output_dir(p, args)
    load = os.getloadavg()[0]   # other work on the machine inflates every timing; recorded with them
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = args.corpus
        rows: list[dict] = []
        if not args.skip_preprocess:
            if corpus is None:
                corpus = str(work / "stdlib.jsonl")
                with contextlib.redirect_stderr(io.StringIO()):
                    build_corpus.main(["--stdlib", "--output", corpus])
            rows += bench_preprocess(corpus, work, args.vocab_size)
        rows += bench_index(args.index_docs, args.seq_len, work, args.repeats)
        rows += bench_blend()
        helper = megatron_helper()
        info = {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
                "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                "megatron_helper": "imported" if helper is not None else "not importable",
                "load_average_at_start": round(load, 2), "load_average_at_end": round(os.getloadavg()[0], 2),
                "corpus": None if args.skip_preprocess else
                (Path(args.corpus).name if args.corpus else "stdlib (tools/build_corpus.py --stdlib)"),
                "corpus_mb": None if args.skip_preprocess else os.path.getsize(corpus) / 1e6}
    print(f"corpus: {info['corpus']}, {info['corpus_mb'] or 0:.1f} MB jsonl; {info['cpus']} CPUs, Python "
          f"{info['python']}, numpy {info['numpy']}; megatron-core helper {info['megatron_helper']}; load average "
          f"{info['load_average_at_start']} -> {info['load_average_at_end']}")
    print(table(rows, helper is not None))
    if folder is not None:
        out = write_text(folder, "data.json", json.dumps({"info": info, "rows": rows}, indent=2))
        print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
