"""Tokenize JSON Lines (plain, gzip, bz2, xz or zstd), Parquet, Arrow, a Hugging Face `datasets` folder or a
folder of text files into Megatron-format .bin/.idx.

    python tools/preprocess_data.py --input data/stdlib.jsonl --output-prefix data/stdlib \\
        --tokenizer-type byte --append-eod --workers 2
    # -> data/stdlib_text_document.bin / .idx (one pair per --json-keys entry)
    python tools/preprocess_data.py --input 'fineweb/data/**/*.parquet' --output-prefix data/fineweb ...
    python tools/preprocess_data.py --chat --input chats.jsonl --output-prefix data/chats --tokenizer-type \
        huggingface --tokenizer-model models/Qwen2.5-0.5B-Instruct     # conversations: preprocess_chat.py

--input is a file, a glob or a folder. Files are JSON Lines unless their bytes say Parquet or Arrow
(needs pyarrow; zstd needs zstandard); --json-keys names the keys or columns to tokenize, read in
record batches, never whole files. A `datasets` folder (save_to_disk) is read as its Arrow files, a
folder of Parquet, Arrow or .jsonl files as those, any other folder as one text document per file.
The same documents give the same bytes whatever their format.

Megatron-LM's tools/preprocess_data.py command lines run unchanged and write the same bytes:
--tokenizer-type HuggingFaceTokenizer / SentencePieceTokenizer / GPTSentencePieceTokenizer /
Llama2Tokenizer / GPT2BPETokenizer (--vocab-file, --merge-file) / NullTokenizer (--vocab-size), and
--json-keys, --append-eod, --workers, --partitions (documents dealt to partitions round-robin, or in
blocks with --keep-sequential-samples, then merged in partition order), --log-interval (documents),
--keep-newlines and --lang (they only act with --split-sentences, as in Megatron-LM). Flags that
cannot be honoured (--split-sentences, --find-optimal-num-workers, slow or remote-code Hugging Face
tokenizers, ...) are refused with the reason.

Special tokens spelled in a document's text (a source file that contains `<|endoftext|>`) are tokenized as
text, for every tokenizer type, as Megatron-LM's tool does with GPT2BPETokenizer, GPTSentencePieceTokenizer
and Llama2Tokenizer: the data never gains a document boundary or a control token that its text only spelled.
--parse-special-tokens makes them the tokens instead, as Hugging Face tokenizers do (Megatron-LM's
HuggingFaceTokenizer: with it, its bytes). The summary counts the documents whose text spells one.

As in Megatron-LM, a document whose text is empty after tokenization is an empty document: a
document boundary with no tokens and no EOD; a JSON list of strings is a pre-split document, one
sequence per non-empty string. Lines that are not JSON, lack a key or hold a non-string are skipped,
counted and reported (a line is skipped whole, so the per-key outputs stay aligned); empty documents
are counted and reported. A run that would write no tokens is refused. Output is byte-identical for
any --workers. Files are written under temporary names and renamed at the very end, the .idx last; beside
each dataset, PREFIX.tokenizer.json records the tokenizer that wrote it (its type, files and their sha256,
ids, EOD), which training compares with its own (docs/DATA_FORMAT.md).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import multiprocessing as mp
import os
import shlex
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from megalysses.data.indexed import (DatasetError, IndexedDatasetBuilder, bin_path, idx_path, merge_datasets,
                                     optimal_dtype)
from megalysses.data.chat_template import TemplateError
from megalysses.data.columnar import chat_columns, check_columns, read_records
from megalysses.data.progress import Progress
from megalysses.data.text_input import InputError, Position, check_jsonl, corpus_inputs, read_file, read_lines
from megalysses.data.tokenizer import ByteTokenizer, SpecialTokens, TokenizerError, build_tokenizer
from megalysses.data.tokenizer_identity import sidecar_path, tokenizer_identity, write_identity
from megalysses.tools import preprocess_chat

BATCH_BYTES = 1 << 20
BATCH_DOCS = 1024
_STATE: dict[str, Any] = {}
_USER_ERRORS = (InputError, TokenizerError, DatasetError, TemplateError, OSError)
# Megatron-LM flags that cannot be honoured here, with the reason
_REFUSED = {
    "--split-sentences": "NLTK sentence splitting (for BERT-style data) is not supported: GPT pretraining reads "
                         "whole documents; drop the flag, or give each document as a JSON list of sentences",
    "--find-optimal-num-workers": "worker-count search is not supported: pass --workers N",
    "--workers-to-check": "worker-count search is not supported: pass --workers N",
    "--max-documents": "worker-count search is not supported: pass --workers N",
    "--tokenizer-hf-no-use-fast": "only the fast (tokenizers) Hugging Face tokenizers are supported",
    "--trust-remote-code": "tokenizers that need remote Python code are not supported: use their tokenizer.json",
    "--tokenizer-sentencepiece-legacy": "legacy sentencepiece special-token handling is not supported",
    "--tokenizer-special-tokens": "adding special tokens at preprocessing is not supported: train them into the "
                                  "tokenizer (tools/train_tokenizer.py --special-tokens)",
    "--tokenizer-metadata": "tokenizer metadata files are not supported: pass --tokenizer-type and the model files",
}


def _tokenizer(t: dict[str, Any]) -> Any:
    return build_tokenizer(t["type"], t["model"], vocab_file=t["vocab_file"], merge_file=t["merge_file"],
                           vocab_size=t["vocab_size"], special=SpecialTokens(t["eod"], t["bos"]),
                           add_special_tokens=t["special"], need_eod=t["append_eod"] or t["chat"] is not None)


def _init_worker(tok_args: dict[str, Any], keys: list[str], folder: bool, parallel: bool) -> None:
    if parallel:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one tokenizer thread per worker process
        signal.signal(signal.SIGTERM, signal.SIG_DFL)     # a pool worker just ends; the main process reports
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    tok = _tokenizer(tok_args)
    _STATE.clear()                                        # an earlier run in this process leaves nothing behind
    _STATE.update(tok=tok, keys=keys, folder=folder, dtype=optimal_dtype(tok.vocab_size),
                  eod=[tok.eod_id] if tok_args["append_eod"] else [], bos=[tok.bos_id] if tok_args["bos"] else [],
                  parse_special=tok_args["parse_special"])
    if tok_args["chat"] is not None:
        _STATE["chat"] = preprocess_chat.encoder({**tok_args["chat"], "bos": tok_args["bos"]}, tok)


def _parse(raw: bytes | dict, keys: list[str], folder: bool) -> tuple[Optional[list[list[str]]], str]:
    """Per key the texts (sentences) of one document, or (None, why it is malformed). `raw` is a JSON
    line, a whole text file (folder) or the record of a Parquet / Arrow row."""
    try:
        if isinstance(raw, dict):
            doc = raw
        elif folder:
            return [[raw.decode("utf-8")]], ""
        elif not raw.strip():
            return None, "blank line"
        else:
            doc = json.loads(raw)
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except json.JSONDecodeError:
        return None, "bad JSON"
    if not isinstance(doc, dict):
        return None, "not a JSON object"
    texts = []
    for key in keys:
        if key not in doc:
            return None, f"missing key '{key}'"
        value = doc[key]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            texts.append(value)
        elif isinstance(value, str):
            texts.append([value])
        else:
            return None, f"non-string '{key}'"
    return texts, ""


def _size(doc: bytes | dict) -> int:
    """A document's size for batching and MB/s: its bytes, or a record's characters of text."""
    if isinstance(doc, bytes):
        return len(doc)
    texts = [t for v in doc.values() for t in (v if isinstance(v, list) else [v])]
    return sum(len(t) for t in texts if isinstance(t, str))


def _encode(texts: list[str]) -> list[np.ndarray]:
    tok = _STATE["tok"]
    if isinstance(tok, ByteTokenizer):
        return [np.frombuffer(tok.encode_bytes(t), np.uint8) for t in texts]
    return [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(texts, parse_special=_STATE["parse_special"])]


def _spelling(parsed: list[list[list[str]]], ordinals: list[int]) -> tuple[int, Optional[str]]:
    """(documents whose text, under any key, spells a special token of the tokenizer; the first as
    'document N'), for the summary."""
    tok = _STATE["tok"]
    if not tok.special_tokens:
        return 0, None
    spelled = [d for d, doc in enumerate(parsed) if any(tok.spells_special(t) for texts in doc for t in texts)]
    return len(spelled), f"document {ordinals[spelled[0]] + 1}" if spelled else None


def encode_batch(batch: tuple[int, list[bytes | dict], int]) -> dict[str, Any]:
    """Tokenize one batch of raw documents. Per key: the concatenated tokens, the sequence lengths and
    the sequences of each document (0 for an empty one); plus the input ordinal of each kept document."""
    if "chat" in _STATE:
        return preprocess_chat.encode_chat_batch(_STATE, batch, _size)
    first, items, position = batch
    keys, dtype, eod, bos = _STATE["keys"], _STATE["dtype"], _STATE["eod"], _STATE["bos"]
    parsed, ordinals = [], []
    skipped: collections.Counter = collections.Counter()
    examples, seen_keys = [], set()
    for i, raw in enumerate(items):
        texts, reason = _parse(raw, keys, _STATE["folder"])
        if texts is None:
            skipped[reason] += 1
            examples.append(f"{first + i + 1}: {reason}")
            if reason.startswith("missing key") and len(seen_keys) < 20:
                seen_keys.update(json.loads(raw))
            continue
        parsed.append(texts)
        ordinals.append(first + i)
    out: dict[str, Any] = {"skipped": skipped, "examples": examples[:5], "bytes": sum(map(_size, items)),
                           "position": position, "ordinals": np.asarray(ordinals, dtype=np.int64),
                           "seen_keys": sorted(seen_keys), "empty": 0, "empty_example": None}
    out["spelled"], out["spelled_example"] = _spelling(parsed, ordinals)
    for k, key in enumerate(keys):
        encoded = _encode([s for doc in parsed for s in doc[k]])
        bos_arr, eod_arr = np.asarray(bos, dtype=dtype), np.asarray(eod, dtype=dtype)
        pieces: list[np.ndarray] = []
        lengths: list[int] = []
        per_doc = np.zeros(len(parsed), dtype=np.int64)
        i = 0
        for d, doc in enumerate(parsed):
            first = len(lengths)
            for x in encoded[i:i + len(doc[k])]:
                if len(x):
                    pieces.append(x)
                    lengths.append(len(x))
            i += len(doc[k])
            per_doc[d] = len(lengths) - first
            if not per_doc[d]:
                if k == 0:
                    out["empty"] += 1
                    out["empty_example"] = out["empty_example"] or f"{ordinals[d] + 1}"
                continue
            if bos:   # before the document's first sequence, as its first token
                pieces.insert(len(pieces) - per_doc[d], bos_arr)
                lengths[first] += len(bos)
            if eod:
                pieces.append(eod_arr)
                lengths[-1] += len(eod)
        tokens = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)
        out[key] = (tokens, np.asarray(lengths, dtype=np.int32), per_doc)
    return out


class _Reader:
    """Batches of raw documents (jsonl lines, Parquet / Arrow records, or whole files of a text folder) with
    their input ordinals."""

    def __init__(self, spec: str, keys: list[str], chat: bool = False) -> None:
        self.inputs, self.folder = corpus_inputs(spec)
        self.keys = keys
        self.columns: dict[str, list[str]] = {}
        for path, kind in self.inputs:
            if kind == "jsonl":
                check_jsonl(path)
            elif kind == "text" and chat:
                raise InputError(f"{path}: --chat reads conversations from JSON Lines, Parquet or Arrow, not text "
                                 f"files")
            elif kind != "text":
                self.columns[path] = chat_columns(path, kind) if chat else keys
                if not chat:
                    check_columns(path, kind, keys)
        self.total = sum(os.path.getsize(f) for f, _ in self.inputs)
        self.position = Position()

    def documents(self) -> Iterator[bytes | dict]:
        for path, kind in self.inputs:
            if kind == "text":
                yield read_file(path, self.position)
            elif kind == "jsonl":
                yield from read_lines(path, self.position)
            else:
                yield from read_records(path, kind, self.columns[path], self.position)

    def batches(self) -> Iterator[tuple[int, list[bytes | dict], int]]:
        """(ordinal of the first document, raw documents, input position after them)."""
        batch: list[bytes | dict] = []
        size, ordinal = 0, 0
        for doc in self.documents():
            batch.append(doc)
            size += _size(doc)
            if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
                yield ordinal, batch, self.position.done
                ordinal += len(batch)
                batch, size = [], 0
        if batch:
            yield ordinal, batch, self.position.done


def _ordered_results(reader: _Reader, workers: int, init_args: tuple) -> Iterator[dict[str, Any]]:
    """encode_batch over the reader's batches, in order; at most 4 batches per worker in flight."""
    if workers <= 1:
        _init_worker(*init_args)
        for batch in reader.batches():
            yield encode_batch(batch)
        return
    # forkserver: workers fork from a clean server process, never from this one, whose reader and tokenizer
    # threads (Arrow's pool, HF tokenizers' rayon) a fork would copy mid-lock
    with mp.get_context("forkserver").Pool(workers, _init_worker, init_args) as pool:
        in_flight: collections.deque = collections.deque()
        for batch in reader.batches():
            in_flight.append(pool.apply_async(encode_batch, (batch,)))
            if len(in_flight) >= 4 * workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="a .jsonl file (plain, .gz, .bz2, .xz, .zst), a Parquet or Arrow "
                                                  "file, a glob of them, a `datasets` folder, or a folder of them or "
                                                  "of text files (one document per file)")
    p.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl keys or Parquet / Arrow columns to "
                                                                      "tokenize (default: text)")
    p.add_argument("--append-eod", action="store_true", help="append the EOD token to every non-empty document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (output is identical for any)")
    p.add_argument("--partitions", type=int, default=1, help="Megatron-LM's input partitions (output order only)")
    p.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions: consecutive blocks of documents per partition, not round-robin")
    p.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines (0 = every batch)")
    p.add_argument("--keep-newlines", action="store_true", help="Megatron-LM: only acts with --split-sentences")
    p.add_argument("--lang", default="english", help="Megatron-LM: only acts with --split-sentences")
    p.add_argument("--dataset-impl", choices=["mmap"], default="mmap",
                   help="older Megatron-LM: the indexed format, of which only mmap (this one) is written")
    t = p.add_argument_group("tokenizer")
    t.add_argument("--tokenizer-type", default=None,
                   help="byte (the default), sentencepiece, huggingface, gpt2bpe, null, or a Megatron-LM name")
    t.add_argument("--tokenizer-model", default=None, help="sentencepiece .model, or a tokenizer.json or its folder")
    t.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    t.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    t.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: the vocabulary size")
    t.add_argument("--null-tokenizer-eod-id", type=int, default=None, help="NullTokenizer: EOD id (default vocab-1)")
    t.add_argument("--null-tokenizer-pad-id", type=int, default=None, help="NullTokenizer: unused in preprocessing")
    t.add_argument("--vocab-extra-ids", type=int, default=0, help="Megatron-LM T5 sentinels: only 0 is supported")
    t.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                   help="Hugging Face: do not add the post-processor's special tokens (e.g. BOS)")
    t.add_argument("--parse-special-tokens", action="store_true",
                   help="special tokens spelled in the text become the tokens, as Hugging Face tokenizers do "
                        "(Megatron-LM's HuggingFaceTokenizer); default: tokenized as text, as Megatron-LM's "
                        "GPT2BPETokenizer and sentencepiece tokenizers do")
    t.add_argument("--eod", default=None, help="the EOD token or id (default: the tokenizer's EOS)")
    t.add_argument("--bos", default=None, help="a BOS token or id to start every non-empty document with "
                                               "(default: only what the tokenizer adds)")
    preprocess_chat.add_arguments(p)
    for flag in _REFUSED:
        p.add_argument(flag, nargs="*", default=None, help=argparse.SUPPRESS)
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in _REFUSED:
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            p.error(f"{flag}: {_REFUSED[flag]}")
    if args.workers < 1:
        p.error(f"--workers {args.workers}: give at least 1 worker process")
    if args.partitions < 1:
        p.error(f"--partitions {args.partitions}: give at least 1 partition")
    if args.log_interval < 0:
        p.error(f"--log-interval {args.log_interval}: give a number of documents >= 0")
    if args.vocab_extra_ids:
        p.error(f"--vocab-extra-ids {args.vocab_extra_ids}: T5 sentinel tokens are not supported; use 0")
    preprocess_chat.check_arguments(p, args)
    check_output_prefix(p, args.output_prefix)


def check_output_prefix(p: argparse.ArgumentParser, prefix: str) -> None:
    """--output-prefix names files in a directory that exists or can be created."""
    if not prefix or os.path.isdir(prefix) or prefix.endswith(os.sep):
        p.error(f"--output-prefix {prefix!r} is a directory: give a path prefix inside it, e.g. "
                f"{os.path.join(prefix or '.', 'corpus')}")
    parent = Path(prefix).parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        p.error(f"--output-prefix {prefix}: {parent} is a file, not a directory")


def _empty_message(args: argparse.Namespace, key: str, docs: int, skipped: collections.Counter,
                   examples: list[str], seen_keys: set) -> str:
    where = args.input
    if not docs and skipped:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items()))
        hint = ""
        if any(r.startswith("missing key") for r in skipped) and seen_keys:
            hint = f"; the documents' keys are {', '.join(sorted(seen_keys)[:10])}: pass one with --json-keys"
        elif "not UTF-8" in skipped:
            hint = "; convert the input to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        elif any(r.startswith("non-string") for r in skipped):
            hint = "; the values must be strings (or lists of strings)"
        return f"no tokens written: every document of {where} was skipped ({reasons}; first: {examples[0]}){hint}"
    if not docs:
        return f"no tokens written: {where} holds no documents"
    return (f"no tokens written for '{key}': all {docs} documents of {where} are empty after tokenization "
            f"under that key: check --json-keys and the text")


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = _parser()
    args = p.parse_args(argv)
    args.tokenizer_type_given = args.tokenizer_type is not None
    args.tokenizer_type = args.tokenizer_type or "byte"
    _check_args(p, args)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        return _run(args)
    except _USER_ERRORS as e:
        raise SystemExit(f"error: {e}") from None
    except (Stopped, KeyboardInterrupt) as e:
        raise SystemExit(f"error: {str(e) or 'interrupted'}: nothing was written (no temporary file is left; the "
                         f"outputs of an earlier run, if any, are as they were)") from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Stopped(Exception):
    """SIGTERM: raised in the main process, so that the run's temporary files are removed on the way out."""


def raise_stopped(signum: int, frame: object) -> None:
    raise Stopped("stopped by SIGTERM")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    reader = _Reader(args.input, args.json_keys, chat=args.chat)
    if reader.folder and len(args.json_keys) != 1:
        raise InputError("a folder input gives one text per file: pass a single --json-keys name")
    chat = {"template": args.chat_template, "train_on": args.chat_train_on,
            "end_of_turn": args.chat_end_of_turn} if args.chat else None
    tok_args = {"type": args.tokenizer_type, "model": args.tokenizer_model, "vocab_file": args.vocab_file,
                "merge_file": args.merge_file, "vocab_size": args.vocab_size, "append_eod": args.append_eod,
                "eod": args.eod if args.eod is not None else args.null_tokenizer_eod_id, "bos": args.bos,
                "special": not args.tokenizer_hf_no_include_special_tokens, "chat": chat,
                "parse_special": args.parse_special_tokens}
    tokenizer = _tokenizer(tok_args)
    if chat is not None:      # a template that cannot be read or compiled fails here, before any work
        preprocess_chat.encoder({**chat, "bos": args.bos}, tokenizer)
    dtype = optimal_dtype(tokenizer.vocab_size)
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    finals = (preprocess_chat.outputs(args.output_prefix) if args.chat else
              {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys})
    tag = f".tmp-{os.getpid()}"
    parts = args.partitions
    block = None
    if parts > 1 and args.keep_sequential_samples:
        block = max(1, math.ceil(sum(1 for _ in reader.documents()) / parts))
        reader.position = Position()
    temp = {k: f"{f}{tag}" for k, f in finals.items()}      # every temporary file starts with this
    parts_of = {(k, q): f"{temp[k]}.part{q}" for k in finals for q in range(parts)}
    builders = {kq: IndexedDatasetBuilder(bin_path(prefix), np.uint8 if kq[0] == "loss_mask" else dtype)
                for kq, prefix in parts_of.items()}
    tally = _Tally(dict.fromkeys(args.json_keys, 0))
    progress = Progress(reader.total)
    next_log = args.log_interval
    init_args = (tok_args, args.json_keys, reader.folder, args.workers > 1)
    try:
        for result in _ordered_results(reader, args.workers, init_args):
            _write(result, builders, finals, tally.tokens, parts, block)
            tally.add(result, args.chat)
            if tally.docs >= next_log:
                progress.report(tally.docs, tally.nbytes, result["position"], sum(tally.tokens.values()))
                next_log = tally.docs + args.log_interval
        for key, count in tally.tokens.items():
            if count == 0:
                raise InputError(_empty_message(args, key, tally.docs, tally.skipped, tally.examples, tally.seen_keys))
        for kq, builder in builders.items():
            builder.finalize(idx_path(parts_of[kq]))
        identity = tokenizer_identity(tokenizer)
        for key, final in finals.items():
            source = parts_of[key, 0]
            if parts > 1:   # Megatron-LM merges its partitions' outputs in partition order
                source = temp[key]
                merge_datasets([parts_of[key, q] for q in range(parts)], source)
            for old in (idx_path(final), sidecar_path(final)):   # an earlier dataset's identity goes before it
                if os.path.exists(old):
                    os.remove(old)
            os.replace(bin_path(source), bin_path(final))
            os.replace(idx_path(source), idx_path(final))
            if key != "loss_mask":
                write_identity(final, identity)
    finally:
        for builder in builders.values():
            builder.close()
        for prefix in temp.values():
            for leftover in glob.glob(glob.escape(prefix) + "*"):
                os.remove(leftover)
    progress.report(tally.docs, tally.nbytes, reader.position.done, sum(tally.tokens.values()), final=True)
    summary = {"documents": tally.docs, "tokens": sum(tally.tokens.values()), "bytes": tally.nbytes,
               "skipped": dict(tally.skipped), "empty": tally.empty, "loss_tokens": tally.loss_tokens,
               "special_spelled": tally.spelled, "seconds": progress.elapsed, "outputs": list(finals.values())}
    _report(args, tokenizer, finals, summary, tally.examples, tally.empty_example, tally.spelled_example)
    return summary


def _write(result: dict[str, Any], builders: dict, finals: dict[str, str], tokens: dict[str, int], parts: int,
           block: Optional[int]) -> None:
    """A batch of results into the builders: every document into its partition's (the one of its ordinal, or
    of its block of consecutive documents with --keep-sequential-samples), counting each text key's tokens."""
    part = (result["ordinals"] // block if block else result["ordinals"] % parts) if parts > 1 else None
    for key in finals:
        toks, lengths, per_doc = result[key]
        if key in tokens:
            tokens[key] += len(toks)
        if part is None:
            builders[key, 0].add_documents(toks, lengths, per_doc)
            continue
        for q in range(parts):
            mine = part == q
            seq_mine = np.repeat(mine, per_doc)
            builders[key, q].add_documents(toks[np.repeat(seq_mine, lengths)], lengths[seq_mine], per_doc[mine])


@dataclass
class _Tally:
    """What the run has met so far: tokens per key, documents, bytes, skipped and empty records, examples."""

    tokens: dict[str, int]
    docs: int = 0
    nbytes: int = 0
    empty: int = 0
    loss_tokens: int = 0
    spelled: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    examples: list[str] = field(default_factory=list)
    empty_example: Optional[str] = None
    spelled_example: Optional[str] = None
    seen_keys: set = field(default_factory=set)

    def add(self, result: dict[str, Any], chat: bool) -> None:
        self.docs += len(result["ordinals"])
        self.nbytes += result["bytes"]
        self.empty += result["empty"]
        self.empty_example = self.empty_example or result["empty_example"]
        self.spelled += result.get("spelled", 0)
        self.spelled_example = self.spelled_example or result.get("spelled_example")
        self.skipped.update(result["skipped"])
        self.loss_tokens += result.get("loss_tokens", 0)
        if chat:     # a bad record is named as it is met (the first SHOWN of them)
            for line in result["examples"][:max(0, preprocess_chat.SHOWN - len(self.examples))]:
                print(f"skipped {line}", file=sys.stderr)
        self.seen_keys.update(result["seen_keys"])
        self.examples += result["examples"][:(preprocess_chat.SHOWN if chat else 5) - len(self.examples)]


def _report(args: argparse.Namespace, tokenizer: Any, finals: dict[str, str], summary: dict[str, Any],
            examples: list[str], empty_example: Optional[str], spelled_example: Optional[str]) -> None:
    """What was skipped and written, and the settings of a run that trains on it (stderr)."""
    skipped, docs = summary["skipped"], summary["documents"]
    if skipped:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
        count = sum(skipped.values())
        named = "each named above" if count <= len(examples) else f"the first {len(examples)} named above"
        print(f"skipped {count} records ({reasons}; {named}), kept the other {docs}" if args.chat else
              f"skipped {count} malformed documents ({reasons}); first: {'; '.join(examples)}", file=sys.stderr)
    if args.chat:
        total, loss = summary["tokens"], summary["loss_tokens"]
        print(f"{docs} conversations, {total} tokens, {loss} of them ({100 * loss / max(total, 1):.1f}%) carry the "
              f"loss", file=sys.stderr)
    if summary["empty"]:
        print(f"warning: {summary['empty']} documents are empty after tokenization (first: document {empty_example}); "
              f"they are written as Megatron-LM writes them, a document boundary with no tokens and no EOD",
              file=sys.stderr)
    if summary["special_spelled"]:
        print(_spelled_message(summary["special_spelled"], spelled_example, args), file=sys.stderr)
    for key, final in finals.items():
        identity = "" if key == "loss_mask" else f" (and the tokenizer that wrote them in {sidecar_path(final)})"
        print(f"wrote {bin_path(final)} and {idx_path(final)}{identity}", file=sys.stderr)
    # the .bin/.idx do not name their tokenizer (Megatron-LM's format): the settings of a run that uses it
    default = "" if args.tokenizer_type_given else " (the default: pass --tokenizer-type for another)"
    print(f"tokenized with {args.tokenizer_type}{default}: {tokenizer.vocab_size} ids, EOD {tokenizer.eod_id}; "
          f"train with pretrain.py {' '.join(shlex.quote(a) for a in _training_settings(args, tokenizer, finals))} "
          f"(model.vocab_size may be larger)", file=sys.stderr)


def _spelled_message(spelled: int, first: str, args: argparse.Namespace) -> str:
    """The summary of the documents whose text spells a special token."""
    what = f"{spelled} documents spell a special token of the tokenizer in their text (first: {first})"
    if args.parse_special_tokens:
        return f"{what}: written as the special tokens (--parse-special-tokens)"
    return (f"{what}: tokenized as text, as Megatron-LM's GPT2BPETokenizer and sentencepiece tokenizers do; "
            f"--parse-special-tokens writes them as the tokens, as Hugging Face tokenizers (and Megatron-LM's "
            f"HuggingFaceTokenizer) do")


def _training_settings(args: argparse.Namespace, tokenizer: Any, finals: dict[str, str]) -> list[str]:
    """The --set arguments of a run that trains on what was written, with the tokenizer that wrote it."""
    paths = [prefix for key, prefix in finals.items() if key != "loss_mask"]     # the loss mask is found beside
    data = {"paths": f"[{','.join(paths)}]", "tokenizer": args.tokenizer_type,
            "tokenizer_model": args.tokenizer_model, "vocab_file": args.vocab_file, "merge_file": args.merge_file,
            "eod": args.eod if args.eod is not None else args.null_tokenizer_eod_id, "bos": args.bos}
    sets = [f"data.{key}={value}" for key, value in data.items() if value is not None]
    sets.append(f"model.vocab_size={tokenizer.vocab_size}")
    return [a for s in sets for a in ("--set", s)]


def cli() -> int:
    """Console entry point: exit status 0 once main() has written its output."""
    main()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
