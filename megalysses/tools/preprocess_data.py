"""Tokenize jsonl (plain or .gz) or a folder of text files into Megatron-format .bin/.idx datasets.

    python tools/preprocess_data.py --input data/stdlib.jsonl --output-prefix data/stdlib \\
        --tokenizer-type byte --append-eod --workers 2
    # -> data/stdlib_text_document.bin / .idx (one per --json-keys entry)

Each jsonl line is one document; a folder gives one document per file (key "text"). Lines that are
not JSON, lack a key or hold a non-string are skipped, counted and reported at the end (a line is
skipped whole, so the per-key outputs stay aligned). Output is byte-identical for any --workers:
batches are formed by the reader and written in input order. Files are written under temporary
names and renamed at the very end, the .idx last, so an interrupted run never leaves a dataset that
looks complete.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from megalysses.data.indexed import IndexedDatasetBuilder, bin_path, idx_path, optimal_dtype
from megalysses.data.tokenizer import ByteTokenizer, build_tokenizer

BATCH_BYTES = 1 << 20
BATCH_DOCS = 1024
_STATE: dict[str, Any] = {}


def _init_worker(kind: str, model: Optional[str], keys: list[str], append_eod: bool, folder: bool) -> None:
    tok = build_tokenizer(kind, model)
    _STATE.update(tok=tok, keys=keys, append_eod=append_eod, folder=folder,
                  dtype=optimal_dtype(tok.vocab_size))


def _parse(raw: bytes, keys: list[str], folder: bool) -> tuple[Optional[list[str]], Optional[str]]:
    """The texts of one document, or (None, reason it is malformed)."""
    try:
        if folder:
            return [raw.decode("utf-8")], None
        if not raw.strip():
            return None, "blank line"
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, "not UTF-8" if folder else "bad JSON"
    if not isinstance(doc, dict):
        return None, "not a JSON object"
    texts = []
    for key in keys:
        if key not in doc:
            return None, f"missing key '{key}'"
        if not isinstance(doc[key], str):
            return None, f"non-string '{key}'"
        texts.append(doc[key])
    return texts, None


def encode_batch(batch: tuple[int, list[bytes], int]) -> dict[str, Any]:
    """Tokenize one batch of raw documents: per key the concatenated tokens and document lengths."""
    first_line, items, position = batch
    tok, keys, dtype = _STATE["tok"], _STATE["keys"], _STATE["dtype"]
    eod = [tok.eod_id] if _STATE["append_eod"] else []
    texts: list[list[str]] = [[] for _ in keys]
    skipped: collections.Counter = collections.Counter()
    examples = []
    for i, raw in enumerate(items):
        parsed, reason = _parse(raw, keys, _STATE["folder"])
        if parsed is None:
            skipped[reason] += 1
            examples.append(f"{first_line + i}: {reason}")
            continue
        for k, text in enumerate(parsed):
            texts[k].append(text)
    out: dict[str, Any] = {"skipped": skipped, "examples": examples[:5], "bytes": sum(map(len, items)),
                           "position": position}
    for k, key in enumerate(keys):
        if isinstance(tok, ByteTokenizer):
            pieces = [np.frombuffer(tok.encode_bytes(t), np.uint8) for t in texts[k]]
        else:
            pieces = [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(texts[k])]
        lengths = np.array([len(p) + len(eod) for p in pieces], dtype=np.int32)
        if eod:
            eod_arr = np.asarray(eod, dtype=dtype)
            pieces = [x for p in pieces for x in (p, eod_arr)]
        tokens = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)
        out[key] = (tokens, lengths)
    return out


class _Reader:
    """Batches of raw documents with the input position reached, for progress and ETA."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.folder = os.path.isdir(path)
        if self.folder:
            self.files = sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
            self.total = sum(os.path.getsize(f) for f in self.files)
        elif os.path.isfile(path):
            self.total = os.path.getsize(path)
        else:
            raise SystemExit(f"error: --input {path}: no such file or directory")
        self.position = 0

    def _documents(self) -> Iterator[bytes]:
        if self.folder:
            for f in self.files:
                data = Path(f).read_bytes()
                self.position += os.path.getsize(f)
                yield data
            return
        with open(self.path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if self.path.endswith(".gz") else raw
            for line in stream:
                self.position = raw.tell()
                yield line

    def batches(self) -> Iterator[tuple[int, list[bytes], int]]:
        """(number of the first document, raw documents, input position after them)."""
        batch: list[bytes] = []
        size, line = 0, 1
        for doc in self._documents():
            batch.append(doc)
            size += len(doc)
            if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
                yield line, batch, self.position
                line += len(batch)
                batch, size = [], 0
        if batch:
            yield line, batch, self.position


def _ordered_results(reader: _Reader, args: argparse.Namespace, init_args: tuple) -> Iterator[dict[str, Any]]:
    """encode_batch over the reader's batches, in order; at most 4 batches per worker in flight."""
    if args.workers <= 1:
        _init_worker(*init_args)
        for batch in reader.batches():
            yield encode_batch(batch)
        return
    with mp.get_context("fork").Pool(args.workers, _init_worker, init_args) as pool:
        in_flight: collections.deque = collections.deque()
        for batch in reader.batches():
            in_flight.append(pool.apply_async(encode_batch, (batch,)))
            if len(in_flight) >= 4 * args.workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


def _progress(start: float, docs: int, nbytes: int, tokens: int, position: int, total: int, final: bool) -> None:
    elapsed = max(time.time() - start, 1e-9)
    line = (f"{docs:,} docs | {docs / elapsed:,.0f} docs/s | {nbytes / elapsed / 1e6:,.2f} MB/s | "
            f"{tokens / elapsed:,.0f} tokens/s")
    if total and not final:
        frac = min(position / total, 1.0)
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
        line += f" | {100 * frac:.1f}% | ETA {eta:,.0f}s"
    print(("done: " if final else "") + line + f" | {elapsed:,.1f}s", file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="a .jsonl / .jsonl.gz file, or a folder of text files")
    p.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl keys to tokenize (default: text)")
    p.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (output is identical for any)")
    p.add_argument("--tokenizer-type", choices=["byte", "sentencepiece"], default="byte")
    p.add_argument("--tokenizer-model", default=None, help="sentencepiece .model file")
    p.add_argument("--log-interval", type=float, default=2.0, help="seconds between progress lines")
    args = p.parse_args(argv)

    reader = _Reader(args.input)
    if reader.folder and len(args.json_keys) != 1:
        raise SystemExit("error: a folder input gives one text per file: pass a single --json-keys name")
    tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    dtype = optimal_dtype(tok.vocab_size)
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    finals = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    tag = f".tmp-{os.getpid()}"
    builders = {k: IndexedDatasetBuilder(bin_path(f) + tag, dtype) for k, f in finals.items()}
    docs = tokens = nbytes = 0
    skipped: collections.Counter = collections.Counter()
    examples: list[str] = []
    start = last = time.time()
    init_args = (args.tokenizer_type, args.tokenizer_model, args.json_keys, args.append_eod, reader.folder)
    try:
        for result in _ordered_results(reader, args, init_args):
            for key, builder in builders.items():
                builder.add_documents(*result[key])
            first = result[args.json_keys[0]]
            docs += len(first[1])
            tokens += sum(len(result[k][0]) for k in args.json_keys)
            nbytes += result["bytes"]
            skipped.update(result["skipped"])
            examples += result["examples"][:5 - len(examples)]
            if time.time() - last >= args.log_interval:
                _progress(start, docs, nbytes, tokens, result["position"], reader.total, final=False)
                last = time.time()
        for key, builder in builders.items():
            builder.finalize(idx_path(finals[key]) + tag)
        for final in finals.values():
            if os.path.exists(idx_path(final)):
                os.remove(idx_path(final))
            os.replace(bin_path(final) + tag, bin_path(final))
            os.replace(idx_path(final) + tag, idx_path(final))
    finally:
        for key, builder in builders.items():
            builder.close()
            for path in (bin_path(finals[key]) + tag, idx_path(finals[key]) + tag):
                if os.path.exists(path):
                    os.remove(path)
    _progress(start, docs, nbytes, tokens, reader.position, reader.total, final=True)
    if skipped:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
        print(f"skipped {sum(skipped.values())} malformed documents ({reasons}); first: {'; '.join(examples)}",
              file=sys.stderr)
    for final in finals.values():
        print(f"wrote {bin_path(final)} and {idx_path(final)}", file=sys.stderr)
    return {"documents": docs, "tokens": tokens, "bytes": nbytes, "skipped": dict(skipped),
            "seconds": time.time() - start, "outputs": list(finals.values())}


def cli() -> int:
    """Console entry point: exit status 0 once main() has written its output."""
    main()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
